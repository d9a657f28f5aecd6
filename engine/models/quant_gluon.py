"""Q4_K, Q6_K and Q4_1 weights decoded straight into the matrix unit's operand registers on Hopper (issue #28), in
Gluon (Triton's explicit-layout dialect), so no decoded value touches shared memory: a native GGUF's Q4_K, Q6_K and
Q4_1 projections on an sm_90 GPU in bf16 (``hold_operands_``, at load) take it for every product, an AR step's, a
verify's of any budget, a prefill's (the AR step of the 27B Q4_K_M shape 2.45x faster than ``quant_kernel``'s on
an H100, 9.5 against 23.3 ms, 2026-12-06; 9.1 since ``MIN_BLOCK_M`` 8; benchmarks/RESULTS.md).

Why: on an H100 (2026-12-06, ``benchmarks/quant_ncu.py``) the engine's few-row Q4_K launch keeps the L1/shared
pipe 80% busy at 25% of DRAM's bandwidth. Its decoded bf16 tile goes through shared memory into the layout of
``tl.dot``'s A operand (2 bytes a value written, 2 read): at the roofline's pace that round trip alone would
take most of an SM's 128 bytes a cycle. Plain Triton chooses the decode's layout itself; Gluon lets this kernel
name it.

The layout. Hopper's ``warpgroup_mma`` takes A from registers in ``DotOperandLayout(0, parent, k_width=2)``: for
a 64 x 128 tile on 4 warps, lane ``4 g + t`` of warp ``w`` holds rows ``16 w + 8 h + g`` and columns
``16 s + 8 j + 2 t + e`` (register bits e, h, j, then s's three). So one 32-bit word holds exactly a thread's 8
values of one 16-column slice: nibble ``4 j + 2 h + e`` (``repack``, at load). A thread's 8 words (s = 0..7) are two
runs of 4 (two 16-byte loads), ordered so that each of a warp's two loads reads 512 contiguous bytes; a warp's 256
words are one 1 KB run. The 8 nibbles are decoded into 8 tensors, joined
(the outermost join is register bit 0: e, then h, then j), reshaped and permuted into [64, 128]; the conversion into
the operand layout is then a renaming, checked at compile time (``convert_layout(..., assert_trivial=True)``:
that the layout is the operand's; where each nibble lands within a thread is the joins' order, which a CPU test
replays).

Two decodes of Q4_K. The float one: ``d * scale * q - dmin * min`` in float32 with one rounding (a fused
multiply-add), then bf16: the bits ``quant.dequantize`` gives, and so the engine kernel's. The pair one
(``pairs``: nibble ``4 e + 2 j + h``, a register's two columns 16 bits apart): one ``LOP3`` makes their bf16 pair
128 + q, ``HADD2`` takes 128 off, ``HFMA2`` gives q * bf16(d * scale) + bf16(-dmin * min), one rounding
(``benchmarks/quant_packed.values``'s numbers, not ``dequantize``'s: the weights a native load holds here, so
its products are not bit-equal to a dequantized load's, whose values are ``dequantize``'s; exactness is against AR
on the same weights). Q6_K has the pair decode (``repack_q6_k``): its low
nibbles as Q4_K's pair words, its top 2 bits in words of their own, (q - 32) * bf16(d * scale). Q4_1 (SmolLM2's
file; ``repack_q4_1``) is Q4_K's pair decode with a 32-value block's bf16(d) and bf16(m) packed into one word at load
(q * bf16(d) + bf16(m)), its K (576: 4.5 tiles) padded with zero planes to whole tiles and x's columns past it not
read (``K_MASK``; its split by the Q4_K rule: K = 576's 5 tiles one part). A row's bits never
depend on the rows beside it, which is what exactness against AR needs: a launch of more than 64 rows takes them in
blocks of 64 (``ROW_BLOCK``), each block's rows summed as a lone row's, so every launch of a decode (an AR step, a
verify of any budget) reads one weight.

The block's 16-byte head (d, dmin, the packed 6-bit scales and mins) stays as the file has it, in a plane of its own
(``repack``: one 16-byte load a thread); each (row, 32-value sub-block)'s scale and min are decoded by one thread and
passed to the lanes that need them (the pair decode: as one bf16 pair, by warp shuffles; the float decode: through a
little shared memory). The next tile's words and heads are read an iteration ahead (``x_ahead``: its x rows too; or
copied ahead into shared memory by cp.async: an AR step's launches of fewer programs than SMs, a small model's,
``FEW_ROWS_STAGES``, and any launch with ``STAGES``, an option measured no faster; ``PDL``, the engine's: a launch asks
for its weight's tiles while the kernel ahead of it runs). The K order is the natural one, 16 columns an instruction.
Rows past N are padded to whole 64-row tiles; K must be whole 256-value blocks (Q4_1: 32-value ones); a program takes up
to 64 rows (``BLOCK_M`` 8, 16, 32 or 64 from ``MIN_BLOCK_M``; more rows, more row blocks; ``TAILS``: 33-48 rows as 32
and a tail of 8 or 16, two products of one decoded tile: a verify of budget 32 18.7 -> 17.7 ms) on 4 or 8 warps (a 64-
or 128-row tile: ``_warps``; ``MAXNREG``: a tail's 8-warp launch capped at 128 registers; ``WIDE_WARPS``, an option: a
verify's launches on 16, 256-row tiles). Split over K (``split_for``):
each part's fp32 sums, added in order 0..split-1 by the part that finishes last, in the kernel (the engine's tickets);
an even split's in pairs first (parts 2j and 2j + 1, then those sums in order), so that a verify's launch may take
two parts a program, the program adding its pair (``folds``, an option: ``FOLD_FROM``): the same bits from fewer
programs.
The planes and the weights they hold are in ``quant_gluon_planes.py``, the kernels in ``quant_gluon_kernels.py`` (the
staged tiles in ``quant_gluon_staged.py``, what both share in ``quant_gluon_decode.py``).

No interpreter runs Gluon: the CPU tests check the planes' order against the GGUF bytes and the references
(``reference``, ``reference_q6_k``, ``reference_q4_1``) against ``quant.dequantize`` and an independent reading, replay
the kernels' joins and permutations in PyTorch, and compile them for sm_90; on a GPU,
``tests/engine/models/test_quant_gluon.py`` checks that one-hot rows read each kernel's weight back bit for bit, column
block by column block, and rows invariant (Q4_1's: ``test_quant_gluon_q4_1.py``; the options' own bits:
``test_quant_gluon_options.py``).
``benchmarks/quant_gluon.py`` counts the kernels' instructions and times them against the engine's other kernel.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from engine.models import fused, quant
from engine.models import linear as rows_linear
from engine.models import quant_gluon_kernels as kernels
from engine.models import quant_gluon_planes as planes_module
from engine.models.quant_gluon_kernels import gluon  # None: a Triton without Gluon
from engine.models.quant_gluon_planes import (  # noqa: F401 (the planes' names, quant_gluon's as before)
    Q4_1,
    Q4_K,
    TILE_K,
    TILE_N,
    padded_cols,
    padded_rows,
    reference,
    reference_q4_1,
    reference_q6_k,
    repack,
    repack_q4_1,
    repack_q6_k,
    round_bf16,
)


def linear(x: Tensor, words: Tensor, heads: Tensor, n: int, cols: int, split: int = 1, pairs: bool = False,
           x_ahead: bool = False, warps: int | None = None, stages: int | None = None,
           fold: bool | None = None) -> Tensor:
    """``x @ W^T`` [M, n] in x's dtype (bf16), W the repacked Q4_K weight (``repack`` with the same ``pairs``), for
    any rows (blocks of up to 64), on a GPU; ``x_ahead``: x's rows read an iteration ahead too, ``warps`` 4, 8 or 16
    (``_warps``), ``stages`` (the pair decode; ``STAGES`` by default) the tiles in flight through shared memory,
    ``fold`` two parts of an even split a program (``folds``' rule by default): the same bits whichever."""
    stages = _stages(stages, pairs, x_ahead, x, heads.shape[0], cols, split)
    return _launch(kernels._gluon_kernel, x, (words, heads), heads.shape[0], n, cols, split, warps,
                   _fold(fold, "Q4_K"), PAIRS=pairs, X_AHEAD=x_ahead, STAGES=stages)


# Tiles a program has in flight through shared memory, for every launch: ``STAGES - 1`` copied ahead by cp.async (no
# registers held, so a program's bytes in flight are not bounded by its registers); 0 (or 1): the register path, the
# next tile's planes read an iteration ahead into registers; None: the engine's, the register path but for an AR
# step's launches of few programs (``FEW_ROWS_STAGES``). Staged, the K loop takes 30-50 more instructions (cp.async,
# its waits, two more CTA barriers): on an H100 (2026-12-06, tenth session; RESULTS.md) 1-row launches within a few %
# of the register path's (Q6_K's down faster, 40.2 -> 33.5 us at BLOCK_M 16: fewer registers), the 27B Q4_K_M AR
# step 9.5 -> 9.3 ms and its verify at 32 slower (18.67 -> 19.66 ms: 64-row programs at 78 KB of shared memory).
# Bits equal to the register path's (GPU tests)
STAGES: int | None = None

# Programmatic dependent launch: each launch may start as the kernel before it ends (its programs placed as that
# kernel's leave room), asking for its weight's first tiles before it waits (``griddepcontrol.wait``) for x, and
# lets the kernel after it do the same; what it writes waits too. The weight is read before the wait, so it holds
# where the launch just before did not write the planes (nothing in a step does: they are written at load, and a
# load's last kernels are not a product's predecessor in a step). A decode step's norms, attention merges and SwiGLU
# products let the launch after them start as they start (``fused.lets_dependents_launch``). On an H100 (2026-12-07,
# fifteenth session, those kernels letting it; RESULTS.md), SmolLM2's native step graphs: AR 965.2 -> 918.1 us (gaps
# between kernels 106.5 -> 39.3 us; the dequantized step 953.5), verify at budget 22 1,236.0 -> 1,182.1, at 48
# 1,416.3 -> 1,360.9; the 27B Q4_K_M AR step 9.0 -> 8.7 ms, its verify at 32 17.24 -> 17.04 (2026-12-06, before the
# kernels let it: 9.1 -> 9.0 and 18.61 -> 18.76; PDL with them and without them not compared on one machine). A chain
# of launches reading each other's outputs and those kernels' keeps its bits, on a stream and from a graph (GPU test)
PDL = True


# A launch of at most ``MIN_BLOCK_M`` rows (an AR step's) whose programs (a tile and part each) are fewer than the
# GPU's SMs (a small model's weights: SmolLM2's 9-54 on 132) takes every tile of its part of K in flight through
# shared memory at once, up to this many stages: a program's K loop is then the launch's time, and one tile ahead
# in registers leaves each iteration a memory round trip. 0: the register path, as any other launch
FEW_ROWS_STAGES = 6

# The most rows a launch takes ``FEW_ROWS_STAGES``' rule at (None: ``MIN_BLOCK_M``, an AR step's; up to ``ROW_BLOCK``
# a verify's too, whose staged launch takes no tail: the same bits, a column's sums not depending on the product's
# width). Not measured past ``MIN_BLOCK_M`` (``gpu_bench --gluon-staged-rows``): an option
STAGED_ROWS: int | None = None


@functools.cache
def _sms(device: torch.device) -> int:
    """The GPU's SMs; off a GPU (the CPU tests' launches and planes) an H100's and H200's 132."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def few_rows_stages(rows: int, n_pad: int, cols: int, split: int, sms: int) -> int:
    """``FEW_ROWS_STAGES``' stages for a launch of ``rows`` over ``n_pad`` padded rows (64-row tiles), ``cols`` and
    ``split`` parts of K on a GPU of ``sms`` SMs: its part's tiles and one more (all in flight), at most
    ``FEW_ROWS_STAGES``, where the rows are at most ``STAGED_ROWS`` (``MIN_BLOCK_M``) and the programs fewer than the
    SMs (at 64-row tiles: a launch of 128-row tiles has fewer); else 0."""
    most = MIN_BLOCK_M if STAGED_ROWS is None else STAGED_ROWS
    if FEW_ROWS_STAGES < 2 or rows > most or n_pad // TILE_N * split >= sms:
        return 0
    return max(2, min(FEW_ROWS_STAGES, padded_cols(cols) // TILE_K // split + 1))


def _stages(stages: int | None, pairs: bool, x_ahead: bool, x: Tensor | None = None, n_pad: int = 0, cols: int = 0,
            split: int = 1) -> int:
    """A launch's stages: ``stages``, or when None ``STAGES``, or when that is None too, for x on a GPU with the pair
    decode, x not ahead, ``few_rows_stages``' (else 0). 0 / 1 the register path; 2 or more the pair decode only, x
    staged with the planes (no ``x_ahead``). The bits are the same whichever."""
    if stages is None:
        stages = STAGES
    if stages is None:
        on_gpu = pairs and not x_ahead and x is not None and x.is_cuda
        stages = few_rows_stages(x.shape[0], n_pad, cols, split, _sms(x.device)) if on_gpu else 0
    if stages > 1 and (not pairs or x_ahead):
        raise ValueError(f"stages={stages}: shared-memory stages take the pair decode with x staged beside the "
                         f"planes (pairs=True, x_ahead=False), not pairs={pairs}, x_ahead={x_ahead}")
    return max(stages, 0)


def linear_q6_k(x: Tensor, planes: tuple[Tensor, Tensor, Tensor, Tensor], n: int, cols: int, split: int = 1,
                x_ahead: bool = False, warps: int | None = None, stages: int | None = None,
                fold: bool | None = None) -> Tensor:
    """``x @ W^T`` [M, n] for W the Q6_K weight ``repack_q6_k``'s planes hold (``reference_q6_k``'s values), for
    any rows, on a GPU; the options as ``linear``'s."""
    return _launch(kernels._q6_kernel, x, planes, planes[3].shape[0], n, cols, split, warps, _fold(fold, "Q6_K"),
                   X_AHEAD=x_ahead,
                   STAGES=_stages(stages, True, x_ahead, x, planes[3].shape[0], cols, split))


def linear_q4_1(x: Tensor, planes: tuple[Tensor, Tensor], n: int, cols: int, split: int = 1, x_ahead: bool = False,
                warps: int | None = None, stages: int | None = None, fold: bool | None = None) -> Tensor:
    """``x @ W^T`` [M, n] for W the Q4_1 weight ``repack_q4_1``'s planes hold (``reference_q4_1``'s values), for
    any rows and any K of whole 32-value blocks (the planes padded to 128-column tiles, x's columns past K not
    read), on a GPU; the options as ``linear``'s."""
    return _launch(kernels._q4_1_kernel, x, planes, planes[1].shape[0], n, cols, split, warps, _fold(fold, "Q4_1"),
                   X_AHEAD=x_ahead,
                   STAGES=_stages(stages, True, x_ahead, x, planes[1].shape[0], cols, split),
                   K_MASK=cols % TILE_K != 0)


def _launch(kernel, x: Tensor, planes: tuple[Tensor, ...], n_pad: int, n: int, cols: int, split: int,
            warps: int | None, fold: bool | None = None, **constexprs) -> Tensor:
    """One launch: a program a tile of ``16 * warps`` rows, a part of K (whole 128-column tiles of the planes'
    padded K; ``fold``, None for ``folds``' rule: two of the weight's ``split`` parts) and a block of up to
    ``ROW_BLOCK`` of x's rows; the parts' sums added in the kernel (the engine's tickets, one a tile and row block;
    an even split's in pairs first, ``PAIRED``), so the output is bf16 straight away."""
    m = x.shape[0]
    k_tiles = padded_cols(cols) // TILE_K
    assert x.dtype == torch.bfloat16 and m >= 1 and x.shape[1] == cols
    if split < 1 or k_tiles % split:
        raise ValueError(f"split={split}: a weight's K splits into whole 128-column tiles, a divisor of its "
                         f"{k_tiles}")
    stages = constexprs.get("STAGES", 0)
    block_m, tail = _rows_a_program(m, stages)
    # (a tail's launch takes the warps of its rows' power of two; WIDE_WARPS by wide_warps' rule)
    warps = _warps(_block_m(m), n_pad, warps, wide=wide_warps(block_m, stages, n_pad, split, _sms(x.device)))
    if warps == 16 and stages > 1:
        raise ValueError(f"warps=16 takes the register path (stages 0 or 1), not stages={stages}")
    tiles = n_pad // (16 * warps)
    if fold is None:
        fold = folds(block_m, stages, tiles, split, _sms(x.device), warps)
    elif fold and (split % 2 or stages > 1):
        raise ValueError(f"fold=True takes an even split on the register path (stages 0 or 1), not split={split}, "
                         f"stages={stages}")
    programs = split // 2 if fold else split  # a launch's parts of K
    row_blocks = -(-m // (block_m + tail))
    capped = MAXNREG and warps == 8 and tail
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    parts = torch.empty(programs if programs > 1 else 0, m, n, device=x.device, dtype=torch.float32)
    tickets = rows_linear._tickets(x.device, tiles * row_blocks if programs > 1 else 1)  # (a lone part: no ticket)
    kernel[(tiles, programs, row_blocks)](x.contiguous(), *planes, out, parts, tickets,
                                           m, n, cols, k_tiles // programs, programs, tiles, BLOCK_M=block_m,
                                           num_warps=warps, PDL=PDL, launch_pdl=PDL, TAIL=tail, FOLD=fold,
                                           PAIRED=split % 2 == 0 and not fold,
                                           **({"maxnreg": MAXNREG} if capped else {}), **constexprs)
    return out


# A launch of this many rows a program up to 32 (a verify's 32 + a tail, on 8 warps) of a ``FOLD_FORMATS`` weight
# whose split is even takes two of its parts a program (``folds``) where the folded programs fill the SMs in one wave:
# fewer programs, each adding its pair itself, as the last part adds an even split's pairs (``PAIRED``), so the bits
# are the unfolded launch's. None: never. On an H200 (2026-12-07, nineteenth session, ``quant_gluon.py --launches``;
# RESULTS.md), 33 rows: the 27B's GDN in_proj in 4 parts 33.4 us, folded 28.8 (in 2 unfolded 29.3); its o_proj in 12
# 20.4, folded 16.3; the gate_up in 2 folded (272 programs: a second wave of 8) 80.8 against 73.9; Q6_K's slower
# folded (its down in 8 parts 48.5 -> 64.1 us, o_proj in 6 17.6 -> 32.6: 8 bytes spilled, Triton 3.6). One split a
# weight serves both: the 1-row launches gain from more parts (``split_for``). Its GPU bits test passed (2026-12-07,
# twentieth session); at ``PROGRAMS_PER_SM`` 4 it takes the 27B's Q4_K down alone, and the verify at 32 went 16.31 ->
# 16.28 ms (H100, one run each): within noise, so an option: 32 turns it on (``gpu_bench --gluon-fold-from``)
FOLD_FROM: int | None = None
FOLD_FORMATS = ("Q4_K", "Q4_1")


def folds(block_m: int, stages: int, tiles: int, split: int, sms: int, warps: int = 8) -> bool:
    """Whether a launch of ``block_m`` rows a program over ``tiles`` tiles of ``warps`` warps folds its weight's
    ``split`` parts in pairs (``FOLD_FROM``; a format not in ``FOLD_FORMATS`` never, ``_fold``): from that many rows a
    program up to 32 (a tail's launch, capped at 128 registers: 64 rows a program take ~180, one program an SM, not
    measured folded), the register path, an even split, and the folded programs at least the ``sms`` and at most
    one wave of them (two 8-warp programs an SM at 128 registers, four of 4 warps, one of 16)."""
    folded = tiles * split // 2
    return (FOLD_FROM is not None and FOLD_FROM <= block_m <= 32 and stages <= 1 and split % 2 == 0
            and sms <= folded <= 16 // warps * sms)


def _fold(fold: bool | None, fmt: str) -> bool | None:
    """A launcher's ``fold`` for a weight of format ``fmt``: as asked, or where not asked (None: ``folds``' rule)
    False for a format not in ``FOLD_FORMATS``."""
    return False if fold is None and fmt not in FOLD_FORMATS else fold


ROW_BLOCK = 64  # x's rows a program multiplies at most (wgmma's N); more take several row blocks


# A launch's fewest rows a program: 8, wgmma's narrowest N. An AR step's launch compiles to 72 registers a thread (7
# programs an SM) where 16 takes 94 (5), Q6_K's to 85 (6) where 16 takes 107 (4) (static, sm_90), and Nsight found
# the 1-row launch at 16 short of warps (3.8 a scheduler). On an H100 (2026-12-06, tenth session; RESULTS.md): the
# 27B Q4_K_M AR step 9.5 -> 9.1 ms, its verify at 32 unchanged (18.67 -> 18.61 ms), 1 row of the Q6_K down 40.2 ->
# 32.5 us; its rows invariant against a verify's (GPU tests). 16 stays an option (``gpu_bench --gluon-min-rows``)
MIN_BLOCK_M = 8


def _block_m(m: int) -> int:
    """A launch's rows a program: the power of two from ``MIN_BLOCK_M`` to ``ROW_BLOCK`` that holds ``m`` (or
    ``ROW_BLOCK``)."""
    return min(ROW_BLOCK, max(MIN_BLOCK_M, 1 << (m - 1).bit_length()))


# A launch of 33-48 rows (a verify of budget 32 to 47) as two products of one decoded tile: 32 + 8 or 32 + 16 columns
# instead of 64 (``_rows_a_program``): fewer of the matrix unit's columns and of x's bytes. On an H100 (2026-12-07,
# RESULTS.md), with ``MAXNREG``: the 27B Q4_K_M verify at 32 18.67 -> 17.54-17.66 ms; without the cap 18.97 (one
# program an SM at 154 registers). 17-24 rows as 16 + 8 (``TAIL_FROM`` 32) measured 14.80-14.82 -> 14.95-15.09 ms
# at budget 22: they take 32. Rows bit for bit as a lone row's either way (GPU tests)
TAILS = True

# Registers a thread at most for a tail's 8-warp launch: 154 as ptxas allots them, one program an SM; at 128, two,
# with no spill in either kernel's K loop (static, sm_90). 8-warp launches of at most 32 rows without a tail, capped
# too, measured 14.86 against 14.80 ms at budget 22 (23 rows) and keep ptxas' own. None: ptxas' own
MAXNREG: int | None = 128

# The smallest power of two whose rows take a tail (``TAILS``): 64, i.e. 33-48 rows (32: 17-24 rows too)
TAIL_FROM = 64


def _rows_a_program(m: int, stages: int = 0) -> tuple[int, int]:
    """A launch's rows a program as (``BLOCK_M``, ``TAIL``): ``_block_m``'s, or with ``TAILS`` (the register path:
    ``stages`` 0 or 1) where that is at least ``TAIL_FROM``, half of it and a tail of 8 or 16 where the rest fits in a
    quarter of it (33-40 rows: 32 + 8, 41-48: 32 + 16, and at ``TAIL_FROM`` 32 17-24: 16 + 8; 49-64 take the power
    of two)."""
    block_m = _block_m(m)
    rest = m - block_m // 2
    if not TAILS or stages > 1 or m > ROW_BLOCK or block_m < TAIL_FROM or rest > block_m // 4:
        return block_m, 0
    return block_m // 2, 8 if rest <= 8 else 16


# The warps of a launch of 32 rows a program (``wide_warps``) where its padded rows are whole tiles of theirs (else 8,
# else 4): 8, a 128-row tile (the engine's), or 16, a 256-row tile: x read from L2 half as often again, one program an
# SM at 128 registers, no spill (64 rows a program spill on Triton 3.6: not taken). Static counts in
# benchmarks/RESULTS.md (2026-12-07); not yet run on a GPU: an option (``gpu_bench --gluon-wide-warps 16``)
WIDE_WARPS = 8


def wide_warps(block_m: int, stages: int, n_pad: int, split: int, sms: int) -> bool:
    """Whether a launch may take ``WIDE_WARPS``: 32 rows a program (a tail's first part), the register path, and wide
    tiles that times the ``split`` still number the ``sms`` (a small model's weight keeps its programs)."""
    return block_m == 32 and stages <= 1 and n_pad // (16 * WIDE_WARPS) * split >= sms


def _warps(block_m: int, n_pad: int, warps: int | None, wide: bool = True) -> int:
    """A launch's warps: for 32 rows or more ``WIDE_WARPS`` where ``wide`` and the padded rows are whole tiles of
    theirs, else 8 (x read from L2 half as often as at 4) over whole 128-row tiles, else 4; or as asked (4, 8, 16)."""
    if warps is None:
        if block_m >= 32 and wide and n_pad % (16 * WIDE_WARPS) == 0:
            return WIDE_WARPS
        return 8 if block_m >= 32 and n_pad % 128 == 0 else 4
    if warps not in (4, 8, 16) or n_pad % (16 * warps):
        raise ValueError(f"warps={warps}: a launch takes 4, 8 or 16 warps, 16 rows each, over whole tiles of the "
                         f"{n_pad} padded rows")
    return warps


def compile_for_hopper(block_m: int = 16, decode: str = "float", x_ahead: bool = False, warps: int = 4,
                       stages: int = 0, pdl: bool = False, tail: int = 0, fold: bool = False,
                       maxnreg: int | None = None):
    """The kernel compiled for sm_90 (no GPU needed): the launch ``linear`` (``decode`` float or pairs),
    ``linear_q6_k`` (q6_k) or ``linear_q4_1`` (q4_1: K not whole tiles, SmolLM2's 576) makes for ``block_m`` rows on
    ``warps`` warps with ``stages`` (``fold``: a program's two parts added by it, ``FOLD``; ``maxnreg``: registers
    a thread at most)."""
    import triton
    from triton.backends.compiler import GPUTarget

    common = {"x_ptr": "*bf16", "words_ptr": "*i32"}
    after = {"out_ptr": "*bf16", "parts_ptr": "*fp32", "tickets_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
             "k_tiles": "i32", "split": "i32"}
    if decode == "q6_k":
        fn, sig = kernels._q6_kernel, {**common, "high_ptr": "*i32", "scales_ptr": "*i8", "d_ptr": "*fp16", **after,
                                       "tiles": "i32"}
        constexprs = {"BLOCK_M": block_m, "X_AHEAD": x_ahead, "STAGES": _stages(stages, True, x_ahead), "PDL": pdl,
                      "TAIL": tail}
    elif decode == "q4_1":
        fn, sig = kernels._q4_1_kernel, {**common, "steps_ptr": "*i32", **after, "tiles": "i32"}
        constexprs = {"BLOCK_M": block_m, "X_AHEAD": x_ahead, "STAGES": _stages(stages, True, x_ahead), "PDL": pdl,
                      "TAIL": tail, "K_MASK": True}
    else:
        fn, sig = kernels._gluon_kernel, {**common, "heads_ptr": "*i32", **after, "tiles": "i32"}
        constexprs = {"BLOCK_M": block_m, "PAIRS": decode == "pairs", "X_AHEAD": x_ahead,
                      "STAGES": _stages(stages, decode == "pairs", x_ahead), "PDL": pdl, "TAIL": tail}
    if fold and constexprs["STAGES"] > 1:
        raise ValueError(f"fold=True takes the register path (stages 0 or 1), not stages={stages}")
    constexprs |= {"FOLD": fold, "PAIRED": False}
    sig |= {name: "constexpr" for name in constexprs}
    pointers = [i for i, kind in enumerate(sig.values()) if kind.startswith("*")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in pointers + [list(sig).index("K")]}
    src = gluon._runtime.GluonASTSource(fn=fn, signature=sig, attrs=attrs, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "launch_pdl": pdl, **({"maxnreg": maxnreg} if maxnreg else {})})


# split_for's aim: a 1-row launch spread over ~4 programs an SM. On the 27B's weights alone 8 is faster at 1 row
# (2026-12-07, nineteenth session, ``quant_gluon.py --launches``: gate_up 54.2 -> 39.2 us, GDN in_proj 29.7 -> 21.5,
# o_proj 14.3 -> 11.3, the down 26.6 -> 21.8 on an H200; the H100's alike), yet the 27B Q4_K_M AR step at 8 was
# slower on an H100 (8.66 -> 9.01 ms, medians of 6 runs, two processes a tree; its verify at 32 16.35 -> 16.02 with
# the fold). The reading (twentieth session, the step's graphs at 4 and 8 an SM, ``graphs_versus.py``): at 4 a 1-row
# Q4_K launch holds 4 of the 7 programs an SM takes, so the next launch's programs (PDL) are resident at once, asking
# for their first tiles; at 8 the launches span 1.0-1.5 waves and those programs find no room until they end (the
# verify's kernels took 20 us less GPU time, its wall 345 us more). Launch by launch, end to end (twenty-first
# session, ``kernel_timing.end_to_end``), every weight's AR launch was slower at 8 (gate_up 43.6 -> 46.3 us, the GDN
# in_proj 22.2 -> 23.6, the Q4_K down 24.3 -> 25.8), the verify's gate_up alone faster (84.7 -> 76.7:
# ``VERIFY_SLIVER``). The aim leaves room for the next launch.
PROGRAMS_PER_SM = 4
Q6_K_PROGRAMS_PER_SM = 4  # Q6_K's (its verify launches do not fold, ``FOLD_FORMATS``, and slow in more parts)


def split_for(n: int, cols: int, sms: int = 132, per_sm: int | None = None, fmt: str = "Q4_K") -> int:
    """Parts of K (whole 128-column tiles: a divisor of K's tiles, at least two tiles a part where K has them) whose
    4-warp, 1-row launch has the programs nearest, by ratio, ``per_sm`` an SM (by default the format ``fmt``'s
    aim: ``Q6_K_PROGRAMS_PER_SM`` for Q6_K, else ``PROGRAMS_PER_SM``), doubled where ``VERIFY_SLIVER`` takes the
    weight (``split_and_fold``: its other launches then fold the pairs). One split a weight, whatever a launch's
    rows or warps (a row's bits depend on it); a verify's launch may take two of an even split's parts a program
    (``folds``). Measured at 1 row on an H100 (2026-12-06, the 27B's Q4_K weights at every split to 8, 16 rows a
    program): the narrow weights gain to ~4-5 programs an SM (down 36.0 -> 27.5 us from 2.4 to 4.9), the wide
    ones flat past 2 (gate_up 51.8-54.4 us from 4 to 33); at 8 rows a program (``MIN_BLOCK_M``) more parts are
    faster alone (``PROGRAMS_PER_SM``). SmolLM2's Q4_1 weights (K = 576: 5 tiles, one part; the down's 12 in 6)
    measured at 1 row on an H100 (2026-12-07, ``quant_gluon.py --bench --q4-1``): qkv 3.3 us in one part against
    3.5 in five, o_proj 3.3 / 3.4, gate_up 5.1 / 4.6; the down 4.2 in 6 or 12 parts; and five parts cost a
    49-row verify five [49, N] fp32 partial sums (gate_up 8.2 us against the dense kernel's 4.5)."""
    return split_and_fold(n, cols, sms, per_sm, fmt)[0]


def split_and_fold(n: int, cols: int, sms: int = 132, per_sm: int | None = None,
                   fmt: str = "Q4_K") -> tuple[int, bool]:
    """``split_for``'s split, and whether it is the aim's doubled for a verify's launch (``verify_doubles``), every
    other launch of the weight then folding its parts in pairs (``OperandWeight.fold_pairs``)."""
    tiles, k_tiles = -(-n // TILE_N), padded_cols(cols) // TILE_K
    if per_sm is None:
        per_sm = Q6_K_PROGRAMS_PER_SM if fmt == "Q6_K" else PROGRAMS_PER_SM
    target = per_sm * sms
    # a part at least two tiles long where K has them (the engine's default_plan's rule: a part's fixed costs)
    splits = [s for s in range(1, max(1, k_tiles // 2) + 1) if k_tiles % s == 0]
    split = min(splits, key=lambda s: (abs(math.log(tiles * s / target)), s))
    if verify_doubles(n, cols, split, sms, fmt):
        return 2 * split, True
    return split, False


# A weight whose verify launch (32 rows a program and a tail: 33-48 rows, a verify of budget 32 to 47; 17-32 rows
# too; two 8-warp programs an SM, as ``MAXNREG`` 128 gives a tail's launch, and ``TAILS``) would spill past whole
# waves of its programs by at most 1/VERIFY_SLIVER of a wave takes twice the aim's parts of K (``verify_doubles``),
# and every other launch of it (an AR step's, a small budget's, a prefill's) takes two parts a program (``FOLD``:
# the same bits as the verify's unfolded launch, whose last part adds the pairs first, ``PAIRED``), so those
# launches keep the aim's programs. The 27B's gate_up: 272 128-row tiles on 264 places (two 8-warp programs an SM),
# 8 programs in a second wave; in 2 parts its verify launch took 76.7 us in the step against 84.7 in 1 (H100,
# 2026-12-07, twenty-first session: the step's graphs at 8 programs an SM, where every weight took more parts; its
# 1-row launch, unfolded there, 46.3 against 43.6). At 8 (gate_up alone doubled; its folded 1-row launch 80
# registers against 72 on Triton 3.6, the lent GPU's: 6 programs an SM against 7; 80 both on Triton 3.9), the 27B
# Q4_K_M step on an H100, one process each: the verify at 32 16.29 -> 15.81 ms, the AR step 8.474 -> 8.521 ms
# (+0.6%, its three runs 8.499-8.543 against 8.472-8.477; RESULTS.md). An option until its GPU test has run and the
# AR step's cost is known across processes, the AR baseline being the fastest plain decoding (``gpu_bench
# --gluon-verify-sliver 8``). None: never
VERIFY_SLIVER: int | None = None


def verify_doubles(n: int, cols: int, split: int, sms: int, fmt: str = "Q4_K") -> bool:
    """Whether a weight [n, cols] of format ``fmt`` at the aim's ``split`` takes twice the parts
    (``VERIFY_SLIVER``): a ``FOLD_FORMATS`` weight whose doubled parts are still whole runs of at least two tiles,
    and whose verify launch (``_verify_warps``) at ``split`` has more programs than a wave of them on ``sms`` SMs
    with at most 1/``VERIFY_SLIVER`` of a wave past whole waves."""
    k_tiles = padded_cols(cols) // TILE_K
    if VERIFY_SLIVER is None or fmt not in FOLD_FORMATS or k_tiles % (2 * split) or k_tiles // (2 * split) < 2:
        return False
    n_pad = padded_rows(n)
    warps = _verify_warps(n_pad, split, sms)
    programs, wave = n_pad // (16 * warps) * split, 16 // warps * sms
    past = programs % wave
    return programs > wave and 0 < past * VERIFY_SLIVER <= wave


def _verify_warps(n_pad: int, split: int, sms: int) -> int:
    """The warps of a launch of 32 rows a program (a verify's) of a weight of ``n_pad`` padded rows in ``split``
    parts: ``_warps``' choice."""
    return _warps(32, n_pad, None, wide=wide_warps(32, 0, n_pad, split, sms))


def verify_launch(rows: int) -> bool:
    """Whether a launch of ``rows`` takes 32 rows a program (17-48 rows, with ``TAILS``: a verify of budget 16 to
    47), the launch ``VERIFY_SLIVER`` doubles a weight's parts for."""
    return _rows_a_program(rows)[0] == 32


# --- the engine's use: a QuantLinear's weight held as planes -------------------------------------------------

FORMATS = ("Q4_K", "Q6_K", "Q4_1")


@dataclass(frozen=True)
class OperandWeight:
    """How a weight [n, cols] is held as ``repack``'s (Q4_K, pair decode), ``repack_q6_k``'s or ``repack_q4_1``'s
    planes (the module's buffers: ``.to`` moves them, ``state_dict`` counts them), with the split of K every launch
    of it takes (a row's bits depend on the split, so AR steps, verifies and prefills share one)."""

    fmt: str
    n: int
    cols: int
    split: int
    dtypes: tuple[torch.dtype, ...]  # each plane's (a module holds float ones as integers: ``.to(dtype)`` casts)
    fold_pairs: bool = False  # the split doubled for a verify (``VERIFY_SLIVER``): other launches fold its pairs

    def fold(self, rows: int, n_pad: int, sms: int = 132) -> bool | None:
        """A launch of ``rows``' ``fold`` over ``n_pad`` padded rows: with ``fold_pairs`` its pairs of parts folded
        but in a verify's launch (``verify_launch``), which takes them unfolded; else None (``folds``' rule). A
        launch through shared-memory stages (``STAGES``, an option; ``few_rows_stages``' few programs: a small
        weight's) does not fold."""
        if not self.fold_pairs:
            return None
        if (STAGES > 1) if STAGES is not None else few_rows_stages(rows, n_pad, self.cols, self.split, sms) > 1:
            return None
        return not verify_launch(rows)

    def product(self, x: Tensor, planes: tuple[Tensor, ...]) -> Tensor:
        """``x @ W^T`` [..., n] for bf16 rows on the planes' GPU, any count (blocks of 64). Up to ``linear.MAX_ROWS``
        rows (a decode step's, a prefill chunk's: at most 512) take the weight's split; more (training's forwards)
        sum K in one part, whose bits are not a step's (no [split, rows, n] of sums: 0.7 GB for 4,096 rows of the
        27B's down at 8 parts)."""
        x2 = x.reshape(-1, self.cols)
        if x2.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.n)
        whole = x2.shape[0] > rows_linear.MAX_ROWS
        n_pad = planes[3 if self.fmt == "Q6_K" else 1].shape[0]
        split, fold = (1, None) if whole else (self.split, self.fold(x2.shape[0], n_pad, _sms(x2.device)))
        if self.fmt == "Q6_K":
            out = linear_q6_k(x2, planes, self.n, self.cols, split, fold=fold)
        elif self.fmt == "Q4_1":
            out = linear_q4_1(x2, planes, self.n, self.cols, split, fold=fold)
        else:
            out = linear(x2, *planes, self.n, self.cols, split, pairs=True, fold=fold)
        return out.view(*x.shape[:-1], self.n)

    def rows(self, planes: tuple[Tensor, ...], lo: int, hi: int) -> tuple[OperandWeight, tuple[Tensor, ...]] | None:
        """Rows ``lo``..``hi`` as a weight of their own (views of the planes, the same split), where ``lo`` starts a
        64-row tile (a fused weight's part; else None): the planes are ordered by 16-row groups and rows, and the
        whole's padding covers the part's (``lo`` + the part's padded rows <= the whole's padded rows; a part's
        padding rows are the next part's, not zeros: the kernel stores only rows below ``n``)."""
        if lo % TILE_N or not 0 <= lo < hi <= self.n:
            return None
        pad = padded_rows(hi - lo)
        per_group = padded_cols(self.cols) // TILE_K * 256  # words of a 16-row group
        words = planes[0][lo // 16 * per_group:(lo + pad) // 16 * per_group]
        if self.fmt == "Q6_K":
            high = planes[1][lo // 16 * per_group // 2:(lo + pad) // 16 * per_group // 2]
            sliced = (words, high, planes[2][lo:lo + pad], planes[3][lo:lo + pad])
        else:  # Q4_K's heads, Q4_1's steps: a row each
            sliced = (words, planes[1][lo:lo + pad])
        return replace(self, n=hi - lo), sliced

    def values(self, planes: tuple[Tensor, ...], dtype: torch.dtype = torch.bfloat16) -> Tensor:
        """The weight [n, cols] the kernel multiplies by (bf16 values), in ``dtype``: for a call the kernel does
        not take (another dtype, the kernels off, the CPU), ``quant_gluon_planes.REPACK_ROWS`` rows at a time (the
        references' int64 and float64 temporaries, ~40 bytes a value, stay those rows')."""
        out = torch.empty(self.n, self.cols, dtype=dtype, device=planes[0].device)
        rows = planes_module.REPACK_ROWS
        for lo in range(0, self.n, rows):
            part, sliced = self.rows(planes, lo, min(lo + rows, self.n))
            if self.fmt == "Q6_K":
                out[lo:lo + part.n] = reference_q6_k(*sliced, part.n, self.cols)
            elif self.fmt == "Q4_1":
                out[lo:lo + part.n] = reference_q4_1(*sliced, part.n, self.cols)
            else:
                out[lo:lo + part.n] = reference(*sliced, part.n, self.cols, pairs=True)
        return out


def runs_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this decode runs for a model on ``device`` in ``dtype``: Gluon, an sm_90 GPU (``warpgroup_mma``),
    bf16 activations, the kernels on (``ENGINE_KERNELS``) and ``ENGINE_QUANT_DECODE`` not "kernel" (read at
    import: ``fused.quant_decode``; a bad value raises, naming it)."""
    if fused.quant_decode() == "kernel" or gluon is None or device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return fused.kernels_enabled() and rows_linear.capability(device) == (9, 0)


def operand_planes(held: Tensor, fmt: quant.BlockFormat, cols: int) -> tuple[OperandWeight, tuple[Tensor, ...]]:
    """A ``QuantLinear``'s held rows of Q4_K, Q6_K or Q4_1 blocks as planes (the same bytes, rows padded to 64;
    Q4_1's columns to whole 128-column tiles, its d and m as bf16)."""
    repacked = {"Q6_K": repack_q6_k, "Q4_1": repack_q4_1}.get(fmt.name)
    planes = repacked(held, cols) if repacked else repack(held, cols, pairs=True)
    split, fold_pairs = split_and_fold(held.shape[0], cols, _sms(held.device), fmt=fmt.name)
    operand = OperandWeight(fmt.name, held.shape[0], cols, split, tuple(p.dtype for p in planes), fold_pairs)
    return operand, planes


def hold_operands_(model: torch.nn.Module, dtype: torch.dtype, force: bool = False) -> torch.nn.Module:
    """Every ``QuantLinear`` (fused ones too) of Q4_K, Q6_K or Q4_1 blocks, K whole blocks (every such file's), on a
    device this decode runs on for activations in ``dtype`` (``runs_on``; ``force``: anywhere, for the CPU tests),
    held as planes instead of its blocks (``QuantLinear.hold_planes``; the blocks freed, one weight at a time, so a
    load's peak holds one weight twice). Idempotent."""
    for module in model.modules():
        if not isinstance(module, quant.QuantLinear) or module.operand is not None or module.fmt.name not in FORMATS:
            continue
        if module.in_features % module.fmt.values:
            continue
        if not (force or runs_on(module.blocks.device, dtype)):
            continue
        module.hold_planes(*operand_planes(module.blocks, module.fmt, module.in_features))
    return model
