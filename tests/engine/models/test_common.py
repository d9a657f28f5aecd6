"""engine.models.common: projection fusion and the fused residual norms, on the tiny targets."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.config import EngineInputError
from engine.models.common import FusedLinear, fuse_projections_, unfused_state_dict
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


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layers", [[0, 1], [1], [0, 1, 2, 3], [3]])
def test_the_features_are_each_layers_output_bit_for_bit(name, dtype, layers):
    """The target features as the next layers' adds write them (``_stack``'s tees, the last layer's
    by the final norm's add, or its own add when the norm reads the last row alone): each feature
    layer's ``x + delta`` as the layer returned them, in layer order, bit for bit; the logits as without
    features. Out-of-range layers are refused."""
    model, _ = TARGETS[name].build()
    model = model.to(dtype).eval()
    n = len(model.layers)
    layers = [i % n if i < 3 else n - 1 for i in layers]
    outputs = {}
    hooks = [layer.register_forward_hook(lambda _m, _a, out, i=i: outputs.__setitem__(i, out[0] + out[1]))
             for i, layer in enumerate(model.layers)]
    tokens = torch.randint(0, 200, (9,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for last_only in (False, True):
            plain, none = model(tokens, model.new_cache(16), 0, last_only=last_only)
            logits, feats = model(tokens, model.new_cache(16), 0, feature_layers=list(reversed(layers)),
                                  last_only=last_only)
            want = torch.cat([outputs[i] for i in sorted(set(layers))], -1)
            assert none is None and feats.dtype == dtype and torch.equal(feats, want)
            assert torch.equal(logits, plain)
        with pytest.raises(EngineInputError, match="feature_layers"):
            model(tokens, model.new_cache(16), 0, feature_layers=[n])
    for h in hooks:
        h.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_tees_its_sum_into_a_strided_slice(dtype, monkeypatch):
    """``fused.add_rms_norm(tee=...)``: the rounded sum written into a column slice of a wider buffer
    too, by the kernel (on the GPU, or Triton's interpreter) and by the PyTorch form alike, the same
    bits as the sum it returns, nothing else touched; a tee that cannot be a strided view of rows is
    refused."""
    from engine.models import fused
    from tests.engine.models.test_fused import DEVICE

    gen = torch.Generator().manual_seed(4)
    x, delta = (torch.randn(5, 32, generator=gen).to(DEVICE, dtype) for _ in range(2))
    w = torch.randn(32, generator=gen).to(DEVICE, dtype)
    want_total, _ = fused.add_rms_norm_torch(x, delta, w, 1e-6, False)
    for kernels in (False, True):
        if kernels and fused.triton is None:
            continue
        if not kernels or DEVICE == "cpu":  # (on a GPU the kernels' own dispatch)
            monkeypatch.setattr(fused, "use_kernels", lambda *_t, k=kernels: k)
        wide = torch.full((5, 96), 7.0, dtype=dtype, device=DEVICE)
        total, _ = fused.add_rms_norm(x, delta, w, 1e-6, False, tee=wide[:, 32:64])
        assert torch.equal(wide[:, 32:64], total)
        assert (wide[:, :32] == 7).all() and (wide[:, 64:] == 7).all()
        if dtype == torch.float32 or DEVICE == "cuda" or not kernels:  # (the interpreter truncates to bf16)
            assert torch.equal(total, want_total)
        if kernels:
            with pytest.raises(ValueError, match="tee"):
                fused.add_rms_norm(x, delta, w, 1e-6, False, tee=torch.empty(32, 5, dtype=dtype, device=DEVICE).t())
        with pytest.raises(ValueError, match=r"tee: \(4, 32\) .* where the sum is \(5, 32\)"):  # fewer rows
            fused.add_rms_norm(x, delta, w, 1e-6, False, tee=wide[:4, :32])
        monkeypatch.undo()
