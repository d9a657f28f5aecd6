"""GGUF block formats in PyTorch: each format's dequantization equals the gguf package's reference bit
for bit; the quantized linear layers multiply as a float layer of those values would; fused groups
stack rows of blocks of one format and leave mixed groups as their parts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.models.common import FusedLinear, Linear, SwiGLU, free_rows_, fuse_projections_, unfused_state_dict
from engine.models.quant import (
    FORMATS,
    QuantEmbedding,
    QuantFusedLinear,
    QuantLinear,
    bad_scales,
    dequantize,
    embed_rows,
    fusable,
    hold,
    unhold,
)
from tests.engine.gguf_files import quantize, random_blocks

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
SHAPES = [(1, 1), (3, 2), (7, 5), (16, 3)]  # rows, blocks per row


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("rows, blocks", SHAPES)
def test_dequantize_equals_the_gguf_reference_bit_for_bit(name, rows, blocks):
    fmt = FORMATS[name]
    cols = blocks * fmt.values
    data = random_blocks(Q[name], rows, cols, seed=rows * 31 + blocks)
    want = gguf.quants.dequantize(data, Q[name])
    got = dequantize(torch.from_numpy(data), fmt, cols)
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape == (rows, cols)
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))  # bits, so -0.0 != 0.0 too
    assert bad_scales(torch.from_numpy(data), fmt) == 0
    # In another dtype: the float32 values rounded once, as a dequantized load's copy_ rounds them.
    assert torch.equal(dequantize(torch.from_numpy(data), fmt, cols, torch.bfloat16),
                       torch.from_numpy(want).to(torch.bfloat16))


def _f16_bytes(value: float) -> np.ndarray:
    return np.array([value], np.float16).view(np.uint8)


def test_every_value_of_a_block_is_reached():
    """Random bytes decode every quantized level: a field read from the wrong bits would leave some
    levels out (a Q6_K block has 64 levels per scale, a Q5_K 32)."""
    for name, levels in (("Q4_0", 16), ("Q5_0", 32), ("Q8_0", 256), ("Q5_K", 32), ("Q6_K", 64)):
        fmt = FORMATS[name]
        data = random_blocks(Q[name], 64, 4 * fmt.values, seed=5)
        blocks = data.reshape(-1, fmt.nbytes)  # a view: rows of 4 blocks each
        blocks[:, fmt.scales[0] : fmt.scales[0] + 2] = _f16_bytes(1.0)  # d = 1
        if name == "Q6_K":
            blocks[:, 192:208] = 1  # every sub-block scale 1: the values are q - 32
        if name == "Q5_K":  # dmin 0; the 6-bit scales all 1: bytes 0-3 and the low nibbles of 8-11
            blocks[:, 2:4] = _f16_bytes(0.0)
            blocks[:, 4:16] = [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]
        values = dequantize(torch.from_numpy(data), fmt, 4 * fmt.values)
        assert values.unique().numel() == levels, name


def test_bad_scales_counts_nan_and_inf():
    fmt = FORMATS["Q6_K"]
    data = random_blocks(Q.Q6_K, 4, 512, seed=0)
    data[1, 208:210] = _f16_bytes(np.nan)
    data[3, 210 + 208 : 210 + 210] = _f16_bytes(-np.inf)
    assert bad_scales(torch.from_numpy(data), fmt) == 2


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_the_tests_k_quantisers_round_trip_through_the_reference(name):
    """tests/engine/gguf_files.quantize (the K formats, our own min/max quantiser) writes blocks that
    gguf's reference decodes to within one quantisation step of the input: the layouts agree."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 512)) * 0.05).astype(np.float32)
    y = gguf.quants.dequantize(quantize(x, Q[name]), Q[name])
    levels = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 63}[name]
    assert np.abs(y - x).max() <= 2 * np.abs(x).max() / levels
    assert np.abs(y - x).max() > 0  # quantised, not copied


@pytest.mark.parametrize("name", list(FORMATS))
def test_held_rows_are_the_files_bytes_regrouped_and_give_them_back(name):
    """``hold`` keeps a row's bytes and its length; a format with ``planes`` (Q4_0, Q5_0, Q8_0, Q6_K) as each
    field's bytes of every block of the row, field after field (Q8_0: the int8 values, then the fp16 scales, so
    the values start at the row's start); ``unhold`` gives the file's blocks back byte for byte, and a held
    weight dequantizes to the file's values."""
    fmt = FORMATS[name]
    cols = 3 * fmt.values
    blocks = torch.from_numpy(random_blocks(Q[name], 5, cols, seed=4))
    held = hold(blocks, fmt)
    assert held.shape == blocks.shape and torch.equal(unhold(held, fmt), blocks)
    assert torch.equal(held.sort(dim=1).values, blocks.sort(dim=1).values)  # the same bytes, row by row
    if name == "Q8_0":
        b = blocks.view(5, 3, 34)
        assert torch.equal(held[:, :96], b[:, :, 2:].reshape(5, 96))
        assert torch.equal(held[:, 96:], b[:, :, :2].reshape(5, 6))
    if fmt.planes:
        b = blocks.view(5, 3, fmt.nbytes)
        assert torch.equal(held, torch.cat([b[:, :, lo:hi].reshape(5, -1) for lo, hi in fmt.planes], dim=1))
        assert torch.equal(hold(blocks[2:4], fmt), held[2:4])  # row by row: held rows stack and split
    else:
        assert held is blocks
    layer = QuantLinear(fmt, cols, 5, blocks=held)
    assert torch.equal(layer.dequantized(), dequantize(blocks, fmt, cols))


def _quant_linear(name: str, out: int, cols: int, seed: int, bias: bool = False) -> QuantLinear:
    fmt = FORMATS[name]
    blocks = hold(torch.from_numpy(random_blocks(Q[name], out, cols, seed)), fmt)
    layer = QuantLinear(fmt, cols, out, bias=bias, blocks=blocks)
    if bias:
        with torch.no_grad():
            layer.bias.copy_(torch.randn(out, generator=torch.Generator().manual_seed(seed)))
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_multiplies_as_its_dequantized_weight(dtype):
    layer = _quant_linear("Q4_K", 24, 512, seed=1, bias=True).to(dtype)
    assert layer.blocks.dtype == torch.uint8 and layer.bias.dtype == dtype  # .to(dtype) casts floats only
    assert layer.nbytes == 24 * 2 * 144 and not hasattr(layer, "weight")
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0)).to(dtype)
    w = layer.dequantized(dtype)
    assert w.dtype == dtype and w.shape == (24, 512)
    assert torch.equal(layer(x), F.linear(x, w, layer.bias))
    assert torch.equal(free_rows_(layer)(x), F.linear(x, w, layer.bias))
    with pytest.raises(ValueError, match="rows of whole 256-value blocks, but in_features is 300"):
        QuantLinear(FORMATS["Q4_K"], 300, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_embedding_looks_up_its_dequantized_rows(dtype):
    """An untied embedding kept in its blocks: ``.to(dtype)`` moves its dtype (an empty float buffer) and
    leaves its bytes; a lookup of any shape is the dequantized table's rows in that dtype, bit for bit;
    it has no ``weight``, and a width of partial blocks is refused."""
    fmt = FORMATS["Q6_K"]
    blocks = hold(torch.from_numpy(random_blocks(Q.Q6_K, 40, 512, 3)), fmt)
    embed = QuantEmbedding(fmt, 40, 512, blocks=blocks).to(dtype)
    assert embed.blocks.dtype == torch.uint8 and embed.dtype == dtype and embed.nbytes == 40 * 2 * 210
    assert not hasattr(embed, "weight") and embed.state_dict().keys() == {"blocks"}
    table = dequantize(unhold(blocks, fmt), fmt, 512, dtype)
    assert torch.equal(embed.dequantized(dtype), table)
    ids = torch.tensor([[3, 0, 39], [7, 7, 12]])
    got = embed(ids)
    assert got.shape == (2, 3, 512) and got.dtype == dtype
    assert torch.equal(got, table[ids]) and torch.equal(embed_rows(embed, ids[0]), table[ids[0]])
    with pytest.raises(ValueError, match="rows of whole 256-value blocks, but embedding_dim is 300"):
        QuantEmbedding(fmt, 4, 300)


def test_fusion_stacks_rows_of_one_format_and_leaves_mixed_groups_apart():
    """gate/up of one format: one QuantFusedLinear, its blocks the parts' rows stacked, each output the
    part's own; q/k/v mixing Q4_K and Q6_K (as a Q4_K_M file's v): the parts stay, in their blocks;
    a float part among quantized ones takes the row-invariant Linear."""
    mlp = SwiGLU(512, 32)
    mlp.gate_proj, mlp.up_proj = _quant_linear("Q4_K", 32, 512, 1), _quant_linear("Q4_K", 32, 512, 2)
    mlp.down_proj = _quant_linear("Q8_0", 512, 32, 3)
    gate, up = mlp.gate_proj, mlp.up_proj
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    want = mlp(x)
    fuse_projections_(mlp)
    fused = mlp.gate_up_proj
    assert isinstance(fused, QuantFusedLinear) and not hasattr(mlp, "gate_proj")
    assert torch.equal(fused.blocks, torch.cat([gate.blocks, up.blocks])) and fused.blocks.is_contiguous()
    assert torch.equal(mlp(x), want)
    assert torch.equal(fused.part(x, 1), up(x))
    state = unfused_state_dict(mlp)
    assert set(state) == {"gate_proj.blocks", "up_proj.blocks", "down_proj.blocks"}
    assert torch.equal(state["up_proj.blocks"], up.blocks)

    class Attn(nn.Module):
        FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    attn = Attn()
    attn.q_proj, attn.k_proj = _quant_linear("Q4_K", 16, 256, 4, bias=True), _quant_linear("Q4_K", 8, 256, 5)
    attn.v_proj = _quant_linear("Q6_K", 8, 256, 6)
    assert not fusable([attn.q_proj, attn.k_proj, attn.v_proj])
    fuse_projections_(attn)
    assert "qkv_proj" not in attn._modules and isinstance(attn.v_proj, QuantLinear)
    attn.v_proj = nn.Linear(256, 8)
    fuse_projections_(attn)
    assert type(attn.v_proj) is Linear and isinstance(attn.q_proj, QuantLinear)
    attn.q_proj, attn.k_proj = nn.Linear(256, 16), nn.Linear(256, 8)
    fuse_projections_(attn)  # all float again: today's FusedLinear
    assert isinstance(attn.qkv_proj, FusedLinear)


def test_a_fused_group_with_a_missing_bias_stores_zeros():
    parts = [_quant_linear("Q8_0", 6, 64, 1, bias=True), _quant_linear("Q8_0", 4, 64, 2)]
    fused = QuantFusedLinear(parts)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    q, k = fused(x)
    want = F.linear(x, torch.cat([p.dequantized() for p in parts]), torch.cat([parts[0].bias, torch.zeros(4)]))
    assert torch.equal(torch.cat([q, k], -1), want)
    assert torch.allclose(q, parts[0](x), atol=1e-4) and torch.allclose(k, parts[1](x), atol=1e-4)
    assert fused.biased == [True, False] and torch.equal(fused.bias[6:], torch.zeros(4))
