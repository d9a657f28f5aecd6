"""GPU time of one kernel launch, as the kernel benchmarks take it: launches captured in one CUDA graph
(no launch overhead between them), the graph replayed a few times, the median kept; and a decode
step's captured graph replayed alone, its kernels by name (``graph_breakdown``, gpu_bench's graphs)."""

from __future__ import annotations

import statistics

import torch

LAUNCHES = 48  # launches per graph: the 27B shape's 48 Gated DeltaNet layers


# Bytes written before each replay so that L2 (50 MB on an H100 / H200) holds none of what the launches read: a
# benchmark cycling a weight through copies (quant_bench._rotating) promises reads from HBM, which held only for
# weights over ~1 MB while the replays were back to back (48 copies of SmolLM2's 0.35 MB qkv, 17 MB, stayed in L2:
# 3.3 us a launch in the bench, 4.7 in the model's step graph on an H200, 2026-12-07)
FLUSH_BYTES = 256 << 20
_flush: list[torch.Tensor] = []


def flush_l2() -> None:
    """Write ``FLUSH_BYTES`` on the current GPU (L2 then holds those lines, not a benchmark's data)."""
    if not _flush:
        _flush.append(torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda"))
    _flush[0].zero_()


def time_us(fn, reps: int = 5) -> float:
    """GPU microseconds per call: LAUNCHES calls captured in one graph, replayed ``reps`` times, L2 flushed before
    each replay (``flush_l2``: only what the launches themselves read again is an L2 hit)."""
    fn()  # compile, warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAUNCHES):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush_l2()
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(1000.0 * a.elapsed_time(b) / LAUNCHES)
    return statistics.median(times)


def short_kernel_name(kernel: str) -> str:
    """A kernel's name without its argument list and namespaces (cuBLAS and ATen names run to 500
    characters); template arguments stay (an elementwise kernel is named by its functor)."""
    name = kernel.replace("(anonymous namespace)::", "").replace("at::native::", "").replace("void ", "")
    depth = 0
    for i, ch in enumerate(name):
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0:
            name = name[:i]
            break
    return name.replace("c10::", "").replace("std::", "").strip()[:110]


def graph_kernels(replay) -> list:
    """The kernels of one ``replay()`` under the PyTorch profiler, in launch order (the profiler's events; copies
    and memsets left out: a replay's own state put back)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    return sorted((ev for ev in prof.events()
                   if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA and ev.device_time
                   and "Memcpy" not in ev.name and "Memset" not in ev.name),
                  key=lambda ev: ev.time_range.start)


@torch.inference_mode()  # the decoder's buffers are inference tensors
def graph_breakdown(dec, key: tuple, replays: int) -> dict:
    """One captured graph replayed alone: wall (CUDA events around ``replays`` replays) and its
    kernels in launch order from the profiler (the first replay's), grouped by name; ``order``: [name, GPU us,
    end-to-end us (``end_to_end``)] a launch. The root
    position is put back before every replay, so each replays the same step."""
    graph = dec.graphs.graph(key)
    start = dec.start.clone()

    def replay() -> None:
        dec.start.copy_(start)
        graph.replay()

    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    walls, cold = [], []
    for i in range(2 * replays):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if i % 2:  # the GPU kept busy while the graph is launched: its own time, launch hidden
            torch.cuda._sleep(1_000_000)
        e0.record()
        graph.replay()  # the copy of the root position is left out of the time
        e1.record()
        e1.synchronize()
        (walls if i % 2 else cold).append(1000 * e0.elapsed_time(e1))
        dec.start.copy_(start)
    kernels = graph_kernels(replay)
    ends = end_to_end(kernels)
    span = sum(ends)  # the latest end less the first start
    grouped: dict[str, list[list[float]]] = {}
    for ev, share in zip(kernels, ends, strict=True):
        grouped.setdefault(short_kernel_name(ev.name), []).append([ev.device_time, share])
    return {"wall_us": statistics.median(walls), "wall_spread": [min(walls), max(walls)],
            "cold_us": statistics.median(cold),
            "kernels": len(kernels), "kernel_us": sum(ev.device_time for ev in kernels), "span_us": span,
            # by name: calls, GPU us, end-to-end us (the span's share), the largest share first
            "grouped": sorted(((k, len(v), sum(t for t, _ in v), sum(e for _, e in v)) for k, v in grouped.items()),
                              key=lambda r: -r[3]),
            "order": [(short_kernel_name(ev.name), round(ev.device_time, 2), round(share, 2))
                      for ev, share in zip(kernels, ends, strict=True)]}


def end_to_end(kernels: list) -> list[float]:
    """Each kernel's share of a replay's span: from the latest end of the kernels before it (the first: from its own
    start) to its own end, us (0 for one that ends inside what ran before). Under programmatic dependent launch a
    kernel's programs start while the kernel before runs and wait for it, so its GPU time counts that wait too and the
    launches' times can add to more than the span; these shares add to the span (2026-12-07, twentieth session: at 8
    programs an SM an attention layer's second product took 26 -> 14 us of GPU time, after a launch that had
    slowed)."""
    out, last = [], None
    for ev in kernels:
        end = ev.time_range.end
        out.append(end - ev.time_range.start if last is None else max(0.0, end - last))
        last = end if last is None else max(last, end)  # (one that ends inside the span so far: 0)
    return out


def precompile(launch, args: list, workers: int = 0) -> float:
    """Compile Triton kernels ahead of timing them, in ``workers`` processes at once (0: the CPUs less two, at
    most 16): ``launch(arg)`` for each of ``args`` run once in a pool of fresh interpreters (spawned, each with
    its own CUDA context), so Triton's disk cache holds every variant before the timing loop asks for it
    (a tile sweep is otherwise one compile, ~1-3 s, a launch after the other). ``launch`` must be picklable (a
    module-level function, or a ``functools.partial`` of one) and build its own inputs; a launch that fails
    (a tile past the shared memory) is left for the timing loop to report. Returns the wall seconds taken."""
    import concurrent.futures
    import multiprocessing
    import os
    import time

    t0 = time.perf_counter()
    workers = workers or max(1, min(16, (os.cpu_count() or 4) - 2))
    chunks = [args[i::workers] for i in range(workers) if args[i::workers]]
    if chunks:
        spawn = multiprocessing.get_context("spawn")
        try:
            with concurrent.futures.ProcessPoolExecutor(len(chunks), mp_context=spawn) as pool:
                list(pool.map(_run_each, [launch] * len(chunks), chunks))
        except Exception as exc:  # noqa: BLE001 - a worker lost (a CUDA fault): the timing loop compiles the rest
            print(f"precompile: {type(exc).__name__}: {str(exc)[:200]} (what is left compiles as it is timed)",
                  flush=True)
    return time.perf_counter() - t0


def _run_each(launch, args: list) -> None:
    for arg in args:
        try:
            launch(arg)
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - the timing loop meets it again and says what it was
            pass
