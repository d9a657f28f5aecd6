"""The Gluon kernels of ``engine.models.quant_gluon`` (issue #28; that module documents the planes, the decodes and
the launches): the Q4_K, Q6_K and Q4_1 products' entry points, their K loops on the register path and their stores (the
pieces they share with the staged loops, ``quant_gluon_staged``, are in ``quant_gluon_decode``).

A launch's warps set its tile: ``W`` warps (4, 8 or 16) take ``16 W`` weight rows, one warpgroup (4 warps) each 64,
all of them multiplying the same x tile in shared memory; so 8 warps read x from L2 half as often a weight row as 4 do,
which is what a verify's 33 rows pay for (x is then ~1.8x the weight's bytes at 4 warps), and 16 half as often again. A
row's 16-row group keeps its place in the planes whatever the tile (the planes are ordered by 16-row groups), so one
repack serves every tile.

``X_AHEAD``: x's rows read an iteration ahead, into registers. (x kept in shared memory for the whole part of K,
a program taking a strided group of tiles and reading x once instead of once a tile, ran 1.2-1.9x slower at 33 rows
on an H100, 2026-12-06: one program an SM, where the decode's latency wants two or more.) (Each tile's
``warpgroup_mma`` waits for itself: left in flight while the next tile was decoded, the x tile in two buffers, ptxas
put a wait after every one of its 8 instructions, its A operand being registers: more instructions, no overlap. With the
decoded tile stored into shared memory instead, two buffers and one ``warpgroup_mma_wait`` a tile, the products were in
flight for real, and on an H100 the Q4_K launches ran 1.2-1.6x slower at 1-64 rows, Q6_K's 1.3-1.7x from 16-23 rows
(at 1-8 rows 0.96-1.00x), the 27B Q4_K_M verify at 32 16.3 -> 22.0 ms: the round trip through shared memory this
decode exists to avoid. 448bcb0, dropped; benchmarks/RESULTS.md, 2026-12-07.)
Split over K, each part's fp32 sums and then a ticket, as the engine's few-row kernels
(``engine.models.linear.store_rows``): the part that takes the last adds every part in order 0..split-1 (an even
split's in pairs first: parts 2j and 2j + 1, then those sums in order, ``PAIRED``) and writes the bf16 output, so a
product is one launch whatever its split; ``FOLD``: a program takes two parts and adds its pair itself, the same
additions (``quant_gluon.folds``)."""

from __future__ import annotations

from engine.models.quant_gluon_decode import gluon  # None: a Triton without Gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

    from engine.models import quant_gluon_staged as staged  # the staged tiles (``quant_gluon.STAGES``)
    from engine.models.quant_gluon_decode import (
        _barrier,
        _beside,
        _dependency_wait,
        _head_fields,
        _head_words,
        _lanes_layout,
        _let_dependents_launch,
        _mma_layout,
        _operand,
        _packed_steps,
        _pair_steps,
        _pairs_tile,
        _per_value,
        _q6_pairs_tile,
        _q6_steps,
        _quads_layout,
        _step_shift,
        _values_tile,
        _word_offsets,
        _words_layout,
        _x_smem,
        _x_tile,
    )

    @gluon.jit
    def _program(x_ptr, out_ptr, tickets_ptr, M, N, K, tiles, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                 PDL: gl.constexpr, TAIL: gl.constexpr):
        """A product kernel's start: its tile and part of K (``PDL``: the kernel after it let launch), the parts'
        stride, and its block of x's rows (``_row_block``); a tail only on the register path."""
        tile, part = gl.program_id(0), gl.program_id(1)
        if PDL:
            tile = _let_dependents_launch(tile)
        parts_stride = M * N
        x_ptr, out_ptr, tickets_ptr, M, at = _row_block(x_ptr, out_ptr, tickets_ptr, M, N, K, tiles, BLOCK_M + TAIL)
        gl.static_assert(STAGES <= 1 or TAIL == 0, "a tail takes the register path (STAGES 0 or 1)")
        return tile, part, parts_stride, x_ptr, out_ptr, tickets_ptr, M, at

    @gluon.jit
    def _row_block(x_ptr, out_ptr, tickets_ptr, M, N, K, tiles, BLOCK_M: gl.constexpr):
        """This program's block of x's rows (``program_id(2)``): x and out moved to its first row, its rows (at
        most ``BLOCK_M`` are read), its own tickets."""
        rb = gl.program_id(2).to(gl.int64)  # a prefill's rows times a head's N pass 2**31
        return (x_ptr + rb * BLOCK_M * K, out_ptr + rb * BLOCK_M * N, tickets_ptr + rb * tiles,
                M - rb * BLOCK_M, rb * BLOCK_M * N)

    # Not specialised on M (a launch's rows: 1, a verify's, a prefill chunk's) or the split: a weight's step launches
    # (up to MAX_ROWS rows) compile once a BLOCK_M and warps, in the eager warm-up before a graph captures them
    @gluon.jit(do_not_specialize=["M", "split"])
    def _gluon_kernel(x_ptr, words_ptr, heads_ptr, out_ptr, parts_ptr, tickets_ptr, M, N, K, k_tiles, split, tiles,
                      BLOCK_M: gl.constexpr, PAIRS: gl.constexpr, X_AHEAD: gl.constexpr, STAGES: gl.constexpr,
                      PDL: gl.constexpr, TAIL: gl.constexpr, FOLD: gl.constexpr, PAIRED: gl.constexpr):
        """A program a tile, a part of K and a block of x's rows (grid [tiles, split, row blocks]); ``FOLD``: its
        part is two of the weight's, added by the program; ``PAIRED``: the weight's parts are added in pairs
        (``_store_rows``)."""
        tile, part, parts_stride, x_ptr, out_ptr, tickets_ptr, M, at = _program(
            x_ptr, out_ptr, tickets_ptr, M, N, K, tiles, BLOCK_M, STAGES, PDL, TAIL)
        if STAGES > 1:
            acc = staged._q4k_tile_staged(x_ptr, words_ptr, heads_ptr, tile, part, M, K, k_tiles, BLOCK_M, STAGES,
                                          PDL)
            acc2 = acc
        else:
            acc, acc2 = _q4k_tile(x_ptr, words_ptr, heads_ptr, tile, part, M, K, k_tiles, BLOCK_M, PAIRS, X_AHEAD,
                                  PDL, TAIL, FOLD)
        _store_rows(acc, acc2, out_ptr, parts_ptr + at, tickets_ptr, tile, part, split, M, N, parts_stride, BLOCK_M,
                    TAIL, PAIRED)

    @gluon.jit
    def _q4k_tile(x_ptr, words_ptr, heads_ptr, tile, part, M, K, k_tiles, BLOCK_M: gl.constexpr,
                  PAIRS: gl.constexpr, X_AHEAD: gl.constexpr, PDL: gl.constexpr, TAIL: gl.constexpr,
                  FOLD: gl.constexpr):
        """One tile's sums over part ``part`` of K: [16 W, BLOCK_M] in the matrix unit's layout, and the ``TAIL``
        rows' after them ([16 W, TAIL]; the first again when TAIL is 0); ``FOLD``: the part's two halves summed
        apart and then added (``_folded``)."""
        W: gl.constexpr = gl.num_warps()
        x_smem = _x_smem(BLOCK_M)
        one: gl.constexpr = _lanes_layout(W, 1)
        acc = gl.zeros([16 * W, BLOCK_M], gl.float32, layout=_mma_layout(W, BLOCK_M))
        acc2, x_tail = _tail_sums(acc, x_smem, TAIL)
        all_tiles = K // 128
        wbase = _word_offsets(tile, all_tiles)
        sub = gl.arange(0, 4, layout=gl.SliceLayout(0, one))
        # each tile's words and heads (X_AHEAD: and x rows) are read one iteration ahead (registers: the loads of
        # tile i + 1 are in flight while tile i is decoded and multiplied); the last iteration reads its own tile
        # again (a cache hit, no mask). (Two iterations ahead ran 1.0-1.35x slower on an H100, 2026-12-06: 4
        # programs an SM instead of 5 by registers, and the rotation's register moves.)
        kt0 = part * k_tiles
        words_n = gl.load(words_ptr + wbase + kt0 * 256)
        hw0_n, hw1_n = _head_words(heads_ptr, tile, kt0, K, 0), _head_words(heads_ptr, tile, kt0, K, 1)
        if PDL:  # the weight's first tile asked for; x only once the kernel before has written it
            kt0 = _dependency_wait(kt0)
        xt_n = _x_tile(x_ptr, kt0, K, M, BLOCK_M, False) if X_AHEAD else 0
        ahead = (words_n, hw0_n, hw1_n, xt_n)
        if FOLD:
            half = k_tiles // 2
            first, first2, ahead = _q4k_steps(acc, acc2, ahead, 0, half, k_tiles, kt0, x_ptr, words_ptr, heads_ptr,
                                              wbase, tile, K, M, sub, x_smem, x_tail, BLOCK_M, PAIRS, X_AHEAD, TAIL)
            held, held2 = _held(first), _held(first2) if TAIL > 0 else 0
            acc, acc2, ahead = _q4k_steps(gl.zeros_like(acc), gl.zeros_like(acc2), ahead, half, k_tiles, k_tiles, kt0,
                                          x_ptr, words_ptr, heads_ptr, wbase, tile, K, M, sub, x_smem, x_tail, BLOCK_M,
                                          PAIRS, X_AHEAD, TAIL)
            acc, acc2 = _folded(held, held2, acc, acc2, TAIL)
        else:
            acc, acc2, ahead = _q4k_steps(acc, acc2, ahead, 0, k_tiles, k_tiles, kt0, x_ptr, words_ptr, heads_ptr,
                                          wbase, tile, K, M, sub, x_smem, x_tail, BLOCK_M, PAIRS, X_AHEAD, TAIL)
        return acc, acc2

    @gluon.jit
    def _q4k_steps(acc, acc2, ahead, i0, i1, k_tiles, kt0, x_ptr, words_ptr, heads_ptr, wbase, tile, K, M, sub, x_smem,
                   x_tail, BLOCK_M: gl.constexpr, PAIRS: gl.constexpr, X_AHEAD: gl.constexpr, TAIL: gl.constexpr):
        """``_q4k_tile``'s K loop over its tiles ``i0``..``i1`` (of ``k_tiles`` from ``kt0``): the sums, and the
        next tile's planes (and x) read ahead (``ahead``), carried from one run of tiles to the next."""
        words_n, hw0_n, hw1_n, xt_n = ahead
        for i in range(i0, i1):
            kt = kt0 + i
            nxt = kt + (i + 1 < k_tiles).to(gl.int32)
            words, hw0, hw1 = words_n, hw0_n, hw1_n
            words_n = gl.load(words_ptr + wbase + nxt * 256)
            if X_AHEAD:
                xt = xt_n
                xt_n = _x_tile(x_ptr, nxt, K, M, BLOCK_M, False)
            hw0_n, hw1_n = _head_words(heads_ptr, tile, nxt, K, 0), _head_words(heads_ptr, tile, nxt, K, 1)
            h0, a0, m0, r0 = _head_fields(hw0)
            h1, a1, m1, r1 = _head_fields(hw1)
            st0, sh0 = _step_shift(h0, a0, m0, r0, kt, sub)
            st1, sh1 = _step_shift(h1, a1, m1, r1, kt, sub)
            if PAIRS:
                pst0, pnsh0 = _pair_steps(st0, sh0)
                pst1, pnsh1 = _pair_steps(st1, sh1)
                a = _pairs_tile(words, pst0, pnsh0, pst1, pnsh1)
            else:
                a = _values_tile(words, _beside(st0), _beside(sh0), _beside(st1), _beside(sh1))
            if not X_AHEAD:
                xt = _x_tile(x_ptr, kt, K, M, BLOCK_M, False)
            acc, acc2 = _times_x_rows(acc, acc2, a, xt, x_ptr, kt, K, M, x_smem, x_tail, BLOCK_M, TAIL, False)
        return acc, acc2, (words_n, hw0_n, hw1_n, xt_n)

    @gluon.jit
    def _held(acc):
        """``acc`` put aside in shared memory: a folded program's first half's sums, their registers free for the
        second half's (held in registers, the 32 + 8-row launches spilled on Triton 3.6, static: 40 bytes)."""
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        buffer = gl.allocate_shared_memory(gl.float32, acc.type.shape, flat)
        buffer.store(acc)
        return buffer

    @gluon.jit
    def _folded(held, held2, acc, acc2, TAIL: gl.constexpr):
        """A folded program's sums (``FOLD``): its first half's (``_held``) plus its second's, as ``_store_rows``
        adds a ``PAIRED`` weight's pair of parts (the same bits)."""
        acc = held.load(acc.type.layout) + acc
        if TAIL > 0:
            acc2 = held2.load(acc2.type.layout) + acc2
        else:
            acc2 = acc
        return acc, acc2

    @gluon.jit
    def _times_x(acc, a, xt, x_smem):
        """acc += the decoded tile ``a`` times ``xt`` (x's rows for its K tile, through shared memory, as wgmma's B
        operand)."""
        a = _operand(a, acc)
        x_smem.store(xt)
        fence_async_shared()
        return warpgroup_mma(a, x_smem, acc)

    @gluon.jit
    def _tail_sums(acc, x_smem, TAIL: gl.constexpr):
        """The ``TAIL`` rows' sums [16 W, TAIL] (zero) and x tile; without a tail, ``acc`` and ``x_smem`` again."""
        W: gl.constexpr = gl.num_warps()
        if TAIL > 0:
            acc2 = gl.zeros([16 * W, TAIL], gl.float32, layout=_mma_layout(W, TAIL))
            x_tail = _x_smem(TAIL)
        else:
            acc2 = acc
            x_tail = x_smem
        return acc2, x_tail

    @gluon.jit
    def _times_x_rows(acc, acc2, a, xt, x_ptr, kt, K, M, x_smem, x_tail, BLOCK_M: gl.constexpr, TAIL: gl.constexpr,
                      K_MASK: gl.constexpr):
        """``_times_x`` for the ``BLOCK_M`` rows, and with a ``TAIL`` the tail's rows too (``_times_x_tail``):
        (acc, acc2), acc2 being acc without a tail."""
        if TAIL > 0:
            acc, acc2 = _times_x_tail(acc, acc2, a, xt,
                                      _x_tile(x_ptr + BLOCK_M * K, kt, K, M - BLOCK_M, TAIL, K_MASK), x_smem, x_tail)
        else:
            acc = _times_x(acc, a, xt, x_smem)
            acc2 = acc
        return acc, acc2

    @gluon.jit
    def _times_x_tail(acc, acc2, a, xt, xt2, x_smem, x_tail):
        """``_times_x`` for a program's rows in two parts (``TAIL``): the one decoded tile times both x tiles, two
        matrix-unit products of the widths asked for (a column's sums do not depend on the product's width)."""
        a = _operand(a, acc)
        x_smem.store(xt)
        x_tail.store(xt2)
        fence_async_shared()
        acc = warpgroup_mma(a, x_smem, acc)
        a2 = gl.convert_layout(a, gl.DotOperandLayout(operand_index=0, parent=acc2.type.layout, k_width=2),
                               assert_trivial=True)  # A's registers do not depend on N
        return acc, warpgroup_mma(a2, x_tail, acc2)

    @gluon.jit
    def _store_rows(acc, acc2, out_ptr, parts_ptr, tickets_ptr, tile, part, split, M, N, parts_stride,
                    BLOCK_M: gl.constexpr, TAIL: gl.constexpr, PAIRED: gl.constexpr):
        """The tile's fp32 sums [16 W, BLOCK_M] (out's transpose; ``TAIL`` > 0: and ``acc2``'s [16 W, TAIL], the
        rows after them) into ``out`` [M, N] in bf16 (this row block's: at most ``BLOCK_M + TAIL`` of its ``M``
        rows); split over K, each part's sums into ``parts`` (part ``p`` at ``p * parts_stride``), then a ticket:
        the part that takes the last adds every part in order 0..split-1 (``PAIRED``: parts 2j and 2j + 1 first,
        then those sums in order, as folded programs give them; the same bits whichever finished last), writes
        ``out`` and resets the ticket (as ``engine.models.linear.store_rows``, whose ticket buffer this
        shares)."""
        W: gl.constexpr = gl.num_warps()
        # 4 rows a thread (16 bytes of a part, 8 of the output: few addresses, so few registers), 8 lanes over x's rows
        ol: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, 1], threads_per_warp=[4, 8], warps_per_cta=[W, 1],
                                            order=[0, 1])
        acc = gl.convert_layout(acc, ol)
        on = tile * (16 * W) + gl.arange(0, 16 * W, layout=gl.SliceLayout(1, ol))
        om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, ol))
        offs = om[None, :] * N + on[:, None]
        mask = (on < N)[:, None] & (om < M)[None, :]
        if TAIL > 0:
            acc2 = gl.convert_layout(acc2, ol)
            om2 = BLOCK_M + gl.arange(0, TAIL, layout=gl.SliceLayout(0, ol))
            offs2 = om2[None, :] * N + on[:, None]
            mask2 = (on < N)[:, None] & (om2 < M)[None, :]
        if split > 1:
            gl.store(parts_ptr + part * parts_stride + offs, acc, mask=mask)
            if TAIL > 0:
                gl.store(parts_ptr + part * parts_stride + offs2, acc2, mask=mask2)
            _barrier()  # every thread's sums stored before the ticket is taken
            ticket = gl.atomic_add(tickets_ptr + tile, 1, sem="acq_rel")
            if ticket == split - 1:
                # 16 of x's rows at a time: a whole [16 W, 64] tile of sums at once held the kernels at 212 (Q4_K)
                # and 213 (Q6_K) registers at 64 rows, 176 and 193 this way (with the sum in PyTorch: 176, 168)
                for c in gl.static_range(0, BLOCK_M + TAIL, 16):
                    oc = c + gl.arange(0, 16, layout=gl.SliceLayout(0, ol))
                    at = oc[None, :] * N + on[:, None]
                    # (BLOCK_M + TAIL 8, 24 or 40: half a chunk)
                    at_mask = (on < N)[:, None] & ((oc < M) & (oc < BLOCK_M + TAIL))[None, :]
                    total = gl.load(parts_ptr + at, mask=at_mask, other=0.0, cache_modifier=".cg")
                    if PAIRED:
                        total += gl.load(parts_ptr + parts_stride + at, mask=at_mask, other=0.0, cache_modifier=".cg")
                        for p in range(1, split // 2):
                            pair = gl.load(parts_ptr + 2 * p * parts_stride + at, mask=at_mask, other=0.0,
                                           cache_modifier=".cg")
                            pair += gl.load(parts_ptr + (2 * p + 1) * parts_stride + at, mask=at_mask, other=0.0,
                                            cache_modifier=".cg")
                            total += pair
                    else:
                        for p in range(1, split):
                            total += gl.load(parts_ptr + p * parts_stride + at, mask=at_mask, other=0.0,
                                             cache_modifier=".cg")
                    gl.store(out_ptr + at, total.to(gl.bfloat16), mask=at_mask)
                gl.atomic_xchg(tickets_ptr + tile, 0)  # ready for the next launch
        else:
            gl.store(out_ptr + offs, acc.to(gl.bfloat16), mask=mask)
            if TAIL > 0:
                gl.store(out_ptr + offs2, acc2.to(gl.bfloat16), mask=mask2)

    @gluon.jit(do_not_specialize=["M", "split"])
    def _q6_kernel(x_ptr, words_ptr, high_ptr, scales_ptr, d_ptr, out_ptr, parts_ptr, tickets_ptr, M, N, K, k_tiles,
                   split, tiles, BLOCK_M: gl.constexpr, X_AHEAD: gl.constexpr, STAGES: gl.constexpr,
                   PDL: gl.constexpr, TAIL: gl.constexpr, FOLD: gl.constexpr, PAIRED: gl.constexpr):
        """Q6_K's few-row product, launched as ``_gluon_kernel`` (pairs decode only)."""
        tile, part, parts_stride, x_ptr, out_ptr, tickets_ptr, M, at = _program(
            x_ptr, out_ptr, tickets_ptr, M, N, K, tiles, BLOCK_M, STAGES, PDL, TAIL)
        if STAGES > 1:
            acc = staged._q6_tile_staged(x_ptr, words_ptr, high_ptr, scales_ptr, d_ptr, tile, part, M, K, k_tiles,
                                         BLOCK_M, STAGES, PDL)
            acc2 = acc
        else:
            acc, acc2 = _q6_tile(x_ptr, words_ptr, high_ptr, scales_ptr, d_ptr, tile, part, M, K, k_tiles, BLOCK_M,
                                 X_AHEAD, PDL, TAIL, FOLD)
        _store_rows(acc, acc2, out_ptr, parts_ptr + at, tickets_ptr, tile, part, split, M, N, parts_stride, BLOCK_M,
                    TAIL, PAIRED)

    @gluon.jit
    def _q6_tile(x_ptr, words_ptr, high_ptr, scales_ptr, d_ptr, tile, part, M, K, k_tiles, BLOCK_M: gl.constexpr,
                 X_AHEAD: gl.constexpr, PDL: gl.constexpr, TAIL: gl.constexpr, FOLD: gl.constexpr):
        """One Q6_K tile's sums over part ``part`` of K, as ``_q4k_tile``'s (and its ``TAIL`` rows'; ``FOLD``)."""
        W: gl.constexpr = gl.num_warps()
        x_smem = _x_smem(BLOCK_M)
        wl: gl.constexpr = _words_layout(W)
        hl: gl.constexpr = _quads_layout(W)  # the top bits [8 W = (w, g), 4 = t, 4 = u]
        all_tiles = K // 128
        wbase = _word_offsets(tile, all_tiles)
        hr = gl.arange(0, 8 * W, layout=gl.SliceLayout(1, gl.SliceLayout(2, hl)))
        ht = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, hl)))
        hu = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, hl)))
        hbase = ((tile * W + hr // 8) * (all_tiles * 128) + (hr % 8) * 16)[:, None, None] \
            + (ht * 4)[None, :, None] + hu[None, None, :]
        sr = gl.arange(0, 8 * W, layout=gl.SliceLayout(1, gl.SliceLayout(1, wl)))
        row0 = tile * (16 * W) + (sr // 8) * 16 + sr % 8  # h = 0; h = 1 is 8 rows on
        slices = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, wl)))
        acc = gl.zeros([16 * W, BLOCK_M], gl.float32, layout=_mma_layout(W, BLOCK_M))
        acc2, x_tail = _tail_sums(acc, x_smem, TAIL)
        kt0 = part * k_tiles  # the next tile's planes read one iteration ahead, as in _q4k_tile
        words_n = gl.load(words_ptr + wbase + kt0 * 256)
        high_n = gl.load(high_ptr + hbase + kt0 * 128)
        st0_n = _q6_steps(scales_ptr, d_ptr, row0, kt0, slices, K)
        st1_n = _q6_steps(scales_ptr, d_ptr, row0 + 8, kt0, slices, K)
        if PDL:  # as _q4k_tile's
            kt0 = _dependency_wait(kt0)
        xt_n = _x_tile(x_ptr, kt0, K, M, BLOCK_M, False) if X_AHEAD else 0
        ahead = (words_n, high_n, st0_n, st1_n, xt_n)
        if FOLD:
            half = k_tiles // 2
            first, first2, ahead = _q6_steps_run(acc, acc2, ahead, 0, half, k_tiles, kt0, x_ptr, words_ptr,
                                                 high_ptr, scales_ptr, d_ptr, wbase, hbase, row0, slices, K, M, x_smem,
                                                 x_tail, BLOCK_M, X_AHEAD, TAIL)
            held, held2 = _held(first), _held(first2) if TAIL > 0 else 0
            acc, acc2, ahead = _q6_steps_run(gl.zeros_like(acc), gl.zeros_like(acc2), ahead, half, k_tiles, k_tiles,
                                             kt0, x_ptr, words_ptr, high_ptr, scales_ptr, d_ptr, wbase, hbase, row0,
                                             slices, K, M, x_smem, x_tail, BLOCK_M, X_AHEAD, TAIL)
            acc, acc2 = _folded(held, held2, acc, acc2, TAIL)
        else:
            acc, acc2, ahead = _q6_steps_run(acc, acc2, ahead, 0, k_tiles, k_tiles, kt0, x_ptr, words_ptr, high_ptr,
                                             scales_ptr, d_ptr, wbase, hbase, row0, slices, K, M, x_smem, x_tail,
                                             BLOCK_M, X_AHEAD, TAIL)
        return acc, acc2

    @gluon.jit
    def _q6_steps_run(acc, acc2, ahead, i0, i1, k_tiles, kt0, x_ptr, words_ptr, high_ptr, scales_ptr, d_ptr, wbase,
                      hbase, row0, slices, K, M, x_smem, x_tail, BLOCK_M: gl.constexpr, X_AHEAD: gl.constexpr,
                      TAIL: gl.constexpr):
        """``_q6_tile``'s K loop over its tiles ``i0``..``i1``, as ``_q4k_steps``."""
        words_n, high_n, st0_n, st1_n, xt_n = ahead
        for i in range(i0, i1):
            kt = kt0 + i
            nxt = kt + (i + 1 < k_tiles).to(gl.int32)
            words, high, st0, st1 = words_n, high_n, st0_n, st1_n
            words_n = gl.load(words_ptr + wbase + nxt * 256)
            if X_AHEAD:
                xt = xt_n
                xt_n = _x_tile(x_ptr, nxt, K, M, BLOCK_M, False)
            high_n = gl.load(high_ptr + hbase + nxt * 128)
            st0_n = _q6_steps(scales_ptr, d_ptr, row0, nxt, slices, K)
            st1_n = _q6_steps(scales_ptr, d_ptr, row0 + 8, nxt, slices, K)
            a = _q6_pairs_tile(words, high) * _per_value(st0, st1)  # times bf16(d * scale), one rounding
            if not X_AHEAD:
                xt = _x_tile(x_ptr, kt, K, M, BLOCK_M, False)
            acc, acc2 = _times_x_rows(acc, acc2, a, xt, x_ptr, kt, K, M, x_smem, x_tail, BLOCK_M, TAIL, False)
        return acc, acc2, (words_n, high_n, st0_n, st1_n, xt_n)

    @gluon.jit(do_not_specialize=["M", "split"])
    def _q4_1_kernel(x_ptr, words_ptr, steps_ptr, out_ptr, parts_ptr, tickets_ptr, M, N, K, k_tiles, split, tiles,
                     BLOCK_M: gl.constexpr, X_AHEAD: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr,
                     TAIL: gl.constexpr, K_MASK: gl.constexpr, FOLD: gl.constexpr, PAIRED: gl.constexpr):
        """Q4_1's few-row product (``quant_gluon.repack_q4_1``'s planes), launched as ``_gluon_kernel`` (the pair
        decode; ``STAGES`` > 1: its tiles staged in shared memory); ``K_MASK``: K not whole 128-column tiles (the
        planes zero-padded past it, x's columns past it not read)."""
        tile, part, parts_stride, x_ptr, out_ptr, tickets_ptr, M, at = _program(
            x_ptr, out_ptr, tickets_ptr, M, N, K, tiles, BLOCK_M, STAGES, PDL, TAIL)
        if STAGES > 1:
            acc = staged._q4_1_tile_staged(x_ptr, words_ptr, steps_ptr, tile, part, M, K, k_tiles, split, BLOCK_M,
                                           STAGES, PDL, K_MASK)
            acc2 = acc
        else:
            acc, acc2 = _q4_1_tile(x_ptr, words_ptr, steps_ptr, tile, part, M, K, k_tiles, split, BLOCK_M, X_AHEAD,
                                   PDL, TAIL, K_MASK, FOLD)
        _store_rows(acc, acc2, out_ptr, parts_ptr + at, tickets_ptr, tile, part, split, M, N, parts_stride, BLOCK_M,
                    TAIL, PAIRED)

    @gluon.jit
    def _q4_1_steps(steps_ptr, at, kt):
        """Each thread's (row, 32-value block) word of tile ``kt``: bf16(d) low, bf16(m) high (``at``: its row's and
        lane's offset, [8 W, 4] in ``_lanes_layout(W, 1)``)."""
        return gl.load(steps_ptr + at + kt * 4)

    @gluon.jit
    def _q4_1_tile(x_ptr, words_ptr, steps_ptr, tile, part, M, K, k_tiles, split, BLOCK_M: gl.constexpr,
                   X_AHEAD: gl.constexpr, PDL: gl.constexpr, TAIL: gl.constexpr, K_MASK: gl.constexpr,
                   FOLD: gl.constexpr):
        """One Q4_1 tile's sums over part ``part`` of K, as ``_q4k_tile``'s (and its ``TAIL`` rows'; ``FOLD``): the
        nibbles as Q4_K's pair words, each 32-value block's bf16(d) and bf16(m) a word already packed (one 4-byte
        load a thread and row: lane t holds block t of the tile, shuffled to the lanes that need it)."""
        W: gl.constexpr = gl.num_warps()
        x_smem = _x_smem(BLOCK_M)
        one: gl.constexpr = _lanes_layout(W, 1)
        acc = gl.zeros([16 * W, BLOCK_M], gl.float32, layout=_mma_layout(W, BLOCK_M))
        acc2, x_tail = _tail_sums(acc, x_smem, TAIL)
        all_tiles = k_tiles * split  # (K padded to whole tiles: the planes')
        wbase = _word_offsets(tile, all_tiles)
        sr = gl.arange(0, 8 * W, layout=gl.SliceLayout(1, one))
        sub = gl.arange(0, 4, layout=gl.SliceLayout(0, one))
        row0 = tile * (16 * W) + (sr // 8) * 16 + sr % 8  # h = 0; h = 1 is 8 rows on
        at0 = (row0 * (all_tiles * 4))[:, None] + sub[None, :]
        at1 = at0 + 8 * all_tiles * 4
        kt0 = part * k_tiles  # the next tile's planes read one iteration ahead, as in _q4k_tile
        words_n = gl.load(words_ptr + wbase + kt0 * 256)
        s0_n, s1_n = _q4_1_steps(steps_ptr, at0, kt0), _q4_1_steps(steps_ptr, at1, kt0)
        if PDL:  # as _q4k_tile's
            kt0 = _dependency_wait(kt0)
        xt_n = _x_tile(x_ptr, kt0, K, M, BLOCK_M, K_MASK) if X_AHEAD else 0
        ahead = (words_n, s0_n, s1_n, xt_n)
        if FOLD:
            half = k_tiles // 2
            first, first2, ahead = _q4_1_steps_run(acc, acc2, ahead, 0, half, k_tiles, kt0, x_ptr, words_ptr,
                                                   steps_ptr, wbase, at0, at1, K, M, x_smem, x_tail, BLOCK_M, X_AHEAD,
                                                   TAIL, K_MASK)
            held, held2 = _held(first), _held(first2) if TAIL > 0 else 0
            acc, acc2, ahead = _q4_1_steps_run(gl.zeros_like(acc), gl.zeros_like(acc2), ahead, half, k_tiles, k_tiles,
                                               kt0, x_ptr, words_ptr, steps_ptr, wbase, at0, at1, K, M, x_smem,
                                               x_tail, BLOCK_M, X_AHEAD, TAIL, K_MASK)
            acc, acc2 = _folded(held, held2, acc, acc2, TAIL)
        else:
            acc, acc2, ahead = _q4_1_steps_run(acc, acc2, ahead, 0, k_tiles, k_tiles, kt0, x_ptr, words_ptr, steps_ptr,
                                               wbase, at0, at1, K, M, x_smem, x_tail, BLOCK_M, X_AHEAD, TAIL, K_MASK)
        return acc, acc2

    @gluon.jit
    def _q4_1_steps_run(acc, acc2, ahead, i0, i1, k_tiles, kt0, x_ptr, words_ptr, steps_ptr, wbase, at0, at1, K, M,
                        x_smem, x_tail, BLOCK_M: gl.constexpr, X_AHEAD: gl.constexpr, TAIL: gl.constexpr,
                        K_MASK: gl.constexpr):
        """``_q4_1_tile``'s K loop over its tiles ``i0``..``i1``, as ``_q4k_steps``."""
        words_n, s0_n, s1_n, xt_n = ahead
        for i in range(i0, i1):
            kt = kt0 + i
            nxt = kt + (i + 1 < k_tiles).to(gl.int32)
            words, s0, s1 = words_n, s0_n, s1_n
            words_n = gl.load(words_ptr + wbase + nxt * 256)
            if X_AHEAD:
                xt = xt_n
                xt_n = _x_tile(x_ptr, nxt, K, M, BLOCK_M, K_MASK)
            s0_n, s1_n = _q4_1_steps(steps_ptr, at0, nxt), _q4_1_steps(steps_ptr, at1, nxt)
            st0, m0 = _packed_steps(s0)
            st1, m1 = _packed_steps(s1)
            a = _pairs_tile(words, st0, m0, st1, m1)  # q * bf16(d) + bf16(m), one rounding
            if not X_AHEAD:
                xt = _x_tile(x_ptr, kt, K, M, BLOCK_M, K_MASK)
            acc, acc2 = _times_x_rows(acc, acc2, a, xt, x_ptr, kt, K, M, x_smem, x_tail, BLOCK_M, TAIL, K_MASK)
        return acc, acc2, (words_n, s0_n, s1_n, xt_n)
