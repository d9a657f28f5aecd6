"""The pieces the Gluon kernels of ``engine.models.quant_gluon`` share (issue #28; that module documents the planes, the
decodes and the launches): the layouts (a thread's words, its lanes, the matrix unit's accumulator), a tile's words and
heads and their offsets, the Q4_K and Q6_K pair decodes (Q4_1's too) and the float one, x's tile, the decoded tile as
wgmma's A operand, and the grid-dependency instructions of programmatic dependent launch. The K loops that use them are
in ``quant_gluon_kernels`` (the register path) and ``quant_gluon_staged`` (tiles staged in shared memory)."""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy
except ImportError:  # pragma: no cover - a Triton without Gluon
    gluon = None

if gluon is not None:
    # the engine kernel's Triton helpers (Gluon calls them): an fp16 half, Q4_K's 6-bit fields, a small int's float
    from engine.models.quant_kernel import _float, _half_of, k_scale_min

    _barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # a CTA's bar.sync (Triton 3.9's name; 3.6's)
    # cp.async global -> shared (Triton 3.9's name; 3.6's)
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

    @gluon.constexpr_function
    def _words_layout(warps):
        """words [8 W = (w, g), 4 = t, 8 = s]: s in registers (contiguous), t and g in lanes (lane 4 g + t), w in
        warps."""
        return gl.BlockedLayout(size_per_thread=[1, 1, 8], threads_per_warp=[8, 4, 1], warps_per_cta=[warps, 1, 1],
                                order=[2, 1, 0])

    @gluon.constexpr_function
    def _lanes_layout(warps, per_thread):
        """[8 W rows (w, g), 4]: ``per_thread`` 1, one (row, sub-block) a thread (lane t: sub-block t); 4, all four a
        thread (the t lanes alike)."""
        return gl.BlockedLayout(size_per_thread=[1, per_thread], threads_per_warp=[8, 4], warps_per_cta=[warps, 1],
                                order=[1, 0])

    @gluon.constexpr_function
    def _quads_layout(warps):
        """[8 W rows (w, g), 4 lanes t, 4]: 4 words (16 bytes) a thread."""
        return gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[8, 4, 1], warps_per_cta=[warps, 1, 1],
                                order=[2, 1, 0])

    @gluon.constexpr_function
    def _mma_layout(warps, block_m):
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_m, 16])

    @gluon.jit
    def _word_offsets(tile, all_tiles):
        """Each thread's 8 words of a 128-column tile (add ``kt * 256``): [8 W, 4, 8] in ``_words_layout``; word s
        at ``128 (s // 4) + 4 (4 g + t) + s % 4`` of its warp's run (``_nibble_words``: a warp's 16-byte loads each
        read 512 contiguous bytes)."""
        W: gl.constexpr = gl.num_warps()
        wl: gl.constexpr = _words_layout(W)
        rr = gl.arange(0, 8 * W, layout=gl.SliceLayout(1, gl.SliceLayout(2, wl)))
        tt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, wl)))
        ss = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, wl)))
        at = ((tile * W + rr // 8) * (all_tiles * 256) + (rr % 8) * 16)[:, None, None] \
            + (tt * 4)[None, :, None] + ((ss // 4) * 128 + ss % 4)[None, None, :]
        return gl.max_contiguous(gl.multiple_of(at, [1, 1, 4]), [1, 1, 4])

    @gluon.jit
    def _nibble(words, p: gl.constexpr):
        return _float((words >> (4 * p)) & 15, 0)  # the engine kernel's float of a small int, no conversion

    @gluon.jit
    def _head_words(heads_ptr, tile, kt, K, h: gl.constexpr):
        """Rows ``h``'s 16-byte block heads for K tile ``kt`` (d and dmin, then the packed scales and mins: 4 words),
        one 16-byte load a thread: [8 W, 4, 4] in ``_quads_layout`` (each thread its row, the 4 t lanes the same
        head); ``_head_fields`` splits them."""
        W: gl.constexpr = gl.num_warps()
        hl: gl.constexpr = _quads_layout(W)
        sr = gl.arange(0, 8 * W, layout=gl.SliceLayout(1, gl.SliceLayout(2, hl)))
        word = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, hl)))
        lane = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, hl)))
        row = tile * (16 * W) + (sr // 8) * 16 + 8 * h + sr % 8  # row 16 w + 8 h + g of the tile
        at = ((row * (K // 256) + (kt >> 1)) * 4)[:, None, None] + (lane * 0)[None, :, None] + word[None, None, :]
        return gl.load(heads_ptr + gl.max_contiguous(gl.multiple_of(at, [1, 1, 4]), [1, 1, 4]))  # lanes t alike

    @gluon.jit
    def _head_fields(head):
        """``_head_words``' 4 words as 4 x [8 W, 4] in ``_lanes_layout(W, 1)`` (each thread its row, its lane's
        sub-block)."""
        W: gl.constexpr = gl.num_warps()
        even, odd = head.reshape([8 * W, 4, 2, 2]).split()  # words 0 and 2, 1 and 3
        dm, m = even.split()
        a, r = odd.split()
        one: gl.constexpr = _lanes_layout(W, 1)
        return (gl.convert_layout(dm, one, assert_trivial=True), gl.convert_layout(a, one, assert_trivial=True),
                gl.convert_layout(m, one, assert_trivial=True), gl.convert_layout(r, one, assert_trivial=True))

    @gluon.jit
    def _step_shift(head, a, m, r, kt, sub):
        """d * scale and dmin * min (exact in float32) of each row's 32-value sub-block ``sub`` of tile ``kt``."""
        # the sub-block within its 256-value block; & and >> for a tile index (never negative) where signed % and //
        # cost the K loop 11 instructions a thread (the 27B Q4_K_M AR step 8.7 -> 8.5 ms on an H100, 2026-12-07)
        sc, mn = k_scale_min(a, m, r, (kt & 1) * 4 + sub[None, :])
        return _half_of(head) * sc.to(gl.float32), _half_of(head >> 16) * mn.to(gl.float32)

    @gluon.jit
    def _dependency_wait(v):
        """``griddepcontrol.wait``: until the kernel launched before this one (programmatic dependent launch, ``PDL``)
        has ended and its writes are visible; a no-op in a launch without PDL. Returns ``v`` (a scalar int32: the
        asm needs an operand, and the result keeps it ordered before what uses it)."""
        return gl.inline_asm_elementwise("griddepcontrol.wait; mov.b32 $0, $1;", "=r,r", [v], dtype=gl.int32,
                                         is_pure=False, pack=1)

    @gluon.jit
    def _let_dependents_launch(v):
        """``griddepcontrol.launch_dependents``: the next kernel (launched with PDL) may start its programs as this
        one's leave room; they wait (``_dependency_wait``) before reading what this one writes."""
        return gl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.b32 $0, $1;", "=r,r", [v],
                                         dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _from_quad(word, i: gl.constexpr):
        """Each thread's copy of lane ``4 g + i``'s ``word`` (its row's sub-block ``i``, ``_lanes_layout(W, 1)``):
        ``shfl.sync.idx`` within segments of 4 lanes (c = 0x1c03: lane mask 0x1c, clamp 3). Marked pure (the
        compiler may merge or move it): every call is in the K loop, where no branch diverges, so all 32 lanes
        always execute it, as the full member mask (-1) requires."""
        return gl.inline_asm_elementwise(f"shfl.sync.idx.b32 $0, $1, {i}, 0x1c03, -1;", "=r,r", [word],
                                         dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _pair_steps(st, sh):
        """A row's ``bf16(d * scale)`` and ``bf16(-dmin * min)`` for each of its thread's words (sub-block s // 2),
        [8 W, 4, 8] bf16 each in ``_words_layout``, from one sub-block a thread (``_step_shift``'s): packed into one
        word, gathered from the 4 lanes of the row by warp shuffles (no shared memory, no barrier: the same values as
        ``_beside``'s, which converts through shared memory with a CTA barrier each)."""
        # cvt.rn.bf16x2.f32 d, a, b: a (here -dmin * min) rounds into the high half, b (d * scale) the low
        packed = gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", [-sh, st], dtype=gl.int32,
                                           is_pure=True, pack=1)
        return _packed_steps(packed)

    @gluon.jit
    def _packed_steps(packed):
        """Each thread's (row, sub-block) bf16 pair (step low, offset high), [8 W, 4] in ``_lanes_layout(W, 1)``
        -> its row's step and offset for each of its thread's words (sub-block s // 2), [8 W, 4, 8] bf16 each in
        ``_words_layout``: gathered from the 4 lanes of the row by warp shuffles, then joined."""
        W: gl.constexpr = gl.num_warps()
        w0, w1, w2, w3 = _from_quad(packed, 0), _from_quad(packed, 1), _from_quad(packed, 2), _from_quad(packed, 3)
        # joins: innermost on s // 4, then (s // 2) % 2, then s % 2 (the words of one sub-block): s // 2 = sub-block
        w = gl.join(gl.join(gl.join(w0, w2), gl.join(w1, w3)), gl.join(gl.join(w0, w2), gl.join(w1, w3)))
        w = gl.convert_layout(w.reshape([8 * W, 4, 8]), _words_layout(W), assert_trivial=True)
        step = (w & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
        shift = (w >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        return step, shift

    @gluon.jit
    def _beside(v):
        """[8 W rows, 4 sub-blocks], one a thread -> [8 W, 1, 8]: each thread's row, its 8 words' sub-blocks
        (s // 2)."""
        W: gl.constexpr = gl.num_warps()
        v = gl.convert_layout(v, _lanes_layout(W, 4))
        v = gl.join(v, v).reshape([8 * W, 8])
        return gl.convert_layout(v, gl.SliceLayout(1, _words_layout(W)), assert_trivial=True).expand_dims(1)

    @gluon.jit
    def _values_tile(words, st0, sh0, st1, sh1):
        """Nibble ``4 j + 2 h + e`` of each word, each value in float32 (one rounding into bf16) -> [8 W, 4, 8, j, h,
        e]. A join adds a minor dimension; the outermost join's is register bit 0, which the operand layout gives to
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
    def _pairs_tile(words, st0, nsh0, st1, nsh1):
        """Nibbles ``4 e + 2 j + h``: for each (j, h) one mask puts the two columns' nibbles (16 bits apart) under
        bf16's exponent of 128, 128 + q each (``_bf16_pairs``); less 128 (exact), then q * bf16(d * scale) +
        bf16(-dmin * min) (``st``, ``nsh``: ``_pair_steps``'s, rows h = 0 and 1), one rounding (``HADD2.BF16_V2``,
        ``HFMA2.BF16_V2``: two values an instruction)."""
        p00 = _under_128(words)  # j 0, h 0 (nibbles 0 and 4)
        p01 = _under_128(words >> 4)  # j 0, h 1
        p10 = _under_128(words >> 8)  # j 1, h 0
        p11 = _under_128(words >> 12)  # j 1, h 1
        q = _bf16_pairs(p00, p01, p10, p11) - 128.0
        return gl.fma(q, _per_value(st0, st1), _per_value(nsh0, nsh1))

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
    def _x_smem(BLOCK_M: gl.constexpr):
        """The x tile's shared buffer [128, BLOCK_M] (wgmma's B operand, K-major)."""
        xs: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, transposed=True)
        return gl.allocate_shared_memory(gl.bfloat16, [128, BLOCK_M], xs)

    @gluon.jit
    def _x_tile(x_ptr, kt, K, M, BLOCK_M: gl.constexpr, K_MASK: gl.constexpr):
        """x's rows for K tile ``kt``, [128, BLOCK_M] bf16 in registers (rows past M zero, not read; with
        ``K_MASK``, columns past K too: a K that is not whole 128-column tiles, its planes zero-padded)."""
        xl: gl.constexpr = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[16, 2],
                                            warps_per_cta=[1, gl.num_warps()], order=[0, 1])
        xk = gl.arange(0, 128, layout=gl.SliceLayout(1, xl))
        xm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, xl))
        mask = (xm < M)[None, :]
        if K_MASK:
            mask = mask & (kt * 128 + xk < K)[:, None]
        return gl.load(x_ptr + xm[None, :] * K + (kt * 128 + xk)[:, None], mask=mask, other=0.0)

    @gluon.jit
    def _operand(a, acc):
        """The decoded [16 W, 128] tile (``a``: [w, g, t, s, j, h, e] as the joins leave it) as wgmma's A operand."""
        W: gl.constexpr = gl.num_warps()
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
        # [w, g, t, s, j, h, e] -> [w, h, g | s, j, t, e] = [16 W, 128] (tests/engine/models/test_quant_gluon.py
        # replays the joins, this reshape and the permutation on the CPU)
        a = a.reshape([W, 8, 4, 8, 2, 2, 2]).permute([0, 5, 1, 3, 4, 2, 6]).reshape([16 * W, 128])
        return gl.convert_layout(a, a_layout, assert_trivial=True)  # a renaming: no data moves

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
    def _q6_pairs_tile(words, high):
        """Q6_K's pairs: for each (j, h) the low nibbles (as Q4_K's pairs) and the top 2 bits (``high``: field
        ``8 e + 4 o + 2 j + h`` of slice pair u, s = 2 u + o) under 128: 128 + q each; less 160 (exact: q - 32).
        -> [8 W, 4, 8, j, h, e]"""
        W: gl.constexpr = gl.num_warps()
        top = gl.join(high, high >> 8).reshape([8 * W, 4, 8])  # slice s = 2 u + o: its fields at 2 (2 j + h) (+ 16)
        top = gl.convert_layout(top, _words_layout(W), assert_trivial=True)
        p00 = _with_low(words, _top_under_128(top << 4))  # j 0, h 0
        p01 = _with_low(words >> 4, _top_under_128(top << 2))  # j 0, h 1
        p10 = _with_low(words >> 8, _top_under_128(top))  # j 1, h 0
        p11 = _with_low(words >> 12, _top_under_128(top >> 2))  # j 1, h 1
        return _bf16_pairs(p00, p01, p10, p11) - 160.0

    @gluon.jit
    def _q6_steps(scales_ptr, d_ptr, row, kt, s, K):
        """bf16(d * scale) of each row's 8 slices of tile ``kt`` (16 values a scale): [8 W, 1, 8]."""
        at = gl.max_contiguous(gl.multiple_of(row[:, None] * (K // 16) + kt * 8 + s[None, :], [1, 8]), [1, 8])
        sc = gl.load(scales_ptr + at)  # 8 bytes a row (K // 16 is a multiple of 16: K is of 256)
        d = gl.load(d_ptr + row * (K // 256) + (kt >> 1))
        return (d.to(gl.float32)[:, None] * sc.to(gl.float32)).to(gl.bfloat16).expand_dims(1)
