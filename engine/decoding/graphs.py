"""Captured CUDA graphs and the step's readback: what the runtime (``engine.decoding.runtime``) replays
and reads, apart from what it computes.

``Graphs`` captures a step function once per key (kind, key span, ...) and replays it after;
``Readback`` copies a step's small packed result to pinned host memory behind the work launched
after it, so the host reads one step while the device runs the next.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def clear_blas_workspaces() -> None:
    """Give back the cuBLAS workspaces PyTorch keeps for every (handle, stream) a matrix product ran on
    (32 MiB each on Hopper), which neither ``empty_cache`` nor a graph's end frees: without this, the
    workspace of each stream a warm-up or capture used stayed allocated, and a sweep's measured peaks
    grew by ~170 MiB a config (2026-12-07). A no-op off CUDA builds."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_initialized():
        clear()


class Graphs:
    """Captured step functions keyed by bucket; ``graphs=False`` calls them eagerly instead."""

    def __init__(self, enabled: bool, state: list[Tensor]) -> None:
        self.enabled = enabled
        self.state = state  # tensors a warm-up run mutates: restored before capture
        self._captured: dict[object, tuple[torch.cuda.CUDAGraph, object]] = {}
        self._pool = torch.cuda.graph_pool_handle() if enabled else None
        self._side = None  # the warm-ups' stream, one for every capture (each stream has its own workspace)

    def clear(self) -> None:
        """Forget every capture (the buffers they read were replaced), and their memory pool: once
        its last graph is gone PyTorch retires a private pool, and capturing into it again while a
        tensor it allocated is still alive trips the allocator's assertion (the 27B shape's DDTree
        after its chain, 2026-12-04); the next capture takes a fresh pool."""
        self._captured.clear()
        if self.enabled:
            self._pool = torch.cuda.graph_pool_handle()

    def keys(self) -> list[tuple]:
        """The keys captured so far, in capture order (``run``'s keys)."""
        return list(self._captured)

    def graph(self, key: tuple) -> torch.cuda.CUDAGraph:
        """The graph captured for ``key`` (replayed alone by ``benchmarks/gpu_bench.py graphs``)."""
        return self._captured[key][0]

    def _abandon(self) -> None:
        """After a failed capture: PyTorch leaves the caching allocator recording into the pool (every
        later capture into it raised "beginAllocateToPool: already recording to mempool_id": three
        trials of the 2026-12-04 sweep after one bad one), and the failed graph never gives back its
        hold on the pool (its reset releases only a finished capture's), so the pool's memory would
        stay reserved for the process. End that recording and release that hold where this PyTorch
        can, and forget the pool: the next capture takes a fresh one."""
        device = torch.cuda.current_device()
        end = getattr(torch._C, "_cuda_endAllocateToPool", None)
        release = getattr(torch._C, "_cuda_releasePool", None)
        if end is not None:
            try:
                end(device, self._pool)
            except RuntimeError:
                release = None  # the capture's own end had stopped it, and holds nothing more
        if release is not None:
            try:
                release(device, self._pool)
            except RuntimeError:
                pass
        self.clear()

    def run(self, key: tuple, fn: Callable[..., object], *args: object) -> object:
        """``fn(*args)``: captured on the first call with ``key``, replayed after (``args`` must be
        the same static buffers and constants at every call with that key). Every key starts
        ``(kind, key span, ...)``, kind one of "ar", "propose", "verify"; the AR key goes on with
        whether a grammar mask is applied, then whether margins are recorded."""
        if not self.enabled:
            return fn(*args)
        if key not in self._captured:
            saved = [t.clone() for t in self.state]
            if self._side is None:
                self._side = torch.cuda.Stream()
            side = self._side
            side.wait_stream(torch.cuda.current_stream())
            # the eager stream's workspace (the prefill's) given back first, so that the warm-up's does not
            # stand beside it in the peak
            clear_blas_workspaces()
            with torch.cuda.stream(side):  # warm-up outside capture: lazy kernel and workspace init
                fn(*args)
            torch.cuda.current_stream().wait_stream(side)
            for t, s in zip(self.state, saved, strict=True):
                t.copy_(s)
            graph = torch.cuda.CUDAGraph()
            # a capture must take its cuBLAS workspace inside its pool (one made before, outside it, could be
            # given back while the graph still writes it), and nothing after may keep that one: so the workspaces
            # are cleared before and after, as PyTorch's own graph trees do. Given back, the capture's workspace
            # is one more of its intermediates freed into the pool every capture here shares: a later capture
            # may place its tensors there, under the same rule as over the capture's other intermediates
            clear_blas_workspaces()
            try:
                # the outer stream context puts this thread's stream back if the capture fails: the
                # graph context enters its capture stream and, when capture_end raises, never leaves it
                with torch.cuda.stream(torch.cuda.current_stream()), torch.cuda.graph(graph, pool=self._pool):
                    out = fn(*args)
            except Exception as exc:
                clear_blas_workspaces()
                self._abandon()
                # PyTorch's error names the invalidated capture; the op that invalidated it is the first
                first = exc.__context__ if exc.__context__ is not None else exc
                raise RuntimeError(f"capturing the {key[0]!r} step as a CUDA graph failed: "
                                   f"{type(first).__name__}: {str(first).splitlines()[0] if str(first) else ''} "
                                   "(this process can capture again: the graph pool was replaced)") from exc
            clear_blas_workspaces()
            self._captured[key] = (graph, out)
        graph, out = self._captured[key]
        graph.replay()
        return out


class Readback:
    """A step's small result copied to the host behind the work launched after it: on CUDA into
    one of two pinned buffers (alternating: at most two steps are in flight) with an event to wait
    on; elsewhere a plain copy."""

    def __init__(self, device: torch.device, size: int) -> None:
        self.cuda = device.type == "cuda"
        self._buffers = [torch.empty(size, dtype=torch.long, pin_memory=self.cuda) for _ in range(2)]
        self._next = 0

    def push(self, values: Tensor) -> tuple[Tensor, object]:
        buf = self._buffers[self._next][: values.numel()]
        self._next ^= 1
        buf.copy_(values.view(-1), non_blocking=self.cuda)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        return buf, event

    @staticmethod
    def read(item: tuple[Tensor, object]) -> list[int]:
        buf, event = item
        if event is not None:
            event.synchronize()
        return buf.tolist()
