"""A prototype of issue #28's decode redesign (not the engine's kernel): Q4_K blocks decoded two values an
instruction, as bf16 pairs, for the few-row product. ``kernel_sass.py --packed`` counts its loop beside the
engine's kernel (static, sm_90); ``kernel_bench.py packed`` times it on a GPU.

The engine's block kernel (``engine.models.quant_kernel``) decodes each value in float32 (a mask with the
exponent of 2**23, a subtraction, a fused multiply-add) and rounds it once into bf16: the values a dequantized
load holds, 8.3 thread instructions a Q4_K value on its 27B gate_up launch. Here a word of nibbles becomes four
32-bit registers of two bf16 each, with no float32 step:

- ``(word >> s) & 0x00780078 | 0x43004300``: two nibbles q at bits 3-6 of each half under the exponent of
  128, i.e. the bf16 pair 128 + 8q (exact); the four shifts (<< 3, >> 5, >> 1, >> 9) give the pairs
  (4u, 4u+2), (4u+1, 4u+3) of the word's low nibbles (values 4u.. of its chunk) and the same of its high ones
  (values 32 + 4u..); an ``mov`` reinterprets each register as its two bf16 (``_pairs``);
- less 128 (exact), then a bf16 fused multiply-add, ``8q * bf16(d * scale / 8) + bf16(-dmin * min)``, rounded
  once (Triton emits scalar ``add.bf16`` / ``fma.rn.bf16``; ptxas pairs them into ``HADD2.BF16_V2`` /
  ``HFMA2.BF16_V2``, one instruction a pair: 32 each for a thread's 64 values);
- the K order is the pairs' (within each 4 values: 0, 2, 1, 3), and the x tile is permuted alike, so the dot
  sums the same products. (The x tile's permutation takes a trip through shared memory each iteration, in the
  5.8: a few instructions a thread; permuting x once before the launch would cost a copy kernel a call.)

So the values differ from ``quant.dequantize``'s (its step and offset are rounded to bf16 before the product,
not after it), by up to about two bf16 roundings; a row's bits still do not depend on the rows beside it (the
decode never sees the rows; the dot is the dense kernel's), which is what exactness against AR needs. Q4_K only,
K a multiple of 256 (the 27B and 8B shapes'); in Triton's interpreter (the CPU tests) the pairs are split and the
arithmetic done in float64, rounded once to bf16 by hand.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.models import linear as rows_linear
from engine.models import quant, quant_kernel
from engine.models.quant_gluon import round_bf16

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

Q4_K = quant.FORMATS["Q4_K"]


def values(blocks: Tensor, cols: int) -> Tensor:
    """The bf16 weight [N, cols] this decode gives (float64 arithmetic, rounded once: what the GPU's fused
    multiply-add in bf16 gives): 8q * bf16(d * scale / 8) + bf16(-dmin * min) per value, in PyTorch, from
    ``quant``'s own readings of a Q4_K block (its fp16 fields, 6-bit scales and mins, nibbles)."""
    b = blocks.reshape(-1, Q4_K.nbytes)  # a block a row
    scales, mins = quant._k_scales(b[:, 4:16])  # [blocks, 8]
    step = (quant._f16(b, 0) * scales.float() / 8).to(torch.bfloat16).double()  # exact in float32; one rounding
    offset = (-(quant._f16(b, 2) * mins.float())).to(torch.bfloat16).double()
    q = quant._nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32)  # chunk c: sub-blocks 2c (low), 2c + 1
    return round_bf16(8 * q.double() * step[..., None] + offset[..., None]).reshape(blocks.shape[0], cols)


def linear(x: Tensor, blocks: Tensor, cols: int, cfg: rows_linear.LinearConfig | None = None) -> Tensor:
    """``x @ W^T`` for W the Q4_K blocks' weight as ``values`` gives it, on ``cfg`` (default: the weight's plan
    for these rows, as the engine's kernel launches it). bf16 rows, 1 to ``MAX_ROWS`` of them."""
    n = blocks.shape[0]
    assert blocks.dtype == torch.uint8 and blocks.shape[1] == Q4_K.row_bytes(cols) and cols % 256 == 0
    x2 = x.reshape(-1, cols).contiguous()
    m = x2.shape[0]
    if cfg is None:
        cfg = rows_linear.plan_for_shape(n, cols, x.device, "Q4_K").for_rows(m)
    # K whole tiles: the loop reads x and the words unmasked along K
    assert cfg.block_k % 64 == 0 and cols % cfg.block_k == 0 and x.dtype == torch.bfloat16, (cfg, cols, x.dtype)
    block_m, warps = quant_kernel.launch_shape(Q4_K, cfg, m)  # the engine kernel's launch
    k_iters, split = rows_linear.k_parts(cols, cfg)
    tiles, row_blocks = triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    parts = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else out
    view = blocks.view(torch.int32)
    _packed_kernel[(tiles, split, row_blocks)](
        x2, view, out, out, parts, rows_linear._tickets(x.device, tiles * row_blocks), m, n, cols, x2.stride(0),
        view.stride(0), k_iters, split, tiles, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_M=block_m,
        INTERPRET=rows_linear._INTERPRET, num_warps=warps, num_stages=quant_kernel.launch_stages(cfg, block_m, 2))
    return out.view(*x.shape[:-1], n)


def install() -> None:
    """Route the engine's Q4_K few-row products (bf16 rows, K whole 256-value blocks, no bias) through this
    prototype, every other format and case through the engine's kernel: ``quant_kernel.linear`` replaced in
    place, for a benchmark process only (``gpu_bench.py --q4k-decode packed``: the whole AR step and verify)."""
    engine_linear = quant_kernel.linear

    def routed(x: Tensor, blocks: Tensor, fmt, cols: int, bias: Tensor | None = None) -> Tensor:
        if fmt.name == "Q4_K" and cols % 256 == 0 and bias is None and x.dtype == torch.bfloat16:
            return linear(x, blocks, cols)
        return engine_linear(x, blocks, fmt, cols, bias)

    quant_kernel.linear = routed


if triton is not None:
    from engine.models.linear import launch_tile, store_rows, tile_product
    from engine.models.quant_kernel import _half_of, _round, k_scale_min

    @triton.jit
    def _pairs(p, INTERPRET: tl.constexpr):
        """int32 [..] holding two bf16 -> bf16 [.., 2] (the low half first): on a GPU the same register,
        reinterpreted (an ``mov``); in the interpreter split in two."""
        if INTERPRET:
            lo = p.to(tl.int16).to(tl.bfloat16, bitcast=True)
            hi = (p >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
            return tl.join(lo, hi)
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [tl.join(p, p)], dtype=tl.bfloat16,
                                         is_pure=True, pack=2)

    @triton.jit
    def _less_128(q, INTERPRET: tl.constexpr):
        """128 + 8q -> 8q, exact: in bf16 on a GPU (``HADD2.BF16_V2`` with -128); in float32 in the interpreter,
        whose bf16 arithmetic on bits made by a bitcast is wrong."""
        if INTERPRET:
            return q.to(tl.float32) - 128.0
        return q - 128.0

    @triton.jit
    def _step_offset(d, dmin, wa, wm, wr, sub, INTERPRET: tl.constexpr):
        """Sub-block ``sub``'s bf16 step d * scale / 8 and offset -dmin * min (each rounded once)."""
        sc, mins = k_scale_min(wa, wm, wr, sub)
        step = _round(d * sc.to(tl.float32) * 0.125, tl.bfloat16, INTERPRET)
        return step, _round(-(dmin * mins.to(tl.float32)), tl.bfloat16, INTERPRET)

    @triton.jit
    def _fma_bf16(q, step, offset, INTERPRET: tl.constexpr):
        """q * step + offset rounded once to bf16: the GPU's ``fma.rn.bf16`` (paired by ptxas); in the interpreter
        in float64, rounded by hand as ``quant_gluon.round_bf16`` (its bf16 arithmetic rounds unlike the GPU's)."""
        if INTERPRET:
            w = q.to(tl.float64) * step.to(tl.float64) + offset.to(tl.float64)
            bits = w.to(tl.int64, bitcast=True)
            bits = (bits + ((1 << 44) - 1) + ((bits >> 45) & 1)) & ~((1 << 45) - 1)
            return bits.to(tl.float64, bitcast=True).to(tl.float32).to(tl.bfloat16)
        return tl.fma(q, step, offset)

    @triton.jit
    def _decode(w_ptr, row_word, k0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
        """The bf16 values [BLOCK_N, BLOCK_K] of a K tile in the pairs' order (module docstring); K whole."""
        C: tl.constexpr = BLOCK_K // 64
        j = tl.arange(0, C * 8)
        col = k0 + (j // 8) * 64
        at = (col // 256) * 36 + 4 + (col % 256 // 64) * 8 + j % 8  # a chunk's 8 words after the 16-byte head
        words = tl.reshape(tl.load(w_ptr + row_word[:, None] + at[None, :]), (BLOCK_N, C, 8))
        cc = k0 + tl.arange(0, C) * 64
        block_word = row_word[:, None] + ((cc // 256) * 36)[None, :]
        head = tl.load(w_ptr + block_word)
        d, dmin = _half_of(head), _half_of(head >> 16)
        wa, wm, wr = tl.load(w_ptr + block_word + 1), tl.load(w_ptr + block_word + 2), tl.load(w_ptr + block_word + 3)
        first = (cc % 256 // 64)[None, :] * 2  # the chunk's low sub-block
        s_lo, o_lo = _step_offset(d, dmin, wa, wm, wr, first, INTERPRET)
        s_hi, o_hi = _step_offset(d, dmin, wa, wm, wr, first + 1, INTERPRET)
        # 128 + 8q in each half; less 128: 8q (exact)
        low = _less_128(tl.join(_pairs(((words << 3) & 0x00780078) | 0x43004300, INTERPRET),
                                _pairs(((words >> 5) & 0x00780078) | 0x43004300, INTERPRET)), INTERPRET)
        high = _less_128(tl.join(_pairs(((words >> 1) & 0x00780078) | 0x43004300, INTERPRET),
                                 _pairs(((words >> 9) & 0x00780078) | 0x43004300, INTERPRET)), INTERPRET)
        low = _fma_bf16(low, s_lo[:, :, None, None, None], o_lo[:, :, None, None, None], INTERPRET)
        high = _fma_bf16(high, s_hi[:, :, None, None, None], o_hi[:, :, None, None, None], INTERPRET)
        # [N, C, 8(u), 2(half), 2(which), 2(h)] -> [N, C, h, u, which, half]: within 4 values, 0 2 1 3
        w = tl.permute(tl.join(low, high), (0, 1, 5, 2, 4, 3))
        return tl.reshape(w, (BLOCK_N, BLOCK_K))

    @triton.jit(do_not_specialize=["M", "k_iters", "split", "tiles"])
    def _packed_kernel(x_ptr, blocks_ptr, b_ptr, out_ptr, part_ptr, ticket_ptr, M, N, K, sxm, row_stride, k_iters,
                       split, tiles, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       INTERPRET: tl.constexpr):
        tile, part, row_block, rn, rm, mn, mm, k_lo, k_hi = launch_tile(M, N, K, k_iters, BLOCK_N, BLOCK_K, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rm[None, :].to(tl.int64) * sxm + (k_lo + rk)[:, None]
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        row_word = tl.where(mn, rn, 0).to(tl.int64) * row_stride  # rows past N read row 0, never stored
        for k0 in range(k_lo, k_hi, BLOCK_K):
            xt = tl.load(x_ptrs, mask=mm[None, :], other=0.0)
            # the decode's K order: (which, half) swapped within each 4 values
            xt = tl.reshape(tl.permute(tl.reshape(xt, (BLOCK_K // 4, 2, 2, BLOCK_M)), (0, 2, 1, 3)),
                            (BLOCK_K, BLOCK_M))
            w = _decode(blocks_ptr, row_word, k0, BLOCK_N, BLOCK_K, INTERPRET)
            acc = tile_product(acc, w, xt, INTERPRET)
            x_ptrs += BLOCK_K
        store_rows(acc, out_ptr, b_ptr, part_ptr, ticket_ptr, part, row_block, tile, tiles, split, M, N, rm, rn, mm,
                   mn, False, BLOCK_N, BLOCK_M)
