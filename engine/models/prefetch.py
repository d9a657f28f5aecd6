"""Weights streamed into L2 while a decode step runs its small kernels (an experiment, off by default).

A decode step of a large target alternates weight-streaming GEMMs with latency-bound launches
(norms, the delta rule, RoPE, attention) during which HBM sits idle: on the 27B shape those take
~1.8 of a 14.7 ms step. Inside a captured step, ``ahead(weight, mb)`` forks a side stream right
after a GEMM and reads the first ``mb`` MB of the *next* GEMM's weight (the leading columns of every
row: the part each of cuBLAS's tiles reads first) with an evict-last policy; the next GEMM then
finds that part in L2. The read is side-effect free, so nothing waits on it but the step's end
(``join``), which every captured forward calls.

``set_scale(s)`` (or ``ENGINE_L2_PREFETCH=s``) multiplies every call site's amount; 0 turns it off.
Eager forwards (not being captured) never prefetch.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from engine.config import EngineInputError

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def _scale_from_environment() -> tuple[float, str | None]:
    value = os.environ.get("ENGINE_L2_PREFETCH", "0").strip()
    try:
        scale = float(value)
    except ValueError:
        scale = -1.0
    if not scale >= 0:
        return 0.0, f"environment variable ENGINE_L2_PREFETCH must be a number >= 0, got {value!r}"
    return scale, None


_scale, _environment_error = _scale_from_environment()  # a bad value is refused at first use, not at import
_side: dict[int, torch.cuda.Stream] = {}
_forked: set[int] = set()
if _scale > 0 and torch.cuda.is_available():
    _side[torch.cuda.current_device()] = torch.cuda.Stream()


def set_scale(scale: float) -> float:
    """Multiply every prefetch amount by ``scale`` (0: off); returns the previous scale. Captures
    made before keep what they captured."""
    global _scale, _environment_error
    if not scale >= 0:
        raise ValueError(f"prefetch scale must be >= 0, got {scale}")
    previous, _scale, _environment_error = _scale, float(scale), None
    if _scale > 0 and torch.cuda.is_available():  # the side stream exists before any capture uses it
        dev = torch.cuda.current_device()
        _side.setdefault(dev, torch.cuda.Stream(device=dev))
    return previous


def ahead(weight: Tensor, mb: float) -> None:
    """During a CUDA graph capture: read the first ``mb`` (times the scale) MB of ``weight`` [N, K]
    (its leading columns, every row) on a side stream, leaving it in L2 for the GEMM that reads it next."""
    if _environment_error is not None:
        raise EngineInputError(_environment_error)
    if _scale <= 0 or triton is None or not weight.is_cuda or not torch.cuda.is_current_stream_capturing():
        return
    n, k = weight.shape
    cols = min(k, int(_scale * mb * 2**20 / (n * weight.element_size())))
    if cols < 64:
        return
    cols = 1 << (cols.bit_length() - 1)  # a power of two (the kernel's arange), at most the asked amount
    dev = weight.device.index
    side = _side.get(dev)
    if side is None:  # set_scale makes it (not inside a capture); ENGINE_L2_PREFETCH alone: see set_scale
        return
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    rows = max(1, 8192 // cols)
    with torch.cuda.stream(side):
        sink = torch.empty(1, device=weight.device, dtype=torch.float32)
        _prefetch_kernel[(triton.cdiv(n, rows),)](weight, sink, n, weight.stride(0), COLS=cols, ROWS=rows)
    _forked.add(dev)


def join() -> None:
    """The main stream waits for the side stream's reads (a capture must join every stream it forked)."""
    if not _forked:
        return
    main = torch.cuda.current_stream()
    dev = main.device.index
    if dev in _forked:
        main.wait_stream(_side[dev])
        _forked.discard(dev)


if triton is not None:

    @triton.jit
    def _prefetch_kernel(w_ptr, sink_ptr, N, stride, COLS: tl.constexpr, ROWS: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        c = tl.arange(0, COLS)
        x = tl.load(w_ptr + r[:, None] * stride + c[None, :], mask=(r < N)[:, None], other=0.0,
                    eviction_policy="evict_last")
        total = tl.sum(tl.sum(x.to(tl.float32), axis=1), axis=0)
        # stored only on an impossible sum: the loads stay (nothing else reads them)
        tl.store(sink_ptr, total, mask=total == 1.2345e-38)
