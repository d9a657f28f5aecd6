"""Top-k of the log-softmax and argmax (Triton, interpreted on the CPU) against torch's."""

from __future__ import annotations

import pytest
import torch

from engine.models import topk
from tests.engine.models.test_fused import DEVICE, _r, kernels_on  # noqa: F401  (kernels_on: autouse)

pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v,k,temp", [(5000, 8, 1.0), (4096, 16, 0.7), (300, 1, 1.0), (2049, 3, 1.5)])
def test_topk_rows_are_the_top_k_of_the_log_softmax(dtype, v, k, temp):
    """Two launches give torch's top-k of the log-softmax: the same indices, sorted, exact ties to
    the lower index (a row with repeated values and -inf entries included), values to rounding."""
    x = (4 * _r(6, v, seed=3)).to(dtype)
    x[1, :] = x[1, 0]  # a row of one value: its first k indices
    x[2, 100:] = float("-inf")  # most of a row masked
    x[3, 7], x[3, v - 1] = 50.0, 50.0  # a tie for the top at the two ends (different slices)
    lp, ids = topk.topk_rows(x, k, temp)
    want_lp, _ = topk.topk_rows_torch(x, k, temp)
    assert lp.dtype == torch.float32 and ids.dtype == torch.long and lp.shape == ids.shape == (6, k)
    assert torch.all(lp[:, :-1] >= lp[:, 1:])
    assert ids[1].tolist() == list(range(k))
    assert ids[3, :2].tolist() == [7, v - 1][:k]
    # a stable descending sort orders ties by index: its first k are the kernel's, row by row
    stable = torch.sort(x.float() / temp, dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(ids, stable)
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)
    values, plain_ids = topk.topk_rows(x, k, temp, log_probs=False)
    assert torch.equal(plain_ids, ids) and torch.equal(values, torch.gather(x.float() / temp, 1, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torch_argmax(dtype):
    x = _r(9, 49152, dtype=dtype, seed=4)
    x[2] = 0.0  # all tied: the first index
    x[5, 3], x[5, 40000] = 99.0, 99.0
    x[6, :] = float("-inf")
    got = topk.argmax_rows(x)
    assert got.dtype == torch.long and torch.equal(got, torch.argmax(x, dim=-1))
