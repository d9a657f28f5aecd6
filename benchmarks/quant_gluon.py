"""A prototype of issue #28's decode redesign (not the engine's kernel): Q4_K and Q6_K weights decoded straight
into the matrix unit's operand registers, in Gluon (Triton's explicit-layout dialect), so no decoded value touches
shared memory.

Why: on an H100 (2026-12-06, ``benchmarks/quant_ncu.py``) the engine's few-row Q4_K launch keeps the L1/shared
pipe 80% busy at 25% of DRAM's bandwidth. Its decoded bf16 tile goes through shared memory into the layout of
``tl.dot``'s A operand (2 bytes a value written, 2 read): at the roofline's pace that round trip alone would
take most of an SM's 128 bytes a cycle. Plain Triton chooses the decode's layout itself; Gluon lets this kernel
name it.

The layout. Hopper's ``warpgroup_mma`` takes A from registers in ``DotOperandLayout(0, parent, k_width=2)``: for
a 64 x 128 tile on 4 warps, lane ``4 g + t`` of warp ``w`` holds rows ``16 w + 8 h + g`` and columns
``16 s + 8 j + 2 t + e`` (register bits e, h, j, then s's three). So one 32-bit word holds exactly a thread's 8
values of one 16-column slice: nibble ``4 j + 2 h + e`` (``repack``, at load). A thread's 8 words (s = 0..7) are
contiguous (two 16-byte loads); a warp's 256 are one 1 KB run. The 8 nibbles are decoded into 8 tensors, joined
(the outermost join is register bit 0: e, then h, then j), reshaped and permuted into [64, 128]; the conversion into
the operand layout is then a renaming, checked at compile time (``convert_layout(..., assert_trivial=True)``:
that the layout is the operand's; where each nibble lands within a thread is the joins' order, which a CPU test
replays).

Two decodes of Q4_K. The float one: ``d * scale * q - dmin * min`` in float32 with one rounding (a fused
multiply-add), then bf16: the bits ``quant.dequantize`` gives, and so the engine kernel's. The pair one
(``pairs``: nibble ``4 e + 2 j + h``, a register's two columns 16 bits apart): one ``LOP3`` makes their bf16 pair
128 + q, ``HADD2`` takes 128 off, ``HFMA2`` gives q * bf16(d * scale) + bf16(-dmin * min), one rounding
(``quant_packed.values``'s numbers, not ``dequantize``'s). Q6_K has the pair decode (``repack_q6_k``): its low
nibbles as Q4_K's pair words, its top 2 bits in words of their own, (q - 32) * bf16(d * scale). A row's bits never
depend on the rows beside it, which is what exactness against AR needs; but only launches of up to 64 rows take
these kernels, so an engine routed through them (``install``) must keep every launch of a decode at 64 rows or
fewer (a verify of 64 or more tree nodes takes the engine's kernel, ``dequantize``'s values: not AR's weights).

The block's 16-byte head (d, dmin, the packed 6-bit scales and mins) stays as the file has it, in a plane of its own
(``repack``); each (row, 32-value sub-block)'s scale and min are decoded by one thread and passed to the lanes that
need them through a little shared memory. The next tile's words and heads are read an iteration ahead (``x_ahead``:
its x rows too; not yet timed). The K order is the natural one, 16 columns an instruction. Rows past N are padded to
whole 64-row tiles; K must be whole 256-value blocks; a launch takes up to 64 rows (``BLOCK_M`` 16, 32 or 64). Split
over K (``split``): each part's fp32 sums, then added in order 0..split-1.

No interpreter runs Gluon: the CPU tests check the planes' order against the GGUF bytes and the references
(``reference``, ``reference_q6_k``) against ``quant.dequantize`` and an independent reading, replay the kernels'
joins and permutations in PyTorch, and compile them for sm_90; on a GPU, ``tests/test_quant_gluon.py`` checks
that one-hot rows read each kernel's weight back bit for bit, column block by column block, and rows invariant.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import Tensor

from engine.models import quant

Q4_K = quant.FORMATS["Q4_K"]
TILE_N, TILE_K = 64, 128

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma
except ImportError:  # pragma: no cover - a Triton without Gluon
    gluon = None


def _pack(q: Tensor, width: int, order: tuple[int, ...], shape: tuple[int, ...]) -> Tensor:
    """Fields ``width`` bits wide into int32 words: ``q`` reshaped to ``shape`` and permuted by ``order`` so that
    its last dimensions (32 / width values) are one word's fields, lowest first."""
    q = q.to(torch.int64).reshape(shape).permute(*order)
    per = 32 // width
    q = q.reshape(-1, per) << (width * torch.arange(per, device=q.device))
    words = q.sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def _padded(q: Tensor, n_pad: int) -> Tensor:
    return torch.cat([q, q.new_zeros(n_pad - q.shape[0], q.shape[1])])


def _nibble_words(q: Tensor, cols: int, pairs: bool) -> Tensor:
    """Values 0..15 [N padded, cols] in natural order -> the words: order [16-row group][128-column tile][g][t][s]
    (row ``16 G + 8 h + g``, column ``128 kt + 16 s + 8 j + 2 t + e``), nibble ``4 j + 2 h + e`` or with
    ``pairs`` ``4 e + 2 j + h`` (the two columns of a register 16 bits apart: one mask makes their bf16 pair)."""
    shape = (q.shape[0] // 16, 2, 8, cols // TILE_K, 8, 2, 4, 2)  # [G, h, g, kt, s, j, t, e]
    return _pack(q, 4, (0, 3, 2, 6, 4, 7, 5, 1) if pairs else (0, 3, 2, 6, 4, 5, 1, 7), shape)


REPACK_ROWS = 4096  # rows a repack takes at a time (a multiple of TILE_N)


def _by_rows(repack_rows):
    """A repack done ``REPACK_ROWS`` rows at a time (a multiple of the 64-row tile, so the planes concatenate in
    order): its int64 temporaries stay ~16 bytes a value of that many rows (the 27B's head is 1.3 G values)."""
    @functools.wraps(repack_rows)
    def by_rows(blocks: Tensor, cols: int, *args, **kwargs) -> tuple[Tensor, ...]:
        assert blocks.shape[0] > 0 and REPACK_ROWS % TILE_N == 0
        parts = [repack_rows(blocks[r:r + REPACK_ROWS], cols, *args, **kwargs)
                 for r in range(0, blocks.shape[0], REPACK_ROWS)]
        return tuple(torch.cat(planes) for planes in zip(*parts, strict=True))
    return by_rows


@_by_rows
def repack(blocks: Tensor, cols: int, pairs: bool = False) -> tuple[Tensor, Tensor]:
    """Q4_K rows [N, row_bytes] -> (words, heads): the nibbles as the kernel's threads read them, int32
    [ceil(N / 64) * 4 * (cols / 128) * 256] (``_nibble_words``), and each block's 16-byte head, int32
    [N padded, cols / 256, 4]. Padded rows are zero."""
    assert blocks.dtype == torch.uint8 and cols % quant.QK_K == 0 and blocks.shape[1] == Q4_K.row_bytes(cols)
    n = blocks.shape[0]
    n_pad = -(-n // TILE_N) * TILE_N
    b = blocks.reshape(-1, Q4_K.nbytes)
    q = quant._nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(n, cols)  # natural order, 0..15
    words = _nibble_words(_padded(q, n_pad), cols, pairs)
    heads = b[:, :16].reshape(n, cols // quant.QK_K, 16).contiguous().view(torch.int32)
    heads = torch.cat([heads, heads.new_zeros(n_pad - n, cols // quant.QK_K, 4)])
    return words, heads.contiguous()


@_by_rows
def repack_q6_k(held: Tensor, cols: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Q6_K rows (as a ``QuantLinear`` holds them: ``quant.hold``'s planes) -> (words, high, scales, d): the low
    nibbles as ``_nibble_words`` (pairs), the top 2 bits int32 [groups][tiles][g][t][u] (a thread's slices
    s = 2 u + o, field ``8 e + 4 o + 2 j + h``), the int8 scales [N padded, cols / 16] and the fp16 d's
    [N padded, cols / 256]: 210 bytes a block, as the file's."""
    fmt = quant.FORMATS["Q6_K"]
    assert held.dtype == torch.uint8 and cols % quant.QK_K == 0 and held.shape[1] == fmt.row_bytes(cols)
    n = held.shape[0]
    n_pad = -(-n // TILE_N) * TILE_N
    b = quant.unhold(held, fmt).reshape(-1, fmt.nbytes)
    low = quant._nibbles(b[:, 0:128].reshape(-1, 2, 64)).reshape(n, cols)
    top = quant._bits(b[:, 128:192].reshape(-1, 2, 32), 2).permute(0, 1, 3, 2).reshape(n, cols)
    words = _nibble_words(_padded(low, n_pad), cols, True)
    shape = (n_pad // 16, 2, 8, cols // TILE_K, 4, 2, 2, 4, 2)  # [G, h, g, kt, u, o, j, t, e]
    high = _pack(_padded(top, n_pad), 2, (0, 3, 2, 7, 4, 8, 5, 6, 1), shape)
    scales = _padded(b[:, 192:208].reshape(n, cols // 16), n_pad).view(torch.int8).contiguous()
    d = _padded(b[:, 208:210].reshape(n, -1), n_pad).view(torch.float16).contiguous()
    return words, high, scales, d


def _unpacked(words: Tensor, n_pad: int, cols: int, pairs: bool) -> Tensor:
    """``_nibble_words``'s inverse: the words -> values 0..15 [N padded, cols] in natural order."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    q = (w[:, None] >> (4 * torch.arange(8, device=w.device))) & 15  # [word, nibble]
    q = q.reshape(n_pad // 16, cols // TILE_K, 8, 4, 8, 2, 2, 2)  # [G, kt, g, t, s, (j, h, e) or (e, j, h)]
    return q.permute(*((0, 7, 2, 1, 4, 6, 3, 5) if pairs else (0, 6, 2, 1, 4, 5, 3, 7))).reshape(n_pad, cols)


def reference_q6_k(words: Tensor, high: Tensor, scales: Tensor, d: Tensor, n: int, cols: int) -> Tensor:
    """The bf16 weight [n, cols] ``repack_q6_k``'s planes hold, as the pair decode computes it: (q - 32) *
    bf16(d * scale), one rounding (``quant.dequantize``: d * scale * (q - 32) in float32, then bf16)."""
    from quant_packed import _round_bf16

    n_pad = d.shape[0]
    low = _unpacked(words, n_pad, cols, pairs=True)
    hw = high.to(torch.int64) & 0xFFFFFFFF
    top = (hw[:, None] >> (2 * torch.arange(16, device=hw.device))) & 3
    top = top.reshape(n_pad // 16, cols // TILE_K, 8, 4, 4, 2, 2, 2, 2)  # [G, kt, g, t, u, e, o, j, h]
    top = top.permute(0, 8, 2, 1, 4, 6, 7, 3, 5).reshape(n_pad, cols)
    step = (d.float().repeat_interleave(16, dim=1) * scales.float()).to(torch.bfloat16).double()
    q = (low | (top << 4)).double() - 32
    return _round_bf16(q.reshape(n_pad, -1, 16) * step[..., None]).reshape(n_pad, cols)[:n]


def reference(words: Tensor, heads: Tensor, n: int, cols: int, pairs: bool = False) -> Tensor:
    """The weight [n, cols] ``words`` and ``heads`` hold, by the layout ``repack`` documents (each word's 8 nibbles
    at their rows and columns, each block's scale and min): ``quant.dequantize``'s values in float32, or with
    ``pairs`` the bf16 pair decode's (``quant_packed.values``: q * bf16(d * scale) + bf16(-dmin * min), one
    rounding). The kernel's own assembly of a tile is replayed by ``tests/test_quant_gluon.py``."""
    n_pad = heads.shape[0]
    q = _unpacked(words, n_pad, cols, pairs)
    head = heads.reshape(n_pad, -1, 4).contiguous().view(torch.uint8).reshape(-1, 16)
    scales, mins = quant._k_scales(head[:, 4:16])
    if pairs:
        from quant_packed import _round_bf16

        step = (quant._f16(head, 0) * scales.float()).to(torch.bfloat16).double()
        offset = (-(quant._f16(head, 2) * mins.float())).to(torch.bfloat16).double()
        values = _round_bf16(q.reshape(-1, 8, 32).double() * step[..., None] + offset[..., None])
        return values.reshape(n_pad, cols)[:n]
    step = quant._f16(head, 0) * scales.float()
    shift = quant._f16(head, 2) * mins.float()
    values = step[:, :, None] * q.reshape(-1, 8, 32).float() - shift[:, :, None]
    return values.reshape(n_pad, cols)[:n]


def linear(x: Tensor, words: Tensor, heads: Tensor, n: int, cols: int, split: int = 1, pairs: bool = False,
           x_ahead: bool = False) -> Tensor:
    """``x @ W^T`` [M, n] in x's dtype (bf16), W the repacked Q4_K weight (``repack`` with the same ``pairs``), for
    1 to 64 rows, on a GPU; ``x_ahead``: x's rows read an iteration ahead too (the same bits)."""
    m, block_m = _rows(x, cols, split)
    tiles = heads.shape[0] // TILE_N
    parts = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    _gluon_kernel[(tiles, split)](x.contiguous(), words, heads, parts, m, n, cols, cols // TILE_K // split,
                                   BLOCK_M=block_m, PAIRS=pairs, X_AHEAD=x_ahead, num_warps=4)
    return _sum_parts(parts, x.dtype)


def linear_q6_k(x: Tensor, planes: tuple[Tensor, Tensor, Tensor, Tensor], n: int, cols: int, split: int = 1,
                x_ahead: bool = False) -> Tensor:
    """``x @ W^T`` [M, n] for W the Q6_K weight ``repack_q6_k``'s planes hold (``reference_q6_k``'s values), for 1
    to 64 rows, on a GPU; ``x_ahead`` as ``linear``'s."""
    m, block_m = _rows(x, cols, split)
    words, high, scales, d = planes
    parts = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    _q6_kernel[(d.shape[0] // TILE_N, split)](x.contiguous(), words, high, scales, d, parts, m, n, cols,
                                               cols // TILE_K // split, BLOCK_M=block_m, X_AHEAD=x_ahead,
                                               num_warps=4)
    return _sum_parts(parts, x.dtype)


def _rows(x: Tensor, cols: int, split: int) -> tuple[int, int]:
    """A launch's rows and its BLOCK_M (16, 32 or 64: a power of two), x checked against the kernels' limits."""
    m = x.shape[0]
    assert x.dtype == torch.bfloat16 and 1 <= m <= 64 and x.shape[1] == cols and cols % (TILE_K * split) == 0
    return m, max(16, 1 << (m - 1).bit_length())


def _sum_parts(parts: Tensor, dtype: torch.dtype) -> Tensor:
    out = parts[0]
    for p in range(1, parts.shape[0]):  # in order 0..split-1, as the engine kernel's tickets add them
        out = out + parts[p]
    return out.to(dtype)


def install(pairs: bool = False, x_ahead: bool = False) -> None:
    """Route the engine's Q4_K few-row products (bf16, up to 64 rows, K whole 256-value blocks, no bias) through
    this prototype (``pairs``: its bf16 pair decode, and the Q6_K products through ``linear_q6_k`` too; ``x_ahead``:
    x read an iteration ahead), every other product through the engine's kernel: ``quant_kernel.linear`` replaced
    in place, for a benchmark process only (``gpu_bench.py --q4k-decode gluon``, ``gluon-pairs`` or
    ``gluon-pairs-ahead``: the whole AR step and verify). A weight is
    repacked on its first such call and kept (the blocks stay too): that call must come before a graph is
    captured, as the engine's eager warm-up steps do; one first met during a capture takes the engine's kernel.
    With ``pairs`` a launch of more than 64 rows takes the engine's kernel and so ``dequantize``'s values: only
    timings, not exactness, hold for a verify of 64 or more tree nodes."""
    from engine.models import quant_kernel

    engine_linear = quant_kernel.linear
    formats = ("Q4_K", "Q6_K") if pairs else ("Q4_K",)
    # by the rows' address and shape (a fused group's ``part`` is a fresh slice each call, the same rows), with a
    # weak reference to the tensor that owns them: a dead owner's address may hold another weight's blocks
    repacked: dict[tuple[int, tuple[int, ...]], tuple[weakref.ref, tuple[Tensor, ...]]] = {}

    def routed(x: Tensor, blocks: Tensor, fmt, cols: int, bias: Tensor | None = None) -> Tensor:
        rows = x.numel() // cols
        if fmt.name not in formats or cols % quant.QK_K or bias is not None or x.dtype != torch.bfloat16 or rows > 64:
            return engine_linear(x, blocks, fmt, cols, bias)
        key = (blocks.data_ptr(), tuple(blocks.shape))
        if key not in repacked or repacked[key][0]() is None:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                return engine_linear(x, blocks, fmt, cols, bias)
            owner = blocks if blocks._base is None else blocks._base
            planes = repack_q6_k(blocks, cols) if fmt.name == "Q6_K" else repack(blocks, cols, pairs)
            repacked[key] = (weakref.ref(owner), planes)
        n, planes = blocks.shape[0], repacked[key][1]
        split = split_for(n, cols)
        if fmt.name == "Q6_K":
            out = linear_q6_k(x.reshape(rows, cols), planes, n, cols, split, x_ahead)
        else:
            out = linear(x.reshape(rows, cols), *planes, n, cols, split, pairs, x_ahead)
        return out.view(*x.shape[:-1], n)

    quant_kernel.linear = routed


if gluon is not None:
    # the engine kernel's Triton helpers (Gluon calls them): an fp16 half, Q4_K's 6-bit fields, a small int's float
    from engine.models.quant_kernel import _float, _half_of, k_scale_min

    # words [32 = (w, g), 4 = t, 8 = s]: s in registers (contiguous), t and g in lanes (lane 4 g + t), w in warps
    _WORDS = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 8], threads_per_warp=[8, 4, 1],
                                           warps_per_cta=[4, 1, 1], order=[2, 1, 0]))

    @gluon.jit
    def _word_offsets(tile, all_tiles):
        """Each thread's 8 words of a 128-column tile (add ``kt * 256``): [32, 4, 8] in ``_WORDS``."""
        rr = gl.arange(0, 32, layout=gl.SliceLayout(1, gl.SliceLayout(2, _WORDS)))
        tt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, _WORDS)))
        ss = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, _WORDS)))
        return ((tile * 4 + rr // 8) * (all_tiles * 256) + (rr % 8) * 32)[:, None, None] \
            + (tt * 8)[None, :, None] + ss[None, None, :]

    @gluon.jit
    def _nibble(words, p: gl.constexpr):
        return _float((words >> (4 * p)) & 15, 0)  # the engine kernel's float of a small int, no conversion

    @gluon.jit
    def _head(heads_ptr, row, kt, K):
        """Each row's 16-byte block head for K tile ``kt`` (d and dmin, then the packed scales and mins: 4 words)."""
        at = heads_ptr + (row[:, None] * (K // 256) + kt // 2) * 4
        return gl.load(at), gl.load(at + 1), gl.load(at + 2), gl.load(at + 3)

    @gluon.jit
    def _step_shift(head, a, m, r, kt, sub):
        """d * scale and dmin * min (exact in float32) of each row's 32-value sub-block ``sub`` of tile ``kt``."""
        sc, mn = k_scale_min(a, m, r, (kt % 2) * 4 + sub[None, :])  # the sub-block within its 256-value block
        return _half_of(head) * sc.to(gl.float32), _half_of(head >> 16) * mn.to(gl.float32)

    @gluon.jit
    def _beside(v, four: gl.constexpr, wl: gl.constexpr):
        """[32 rows, 4 sub-blocks], one a thread -> [32, 1, 8]: each thread's row, its 8 words' sub-blocks (s // 2)."""
        v = gl.convert_layout(v, four)
        v = gl.join(v, v).reshape([32, 8])
        return gl.convert_layout(v, gl.SliceLayout(1, wl), assert_trivial=True).expand_dims(1)

    @gluon.jit
    def _values_tile(words, st0, sh0, st1, sh1):
        """Nibble ``4 j + 2 h + e`` of each word, each value in float32 (one rounding into bf16) -> [32, 32, j, h, e].
        A join adds a minor dimension; the outermost join's is register bit 0, which the operand layout gives to
        column + 1 (e): so the innermost joins split on j (v_p against v_p+4), the middle on h, the outermost on e."""
        v0 = (_nibble(words, 0) * st0 - sh0).to(gl.bfloat16)  # j 0, h 0, e 0
        v1 = (_nibble(words, 1) * st0 - sh0).to(gl.bfloat16)  # j 0, h 0, e 1
        v2 = (_nibble(words, 2) * st1 - sh1).to(gl.bfloat16)  # j 0, h 1
        v3 = (_nibble(words, 3) * st1 - sh1).to(gl.bfloat16)
        v4 = (_nibble(words, 4) * st0 - sh0).to(gl.bfloat16)  # j 1, h 0
        v5 = (_nibble(words, 5) * st0 - sh0).to(gl.bfloat16)
        v6 = (_nibble(words, 6) * st1 - sh1).to(gl.bfloat16)  # j 1, h 1
        v7 = (_nibble(words, 7) * st1 - sh1).to(gl.bfloat16)
        return gl.join(gl.join(gl.join(v0, v4), gl.join(v2, v6)), gl.join(gl.join(v1, v5), gl.join(v3, v7)))

    @gluon.jit
    def _under_128(w):
        """``(w & 0x000F000F) | 0x43004300`` in one ``LOP3`` (ptxas emits two for the two constants)."""
        return gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;", "=r,r", [w],
                                         dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _pairs_tile(words, st0, sh0, st1, sh1):
        """Nibbles ``4 e + 2 j + h``: for each (j, h) one mask puts the two columns' nibbles (16 bits apart) under
        bf16's exponent of 128, 128 + q each (``_bf16_pairs``); less 128 (exact), then q * bf16(d * scale) +
        bf16(-dmin * min), one rounding (``HADD2.BF16_V2``, ``HFMA2.BF16_V2``: two values an instruction)."""
        p00 = _under_128(words)  # j 0, h 0 (nibbles 0 and 4)
        p01 = _under_128(words >> 4)  # j 0, h 1
        p10 = _under_128(words >> 8)  # j 1, h 0
        p11 = _under_128(words >> 12)  # j 1, h 1
        q = _bf16_pairs(p00, p01, p10, p11) - 128.0
        step = _per_value(st0.to(gl.bfloat16), st1.to(gl.bfloat16))
        return gl.fma(q, step, _per_value((-sh0).to(gl.bfloat16), (-sh1).to(gl.bfloat16)))

    @gluon.jit
    def _bf16_pairs(p00, p01, p10, p11):
        """Each (j, h)'s int32 pair (two bf16, e = 0 low) -> bf16 [.., j, h, e]: joined on j then h (register bits
        1 and 2), then read as their two halves (an ``mov``; e becomes register bit 0)."""
        p = gl.join(gl.join(p00, p10), gl.join(p01, p11))
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [gl.join(p, p)], dtype=gl.bfloat16,
                                         is_pure=True, pack=2)

    @gluon.jit
    def _per_value(v0, v1):
        """A value of rows h = 0 and h = 1 -> [.., j, h, e], the same for both j and both e (as ``_bf16_pairs``)."""
        v = gl.join(gl.join(v0, v0), gl.join(v1, v1))
        return gl.join(v, v)

    @gluon.jit
    def _gluon_kernel(x_ptr, words_ptr, heads_ptr, parts_ptr, M, N, K, k_tiles, BLOCK_M: gl.constexpr,
                      PAIRS: gl.constexpr, X_AHEAD: gl.constexpr):
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_M, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        wl: gl.constexpr = _WORDS
        # the steps: one (row, sub-block) a thread where they are decoded (lane t: sub-block t of the tile's four),
        # then all four a thread (the t lanes alike), as [32, 1, 8] beside the words (s // 2 is the sub-block)
        one: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[8, 4], warps_per_cta=[4, 1],
                                             order=[1, 0])
        four: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[8, 4], warps_per_cta=[4, 1],
                                              order=[1, 0])
        xs: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, transposed=True)
        tile = gl.program_id(0)
        part = gl.program_id(1)
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [128, BLOCK_M], xs)
        acc = gl.zeros([64, BLOCK_M], gl.float32, layout=mma)
        all_tiles = K // 128
        wbase = _word_offsets(tile, all_tiles)
        sr = gl.arange(0, 32, layout=gl.SliceLayout(1, one))
        row0 = tile * 64 + (sr // 8) * 16 + sr % 8  # h = 0; h = 1 is 8 rows on
        sub = gl.arange(0, 4, layout=gl.SliceLayout(0, one))
        # each tile's words and heads (X_AHEAD: and x rows) are read one iteration ahead (registers: the loads of
        # tile i + 1 are in flight while tile i is decoded and multiplied); the last iteration reads its own tile
        # again (a cache hit, no mask)
        kt0 = part * k_tiles
        words_n = gl.load(words_ptr + wbase + kt0 * 256)
        h0_n, a0_n, m0_n, r0_n = _head(heads_ptr, row0, kt0, K)
        h1_n, a1_n, m1_n, r1_n = _head(heads_ptr, row0 + 8, kt0, K)
        if X_AHEAD:
            xt_n = _x_tile(x_ptr, kt0, K, M, BLOCK_M)
        for i in range(0, k_tiles):
            kt = kt0 + i
            nxt = kt + (i + 1 < k_tiles).to(gl.int32)
            words, h0, a0, m0, r0, h1, a1, m1, r1 = words_n, h0_n, a0_n, m0_n, r0_n, h1_n, a1_n, m1_n, r1_n
            words_n = gl.load(words_ptr + wbase + nxt * 256)
            if X_AHEAD:
                xt = xt_n
                xt_n = _x_tile(x_ptr, nxt, K, M, BLOCK_M)
            h0_n, a0_n, m0_n, r0_n = _head(heads_ptr, row0, nxt, K)
            h1_n, a1_n, m1_n, r1_n = _head(heads_ptr, row0 + 8, nxt, K)
            st0, sh0 = _step_shift(h0, a0, m0, r0, kt, sub)
            st1, sh1 = _step_shift(h1, a1, m1, r1, kt, sub)
            st0, sh0 = _beside(st0, four, wl), _beside(sh0, four, wl)
            st1, sh1 = _beside(st1, four, wl), _beside(sh1, four, wl)
            if PAIRS:
                a = _pairs_tile(words, st0, sh0, st1, sh1)
            else:
                a = _values_tile(words, st0, sh0, st1, sh1)
            if not X_AHEAD:
                xt = _x_tile(x_ptr, kt, K, M, BLOCK_M)
            acc = _times_x(acc, a, a_layout, xt, x_smem)
        _store_part(acc, parts_ptr, tile, part, M, N, BLOCK_M)

    @gluon.jit
    def _x_tile(x_ptr, kt, K, M, BLOCK_M: gl.constexpr):
        """x's rows for K tile ``kt``, [128, BLOCK_M] bf16 in registers (rows past M zero, not read)."""
        xl: gl.constexpr = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[16, 2], warps_per_cta=[1, 4],
                                            order=[0, 1])
        xk = gl.arange(0, 128, layout=gl.SliceLayout(1, xl))
        xm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, xl))
        return gl.load(x_ptr + xm[None, :] * K + (kt * 128 + xk)[:, None], mask=(xm < M)[None, :], other=0.0)

    @gluon.jit
    def _times_x(acc, a, a_layout: gl.constexpr, xt, x_smem):
        """acc += the decoded [64, 128] tile (``a``: [w, g, t, s, j, h, e] as the joins leave it) times ``xt`` (x's
        rows for its K tile, through shared memory, as wgmma's B operand)."""
        # [w, g, t, s, j, h, e] -> [w, h, g | s, j, t, e] = [64, 128] (tests/test_quant_gluon.py replays the
        # joins, this reshape and the permutation on the CPU)
        a = a.reshape([4, 8, 4, 8, 2, 2, 2]).permute([0, 5, 1, 3, 4, 2, 6]).reshape([64, 128])
        a = gl.convert_layout(a, a_layout, assert_trivial=True)  # a renaming: no data moves
        x_smem.store(xt)
        fence_async_shared()
        return warpgroup_mma(a, x_smem, acc)

    @gluon.jit
    def _store_part(acc, parts_ptr, tile, part, M, N, BLOCK_M: gl.constexpr):
        """The tile's fp32 sums into part ``part`` of the output [split, M, N]."""
        ol: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[32, 1], warps_per_cta=[4, 1],
                                            order=[0, 1])
        acc = gl.convert_layout(acc, ol)
        on = tile * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, ol))
        om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, ol))
        gl.store(parts_ptr + part * M * N + om[None, :] * N + on[:, None], acc,
                 mask=(on < N)[:, None] & (om < M)[None, :])

    @gluon.jit
    def _top_under_128(w):
        """``(w & 0x00300030) | 0x43004300``: a pair's top 2 bits (at bits 4-5 of each half) under 128, one LOP3."""
        return gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x00300030, 0x43004300, 0xEA;", "=r,r", [w],
                                         dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _with_low(w, top):
        """``(w & 0x000F000F) | top``: the pair's low nibbles beside its top bits, one LOP3."""
        return gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, $2, 0xEA;", "=r,r,r", [w, top],
                                         dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _q6_pairs_tile(words, high, st0, st1, wl: gl.constexpr):
        """Q6_K's pairs: for each (j, h) the low nibbles (as Q4_K's pairs) and the top 2 bits (``high``: field
        ``8 e + 4 o + 2 j + h`` of slice pair u, s = 2 u + o) under 128: 128 + q each; less 160 (exact: q - 32),
        times bf16(d * scale), one rounding. -> [32, 4, 8, j, h, e]"""
        top = gl.join(high, high >> 8).reshape([32, 4, 8])  # slice s = 2 u + o: its fields at 2 (2 j + h) (+ 16)
        top = gl.convert_layout(top, wl, assert_trivial=True)
        p00 = _with_low(words, _top_under_128(top << 4))  # j 0, h 0
        p01 = _with_low(words >> 4, _top_under_128(top << 2))  # j 0, h 1
        p10 = _with_low(words >> 8, _top_under_128(top))  # j 1, h 0
        p11 = _with_low(words >> 12, _top_under_128(top >> 2))  # j 1, h 1
        return (_bf16_pairs(p00, p01, p10, p11) - 160.0) * _per_value(st0, st1)

    @gluon.jit
    def _q6_steps(scales_ptr, d_ptr, row, kt, s, K):
        """bf16(d * scale) of each row's 8 slices of tile ``kt`` (16 values a scale): [32, 1, 8]."""
        at = gl.max_contiguous(gl.multiple_of(row[:, None] * (K // 16) + kt * 8 + s[None, :], [1, 8]), [1, 8])
        sc = gl.load(scales_ptr + at)  # 8 bytes a row (K // 16 is a multiple of 16: K is of 256)
        d = gl.load(d_ptr + row * (K // 256) + kt // 2)
        return (d.to(gl.float32)[:, None] * sc.to(gl.float32)).to(gl.bfloat16).expand_dims(1)

    @gluon.jit
    def _q6_kernel(x_ptr, words_ptr, high_ptr, scales_ptr, d_ptr, parts_ptr, M, N, K, k_tiles,
                   BLOCK_M: gl.constexpr, X_AHEAD: gl.constexpr):
        """Q6_K's few-row product, the tile's skeleton as ``_gluon_kernel``'s (pairs decode only)."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_M, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        wl: gl.constexpr = _WORDS
        # the top bits [32 = (w, g), 4 = t, 4 = u]: a thread's 4 words (16 bytes)
        hl: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[8, 4, 1],
                                            warps_per_cta=[4, 1, 1], order=[2, 1, 0])
        xs: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, transposed=True)
        tile = gl.program_id(0)
        part = gl.program_id(1)
        all_tiles = K // 128
        wbase = _word_offsets(tile, all_tiles)
        hr = gl.arange(0, 32, layout=gl.SliceLayout(1, gl.SliceLayout(2, hl)))
        ht = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, hl)))
        hu = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, hl)))
        hbase = ((tile * 4 + hr // 8) * (all_tiles * 128) + (hr % 8) * 16)[:, None, None] \
            + (ht * 4)[None, :, None] + hu[None, None, :]
        sr = gl.arange(0, 32, layout=gl.SliceLayout(1, gl.SliceLayout(1, wl)))
        row0 = tile * 64 + (sr // 8) * 16 + sr % 8  # h = 0; h = 1 is 8 rows on
        slices = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, wl)))
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [128, BLOCK_M], xs)
        acc = gl.zeros([64, BLOCK_M], gl.float32, layout=mma)
        kt0 = part * k_tiles  # the next tile's planes read one iteration ahead, as in _gluon_kernel
        words_n = gl.load(words_ptr + wbase + kt0 * 256)
        high_n = gl.load(high_ptr + hbase + kt0 * 128)
        st0_n = _q6_steps(scales_ptr, d_ptr, row0, kt0, slices, K)
        st1_n = _q6_steps(scales_ptr, d_ptr, row0 + 8, kt0, slices, K)
        if X_AHEAD:
            xt_n = _x_tile(x_ptr, kt0, K, M, BLOCK_M)
        for i in range(0, k_tiles):
            kt = kt0 + i
            nxt = kt + (i + 1 < k_tiles).to(gl.int32)
            words, high, st0, st1 = words_n, high_n, st0_n, st1_n
            words_n = gl.load(words_ptr + wbase + nxt * 256)
            if X_AHEAD:
                xt = xt_n
                xt_n = _x_tile(x_ptr, nxt, K, M, BLOCK_M)
            high_n = gl.load(high_ptr + hbase + nxt * 128)
            st0_n = _q6_steps(scales_ptr, d_ptr, row0, nxt, slices, K)
            st1_n = _q6_steps(scales_ptr, d_ptr, row0 + 8, nxt, slices, K)
            a = _q6_pairs_tile(words, high, st0, st1, wl)
            if not X_AHEAD:
                xt = _x_tile(x_ptr, kt, K, M, BLOCK_M)
            acc = _times_x(acc, a, a_layout, xt, x_smem)
        _store_part(acc, parts_ptr, tile, part, M, N, BLOCK_M)


def compile_for_hopper(block_m: int = 16, decode: str = "float", x_ahead: bool = False):
    """The kernel compiled for sm_90 (no GPU needed): the launch ``linear`` (``decode`` float or pairs) or
    ``linear_q6_k`` (q6_k) makes for ``block_m`` rows."""
    import triton
    from triton.backends.compiler import GPUTarget

    common = {"x_ptr": "*bf16", "words_ptr": "*i32"}
    if decode == "q6_k":
        fn, sig = _q6_kernel, {**common, "high_ptr": "*i32", "scales_ptr": "*i8", "d_ptr": "*fp16"}
        constexprs = {"BLOCK_M": block_m, "X_AHEAD": x_ahead}
    else:
        fn, sig = _gluon_kernel, {**common, "heads_ptr": "*i32"}
        constexprs = {"BLOCK_M": block_m, "PAIRS": decode == "pairs", "X_AHEAD": x_ahead}
    sig |= {"parts_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "k_tiles": "i32"}
    sig |= {name: "constexpr" for name in constexprs}
    pointers = [i for i, kind in enumerate(sig.values()) if kind.startswith("*")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in pointers + [list(sig).index("K")]}
    src = gluon._runtime.GluonASTSource(fn=fn, signature=sig, attrs=attrs, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def split_for(n: int, cols: int, sms: int = 132, per_sm: int = 2) -> int:
    """Parts of K so that a launch has about ``per_sm`` programs an SM (the 64-row tiles alone are fewer on a
    narrow weight), each part whole 128-column tiles."""
    tiles, k_tiles = -(-n // TILE_N), cols // TILE_K
    split = max(1, min(k_tiles, -(-per_sm * sms // tiles)))
    while k_tiles % split:
        split -= 1
    return split


def main(argv: list[str] | None = None) -> int:
    """Static counts of the K loop (sm_90): thread instructions a weight value and the loop's shared-memory traffic
    (the x tile's store only: the decoded values never go through shared memory); ``--bench`` times it on a GPU."""
    import argparse
    import re
    import sys
    from collections import Counter
    from pathlib import Path

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64], help="BLOCK_M of each launch (16, 32, 64)")
    ap.add_argument("--bench", action="store_true", help="on a GPU: time it beside the engine kernel (27B weights)")
    ap.add_argument("--md", help="--bench: write the table here too")
    ap.add_argument("--x-ahead", action="store_true", help="the static counts with x's rows read an iteration ahead")
    args = ap.parse_args(argv)
    if gluon is None:
        print("this Triton has no Gluon", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.bench:
        if not torch.cuda.is_available():
            print("--bench needs CUDA", file=sys.stderr)
            return 2
        from quant_gluon_bench import bench

        lines = bench()
        if args.md:
            Path(args.md).write_text("\n".join(lines) + "\n")
        return 0
    from kernel_check import loop, resources

    print("| decode | BLOCK_M | registers | loop instructions a thread | a weight value | HGMMA | STS | LDS / LDSM | "
          "global loads |\n|---|---|---|---|---|---|---|---|---|")
    for decode, block_m in [(decode, block_m) for decode in ("float", "pairs", "q6_k") for block_m in args.rows]:
        compiled = compile_for_hopper(block_m, decode, args.x_ahead)
        body = loop(compiled)
        ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0] for ins in body)
        hgmma, sts, lds = (sum(v for op, v in ops.items() if op.startswith(p)) for p in ("HGMMA", "STS", "LDS"))
        loads = ", ".join(f"{op} {v}" for op, v in sorted(ops.items()) if op.startswith("LDG"))
        print(f"| {decode} | {block_m} | {resources(compiled)['REG']} | {len(body)} | "
              f"{len(body) * 128 / (TILE_N * TILE_K):.2f} | "
              f"{hgmma} | {sts} | {lds} | {loads} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
