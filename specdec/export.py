"""
Export trained Medusa heads or an EAGLE-3 layer for serving: vLLM's Medusa checkpoint layout, a
folder with config.json (model_type "medusa") and model.safetensors, or the EAGLE-3 layout vLLM and
SGLang load (LlamaForCausalLMEagle3, below); and, with --base-out, the base model as a folder vLLM
serves.

vLLM (vllm/model_executor/models/medusa.py) builds per head num_hidden_layers residual blocks
x = x + SiLU(W x + b) and an LM head, on the target model's final (post-norm) hidden state: the
math of heads.MedusaHeads, so the export renames tensors and writes the config:

    ours (heads.safetensors, the base model)      vLLM
    blocks.{k}.{l}.linear.weight / .bias          blocks.{k}.layers.{l}.weight / .bias,
                                                  medusa_fc_bias
    own_lm_head false: the base LM head           lm_head.weight (V, D), original_lm_head: shared
    own_lm_head true: lm_head.weight[k]           lm_heads.{k}.weight (V, D)

Always the full vocabulary. Heads that keep V' < V tokens (kept_ids) have their V' rows put back
among the base LM head's V rows: vLLM 0.32 refuses its own reduced form (a token_map tensor with
truncated_vocab_size V'), as Medusa.load_weights makes token_map a parameter without reporting it
loaded, so the loader stops on "weights were not initialized from checkpoint: {'token_map'}"; and
its own_lm_head heads are V rows whatever truncated_vocab_size says. What that changes: vLLM's
heads score every token, where ours score the kept ones, so a head's top-1 can be a token ours
never draft (its logit from the base LM head's row); the kept tokens' logits are ours. Greedy
output is the base model's either way; acceptance, measured on the shipped heads, is unchanged
(results/vllm-cpu.md). vLLM's reduced form would need, in Medusa.load_weights, "token_map" added
to the names it returns (or token_map registered in __init__); its own_lm_head heads, V' rows.

Hydra and Hydra++ heads read the drafted tokens (Hydra++ also a prefix layer), and joint heads
(joint.py) need their adapted base model: vLLM's layout holds neither, so they are refused.

An EAGLE-3 layer (specdec/eagle3.py, train.py --heads eagle3) goes out as vLLM 0.32's
llama_eagle3.py reads it (Eagle3LlamaForCausalLM.load_weights: every name but lm_head under
"model.", "midlayer." for "layers.0.", q/k/v and gate/up stacked into one product each, d2t into
draft_id_to_target_id, t2d skipped; SGLang reads t2d), the names ours already have:

    ours (heads.safetensors)                      EAGLE-3's model.safetensors
    fc.weight (D, F*D), midlayer.*, norm.weight   the same names and shapes
    lm_head.weight (V', D)                        lm_head.weight, draft_vocab_size V'
    kept_ids (V',)                                d2t (V',) int64: target id = draft id + d2t[id];
                                                  t2d (V,) bool: the kept tokens
    the base's embed_tokens (a shared buffer)     not written: vLLM then shares the target's

config.json names LlamaForCausalLMEagle3, one layer of the base model's dims and rope, the draft
vocabulary, and eagle_config's eagle_aux_hidden_state_layer_ids only where the fused layers are not
the engines' default, the inputs of layers (2, L // 2, L - 3) (the default model's 2, 15, 27): in
the ids they are written as vLLM reads them (id l: the input of layer l), while SGLang reads an id
l as layer l's output (it adds one), so such a layer serves in SGLang with its ids lowered by one.
t2d is SGLang's alone (vLLM skips it). vLLM's load_weights checks no name: tests/test_eagle3.py
checks that every parameter its model creates is written.

    python -m specdec.export --heads medusa --out medusa-vllm --base-out smollm2-vllm
    python -m specdec.export --heads eagle3 --out eagle3-vllm --dtype bf16
    python -m vllm.entrypoints.openai.api_server --model smollm2-vllm --speculative-config \
        '{"method": "medusa", "model": "medusa-vllm", "num_speculative_tokens": 3}'

--base-out copies the base model's folder (for the default model, the one checkpoint.resolve
converts into ~/.cache/specdec) and names its architecture in config.json, which vLLM needs and
the GGUF conversion leaves empty. Tests: `python -m pytest -q tests/test_export.py`; in vLLM
itself, tests/test_vllm.py (README, "Serve with vLLM").
Shapes: D hidden, K heads, V vocabulary, V' the heads' kept tokens.
"""

import specdec.ctrl_c  # noqa: F401 (first: a Ctrl-C while torch imports is one line, exit 130)
import json
import os
import shlex
import shutil

import torch

from specdec.loading import catalog
from specdec.loading import checkpoint
from specdec import cli
from specdec import eagle3 as eagle3_lib
from heads import HeadsError
from model import lm_head_fingerprint

WEIGHTS, CONFIG = "model.safetensors", "config.json"


# --- the layout ----------------------------------------------------------------------------------
# Pure: loaded heads in, vLLM's config and tensors out.


def full_rows(heads, base_rows):
    """The heads' LM head over the whole vocabulary: (V, D) shared, (K, V, D) own. Kept rows go back
    to their token ids; the others are the base LM head's rows `base_rows` (V, D)."""
    rows, kept = heads.lm_head.weight.detach(), heads.kept_ids  # (V', D) | (K, V', D)
    if kept is None:
        return rows
    full = base_rows.expand(*rows.shape[:-2], *base_rows.shape).clone()  # (V, D) | (K, V, D)
    full[..., kept, :] = rows
    return full


def vllm_medusa(heads, base_rows, dtype=torch.float16):
    """(config.json as a dict, {name: tensor}) of Medusa heads (heads.MedusaHeads) in vLLM's
    layout, over the full vocabulary; `base_rows` (V, D) is the base model's LM head."""
    cfg = heads.cfg
    rows = full_rows(heads, base_rows)  # (V, D) | (K, V, D)
    assert rows.shape[-2:] == (cfg.vocab_size, cfg.dim), tuple(rows.shape)
    tensors = {}
    for k, blocks in enumerate(heads.blocks):  # head k: num_layers ResBlocks
        for l, block in enumerate(blocks):
            tensors[f"blocks.{k}.layers.{l}.weight"] = block.linear.weight  # (D, D)
            tensors[f"blocks.{k}.layers.{l}.bias"] = block.linear.bias  # (D,)
    if cfg.own_lm_head:
        tensors |= {f"lm_heads.{k}.weight": rows[k] for k in range(cfg.num_heads)}  # (V, D) each
    else:
        tensors["lm_head.weight"] = rows  # (V, D), one for every head
    tensors = {n: w.detach().to(dtype).contiguous() for n, w in tensors.items()}
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": cfg.dim,
        "vocab_size": cfg.vocab_size,
        "num_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers,
        "medusa_fc_bias": True,
        "original_lm_head": not cfg.own_lm_head,
        "truncated_vocab_size": cfg.vocab_size,
    }
    return config, tensors


def vllm_eagle3(module, base_layers, dtype=torch.float16):
    """(config.json as a dict, {name: tensor}) of an EAGLE-3 layer (eagle3.Eagle3, for a base model
    of `base_layers` layers) in the layout vLLM's and SGLang's LlamaForCausalLMEagle3 load."""
    cfg, c = module.cfg, module.draft_cfg
    state = module.state_dict()
    kept = state.pop("kept_ids", None)
    tensors = {n: w.detach().to(dtype).contiguous() for n, w in state.items()}
    if kept is not None:  # draft id i is target id i + d2t[i]
        kept = kept.cpu()
        tensors["d2t"] = kept - torch.arange(len(kept))  # (V',) int64
        tensors["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)  # (V,)
        tensors["t2d"][kept] = True
    rope = {"rope_type": "default"} | c.rope_scaling
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.dim,
        "intermediate_size": c.hidden_dim,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None if rope["rope_type"] == "default" else rope,
        "max_position_embeddings": c.max_seq_len,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": len(kept) if kept is not None else cfg.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if tuple(cfg.layers) != (2, base_layers // 2, base_layers - 3):  # not the engines' default
        ids = {"eagle_aux_hidden_state_layer_ids": list(cfg.layers), "use_aux_hidden_state": True}
        config["eagle_config"] = ids
    return config, tensors


def read_eagle3(folder, base):
    """An EAGLE-3 folder vllm_eagle3 wrote (or one in its layout trained elsewhere for `base`) as
    our eagle3.Eagle3 in the base's dtype: the way back, by the same names."""
    from safetensors.torch import load_file

    with open(os.path.join(folder, CONFIG)) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(folder, WEIGHTS))
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)
    kept = None if d2t is None else torch.arange(len(d2t)) + d2t
    L = base.cfg.n_layers
    layers = (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids", [2, L // 2, L - 3]
    )
    module = eagle3_lib.build(base, kept, layers=layers)
    module.load_state_dict(tensors | ({} if kept is None else {"kept_ids": kept}))
    return module


def served_config(config):
    """The base model's config.json as vLLM reads it: `architectures` named from `model_type`
    where it is missing or empty (the GGUF conversion writes null), else as it is."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not config.get("architectures"):
        config = config | {
            "architectures": [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
        }
    return config


# --- the command line ----------------------------------------------------------------------------
# Every refusal comes before the model loads; nothing of the user's is overwritten.


def build_parser():
    p = cli.Parser(description=__doc__.split("\n\n")[0].strip())
    # what to export
    p.add_argument(
        "--model",
        default=checkpoint.DEFAULT,
        help="the base model the heads were trained on: 'default' "
        "(embedded SmolLM2-135M-Instruct), a local HF folder or a hub id; its LM head's rows are "
        "exported",
    )
    p.add_argument(
        "--heads",
        default="medusa",
        help="medusa or eagle3 (shipped for the default model), or a folder of Medusa heads or "
        "of an EAGLE-3 layer that train.py wrote",
    )
    # where to
    p.add_argument(
        "--to",
        default="vllm",
        choices=["vllm"],
        help="the serving layout: vllm (its Medusa checkpoint; an EAGLE-3 layer's is SGLang's too)",
    )
    p.add_argument(
        "--out", required=True, help="a new or empty folder for config.json and model.safetensors"
    )
    p.add_argument(
        "--base-out",
        help="also a new or empty folder for the base model as vLLM serves it (its weights, "
        "tokenizer and config.json, the architecture named); vLLM cannot read the default GGUF",
    )
    p.add_argument(
        "--dtype",
        default="fp16",
        choices=list(cli.DTYPES),
        help="dtype of the exported weights (vLLM casts them to the served model's dtype)",
    )
    return p


def refusal(folder):
    """Why heads in `folder` cannot go to vLLM's Medusa layout, or None; reads heads.json only."""
    cfg = checkpoint.read_config(os.path.join(folder, checkpoint.HEADS_CONFIG))
    if cfg.kind != "medusa":
        return (
            f"{cfg.kind} heads read the tokens drafted before "
            f"them{' and a prefix layer' * (cfg.kind == 'hydra++')}, "
            "which vLLM's Medusa layout cannot hold; export Medusa heads (train.py --heads medusa)"
        )
    if checkpoint.has_delta(folder):
        return (
            "these heads were trained with a LoRA delta on the base model (joint.py), which "
            "vLLM's Medusa "
            "layout cannot carry; export heads trained on the frozen model (train.py --heads "
            "medusa)"
        )
    return None


def default_fingerprint():
    """The embedded default model's LM-head fingerprint, as the shipped heads (trained on it) record
    it, or None where none are shipped; found without loading the model."""
    try:
        shipped = os.path.join(catalog.SHIPPED, "medusa", checkpoint.HEADS_CONFIG)
        return checkpoint.read_config(shipped).base_fingerprint
    except HeadsError:
        return None


def other_model(heads_cfg, args, fingerprint):
    """The refusal of heads trained for a base model other than --model's (LM-head `fingerprint`),
    naming the one their heads.json records as --model would take it; None if they match."""
    if heads_cfg.base_fingerprint == fingerprint:
        return None
    is_default = heads_cfg.base_fingerprint == default_fingerprint()
    flag = checkpoint.DEFAULT if is_default else shlex.quote(heads_cfg.base_name)
    return cli.UsageError(
        f"--heads {args.heads}: trained for {heads_cfg.base_name} (their "
        f"{checkpoint.HEADS_CONFIG}), not for --model {args.model}; "
        f"pass --model {flag}"
    )


def heads_folder(name):
    """--heads -> the folder of heads to export, checked to hold heads (heads.json and their
    weights, a readable heads.json); reads heads.json only."""
    folder = catalog.find_heads(name)
    if folder is None:
        raise cli.UsageError(
            f"--heads {name}: no heads to export; give medusa, eagle3 or a folder of Medusa heads"
        )
    if eagle3_lib.is_eagle3(folder):
        try:
            eagle3_lib.read_config(os.path.join(folder, checkpoint.HEADS_CONFIG))
        except HeadsError as e:
            raise cli.UsageError(f"--heads {name}: {e}") from None
        return folder
    catalog.check_heads_in(folder, f"--heads {name}")
    return folder


def copy_base(src, out):
    """The base model's folder `src` into `out`: every file but the conversion's manifest, and
    config.json as vLLM reads it (served_config)."""
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if name == CONFIG:
            with open(path) as f:
                config = served_config(json.load(f))
            with open(os.path.join(out, CONFIG), "w") as f:
                json.dump(config, f, indent=1)
        elif name != "manifest.json" and os.path.isfile(path):
            shutil.copyfile(path, os.path.join(out, name))


def main(args):
    folder = heads_folder(args.heads)
    eagle3 = eagle3_lib.is_eagle3(folder)
    if not eagle3 and (why := refusal(folder)):
        raise cli.UsageError(f"--heads {args.heads}: {why}")
    for flag, path in (("--out", args.out), ("--base-out", args.base_out)):
        if path and os.path.isdir(path) and os.listdir(path):
            raise cli.UsageError(
                f"{flag} {path}: not empty; give a new or empty folder (nothing is overwritten)"
            )
    if args.base_out and os.path.abspath(args.base_out) == os.path.abspath(args.out):
        raise cli.UsageError(f"--base-out {args.base_out}: the same as --out; give another folder")
    read = eagle3_lib.read_config if eagle3 else checkpoint.read_config
    heads_cfg = read(os.path.join(folder, checkpoint.HEADS_CONFIG))
    if args.model == checkpoint.DEFAULT and default_fingerprint() is not None:  # known, not loaded
        if error := other_model(heads_cfg, args, default_fingerprint()):
            raise error
    made = cli.new_folders(args.out, args.base_out)
    cli.writable_folder("--out", args.out)  # made now: an unwritable place is found before the work
    if args.base_out:
        cli.writable_folder("--base-out", args.base_out)
    try:
        model, _ = checkpoint.load(args.model, "cpu", torch.float32)
        if error := other_model(heads_cfg, args, lm_head_fingerprint(model)):
            raise error
        dtype = cli.DTYPES[args.dtype]
        if eagle3:
            heads = eagle3_lib.load(folder, model)
            config, tensors = vllm_eagle3(heads, model.cfg.n_layers, dtype)
        else:
            heads = checkpoint.load_heads(folder, model)
            config, tensors = vllm_medusa(heads, model.lm_head.weight, dtype)
        checkpoint.save_tensors(tensors, os.path.join(args.out, WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(args.out, CONFIG), "w") as f:
            json.dump(config, f, indent=1)
        if args.base_out:
            copy_base(checkpoint.resolve(args.model), args.base_out)
    finally:
        cli.remove_empty(made)  # a run that stopped leaves no empty folder of its own
    kept = heads.cfg.kept_tokens or config["vocab_size"]
    if eagle3:
        print(
            f"wrote {args.out}: an EAGLE-3 layer (LlamaForCausalLMEagle3) for vLLM and SGLang, "
            f"draft vocabulary {kept} of {config['vocab_size']}, fused layers "
            f"{', '.join(map(str, heads.cfg.layers))}"
        )
    else:
        heads_n = cli.plural(config["num_heads"], "Medusa head")
        print(
            f"wrote {args.out}: {heads_n} for vLLM, vocabulary {config['vocab_size']} (the heads' "
            f"{kept} tokens, the base LM head's rows for the rest)"
        )
    if args.base_out:
        print(f"wrote {args.base_out}: {args.model} as vLLM serves it")


def cli_main(argv=None) -> int:
    """Bad input: one line on stderr, exit code 2."""
    return cli.run(main, build_parser(), argv)


if __name__ == "__main__":
    specdec.ctrl_c.exit_now(cli_main())
