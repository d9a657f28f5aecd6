"""Single-row projections (an AR decode step) as one Triton GEMV per weight, in half precision.

An AR step multiplies one row by every weight matrix of the model: the step is a stream over the
weights, and its speed is how close each product reads at the memory's bandwidth. cuBLAS answers
one-row products with GEMM kernels, several of them split over K with a second, reducing launch.
Here each program reads ``BLOCK_N`` whole weight rows in ``BLOCK_K``-wide tiles (coalesced along
K), accumulates in float32 and rounds once; one launch per product, no split. The launch
configuration is tuned per (N, K) on the GPU at the first call (``triton.autotune``); each output's
sum order depends only on the configuration, so a process's AR steps are deterministic.

Only bfloat16/float16 weights take this path: float32 stays on cuBLAS, so the float32 exactness
of speculative decoding against AR (which the tests check on the GPU) is untouched. Tree verifies
(many rows) stay on cuBLAS GEMMs in every dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.models import fused

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - installs without Triton use F.linear
    triton = None

HALF = (torch.bfloat16, torch.float16)
# (BLOCK_N, BLOCK_K, num_warps): what the autotuner chooses from at each (N, K)
CONFIGS = [(8, 512, 4), (16, 256, 4), (16, 512, 4), (32, 256, 4), (32, 256, 8), (64, 128, 4), (64, 256, 8)]
_on = True  # set_gemv: benchmarks time the step without it


def set_gemv(enabled: bool) -> bool:
    """Turn the GEMV path on or off for this process (under ``fused.kernels_enabled``); returns the
    previous setting."""
    global _on
    previous, _on = _on, bool(enabled)
    return previous


def gemv_enabled() -> bool:
    """Whether one-row half-precision CUDA products take the GEMV kernel in this process."""
    return _on and triton is not None and fused.kernels_enabled()


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``; one row of a half-precision CUDA tensor takes the GEMV kernel."""
    if (_on and triton is not None and x.dtype in HALF and weight.dtype == x.dtype and x.numel() == x.shape[-1]
            and fused.use_kernels(x, weight)):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None, config: tuple[int, int, int] | None = None
         ) -> Tensor:
    """One row ``x`` [..., K] (a single row in all) times ``weight`` [N, K] (+ ``bias`` [N]): [..., N].
    ``config`` (BLOCK_N, BLOCK_K, num_warps) fixes the launch (the tests); None tunes it per shape."""
    n, k = weight.shape
    if x.numel() != k or x.shape[-1] != k:
        raise ValueError(f"gemv takes one row of {k} values, got x of shape {tuple(x.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("gemv needs the weight's rows contiguous (stride 1 along K)")
    x1 = x.reshape(k).contiguous()
    y = torch.empty(n, device=x.device, dtype=x.dtype)
    b = bias if bias is not None else y  # not read without HAS_BIAS
    if config is None:
        _gemv_tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
            x1, weight, b, y, n, k, weight.stride(0), HAS_BIAS=bias is not None)
    else:
        block_n, block_k, warps = config
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            x1, weight, b, y, n, k, weight.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n,
            BLOCK_K=block_k, num_warps=warps)
    return y.reshape(*x.shape[:-1], n)


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_n, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = rn < N
        # A 2-D float32 accumulator, reduced once at the end: one tree reduction per output instead
        # of one per tile, and the tiles' loads do not wait on a reduction.
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            mk = rk < K
            xv = tl.load(x_ptr + rk, mask=mk, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + rn[:, None] * stride_n + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
            acc += w.to(tl.float32) * xv[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=mn, other=0.0).to(tl.float32)
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=mn)

    _gemv_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w) for bn, bk, w in CONFIGS],
        key=["N", "K"],
    )(_gemv_kernel)
