"""
The fast CPU paths, each the twin of a readable function or layer in model.py, heads.py or
train.py, tested equal to it (tests/test_kernels.py), and chosen in one place: use().

    kernels.use(model)                   # the twins Kernels.choose() picks for the model's device
                                         and dtype
    kernels.use(model, Kernels())        # back to the readable layers
    kernels.in_use(model)                # -> the Kernels in use
    loss = fused_batch_loss(kind, z, weight, j, top_ids, top_p, target, dtype)   # training's loss
    kernels.sizes(device)                # batch and block sizes for the device (CPU: measured; GPU:
                                         guessed)

    readable                                        fast twin (here)
    nn.Linear                                       PackedLinear: through a oneDNN-prepacked copy of
                                                    the weight,
                                                    kernels.c's for bf16 (NativeWeight), or an fp16,
                                                    int8 or
                                                    int4 one (quantize(): other numbers)
    model.Attention.project: three products         FastAttention.project: one prepacked product for
                                                    q, k, v, biases
    model.attend: SDPA                              attend: fp32 SDPA for one query, two matmuls for
                                                    a batch;
                                                    attend_native: kernels.c, a step or a tree in
                                                    bf16
    model.MLP.gate_up: two products                 FastMLP.gate_up: one prepacked product
    model.RMSNorm: eight small ops                  FastRMSNorm: one layer norm (of [x, -x]),
                                                    rms_norm()
    model.apply_rope: on q, then on k               FastAttention.forward: q and k rotated at once,
                                                    rope()
    model.Block: x + o_proj(..), x + down_proj(..)  FastBlock: each residual add inside its product;
                                                    block_native: kernels.c, the whole layer in one
                                                    call
    model.Transformer.run_layers: layer by layer    FastTransformer: kernels.c, all of them in one
                                                    call (stack_native)
    heads.LMHead (the frozen shared matrix)         FastLMHead: that matrix, prepacked
    train.batch_loss(kind, logits_of(heads, z, j))   fused_batch_loss: LM head and loss in blocks of
                                                    rows

use() swaps a layer's class to its twin in place (the same parameters, the same state_dict) and
prepacks its weights as they are then; use(..., Kernels()) swaps back. A twin replaces products
(project, gate_up) and attend(); with Kernels.glue, also the small ops between the products
(norms, rope, the q/k/v views, the residual adds), each a trip through PyTorch's dispatcher: most
of a decode step's time beyond its products (results/step-time-zen5-bf16.md).
kernels.c (beside this file, compiled once per machine for its CPU: AVX512-BF16, AVX-512 without
BF16, AVX2 or NEON; native_path()) holds three of them in C, for bf16: the product of a few rows,
reading the weight once; the attention of a few queries; and a whole decoder layer built from
them, one call instead of some forty PyTorch operations (and the layers of a forward in one
call, no Python between two of them). Each computes every row alone, so in bf16 a tree's nodes get
exactly what plain decoding gets: greedy speculative decoding is token-identical to plain greedy
in bf16 too. Where it runs, bf16 runs through it, whether PyTorch's bf16 is native here or not.
Every family model.py computes (Qwen2's biases, Qwen3's q/k norms, GeGLU) runs the same twins.
checkpoint.load and checkpoint.load_heads end with use(), so whatever loads a model or heads runs
the twins.
Why each twin is faster, and by how much on which CPU: results/kernels-cpu.md, whose table
`python bench.py --kernels` measures on this machine. Off the CPU (CUDA) the readable layers
already run the fast kernels and use() keeps them. Under autograd every twin runs its readable
forward (oneDNN's prepacked product has no backward): weights trained after use() need use()
again before inference reads them.

Test: `python -m pytest -q tests/test_kernels.py` (and tests/test_kernels_qemu.py: the NEON path
off ARM, under qemu-user). Shapes: B batch, T new tokens, S cache slots,
H query heads, Hkv key/value heads, Dh head size, D hidden, M predictions, V' head vocabulary,
k teacher top-k, R rows of a block.
"""

import ctypes
import functools
import hashlib
import itertools
import math
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from specdec import cli
import heads
import model
from specdec import rows


# --- choosing ------------------------------------------------------------------------------------
# PyTorch's bf16 attention on a CPU runs a blocked flash kernel built for long queries, and
# F.linear on a few rows misses oneDNN's fast path, in bf16 and (through MKL) in fp32; oneDNN's
# product on a weight reordered once into its blocked layout runs near the memory bandwidth. So on
# every CPU the linear layers are prepacked (fp32, and bf16 where it is native), and the bf16
# attention path is added where bf16 is native. Where kernels.c runs, every bf16 product, the
# attention of a step and whole decoder layers go through it instead, bf16 native to oneDNN or not
# (on AVX2, PyTorch's bf16 products are emulated: tens of times slower than fp32's). The prepacked
# weights are a second copy of every linear layer's weight, made only where it fits in free memory.


@dataclass(frozen=True)
class Kernels:
    # "sdpa": model.attend | "cpu-bf16": attend() | "expanded-kv": attend_expanded()
    attention: str = "sdpa"
    packed: bool = False  # linear layers run through oneDNN-prepacked copies of their weights
    # "fp16" | "int8" | "int4": linear layers run through such copies of their weights (quantize)
    quant: str = "none"
    # fewer small ops a layer: FastRMSNorm, q and k rotated at once, FastBlock's adds
    glue: bool = False
    native: bool = False  # bf16 products through kernels.c (NativeWeight), not oneDNN

    @property
    def product(
        self,
        # whose product the prepacked linears run: "fp16" (fbgemm), "c", "c-int8" (kernels.c) or
        # "onednn"
    ) -> str:
        if self.quant == "fp16":
            return "fp16"
        if self.native:
            return "c-int8" if self.quant == "int8" else "c"
        return "onednn"

    @staticmethod
    def choose(device, dtype, weight_bytes=0) -> "Kernels":
        """The fast kernels for weights of `weight_bytes` on `device` in `dtype`; Kernels() (the
        readable path) off the CPU, and where nothing here is faster."""
        if torch.device(device).type == "cuda":
            return Kernels(attention="expanded-kv")
        if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return Kernels()
        bf16 = dtype == torch.bfloat16
        native = bf16 and native_library() is not None
        mkldnn = torch.backends.mkldnn
        onednn = mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        if bf16 and not native and not (onednn and onednn_bf16()):
            return Kernels()  # bf16 emulated here, and no kernels.c: nothing here is faster
        free = (
            os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            if hasattr(os, "sysconf")
            else 0
        )
        fits = 2 * weight_bytes < free
        return Kernels(
            attention="cpu-bf16" if bf16 else "sdpa",
            packed=fits and (native or onednn),
            glue=True,
            native=native and fits,
        )


@functools.cache
def onednn_bf16():
    """Whether oneDNN, PyTorch's CPU products, multiplies bf16 natively here (AVX512-BF16, AMX);
    where not (AVX2), PyTorch's bf16 products are emulated, tens of times slower than fp32's
    (pytorch/pytorch#146508)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pick_dtype(name, device, quantize="none", native=True):
    """--dtype: fp32, bf16, fp16, or auto: bf16 on CUDA, fp16 on a GPU before Ampere (compute
    capability < 8, which emulates bf16 slowly); on a CPU bf16 wherever a bf16 step is fast, else
    fp32, and fp32 under --quantize fp16 (fp16 weights take fp32 rows, results/kernels-cpu.md). A
    bf16 step is fast where oneDNN multiplies bf16 natively (results/README.md), and, for work
    that runs kernels.c (`native`: decoding), wherever kernels.c runs. Training passes
    native=False: its products are PyTorch's, emulated in bf16 on a CPU without native bf16."""
    if name != "auto" and name not in cli.DTYPES:
        raise cli.UsageError(f"--dtype {name}: unknown dtype; use auto, {', '.join(cli.DTYPES)}")
    if name != "auto":
        return cli.DTYPES[name]
    if torch.device(device).type == "cpu":
        fast = (native and native_library() is not None) or onednn_bf16()
        return torch.bfloat16 if fast and quantize != "fp16" else torch.float32
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.bfloat16
    return torch.float16


# --- sizes of work, per device -------------------------------------------------------------------
# Chosen in this one place. The CPU's were measured there (the data stage's batch: 128 rows with
# oneDNN's products, commit 06d743e; 16 where kernels.c's run, which read the weights again for
# each tile of a few rows: 1.4-1.5x 128 rows on AVX2, results/batch-cpu.md; the loss's blocks:
# results/train-speed-zen5-bf16.md). A GPU runs a kernel over more rows in about the time of fewer,
# so its sizes are larger: guesses, not measured (no GPU has trained or run the data stage yet);
# bench on one and set them here.


@dataclass(frozen=True)
class Sizes:
    gen_batch: int  # rows train.py's data stage decodes together (--gen-batch 0)
    loss_rows: int  # rows in a block of FusedHeadLoss; a CPU's block of logits stays in its caches


def sizes(device, native=False) -> Sizes:
    """The Sizes for `device`: the CPU's measured ones (native: kernels.c's products run, as
    Kernels.native says), or a GPU's untested guesses."""
    if torch.device(device).type == "cuda":
        return Sizes(gen_batch=256, loss_rows=2048)
    return Sizes(gen_batch=16 if native else 128, loss_rows=256)


# --- linear layers: kernels.c's product, for bf16 ------------------------------------------------
# kernels.c multiplies a few bf16 rows by a weight it reads once: from 1 to 64 rows faster than
# oneDNN's prepacked product, and a row's result the same bits whatever rows share the call
# (results/kernels-cpu.md). Its paths, one per instruction set: AVX512-BF16 (bf16 pairs multiplied
# in hardware), AVX-512 without BF16 (avx512f: bf16 widened to fp32 by a shift in registers, 16
# lanes; the Skylake to Ice Lake Xeons most clouds rent), AVX2 with FMA (widened likewise, 8 lanes;
# where PyTorch's own bf16 products are emulated, tens of times slower than fp32's) and NEON (64-bit
# ARM). The best path this CPU runs is compiled here once per machine into the cache folder (about
# a second); SPECDEC_KERNELS=avx512-bf16|avx512f|avx2|neon|off forces one (SPECDEC_NO_C=1 is off).
# Where none runs (another CPU, no C compiler), PyTorch's kernels do; native_reason() says why.

# -ffp-contract=off: the arithmetic as written, no multiply and add fused where the compiler finds
# them (it would differ between the code compiled for 1 row and for 8, and so would a row's bits).
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.c")
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
PATHS = {  # best first: the CPU features a path needs (as /proc/cpuinfo names them), its flags
    "avx512-bf16": (
        {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"},
        ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"],
    ),
    "avx512f": ({"avx512f", "avx512bw", "avx512vl"}, ["-mavx512f", "-mavx512bw", "-mavx512vl"]),
    "avx2": ({"avx2", "fma", "f16c"}, ["-mavx2", "-mfma", "-mf16c"]),
    "neon": (set(), []),  # every 64-bit ARM CPU has it, and its compilers' default targets it
}
ARM = ("aarch64", "arm64")


@functools.cache
def cpu_flags():
    """This CPU's features as Linux's /proc/cpuinfo lists them (x86's flags, ARM's Features);
    none elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:  # not Linux
        pass
    return frozenset()


def runnable_paths():
    """The kernels.c paths this CPU executes, best first."""
    arm = platform.machine().lower() in ARM
    return [
        path
        for path, (needs, _) in PATHS.items()
        if (path == "neon") == arm and needs <= cpu_flags()
    ]


def forced_path():
    """SPECDEC_KERNELS's path ("" where unset; SPECDEC_NO_C=1 is "off")."""
    if os.environ.get("SPECDEC_NO_C") == "1":
        return "off"
    return os.environ.get("SPECDEC_KERNELS", "").strip().lower()


def native_choice():
    """(the kernels.c path to run, None) or (None, why none, in one line): the forced path where
    this CPU runs it, else the best this CPU runs."""
    forced, runnable = forced_path(), runnable_paths()
    if forced == "off":
        return None, "turned off (SPECDEC_KERNELS=off or SPECDEC_NO_C=1)"
    if forced and forced not in PATHS:
        return None, f"SPECDEC_KERNELS={forced} is none of {', '.join(PATHS)}, off"
    if forced and forced not in runnable:
        runs = ", ".join(runnable) or "none"
        return None, f"SPECDEC_KERNELS={forced}: this CPU cannot run it (it runs: {runs})"
    if not runnable:
        return None, (
            f"this CPU ({platform.machine()}) has none of AVX512-BF16, AVX-512 (F, BW, VL), "
            "AVX2 with FMA, NEON"
        )
    return forced or runnable[0], None


def native_path():
    """The kernels.c path chosen for this process: "avx512-bf16", "avx512f", "avx2", "neon", or
    None (see native_choice; whether it builds is native_library's answer)."""
    return native_choice()[0]


def build_command(path, out):
    """The command that compiles kernels.c's `path` into the library `out` (CC: the compiler)."""
    return [os.environ.get("CC", "cc"), *CFLAGS, *PATHS[path][1], SOURCE, "-o", out]


def library_file(path):
    """Where kernels.c's `path` is built for this machine: the name keys the source, the command,
    torch and the CPU, so that a home folder shared by two machines keeps a build for each."""
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = [*build_command(path, ""), torch.__version__, platform.machine(), *sorted(cpu_flags())]
    digest = hashlib.sha256(source + " ".join(key).encode()).hexdigest()[:16]
    return os.path.join(cli.cache_root(), f"kernels-{path}-{digest}.so")


@functools.cache
def native():
    """(kernels.c built for native_path() and loaded through ctypes, None), or (None, why not in
    one line). A forced path this CPU cannot run, or a build that fails, says so in one notice;
    then PyTorch's kernels run, never an illegal instruction."""
    path, why = native_choice()
    if path is None:
        if forced_path() not in ("", "off"):  # asked for, not to be had
            print(f"notice: {why}; PyTorch's kernels run", file=sys.stderr)
        return None, why
    built = library_file(path)
    try:
        if not os.path.exists(built):
            os.makedirs(os.path.dirname(built), exist_ok=True)
            partial = f"{built}.{os.getpid()}.partial"
            subprocess.run(
                build_command(path, partial), check=True, capture_output=True, timeout=120
            )
            os.replace(partial, built)  # whole, or not there: a concurrent build writes its own
        lib = ctypes.CDLL(built)
    except (OSError, subprocess.SubprocessError) as e:
        said = (getattr(e, "stderr", None) or b"").decode(errors="replace").splitlines()
        errors = [line for line in said if "error" in line]  # the compiler's first error
        if isinstance(e, subprocess.CalledProcessError):
            errors.append(f"{e.cmd[0]} exited with {e.returncode}")
        why = f"kernels.c not built here ({(errors or [str(e)])[0].strip()[:120]})"
        print(f"notice: {why}; PyTorch's kernels run", file=sys.stderr)
        return None, why
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.kernels_isa.argtypes, lib.kernels_isa.restype = [], ctypes.c_char_p
    assert lib.kernels_isa().decode() == path, f"{built} is not kernels.c's {path} path"
    lib.linear_bf16.argtypes, lib.linear_bf16.restype = [p, i, i, p, p, i, p, p, p], i
    long = ctypes.c_long
    lib.attend_bf16.argtypes = [p, i, p, i, i, i, p, p, i, i, long, long, p, f, p]
    lib.attend_bf16.restype = i
    lib.block_bf16.argtypes = [p, p, i, p, i, p, p, p, p, long, long, i, p, p]
    lib.block_bf16.restype = i
    lib.stack_bf16.argtypes = [p, i, p, i, p, i, p, p, p, p, long, long, long, i, p]
    lib.stack_bf16.restype = i
    return lib, None


def native_library():
    """kernels.c for this process (native()), or None: then PyTorch's kernels run."""
    return native()[0]


def native_reason():
    """Why no kernels.c path runs here, in one line (for a banner), or None where one runs."""
    return native()[1]


def address(t):
    """A tensor's data pointer for ctypes; None (C's NULL) for no tensor."""
    return None if t is None else t.data_ptr()


class NativeWeight:
    """A bf16 (out, in) weight packed for kernels.c: (ceil(out/32)*2, in/2, 16, 2), zero rows
    padding out; with int8, int8_weight's q packed so and its scales (fp32, one an output).
    Calling it is F.linear(x, weight, bias) (+ add) for bf16 x (..., in), the weight int8's
    widen(q, scale) where it is int8."""

    def __init__(self, weight, int8=False):
        N, K = weight.shape
        assert self.fits(weight), (
            "kernels.c takes bf16 weights on the CPU with an even number of inputs"
        )
        q, scale = int8_weight(weight) if int8 else (weight, None)
        padded = torch.zeros(bucket(N, 32), K, dtype=q.dtype)
        padded[:N] = q
        # (N'/16, K/2, 16, 2)
        self.packed, self.out = (
            padded.view(-1, 16, K // 2, 2).transpose(1, 2).contiguous(),
            N,
        )
        self.scale = None if scale is None else scale.float()  # (out,) fp32

    @staticmethod
    def fits(weight):
        return (
            weight.dtype == torch.bfloat16
            and weight.device.type == "cpu"
            and weight.shape[-1] % 2 == 0
        )

    def __call__(self, x, bias=None, add=None):
        K = x.shape[-1]
        assert x.dtype == torch.bfloat16, f"kernels.c multiplies bf16 rows, got {x.dtype}"
        x2 = x.reshape(-1, K).contiguous()  # (rows, in)
        y = torch.empty(*x.shape[:-1], self.out, dtype=torch.bfloat16)  # (..., out)
        if add is not None:
            add = add.to(torch.bfloat16).contiguous()
            assert add.shape == y.shape, (
                f"add {tuple(add.shape)} is not the output's {tuple(y.shape)}"
            )
        if bias is not None:
            bias = bias.to(torch.bfloat16).contiguous()
        failed = native_library().linear_bf16(
            address(x2),
            len(x2),
            K,
            address(self.packed),
            address(self.scale),
            self.out,
            address(bias),
            address(add),
            address(y),
        )
        if failed:
            raise MemoryError(f"a product of {len(x2)} rows: no scratch memory")
        return y


# --- linear layers: prepacked weights ------------------------------------------------------------

# fbgemm's fp16 product (quantize(.., "fp16")) keeps the weights in fp16 and multiplies in fp32:
# for one row it streams them faster than oneDNN's bf16 product, for a tree's rows no faster, for a
# prefill's slower (results/kernels-cpu.md). A bf16 weight is an fp16 one but for values below
# fp16's normal range (6e-5). Whether a row's result is the same bits whatever rows share its call
# depends on the CPU: with AVX-512 it is; on AVX2 fbgemm sums some row counts in another order, so
# there a tree's rows and plain decoding's may round apart (fp16_rows_alone() tries it).


@torch.no_grad()  # a copy of the weights' values, not a step of any autograd graph
def prepack(*weights, product="onednn"):
    """One prepacked weight for the concatenated (out, in) weights, for Kernels.product's product:
    oneDNN's in their dtype, kernels.c's (bf16, where the weight fits it) or fbgemm's fp16."""
    weight = torch.cat(weights).contiguous()
    if product == "fp16":
        return torch.ops.quantized.linear_prepack_fp16(weight.float(), None)
    if product in ("c", "c-int8") and NativeWeight.fits(weight):
        return NativeWeight(weight, int8=product == "c-int8")
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def linear(x, packed, bias=None, add=None):
    """F.linear(x, weight, bias) through the prepacked copy of weight (no autograd); with `add`, a
    tensor of the output's shape, add + F.linear(x, weight, bias) in the same call (a oneDNN
    post-op)."""
    if isinstance(packed, NativeWeight):  # kernels.c: bf16 in and out
        return packed(x, bias, add)
    if not isinstance(packed, torch.Tensor):  # fbgemm's fp16: fp32 in and out
        y = torch.ops.quantized.linear_dynamic_fp16(x.float(), packed)
        y = (y if bias is None else y + bias).to(x.dtype)
        return y if add is None else add + y
    if add is not None:
        return torch.ops.mkldnn._linear_pointwise.binary(x, add, packed, bias, "add")
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.cache
@torch.no_grad()
def fp16_rows_alone() -> bool:
    """Whether fbgemm's fp16 product on this CPU gives each row the same bits whatever rows share
    its call (tried on 1 to 40 rows): where not, greedy speculative decoding on fp16 weights may
    part from plain greedy decoding on them (generate.py's banner says so)."""
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=generator) * 0.1
    x = torch.randn(1, 40, 64, generator=generator)
    packed = prepack(w, product="fp16")
    whole = linear(x, packed)
    return all(torch.equal(linear(x[:, :n], packed), whole[:, :n]) for n in range(1, 40))


@torch.no_grad()
def int8_weight(weight):
    """Weight-only int8, one scale per output channel: weight ~ scale[:, None] * q, q in [-127,
    127]."""
    scale = weight.float().abs().amax(1).clamp(min=1e-12) / 127  # (out,)
    return (weight.float() / scale[:, None]).round().to(torch.int8), scale.to(weight.dtype)


@torch.no_grad()
def int4_weight(weight, group=32):
    """Weight-only int4 (gpt-fast's), a scale and a zero per `group` inputs of an output channel:
    weight ~ (q - 8) * scale + zero, q in [0, 15] -> q (out, in), scale_zero (in/group, out, 2)."""
    N, K = weight.shape
    w = weight.float().view(N, K // group, group)  # (out, in/group, group)
    low, scale = w.amin(-1), (w.amax(-1) - w.amin(-1)).clamp(min=1e-6) / 15  # (out, in/group) each
    q = ((w - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8).view(N, K)
    return q, torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous().to(
        weight.dtype
    )


def int4_pack(q):
    """int4_weight's q (out, in) in the CPU kernel's layout: two per byte, tiled (out, in/2)."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 8)


def int4_fits(weight, group=32):
    """Whether the CPU's int4 kernel takes this (out, in) weight: out a multiple of 16, in of
    group."""
    return weight.shape[0] % 16 == 0 and weight.shape[1] % group == 0


def widen(q, scale):
    """The weight that int8_weight's (q, scale) or int4_weight's (q, scale_zero) stands for (out,
    in)."""
    if scale.dim() == 1:  # int8: (out,)
        return q.to(scale.dtype) * scale[:, None]
    s, zero = scale.float().transpose(0, 1).unbind(-1)  # (out, in/group) each
    return (
        ((q.float().view(*s.shape, -1) - 8) * s[..., None] + zero[..., None])
        .view(q.shape)
        .to(scale.dtype)
    )


def quantized_linear(x, q, scale, bias=None):
    """F.linear(x, widen(q, scale), bias): on a CPU one kernel that reads the quantized weight
    (int8:
    half the bytes of bf16; int4: a quarter, q as int4_pack() left it); elsewhere it is widened
    first
    (correct, not faster)."""
    if x.device.type != "cpu":
        return F.linear(x, widen(q, scale).to(x.dtype), bias)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (rows, in)
    if scale.dim() == 1:
        y = torch._weight_int8pack_mm(x2, q, scale)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, q, x.shape[-1] // len(scale), scale)
    y = y.view(*x.shape[:-1], -1)  # (..., out)
    return y if bias is None else y + bias


class PackedLinear(nn.Linear):
    """nn.Linear's twin: the product through a prepacked copy of the weight, or an fp16, int8 or
    int4 one."""

    @staticmethod
    def wanted(layer, kernels):
        return (
            kernels.packed
            or kernels.quant == "int8"
            or (kernels.quant == "int4" and int4_fits(layer.weight))
        )

    def prepare(self, kernels):
        self.kernels = kernels
        if kernels.quant == "int4":
            q, scale_zero = int4_weight(self.weight)
            self.packed = (int4_pack(q) if q.device.type == "cpu" else q), scale_zero
        elif kernels.quant == "int8" and kernels.product != "c-int8":
            self.packed = int8_weight(self.weight)
        else:
            self.packed = prepack(self.weight, product=kernels.product)

    def forward(self, x):
        if torch.is_grad_enabled():
            return super().forward(x)
        if isinstance(self.packed, tuple):  # int8_weight's or int4_weight's
            return quantized_linear(x, *self.packed, self.bias)
        return linear(x, self.packed, self.bias)


# --- norms and rotary: the small ops between the products ----------------------------------------
# On a CPU F.rms_norm is no single kernel: it runs model.RMSNorm's eight ops. F.layer_norm is one:
# the layer norm of [x, -x] (mean 0, variance mean(x^2)) is RMSNorm's x * rsqrt(mean(x^2) + eps).
# apply_rope's rotate-half is a roll by Dh/2 with the first half negated: the sign moves onto sin.


def rms_norm(x, weight2, eps):
    """model.RMSNorm's twin: x (..., D), weight2 the norm's weight twice (2D,), or None for no
    weight -> (..., D). One rounding in bf16 where the readable rounds twice: within 1 ulp of it."""
    D = x.shape[-1]
    return F.layer_norm(torch.cat([x, -x], -1), (2 * D,), weight2, None, eps)[..., :D]


def rope(x, cos, sin, sign):
    """model.apply_rope's twin, for q and k at once: x (B, H+Hkv, T, Dh); cos, sin (B|1, 1, T, Dh);
    sign (Dh,) -1 then +1. The same products and sum, so the same bits in any dtype."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * (sin * sign)  # (B, H+Hkv, T, Dh)


class FastRMSNorm(model.RMSNorm):
    """model.RMSNorm's twin: rms_norm(), one layer norm."""

    @staticmethod
    def wanted(layer, kernels):
        return kernels.glue

    def prepare(self, kernels):
        self.kernels, self.packed = kernels, torch.cat([self.weight, self.weight]).detach()

    def forward(self, x):
        if torch.is_grad_enabled():
            return super().forward(x)
        return rms_norm(x, self.packed, self.eps)


# --- attention -----------------------------------------------------------------------------------


def attend(q, k, v, mask):
    """model.attend's twin for bf16 on a CPU. q (B, H, T, Dh); k, v (B, Hkv, S, Dh); mask
    (B|1, 1, T, S) bool or None -> (B, H, T, Dh)."""
    B, H, T, Dh = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    # one decode step: SDPA's fp32 kernel beats its bf16 one; where bf16 is emulated, so does all
    if (B == 1 and T == 1) or not onednn_bf16():
        return model.attend(q.float(), k.float(), v.float(), mask).to(q.dtype)
    # a tree or a prefill (SDPA is as fast), or scores over 128 MB
    if B == 1 or B * H * T * S > 2**25:
        return model.attend(q, k, v, mask)
    # batches (train.py's data stage): the G = H / Hkv query heads of a key/value head become G*T
    # rows of one matrix product in bf16; softmax in fp32 (as SDPA does inside, minus the blocking).
    # k and v are views into the cache with gaps between rows, on which a bf16 matmul is much
    # slower than a copy to contiguous memory followed by the product.
    G = H // Hkv
    if mask is None and T > 1:  # causal, as model.attend's is_causal: nothing cached, S = T
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()[
            None, None
        ]  # (1, 1, T, S)
    k, v = k.contiguous(), v.contiguous()
    scores = (
        q.reshape(B, Hkv, G * T, Dh) @ k.transpose(-1, -2)
    ).float() * Dh**-0.5  # (B, Hkv, G*T, S)
    if mask is not None:
        scores = (
            scores.view(B, Hkv, G, T, S)
            .masked_fill(~mask[:, :, None], -math.inf)
            .view(B, Hkv, G * T, S)
        )
    return (scores.softmax(-1).to(v.dtype) @ v).view(B, H, T, Dh)  # (B, H, T, Dh)


def attend_native(q, k, v, mask):
    """model.attend's twin through kernels.c for bf16: q (B, H, T, Dh); k, v (B, Hkv, S, Dh), rows
    contiguous (the cache's views); mask (B|1, 1, T, S) bool or None (causal) -> (B, H, T, Dh).
    Each query alone: a tree's node gets plain decoding's bits."""
    B, H, T, Dh = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    assert k.stride() == v.stride() and k.stride()[2:] == (Dh, 1), (
        "k and v: rows of Dh side by side, as the cache holds them"
    )
    q = q.transpose(1, 2).contiguous()  # (B, T, H, Dh): query m = b T + t, its heads together
    # (B, T, S) bool: one byte each
    visible = None if mask is None else mask.expand(B, 1, T, S).reshape(B, T, S).contiguous()
    y = torch.empty(B, T, H, Dh, dtype=q.dtype)  # (B, T, H, Dh)
    failed = native_library().attend_bf16(
        address(q),
        B * T,
        None,
        H,
        T,
        Dh,
        address(k),
        address(v),
        Hkv,
        S,
        k.stride(0),
        k.stride(1),
        address(visible),
        Dh**-0.5,
        address(y),
    )
    if failed:
        raise MemoryError(f"attention over {S} keys: no scratch memory")
    return y.transpose(1, 2)  # (B, H, T, Dh)


def native_attends(q, k, v):
    """Whether attend_native takes these: a decode step or a tree of each row (not a prefill), Dh
    even and at most 256, k and v with the cache's layout."""
    return (
        q.shape[2] <= 64
        and q.dtype == torch.bfloat16
        and q.shape[-1] <= 256
        and q.shape[-1] % 2 == 0
        and k.stride() == v.stride()
        and k.stride()[2:] == (q.shape[-1], 1)
    )


def attend_expanded(q, k, v, mask):
    """model.attend's twin on a GPU: an explicit mask together with enable_gqa leaves SDPA only its
    slowest (math) backend; with the key and value heads repeated to the query heads, the
    memory-efficient one takes the mask (a tree, padding). A causal prefill has no mask
    (is_causal): model.attend's SDPA call runs its flash kernel as it is. Never cuDNN's attention:
    it builds a plan for each new shape, and a decode step's key length is new every step (1.4 ms
    of host time a call on an H200, results/bench-gpu-h200-bf16.md); the caller's setting is put
    back after."""
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        if mask is None or k.shape[1] == q.shape[1]:
            return model.attend(q, k, v, mask)
        G = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=mask
        )
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)


class FastAttention(model.Attention):
    """model.Attention's twin: q, k and v out of one prepacked product (one call, not three), and
    attend() above where the kernels say "cpu-bf16". With Kernels.glue, its forward also views
    q, k and v out of that product at once, rotates q and k together, and can add the residual
    inside o_proj's product (FastBlock)."""

    FUSED = ("q_proj", "k_proj", "v_proj")  # packed here together, not each on its own

    @staticmethod
    def wanted(layer, kernels):
        return kernels.packed or kernels.attention != "sdpa"

    def prepare(self, kernels):
        self.kernels, qkv, c = kernels, (self.q_proj, self.k_proj, self.v_proj), self.cfg
        # Qwen2's
        bias = torch.cat([p.bias for p in qkv]).detach() if self.q_proj.bias is not None else None
        self.packed = (
            (prepack(*(p.weight for p in qkv), product=kernels.product), bias)
            if kernels.packed
            else None
        )
        # rope()'s sign (Dh,); Qwen3's: q_norm's weight on q's heads, k_norm's on k's (H+Hkv, 1, Dh)
        self.rotary = None
        if kernels.glue and kernels.packed:
            sign = torch.tensor([-1, 1]).repeat_interleave(c.head_dim // 2).to(self.q_proj.weight)
            norms = (
                (
                    self.q_norm.weight.expand(c.n_heads, -1),
                    self.k_norm.weight.expand(c.n_kv_heads, -1),
                )
                if c.qk_norm
                else ()
            )
            self.rotary = sign, torch.cat(norms).detach()[:, None] if norms else None

    def forward(self, x, cos, sin, attn_mask, kv, residual=None):
        """model.Attention.forward's twin; with `residual` (B, T, D), residual + the output."""
        if self.rotary is None or torch.is_grad_enabled():
            y = super().forward(x, cos, sin, attn_mask, kv)
            return y if residual is None else residual + y
        B, T, _ = x.shape
        (sign, qk_weight), c = self.rotary, self.cfg
        H, Hkv = c.n_heads, c.n_kv_heads
        # (B, H+2Hkv, T, Dh)
        qkv = linear(x, *self.packed).view(B, T, H + 2 * Hkv, c.head_dim).transpose(1, 2)
        qk, v = qkv.split([H + Hkv, Hkv], 1)  # (B, H+Hkv, T, Dh), (B, Hkv, T, Dh)
        if qk_weight is not None:
            qk = rms_norm(qk, None, c.norm_eps) * qk_weight  # q_norm(q), k_norm(k)
        q, k = rope(qk, cos, sin, sign).split([H, Hkv], 1)  # (B, H, T, Dh), (B, Hkv, T, Dh)
        if kv is not None:  # as model.Attention: the new entries after the prefix, then all of it
            k_cache, v_cache, start = kv
            k_cache[:, :, start : start + T], v_cache[:, :, start : start + T] = k, v
            k, v = k_cache[:, :, : start + T], v_cache[:, :, : start + T]  # (B, Hkv, S, Dh)
        y = self.attend(q, k, v, attn_mask).transpose(1, 2).reshape(B, T, H * c.head_dim)
        return linear(y, self.o_proj.packed, None, residual)  # (B, T, D)

    def project(self, x):
        if self.packed is None or torch.is_grad_enabled():
            return super().project(x)
        c = self.cfg
        return linear(x, *self.packed).split(
            [c.n_heads * c.head_dim] + 2 * [c.n_kv_heads * c.head_dim], -1
        )

    def attend(self, q, k, v, mask):
        if self.kernels.attention == "expanded-kv":
            return attend_expanded(q, k, v, mask)  # (B, H, T, Dh)
        if self.kernels.attention == "sdpa" or torch.is_grad_enabled():
            return super().attend(q, k, v, mask)
        if self.kernels.native and native_attends(q, k, v):
            return attend_native(q, k, v, mask)  # (B, H, T, Dh)
        return attend(q, k, v, mask)  # (B, H, T, Dh)


# --- the MLP, the decoder layer and the heads' LM head -------------------------------------------


class FastMLP(model.MLP):
    """model.MLP's twin: gate and up out of one prepacked product; the residual added inside the
    down product (FastBlock)."""

    FUSED = ("gate_proj", "up_proj")

    @staticmethod
    def wanted(layer, kernels):
        return kernels.packed

    def prepare(self, kernels):
        self.kernels, self.packed = (
            kernels,
            prepack(self.gate_proj.weight, self.up_proj.weight, product=kernels.product),
        )

    def gate_up(self, x):
        if torch.is_grad_enabled():
            return super().gate_up(x)
        return linear(x, self.packed).chunk(2, dim=-1)  # (B, T, hidden_dim) each

    def forward(self, x, residual=None):
        """model.MLP.forward's twin; with `residual` (B, T, D), residual + the output."""
        if residual is None or torch.is_grad_enabled():
            return super().forward(x) if residual is None else residual + super().forward(x)
        gate, up = self.gate_up(x)
        return linear(self.act(gate) * up, self.down_proj.packed, None, residual)  # (B, T, D)


class NativeLayer(ctypes.Structure):
    """kernels.c's Layer: a decoder layer's sizes and the addresses of its weights, laid out once
    (the packed products and norms it points to stay where they are while the layer is in use)."""

    _fields_ = [
        *((name, ctypes.c_int) for name in ("D", "H", "Hkv", "Dh", "F", "gelu")),
        ("eps", ctypes.c_float),
        *((name, ctypes.c_void_p) for name in ("norm1", "norm2", "bqkv", "qnorm", "knorm")),
        *((name, ctypes.c_void_p) for name in ("wqkv", "wo", "wgu", "wdown")),
        *((name, ctypes.c_void_p) for name in ("sqkv", "so", "sgu", "sdown")),
    ]

    def __init__(self, block):
        c, attn, mlp = block.self_attn.cfg, block.self_attn, block.mlp
        wqkv, bias = attn.packed
        # kept here: the struct holds only its address
        self.bias = None if bias is None else bias.to(torch.bfloat16).contiguous()
        norms = (attn.q_norm.weight, attn.k_norm.weight) if c.qk_norm else (None, None)
        products = (wqkv, attn.o_proj.packed, mlp.packed, mlp.down_proj.packed)
        super().__init__(
            D=c.dim,
            H=c.n_heads,
            Hkv=c.n_kv_heads,
            Dh=c.head_dim,
            F=c.hidden_dim,
            gelu=c.activation != "silu",
            eps=block.input_layernorm.eps,
            norm1=address(block.input_layernorm.weight),
            norm2=address(block.post_attention_layernorm.weight),
            bqkv=address(self.bias),
            qnorm=address(norms[0]),
            knorm=address(norms[1]),
            **{w: address(p.packed) for w, p in zip(("wqkv", "wo", "wgu", "wdown"), products)},
            **{s: address(p.scale) for s, p in zip(("sqkv", "so", "sgu", "sdown"), products)},
        )


def per_row(B, T, start, cos, sin, mask):
    """cos, sin (B|1, 1, T, Dh) and mask (B|1, 1, T, start+T) or None as kernels.c reads them: every
    batch row's own, contiguous: (B, 1, T, Dh) each, (B, T, start+T) bool or None."""
    Dh = cos.shape[-1]
    cos = cos.expand(B, 1, T, Dh).contiguous()  # each row's positions
    sin = sin.expand(B, 1, T, Dh).contiguous()
    if mask is not None:
        mask = mask.expand(B, 1, T, start + T).reshape(B, T, start + T).contiguous()
    return cos, sin, mask


def block_native(block, x, cos, sin, mask, kv):
    """model.Block's forward through kernels.c's block_bf16, one call for the layer: x (B, T, D)
    bf16; cos, sin (B|1, 1, T, Dh); mask (B|1, 1, T, S) bool or None; kv = (k_cache, v_cache,
    start), the layer's cache (B, Hkv, slots, Dh) each -> (B, T, D). The new keys and values are
    written to the cache as model.Attention writes them."""
    k_cache, v_cache, start = kv
    B, T, _ = x.shape
    x, out = x.contiguous(), torch.empty_like(x)  # (B, T, D) each
    cos, sin, mask = per_row(B, T, start, cos, sin, mask)
    failed = native_library().block_bf16(
        ctypes.byref(block.native_layer),
        address(x),
        B * T,
        None,
        T,
        address(cos),
        address(sin),
        address(k_cache),
        address(v_cache),
        k_cache.stride(0),
        k_cache.stride(1),
        start,
        address(mask),
        address(out),
    )
    if failed:
        raise MemoryError("a decoder layer in kernels.c: no scratch memory")
    return out


def native_layer(block):
    """The layer's NativeLayer where kernels.c's block_bf16 computes it (every product on kernels.c,
    SwiGLU or GeGLU, bf16 norms, heads of at most 256), else None; laid out at the first call."""
    if block.native_layer is None:
        c = block.self_attn.cfg
        products = (
            block.self_attn.packed[0] if block.self_attn.packed else None,
            block.self_attn.o_proj.__dict__.get("packed"),
            block.mlp.__dict__.get("packed"),
            block.mlp.down_proj.__dict__.get("packed"),
        )
        takes = (
            c.activation in ("silu", "gelu_pytorch_tanh")
            and c.head_dim <= 256
            and c.head_dim % 2 == 0
            and all(isinstance(p, NativeWeight) for p in products)
            and block.input_layernorm.weight.dtype == torch.bfloat16
        )
        block.native_layer = NativeLayer(block) if takes else False
    return block.native_layer or None


def native_block_takes(block, x, kv):
    """Whether block_native computes this forward: a layer it takes (native_layer), bf16 rows, up
    to 512 new tokens a row (a longer prefill's attention is faster in SDPA's blocked kernel:
    results/kernels-cpu.md), a cache with its layout."""
    return (
        kv is not None
        and x.shape[1] <= 512
        and x.dtype == torch.bfloat16
        and kv[0].stride() == kv[1].stride()
        and kv[0].stride()[2:] == (kv[0].shape[-1], 1)
        and native_layer(block) is not None
    )


class FastBlock(model.Block):
    """model.Block's twin: each residual add inside the product before it (o_proj's, down_proj's),
    through FastAttention's and FastMLP's `residual`; with kernels.c, the whole layer in one call
    (block_native) where it takes the layer."""

    @staticmethod
    def wanted(layer, kernels):
        return kernels.glue and kernels.packed

    def prepare(self, kernels):
        self.kernels = kernels
        self.native_layer = None  # native_layer(self)'s answer, once asked

    def forward(self, x, cos, sin, attn_mask, kv=None):
        if torch.is_grad_enabled():
            return super().forward(x, cos, sin, attn_mask, kv)
        if self.kernels.native and native_block_takes(self, x, kv):
            return block_native(self, x, cos, sin, attn_mask, kv)  # (B, T, D)
        x = self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, kv, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)  # (B, T, D)


class FastTransformer(rows.Model):
    """model.Transformer's twin: with kernels.c, the decoder layers in one call (stack_native) where
    block_native would take each of them (no Python between two layers), else one by one."""

    @staticmethod
    def wanted(layer, kernels):
        return kernels.glue and kernels.packed

    def prepare(self, kernels):
        self.kernels = kernels
        self.native_stack = {}  # the layers run (indices) -> their NativeLayers, or None

    def run_layers(self, x, cos, sin, attn_mask, cache, start, layers=None, sizes=None):
        if self.kernels.native and cache is not None and not torch.is_grad_enabled():
            run = tuple(range(len(self.layers)) if layers is None else layers)
            stack = self.stack(run)  # None where kernels.c does not take every layer of the run
            kv = (cache.k[0], cache.v[0], start)  # the first layer's cache, as block_native's
            if stack is not None and native_block_takes(self.layers[run[0]], x, kv):
                return stack_native(stack, x, cos, sin, attn_mask, cache, start, sizes)
        return super().run_layers(x, cos, sin, attn_mask, cache, start, layers, sizes)

    def stack(self, run):
        """The layers `run` as an array of NativeLayers where block_native takes each, none with a
        hook (a hook sees its layer run alone); else None. Laid out at the first call."""
        if run not in self.native_stack:
            blocks = [self.layers[i] for i in run]
            takes = blocks and all(
                type(b) is FastBlock
                and native_layer(b) is not None
                and not (b._forward_hooks or b._forward_pre_hooks)
                for b in blocks
            )
            array = NativeLayer * len(blocks)  # a C array of the layers' structs
            self.native_stack[run] = array(*[b.native_layer for b in blocks]) if takes else None
        return self.native_stack[run]


def stack_native(stack, x, cos, sin, mask, cache, start, sizes=None):
    """Transformer.run_layers through kernels.c's stack_bf16: every layer of `stack` (an array of
    NativeLayer) in one call on a copy of x (B, T, D); cos, sin, mask as block_native's; layer i of
    the stack reads and extends cache.k[i], cache.v[i] -> (B, T, D). sizes: row b's first sizes[b]
    tokens alone are computed (rows.Model.forward's), packed side by side; the others' outputs are
    their inputs."""
    B, T, D = x.shape
    k, v = cache.k, cache.v
    cos, sin, mask = per_row(B, T, start, cos, sin, mask)
    at = None if sizes is None or sum(sizes) == B * T else rows.packed(sizes, T)  # (M,) int32
    if at is None:
        x = x.clone(memory_format=torch.contiguous_format)  # (B, T, D): written in place
        M = B * T
    else:  # each token's rotary and mask, the padding's left out
        M, flat = len(at), at.long()
        out = x.clone()  # (B, T, D): the padding keeps its input
        x = x.reshape(B * T, D)[flat]  # (M, D)
        cos = cos.reshape(B * T, -1)[flat]  # (M, Dh)
        sin = sin.reshape(B * T, -1)[flat]
        mask = None if mask is None else mask.reshape(B * T, -1)[flat]  # (M, S)
    failed = native_library().stack_bf16(
        stack,
        len(stack),
        address(x),
        M,
        address(at),
        T,
        address(cos),
        address(sin),
        address(k),
        address(v),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        start,
        address(mask),
    )
    if failed:
        raise MemoryError("the decoder layers in kernels.c: no scratch memory")
    if at is None:
        return x
    out.view(B * T, D)[flat] = x
    return out


class FastLMHead(heads.LMHead):
    """heads.LMHead's twin for the frozen matrix every head shares: prepacked, as the base's."""

    @staticmethod
    def wanted(layer, kernels):
        return kernels.packed and layer.weight.dim() == 2

    def prepare(self, kernels):
        self.kernels, self.packed = kernels, prepack(self.weight, product=kernels.product)

    def forward(self, z, d=None):
        if torch.is_grad_enabled():
            return super().forward(z, d)
        return linear(z, self.packed)  # (..., V')


# --- switching a module's layers -----------------------------------------------------------------

TWINS = {
    nn.Linear: PackedLinear,
    model.Attention: FastAttention,
    model.MLP: FastMLP,
    heads.LMHead: FastLMHead,
    model.RMSNorm: FastRMSNorm,
    model.Block: FastBlock,
    rows.Model: FastTransformer,
}
READABLE = {twin: readable for readable, twin in TWINS.items()}


def in_use(module: nn.Module) -> Kernels:
    """The kernels module's layers run (Kernels(): the readable ones)."""
    return next((m.kernels for m in module.modules() if type(m) in READABLE), Kernels())


def use(module: nn.Module, kernels: Kernels = None) -> nn.Module:
    """Swap every layer inside `module` that has a twin (the base model: decoder layers, attention,
    MLPs, norms, linear layers, LM head; heads: their linear layers, norms, LM head and Hydra++'s
    decoder layer) to `kernels`, prepacked from the weights as they are now; None: Kernels.choose
    for the module's device and dtype. Kernels(): the readable classes. A kernel this build or
    machine lacks falls back to the readable path with one notice on stderr, never a crash. Returns
    the module."""
    tensors = [
        t for t in itertools.chain(module.parameters(), module.buffers()) if t.is_floating_point()
    ]
    if kernels is None and tensors:
        kernels = Kernels.choose(
            tensors[0].device, tensors[0].dtype, sum(t.numel() * t.element_size() for t in tensors)
        )
    kernels = kernels or Kernels()
    try:
        fused = set()  # layers that a twin above them already packed, with others, into one product
        for m in module.modules():  # parents before their children
            if type(m) in READABLE:  # back to the readable class, without the prepacked copy
                m.__class__ = READABLE[type(m)]
                for name in ("kernels", "packed", "rotary", "native_layer", "native_stack"):
                    m.__dict__.pop(name, None)
            twin = TWINS.get(type(m))
            if twin is not None and id(m) not in fused and twin.wanted(m, kernels):
                m.__class__ = twin
                m.prepare(kernels)
                fused.update(
                    id(getattr(m, name)) for name in getattr(twin, "FUSED", ()) if kernels.packed
                )
        return module
    except (RuntimeError, AttributeError) as e:
        if kernels == Kernels():
            raise
        print(
            f"notice: fast kernels unavailable here ({type(e).__name__}: {str(e)[:80]}); using "
            "the readable path",
            file=sys.stderr,
        )
        return use(module, Kernels())


def quantize(module: nn.Module, quant: str) -> nn.Module:
    """Weight-only `quant` ("fp16", "int8" or "int4") for every linear layer of `module` (a base
    model: its projections and LM head; a tied LM head quantizes a copy, the embedding reads the
    table as it is), the attention as chosen before; the KV cache and the activations keep their
    dtype. fp16 keeps the fused products and the glue; a layer the int4 kernel does not take
    (int4_fits) stays readable. A CPU's kernels: off the CPU, int8 and int4 are widened first
    (correct, not faster) and fp16 is refused. Returns the module."""
    if quant == "fp16" and any(p.device.type != "cpu" for p in module.parameters()):
        raise ValueError(
            "fp16 weights run through fbgemm, a CPU kernel; on a GPU, use fp16 as the dtype"
        )
    chosen = in_use(module)
    c_int8 = (
        quant == "int8"
        and chosen.native
        and all(NativeWeight.fits(m.weight) for m in module.modules() if isinstance(m, nn.Linear))
    )  # kernels.c's int8: fused products, whole layers
    return use(
        module,
        replace(
            chosen,
            packed=quant == "fp16" or c_int8,
            quant=quant,
            native=chosen.native and quant in ("none", "int8"),
        ),
    )


# --- the training loss ---------------------------------------------------------------------------


def bucket(n, size):
    """n rounded up to a multiple of size. oneDNN (the CPU's matrix products) builds a kernel for
    every new shape and keeps up to 1,024 of them, so shapes that change every step cost time and
    memory that grows over a run. Training pads to buckets: a batch's length to 16, the heads'
    rows to 64, the loss's to whole blocks (results/train-speed-zen5-bf16.md)."""
    return -(-n // size) * size


class FusedHeadLoss(torch.autograd.Function):
    """sum_m scale_m * train.teacher_loss(z_m W^T)_m: the heads' LM head and teacher_loss in one
    pass, the same numbers as autograd through the readable pair, with the gradient written out.

    Through autograd the (M, V') logits and their gradient are whole tensors, each written and read
    several times, and allocated anew every step. Here R rows at a time (R =
    sizes(device).loss_rows) go through the LM head, their loss and its gradient while the block's
    logits sit in cache, and the gradients of z (and of W, if it trains) are formed there and then;
    backward only scales them by the one number it receives (the sum is a scalar). With q =
    softmax(logits), s = sum_i q_i over the teacher's top-k, P = sum_i p_i, r its residual mass and
    w = r / (1 - s), differentiating the formula of teacher_loss gives

        dL/dlogit_v = q_v (P - w s)  +  [v in top-k] (w q_v - p_v)      then  dL/dz = (dL/dlogits) W
                                                                              dL/dW = (dL/dlogits)^T
                                                                              z

    a dense term (a scaled softmax) and k sparse ones. w = 0 where 1 - s is clamped at 1e-6, as
    autograd through the clamp has it. The products run in `dtype` (bf16 where training uses it),
    the loss and its gradient in fp32. How much faster: results/train-speed-zen5-bf16.md."""

    @staticmethod
    def forward(ctx, z, weight, top_ids, top_p, scale, dtype):
        # z (M, D) head states; weight (V', D) the LM head; top_ids, top_p (M, k); scale (M,)
        want_z, want_w = ctx.needs_input_grad[:2]
        with torch.autocast(z.device.type, enabled=False):
            R = sizes(z.device).loss_rows
            M, extra = len(z), bucket(len(z), R) - len(z)  # whole blocks: one product shape
            # rows that weigh 0
            pad = lambda x, value: torch.cat([x, x.new_full((extra, *x.shape[1:]), value)])
            z, top_ids, top_p, scale = pad(z, 0), pad(top_ids, -1), pad(top_p, 0), pad(scale, 0)
            grad_z = torch.empty_like(z) if want_z else None  # (M + extra, D)
            grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None  # (V', D)
            total = torch.zeros((), device=z.device)
            w_ = weight.detach().to(dtype)
            for a in range(0, len(z), R):
                rows = slice(a, a + R)
                zb = z[rows].detach().to(dtype)  # (R, D)
                logits = (zb @ w_.T).float()  # (R, V')
                lse = logits.logsumexp(-1)  # (R,)
                kept = top_ids[rows] >= 0  # (R, k)
                ids = top_ids[rows].clamp(min=0)
                picked = (
                    logits.gather(1, ids) - lse[:, None]
                ) * kept  # (R, k) log q_i, 0 if not kept
                q = picked.exp() * kept  # (R, k)
                p = top_p[rows].float() * kept  # (R, k)
                # (R,) teacher mass beyond its top-k
                rest_p = (1 - top_p[rows].float().sum(-1)).clamp(min=0)
                rest_q = 1 - q.sum(-1)  # (R,) head mass beyond them
                loss = -(p * picked).sum(-1) - rest_p * rest_q.clamp(min=1e-6).log()
                sc = scale[rows]  # (R,)
                total += (sc * loss).sum()
                if not (want_z or want_w):
                    continue
                w = torch.where(
                    rest_q >= 1e-6, rest_p / rest_q.clamp(min=1e-6), torch.zeros_like(rest_q)
                )
                g = (
                    logits.sub_(lse[:, None])
                    .exp_()
                    .mul_((sc * (p.sum(-1) - w * q.sum(-1)))[:, None])
                )
                # (R, V') dL/dlogits
                g = g.scatter_add_(1, ids, sc[:, None] * (w[:, None] * q - p)).to(dtype)
                if want_z:
                    grad_z[rows] = g @ w_
                if want_w:
                    grad_w += g.T @ zb
        ctx.save_for_backward(None if grad_z is None else grad_z[:M], grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_z, grad_w = ctx.saved_tensors
        return (
            None if grad_z is None else grad_total * grad_z,
            None if grad_w is None else grad_total * grad_w,
            None,
            None,
            None,
            None,
        )


def fused_batch_loss(kind, z, weight, j, top_ids, top_p, target, dtype=torch.float32):
    """batch_loss(kind, logits_of(heads, z, j), j + 1, top_ids, top_p, target)'s twin (train.py,
    which counts heads from 1), from the head states z (M, D) and the LM head's weight (V', D), or
    (K, V', D) one per head; j (M,) is head - 1; dtype is the products'. The next-token loss is
    the teacher loss with the data token as a teacher sure of it (p = 1), so both go through
    FusedHeadLoss, each row weighted as batch_loss weighs it."""
    M = max(len(z), 1)
    if kind == "teacher":
        ids, p, scale = top_ids, top_p, torch.full((len(z),), 1 / M, device=z.device)
    else:
        ids, p = target[:, None], torch.ones(len(z), 1, device=z.device)
        scale = 0.8 ** (j + 1).float() / M
    if weight.dim() == 2:  # one matrix for every head
        return FusedHeadLoss.apply(z, weight, ids, p, scale, dtype)
    return sum(
        FusedHeadLoss.apply(z[j == d], weight[d], ids[j == d], p[j == d], scale[j == d], dtype)
        for d in range(len(weight))
    )
