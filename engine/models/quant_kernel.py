"""The few-row product of a weight kept in its GGUF blocks: ``x @ W^T`` with W read as bytes and
dequantized in registers, one launch (Triton), for AR steps, verifies, replays and draft blocks.

A decode step streams every weight once; kept in its blocks a Q4_K weight is 4.5 bits a value where
its bf16 twin is 16, so the step reads ~3.5x fewer bytes. Dequantizing the whole weight per call (the
PyTorch form, ``quant.QuantLinear`` on the CPU) reads the blocks, writes the bf16 weight and reads it
again: slower than the bf16 model. Here each program reads a tile of block bytes, decodes it into the
values ``quant.dequantize`` gives (same float32 operations: every product of a scale and a quantized
value is exact in float32, so the one rounding each value has is the same whether or not the compiler
fuses it into an FMA), rounds them to the activations' dtype as a dequantized load does, and multiplies
as ``engine.models.linear``'s kernel does.

Exactness. Everything after the decode is ``linear._linear_kernel``'s arithmetic on the weight's plan (by
shape, as a dense weight's: the same ``split`` and ``block_k``, so the same sums over K in the same order, the
parts added in order by the last one to finish; or its format's own, ``linear.TUNED_NATIVE``). Hence:

- row invariance: a row's bits do not depend on how many rows share the launch (1 to ``MAX_ROWS``,
  step and verify launches alike), as for the dense kernel: a verify's rows round as AR steps do;
- native = dequantized, where the weight takes its shape's plan (not where ``TUNED_NATIVE`` gives it one of
  its own): the result equals ``linear.linear(x, dequantize(blocks, x.dtype))`` bit for bit,
  so a native target decodes its dequantized twin's tokens. Checked in Triton's interpreter for every
  format and both decodes; on a GPU it holds where the matrix unit's sums depend on the K partition only
  (what ``linear.py``'s row invariance rests on): ``test_quant_kernel.py``'s CUDA tests and
  ``benchmarks/kernel_bench.py quant`` check it there. On an H100 (2026-12-05) the word decode held it at
  every shape measured; the half-word decode did not at 576- and 960-wide weights (rows still invariant).

Rows past ``MAX_ROWS`` (a training forward's; a decode's prefill is chunked to at most 512 rows) dequantize
the weight once and take cuBLAS, as the dense path does past the same bound.

Layout (``quant.py``): row n of the weight is ``row_bytes`` bytes, its K / ``values`` blocks in order, or
for a format with ``planes`` (Q4_0, Q5_0, Q8_0, Q6_K) the same bytes regrouped field by field (``quant.hold``).
Two decodes of a K tile of ``BLOCK_K`` values, with the same values:

- words (every format, where ``reads_words`` allows: a K tile of whole chunks, rows of whole words
  starting 4-byte aligned; ``WORD_FORMATS``): the tile's quantized bytes as runs of 32-bit words, each
  word's 8 nibbles (4 int8) shifts of one register, the scales a word per block field. Every load is an
  asynchronous copy the pipeline overlaps (sm_90: 8.3 thread instructions a Q4_K value, 14.8 a Q6_K one,
  ``benchmarks/kernel_sass.py``; the 27B Q4_K_M step's 1-row kernel time 25.1 ms against 65.4 on an H100,
  24.5 on an H200). Q4_0, Q5_0, Q8_0 and Q6_K are held in planes (``quant.BlockFormat.planes``: a row's
  values' bytes, then its scales), so their values are whole aligned words: in GGUF's 18-, 22-, 34- and
  210-byte blocks a word straddled two (Q8_0's word decode ran 3.7x slower than its half-word one on an
  H200, Q6_K streamed 0.35 TB/s where Q4_K streamed 0.8; RESULTS.md, eighth session);
- half-words (any other launch): ``G`` groups of ``GROUP`` values (a group: the values that share one
  scale; 32, or 16 for Q6_K), per group its block's scales, per pair of values a half-word, the widest
  load rows of an odd count of 18-, 22-, 34- or 210-byte blocks allow (sm_90, GGUF's blocks in place: 14.2 a
  Q4_K value, 10 of the loop's loads synchronous, 29.5 a Q6_K value).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engine.models import fused
from engine.models import linear as rows_linear

if TYPE_CHECKING:  # quant.py calls this module: the format's type only, no import cycle
    from engine.models.quant import BlockFormat

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - installs without Triton dequantize per call
    triton = None

# The formats this kernel decodes, by the code the kernel branches on (a constexpr: one compiled
# variant per format).
KERNEL_FORMATS = {name: code for code, name in enumerate(rows_linear.BLOCK_FORMATS)}
MAX_ROWS = rows_linear.MAX_ROWS  # every row count a decode step reaches (engine.config.MAX_BUDGET + 1)
# Rows a program takes at most, where a plan's 128 (a tile's float32 sums, 64 registers a thread) and
# the format's decode would spill registers (benchmarks/kernel_check.py); more rows take more row blocks,
# which never changes a row's sums
ROW_BLOCK_CAP = {"Q6_K": 64}
# Values of a weight tile a thread decodes at most where the blocks are not 16-byte aligned (all but
# Q4_K's 144 and Q5_K's 176 bytes): before the planes their loads went through registers, not asynchronous
# copies, and the pipeline's stages held them there; more warps share the tile (warps never change a row's
# sums): a 64 x 128 Q6_K tile took 254 registers a thread on 4 warps and 156 on 8 (sm_90, 2026-12). Q4_0,
# Q5_0, Q8_0 and Q6_K in planes take asynchronous copies (2026-12-06) and keep the rule: whether they still
# need it is ``kernel_bench.py quant-tiles``' to say.
REGISTER_VALUES = 32
# Registers a thread at most on a step's word launch (rows up to ``linear.STEP_ROWS``), by format: Q6_K's took
# 136-138 on 8 warps once held in planes (sm_90, 2026-12-06; 128 before), one program an SM; capped at 128 it
# keeps two, its loop's instructions unchanged (8-16 bytes of stack outside the loop: benchmarks/kernel_sass.py).
# A verify's launch (214) is left alone: a cap there would spill inside the loop; so is a launch on 4 warps,
# where ptxas given the cap took more registers than it does without (a 576 x 1536 step: 124 against 78).
STEP_REGISTER_CAP = {"Q6_K": 128}


def register_cap(fmt: BlockFormat, words: bool, block_m: int, warps: int, capability: tuple[int, int] = (9, 0)
                 ) -> int | None:
    """The register cap ``kernel_linear`` gives a launch (``STEP_REGISTER_CAP``: a step's word launch on 8
    warps, on the architecture it was checked on, sm_90), or None."""
    if capability[0] == 9 and words and block_m <= rows_linear.STEP_ROWS and warps == 8:
        return STEP_REGISTER_CAP.get(fmt.name)
    return None


# A nibble's mask, passed to the kernel as a runtime argument (``nibble``): the decode ANDs each value's bits
# with it shifted to the value's place in its half-word, four masks a tile. As constants, ptxas put each back in
# a register by a move before every LOP3 (a LOP3 takes one immediate, the exponent bits of 2**23 already one):
# a move a value. Held in registers over the loop instead: a Q4_K value's thread instructions 9.3 -> 8.3
# (``benchmarks/kernel_sass.py``, sm_90, 2026-12-05; Q6_K, at its 128-register cap, 18.8 -> 18.5).
NIBBLE = 15
# The formats read as 32-bit words (``_decode_words``), by name: (values a chunk, words a chunk, the chunk's
# first byte in its block). A chunk is a run of whole words: in the nibble formats the bytes whose low
# nibbles are its first half of values and whose high nibbles its second (GGUF's order; Q4_K and Q5_K: 64
# values in 32 bytes, the 32-value formats their block's 16), in Q8_0 a block's 32 int8 (in its plane of
# values: ``_decode_q8_0_words``), in Q6_K a half block (128 values: 64 bytes of nibbles, 32 of top bits, in
# their planes: ``_decode_q6_k_words``). Blocks of a multiple of 4 bytes (Q4_1, Q5_1, Q4_K, Q5_K) are read
# word by word in place; the others (Q4_0, Q5_0, Q8_0, Q6_K: 18, 22, 34, 210 bytes) from their planes, where
# GGUF's blocks left every other block's words straddling two aligned ones (the chunk's first byte: 0).
WORD_FORMATS = {"Q4_0": (32, 4, 0), "Q4_1": (32, 4, 4), "Q5_0": (32, 4, 0), "Q5_1": (32, 4, 8), "Q8_0": (32, 8, 0),
                "Q4_K": (64, 8, 16), "Q5_K": (64, 8, 48), "Q6_K": (128, 16, 0)}


def group_size(fmt: BlockFormat, block_k: int) -> int:
    """Values per group of a K tile: those sharing one scale (Q6_K: 16; the others: 32), at most the tile."""
    return min(16 if fmt.name == "Q6_K" else 32, block_k)


def use_kernel(x: Tensor, blocks: Tensor, fmt: BlockFormat, bias: Tensor | None = None) -> bool:
    """Whether ``x`` against these blocks takes the kernel: the kernels on (``fused.use_kernels``: CUDA,
    no gradient, ``kernels: fused`` and ``ENGINE_KERNELS``), half-precision rows, 1 to ``MAX_ROWS`` of
    them, a format the kernel decodes, rows of blocks it can read in place."""
    if triton is None or fmt.name not in KERNEL_FORMATS:
        return False
    if not fused.use_kernels(x, *([] if bias is None else [bias])):
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return (x.dtype in (torch.bfloat16, torch.float16) and 1 <= rows <= MAX_ROWS and blocks.device == x.device
            and blocks.stride(-1) == 1 and blocks.stride(0) % 2 == 0 and (bias is None or bias.dtype == x.dtype))


def linear(x: Tensor, blocks: Tensor, fmt: BlockFormat, cols: int, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, W, bias)`` for W = the blocks' ``[N, cols]`` weight in ``x``'s dtype, where
    ``use_kernel`` says the kernel takes it: on the weight's plan (``linear.plan_for_shape``: its format's
    measured one, else the one an ``[N, cols]`` dense weight takes)."""
    plan = rows_linear.plan_for_shape(blocks.shape[0], cols, blocks.device, fmt.name)
    return kernel_linear(x, blocks, fmt, cols, bias, plan.for_rows(x.numel() // cols))


def words_fit(fmt: BlockFormat, block_k: int, row_bytes: int) -> bool:
    """Whether a launch of ``block_k`` can read rows of ``row_bytes`` as 32-bit words: a ``WORD_FORMATS``
    format, a K tile of whole chunks, rows of whole words."""
    spec = WORD_FORMATS.get(fmt.name)
    return spec is not None and block_k % spec[0] == 0 and row_bytes % 4 == 0


def reads_words(fmt: BlockFormat, block_k: int, blocks: Tensor) -> bool:
    """Whether a launch of ``block_k`` reads these blocks as words: ``words_fit`` and rows that start
    4-byte aligned (every row of a whole weight does)."""
    return (words_fit(fmt, block_k, blocks.shape[1]) and blocks.data_ptr() % 4 == 0
            and blocks.stride(0) % 4 == 0)


def word_constants(fmt: BlockFormat, words: bool) -> dict[str, int | bool]:
    """The kernel's constants of a launch that reads ``fmt``'s blocks as words (``reads_words``) or not."""
    chunk, chunk_words, first_byte = WORD_FORMATS[fmt.name] if words else (0, 0, 0)
    return dict(WORDS=words, CHUNK=chunk, CHUNK_WORDS=chunk_words, FIRST_BYTE=first_byte)


def launch_shape(fmt: BlockFormat, cfg: rows_linear.LinearConfig, rows: int) -> tuple[int, int]:
    """(rows a program, warps) of ``cfg``'s launch for ``rows`` rows of this format: the plan's, with at
    most ``ROW_BLOCK_CAP`` rows a program, and for blocks not 16-byte aligned warps enough that a thread
    decodes at most ``REGISTER_VALUES`` values a tile (at most 8; Q6_K's words: 8 warps, capped at 128
    registers a thread by ``register_cap`` on a step, two programs an SM, sm_90)."""
    widest = min(cfg.row_block, ROW_BLOCK_CAP.get(fmt.name, rows_linear.ROW_BLOCK))
    block_m = min(widest, max(16, triton.next_power_of_2(rows)))
    warps = cfg.num_warps
    if fmt.nbytes % 16:
        warps = max(warps, min(8, cfg.block_n * cfg.block_k // (32 * REGISTER_VALUES)))
    return block_m, warps


# Pipeline stages of the block kernel's verify launches at most (``launch_stages``).
MAX_VERIFY_STAGES = 3


def launch_stages(cfg: rows_linear.LinearConfig, block_m: int, itemsize: int) -> int:
    """Pipeline stages of a launch: the dense kernel's (``linear.stages_for``); on a verify's row tile (more
    than ``linear.STEP_ROWS`` rows) at most ``MAX_VERIFY_STAGES``. The decode is latency-bound, so programs an
    SM matter more than a deeper pipeline: a step's launch keeps four (sm_90, ~110 registers a thread on 4
    warps, 28-52 KB of shared memory), but the 27B gate_up's verify launch took the dense plan's 6 stages for
    64 rows: 130 KB, one program an SM. On an H100 (2026-12-06, ``quant-tiles --rows 33``) it took 201 us on 6
    stages, 162 on 4, 146 on 3; the 27B Q4_K_M's verify@32, 1.39x -> 1.34x an AR step from 4 to 3. Exact."""
    stages = rows_linear.stages_for(cfg, block_m, itemsize)
    return stages if block_m <= rows_linear.STEP_ROWS else min(stages, MAX_VERIFY_STAGES)


def kernel_linear(x: Tensor, blocks: Tensor, fmt: BlockFormat, cols: int, bias: Tensor | None,
                  cfg: rows_linear.LinearConfig, words: bool = True, max_registers: int | None = None,
                  stages: int | None = None) -> Tensor:
    """The kernel on one launch configuration (tests and benchmarks pick it; ``linear`` takes the
    weight's plan), reading the blocks as words where ``reads_words`` allows and ``words`` is on (off: the
    half-word decode, which tests and benchmarks hold the word decode against). ``max_registers``: a cap
    on a thread's registers (ptxas ``maxnreg``: 128 of 65,536 a thread on 8 warps leave two programs an SM,
    more one); None: the format's ``STEP_REGISTER_CAP`` on a step's word launch, 0: none (the benchmarks
    time both). ``stages``: the pipeline's (None: ``launch_stages``; the benchmarks time others). On CPU
    tensors it runs only in Triton's interpreter (the CPU tests)."""
    n = blocks.shape[0]
    assert blocks.dtype == torch.uint8 and blocks.shape[1] == fmt.row_bytes(cols) and blocks.stride(1) == 1, (
        f"{fmt.name} blocks {tuple(blocks.shape)} {blocks.dtype} do not hold rows of {cols} values")
    assert x.shape[-1] == cols and cols % fmt.values == 0, (tuple(x.shape), cols, fmt.name)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    words = words and reads_words(fmt, cfg.block_k, blocks)
    block_m, warps = launch_shape(fmt, cfg, m)
    if max_registers is None:  # (the device's capability asked once, not at every launch)
        max_registers = register_cap(fmt, words, block_m, warps, rows_linear.capability(x.device))
    row_blocks = triton.cdiv(m, block_m)
    tiles = triton.cdiv(n, cfg.block_n)
    k_iters, split = rows_linear.k_parts(cols, cfg)
    if stages is None:
        stages = launch_stages(cfg, block_m, x.element_size())
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    parts = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else out
    tickets = rows_linear._tickets(x.device, tiles * row_blocks)
    # the same bytes read as words, or as half-words (blocks and fields start even)
    view = blocks.view(torch.int32 if words else torch.float16)
    _quant_kernel[(tiles, split, row_blocks)](
        x2, view, bias if bias is not None else out, out, parts, tickets, m, n, cols, x2.stride(0),
        view.stride(0), k_iters, split, tiles, NIBBLE, FMT=KERNEL_FORMATS[fmt.name], VALUES=fmt.values,
        NBYTES=fmt.nbytes, GROUP=group_size(fmt, cfg.block_k), **word_constants(fmt, words), HAS_BIAS=bias is not None,
        EVEN_K=cols % cfg.block_k == 0, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_M=block_m,
        INTERPRET=rows_linear._INTERPRET, num_warps=warps, num_stages=stages,
        **({} if not max_registers or rows_linear._INTERPRET else {"maxnreg": max_registers}),
    )
    return out.view(*lead, n)


if triton is not None:
    from engine.models.linear import launch_tile, store_rows, tile_product

    @triton.jit
    def _f16_at(h_ptr, block_half, offset: tl.constexpr, mask):
        """The fp16 at byte ``offset`` of each group's block or plane run (``block_half``: its start in halves)."""
        return tl.load(h_ptr + block_half + offset // 2, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _round(w, dtype: tl.constexpr, INTERPRET: tl.constexpr):
        """float32 -> ``dtype`` to nearest even. Triton 3.9's interpreter rounds float32 -> bf16 half up
        and drops the carry into the exponent, so there the bits are rounded by hand (finite values: the
        loader refuses NaN and inf scales); a GPU converts in one instruction."""
        if INTERPRET and dtype == tl.bfloat16:
            bits = w.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return w.to(dtype, fp_downcast_rounding="rtne")

    @triton.jit
    def _bytes(h_ptr, block_half, at, mask):
        """The byte of each value [BLOCK_N, G, GROUP], read two at a time: ``at`` [1, G, GROUP // 2], the
        half-word of each pair of neighbouring values 2i, 2i + 1 in its block (in every format the two
        sit in one half-word, the even value's in its low byte). Rows of an odd count of 18-, 22-, 34- or
        210-byte blocks are only 2-byte aligned: half-words are the widest loads every row allows, half as
        many as bytes."""
        pair = tl.load(h_ptr + block_half + at, mask=mask, other=0.0).to(tl.int16, bitcast=True)
        pair = pair.to(tl.int32) & 0xFFFF
        both = tl.join(pair & 0xFF, pair >> 8)  # [BLOCK_N, G, GROUP // 2, 2]: the even value's byte, the odd's
        return tl.reshape(both, (both.shape[0], both.shape[1], both.shape[2] * 2))

    @triton.jit
    def _u16(h_ptr, block_half, offset, mask):
        """The little-endian uint16 at the even byte ``offset`` of each group's block."""
        return tl.load(h_ptr + block_half + offset // 2, mask=mask, other=0.0).to(tl.int16, bitcast=True).to(
            tl.int32) & 0xFFFF

    @triton.jit
    def _float(q, offset: tl.constexpr):
        """float(q - offset), exactly, for int32 0 <= q < 2**22, without an int -> float conversion (a
        quarter-rate instruction: at a few-row product's pace the decode would wait on it): q's bits under
        the exponent of 2**23 are the float 2**23 + q; less 2**23 + offset, exactly."""
        return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)

    @triton.jit
    def _nibble_shift(jg, ri, GROUP: tl.constexpr):
        """The 32-value formats' nibble of each value (values 0-15 of a block low, 16-31 high), times 4:
        by its lane in a 32-value group (the same for every tile: computed once), or by its 16-value
        group's place in the block."""
        if GROUP == 32:
            return (ri // 16) * 4
        else:
            return (jg % 32 // 16) * 4

    @triton.jit
    def _decode_planes_halves(h_ptr, row_half, blk, jg, ri, jh, K, mask, FMT: tl.constexpr, GROUP: tl.constexpr):
        """Q4_0's or Q5_0's values [BLOCK_N, G, GROUP] from their planes (``quant.BlockFormat.planes``: a row's
        16-byte nibble runs (values 0-15 low, 16-31 high), Q5_0's 4-byte fifth-bit runs, then the fp16 d's)
        read as half-words: ``row_half`` [BLOCK_N, 1, 1] each row's start, ``blk`` [1, G, 1] each group's block,
        ``jg``, ``ri``, ``jh`` as ``_decode``'s. d * (q - 8), d * (q - 16): as ``quant._q4_0``, ``quant._q5_0``."""
        q = (_bytes(h_ptr, row_half + blk * 8, jh % 8, mask) >> _nibble_shift(jg, ri, GROUP)) & 15
        if FMT == 0:
            w = _f16_at(h_ptr, row_half + K // 4 + blk, 0, mask) * _float(q, 8)
        else:
            bits = row_half + K // 4 + blk * 2  # the block's fifth bits, a little-endian uint32
            high = _u16(h_ptr, bits, 0, mask) | (_u16(h_ptr, bits, 2, mask) << 16)
            q = q | (((high >> (jg % 32 + ri)) & 1) << 4)
            w = _f16_at(h_ptr, row_half + K // 4 + K // 16 + blk, 0, mask) * _float(q, 16)
        return w

    @triton.jit
    def _decode_q8_0_halves(h_ptr, row_half, col, rh, K, mask):
        """Q8_0's values [BLOCK_N, G, GROUP] from its planes (``quant.BlockFormat.planes``: a row's int8
        values, then its fp16 scales) read as half-words: ``row_half`` [BLOCK_N, 1, 1] each row's start,
        ``col`` [1, G, 1] each group's first value, ``rh`` [1, 1, GROUP // 2] its pairs. q * d, as
        ``quant._q8_0`` (a byte b holds the int8 (b ^ 128) - 128)."""
        q = _float(_bytes(h_ptr, row_half + col // 2, rh, mask) ^ 128, 128)
        return q * tl.load(h_ptr + row_half + K // 2 + col // 32, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _decode_q6_k_halves(h_ptr, row_half, blk, jg, jh, K, mask):
        """Q6_K's values [BLOCK_N, G, GROUP] from its planes (``quant.BlockFormat.planes``: a row's 128-byte
        nibble runs, then its 64-byte top-bit runs, 16-byte scale runs and fp16 d's, one a block) read as
        half-words: ``row_half`` [BLOCK_N, 1, 1] each row's start, ``blk`` [1, G, 1] each group's block,
        ``jg`` and ``jh`` as ``_decode``'s. A value's half h = j // 128, its 32-value group g4 = j % 128 // 32
        (one per 16-value group): d * scale * (q - 32), as ``quant._q6_k``."""
        g4 = jg % 128 // 32
        low = _bytes(h_ptr, row_half + blk * 64, (jh // 64) * 32 + (jh % 64 // 16 % 2) * 16 + jh % 16, mask)
        top = _bytes(h_ptr, row_half + K // 4 + blk * 32, (jh // 64) * 16 + jh % 16, mask)
        q = ((low >> ((g4 // 2) * 4)) & 15) | (((top >> (g4 * 2)) & 3) << 4)
        # the scales of 16-value groups 2i, 2i + 1, a half-word
        pair = _u16(h_ptr, row_half + 3 * K // 8 + blk * 8, (jg // 32) * 2, mask)
        sc = ((pair >> ((jg // 16 % 2) * 8)) & 0xFF).to(tl.int8).to(tl.float32)
        return (_f16_at(h_ptr, row_half + 13 * K // 32 + blk, 0, mask) * sc) * _float(q, 32)

    @triton.jit
    def _decode(h_ptr, block_half, jg, ri, jh, mask, FMT: tl.constexpr, GROUP: tl.constexpr):
        """The float32 values [BLOCK_N, G, GROUP] of one K tile, as ``quant.py``'s decoders compute them.
        ``block_half`` [BLOCK_N, G, 1]: each group's block start in half-words; ``jg`` [1, G, 1]: each
        group's first value's index in its block; ``ri`` [1, 1, GROUP]: a value's lane in its group;
        ``jh`` [1, G, GROUP // 2]: each pair of values' first index // 2 (the loads' offsets are in
        half-words, contiguous runs the compiler can see). Per-value work is the bits and two float
        operations; what a group or a lane shares is computed per group or once."""
        if FMT == 1:  # Q4_1: d, m, nibbles; d * q + m
            q = (_bytes(h_ptr, block_half, 2 + jh % 8, mask) >> _nibble_shift(jg, ri, GROUP)) & 15
            w = _f16_at(h_ptr, block_half, 0, mask) * _float(q, 0) + _f16_at(h_ptr, block_half, 2, mask)
        elif FMT == 3:  # Q5_1: d, m, 32 fifth bits (a little-endian uint32), nibbles; d * q + m
            high = _u16(h_ptr, block_half, 4, mask) | (_u16(h_ptr, block_half, 6, mask) << 16)
            q = (_bytes(h_ptr, block_half, 4 + jh % 8, mask) >> _nibble_shift(jg, ri, GROUP)) & 15
            q = q | (((high >> (jg % 32 + ri)) & 1) << 4)
            w = _f16_at(h_ptr, block_half, 0, mask) * _float(q, 0) + _f16_at(h_ptr, block_half, 2, mask)
        else:  # Q4_K (5) / Q5_K (6): d, dmin, 12 bytes of 6-bit scales and mins, (Q5_K: fifth bits,) nibbles
            sub = jg // 32  # the sub-block: 8 of 32 values (one per group)
            lo = sub % 4
            at = (lo // 2) * 2  # the byte pair holding sub-block lo's, its byte lo % 2
            a = (_u16(h_ptr, block_half, 4 + at, mask) >> ((lo % 2) * 8)) & 0xFF
            mb = (_u16(h_ptr, block_half, 8 + at, mask) >> ((lo % 2) * 8)) & 0xFF
            r = (_u16(h_ptr, block_half, 12 + at, mask) >> ((lo % 2) * 8)) & 0xFF
            sc = tl.where(sub >= 4, (r & 15) | ((a >> 2) & 48), a & 63)
            mn = tl.where(sub >= 4, (r >> 4) | ((mb >> 2) & 48), mb & 63)
            nib: tl.constexpr = 8 if FMT == 5 else 24  # where the nibbles start (half-words)
            q = (_bytes(h_ptr, block_half, nib + (jh // 32) * 16 + jh % 16, mask) >> ((sub % 2) * 4)) & 15
            if FMT == 6:
                q = q | (((_bytes(h_ptr, block_half, 8 + jh % 16, mask) >> sub) & 1) << 4)
            step = _f16_at(h_ptr, block_half, 0, mask) * sc.to(tl.float32)
            shift = _f16_at(h_ptr, block_half, 2, mask) * mn.to(tl.float32)
            w = step * _float(q, 0) - shift
        return w

    @triton.jit
    def k_scale_min(a, m, r, sub):
        """Q4_K/Q5_K sub-block ``sub``'s 6-bit scale and min (as ``quant._k_scales``) from the block's three scale
        words (bytes 4-7: scales 0-3 and the top bits of 4-7; 8-11: the same of the mins; 12-15: the low 4 bits of
        scales and mins 4-7), each sub-block's byte at 8 * (sub % 4)."""
        shift = 8 * (sub % 4)
        a, m, r = (a >> shift) & 0xFF, (m >> shift) & 0xFF, (r >> shift) & 0xFF
        return tl.where(sub >= 4, (r & 15) | ((a >> 2) & 48), a & 63), tl.where(sub >= 4, (r >> 4) | ((m >> 2) & 48),
                                                                                m & 63)

    @triton.jit
    def _half_of(word):
        """The fp16 in the low half of each int32 word, as float32 (exact)."""
        return (word & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _half_at(w_ptr, byte, mask):
        """The fp16 at each even ``byte`` as float32: the aligned word holding it, its low or high half."""
        word = tl.load(w_ptr + byte // 4, mask=mask, other=0)
        return _half_of(tl.where(byte % 4 != 0, word >> 16, word))

    @triton.jit
    def _in_half(words, at):
        """Each word, or for a field at bit ``at`` >= 16 its high half-word shifted down (the field then at
        ``at`` mod 16: below 2**23 however wide the values, for the in-place float of ``_decode_words``)."""
        return tl.where(at < 16, words, (words >> 16) & 0xFFFF)

    @triton.jit
    def _unplace(place):
        """2**-place as float32 (exact: a power of two of a normal float32)."""
        return (0x3F800000 - (place << 23)).to(tl.float32, bitcast=True)

    @triton.jit
    def _decode_q6_k_words(w_ptr, row_word, k0, k_hi, K, mn, nibble, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
        """Q6_K's values [BLOCK_N, BLOCK_K] from words, as ``quant._q6_k``: a half block (128 values: its
        value v = 64h + 32a + 16s + 4u + b) takes its low nibble from byte 32a + 16s + 4u + b of the half's
        64 (nibble h), its top 2 bits from byte 16s + 4u + b of the half's 32 (bits 2(2h + a)), its scale
        from int8 8H + 4h + 2a + s of the block's 16; d * scale * (q - 32). The row held in planes
        (``quant.BlockFormat.planes``): its nibble bytes from word 0 (a half block's 16 words at 16 per half
        block before it), its top bits from word K / 8 (8 a half block), its scales from byte 3K / 4 (16 a
        block), its d from byte 13K / 16: every word aligned, a mask constant over a half block's words."""
        C: tl.constexpr = BLOCK_K // 128
        k_word = tl.multiple_of(k0 // 8, BLOCK_K // 8)  # k0: a multiple of BLOCK_K (a part starts on a tile)
        j = tl.arange(0, C * 16)  # the nibble words, 16 a half block
        col = k0 + (j // 16) * 128
        low = tl.load(w_ptr + row_word[:, None] + (k_word + j)[None, :], mask=mn[:, None] & (col < k_hi)[None, :],
                      other=0)
        jt = tl.arange(0, C * 8)  # the top-bit words, 8 a half block
        colt = k0 + (jt // 8) * 128
        top = tl.load(w_ptr + row_word[:, None] + (K // 8 + k_word // 2 + jt)[None, :],
                      mask=mn[:, None] & (colt < k_hi)[None, :], other=0)
        h = tl.arange(0, 2)[None, None, :, None, None, None, None]
        a = tl.arange(0, 2)[None, None, None, :, None, None, None]
        b = tl.arange(0, 4)[None, None, None, None, None, None, :]
        # In place, as _decode_words: the nibble at bit 4h + 8b of its word is q_low * 2**s (s = that bit mod
        # 16, the high half-word shifted down once a word) under a mask; its top bits, at bit 4h + 2a + 8b of
        # theirs, are shifted to s + 4 from the same half: (4h + 8b) - (4h + 2a + 8b) + 4 = 4 - 2a left.
        at = 4 * h + 8 * b
        place = at % 16
        low = tl.reshape(low, (BLOCK_N, C, 1, 2, 2, 4, 1))
        top = tl.reshape(top, (BLOCK_N, C, 1, 1, 2, 4, 1))
        low = _in_half(low, at) & (nibble << place)
        top = (_in_half(top, at) << (4 - 2 * a)) & ((nibble >> 2) << (place + 4))  # (3: the 2 top bits' mask)
        # [BLOCK_N, C, h, a, s, u, b]: (q - 32) * 2**s, exact (q * 2**s < 2**23)
        q = (low | top | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + (32 << place).to(tl.float32))
        cc = k0 + tl.arange(0, C) * 128  # each half block's first value
        cmask = mn[:, None] & (cc < k_hi)[None, :]
        blk = (cc // 256)[None, :]  # [1, C]: each half block's block
        sj = ((cc % 256 // 128) * 8)[None, :, None, None, None] + 4 * tl.arange(0, 2)[None, None, :, None, None] + \
            2 * tl.arange(0, 2)[None, None, None, :, None] + tl.arange(0, 2)[None, None, None, None, :]
        at = row_word[:, None, None, None, None] + 3 * K // 16 + 4 * blk[:, :, None, None, None] + sj // 4
        scale = tl.load(w_ptr + at, mask=cmask[:, :, None, None, None], other=0)
        scale = ((scale >> (8 * (sj % 4))) & 0xFF).to(tl.int8).to(tl.float32)  # [BLOCK_N, C, h, a, s]
        d = _half_at(w_ptr, row_word[:, None] * 4 + 13 * K // 16 + 2 * blk, cmask)
        # d * scale * (q - 32) as (d * scale * 2**-s) * ((q - 32) * 2**s): the same product, rounded once alike
        w = ((d[:, :, None, None, None] * scale)[:, :, :, :, :, None, None] * _unplace(place)) * q
        if not EVEN_K:  # past K: +0.0, as _decode's (d * 0 * -32 is -0.0); rows past N are never stored
            w = tl.where(cmask[:, :, None, None, None, None, None], w, 0.0)
        return tl.reshape(w, (BLOCK_N, BLOCK_K))

    @triton.jit
    def _decode_q8_0_words(w_ptr, row_word, k0, k_hi, K, mn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Q8_0's values [BLOCK_N, BLOCK_K] of one K tile from its planes (``quant.BlockFormat.planes``) read
        as words: a row's int8 values from its first word (value k in byte k: runs of whole words, no block
        header between them), then its fp16 scales (block i's at byte K + 2i). q * d, as ``quant._q8_0``,
        q the int8 (byte ^ 128) - 128; past K the words and scales are 0, so the values +0.0."""
        j = tl.arange(0, BLOCK_K // 4)  # the tile's words
        # masked by block (K and a part's end are whole blocks): a mask constant over a block's 8 words, and a
        # start the compiler knows is a multiple of the tile (a part starts on one) let the copies take 16 bytes
        wmask = mn[:, None] & (k0 + (j // 8) * 32 < k_hi)[None, :]
        words = tl.load(w_ptr + row_word[:, None] + (tl.multiple_of(k0 // 4, BLOCK_K // 4) + j)[None, :], mask=wmask,
                        other=0)
        cc = k0 + tl.arange(0, BLOCK_K // 32) * 32  # each block's first value
        d = _half_at(w_ptr, (row_word * 4)[:, None] + (K + 2 * (cc // 32))[None, :], mn[:, None] & (cc < k_hi)[None, :])
        b8 = tl.arange(0, 4)[None, None, None, :]
        q = _float(((tl.reshape(words, (BLOCK_N, BLOCK_K // 32, 8, 1)) >> (8 * b8)) & 0xFF) ^ 128, 128)
        return tl.reshape(q * d[:, :, None, None], (BLOCK_N, BLOCK_K))

    @triton.jit
    def _decode_words(w_ptr, row_word, k0, k_hi, K, mn, nibble, FMT: tl.constexpr, VALUES: tl.constexpr,
                      NBYTES: tl.constexpr, CHUNK: tl.constexpr, CHUNK_WORDS: tl.constexpr, FIRST_BYTE: tl.constexpr,
                      EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The float32 values [BLOCK_N, BLOCK_K] of one K tile of a ``WORD_FORMATS`` format other than Q6_K and Q8_0,
        as ``_decode`` (and ``quant.py``) compute them, from 32-bit words. In the nibble formats byte b of
        word w of a chunk holds value 4w + b in its low nibble and CHUNK / 2 + 4w + b in its high one, so
        each word's 8 values are shifts of the one register.
        Per value: a mask and two float operations (the fifth bits of Q5_*: three more); per chunk its
        block's scale fields. ``row_word`` [BLOCK_N]: each row's first word. Blocks of whole words are
        addressed in words (the loads' contiguity then plain to the compiler: 16-byte copies, 9.3 thread
        instructions a Q4_K value where byte addresses made 14.5, sm_90; 8.3 with ``NIBBLE``); Q4_0's and
        Q5_0's planes likewise."""
        C: tl.constexpr = BLOCK_K // CHUNK
        W: tl.constexpr = CHUNK_WORDS
        ALIGNED: tl.constexpr = NBYTES % 4 == 0  # else Q4_0 / Q5_0, in planes
        j = tl.arange(0, C * W)  # the tile's words, chunk by chunk: runs of W contiguous words
        col = k0 + (j // W) * CHUNK  # each word's chunk's first value
        wmask = mn[:, None] & (col < k_hi)[None, :]
        cc = k0 + tl.arange(0, C) * CHUNK  # [C]: each chunk's first value
        cmask = mn[:, None] & (cc < k_hi)[None, :]
        if ALIGNED:
            at = (col // VALUES) * (NBYTES // 4) + FIRST_BYTE // 4 + (col % VALUES // CHUNK) * W + j % W
            words = tl.load(w_ptr + row_word[:, None] + at[None, :], mask=wmask, other=0)
            block_word = row_word[:, None] + ((cc // VALUES) * (NBYTES // 4))[None, :]  # [BLOCK_N, C]
            head = tl.load(w_ptr + block_word, mask=cmask, other=0)  # d and (Q4_1, Q5_1: m; Q4_K, Q5_K: dmin)
            d = _half_of(head)
            second = _half_of(head >> 16)
        else:  # Q4_0 / Q5_0 in planes: the row's 16-byte nibble runs from word 0, (Q5_0: its fifth bits' words
            # from word K / 8,) its fp16 d's after them
            words = tl.load(w_ptr + row_word[:, None] + (k0 // 8 + j)[None, :], mask=wmask, other=0)
            at_d: tl.constexpr = 0 if FMT == 0 else 1  # the d plane after the nibbles (K / 2 bytes) and Q5_0's K / 8
            d = _half_at(w_ptr, (row_word * 4)[:, None] + (K // 2 + at_d * (K // 8) + 2 * (cc // 32))[None, :], cmask)
        h = tl.arange(0, 2)[None, None, :, None, None]
        u = tl.arange(0, W)[None, None, None, :, None]
        b = tl.arange(0, 4)[None, None, None, None, :]
        # [BLOCK_N, C, 2, W, 4]: chunk c's value c * CHUNK + h * CHUNK / 2 + 4u + b, the tile's K order, at
        # bit 4h + 8b of its word; taken as q * 2**s in place (s = that bit mod 16: the high half-word
        # shifted down once a word), a mask and the exponent bits of 2**23 (a float 2**23 + q * 2**s,
        # exact while q * 2**s < 2**23), less 2**23 (and the format's offset): two operations a value
        # where a shift, a mask and the two were four
        at = 4 * h + 8 * b
        place = at % 16
        words = tl.reshape(words, (BLOCK_N, C, 1, W, 1))
        bits = _in_half(words, at) & (nibble << place)
        if FMT == 2 or FMT == 3:  # Q5_0 / Q5_1: value i's fifth bit is bit i of a uint32
            if FMT == 3:  # after d and m: byte 4
                qh = tl.load(w_ptr + block_word + 1, mask=cmask, other=0)
            else:  # Q5_0 in planes: block i's, word K / 8 + i
                qh = tl.load(w_ptr + row_word[:, None] + (K // 8 + cc // 32)[None, :], mask=cmask, other=0)
            bits = bits | (((qh[:, :, None, None, None] >> (16 * h + 4 * u + b)) & 1) << (place + 4))
        elif FMT == 6:  # Q5_K: sub-block j's value i's fifth bit is bit j of byte i of the 32 after the scales
            qh = tl.load(w_ptr + block_word[:, :, None, None, None] + 4 + u, mask=cmask[:, :, None, None, None],
                         other=0)
            sub = (cc % VALUES // CHUNK)[None, :, None, None, None] * 2 + h
            bits = bits | (((qh >> (8 * b + sub)) & 1) << (place + 4))
        # the format's offset (Q4_0: 8, Q5_0: 16) at the place
        offset: tl.constexpr = 8 if FMT == 0 else (16 if FMT == 2 else 0)
        q = (bits | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + (offset << place).to(tl.float32))
        unplace = _unplace(place)  # [1, 1, 2, 1, 4]: the scale factors' share of the place
        if FMT == 0 or FMT == 2:  # Q4_0 / Q5_0: d * (q - offset), as (d * 2**-s) * ((q - offset) * 2**s)
            w = (d[:, :, None, None, None] * unplace) * q
            if not EVEN_K:  # past K: +0.0, as _decode's (0 * -8 is -0.0); rows past N are never stored
                w = tl.where(cmask[:, :, None, None, None], w, 0.0)
        elif FMT == 1 or FMT == 3:  # Q4_1 / Q5_1: d * q + m: the same product, rounded once alike
            w = (d[:, :, None, None, None] * unplace) * q + second[:, :, None, None, None]
        else:  # Q4_K / Q5_K: d * scale * q - dmin * min, the chunk's two sub-blocks (h), their 6-bit pairs
            sub = (cc % VALUES // CHUNK)[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]  # [1, C, 2]
            sc, mins = k_scale_min(tl.load(w_ptr + block_word + 1, mask=cmask, other=0)[:, :, None],
                                   tl.load(w_ptr + block_word + 2, mask=cmask, other=0)[:, :, None],
                                   tl.load(w_ptr + block_word + 3, mask=cmask, other=0)[:, :, None], sub)
            step = d[:, :, None] * sc.to(tl.float32)
            shift_by = second[:, :, None] * mins.to(tl.float32)
            w = (step[:, :, :, None, None] * unplace) * q - shift_by[:, :, :, None, None]
        # Elsewhere a masked chunk's words, scales and scale factors are 0, so its values are 0 * 0 (+ or -)
        # 0: +0.0, as _decode's (no select: a select a value went back and forth through packed halves)
        return tl.reshape(w, (BLOCK_N, BLOCK_K))

    # As linear._linear_kernel (its launch, K partition, row blocks, split-K tickets), with the weight
    # tile decoded from its blocks instead of loaded: ``blocks_ptr`` the blocks viewed as int32 words
    # (WORDS) or as half-words, ``row_stride`` a row's length in that view's units.
    @triton.jit(do_not_specialize=["M", "k_iters", "split", "tiles", "nibble"])
    def _quant_kernel(x_ptr, blocks_ptr, b_ptr, out_ptr, part_ptr, ticket_ptr, M, N, K, sxm, row_stride, k_iters,
                      split, tiles, nibble, FMT: tl.constexpr, VALUES: tl.constexpr, NBYTES: tl.constexpr,
                      GROUP: tl.constexpr, WORDS: tl.constexpr, CHUNK: tl.constexpr, CHUNK_WORDS: tl.constexpr,
                      FIRST_BYTE: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr):
        G: tl.constexpr = BLOCK_K // GROUP
        tile, part, row_block, rn, rm, mn, mm, k_lo, k_hi = launch_tile(M, N, K, k_iters, BLOCK_N, BLOCK_K, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        rg = tl.arange(0, G)[None, :, None] * GROUP  # [1, G, 1]: each group's first column in the tile
        ri = tl.arange(0, GROUP)[None, None, :]  # [1, 1, GROUP]
        rh = tl.arange(0, GROUP // 2)[None, None, :]  # [1, 1, GROUP // 2]: pairs of values
        row_half = rn[:, None, None].to(tl.int64) * row_stride  # [BLOCK_N, 1, 1] (half-words)
        x_ptrs = x_ptr + rm[None, :].to(tl.int64) * sxm + (k_lo + rk)[:, None]
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            col = k0 + rg  # [1, G, 1]
            block_half = row_half + (col // VALUES) * (NBYTES // 2)  # [BLOCK_N, G, 1]
            jg = col % VALUES
            if EVEN_K:
                wmask = mn[:, None, None]
                xt = tl.load(x_ptrs, mask=mm[None, :], other=0.0)
            else:
                wmask = mn[:, None, None] & (col < k_hi)
                mk = (k0 + rk) < k_hi
                xt = tl.load(x_ptrs, mask=mk[:, None] & mm[None, :], other=0.0)
            if WORDS and FMT == 7:
                w = _decode_q6_k_words(blocks_ptr, rn.to(tl.int64) * row_stride, k0, k_hi, K, mn, nibble, EVEN_K,
                                       BLOCK_N, BLOCK_K)
            elif WORDS and FMT == 4:
                w = _decode_q8_0_words(blocks_ptr, rn.to(tl.int64) * row_stride, k0, k_hi, K, mn, BLOCK_N, BLOCK_K)
            elif WORDS:
                w = _decode_words(blocks_ptr, rn.to(tl.int64) * row_stride, k0, k_hi, K, mn, nibble, FMT, VALUES,
                                  NBYTES, CHUNK, CHUNK_WORDS, FIRST_BYTE, EVEN_K, BLOCK_N, BLOCK_K)
            else:
                if FMT == 4:
                    w = _decode_q8_0_halves(blocks_ptr, row_half, col, rh, K, wmask)
                elif FMT == 7:
                    w = _decode_q6_k_halves(blocks_ptr, row_half, col // VALUES, jg, jg // 2 + rh, K, wmask)
                elif FMT == 0 or FMT == 2:
                    w = _decode_planes_halves(blocks_ptr, row_half, col // VALUES, jg, ri, jg // 2 + rh, K, wmask, FMT,
                                              GROUP)
                else:
                    w = _decode(blocks_ptr, block_half, jg, ri, jg // 2 + rh, wmask, FMT, GROUP)
                w = tl.where(wmask, w, 0.0)  # masked values are +0.0, as the dense kernel's masked loads
            # One rounding into the activations' dtype, to nearest even: the value a dequantized load holds.
            w = tl.reshape(_round(w, x_ptr.dtype.element_ty, INTERPRET), (BLOCK_N, BLOCK_K))
            acc = tile_product(acc, w, xt, INTERPRET)  # linear.py's: the same bits
            x_ptrs += BLOCK_K
        # linear.py's store: the split's parts added in order 0..split-1, the bias, the rows rounded alike
        store_rows(acc, out_ptr, b_ptr, part_ptr, ticket_ptr, part, row_block, tile, tiles, split, M, N, rm, rn, mm,
                   mn, HAS_BIAS, BLOCK_N, BLOCK_M)
