"""GPU time of one kernel launch, as the kernel benchmarks take it: launches captured in one CUDA graph
(no launch overhead between them), the graph replayed a few times, the median kept."""

from __future__ import annotations

import statistics

import torch

LAUNCHES = 48  # launches per graph: the 27B shape's 48 Gated DeltaNet layers


def time_us(fn, reps: int = 5) -> float:
    """GPU microseconds per call: LAUNCHES calls captured in one graph, replayed ``reps`` times."""
    fn()  # compile, warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAUNCHES):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(1000.0 * a.elapsed_time(b) / LAUNCHES)
    return statistics.median(times)
