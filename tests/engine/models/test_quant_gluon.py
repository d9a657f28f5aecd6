"""``engine.models.quant_gluon``: Q4_K and Q6_K weights decoded straight into the matrix unit's operand registers on
Hopper (issue #28). No interpreter runs Gluon, so on the CPU: the repacked planes hold each thread's fragment as the
module says (explicit positions against the file's bytes), read back as ``quant.dequantize``'s values (the float
decode) or an independent reading's (the pair decodes), the kernels' joins and permutations replayed, a model's
weights held as planes (``hold_operands_``) multiply by the pair decode's values. On a GPU: one-hot rows read each
weight back bit for bit, every column, and rows invariant (``benchmarks/quant_gluon.py``'s test compiles them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine.models import quant_gluon, quant_gluon_planes
from engine.models.quant import FORMATS, dequantize
from tests.engine.gguf_files import random_blocks

gguf = pytest.importorskip("gguf")
BENCH = Path(__file__).resolve().parents[3] / "benchmarks"

N, K = 100, 512  # rows not a multiple of the 64-row tile; two 256-value blocks, four 128-column tiles
N2 = 228  # the GPU tests' and the replay's rows: two 128-row tiles (8 warps), the second partial; 4 at 4 warps
ROWS = 100  # the GPU tests' rows of x: two row blocks (64 and 36)


def _reads_back(linear, weight: torch.Tensor) -> None:
    """One-hot rows, 64 columns at a time over all K: each launch's output is those columns of ``weight``, bit for
    bit (every tile, block, sub-block and the tile read ahead)."""
    cols = weight.shape[1]
    for c0 in range(0, cols, 64):
        eye = torch.zeros(64, cols, device="cuda", dtype=torch.bfloat16)
        width = min(64, cols - c0)
        eye[torch.arange(width), c0 + torch.arange(width)] = 1
        assert torch.equal(linear(eye)[:width], weight[:, c0:c0 + 64].T), c0


def _blocks(seed: int, n: int = N) -> torch.Tensor:
    return torch.from_numpy(random_blocks(gguf.GGMLQuantizationType.Q4_K, n, K, seed, scale=0.05))


@pytest.mark.parametrize("pairs", [False, True])
def test_a_word_holds_one_threads_eight_values_of_a_slice(pairs):
    """Word [G][kt][s // 4][g][t][s % 4], nibble 4 j + 2 h + e (pairs: 4 e + 2 j + h): row 16 G + 8 h + g, column
    128 kt + 16 s + 8 j + 2 t + e (the operand layout's register bits e, h, j), read here position by position,
    not by the module's permutation; read back, the float decode's values are ``quant.dequantize``'s and the pair
    decode's ``quant_packed.values``'s."""
    sys.path.insert(0, str(BENCH))
    import quant_packed

    blocks = _blocks(seed=0)
    words, heads = quant_gluon.repack(blocks, K, pairs)
    assert words.numel() == (128 // 16) * (K // 128) * 256 and heads.shape == (128, K // 256, 4)
    want = quant_packed.values(blocks, K) if pairs else dequantize(blocks, FORMATS["Q4_K"], K)
    assert torch.equal(quant_gluon.reference(words, heads, N, K, pairs), want)
    for G, kt, g, t, s in [(0, 0, 0, 0, 0), (1, 2, 5, 3, 7), (6, 3, 3, 1, 4), (5, 1, 7, 2, 2)]:
        word = int(words[(G * (K // 128) + kt) * 256 + (s // 4) * 128 + (4 * g + t) * 4 + s % 4]) & 0xFFFFFFFF
        for j in range(2):
            for h in range(2):
                for e in range(2):
                    row, col = 16 * G + 8 * h + g, 128 * kt + 16 * s + 8 * j + 2 * t + e
                    got = (word >> (4 * ((4 * e + 2 * j + h) if pairs else (4 * j + 2 * h + e)))) & 15
                    if row >= N:
                        assert got == 0  # padded rows are zero
                        continue
                    blk, v = divmod(col, 256)  # Q4_K: 32-byte chunk c holds values 64 c + i (low), 64 c + 32 + i
                    chunk, i = divmod(v, 64)
                    byte = int(blocks[row, blk * 144 + 16 + chunk * 32 + i % 32])
                    assert got == (byte >> 4 if i >= 32 else byte & 15), (G, kt, g, t, s, j, h, e)


@pytest.mark.skipif(not torch.cuda.is_available() or quant_gluon.gluon is None, reason="needs CUDA and Gluon")
@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("pairs, ahead", [(False, False), (True, False), (True, True)])
def test_on_the_gpu_the_product_is_its_weights_and_rows_do_not_round_together(split, warps, pairs, ahead):
    """Each row of the product is the dot of its x row with the decode's weight (``reference``: one-hot rows read
    the weight's values back bit for bit, the parts of K added by the last part's program), and its bits do not
    depend on the rows launched beside it (one, 33, 100 in two row blocks), on the tile's height (warps) or on x
    read ahead."""
    blocks = _blocks(seed=1, n=N2).cuda()
    words, heads = quant_gluon.repack(blocks, K, pairs)
    weight = quant_gluon.reference(words, heads, N2, K, pairs).to(torch.bfloat16)
    _reads_back(lambda x: quant_gluon.linear(x, words, heads, N2, K, split, pairs, ahead, warps), weight)
    x = torch.randn(ROWS, K, device="cuda", dtype=torch.bfloat16)
    many = quant_gluon.linear(x, words, heads, N2, K, split, pairs, ahead, warps)
    for rows in (slice(0, 1), slice(0, 33), slice(ROWS - 1, ROWS)):  # a lone row, a verify, the last row block's
        assert torch.equal(quant_gluon.linear(x[rows], words, heads, N2, K, split, pairs, ahead, 4), many[rows])
    assert torch.equal(quant_gluon.linear(x, words, heads, N2, K, split, pairs, not ahead, 12 - warps), many)
    exact = x.double() @ weight.double().T
    assert float((many.double() - exact).norm() / exact.norm()) < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available() or quant_gluon.gluon is None, reason="needs CUDA and Gluon")
@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("ahead", [False, True])
def test_on_the_gpu_the_q6_k_product_is_its_weights_and_rows_do_not_round_together(split, warps, ahead):
    from engine.models.quant import hold

    planes = quant_gluon.repack_q6_k(hold(_q6_blocks(seed=5, n=N2), FORMATS["Q6_K"]).cuda(), K)
    weight = quant_gluon.reference_q6_k(*planes, N2, K)
    _reads_back(lambda x: quant_gluon.linear_q6_k(x, planes, N2, K, split, ahead, warps), weight)
    x = torch.randn(ROWS, K, device="cuda", dtype=torch.bfloat16)
    many = quant_gluon.linear_q6_k(x, planes, N2, K, split, ahead, warps)
    for rows in (slice(0, 1), slice(0, 33), slice(ROWS - 1, ROWS)):
        assert torch.equal(quant_gluon.linear_q6_k(x[rows], planes, N2, K, split, ahead, 4), many[rows])
    assert torch.equal(quant_gluon.linear_q6_k(x, planes, N2, K, split, not ahead, 12 - warps), many)
    exact = x.double() @ weight.double().T
    assert float((many.double() - exact).norm() / exact.norm()) < 1e-2


K1 = 576  # SmolLM2's K: 18 blocks of 32, 4.5 tiles of 128 (the planes padded to 5)


def _q41_blocks(seed: int, n: int = N, cols: int = K1) -> torch.Tensor:
    return torch.from_numpy(random_blocks(gguf.GGMLQuantizationType.Q4_1, n, cols, seed, scale=0.05))


def _q41_read(blocks: torch.Tensor, cols: int = K1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 file blocks -> (q 0..15, bf16(d), bf16(m)) [N, cols], by ggml's layout value by value: block v // 32,
    byte 4 + v % 16 of it, the low nibble for v % 32 < 16 (independent of ``quant`` and of the module)."""
    v = torch.arange(cols)
    blk, pos = v // 32, v % 32
    q = (blocks[:, blk * 20 + 4 + pos % 16].long() >> (4 * (pos // 16))) & 15
    fields = blocks.reshape(blocks.shape[0], -1, 20)
    d, m = (fields[:, :, at:at + 2].contiguous().view(torch.float16).squeeze(-1).to(torch.bfloat16)
            .repeat_interleave(32, dim=1) for at in (0, 2))
    return q, d, m


@pytest.mark.skipif(not torch.cuda.is_available() or quant_gluon.gluon is None, reason="needs CUDA and Gluon")
@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("warps, x_ahead", [(4, False), (8, False), (4, True)])
@pytest.mark.parametrize("few_rows_stages", [0, 6])
def test_on_the_gpu_a_few_rows_on_wgmmas_narrowest_n_round_as_in_a_verify(monkeypatch, split, warps, x_ahead,
                                                                          few_rows_stages):
    """``MIN_BLOCK_M`` 8 (a launch of 1-8 rows on wgmma's narrowest N, the engine's): one-hot rows read each weight
    back bit for bit and a lone row's bits equal its bits among 33 (32 + a tail of 8, the engine's), Q4_K's pairs and
    Q6_K; on the register path and (``FEW_ROWS_STAGES`` 6, the engine's for these few programs, x not ahead) with
    the tiles through shared memory."""
    from engine.models.quant import hold

    monkeypatch.setattr(quant_gluon, "MIN_BLOCK_M", 8)
    monkeypatch.setattr(quant_gluon, "FEW_ROWS_STAGES", few_rows_stages)
    assert quant_gluon._block_m(1) == 8 and quant_gluon._block_m(9) == 16
    words, heads = quant_gluon.repack(_blocks(seed=6, n=N2).cuda(), K, True)
    planes = quant_gluon.repack_q6_k(hold(_q6_blocks(seed=7, n=N2), FORMATS["Q6_K"]).cuda(), K)
    x = torch.randn(33, K, device="cuda", dtype=torch.bfloat16)
    options = {"x_ahead": x_ahead, "warps": warps}  # (8 warps: the x tile's layout covers 16 rows, repeats them)
    for product, weight in [(lambda x: quant_gluon.linear(x, words, heads, N2, K, split, True, **options),
                             quant_gluon.reference(words, heads, N2, K, True).to(torch.bfloat16)),
                            (lambda x: quant_gluon.linear_q6_k(x, planes, N2, K, split, **options),
                             quant_gluon.reference_q6_k(*planes, N2, K))]:
        for c0 in range(0, K, 8):  # 8 one-hot rows a launch: BLOCK_M 8
            eye = torch.zeros(8, K, device="cuda", dtype=torch.bfloat16)
            eye[torch.arange(8), c0 + torch.arange(8)] = 1
            assert torch.equal(product(eye), weight[:, c0:c0 + 8].T), c0
        many = product(x)  # 33 rows: 32 + a tail of 8 (``TAILS``; and the 33-row launch's own warps)
        assert torch.equal(product(x[:1]), many[:1]) and torch.equal(product(x[5:13]), many[5:13])


def test_a_launchs_rows_a_program_are_a_power_of_two_from_the_fewest_to_64(monkeypatch):
    """``_block_m``: 1-8 rows at ``MIN_BLOCK_M`` 8 (the engine's), then 16, 32, 64, and 64 a row block beyond; at 16,
    1-16 rows at 16."""
    assert [quant_gluon._block_m(m) for m in (1, 8, 9, 16, 17, 33, 64, 65, 1100)] == [8, 8, 16, 16, 32, 64, 64, 64, 64]
    monkeypatch.setattr(quant_gluon, "MIN_BLOCK_M", 16)
    assert [quant_gluon._block_m(m) for m in (1, 8, 16, 17, 33)] == [16, 16, 16, 32, 64]


def test_a_launch_takes_eight_warps_for_a_verify_of_whole_128_row_tiles_and_refuses_other_counts():
    """``_warps``: 32 rows or more on 8 warps (a 128-row tile: x read half as often) where the padded rows are
    whole 128-row tiles, else 4 (``WIDE_WARPS`` 8, the engine's); asked for, 4, 8 or 16 over whole tiles, anything
    else refused with the value."""
    assert [quant_gluon._warps(m, 128, None) for m in (16, 32, 64)] == [4, 8, 8]
    assert quant_gluon._warps(64, 192, None) == 4 and quant_gluon._warps(16, 256, 8) == 8
    assert quant_gluon._warps(32, 256, 16) == 16
    for warps, n_pad in [(8, 192), (2, 128), (16, 384), (32, 512)]:
        with pytest.raises(ValueError, match=f"warps={warps}: a launch takes 4, 8 or 16 warps.*{n_pad} padded rows"):
            quant_gluon._warps(64, n_pad, warps)


def test_a_weight_splits_k_into_parts_that_spread_its_launch_over_about_four_programs_an_sm():
    """``split_for``: the divisor of K's 128-column tiles whose 4-warp, 1-row launch is nearest (by ratio) 4 programs
    an SM of 132 (``PROGRAMS_PER_SM``; at 8: the 2026-12-07 sweep's faster launches alone), each part at least two
    tiles long: the 27B's wide gate_up whole (544 tiles), its narrow down and o_proj in 8 and 6 parts (80 tiles), k or
    v at the two-tile floor; at 8 an SM the gate_up in 2, the GDN in_proj in 4, the down in 17, the o_proj in 12."""
    assert [quant_gluon.split_for(*shape, per_sm=8) for shape in [(34816, 5120), (16480, 5120), (5120, 17408),
                                                                  (5120, 6144)]] == [2, 4, 17, 12]
    cases = {(34816, 5120): 1, (16480, 5120): 2, (5120, 17408): 8, (5120, 6144): 6, (1024, 5120): 20,
             (N, K): 2, (64, 256): 1,
             # SmolLM2's Q4_1 weights: K = 576 is 5 tiles of the padded planes (one part), the down's 1536 is 12
             (576, 576): 1, (3072, 576): 1, (960, 576): 1, (576, 1536): 6, (1024, 1920): 5}
    assert {shape: quant_gluon.split_for(*shape) for shape in cases} == cases
    for n, cols in cases:
        k_tiles = quant_gluon.padded_cols(cols) // quant_gluon.TILE_K
        assert k_tiles % quant_gluon.split_for(n, cols) == 0


def test_a_repack_in_row_chunks_is_the_repack_in_one(monkeypatch):
    """``_by_rows``: chunks of ``REPACK_ROWS`` (64 here, so 100 rows take two, the second padded) give the planes
    one chunk gives, keyword arguments passed through."""
    from engine.models.quant import hold

    blocks, q6, q41 = _blocks(seed=6), hold(_q6_blocks(seed=6), FORMATS["Q6_K"]), _q41_blocks(seed=6)
    whole = [quant_gluon.repack(blocks, K, pairs=True), quant_gluon.repack_q6_k(q6, K),
             quant_gluon.repack_q4_1(q41, K1)]
    monkeypatch.setattr(quant_gluon_planes, "REPACK_ROWS", 64)
    for got, want in zip([quant_gluon.repack(blocks, K, pairs=True), quant_gluon.repack_q6_k(q6, K),
                          quant_gluon.repack_q4_1(q41, K1)], whole, strict=True):
        assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def _q6_blocks(seed: int, n: int = N) -> torch.Tensor:
    return torch.from_numpy(random_blocks(gguf.GGMLQuantizationType.Q6_K, n, K, seed, scale=0.05))


def _q6_read(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K file blocks -> (q 0..63, bf16(d * scale)) [N, K], by ggml's layout value by value: half v // 128,
    quarter (v % 128) // 32, position v % 32 (independent of ``quant`` and of the module)."""
    v = torch.arange(K)
    blk, half, quarter, pos = v // 256, v % 256 // 128, v % 128 // 32, v % 32
    low = (blocks[:, blk * 210 + half * 64 + (quarter % 2) * 32 + pos].long() >> (4 * (quarter // 2))) & 15
    top = (blocks[:, blk * 210 + 128 + half * 32 + pos].long() >> (2 * quarter)) & 3
    scale = blocks[:, blk * 210 + 192 + v % 256 // 16].view(torch.int8).float()
    block_d = blocks.reshape(blocks.shape[0], -1, 210)[:, :, 208:210].contiguous()
    block_d = block_d.view(torch.float16).float().squeeze(-1)
    return low | (top << 4), (block_d.repeat_interleave(256, dim=1) * scale).to(torch.bfloat16)


def test_q6_k_planes_hold_each_value_where_the_kernel_reads_it_and_read_back_as_its_decode():
    """``repack_q6_k``: the low nibbles as Q4_K's pair words; the top 2 bits of slice s = 2 u + o at field
    8 e + 4 o + 2 j + h of word [G][kt][g][t][u], read position by position against the file's bytes; read back, the
    values are (q - 32) * bf16(d * scale) rounded once, computed here from the file's blocks (not the planes)."""

    from engine.models.quant import hold

    fmt = FORMATS["Q6_K"]
    blocks = _q6_blocks(seed=4)
    words, high, scales, d = quant_gluon.repack_q6_k(hold(blocks, fmt), K)
    assert high.numel() == (128 // 16) * (K // 128) * 128 and scales.shape == (128, K // 16) and d.shape == (128, 2)
    for G, kt, g, t, u in [(0, 0, 0, 0, 0), (1, 2, 5, 3, 3), (6, 3, 3, 1, 2), (5, 1, 7, 2, 1)]:
        word = int(high[((G * (K // 128) + kt) * 8 + g) * 16 + t * 4 + u]) & 0xFFFFFFFF
        for o, j, h, e in [(o, j, h, e) for o in range(2) for j in range(2) for h in range(2) for e in range(2)]:
            row, col = 16 * G + 8 * h + g, 128 * kt + 16 * (2 * u + o) + 8 * j + 2 * t + e
            got = (word >> (2 * (8 * e + 4 * o + 2 * j + h))) & 3
            if row >= N:
                assert got == 0
                continue
            blk, v = divmod(col, 256)  # ggml: half v // 128, then 32-value group l, quarter v % 128 // 32
            half, r = divmod(v, 128)
            quarter, l_ = divmod(r, 32)
            qh = int(blocks[row, blk * 210 + 128 + half * 32 + l_])
            assert got == (qh >> (2 * quarter)) & 3, (G, kt, g, t, u, o, j, h, e)
    q, step = _q6_read(blocks)
    want = quant_gluon.round_bf16((q - 32).double() * step.double())
    assert torch.equal(quant_gluon.reference_q6_k(words, high, scales, d, N, K), want)


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("decode", ["float", "pairs", "q6_k", "q4_1"])
def test_the_kernels_joins_and_permutation_put_each_nibble_at_its_row_and_column(decode, warps):
    """``_gluon_kernel``'s assembly of a 16 W x 128 tile (W warps: 64 or 128 rows) replayed in PyTorch (a join is a
    stack on a new minor dimension; the pair decode's ``mov`` splits an int32 into its low then high 16 bits on a new
    minor dimension): its word addresses, its nibbles' joins, its reshape and permutation give the tile of the
    natural weight, and for the pair decode its steps' gather (``_pair_steps``: packed words, warp shuffles, joins)
    gives each value its row's and sub-block's step and offset: the decode's weight, bit for bit. The compile
    checks that the layout is the operand's; this checks that the data is the tile's (the first version joined the
    nibbles the other way round and compiled all the same). Q4_1 at K = 576: its steps loaded a word a lane
    (``_q4_1_steps``), the last tile's padding zero."""
    from engine.models.quant import _nibbles, hold

    cols = K1 if decode == "q4_1" else K
    k_tiles = quant_gluon.padded_cols(cols) // 128
    if decode == "q6_k":  # the 6-bit values, read from the file's bytes
        blocks = _q6_blocks(seed=3, n=N2)
        words, high, _, _ = quant_gluon.repack_q6_k(hold(blocks, FORMATS["Q6_K"]), K)
        q, _ = _q6_read(blocks)
    elif decode == "q4_1":
        blocks = _q41_blocks(seed=3, n=N2)
        words, q41_steps = quant_gluon.repack_q4_1(blocks, K1)
        q = torch.cat([_q41_read(blocks)[0], torch.zeros(N2, 640 - K1, dtype=torch.long)], dim=1)
        weight = torch.cat([quant_gluon.reference_q4_1(words, q41_steps, N2, K1),
                            torch.zeros(N2, 640 - K1, dtype=torch.bfloat16)], dim=1)
        steps = q41_steps.long() & 0xFFFFFFFF  # a word a (row, 32-value block), as the kernel loads them
    else:
        blocks = _blocks(seed=3, n=N2)
        words, heads = quant_gluon.repack(blocks, K, decode == "pairs")
        q = _nibbles(blocks.reshape(-1, 144)[:, 16:].reshape(-1, 4, 32)).reshape(N2, K)
        if decode == "pairs":  # the pair decode's values, for its steps' replay below
            weight, steps = quant_gluon.reference(words, heads, N2, K, True), _pair_step_words(heads)
            steps = steps.reshape(steps.shape[0], -1)  # [row, 32-value sub-block]

    def join(a, b):
        return torch.stack([a, b], dim=-1)

    rr, cc = torch.arange(8 * warps)[:, None], torch.arange(32)[None, :]
    rows_a_tile = 16 * warps
    for tile in range(256 // rows_a_tile):  # the 228 rows padded to 256: the last tile partial
        for kt in range(k_tiles):
            wbase = (tile * warps + rr // 8) * (k_tiles * 256) + (rr % 8) * 16 + cc // 8 * 4 \
                + (cc % 8 // 4) * 128 + cc % 4  # as the kernel's (cc = 8 t + s)
            w = words[wbase + kt * 256].to(torch.int64) & 0xFFFFFFFF
            if decode == "q6_k":  # _q6_pairs_tile: the top words joined with themselves >> 8, then per (j, h)
                hb = (tile * warps + rr // 8) * ((K // 128) * 128) + (rr % 8) * 16 + cc // 8 * 4 + cc % 8 // 2
                hw = high[hb + kt * 128].to(torch.int64) & 0xFFFFFFFF  # word u = s // 2 of the thread's slice
                top = torch.where(cc % 2 == 0, hw, hw >> 8)  # join(high, high >> 8): o = s % 2
                shifted = [top << 4, top << 2, top, top >> 2]
                p = [((w >> (4 * n)) & 0x000F000F) | (shifted[n] & 0x00300030) for n in range(4)]
                both = join(join(p[0], p[2]), join(p[1], p[3]))
                a = join(both & 0xFFFF, (both >> 16) & 0xFFFF)
            elif decode in ("pairs", "q4_1"):  # _pairs_tile: (w >> 4 (2 j + h)) & 0x000F000F, joined on j then h
                p = [(w >> (4 * n)) & 0x000F000F for n in range(4)]
                both = join(join(p[0], p[2]), join(p[1], p[3]))
                a = join(both & 0xFFFF, both >> 16)
            else:  # _values_tile
                v = [(w >> (4 * n)) & 15 for n in range(8)]
                a = join(join(join(v[0], v[4]), join(v[2], v[6])), join(join(v[1], v[5]), join(v[3], v[7])))
            rows = slice(rows_a_tile * tile, min(rows_a_tile * (tile + 1), N2))
            if decode in ("pairs", "q4_1"):  # _packed_steps and _per_value: the values, against the decode's weight
                values = _pair_values(a, steps, tile, kt, warps)
                assert torch.equal(_tile(values, warps)[: rows.stop - rows.start],
                                   weight[rows, 128 * kt:128 * kt + 128]), (tile, kt)
            a = _tile(a, warps)
            assert torch.equal(a[: rows.stop - rows.start], q[rows, 128 * kt:128 * kt + 128]), (tile, kt)
            assert not a[rows.stop - rows.start:].any()  # padded rows


def _tile(a: torch.Tensor, warps: int) -> torch.Tensor:
    """``_operand``'s reshape and permutation: [w, g, t, s, j, h, e] (as the joins leave it) -> [16 W, 128]."""
    return a.reshape(warps, 8, 4, 8, 2, 2, 2).permute(0, 5, 1, 3, 4, 2, 6).reshape(16 * warps, 128)


def _pair_step_words(heads: torch.Tensor) -> torch.Tensor:
    """What ``_pair_steps`` packs, one word a (row, block, sub-block), from the heads' bytes (not the kernel's
    arithmetic): bf16(d * scale) in the low half, bf16(-dmin * min) in the high -> int64 [N padded, blocks, 8]."""
    from engine.models.quant import _k_scales

    head = heads.contiguous().view(torch.uint8).reshape(heads.shape[0], -1, 16)
    d, dmin = (head[..., at:at + 2].contiguous().view(torch.float16).float() for at in (0, 2))
    scales, mins = (v.reshape(head.shape[0], -1, 8).float() for v in _k_scales(head.reshape(-1, 16)[:, 4:]))
    step, offset = (d * scales).to(torch.bfloat16), (-(dmin * mins)).to(torch.bfloat16)
    return (step.view(torch.int16).long() & 0xFFFF) | ((offset.view(torch.int16).long() & 0xFFFF) << 16)


def _pair_values(a: torch.Tensor, steps: torch.Tensor, tile: int, kt: int, warps: int) -> torch.Tensor:
    """``_packed_steps`` replayed on one tile (``steps``: a word a row and 32-value sub-block): lane 4 g + t of a
    row's quad holds sub-block t's word (rows h = 0 and 1: 8 apart), ``shfl.sync.idx`` gives every lane lane 4 g +
    i's, the joins put sub-block s // 2 at word s; then ``_per_value`` (h picks the row's steps) and one rounding of
    q * step + offset: [w, g, t, s, j, h, e] as ``a`` (the nibbles q)."""
    def join(x, y):
        return torch.stack([x, y], dim=-1)

    per_h = []
    for h in range(2):
        row = tile * 16 * warps + (torch.arange(8 * warps) // 8) * 16 + 8 * h + torch.arange(8 * warps) % 8
        lanes = steps[row][:, kt * 4 + torch.arange(4)]  # [8 W rows, 4 lanes t]: sub-block t
        w = [lanes[:, i, None].expand(-1, 4) for i in range(4)]  # lane 4 g + i's word, in every lane t
        packed = join(join(join(w[0], w[2]), join(w[1], w[3])), join(join(w[0], w[2]), join(w[1], w[3])))
        packed = packed.reshape(8 * warps, 4, 8)  # [row, t, s]
        per_h.append([(packed >> shift & 0xFFFF).to(torch.int16).view(torch.bfloat16).double() for shift in (0, 16)])
    (st0, off0), (st1, off1) = per_h

    def per_value(v0, v1):  # [row, t, s] -> [row, t, s, j, h, e]
        v = join(join(v0, v0), join(v1, v1))
        return join(v, v)

    q = a.reshape(8 * warps, 4, 8, 2, 2, 2).double()
    return quant_gluon.round_bf16(q * per_value(st0, st1) + per_value(off0, off1)).reshape(a.shape)


# ------------------------------------------------------------------ a model's weights held as planes (the engine)


def _layers() -> torch.nn.ModuleDict:
    """Q4_K and Q6_K projections (the second fused of two Q4_K parts, one with a bias), and a Q8_0 one, which a load
    leaves in blocks."""
    from engine.models.quant import QuantFusedLinear, QuantLinear, hold

    def layer(name, seed, n=N, bias=False):
        fmt = FORMATS[name]
        blocks = torch.from_numpy(random_blocks(getattr(gguf.GGMLQuantizationType, name), n, K, seed, scale=0.05))
        out = QuantLinear(fmt, K, n, bias=bias, blocks=hold(blocks, fmt))
        if bias:
            torch.nn.init.normal_(out.bias)
        return out

    return torch.nn.ModuleDict({"q4": layer("Q4_K", 10), "fused": QuantFusedLinear([layer("Q4_K", 11, 64),
                                                                                      layer("Q4_K", 12, 36, True)]),
                                "q6": layer("Q6_K", 13), "q8": layer("Q8_0", 14)})


def test_a_model_held_as_planes_multiplies_by_the_pair_decodes_values_and_frees_its_blocks():
    """``hold_operands_`` (forced: off sm_90 it holds nothing): each bias-free Q4_K and Q6_K projection, fused ones
    too, holds planes instead of its blocks (buffers, counted by ``nbytes`` and ``state_dict``; a float plane as
    its bits, so ``.to(dtype)`` leaves it), and multiplies by the pair decode's values (against an independent
    reading of the file's blocks), a bias after; a Q8_0 projection keeps its blocks. Idempotent."""
    sys.path.insert(0, str(BENCH))
    import quant_packed

    from engine.models.quant import unhold

    model = _layers()
    files = {name: unhold(m.blocks, m.fmt).clone() for name, m in model.items()}
    before = {name: m.blocks.numel() for name, m in model.items()}
    quant_gluon.hold_operands_(model, torch.bfloat16, force=True)
    for name in ("q4", "fused", "q6"):
        m = model[name]
        assert m.operand is not None and m.blocks.numel() == 0 and m.operand.split == quant_gluon.split_for(
            m.out_features, K)
        state = {k: v for k, v in m.state_dict().items() if k.startswith("planes_")}
        assert len(state) == (4 if name == "q6" else 2) and not any(v.is_floating_point() for v in state.values())
        assert m.nbytes == sum(v.numel() * v.element_size() for v in state.values()) >= before[name]
    assert model["q8"].operand is None and model["q8"].blocks.numel() == before["q8"]
    assert torch.equal(model["q4"].dequantized(torch.float32), quant_packed.values(files["q4"], K).float())
    assert torch.equal(model["fused"].dequantized(torch.float32), quant_packed.values(files["fused"], K).float())
    q, step = _q6_read(files["q6"])
    q6_values = quant_gluon.round_bf16((q - 32).double() * step.double())
    assert torch.equal(model["q6"].dequantized(torch.bfloat16), q6_values)
    x = torch.randn(3, K)
    for name in ("q4", "q6"):
        assert torch.equal(model[name](x), torch.nn.functional.linear(x, model[name].dequantized(torch.float32)))
    whole = model["fused"].forward(x)
    assert [t.shape[-1] for t in whole] == [64, 36]
    assert torch.equal(whole[1], torch.nn.functional.linear(x, model["fused"].dequantized(torch.float32)[64:],
                                                            model["fused"].bias[64:]))
    assert torch.equal(model["fused"].part(x, 1), whole[1]) and torch.equal(model["fused"].part(x, 0), whole[0])
    model.to(torch.float64)  # planes are integers: a cast leaves them
    assert torch.equal(model["q6"].dequantized(torch.bfloat16), q6_values)
    planes = model["q4"].planes()
    quant_gluon.hold_operands_(model, torch.bfloat16, force=True)
    assert [p.data_ptr() for p in model["q4"].planes()] == [p.data_ptr() for p in planes]


def _q41_layers() -> torch.nn.ModuleDict:
    """SmolLM2's Q4_1 projections' shape of K (576): one alone, one fused of two parts (64 + 36 rows, the second
    with a bias)."""
    from engine.models.quant import QuantFusedLinear, QuantLinear

    def layer(seed, n=N, bias=False):
        out = QuantLinear(FORMATS["Q4_1"], K1, n, bias=bias, blocks=_q41_blocks(seed, n))
        if bias:
            torch.nn.init.normal_(out.bias)
        return out

    return torch.nn.ModuleDict({"q41": layer(30), "fused": QuantFusedLinear([layer(31, 64), layer(32, 36, True)])})


def _q41_values(blocks: torch.Tensor) -> torch.Tensor:
    q, d, m = _q41_read(blocks)
    return quant_gluon.round_bf16(q.double() * d.double() + m.double())


def test_a_fused_weights_part_is_its_rows_of_the_planes_where_it_starts_a_tile(monkeypatch):
    """``OperandWeight.rows``: a part starting a 64-row tile reads views of the whole's planes, whose values are the
    file's rows (an independent reading: ``quant_packed.values``, ``_q6_read``), the last part's padding the whole's;
    one starting inside a tile is refused (None). ``values`` by chunks of 64 rows gives the values of one chunk."""
    sys.path.insert(0, str(BENCH))
    import quant_packed

    from engine.models.quant import unhold

    model = _layers()
    files = {name: unhold(m.blocks, m.fmt).clone() for name, m in model.items()}
    quant_gluon.hold_operands_(model, torch.bfloat16, force=True)
    q, step = _q6_read(files["q6"])
    want = {"fused": quant_packed.values(files["fused"], K),
            "q6": quant_gluon.round_bf16((q - 32).double() * step.double())}
    for name, lo, hi in [("fused", 0, 64), ("fused", 64, 100), ("q6", 64, 100), ("q6", 0, 100)]:
        m = model[name]
        operand, planes = m.operand.rows(m.planes(), lo, hi)
        assert operand.n == hi - lo and operand.split == m.operand.split
        assert all(p.data_ptr() >= w.data_ptr() for p, w in zip(planes, m.planes(), strict=True))  # views
        assert torch.equal(operand.values(planes), want[name][lo:hi]), (name, lo, hi)
    assert model["fused"].operand.rows(model["fused"].planes(), 32, 64) is None
    monkeypatch.setattr(quant_gluon_planes, "REPACK_ROWS", 64)  # values in two chunks, the second 36 rows
    for name in ("fused", "q6"):
        assert torch.equal(model[name].dequantized(torch.bfloat16), want[name]), name


def test_the_decode_runs_only_on_sm_90_in_bf16_with_the_kernels_on_unless_quant_kernel_is_asked_for(monkeypatch):
    """``runs_on``: off CUDA, in another dtype or with the kernels off, never (a load there keeps its blocks);
    ``ENGINE_QUANT_DECODE=kernel`` keeps quant_kernel's blocks everywhere; a value that is neither is refused as an
    input error naming it (``check_environment``, the CLIs' first check: exit 2)."""
    from engine.config import EngineInputError
    from engine.models import fused

    assert not quant_gluon.runs_on(torch.device("cpu"), torch.bfloat16)
    model = _layers()
    quant_gluon.hold_operands_(model, torch.bfloat16)
    assert all(m.operand is None for m in model.values())
    monkeypatch.setattr("engine.models.linear.capability", lambda dev: (9, 0))
    monkeypatch.setattr(fused, "triton", object())  # (a CPU install without Triton: the kernels' switch alone)
    cuda = torch.device("cuda")
    if quant_gluon.gluon is not None:
        assert quant_gluon.runs_on(cuda, torch.bfloat16) and not quant_gluon.runs_on(cuda, torch.float16)
        previous = fused.set_kernels(False)
        try:
            assert not quant_gluon.runs_on(cuda, torch.bfloat16)
        finally:
            fused.set_kernels(previous)
    monkeypatch.setattr(fused, "_quant_decode", fused._quant_decode)  # restored after
    assert fused.set_quant_decode("kernel") == "auto" and not quant_gluon.runs_on(cuda, torch.bfloat16)
    with pytest.raises(EngineInputError, match=r"set_quant_decode: must be one of \['auto', 'kernel'\], got 'off'"):
        fused.set_quant_decode("off")
    for value, error in [("Kernel ", None), ("", "got ''"), (" Operand", "got ' Operand'")]:
        monkeypatch.setenv("ENGINE_QUANT_DECODE", value)
        got = fused._quant_decode_from_environment()[1]
        assert got is None if error is None else error in got
    monkeypatch.setattr(fused, "_quant_decode_error", fused._quant_decode_from_environment()[1])
    monkeypatch.setitem(fused._AT_IMPORT, "ENGINE_QUANT_DECODE", " Operand")
    assert fused.environment_errors()["ENGINE_QUANT_DECODE"] == ("must be 'auto' or 'kernel'", " Operand")
    for check in (fused.check_environment, lambda: quant_gluon.runs_on(cuda, torch.bfloat16)):
        with pytest.raises(EngineInputError, match="ENGINE_QUANT_DECODE must be 'auto' .* got ' Operand'"):
            check()


@pytest.mark.skipif(not torch.cuda.is_available() or quant_gluon.gluon is None
                    or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU and Gluon")
def test_on_hopper_a_model_held_as_planes_rounds_a_row_alike_in_every_step_and_multiplies_a_prefill(monkeypatch):
    """As a load holds them (``hold_operands_``, not forced): a decode step's rows (1, 33, 100: two row blocks, the
    verify of a budget-99 tree) give each row the bits it has alone; 1,100 rows (past ``MAX_ROWS``: K in one part)
    and every step multiply by the planes' values (the product of the dequantized bf16 weight, to float32
    rounding); a fused part (its rows of the planes) is its columns of the whole; no row reaches quant_kernel."""
    from engine.models import quant_kernel

    model = _layers()
    model.update({f"{name}_q41": layer for name, layer in _q41_layers().items()})  # Q4_1 at K = 576
    model = model.cuda()
    quant_gluon.hold_operands_(model, torch.bfloat16)
    assert all(model[name].operand is not None for name in ("q4", "fused", "q6", "q41_q41", "fused_q41"))
    calls = []
    monkeypatch.setattr(quant_kernel, "linear", lambda *a, **k: calls.append(a[2].name))
    xs = {K: torch.randn(1100, K, device="cuda", dtype=torch.bfloat16),
          K1: torch.randn(1100, K1, device="cuda", dtype=torch.bfloat16)}

    def run(m, rows):
        out = m(xs[m.in_features][rows])
        return torch.cat(out, -1) if isinstance(out, tuple) else out

    with torch.no_grad():
        for name in ("q4", "fused", "q6", "q41_q41", "fused_q41"):
            m = model[name]
            x = xs[m.in_features]
            full = run(m, slice(0, 1100))
            bias = 0 if m.bias is None else m.bias.float()
            exact = x.float() @ m.dequantized(torch.float32).T + bias
            assert float((full.float() - exact).norm() / exact.norm()) < 1e-2, name
            step = run(m, slice(0, 100))
            for rows in (slice(0, 1), slice(0, 33), slice(99, 100)):
                assert torch.equal(run(m, rows), step[rows]), (name, rows)
        for name in ("fused", "fused_q41"):
            x = xs[model[name].in_features]
            assert torch.equal(model[name].part(x[:33], 1), model[name](x[:33])[1])
    assert calls == []


def test_the_weights_summary_names_the_weights_held_as_planes():
    """``quant.weights_summary``: ``operand`` lists the weights (a fused group by its parts' names) held as planes;
    ``native`` lists every weight in blocks, as before."""
    from engine.models.quant import weights_summary

    class Owner(torch.nn.Module):
        FUSED = {"fused": ("a_proj", "b_proj")}

        def __init__(self):
            super().__init__()
            for name, layer in _layers().items():
                setattr(self, name, layer)

    model = Owner()
    assert weights_summary(model, "native")["operand"] == {}
    quant_gluon.hold_operands_(model, torch.bfloat16, force=True)
    summary = weights_summary(model, "native")
    assert summary["operand"] == {"q4.weight": "Q4_K", "a_proj.weight": "Q4_K", "b_proj.weight": "Q4_K",
                                  "q6.weight": "Q6_K"}
    assert set(summary["native"]) == {*summary["operand"], "q8.weight"}
