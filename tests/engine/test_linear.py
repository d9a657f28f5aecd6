"""The few-row linear kernel (Triton, interpreted on the CPU) against a float64 product, its
split-K ticket protocol, and the dispatch between it and cuBLAS."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models import fused
from engine.models import linear as lin
from engine.models.common import Linear

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 / fp16 outputs: one rounding of a float32 sum (the interpreter truncates bf16: a few ulps)
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _r(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k", "rows", "split"), [
    (192, 256, 1, 1),  # a step, whole K
    (100, 300, 5, 3),  # ragged N and K: masked tiles, a last part shorter than the others
    (64, 1024, 33, 4),  # a verify's rows (BLOCK_M 64), four parts
    (80, 512, 16, 8),  # as many parts as K blocks
])
def test_kernel_matches_the_product(dtype, n, k, rows, split):
    w, x = 0.05 * _r(n, k, dtype=dtype, seed=n), _r(rows, k, dtype=dtype, seed=k)
    bias = _r(n, dtype=dtype, seed=3)
    cfg = lin.LinearConfig(64, 64, split)
    ref = x.double() @ w.double().T
    got = lin._kernel_linear(x, w, None, cfg)
    assert got.dtype == dtype and got.shape == (rows, n) and not got.isnan().any()
    assert _rel(got, ref) < TOL[dtype]
    assert _rel(lin._kernel_linear(x, w, bias, cfg), ref + bias.double()) < TOL[dtype]
    # Every part's ticket was taken and the tile's reset for the next launch.
    if split > 1:
        assert not lin._tickets(x.device, 1).any()


@pytest.mark.skipif(DEVICE == "cuda", reason="the reference parts are float32 products: tf32 on a GPU")
def test_parts_add_in_order():
    """The result is the parts' float32 sums added in order 0..split-1, then rounded: the same bits
    as single-part launches added that way. (The interpreter runs the parts in grid order, so the last
    one takes the last ticket here; on a GPU any part may, and the order of the sum is the same.)"""
    n, k, split = 64, 512, 4
    w, x = 0.05 * _r(n, k, dtype=torch.float16, seed=1), _r(1, k, dtype=torch.float16, seed=2)
    got = lin._kernel_linear(x, w, None, lin.LinearConfig(64, 64, split))
    parts = torch.zeros(1, n, dtype=torch.float32, device=DEVICE)
    for p in range(split):
        lo, hi = p * k // split, (p + 1) * k // split
        # a part alone, summed in float32 by the same kernel (one part: no ticket)
        parts += _float32_product(x[:, lo:hi], w[:, lo:hi])
    assert torch.equal(got, parts.to(torch.float16))


def _float32_product(x, w):
    return lin._kernel_linear(x.float(), w.float(), None, lin.LinearConfig(64, 64, 1))


def test_strided_rows_and_leading_dims():
    w = 0.05 * _r(96, 128, dtype=torch.bfloat16, seed=5)
    x = _r(2, 3, 256, dtype=torch.bfloat16, seed=6)[..., ::2]  # a strided view: rows copied contiguous
    cfg = lin.LinearConfig(32, 64, 2)
    got = lin._kernel_linear(x, w, None, cfg)
    assert got.shape == (2, 3, 96)
    assert _rel(got, x.double() @ w.double().T) < TOL[torch.bfloat16]


def test_config_is_validated():
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        lin.LinearConfig(48, 64)
    with pytest.raises(ValueError, match="num_warps 4 or 8"):
        lin.LinearConfig(64, 64, 1, 2)
    with pytest.raises(ValueError, match="split >= 1"):
        lin.LinearConfig(64, 64, 0)


def test_dispatch_takes_cublas_where_nothing_is_tuned():
    """CPU tensors, float32, gradients, untuned shapes and row counts past MAX_ROWS take F.linear,
    and ``Linear`` is an ``nn.Linear`` with the same parameters and result."""
    layer = Linear(64, 32)
    x = torch.randn(3, 64)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert not lin.use_kernel(x, layer.weight)  # float32 on the CPU
    assert set(layer.state_dict()) == {"weight", "bias"}
    if DEVICE == "cuda":
        w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        assert lin.launch_config(torch.randn(129, 4096, device="cuda", dtype=torch.bfloat16), w) is None
        assert lin.launch_config(torch.randn(1, 4096, device="cuda"), w[:100]) is None  # untuned shape


@pytest.mark.skipif(DEVICE != "cuda", reason="the tuned launches are for GPUs")
def test_tuned_shapes_on_the_gpu_match_cublas_and_round_alike_across_rows():
    """A tuned weight (the 8B shape's qkv: a step and a verify launch) through the engine's dispatch:
    close to cuBLAS, and a row's bits the same however many rows share its launch class (1 and 16
    rows: a step; 17, 33 and 65 rows: a verify, BLOCK_M 32, 64 and 128)."""
    previous = fused.set_kernels(True)
    try:
        _check_tuned_qkv()
    finally:
        fused.set_kernels(previous)


def _check_tuned_qkv():
    cap = torch.cuda.get_device_capability()
    if set(lin.TUNED.get(cap, {}).get((6144, 4096), {})) != {"step", "verify"}:
        pytest.skip(f"no tuned step and verify launches for compute capability {cap}")
    w = 0.02 * torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(65, 4096, device="cuda", dtype=torch.bfloat16)
    for rows in (1, 16, 17, 33, 65):
        assert lin.launch_config(x[:rows], w) is not None
    assert _rel(lin.linear(x, w), F.linear(x.float(), w.float())) < 1e-2
    step = lin.linear(x[:16], w)
    assert torch.equal(lin.linear(x[:1], w), step[:1])
    verify = lin.linear(x[:17], w)
    for rows in (33, 65):
        assert torch.equal(lin.linear(x[:rows], w)[:17], verify)
