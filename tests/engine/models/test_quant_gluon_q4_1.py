"""``engine.models.quant_gluon``'s Q4_1 decode (SmolLM2's file; issue #28): its planes against the file's bytes
position by position, its product on a GPU (one-hot rows read the weight back bit for bit at K = 576, 1536 and 512,
rows invariant, x never read past K), a model holding it. The layout, the replay of the kernels' joins (Q4_1's
included) and the engine's other uses are ``test_quant_gluon.py``'s, whose cases these share."""

from __future__ import annotations

import pytest
import torch

from engine.models import quant_gluon
from tests.engine.models.test_quant_gluon import (
    K1,
    N2,
    ROWS,
    N,
    _q41_blocks,
    _q41_layers,
    _q41_read,
    _q41_values,
    _reads_back,
)


def test_q4_1_planes_hold_each_value_where_the_kernel_reads_it_and_read_back_as_its_decode():
    """``repack_q4_1``: the nibbles as Q4_K's pair words over K padded to whole 128-column tiles (576 -> 640, the
    padding zero), read position by position against the file's bytes; each block's bf16(d) and bf16(m) one word;
    read back, the values are q * bf16(d) + bf16(m) rounded once, computed here from the file's blocks."""
    blocks = _q41_blocks(seed=20)
    words, steps = quant_gluon.repack_q4_1(blocks, K1)
    assert words.numel() == (128 // 16) * 5 * 256 and steps.shape == (128, 640 // 32) and steps.dtype == torch.int32
    q, d, m = _q41_read(blocks)
    for G, kt, g, t, s in [(0, 0, 0, 0, 0), (1, 2, 5, 3, 7), (6, 4, 3, 1, 4), (5, 4, 7, 2, 2), (2, 4, 1, 0, 3)]:
        word = int(words[(G * 5 + kt) * 256 + (s // 4) * 128 + (4 * g + t) * 4 + s % 4]) & 0xFFFFFFFF
        for j, h, e in [(j, h, e) for j in range(2) for h in range(2) for e in range(2)]:
            row, col = 16 * G + 8 * h + g, 128 * kt + 16 * s + 8 * j + 2 * t + e
            got = (word >> (4 * (4 * e + 2 * j + h))) & 15
            assert got == (int(q[row, col]) if row < N and col < K1 else 0), (G, kt, g, t, s, j, h, e)
    packed = steps.long() & 0xFFFFFFFF
    assert torch.equal((packed[:N, :18] & 0xFFFF).to(torch.int16).view(torch.bfloat16), d[:, ::32])
    assert torch.equal((packed[:N, :18] >> 16).to(torch.int16).view(torch.bfloat16), m[:, ::32])
    assert not packed[N:].any() and not packed[:, 18:].any()  # padded rows and columns
    want = quant_gluon.round_bf16(q.double() * d.double() + m.double())
    assert torch.equal(quant_gluon.reference_q4_1(words, steps, N, K1), want)


@pytest.mark.skipif(not torch.cuda.is_available() or quant_gluon.gluon is None, reason="needs CUDA and Gluon")
@pytest.mark.parametrize("cols, split", [(K1, 1), (K1, 5), (1536, 3), (1536, 12), (512, 2)])
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("ahead", [False, True])
def test_on_the_gpu_the_q4_1_product_is_its_weights_and_rows_do_not_round_together(cols, split, warps, ahead):
    """As the Q4_K test, for Q4_1 at SmolLM2's K (576: the last tile half padding, x's columns past K not read:
    x is followed in memory by a row of NaN, which a read past K would carry into the last rows' sums; 1536) and at
    whole tiles (512)."""
    planes = quant_gluon.repack_q4_1(_q41_blocks(seed=21, n=N2, cols=cols).cuda(), cols)
    weight = quant_gluon.reference_q4_1(*planes, N2, cols)
    _reads_back(lambda x: quant_gluon.linear_q4_1(x, planes, N2, cols, split, ahead, warps), weight)
    memory = torch.randn(ROWS + 1, cols, device="cuda", dtype=torch.bfloat16)
    memory[ROWS] = float("nan")
    x = memory[:ROWS]  # (contiguous: the launch reads it in place)
    many = quant_gluon.linear_q4_1(x, planes, N2, cols, split, ahead, warps)
    assert torch.isfinite(many).all()
    for rows in (slice(0, 1), slice(0, 33), slice(0, 41), slice(ROWS - 1, ROWS)):  # 41: a tail of 16
        assert torch.equal(quant_gluon.linear_q4_1(x[rows], planes, N2, cols, split, ahead, 4), many[rows])
    assert torch.equal(quant_gluon.linear_q4_1(x, planes, N2, cols, split, not ahead, 12 - warps), many)
    exact = x.double() @ weight.double().T
    assert float((many.double() - exact).norm() / exact.norm()) < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available() or quant_gluon.gluon is None, reason="needs CUDA and Gluon")
@pytest.mark.parametrize("cols, split", [(K1, 1), (K1, 5), (1536, 6), (512, 2)])
@pytest.mark.parametrize("stages", [2, 3, 6])
def test_on_the_gpu_q4_1_tiles_staged_in_shared_memory_give_the_register_paths_bits(cols, split, stages):
    """``stages`` for Q4_1 (each tile's words, d | m words and x rows copied ahead by cp.async; 6: all of a
    576-column part's 5 tiles at once, the stages past it copying nothing): one-hot rows read the weight back bit
    for bit, and every row count's product is the register path's, bit for bit, x's columns past K never read (a
    row of NaN after x in memory)."""
    planes = quant_gluon.repack_q4_1(_q41_blocks(seed=22, n=N2, cols=cols).cuda(), cols)
    weight = quant_gluon.reference_q4_1(*planes, N2, cols)
    _reads_back(lambda x: quant_gluon.linear_q4_1(x, planes, N2, cols, split, stages=stages), weight)
    memory = torch.randn(ROWS + 1, cols, device="cuda", dtype=torch.bfloat16)
    memory[ROWS] = float("nan")
    x = memory[:ROWS]
    for rows in (1, 5, 8, 16, 33, 49, ROWS):
        staged = quant_gluon.linear_q4_1(x[:rows], planes, N2, cols, split, stages=stages)
        assert torch.isfinite(staged).all(), rows
        assert torch.equal(staged, quant_gluon.linear_q4_1(x[:rows], planes, N2, cols, split, stages=0)), rows


def test_a_q4_1_model_held_as_planes_multiplies_by_the_pair_decodes_values():
    """``hold_operands_`` (forced) holds Q4_1 projections of K = 576 (not whole 128-column tiles) as planes whose
    split is ``split_for``'s (one part: 5 tiles), multiplying by q * bf16(d) + bf16(m) (against the file's blocks,
    read independently); a fused part starting a tile is its rows of the planes."""
    model = _q41_layers()
    files = {name: m.blocks.clone() for name, m in model.items()}
    quant_gluon.hold_operands_(model, torch.bfloat16, force=True)
    for name, m in model.items():
        assert m.operand is not None and m.operand.fmt == "Q4_1" and m.blocks.numel() == 0
        assert m.operand.split == quant_gluon.split_for(m.out_features, K1) == 1  # parts of two tiles at least
        assert torch.equal(m.dequantized(torch.bfloat16), _q41_values(files[name])), name
    x = torch.randn(3, K1)
    assert torch.equal(model["q41"](x), torch.nn.functional.linear(x, model["q41"].dequantized(torch.float32)))
    fused = model["fused"]
    whole = fused(x)
    assert torch.equal(whole[1], torch.nn.functional.linear(x, _q41_values(files["fused"])[64:].float(),
                                                            fused.bias[64:]))
    operand, planes = fused.operand.rows(fused.planes(), 64, 100)
    assert torch.equal(operand.values(planes), _q41_values(files["fused"])[64:])
    assert torch.equal(fused.part(x, 1), whole[1]) and torch.equal(fused.part(x, 0), whole[0])
