"""The one-row GEMV (Triton, interpreted on the CPU) against F.linear, and where it is used."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.models import fused, gemv
from engine.models.common import FusedLinear, RowLinear, row_linears_
from engine.registry import load_target

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16: a few ulps (Triton's interpreter converts float32 to bf16 by truncation, the GPU rounds)
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _r(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(48, 64), (100, 200), (7, 1000)])  # K and N off the blocks too
@pytest.mark.parametrize("config", [(8, 128, 4), (16, 256, 4), (64, 128, 8)])
def test_gemv_matches_f_linear(dtype, n, k, config):
    x, w, b = _r(1, 1, k, dtype=dtype), _r(n, k, dtype=dtype, seed=1), _r(n, dtype=dtype, seed=2)
    want = F.linear(x.float(), w.float(), b.float())
    got = gemv.gemv(x, w, b, config=config)
    assert got.shape == (1, 1, n) and got.dtype == dtype
    assert _rel(got, want) < TOL[dtype]
    assert _rel(gemv.gemv(x, w, None, config=config), F.linear(x.float(), w.float())) < TOL[dtype]
    assert torch.equal(gemv.gemv(x, w, b, config=config), got)  # deterministic


def test_gemv_refuses_what_it_cannot_compute():
    w = _r(8, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="one row of 16 values"):
        gemv.gemv(_r(2, 16, dtype=torch.float16), w, config=(8, 128, 4))
    with pytest.raises(ValueError, match="rows contiguous"):
        gemv.gemv(_r(16, dtype=torch.float16), _r(16, 8, dtype=torch.float16).t(), config=(8, 128, 4))


def test_linear_dispatch_keeps_f_linear_off_the_gemv_path(monkeypatch):
    """Float32, several rows, a CPU tensor (no kernels) or the switch off: exactly F.linear."""
    x32, w32 = _r(1, 24, dtype=torch.float32), _r(8, 24, dtype=torch.float32, seed=1)
    assert torch.equal(gemv.linear(x32, w32), F.linear(x32, w32))  # float32 stays on cuBLAS / ATen
    x, w = _r(3, 24, dtype=torch.float16), _r(8, 24, dtype=torch.float16, seed=1)
    assert torch.equal(gemv.linear(x, w), F.linear(x, w))  # several rows: a GEMM
    called = []
    monkeypatch.setattr(gemv, "gemv", lambda *a, **k: called.append(1) or F.linear(*a))
    monkeypatch.setattr(fused, "use_kernels", lambda *t: True)
    gemv.linear(x[:1], w)
    assert called == [1]  # one half-precision row with the kernels on: the GEMV
    previous = gemv.set_gemv(False)
    try:
        gemv.linear(x[:1], w)
    finally:
        gemv.set_gemv(previous)
    assert called == [1]


def test_row_linears_change_the_class_only():
    model = nn.Sequential(nn.Linear(8, 4), FusedLinear([nn.Linear(4, 2), nn.Linear(4, 3)]), nn.Linear(5, 2))
    before = copy.deepcopy(model.state_dict())
    row_linears_(model)
    assert [type(m) for m in model] == [RowLinear, FusedLinear, RowLinear]
    assert row_linears_(model) is model and type(model[0]) is RowLinear  # idempotent
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    x = torch.randn(2, 8)
    assert torch.equal(model[0](x), F.linear(x, model[0].weight, model[0].bias))


def test_loaded_targets_use_row_linears():
    model, _ = load_target("tiny-dense", torch.device("cpu"), torch.float32)
    assert type(model.lm_head) is RowLinear
    assert not [m for m in model.modules() if type(m) is nn.Linear]


@pytest.mark.skipif(DEVICE != "cuda", reason="the autotuner times configurations on a GPU")
def test_tuned_gemv_on_the_gpu():
    x, w = _r(1, 5120, dtype=torch.bfloat16), _r(3000, 5120, dtype=torch.bfloat16, seed=1)
    got = gemv.gemv(x, w)
    assert _rel(got, F.linear(x.float(), w.float())) < 1e-2 and torch.equal(gemv.gemv(x, w), got)
