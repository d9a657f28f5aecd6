"""Linear layers of decode steps and tree verifies: a few rows against a large weight, one launch.

An AR step or a verify multiplies 1-65 rows by every weight of the model: a stream over the
weights, which cuBLAS answers with GEMM kernels tiled for many rows, some split over K with a
second, reducing launch. This kernel reads the weight once in tiles of ``block_n`` output columns,
``block_k`` at a time through pipelined asynchronous copies, with the rows as the matrix unit's
narrow operand (``W @ x^T``, padded to 16 rows or more, at most ``ROW_BLOCK`` a program). Where the
output is too narrow to fill the GPU, K is split into ``split`` parts; the last program of a column
tile to finish (an atomic ticket) adds the parts in order, so there is one launch and its result
does not depend on which part finished last.

Row invariance (speculative decoding must commit exactly the AR tokens in bf16): a row's result
is the sum over K in 16-wide chunks in order, part by part, the parts added in order 0..split-1.
That order depends on the K partition (``split`` and ``block_k``) only, never on the tile's width,
its row count, warps or stages: every weight has one ``LinearPlan`` whose two launches (``step`` up
to 16 rows: an AR step, a chain, a draft block; ``verify`` beyond) share that partition, and every
row count from 1 to ``MAX_ROWS`` takes it. cuBLAS picks its kernels by row count, so it would round
a verify's rows otherwise than an AR step's; it takes only what no step reaches (forwards past
``MAX_ROWS``, which a decode's prefill no longer makes: its chunks are of 512 rows at most; float32,
CPU tensors). ``tests/engine/models/test_linear.py`` checks a row's bits across 1, 7, 17, 33 and 65
rows on the GPU for every plan, and in Triton's interpreter (whose dot runs as an explicit
sequential sum, the order the GPU's matrix unit keeps) on the CPU.

Which launch each weight takes is measured, not guessed: ``TUNED`` holds, per GPU architecture and
weight shape, the plan that beat cuBLAS (``benchmarks/kernel_bench.py linear``); any other weight
takes ``default_plan``, sized from its shape. A weight kept in GGUF blocks (``quant_kernel``) takes its
shape's plan too, unless ``TUNED_NATIVE`` (or a plans file's entry with a ``format``) has one for its
format and shape. The kernel switch is ``engine.models.fused``'s.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.models import fused
from engine.models.fused import gdc_launch_dependents, gdc_wait  # (None without them: PDL never on)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - installs without Triton use F.linear
    triton = None

# Rows the kernel takes: every decode step, verify (the engine's budgets stay below it: MAX_BUDGET in
# engine.config), replay and draft block, and every prefill chunk (``prefix_cache.PREFILL_CHUNK``);
# longer forwards (training's) take cuBLAS.
MAX_ROWS = 1024
ROW_BLOCK = 128  # rows per program at most (acc [block_n, 128] float32 in registers); more: row blocks
STEP_ROWS = 16  # up to here a plan's "step" launch (BLOCK_M 16), beyond its "verify" one
SHARED_BYTES = 200 * 2**10  # of an H100/H200 SM's 227 KB, what the pipeline stages may take
# Triton's interpreter (the CPU tests) runs tl.dot as NumPy's matmul, whose rounding depends on the
# matrix's shape: there the product is an explicit sum over K in order (as the GPU's matrix unit keeps
# it), so that a row's bits are checked not to depend on the launch on the CPU too.
_INTERPRET = triton is not None and triton.knobs.runtime.interpret
# Programmatic dependent launch for this kernel (issue #28), as ``quant_gluon.PDL`` is for the native products: a
# launch may start while the kernel before it runs (a decode step's norms, attention merges and SwiGLU products let
# it: ``fused.lets_dependents_launch``), asks for the first K blocks of its part of the weight into L2 (a 128-byte
# line of each row at a time, ``prefetch.global.L2``), then waits (``griddepcontrol.wait``) for that kernel's writes
# before it reads x; the same products in the same order, so the same bits. sm_90 and later; an option: on an H100
# (2026-12-07, sixteenth session; RESULTS.md) SmolLM2's AR step graph 960.3 -> 945.0 us, its budget-48 verify
# 1,089.2 -> 1,161.8 (its kernels longer than the gaps it closes), so off
PDL = False
TARGET_PROGRAMS = 264  # default_plan's split aims at two programs per SM of an H100/H200 (132 SMs)


@dataclass(frozen=True)
class LinearConfig:
    """One launch: output columns per tile, K per block, parts of K, warps, pipeline stages (at
    most: fewer where a verify's wider row tile leaves no room; stages never change the result), and
    rows per program at most (``row_block``: a power of two from 16 to ``ROW_BLOCK``; more rows take
    several row blocks, each reading the weight tile again, mostly from L2: at a small model's
    weights a verify's 49 rows in blocks of 16 beat one block of 64, 2026-12-03)."""

    block_n: int
    block_k: int
    split: int = 1
    num_warps: int = 4
    num_stages: int = 4
    row_block: int = ROW_BLOCK

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"LinearConfig.{name} must be a power of two >= 16, but got {value}")
        if not 16 <= self.row_block <= ROW_BLOCK or self.row_block & (self.row_block - 1):
            raise ValueError(f"LinearConfig.row_block must be a power of two in 16..{ROW_BLOCK}, got {self.row_block}")
        if self.split < 1 or self.num_warps not in (4, 8) or self.num_stages < 1:
            raise ValueError(f"LinearConfig needs split >= 1, num_warps 4 or 8 and num_stages >= 1, got {self}")


@dataclass(frozen=True)
class LinearPlan:
    """A weight's launches for every row count: ``step`` up to ``STEP_ROWS`` rows, ``verify`` beyond.
    Both must split K alike (the same ``split`` and ``block_k``), so that a row's sums run in one
    order whichever launch computes it."""

    step: LinearConfig
    verify: LinearConfig

    def __post_init__(self) -> None:
        if (self.step.split, self.step.block_k) != (self.verify.split, self.verify.block_k):
            raise ValueError("a LinearPlan's step and verify launches must split K alike (split and block_k), "
                             f"but got step {self.step} and verify {self.verify}")

    def for_rows(self, rows: int) -> LinearConfig:
        return self.step if rows <= STEP_ROWS else self.verify


def _plan(step: LinearConfig, verify: LinearConfig | None = None) -> LinearPlan:
    return LinearPlan(step, verify or step)


_C = LinearConfig
# H100/H200 (sm_90). Measured on an H200, 2026-12-02 (benchmarks/RESULTS.md, "few-row linear"): the
# weights of the Qwen3.5-27B and Qwen3-8B shapes, GPU us at 1 / 33 rows (cuBLAS's in brackets); and
# 2026-12-03 SmolLM2-135M's (`kernel_bench.py plans`: the fastest step and verify tiles of one K
# partition, the partition with the least total).
TUNED: dict[tuple[int, int], dict[tuple[int, int], LinearPlan]] = {
    (9, 0): {
        # 27B (`kernel_bench.py plans --shapes 27B --rows 1 33`, 2026-12-04): GDN in_proj 40.8/43.0 us
        # (cuBLAS 43.6/45.5), qkv 35.9/37.8 (37.3/38.7), gate_up 85.2/100.8 (88.4/94.5), down 45.0/48.0
        # (49.4/49.3), lm_head 563.5/593.4 (617.7/632.1); against the plans of 2026-12-02 on one machine
        # the 27B verify@32 took 17.49 ms instead of 17.73 (its AR step 13.9 ms with either)
        (16480, 5120): _plan(_C(64, 128, 1, 4, 3)),
        (14336, 5120): _plan(_C(128, 128, 1, 8, 4)),
        (34816, 5120): _plan(_C(64, 128, 1, 4, 3), _C(64, 128, 1, 4, 6)),
        (5120, 17408): _plan(_C(64, 128, 3, 4, 4), _C(128, 128, 3, 8, 5)),
        (248320, 5120): _plan(_C(64, 128, 1, 4, 3), _C(128, 128, 1, 8, 4)),
        # 8B: qkv 15.0/16.3 (16.8/16.4), o_proj 12.1/15.1 (12.7/13.6), gate_up 48.0/52.2 (49.8/51.4), down
        # 27.5/30.1 (29.0/29.2), lm_head 277/292 (297/307): the step launches of 2026-12-02, the verify
        # tiles measured under their K partitions on 2026-12-04 (`kernel_bench.py plans --keep-step`;
        # the 8B verify@32 went from 1.25x to 1.19x an AR step, the 27B's tiles stayed the fastest)
        (6144, 4096): _plan(_C(64, 128, 1, 4, 6), _C(64, 128, 1, 4, 8)),
        (4096, 4096): _plan(_C(64, 128, 1, 4, 6), _C(64, 128, 1, 8, 4, 32)),
        (24576, 4096): _plan(_C(64, 128, 1, 4, 3), _C(64, 128, 1, 4, 2)),
        (4096, 12288): _plan(_C(64, 128, 4, 4, 4), _C(64, 128, 4, 4, 3)),
        (151936, 4096): _plan(_C(64, 128, 1, 4, 3), _C(128, 128, 1, 8, 5)),
        # 27B out-projections (GDN out_proj, attention o_proj): 18.7/21.1 us (cuBLAS 17.9/18.6), the
        # fastest tiles under one K partition (on cuBLAS before issue #21); 2026-12-04
        (5120, 6144): _plan(_C(64, 128, 3, 4, 4), _C(64, 128, 3, 4, 3)),
        # SmolLM2-135M (`kernel_bench.py plans --shapes SmolLM2 --rows 1 16 49`, 2026-12-03), us at 1/16/49
        # rows (cuBLAS's): qkv 3.5/3.6/3.6 (3.8/3.4/3.4), o_proj 3.0/3.0/3.3 (3.2/3.3/3.3), gate_up
        # 4.0/4.0/4.4 (4.2/4.2/4.2), down 4.9/5.0/6.0 (5.3/5.2/5.2), lm_head 15.7/16.2/17.8 (16.0/16.6/18.3)
        (960, 576): _plan(_C(32, 128, 1, 4, 4), _C(32, 128, 1, 4, 4, 16)),
        (576, 576): _plan(_C(32, 128, 1, 4, 4), _C(32, 128, 1, 4, 4, 16)),
        (3072, 576): _plan(_C(64, 128, 1, 4, 4), _C(64, 128, 1, 4, 4, 32)),
        (576, 1536): _plan(_C(32, 128, 6, 4, 4), _C(32, 128, 6, 4, 4, 32)),
        (49152, 576): _plan(_C(64, 64, 1, 4, 2)),
    },
}
# The GGUF block formats the few-row block kernel decodes (``quant_kernel``), in the order of its format codes.
BLOCK_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# Plans of weights kept in GGUF blocks, by (format, N, K), where a launch of their own beat the shape's plan on the
# block kernel (``kernel_bench.py quant-plans``): a block kernel's decode is latency-bound where the dense kernel
# streams, so at a small model's short K (SmolLM2's 576) its best tiles and K partition are not the dense ones.
# A block weight without an entry takes its shape's plan and so rounds as its dequantized twin does; with one its K
# splits its own way: its rows still sum alike at every row count (one partition a weight), but native and
# dequantized weights then round apart at near-ties, each exact against its own AR.
TUNED_NATIVE: dict[tuple[int, int], dict[tuple[str, int, int], LinearPlan]] = {
    # none: on sm_90 in bf16 SmolLM2's Q4_1 weights take quant_gluon's decode (2026-12-07), and the Q8_0 head plan
    # measured then (RESULTS.md, thirteenth session) is of a shape no native weight of ours has (SmolLM2's is tied)
    (9, 0): {},
}
_CAPABILITY: dict[torch.device, tuple[int, int]] = {}


def default_plan(n: int, k: int) -> LinearPlan:
    """The launch of a weight nothing was measured for, from its shape alone: tiles of 64 columns,
    K in blocks of 128 (64 for a K under 1,024: more parts for the narrow outputs of small models),
    and K split until about ``TARGET_PROGRAMS`` programs run (a part at least two blocks long)."""
    block_k = 128 if k >= 1024 else 64
    tiles = -(-n // 64)
    blocks = -(-k // block_k)
    split = max(1, min(blocks // 2, -(-TARGET_PROGRAMS // tiles)))
    return _plan(LinearConfig(64, block_k, split, 4, 4))


# Files of measured plans (``kernel_bench.py plans --out FILE``, ``quant-plans --out FILE``) for weights of your own
# model or GPU, read once: a dense weight's plan there comes before ``TUNED``'s on every GPU, a block weight's
# (an entry with a ``format``) before ``TUNED_NATIVE``'s (measure on the GPU you run).
PLANS_ENV = "ENGINE_LINEAR_PLANS"
_FILE_PLANS: dict[str, dict[tuple, LinearPlan]] = {}
_CONFIG_FIELDS = ("block_n", "block_k", "split", "num_warps", "num_stages", "row_block")


def load_plans(path: str) -> dict[tuple, LinearPlan]:
    """The plans in ``path``, a JSON list as ``kernel_bench.py plans --out`` (or ``quant-plans --out``) writes
    it: one object per weight with ``n`` and ``k`` (its out and in features), ``step`` and ``verify`` launches
    (objects with ``LinearConfig``'s fields) and, for a weight kept in GGUF blocks, its ``format`` (one of
    ``BLOCK_FORMATS``; keyed (format, n, k), as ``TUNED_NATIVE``). Anything else raises ``ValueError`` naming
    the file, the entry and the rule, so that a mistyped file never decodes on a launch nobody chose."""
    try:
        with open(path) as f:
            entries = json.load(f)
    except OSError as exc:
        raise ValueError(f"{PLANS_ENV}: cannot read {path!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{PLANS_ENV}: {path!r} is not JSON: {exc}") from None
    if not isinstance(entries, list):
        raise ValueError(f"{PLANS_ENV}: {path!r} must hold a list of plans (kernel_bench.py plans --out), "
                         f"got a {type(entries).__name__}")
    plans: dict[tuple, LinearPlan] = {}
    for i, e in enumerate(entries):
        where = f"{PLANS_ENV}: {path!r} entry {i}"
        if not isinstance(e, dict) or not all(key in e for key in ("n", "k", "step", "verify")):
            raise ValueError(f"{where} must be an object with n, k, step and verify")
        n, k = e["n"], e["k"]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (n, k)):
            raise ValueError(f"{where}: n and k must be positive integers, got n={n!r} k={k!r}")
        fmt = e.get("format")
        if fmt is not None and fmt not in BLOCK_FORMATS:
            raise ValueError(f"{where}: format must be one of {', '.join(BLOCK_FORMATS)} (a weight kept in those "
                             f"GGUF blocks) or absent (a dense weight), got {fmt!r}")
        launches = []
        for kind in ("step", "verify"):
            c = e[kind]
            if not isinstance(c, dict) or set(c) != set(_CONFIG_FIELDS) or not all(
                    isinstance(c[f], int) and not isinstance(c[f], bool) for f in _CONFIG_FIELDS):
                raise ValueError(f"{where}: {kind} must be an object of the integers {', '.join(_CONFIG_FIELDS)}, "
                                 f"got {c!r}")
            try:
                launches.append(LinearConfig(**c))
            except ValueError as exc:
                raise ValueError(f"{where}: {kind}: {exc}") from None
        try:
            plans[(n, k) if fmt is None else (fmt, n, k)] = LinearPlan(*launches)
        except ValueError as exc:
            raise ValueError(f"{where} ({n} x {k}): {exc}") from None
    return plans


def file_plans() -> dict[tuple, LinearPlan]:
    """The plans of the files ``ENGINE_LINEAR_PLANS`` names (none when unset; several separated by ``os.pathsep``,
    e.g. a dense weights' ``plans --out`` and a GGUF's ``quant-plans --out``), read once per value of the variable;
    a weight planned in two of them is refused, naming both."""
    value = os.environ.get(PLANS_ENV, "")
    if value not in _FILE_PLANS:
        plans: dict[tuple, LinearPlan] = {}
        where: dict[tuple, str] = {}
        for path in dict.fromkeys(p for p in value.split(os.pathsep) if p):  # (a file named twice: once)
            for key, plan in load_plans(path).items():
                if key in where:
                    raise ValueError(f"{PLANS_ENV}: {where[key]!r} and {path!r} both plan the weight {key}: a "
                                     "weight takes one plan (keep one of the entries)")
                plans[key], where[key] = plan, path
        _FILE_PLANS[value] = plans
    return _FILE_PLANS[value]


def plan_for(weight: Tensor) -> LinearPlan:
    """``weight``'s plan on its GPU: the file's (``ENGINE_LINEAR_PLANS``), else the tuned one, else
    ``default_plan``."""
    return plan_for_shape(*weight.shape, weight.device)


def capability(dev: torch.device) -> tuple[int, int]:
    """``dev``'s compute capability, asked once per device ((0, 0) off CUDA: a CPU tensor reaches the
    kernels in Triton's interpreter only, the CPU tests)."""
    if dev not in _CAPABILITY:
        _CAPABILITY[dev] = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else (0, 0)
    return _CAPABILITY[dev]


def plan_for_shape(n: int, k: int, dev: torch.device, fmt: str | None = None) -> LinearPlan:
    """``plan_for`` of an ``[n, k]`` weight on ``dev``; a weight kept in ``fmt``'s GGUF blocks (``quant_kernel``)
    first takes its own (the file's, then ``TUNED_NATIVE``'s: measured on the block kernel, so before a file's
    plan of the dense shape), else the shape's (the file's, then ``tuned_plan``'s)."""
    files = file_plans()
    cap = capability(dev)
    native = None if fmt is None else files.get((fmt, n, k)) or TUNED_NATIVE.get(cap, {}).get((fmt, n, k))
    return native or files.get((n, k)) or tuned_plan(n, k, cap)


def tuned_plan(n: int, k: int, arch: tuple[int, int], fmt: str | None = None) -> LinearPlan:
    """The plan this repository measured for an ``[n, k]`` weight (in ``fmt``'s blocks: ``TUNED_NATIVE`` first) on
    GPUs of compute capability ``arch``, else ``default_plan``; no plans file (``benchmarks/kernel_check.py``
    compiles these)."""
    native = None if fmt is None else TUNED_NATIVE.get(arch, {}).get((fmt, n, k))
    return native or TUNED.get(arch, {}).get((n, k)) or default_plan(n, k)


def launch_config(x: Tensor, weight: Tensor) -> LinearConfig | None:
    """The launch for ``x``'s rows against ``weight`` on its GPU (its plan's), or None (cuBLAS:
    more rows than ``MAX_ROWS``)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if not 1 <= rows <= MAX_ROWS:
        return None
    return plan_for(weight).for_rows(rows)


def use_kernel(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether these operands can take the kernel at all (half precision on CUDA, no gradient,
    rows the kernel reads: a weight with contiguous rows, as many inputs as its columns)."""
    if triton is None or not fused.use_kernels(x, weight, *([] if bias is None else [bias])):
        return False
    return (x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and weight.dim() == 2
            and weight.stride(-1) == 1 and x.shape[-1] == weight.shape[1] and (bias is None or bias.dtype == x.dtype))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, config: LinearConfig | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``: through the kernel (the weight's plan, or ``config`` for
    benchmarks and tests) for up to ``MAX_ROWS`` half-precision rows on CUDA, else cuBLAS."""
    if not use_kernel(x, weight, bias):
        return F.linear(x, weight, bias)
    config = config or launch_config(x, weight)
    if config is None:
        return F.linear(x, weight, bias)
    return _kernel_linear(x, weight, bias, config)


def _kernel_linear(x: Tensor, weight: Tensor, bias: Tensor | None, cfg: LinearConfig) -> Tensor:
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    block_m = min(cfg.row_block, max(16, triton.next_power_of_2(m)))
    row_blocks = triton.cdiv(m, block_m)
    tiles = triton.cdiv(n, cfg.block_n)
    k_iters, split = k_parts(k, cfg)
    stages = stages_for(cfg, block_m, x.element_size())
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    parts = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else out
    tickets = _tickets(x.device, tiles * row_blocks)
    pdl = PDL and fused.lets_dependents_launch(x.device)
    _linear_kernel[(tiles, split, row_blocks)](
        x2, weight, bias if bias is not None else out, out, parts, tickets, m, n, k, x2.stride(0), weight.stride(0),
        k_iters, split, tiles, HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_M=block_m, INTERPRET=_INTERPRET, PDL=pdl,
        num_warps=cfg.num_warps, num_stages=stages, launch_pdl=pdl,
    )
    return out.view(*lead, n)


def k_parts(k: int, cfg: LinearConfig) -> tuple[int, int]:
    """(K blocks a part, parts) of a launch of ``cfg`` over K = ``k``: ``cfg.split`` parts of whole K blocks, fewer
    where those fill K sooner. Every few-row kernel cuts K so (``quant_kernel``'s too): the same sums."""
    k_iters = triton.cdiv(triton.cdiv(k, cfg.split), cfg.block_k)
    return k_iters, triton.cdiv(k, k_iters * cfg.block_k)


def stages_for(cfg: LinearConfig, block_m: int, itemsize: int) -> int:
    """Pipeline stages of a launch: ``cfg.num_stages``, fewer where a verify's wider row tile leaves
    no room for them (stages never change the arithmetic)."""
    stage_bytes = (cfg.block_n + block_m) * cfg.block_k * itemsize
    return max(2, min(cfg.num_stages, SHARED_BYTES // stage_bytes))


_TICKETS: dict[torch.device, Tensor] = {}
_RETIRED: list[Tensor] = []  # smaller ticket buffers replaced by a larger one: graphs may still use them


def _tickets(device: torch.device, tiles: int) -> Tensor:
    """Per column tile, how many parts have finished: zero between launches (the last part resets
    its tile's), one buffer per device (the engine's launches run on one stream, one after another).
    A launch with more tiles gets a larger buffer; the smaller one is kept alive, since a captured
    CUDA graph may still point at it (the runtime's warm-up run makes buffers outside capture)."""
    buf = _TICKETS.get(device)
    if buf is None or buf.numel() < tiles:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _TICKETS[device] = buf
    return buf


if triton is not None:

    @triton.jit
    def launch_tile(M, N, K, k_iters, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr):
        """A few-row launch's program (grid: output tiles, parts of K, row blocks): its tile, part and row block,
        the tile's output columns ``rn`` and rows ``rm`` with their masks, and its part's K range [k_lo, k_hi).
        Shared by every few-row kernel (``quant_kernel``'s too), so their launches cut alike."""
        tile = tl.program_id(0)
        part = tl.program_id(1)
        row_block = tl.program_id(2)
        rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        k_lo = part * k_iters * BLOCK_K
        return tile, part, row_block, rn, rm, rn < N, rm < M, k_lo, tl.minimum(k_lo + k_iters * BLOCK_K, K)

    @triton.jit
    def prefetch_rows(ptr, rows, lo, hi):
        """``prefetch.global.L2`` of columns ``lo``..``hi`` of 2-byte rows at ``ptr + rows``: a 128-byte line (64
        columns) an instruction a row, a hint (nothing waits for it, a line past the rows' end is not read)."""
        for c in range(lo, hi, 64):
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptr + rows + c],
                                      dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def tile_product(acc, w, xt, INTERPRET: tl.constexpr):
        """``acc + w @ xt`` in float32: the matrix unit's (``tl.dot``), or in Triton's interpreter, whose dot is
        NumPy's matmul (its rounding depends on the shape), the sum over K in order, one product at a time: a row's
        own order whatever the rows beside it. Shared by every few-row kernel."""
        if INTERPRET:
            return acc + tl.sum(w.to(tl.float32)[:, :, None] * xt.to(tl.float32)[None, :, :], axis=1)
        return tl.dot(w, xt, acc)

    @triton.jit
    def store_rows(acc, out_ptr, b_ptr, part_ptr, ticket_ptr, part, row_block, tile, tiles, split, M, N, rm, rn, mm, mn,
                   HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
        """A tile's sums ``acc`` [BLOCK_N, BLOCK_M] (out's transpose) into ``out``, with the bias; split
        over K, each part's sum then a ticket: the part that takes the last one adds every part in order
        0..split-1 (the same bits whichever finished last) and resets the ticket. Shared by every
        few-row kernel (``quant_kernel``'s too), so their rows round alike."""
        out_offs = rm[None, :].to(tl.int64) * N + rn[:, None]
        omask = mn[:, None] & mm[None, :]
        if split > 1:
            tl.store(part_ptr + part * M * N + out_offs, acc, mask=omask)
            tl.debug_barrier()  # every thread's partial sums stored before the ticket is taken
            ticket_at = ticket_ptr + row_block * tiles + tile
            ticket = tl.atomic_add(ticket_at, 1, sem="acq_rel")
            if ticket == split - 1:
                acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
                for p in range(0, split):
                    acc += tl.load(part_ptr + p * M * N + out_offs, mask=omask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    acc += tl.load(b_ptr + rn, mask=mn, other=0.0).to(tl.float32)[:, None]
                tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=omask)
                tl.atomic_xchg(ticket_at, 0)  # ready for the next launch
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=mn, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=omask)

    # Not specialised on the rows or the split: an AR step and a verify run one compiled variant
    # per BLOCK_M, and the parts of K sit where they sit whatever the rows. A part starts at a
    # multiple of BLOCK_K (k_iters blocks a part): the compiler knows its alignment, so the tiles
    # load 16 bytes at a time through the pipelined asynchronous copies.
    @triton.jit(do_not_specialize=["M", "k_iters", "split", "tiles"])
    def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, ticket_ptr, M, N, K, sxm, swn, k_iters, split, tiles,
                       HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
        tile, part, row_block, rn, rm, mn, mm, k_lo, k_hi = launch_tile(M, N, K, k_iters, BLOCK_N, BLOCK_K, BLOCK_M)
        if PDL:  # the part's first K blocks asked for while the kernel before runs; x once it has ended (linear.PDL)
            # (at most 4 blocks, as a pipeline holds: the whole part of every program at once, past L2's size on a
            # wide weight, would be evicted before its loop reads it)
            prefetch_rows(w_ptr, tl.where(mn, rn, 0).to(tl.int64) * swn, k_lo, tl.minimum(k_hi, k_lo + 4 * BLOCK_K))
            gdc_wait()
            gdc_launch_dependents()
        rk = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * swn + (k_lo + rk)[None, :]
        x_ptrs = x_ptr + rm[None, :].to(tl.int64) * sxm + (k_lo + rk)[:, None]
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs, mask=mn[:, None], other=0.0)
                xt = tl.load(x_ptrs, mask=mm[None, :], other=0.0)
            else:
                mk = (k0 + rk) < k_hi
                w = tl.load(w_ptrs, mask=mn[:, None] & mk[None, :], other=0.0)
                xt = tl.load(x_ptrs, mask=mk[:, None] & mm[None, :], other=0.0)
            acc = tile_product(acc, w, xt, INTERPRET)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        store_rows(acc, out_ptr, b_ptr, part_ptr, ticket_ptr, part, row_block, tile, tiles, split, M, N, rm, rn, mm,
                   mn, HAS_BIAS, BLOCK_N, BLOCK_M)
