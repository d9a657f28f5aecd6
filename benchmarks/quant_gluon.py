"""A prototype of issue #28's decode redesign (not the engine's kernel): Q4_K weights decoded straight into the
matrix unit's operand registers, in Gluon (Triton's explicit-layout dialect), so no decoded value touches shared
memory.

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

Values: ``d * scale * q - dmin * min`` in float32 with one rounding (a fused multiply-add), then bf16: the bits
``quant.dequantize`` gives, and so the engine kernel's. The block's 16-byte head (d, dmin, the packed 6-bit
scales and mins) stays as the file has it, in a plane of its own (``repack``); each word's scale and min are
decoded from it. The K order is the natural one, 16 columns an instruction, as the engine kernel's ``tl.dot``.
Rows past N are padded to whole 64-row tiles; K must be whole 256-value blocks; a launch takes up to 64 rows
(``BLOCK_M`` 16, 32 or 64). Split over K (``split``): each part's fp32 sums, then added in order 0..split-1.

No interpreter runs Gluon: the CPU tests check ``repack``'s order against the GGUF bytes and ``quant.dequantize``
(through ``reference``), replay the kernel's joins and permutation in PyTorch, and compile it for sm_90 with the
conversion trivial; on a GPU, ``tests/test_quant_gluon.py`` checks its bits against the dequantized product.
"""

from __future__ import annotations

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


def nibble_of(j: int, h: int, e: int, pairs: bool = False) -> int:
    """Where a thread's value (j, h, e) sits in its word: nibble ``4 j + 2 h + e`` (each value decoded alone), or
    with ``pairs`` ``4 e + 2 j + h`` (the two columns of a register 16 bits apart: one mask makes their bf16 pair)."""
    return 4 * e + 2 * j + h if pairs else 4 * j + 2 * h + e


def repack(blocks: Tensor, cols: int, pairs: bool = False) -> tuple[Tensor, Tensor]:
    """Q4_K rows [N, row_bytes] -> (words, heads): the nibbles as the kernel's threads read them, int32
    [ceil(N / 64) * 4 * (cols / 128) * 256] in order [16-row group][128-column tile][g][t][s] (the word's
    nibble ``nibble_of(j, h, e, pairs)``: row ``16 G + 8 h + g``, column ``128 kt + 16 s + 8 j + 2 t + e``), and
    each block's 16-byte head, int32 [N padded, cols / 256, 4]. Padded rows are zero."""
    assert blocks.dtype == torch.uint8 and cols % quant.QK_K == 0 and blocks.shape[1] == Q4_K.row_bytes(cols)
    n = blocks.shape[0]
    n_pad = -(-n // TILE_N) * TILE_N
    b = blocks.reshape(-1, Q4_K.nbytes)
    q = quant._nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(n, cols).to(torch.int64)  # natural order, 0..15
    q = torch.cat([q, q.new_zeros(n_pad - n, cols)])
    # [G, h, g, kt, s, j, t, e] -> [G, kt, g, t, s, (j, h, e) or (e, j, h)]: the last three are the nibble's place
    q = q.reshape(n_pad // 16, 2, 8, cols // TILE_K, 8, 2, 4, 2)
    q = q.permute(0, 3, 2, 6, 4, 7, 5, 1) if pairs else q.permute(0, 3, 2, 6, 4, 5, 1, 7)
    q = q.reshape(-1, 8) << (4 * torch.arange(8, device=q.device))
    words = q.sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    heads = b[:, :16].reshape(n, cols // quant.QK_K, 16).contiguous().view(torch.int32)
    heads = torch.cat([heads, heads.new_zeros(n_pad - n, cols // quant.QK_K, 4)])
    return words.contiguous(), heads.contiguous()


def reference(words: Tensor, heads: Tensor, n: int, cols: int, pairs: bool = False) -> Tensor:
    """The weight [n, cols] ``words`` and ``heads`` hold, by the layout ``repack`` documents (each word's 8 nibbles
    at their rows and columns, each block's scale and min): ``quant.dequantize``'s values in float32, or with
    ``pairs`` the bf16 pair decode's (``quant_packed.values``: q * bf16(d * scale) + bf16(-dmin * min), one
    rounding). The kernel's own assembly of a tile is replayed by ``tests/test_quant_gluon.py``."""
    n_pad = heads.shape[0]
    w = words.to(torch.int64) & 0xFFFFFFFF
    q = (w[:, None] >> (4 * torch.arange(8, device=w.device))) & 15  # [word, nibble]
    q = q.reshape(n_pad // 16, cols // TILE_K, 8, 4, 8, 2, 2, 2)  # [G, kt, g, t, s, (j, h, e) or (e, j, h)]
    order = (0, 7, 2, 1, 4, 6, 3, 5) if pairs else (0, 6, 2, 1, 4, 5, 3, 7)
    q = q.permute(*order).reshape(n_pad, cols)
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


def linear(x: Tensor, words: Tensor, heads: Tensor, n: int, cols: int, split: int = 1, pairs: bool = False) -> Tensor:
    """``x @ W^T`` [M, n] in x's dtype (bf16), W the repacked Q4_K weight (``repack`` with the same ``pairs``), for
    1 to 64 rows, on a GPU."""
    m = x.shape[0]
    assert x.dtype == torch.bfloat16 and 1 <= m <= 64 and x.shape[1] == cols and cols % (TILE_K * split) == 0
    block_m = max(16, 1 << (m - 1).bit_length())  # 16, 32 or 64: a power of two
    tiles = heads.shape[0] // TILE_N
    parts = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    _gluon_kernel[(tiles, split)](x.contiguous(), words, heads, parts, m, n, cols, cols // TILE_K // split,
                                   BLOCK_M=block_m, PAIRS=pairs, num_warps=4)
    out = parts[0]
    for p in range(1, split):  # in order 0..split-1, as the engine kernel's tickets add them
        out = out + parts[p]
    return out.to(x.dtype)


def install(pairs: bool = False) -> None:
    """Route the engine's Q4_K few-row products (bf16, up to 64 rows, K whole 256-value blocks, no bias) through
    this prototype (``pairs``: its bf16 pair decode), every other product through the engine's kernel:
    ``quant_kernel.linear`` replaced in place, for a benchmark process only (``gpu_bench.py --q4k-decode gluon``
    or ``gluon-pairs``: the whole AR step and verify). A weight is
    repacked on its first such call and kept (the blocks stay too): that call must come before a graph is
    captured, as the engine's eager warm-up steps do; one first met during a capture takes the engine's kernel."""
    from engine.models import quant_kernel

    engine_linear = quant_kernel.linear
    # by the rows' address and shape (a fused group's ``part`` is a fresh slice each call, the same rows), with a
    # weak reference to the tensor that owns them: a dead owner's address may hold another weight's blocks
    repacked: dict[tuple[int, tuple[int, ...]], tuple[weakref.ref, Tensor, Tensor]] = {}

    def routed(x: Tensor, blocks: Tensor, fmt, cols: int, bias: Tensor | None = None) -> Tensor:
        rows = x.numel() // cols
        if fmt.name != "Q4_K" or cols % quant.QK_K or bias is not None or x.dtype != torch.bfloat16 or rows > 64:
            return engine_linear(x, blocks, fmt, cols, bias)
        key = (blocks.data_ptr(), tuple(blocks.shape))
        if key not in repacked or repacked[key][0]() is None:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                return engine_linear(x, blocks, fmt, cols, bias)
            owner = blocks if blocks._base is None else blocks._base
            repacked[key] = (weakref.ref(owner), *repack(blocks, cols, pairs))
        n = blocks.shape[0]
        out = linear(x.reshape(rows, cols), *repacked[key][1:], n, cols, split_for(n, cols), pairs)
        return out.view(*x.shape[:-1], n)

    quant_kernel.linear = routed


if gluon is not None:
    # the engine kernel's Triton helpers (Gluon calls them): an fp16 half, Q4_K's 6-bit fields, a small int's float
    from engine.models.quant_kernel import _float, _half_of, k_scale_min

    @gluon.jit
    def _nibble(words, p: gl.constexpr):
        return _float((words >> (4 * p)) & 15, 0)  # the engine kernel's float of a small int, no conversion

    @gluon.jit
    def _head(heads_ptr, row, kt, K):
        """Each row's 16-byte block head for K tile ``kt`` (d and dmin, then the packed scales and mins: 4 words)."""
        at = (row[:, None] * (K // 256) + kt // 2) * 4
        return gl.load(heads_ptr + at), gl.load(heads_ptr + at + 1), gl.load(heads_ptr + at + 2), \
            gl.load(heads_ptr + at + 3)

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
        """Nibbles ``4 e + 2 j + h``: for each (j, h) one mask puts the two columns' nibbles (e = 0, 1, 16 bits
        apart) under bf16's exponent of 128, 128 + q each; the int32 pairs are joined (h, then j: register bits 1
        and 2), then read as their two bf16 (an ``mov``; e becomes register bit 0), less 128 (exact), and
        q * bf16(d * scale) + bf16(-dmin * min) in bf16, one rounding: ptxas pairs these into ``HADD2.BF16_V2`` and
        ``HFMA2.BF16_V2``, one instruction two values. -> [32, 32, j, h, e]"""
        p00 = _under_128(words)  # j 0, h 0 (nibbles 0 and 4)
        p01 = _under_128(words >> 4)  # j 0, h 1
        p10 = _under_128(words >> 8)  # j 1, h 0
        p11 = _under_128(words >> 12)  # j 1, h 1
        p = gl.join(gl.join(p00, p10), gl.join(p01, p11))  # [32, 32, j, h]
        q = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [gl.join(p, p)], dtype=gl.bfloat16,
                                      is_pure=True, pack=2) - 128.0
        s0, s1 = st0.to(gl.bfloat16), st1.to(gl.bfloat16)
        o0, o1 = (-sh0).to(gl.bfloat16), (-sh1).to(gl.bfloat16)
        step = gl.join(gl.join(s0, s0), gl.join(s1, s1))
        offset = gl.join(gl.join(o0, o0), gl.join(o1, o1))
        return gl.fma(q, gl.join(step, step), gl.join(offset, offset))

    @gluon.jit
    def _gluon_kernel(x_ptr, words_ptr, heads_ptr, parts_ptr, M, N, K, k_tiles, BLOCK_M: gl.constexpr,
                      PAIRS: gl.constexpr):
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_M, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        # words [32 = (w, g), 4 = t, 8 = s]: s in registers (contiguous), t and g in lanes (lane 4 g + t), w in warps
        wl: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 8], threads_per_warp=[8, 4, 1],
                                            warps_per_cta=[4, 1, 1], order=[2, 1, 0])
        # the steps: one (row, sub-block) a thread where they are decoded (lane t: sub-block t of the tile's four),
        # then all four a thread (the t lanes alike), as [32, 1, 8] beside the words (s // 2 is the sub-block)
        one: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[8, 4], warps_per_cta=[4, 1],
                                             order=[1, 0])
        four: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[8, 4], warps_per_cta=[4, 1],
                                              order=[1, 0])
        xl: gl.constexpr = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[16, 2], warps_per_cta=[1, 4],
                                            order=[0, 1])
        xs: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, transposed=True)
        tile = gl.program_id(0)
        part = gl.program_id(1)
        rr = gl.arange(0, 32, layout=gl.SliceLayout(1, gl.SliceLayout(2, wl)))
        tt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, wl)))
        ss = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, wl)))
        xk = gl.arange(0, 128, layout=gl.SliceLayout(1, xl))
        xm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, xl))
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [128, BLOCK_M], xs)
        acc = gl.zeros([64, BLOCK_M], gl.float32, layout=mma)
        all_tiles = K // 128
        wbase = ((tile * 4 + rr // 8) * (all_tiles * 256) + (rr % 8) * 32)[:, None, None] \
            + (tt * 8)[None, :, None] + ss[None, None, :]
        sr = gl.arange(0, 32, layout=gl.SliceLayout(1, one))
        row0 = tile * 64 + (sr // 8) * 16 + sr % 8  # h = 0; h = 1 is 8 rows on
        sub = gl.arange(0, 4, layout=gl.SliceLayout(0, one))
        # each tile's words and heads are read one iteration ahead (registers: the load of tile i + 1 is in flight
        # while tile i is decoded and multiplied); the last iteration reads its own tile again (a cache hit, no mask)
        kt0 = part * k_tiles
        words_n = gl.load(words_ptr + wbase + kt0 * 256)
        h0_n, a0_n, m0_n, r0_n = _head(heads_ptr, row0, kt0, K)
        h1_n, a1_n, m1_n, r1_n = _head(heads_ptr, row0 + 8, kt0, K)
        for i in range(0, k_tiles):
            kt = kt0 + i
            nxt = kt + (i + 1 < k_tiles).to(gl.int32)
            words, h0, a0, m0, r0, h1, a1, m1, r1 = words_n, h0_n, a0_n, m0_n, r0_n, h1_n, a1_n, m1_n, r1_n
            words_n = gl.load(words_ptr + wbase + nxt * 256)
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
            # [w, g, t, s, j, h, e] -> [w, h, g | s, j, t, e] = [64, 128] (tests/test_quant_gluon.py replays the
            # joins, this reshape and the permutation on the CPU)
            a = a.reshape([4, 8, 4, 8, 2, 2, 2]).permute([0, 5, 1, 3, 4, 2, 6]).reshape([64, 128])
            a = gl.convert_layout(a, a_layout, assert_trivial=True)  # a renaming: no data moves
            xt = gl.load(x_ptr + xm[None, :] * K + (kt * 128 + xk)[:, None], mask=(xm < M)[None, :], other=0.0)
            x_smem.store(xt)
            fence_async_shared()
            acc = warpgroup_mma(a, x_smem, acc)
        ol: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[32, 1], warps_per_cta=[4, 1],
                                            order=[0, 1])
        acc = gl.convert_layout(acc, ol)
        on = tile * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, ol))
        om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, ol))
        gl.store(parts_ptr + part * M * N + om[None, :] * N + on[:, None], acc,
                 mask=(on < N)[:, None] & (om < M)[None, :])


def compile_for_hopper(block_m: int = 16, pairs: bool = False):
    """The kernel compiled for sm_90 (no GPU needed): the launch ``linear`` makes for ``block_m`` rows."""
    import triton
    from triton.backends.compiler import GPUTarget

    sig = {"x_ptr": "*bf16", "words_ptr": "*i32", "heads_ptr": "*i32", "parts_ptr": "*fp32", "M": "i32", "N": "i32",
           "K": "i32", "k_tiles": "i32", "BLOCK_M": "constexpr", "PAIRS": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 6)}
    src = gluon._runtime.GluonASTSource(fn=_gluon_kernel, signature=sig, attrs=attrs,
                                        constexprs={"BLOCK_M": block_m, "PAIRS": pairs})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


SHAPES = [("27B gate_up", 34816, 5120), ("27B down", 5120, 17408), ("27B GDN in_proj", 16480, 5120),
          ("27B o_proj", 5120, 6144)]


def split_for(n: int, cols: int, sms: int = 132, per_sm: int = 2) -> int:
    """Parts of K so that a launch has about ``per_sm`` programs an SM (the 64-row tiles alone are fewer on a
    narrow weight), each part whole 128-column tiles."""
    tiles, k_tiles = -(-n // TILE_N), cols // TILE_K
    split = max(1, min(k_tiles, -(-per_sm * sms // tiles)))
    while k_tiles % split:
        split -= 1
    return split


def bench(rows: tuple[int, ...] = (1, 33)) -> list[str]:
    """GPU us a call of the engine's Q4_K kernel (the weight's plan) and of this one (``split_for``), its float
    decode and its bf16 pair decode, on each 27B Q4_K weight, weights cycled through 256 MB; each decode's row
    invariance and error against the product of ``quant.dequantize``'s weight."""
    from kernel_timing import time_us
    from quant_bench import _copies, _rotating

    from engine.models import quant_kernel
    from engine.models.quantize import quantize

    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lines = ["| weight | MB | split (x4) | "
             + " | ".join(f"{m} rows: engine / gluon / pairs / pairs x4 us" for m in rows)
             + " | rows invariant: gluon, pairs | error: engine / gluon / pairs |",
             "|---|---|---|" + "---|" * (len(rows) + 2)]
    for label, n, k in SHAPES:
        blocks = quantize(torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02, Q4_K)
        copies = _copies(blocks.numel())
        pick_blocks = _rotating([blocks] + [blocks.clone() for _ in range(copies - 1)])
        split, split4 = split_for(n, k, sms), split_for(n, k, sms, per_sm=4)
        xs = {m: torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16) for m in rows}
        times = {m: [time_us(lambda x=xs[m], b=pick_blocks, k=k: quant_kernel.linear(x, b(), Q4_K, k))] for m in rows}
        x = xs[max(rows)]
        exact = x.double() @ quant.dequantize(blocks, Q4_K, k).to(torch.bfloat16).double().T
        got = [quant_kernel.linear(x, blocks, Q4_K, k)]
        invariant = []
        for pairs in (False, True):
            packed = [repack(blocks, k, pairs)]
            pick = _rotating(packed + [(w.clone(), h.clone()) for w, h in packed * (copies - 1)])
            for m in rows:
                for sp in (split, split4) if pairs else (split,):
                    times[m].append(time_us(lambda x=xs[m], p=pick, n=n, k=k, s=sp, pr=pairs:
                                            linear(x, *p(), n, k, s, pr)))
            many = linear(x, *packed[0], n, k, split, pairs)
            invariant.append("y" if torch.equal(linear(x[:1], *packed[0], n, k, split, pairs), many[:1]) else "n")
            got.append(many)
            del packed, pick
        errors = [float((g.double() - exact).norm() / exact.norm()) for g in got]
        lines.append(f"| {label} ({n} x {k}) | {blocks.numel() / 1e6:.1f} | {split} ({split4}) | "
                     + " | ".join(" / ".join(f"{t:.1f}" for t in times[m]) for m in rows)
                     + f" | {', '.join(invariant)} | {' / '.join(f'{e:.1e}' for e in errors)} |")
        print(lines[-1], flush=True)
        del blocks, pick_blocks
        torch.cuda.empty_cache()
    return lines


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
    args = ap.parse_args(argv)
    if gluon is None:
        print("this Triton has no Gluon", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.bench:
        if not torch.cuda.is_available():
            print("--bench needs CUDA", file=sys.stderr)
            return 2
        lines = bench()
        if args.md:
            Path(args.md).write_text("\n".join(lines) + "\n")
        return 0
    from kernel_check import loop, resources

    print("| decode | BLOCK_M | registers | loop instructions a thread | a weight value | HGMMA | STS | LDS / LDSM | "
          "global loads |\n|---|---|---|---|---|---|---|---|---|")
    for pairs, block_m in [(pairs, block_m) for pairs in (False, True) for block_m in args.rows]:
        compiled = compile_for_hopper(block_m, pairs)
        body = loop(compiled)
        ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0] for ins in body)
        hgmma, sts, lds = (sum(v for op, v in ops.items() if op.startswith(p)) for p in ("HGMMA", "STS", "LDS"))
        loads = ", ".join(f"{op} {v}" for op, v in sorted(ops.items()) if op.startswith("LDG"))
        print(f"| {'pairs' if pairs else 'float'} | {block_m} | {resources(compiled)['REG']} | {len(body)} | "
              f"{len(body) * 128 / (TILE_N * TILE_K):.2f} | "
              f"{hgmma} | {sts} | {lds} | {loads} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
