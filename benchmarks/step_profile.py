"""``gpu_bench.py profile`` and ``graphs``: where a decode step's time goes (the kernels of whole steps
under the PyTorch profiler; each captured step graph replayed alone)."""

from __future__ import annotations

import gc
from pathlib import Path

import torch
from bench_common import env_record, large_pair, set_prompts
from kernel_timing import graph_breakdown

import engine
from engine import EngineConfig


def profile_steps(pair, cfg: EngineConfig, prompt: list[int], new_tokens: int, trace: Path | None,
                   name: str) -> tuple[list[str], dict]:
    """Kernels of one generation after a warm-up one (graphs captured), grouped by name, and the decode's wall a step
    of one generation between them, not profiled (the loop's own step: its steps launched ahead, beside a step graph
    replayed alone, ``section_graphs``)."""
    from torch.profiler import ProfilerActivity, profile

    engine.generate(pair, prompt, cfg, new_tokens, ignore_eos=True)  # warm-up: captures, allocations
    plain = engine.generate(pair, prompt, cfg, new_tokens, ignore_eos=True)
    plain_ms = 1000 * plain.stats.decode_s / max(plain.stats.steps, 1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        gen = engine.generate(pair, prompt, cfg, new_tokens, ignore_eos=True)
    if trace is not None:
        trace.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace / f"{name}.json"))
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        dev_us = ev.device_time  # microseconds on the device (0 for host events)
        if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA and dev_us:
            kernels.setdefault(ev.name, []).append(dev_us)
    steps = max(gen.stats.steps, 1)
    total_us = sum(sum(v) for v in kernels.values())
    wall_ms = 1000 * gen.stats.decode_s / steps
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:15]
    lines = [f"**{name}**: {steps} steps, wall {plain_ms:.3f} ms/step (not profiled), {wall_ms:.2f} profiled, "
             f"kernels {total_us / 1000 / steps:.2f} ms/step ({sum(len(v) for v in kernels.values()) / steps:.0f} "
             "launches/step; includes the prefill)", "",
             "| kernel | calls/step | us/step | share |", "|---|---|---|---|"]
    for kname, times in top:
        lines.append(f"| `{kname[:90]}` | {len(times) / steps:.1f} | {sum(times) / steps:.1f} | "
                     f"{100 * sum(times) / max(total_us, 1e-9):.1f}% |")
    rep = {"steps": steps, "wall_ms_per_step": wall_ms, "plain_wall_ms_per_step": plain_ms,
           "kernel_ms_per_step": total_us / 1000 / steps,
           "launches_per_step": sum(len(v) for v in kernels.values()) / steps,
           "top": {k: [len(v), sum(v)] for k, v in top}}
    return lines, rep


def _targets(args) -> list[tuple[str, str, str, bool]]:
    """(target, draft, weights held, whether it is a shape preset: random weights, a range of token ids
    for a prompt) of each pair to time: ``--presets`` as ``large`` pairs them (``--weights``), else
    ``--target``/``--draft`` as given (``--weights native``: a GGUF target's projections in their blocks)."""
    if args.presets_given:
        return [(*large_pair(t, args.weights, getattr(args, "draft_recipe", None)), t.endswith("-shape"))
                for t in args.presets]
    weights = "native" if args.weights == "native" else "dequantized"
    return [(args.target, args.draft, weights, args.target.endswith("-shape"))]


def _shown(target: str, weights: str, args) -> str:
    """A target's name in the tables: a GGUF target held native (``--weights native``) says so."""
    return f"{target}-native" if weights == "native" and not args.presets_given else target


def section_profile(args) -> tuple[str, dict]:
    lines: list[str] = []
    report: dict = {"env": env_record(), "runs": {}}
    trace = Path(args.trace) if args.trace else None
    for target, draft, weights, shape in _targets(args):
        pair = engine.load(target, draft, device="cuda", dtype=args.dtype, weights=weights)
        target = _shown(target, weights, args)
        if shape:
            prompts = [list(range(10, 10 + args.context))]
        else:
            prompts = set_prompts(pair, args.sets[0], 1)
        for label, cfg in (("ar", EngineConfig(verify="ar")),
                           (f"ddtree-b{args.budget}", EngineConfig(verify="ddtree", budget=args.budget,
                                                                   top_k=args.top_k)),
                           ("ar-generic", EngineConfig(verify="ar", draft_path="generic"))):
            name = f"{target}-{label}"
            part, rep = profile_steps(pair, cfg, prompts[0], args.new_tokens, trace, name)
            lines.extend(part + [""])
            report["runs"][name] = rep
            print("\n".join(part), flush=True)
        del pair
        gc.collect()
        torch.cuda.empty_cache()
    return "\n".join(lines), report


def section_graphs(args) -> tuple[str, dict]:
    """Each captured step graph alone (AR; DDTree's propose and verify): wall time, kernel count and
    kernel time, the gap between them being launch latency and idle SMs between dependent kernels."""
    from engine.decoding.runtime import decoder_for

    lines = ["| target | config | graph | wall us (launch hidden) | wall us (idle GPU) | kernels | kernel us (sum) "
             "| first-to-last us | gaps (wall - kernel us) | us per kernel |", "|" + "---|" * 10]
    report: dict = {"env": env_record(), "runs": {}}
    for target, draft, weights, shape in _targets(args):
        pair = engine.load(target, draft, device="cuda", dtype=args.dtype, weights=weights)
        prompt = list(range(10, 10 + args.context)) if shape else set_prompts(pair, args.sets[0], 1)[0]
        target = _shown(target, weights, args)
        for budget in args.budgets:
            configs = [("ar", EngineConfig(verify="ar")),
                       (f"ddtree-b{budget}", EngineConfig(verify="ddtree", budget=budget, top_k=args.top_k))]
            for label, cfg in configs:
                if label == "ar" and budget != args.budgets[0]:
                    continue
                engine.generate(pair, prompt, cfg, args.new_tokens, ignore_eos=True)
                dec = decoder_for(pair, pair._workspace, graphs=True)
                for key in dec.graphs.keys():
                    if key[-1] != cfg.kernels or (key[0] == "ar") != (label == "ar"):
                        continue
                    rep = graph_breakdown(dec, key, args.repeats)
                    name = f"{target}/{label}/{key[0]}@{key[1]}"
                    report["runs"][name] = rep
                    lines.append(f"| {target} | {label} | {key[0]} (keys {key[1]}) | {rep['wall_us']:.1f} | "
                                 f"{rep['cold_us']:.1f} | {rep['kernels']} | {rep['kernel_us']:.1f} | "
                                 f"{rep['span_us']:.1f} | "
                                 f"{rep['wall_us'] - rep['kernel_us']:.1f} | "
                                 f"{rep['wall_us'] / max(rep['kernels'], 1):.2f} |")
                    print(lines[-1], flush=True)
                dec.graphs.clear()
        for name, rep in report["runs"].items():
            if not name.startswith(f"{target}/"):
                continue
            lines += ["", f"**{name}**: kernels by name (calls; GPU us per replay, which under programmatic dependent "
                      "launch count a launch's wait for the one before; end-to-end us, from the latest end before "
                      "each launch, adding to the span: `kernel_timing.end_to_end`)", "",
                      "| kernel | calls | GPU us | end-to-end us | share of the span |", "|---|---|---|---|---|"]
            for kname, n, us, share in rep["grouped"][:14]:
                lines.append(f"| `{kname}` | {n} | {us:.1f} | {share:.1f} | "
                             f"{100 * share / max(rep['span_us'], 1e-9):.0f}% |")
        del pair
        gc.collect()
        torch.cuda.empty_cache()
    return "\n".join(lines), report
