"""The Q4_K, Q6_K and Q4_1 products of ``engine.models.quant_gluon`` with each tile's planes and x rows copied into
shared memory ahead of their use (``quant_gluon.STAGES``, ``FEW_ROWS_STAGES``; issue #28): cp.async into ``STAGES``
buffers, ``STAGES - 1`` tiles in flight, so a program's bytes in flight are not bounded by its registers. The decode
and the matrix-unit products are the register path's (``quant_gluon_kernels``), so are the bits.

A thread reads back from shared memory what its own copies wrote (the planes' runs, ``_run_layout``), the heads (Q4_1:
its d | m words) and x excepted (a CTA barrier a tile: ``_staged_in``). With ``PDL`` the prologue asks for the
weight's stages first and copies x only after ``griddepcontrol.wait``. Measured on an H100 (2026-12-06,
benchmarks/RESULTS.md): within a few % of the register path at 1 row, slower for a verify's 64-row programs (78 KB of
shared memory at 3 stages), so not the engine's there; the engine's for an AR step's launches with fewer programs
than SMs (a small model's: every tile of a program's part of K in flight at once)."""

from __future__ import annotations

from engine.models.quant_gluon_decode import gluon  # None: a Triton without Gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, warpgroup_mma

    from engine.models import quant_gluon_decode as decode  # the layouts and decodes the register path uses too

    @gluon.constexpr_function
    def _run_layout(warps, width):
        """A tile's words (``width`` 256) or Q6_K's top bits (128) as the planes hold them, [W, width]: a warp's
        contiguous run, lane l's 16 bytes at 4 l (and 128 + 4 l): the words ``_words_layout`` (``_quads_layout``)
        gives lane l, so a thread reads back from shared memory what its own copies wrote."""
        return gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[1, 32], warps_per_cta=[warps, 1],
                                order=[1, 0])

    @gluon.constexpr_function
    def _heads_copy_layout(warps):
        """[8 W rows (w, g), 4 words]: a word a thread (each copied once)."""
        return gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[8, 4], warps_per_cta=[warps, 1],
                                order=[1, 0])

    @gluon.constexpr_function
    def _flat(rank):
        """Shared memory in row-major order, no swizzle (each thread's 16 bytes contiguous)."""
        return gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=list(range(rank - 1, -1, -1)))

    @gluon.jit
    def _run_offsets(tile, all_tiles, width: gl.constexpr):
        """[W, width] words of tile ``tile``'s K tile 0 (add ``kt * width``): warp w's run of its 16-row group."""
        W: gl.constexpr = gl.num_warps()
        rl: gl.constexpr = _run_layout(W, width)
        w = gl.arange(0, W, layout=gl.SliceLayout(1, rl))
        j = gl.arange(0, width, layout=gl.SliceLayout(0, rl))
        at = ((tile * W + w) * (all_tiles * width))[:, None] + j[None, :]
        return gl.max_contiguous(gl.multiple_of(at, [1, 4]), [1, 4])

    @gluon.jit
    def _from_run(run):
        """``_run_offsets``' [W, 256] read back -> [8 W, 4, 8] in ``_words_layout`` (a renaming: word s of lane
        4 g + t is run word 128 (s // 4) + 16 g + 4 t + s % 4, ``_word_offsets``')."""
        W: gl.constexpr = gl.num_warps()
        run = run.reshape([W, 2, 8, 4, 4]).permute([0, 2, 3, 1, 4]).reshape([8 * W, 4, 8])
        return gl.convert_layout(run, decode._words_layout(W), assert_trivial=True)

    @gluon.jit
    def _staged_heads(heads_s):
        """One row half's heads of a staged tile ([8 W, 4] words) as ``_head_words``' [8 W, 4, 4] (the t lanes
        alike: a broadcast)."""
        W: gl.constexpr = gl.num_warps()
        hl: gl.constexpr = decode._quads_layout(W)
        head = heads_s.load(gl.SliceLayout(1, hl)).expand_dims(1)  # [8 W, 1, 4]
        return head + gl.zeros([8 * W, 4, 4], gl.int32, layout=hl)

    @gluon.constexpr_function
    def _x_copy_layout(warps):
        """x's rows [128, BLOCK_M] as ``_x_tile`` reads them: 8 columns (16 bytes) a thread."""
        return gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[16, 2], warps_per_cta=[1, warps],
                                order=[0, 1])

    @gluon.jit
    def _x_offsets(K, M, BLOCK_M: gl.constexpr):
        """x's rows for K tile 0 (add ``kt * 128``), [128, BLOCK_M] in ``_x_tile``'s layout, and the rows < M."""
        xl: gl.constexpr = _x_copy_layout(gl.num_warps())
        xk = gl.arange(0, 128, layout=gl.SliceLayout(1, xl))
        xm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, xl))
        at = gl.max_contiguous(gl.multiple_of(xm[None, :] * K + xk[:, None], [8, 1]), [8, 1])
        return at, (xm < M)[None, :] & (xk >= 0)[:, None]

    @gluon.jit
    def _x_staged(BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
        """``STAGES`` x tiles [128, BLOCK_M] in shared memory (``_x_smem``'s layout)."""
        xs: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, transposed=True)
        return gl.allocate_shared_memory(gl.bfloat16, [STAGES, 128, BLOCK_M], xs)

    @gluon.jit
    def _stage_run(runs_s, ptr, run, kt, ok):
        """cp.async of a plane's runs (``_run_offsets``') for K tile ``kt`` into ``runs_s`` [W, width]; ``ok``
        false: nothing read (zeros written)."""
        decode._async_load(runs_s, ptr + run + kt * runs_s.shape[1], mask=(run >= 0) & ok)

    @gluon.jit
    def _stage_q4k(words_s, heads_s, x_s, x_ptr, words_ptr, heads_ptr, wrun, hat0, hat1, xat, xrows, j, kt0, k_tiles,
                   WITH_X: gl.constexpr = True):
        """cp.async of part tile ``j`` (K tile ``kt0 + j``: words, heads, x's rows unless not ``WITH_X``) into stage
        ``j % STAGES``, one commit group; past the part's tiles nothing is read from global memory (masked copies
        zero-fill the stage, which no product then reads)."""
        stage = j % words_s.shape[0]  # STAGES
        ok = j < k_tiles
        kt = kt0 + j
        _stage_run(words_s.index(stage), words_ptr, wrun, kt, ok)
        decode._async_load(heads_s.index(2 * stage), heads_ptr + hat0 + (kt >> 1) * 4, mask=(hat0 >= 0) & ok)
        decode._async_load(heads_s.index(2 * stage + 1), heads_ptr + hat1 + (kt >> 1) * 4, mask=(hat1 >= 0) & ok)
        if WITH_X:
            _stage_x(x_s, x_ptr, xat, xrows, j, kt0, k_tiles)
        async_copy.commit_group()

    @gluon.jit
    def _stage_x(x_s, x_ptr, xat, xrows, j, kt0, k_tiles, K=0, K_MASK: gl.constexpr = False):
        """x's rows for part tile ``j`` into its stage (no commit: the caller's group); with ``K_MASK`` its columns
        past K not read, zeros written (K a multiple of 16: a thread's 8 columns all read or none, 16-byte copies)."""
        mask = xrows & (j < k_tiles)
        if K_MASK:
            xk = gl.arange(0, 128, layout=gl.SliceLayout(1, _x_copy_layout(gl.num_warps())))
            mask = mask & ((kt0 + j) * 128 + xk < K)[:, None]
        decode._async_load(x_s.index(j % x_s.shape[0]), x_ptr + xat + (kt0 + j) * 128, mask=mask)

    @gluon.jit
    def _staged_prologue_x(x_s, x_ptr, xat, xrows, kt0, k_tiles, STAGES: gl.constexpr, K=0,
                           K_MASK: gl.constexpr = False):
        """With PDL, the prologue's weight stages are asked for first (without x); then, once the kernel before
        has written x (``_dependency_wait``), x's rows for those stages, and all of it waited for (the loop's first
        wait would leave x, the last group, in flight). Returns ``kt0`` through the wait, for the loop's copies."""
        kt0 = decode._dependency_wait(kt0)
        for j in gl.static_range(STAGES - 1):
            _stage_x(x_s, x_ptr, xat, xrows, j, kt0, k_tiles, K, K_MASK)
        async_copy.commit_group()
        async_copy.wait_group(0)
        return kt0

    @gluon.jit
    def _stage_q6(words_s, high_s, x_s, x_ptr, words_ptr, high_ptr, wrun, hrun, xat, xrows, j, kt0, k_tiles,
                  WITH_X: gl.constexpr = True):
        """``_stage_q4k`` for Q6_K: words, top bits, x's rows (its steps are read an iteration ahead into
        registers: a row's d is 2 bytes, below cp.async's 4)."""
        stage = j % words_s.shape[0]
        ok = j < k_tiles
        kt = kt0 + j
        _stage_run(words_s.index(stage), words_ptr, wrun, kt, ok)
        _stage_run(high_s.index(stage), high_ptr, hrun, kt, ok)
        if WITH_X:
            _stage_x(x_s, x_ptr, xat, xrows, j, kt0, k_tiles)
        async_copy.commit_group()

    @gluon.jit
    def _staged_in(STAGES: gl.constexpr):
        """The top of a staged K loop's iteration: this thread's copies of its tile in (``STAGES - 2`` groups left
        in flight), visible to the matrix unit (x) and to every thread; every warp done with the last tile (the stage
        the next copies go into)."""
        async_copy.wait_group(STAGES - 2)
        fence_async_shared()
        decode._barrier()

    @gluon.jit
    def _q4k_tile_staged(x_ptr, words_ptr, heads_ptr, tile, part, M, K, k_tiles, BLOCK_M: gl.constexpr,
                         STAGES: gl.constexpr, PDL: gl.constexpr):
        """``_q4k_tile``'s sums (the pair decode) with each tile's words, heads and x rows copied into shared memory
        ``STAGES - 1`` tiles ahead (cp.async, no registers held: the bytes in flight a program are no longer
        what its registers can hold)."""
        W: gl.constexpr = gl.num_warps()
        words_s = gl.allocate_shared_memory(gl.int32, [STAGES, W, 256], _flat(2))
        heads_s = gl.allocate_shared_memory(gl.int32, [2 * STAGES, 8 * W, 4], _flat(2))  # stage s, rows h: 2 s + h
        x_s = _x_staged(BLOCK_M, STAGES)
        all_tiles = K // 128
        wrun = _run_offsets(tile, all_tiles, 256)
        cl: gl.constexpr = _heads_copy_layout(W)
        hr = gl.arange(0, 8 * W, layout=gl.SliceLayout(1, cl))
        hw = gl.arange(0, 4, layout=gl.SliceLayout(0, cl))
        row = tile * (16 * W) + (hr // 8) * 16 + hr % 8  # h = 0's row of lane g of warp w
        hat0 = (row * (K // 256) * 4)[:, None] + hw[None, :]  # rows h = 0's heads (of K tile 0)
        hat1 = hat0 + 8 * (K // 256) * 4  # rows h = 1: 8 rows on
        xat, xrows = _x_offsets(K, M, BLOCK_M)
        kt0 = part * k_tiles
        for j in gl.static_range(STAGES - 1):
            _stage_q4k(words_s, heads_s, x_s, x_ptr, words_ptr, heads_ptr, wrun, hat0, hat1, xat, xrows, j, kt0,
                       k_tiles, not PDL)
        if PDL:
            kt0 = _staged_prologue_x(x_s, x_ptr, xat, xrows, kt0, k_tiles, STAGES)
        one: gl.constexpr = decode._lanes_layout(W, 1)
        sub = gl.arange(0, 4, layout=gl.SliceLayout(0, one))
        rl: gl.constexpr = _run_layout(W, 256)
        acc = gl.zeros([16 * W, BLOCK_M], gl.float32, layout=decode._mma_layout(W, BLOCK_M))
        for i in range(0, k_tiles):
            kt = kt0 + i
            stage = i % STAGES
            _staged_in(STAGES)
            _stage_q4k(words_s, heads_s, x_s, x_ptr, words_ptr, heads_ptr, wrun, hat0, hat1, xat, xrows,
                       i + STAGES - 1, kt0, k_tiles)
            words = _from_run(words_s.index(stage).load(rl))
            h0, a0, m0, r0 = decode._head_fields(_staged_heads(heads_s.index(2 * stage)))
            h1, a1, m1, r1 = decode._head_fields(_staged_heads(heads_s.index(2 * stage + 1)))
            st0, sh0 = decode._step_shift(h0, a0, m0, r0, kt, sub)
            st1, sh1 = decode._step_shift(h1, a1, m1, r1, kt, sub)
            pst0, pnsh0 = decode._pair_steps(st0, sh0)
            pst1, pnsh1 = decode._pair_steps(st1, sh1)
            a = decode._operand(decode._pairs_tile(words, pst0, pnsh0, pst1, pnsh1), acc)
            acc = warpgroup_mma(a, x_s.index(stage), acc)
        async_copy.wait_group(0)  # no copy outstanding when the program ends (the empty groups past the part)
        return acc

    @gluon.jit
    def _q6_tile_staged(x_ptr, words_ptr, high_ptr, scales_ptr, d_ptr, tile, part, M, K, k_tiles,
                        BLOCK_M: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr):
        """``_q6_tile``'s sums with each tile's words, top bits and x rows staged as ``_q4k_tile_staged``'s."""
        W: gl.constexpr = gl.num_warps()
        words_s = gl.allocate_shared_memory(gl.int32, [STAGES, W, 256], _flat(2))
        high_s = gl.allocate_shared_memory(gl.int32, [STAGES, W, 128], _flat(2))
        x_s = _x_staged(BLOCK_M, STAGES)
        all_tiles = K // 128
        wrun, hrun = _run_offsets(tile, all_tiles, 256), _run_offsets(tile, all_tiles, 128)
        xat, xrows = _x_offsets(K, M, BLOCK_M)
        kt0 = part * k_tiles
        for j in gl.static_range(STAGES - 1):
            _stage_q6(words_s, high_s, x_s, x_ptr, words_ptr, high_ptr, wrun, hrun, xat, xrows, j, kt0, k_tiles,
                      not PDL)
        if PDL:
            kt0 = _staged_prologue_x(x_s, x_ptr, xat, xrows, kt0, k_tiles, STAGES)
        wl: gl.constexpr = decode._words_layout(W)
        sr = gl.arange(0, 8 * W, layout=gl.SliceLayout(1, gl.SliceLayout(1, wl)))
        row0 = tile * (16 * W) + (sr // 8) * 16 + sr % 8  # h = 0; h = 1 is 8 rows on
        slices = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, wl)))
        st0_n = decode._q6_steps(scales_ptr, d_ptr, row0, kt0, slices, K)
        st1_n = decode._q6_steps(scales_ptr, d_ptr, row0 + 8, kt0, slices, K)
        acc = gl.zeros([16 * W, BLOCK_M], gl.float32, layout=decode._mma_layout(W, BLOCK_M))
        for i in range(0, k_tiles):
            stage = i % STAGES
            nxt = kt0 + i + (i + 1 < k_tiles).to(gl.int32)
            st0, st1 = st0_n, st1_n
            st0_n = decode._q6_steps(scales_ptr, d_ptr, row0, nxt, slices, K)
            st1_n = decode._q6_steps(scales_ptr, d_ptr, row0 + 8, nxt, slices, K)
            _staged_in(STAGES)
            _stage_q6(words_s, high_s, x_s, x_ptr, words_ptr, high_ptr, wrun, hrun, xat, xrows, i + STAGES - 1, kt0,
                      k_tiles)
            words = _from_run(words_s.index(stage).load(_run_layout(W, 256)))
            high = high_s.index(stage).load(_run_layout(W, 128)).reshape([8 * W, 4, 4])  # [(w, g), t, u]
            high = gl.convert_layout(high, decode._quads_layout(W), assert_trivial=True)
            a = decode._q6_pairs_tile(words, high) * decode._per_value(st0, st1)  # times bf16(d * scale), one rounding
            acc = warpgroup_mma(decode._operand(a, acc), x_s.index(stage), acc)
        async_copy.wait_group(0)
        return acc

    @gluon.jit
    def _stage_q4_1(words_s, steps_s, x_s, x_ptr, words_ptr, steps_ptr, wrun, sat0, sat1, xat, xrows, j, kt0,
                    k_tiles, K, WITH_X: gl.constexpr, K_MASK: gl.constexpr):
        """``_stage_q4k`` for Q4_1: words, each row's four d | m words of the tile (4 bytes: cp.async's least), x's
        rows (``K_MASK``: not past K)."""
        stage = j % words_s.shape[0]
        ok = j < k_tiles
        kt = kt0 + j
        _stage_run(words_s.index(stage), words_ptr, wrun, kt, ok)
        decode._async_load(steps_s.index(2 * stage), steps_ptr + sat0 + kt * 4, mask=(sat0 >= 0) & ok)
        decode._async_load(steps_s.index(2 * stage + 1), steps_ptr + sat1 + kt * 4, mask=(sat1 >= 0) & ok)
        if WITH_X:
            _stage_x(x_s, x_ptr, xat, xrows, j, kt0, k_tiles, K, K_MASK)
        async_copy.commit_group()

    @gluon.jit
    def _q4_1_tile_staged(x_ptr, words_ptr, steps_ptr, tile, part, M, K, k_tiles, split, BLOCK_M: gl.constexpr,
                          STAGES: gl.constexpr, PDL: gl.constexpr, K_MASK: gl.constexpr):
        """``_q4_1_tile``'s sums with each tile's words, steps and x rows staged as ``_q4k_tile_staged``'s: for a
        launch of few programs (a small model's weights: SmolLM2's have 9-54 on 132 SMs), where one tile in flight
        a program leaves each of the K loop's iterations a memory round trip."""
        W: gl.constexpr = gl.num_warps()
        words_s = gl.allocate_shared_memory(gl.int32, [STAGES, W, 256], _flat(2))
        steps_s = gl.allocate_shared_memory(gl.int32, [2 * STAGES, 8 * W, 4], _flat(2))  # stage s, rows h: 2 s + h
        x_s = _x_staged(BLOCK_M, STAGES)
        all_tiles = k_tiles * split  # (K padded to whole tiles: the planes')
        wrun = _run_offsets(tile, all_tiles, 256)
        cl: gl.constexpr = _heads_copy_layout(W)
        sr = gl.arange(0, 8 * W, layout=gl.SliceLayout(1, cl))
        sw = gl.arange(0, 4, layout=gl.SliceLayout(0, cl))
        row = tile * (16 * W) + (sr // 8) * 16 + sr % 8  # h = 0's row of lane g of warp w
        sat0 = (row * (all_tiles * 4))[:, None] + sw[None, :]  # rows h = 0's steps (of K tile 0)
        sat1 = sat0 + 8 * all_tiles * 4  # rows h = 1: 8 rows on
        xat, xrows = _x_offsets(K, M, BLOCK_M)
        kt0 = part * k_tiles
        for j in gl.static_range(STAGES - 1):
            _stage_q4_1(words_s, steps_s, x_s, x_ptr, words_ptr, steps_ptr, wrun, sat0, sat1, xat, xrows, j, kt0,
                        k_tiles, K, not PDL, K_MASK)
        if PDL:
            kt0 = _staged_prologue_x(x_s, x_ptr, xat, xrows, kt0, k_tiles, STAGES, K, K_MASK)
        one: gl.constexpr = decode._lanes_layout(W, 1)
        rl: gl.constexpr = _run_layout(W, 256)
        acc = gl.zeros([16 * W, BLOCK_M], gl.float32, layout=decode._mma_layout(W, BLOCK_M))
        for i in range(0, k_tiles):
            stage = i % STAGES
            _staged_in(STAGES)
            _stage_q4_1(words_s, steps_s, x_s, x_ptr, words_ptr, steps_ptr, wrun, sat0, sat1, xat, xrows,
                        i + STAGES - 1, kt0, k_tiles, K, True, K_MASK)
            words = _from_run(words_s.index(stage).load(rl))
            st0, m0 = decode._packed_steps(steps_s.index(2 * stage).load(one))
            st1, m1 = decode._packed_steps(steps_s.index(2 * stage + 1).load(one))
            a = decode._operand(decode._pairs_tile(words, st0, m0, st1, m1), acc)
            acc = warpgroup_mma(a, x_s.index(stage), acc)
        async_copy.wait_group(0)
        return acc
