"""The planes of ``engine.models.quant_gluon`` (issue #28; that module documents the layout and the decodes): a Q4_K,
Q6_K or Q4_1 weight's blocks reordered at load so that one 32-bit word holds a thread's 8 values of a 16-column slice of
the matrix unit's A operand (``repack``, ``repack_q6_k``, ``repack_q4_1``), and the weights they hold, computed as the
kernels' decodes compute them (``reference``, ``reference_q6_k``, ``reference_q4_1``: the CPU tests' and any call the
kernels do not take)."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from engine.models import quant

Q4_K = quant.FORMATS["Q4_K"]
Q4_1 = quant.FORMATS["Q4_1"]
TILE_N, TILE_K = 64, 128


def _pack(q: Tensor, width: int, order: tuple[int, ...], shape: tuple[int, ...]) -> Tensor:
    """Fields ``width`` bits wide into int32 words: ``q`` reshaped to ``shape`` and permuted by ``order`` so that
    its last dimensions (32 / width values) are one word's fields, lowest first."""
    q = q.to(torch.int64).reshape(shape).permute(*order)
    per = 32 // width
    q = q.reshape(-1, per) << (width * torch.arange(per, device=q.device))
    words = q.sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def padded_rows(n: int) -> int:
    """A weight's rows in its planes: whole 64-row tiles, the rows past ``n`` zero."""
    return -(-n // TILE_N) * TILE_N


def padded_cols(cols: int) -> int:
    """A weight's columns in its planes: whole 128-column tiles (Q4_1's K = 576 is 4.5), the columns past ``cols``
    zero."""
    return -(-cols // TILE_K) * TILE_K


def _padded(q: Tensor, n_pad: int, cols_pad: int | None = None) -> Tensor:
    """Rows (and with ``cols_pad`` columns) zero-padded."""
    if cols_pad is not None and cols_pad > q.shape[1]:
        q = torch.cat([q, q.new_zeros(q.shape[0], cols_pad - q.shape[1])], dim=1)
    return torch.cat([q, q.new_zeros(n_pad - q.shape[0], q.shape[1])])


def _nibble_words(q: Tensor, cols: int, pairs: bool) -> Tensor:
    """Values 0..15 [N padded, cols] in natural order -> the words: order [16-row group][128-column tile][s // 4][g]
    [t][s % 4] (row ``16 G + 8 h + g``, column ``128 kt + 16 s + 8 j + 2 t + e``: a thread's 8 words are two runs of
    4, so each of a warp's two 16-byte loads reads 512 contiguous bytes), nibble ``4 j + 2 h + e`` or with ``pairs``
    ``4 e + 2 j + h`` (the two columns of a register 16 bits apart: one mask makes their bf16 pair)."""
    shape = (q.shape[0] // 16, 2, 8, cols // TILE_K, 2, 4, 2, 4, 2)  # [G, h, g, kt, s // 4, s % 4, j, t, e]
    return _pack(q, 4, (0, 3, 4, 2, 7, 5, 8, 6, 1) if pairs else (0, 3, 4, 2, 7, 5, 6, 1, 8), shape)


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
    n_pad = padded_rows(n)
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
    n_pad = padded_rows(n)
    b = quant.unhold(held, fmt).reshape(-1, fmt.nbytes)
    low = quant._nibbles(b[:, 0:128].reshape(-1, 2, 64)).reshape(n, cols)
    top = quant._bits(b[:, 128:192].reshape(-1, 2, 32), 2).permute(0, 1, 3, 2).reshape(n, cols)
    words = _nibble_words(_padded(low, n_pad), cols, True)
    shape = (n_pad // 16, 2, 8, cols // TILE_K, 4, 2, 2, 4, 2)  # [G, h, g, kt, u, o, j, t, e]
    high = _pack(_padded(top, n_pad), 2, (0, 3, 2, 7, 4, 8, 5, 6, 1), shape)
    scales = _padded(b[:, 192:208].reshape(n, cols // 16), n_pad).view(torch.int8).contiguous()
    d = _padded(b[:, 208:210].reshape(n, -1), n_pad).view(torch.float16).contiguous()
    return words, high, scales, d


@_by_rows
def repack_q4_1(blocks: Tensor, cols: int) -> tuple[Tensor, Tensor]:
    """Q4_1 rows [N, row_bytes] (as the file has them, 20-byte blocks: fp16 d and m, 16 bytes of nibbles, values
    0-15 low and 16-31 high) -> (words, steps): the nibbles as Q4_K's pair words (``_nibble_words``) over the
    columns padded to whole 128-column tiles (``padded_cols``), and each block's bf16(d) (low half) and bf16(m)
    (high) in one int32 [N padded, padded columns / 32]: the pair decode's q * bf16(d) + bf16(m) needs no
    conversion in the kernel. Padded rows and columns are zero (their values 0)."""
    assert blocks.dtype == torch.uint8 and cols % Q4_1.values == 0 and blocks.shape[1] == Q4_1.row_bytes(cols)
    n = blocks.shape[0]
    n_pad, cols_pad = padded_rows(n), padded_cols(cols)
    b = quant.unhold(blocks, Q4_1).reshape(-1, Q4_1.nbytes)  # (Q4_1 is held as the file has it: the same bytes)
    q = quant._nibbles(b[:, 4:20].unsqueeze(1)).reshape(n, cols)  # natural order, 0..15
    words = _nibble_words(_padded(q, n_pad, cols_pad), cols_pad, True)
    d, m = (b[:, at:at + 2].contiguous().view(torch.float16).to(torch.bfloat16).view(torch.int16).to(torch.int64)
            & 0xFFFF for at in (0, 2))
    packed = (d | (m << 16)).reshape(n, cols // Q4_1.values)
    steps = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return words, _padded(steps, n_pad, cols_pad // Q4_1.values).contiguous()


def _unpacked(words: Tensor, n_pad: int, cols: int, pairs: bool) -> Tensor:
    """``_nibble_words``'s inverse: the words -> values 0..15 [N padded, cols] in natural order."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    q = (w[:, None] >> (4 * torch.arange(8, device=w.device))) & 15  # [word, nibble]
    q = q.reshape(n_pad // 16, cols // TILE_K, 2, 8, 4, 4, 2, 2, 2)  # [G, kt, s // 4, g, t, s % 4, (j, h, e) or
    # (e, j, h)] -> [G, h, g, kt, s // 4, s % 4, j, t, e]
    order = (0, 8, 3, 1, 2, 5, 7, 4, 6) if pairs else (0, 7, 3, 1, 2, 5, 6, 4, 8)
    return q.permute(*order).reshape(n_pad, cols)


def reference_q6_k(words: Tensor, high: Tensor, scales: Tensor, d: Tensor, n: int, cols: int) -> Tensor:
    """The bf16 weight [n, cols] ``repack_q6_k``'s planes hold, as the pair decode computes it: (q - 32) *
    bf16(d * scale), one rounding (``quant.dequantize``: d * scale * (q - 32) in float32, then bf16)."""
    n_pad = d.shape[0]
    low = _unpacked(words, n_pad, cols, pairs=True)
    hw = high.to(torch.int64) & 0xFFFFFFFF
    top = (hw[:, None] >> (2 * torch.arange(16, device=hw.device))) & 3
    top = top.reshape(n_pad // 16, cols // TILE_K, 8, 4, 4, 2, 2, 2, 2)  # [G, kt, g, t, u, e, o, j, h]
    top = top.permute(0, 8, 2, 1, 4, 6, 7, 3, 5).reshape(n_pad, cols)
    step = (d.float().repeat_interleave(16, dim=1) * scales.float()).to(torch.bfloat16).double()
    q = (low | (top << 4)).double() - 32
    return round_bf16(q.reshape(n_pad, -1, 16) * step[..., None]).reshape(n_pad, cols)[:n]


def reference_q4_1(words: Tensor, steps: Tensor, n: int, cols: int) -> Tensor:
    """The bf16 weight [n, cols] ``repack_q4_1``'s planes hold, as the pair decode computes it: q * bf16(d) +
    bf16(m), one rounding (``quant.dequantize``: d * q + m in float32, then bf16)."""
    n_pad, cols_pad = steps.shape[0], padded_cols(cols)
    q = _unpacked(words, n_pad, cols_pad, pairs=True).double().reshape(n_pad, -1, Q4_1.values)
    w = steps.to(torch.int64) & 0xFFFFFFFF
    d, m = ((w >> shift & 0xFFFF).to(torch.int16).view(torch.bfloat16).double()[..., None] for shift in (0, 16))
    return round_bf16(q * d + m).reshape(n_pad, cols_pad)[:n, :cols]


def reference(words: Tensor, heads: Tensor, n: int, cols: int, pairs: bool = False) -> Tensor:
    """The weight [n, cols] ``words`` and ``heads`` hold, by the layout ``repack`` documents (each word's 8 nibbles
    at their rows and columns, each block's scale and min): ``quant.dequantize``'s values in float32, or with
    ``pairs`` the bf16 pair decode's (``benchmarks/quant_packed.values``: q * bf16(d * scale) + bf16(-dmin * min), one
    rounding). The kernel's own assembly of a tile is replayed by ``tests/engine/models/test_quant_gluon.py``."""
    n_pad = heads.shape[0]
    q = _unpacked(words, n_pad, cols, pairs)
    head = heads.reshape(n_pad, -1, 4).contiguous().view(torch.uint8).reshape(-1, 16)
    scales, mins = quant._k_scales(head[:, 4:16])
    if pairs:
        step = (quant._f16(head, 0) * scales.float()).to(torch.bfloat16).double()
        offset = (-(quant._f16(head, 2) * mins.float())).to(torch.bfloat16).double()
        values = round_bf16(q.reshape(-1, 8, 32).double() * step[..., None] + offset[..., None])
        return values.reshape(n_pad, cols)[:n]
    step = quant._f16(head, 0) * scales.float()
    shift = quant._f16(head, 2) * mins.float()
    values = step[:, :, None] * q.reshape(-1, 8, 32).float() - shift[:, :, None]
    return values.reshape(n_pad, cols)[:n]


def round_bf16(w: Tensor) -> Tensor:
    """float64 -> bf16 to nearest even, once (PyTorch goes through float32: two roundings), in bf16's normal
    range (below 2**-126 it rounds twice; no Q4_K, Q6_K or Q4_1 value is that small)."""
    bits = w.view(torch.int64)
    bits = (bits + ((1 << 44) - 1) + ((bits >> 45) & 1)) & ~((1 << 45) - 1)  # 7 mantissa bits kept
    return bits.view(torch.float64).float().to(torch.bfloat16)  # now exact in float32 and in bf16
