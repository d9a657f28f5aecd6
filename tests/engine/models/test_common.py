"""engine.models.common: projection fusion and the fused residual norms, on the tiny targets."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.models.common import FusedLinear, fuse_projections_, layer_outputs, unfused_state_dict
from engine.registry import TARGETS, load_target


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid"])
def test_fused_projections_compute_what_the_parts_did(name):
    model, _ = TARGETS[name].build()
    model = model.float().eval()
    fused = fuse_projections_(copy.deepcopy(model))
    names = {n for n, _ in fused.named_parameters()}
    owners = {n.split(".")[-2] for n in names}
    assert not owners & {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "in_proj_qkv", "in_proj_z",
                         "in_proj_a", "in_proj_b"}
    assert {"qkv_proj", "gate_up_proj"} <= owners
    # the parts' weights are stacked, not copied beside them: the same number of parameters
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in model.parameters())
    assert fuse_projections_(fused) is fused and {n for n, _ in fused.named_parameters()} == names  # idempotent
    tokens = torch.randint(0, 200, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, want_feats = model(tokens, model.new_cache(64), 0, feature_layers=[1, 2])
        got, feats = fused(tokens, fused.new_cache(64), 0, feature_layers=[1, 2])
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5) and torch.allclose(feats, want_feats, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_fused_linear_keeps_each_part_and_zero_fills_a_missing_bias():
    gen = torch.Generator().manual_seed(1)
    parts = [torch.nn.Linear(8, 5, bias=True), torch.nn.Linear(8, 3, bias=False)]
    for p in parts:
        torch.nn.init.normal_(p.weight, generator=gen)
    parts[0].bias.data.normal_(generator=gen)
    x = torch.randn(4, 8, generator=gen)
    a, b = FusedLinear(parts)(x)
    assert torch.allclose(a, parts[0](x), atol=1e-6) and torch.allclose(b, parts[1](x), atol=1e-6)


def test_loaded_targets_are_fused():
    model, _ = load_target("tiny-hybrid", torch.device("cpu"), torch.float32)
    kinds = {type(m).__name__ for m in model.modules()}
    assert "FusedLinear" in kinds and not any(isinstance(m, torch.nn.Linear) and n.endswith("in_proj_qkv")
                                              for n, m in model.named_modules())


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid"])
def test_unfused_state_dict_gives_back_the_checkpoint_names_and_values(name):
    """What hands a fused target to another implementation (gpu_bench's transformers run)."""
    model, _ = TARGETS[name].build()
    want = model.state_dict()
    got = unfused_state_dict(fuse_projections_(copy.deepcopy(model)))
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert unfused_state_dict(model).keys() == want.keys()  # an unfused model: its own state dict


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rows_are_rope_cos_sin_bit_for_bit(dtype):
    """A captured step gathers its positions' cos/sin from a table made once per size: the values of
    rope_cos_sin at those positions, exactly (an AR step, a verify and the prefill must agree)."""
    from torch import nn

    from engine.models.common import rope_cos_sin, rope_inv_freq, rope_rows

    module = nn.Module()
    module.inv_freq = rope_inv_freq(24, 1e6)
    module._rope_tables = {}
    positions = torch.tensor([0, 7, 7, 300, 511])
    cos, sin = rope_rows(module, positions, 512, dtype)
    want_cos, want_sin = rope_cos_sin(positions, module.inv_freq, dtype)
    assert cos.dtype == dtype and torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    rope_rows(module, positions[:2], 512, dtype)
    assert len(module._rope_tables) == 1  # made once for that size and dtype


def test_fusion_frees_each_groups_parts_before_stacking_the_next(monkeypatch):
    """A load's peak holds one group's weights twice, not all of them: when a group is stacked, the
    parts of every group stacked before it are gone (on the 27B shape at Q4_K_M, all of them kept to the
    end were 8.4 GiB over the model)."""
    import weakref

    from engine.models import common

    model, _ = TARGETS["tiny-hybrid"].build()
    owners = [m for m in model.modules() if getattr(m, "FUSED", None)]
    parts = [weakref.ref(m.get_submodule(p).weight) for m in owners for group in m.FUSED.values() for p in group]
    sizes = [len(group) for m in owners for group in m.FUSED.values()]
    alive = []

    class Counting(common.FusedLinear):
        def __init__(self, linears):
            alive.append(sum(ref() is not None for ref in parts))
            super().__init__(linears)

    monkeypatch.setattr(common, "FusedLinear", Counting)
    common.fuse_projections_(model)
    assert len(alive) == len(sizes) > 2
    assert alive == [len(parts) - sum(sizes[:i]) for i in range(len(sizes))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_layer_outputs_are_each_layers_sum_bit_for_bit(dtype):
    """The target features in three launches equal the sum per layer then the cat, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    outs = [torch.randn(7, 48, generator=gen).to(dtype) * 10 ** k for k in range(-2, 3)]
    deltas = [torch.randn(7, 48, generator=gen).to(dtype) for _ in outs]
    want = torch.cat([x + d for x, d in zip(outs, deltas, strict=True)], -1)
    before = [t.clone() for t in outs + deltas]
    got = layer_outputs(outs, deltas)
    assert got.dtype == dtype and torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(outs + deltas, before, strict=True))  # the layers' tensors untouched
    assert layer_outputs([], []) is None
    assert torch.equal(layer_outputs(outs[:1], deltas[:1]), outs[0] + deltas[0])
    assert torch.equal(layer_outputs(outs[:2], [deltas[0], None]), torch.cat([outs[0] + deltas[0], outs[1]], -1))
