"""Acceptance length of a draft per workload: AR, chain and DDTree on eval prompts, greedy.

    python benchmarks/eval_draft.py --target smollm2-135m-instruct --draft smollm2-135m-dflash \
        --sets humaneval chat agent --n-prompts 20 --max-new-tokens 128

Prints a table and a `key: value` summary; --out writes every number as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import engine
from engine import EngineConfig
from engine.data.workloads import load_workload


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--sets", nargs="+", default=["humaneval", "chat", "agent"])
    ap.add_argument("--n-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=22)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1, help="timed passes per config (AL does not change)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    pair = engine.load(args.target, args.draft, device=args.device, dtype=args.dtype)
    configs = {
        "ar": EngineConfig(verify="ar"),
        "chain": EngineConfig(verify="chain"),
        f"ddtree_b{args.budget}": EngineConfig(verify="ddtree", budget=args.budget, top_k=args.top_k),
    }
    rows, report = [], {"target": args.target, "draft": args.draft, "device": pair.device, "dtype": pair.dtype,
                        "gpu": torch.cuda.get_device_name() if pair.device.startswith("cuda") else platform.processor(),
                        "date": time.strftime("%Y-%m-%d"), "command": "python " + " ".join(sys.argv), "sets": {}}
    for spec in args.sets:
        wl = load_workload(spec, Path.cwd(), args.n_prompts, args.seed, split="eval")
        prompts = [pair.encode(p) for p in wl.prompts]
        engine.bench(pair, configs["ar"], prompts[:2], 8)  # warm-up (allocator, kernels)
        entry = {"workload_hash": wl.hash, "n_prompts": len(prompts)}
        reference = None
        for name, cfg in configs.items():
            runs = [engine.bench(pair, cfg, prompts, args.max_new_tokens, reference=reference)
                    for _ in range(args.repeats)]
            res = runs[-1]
            if name == "ar":
                reference = res.outputs
            tps = [r.decode_tps for r in runs]
            entry[name] = {"acceptance_length": res.acceptance_length, "decode_tps_median": statistics.median(tps),
                           "decode_tps_runs": tps, "exact_match": res.exact_match, "steps": res.steps,
                           "step_ms": res.step_ms, "phase_ms_per_step": res.phase_ms_per_step,
                           "al_histogram": res.al_histogram, "new_tokens": res.new_tokens}
        report["sets"][wl.name] = entry
        ar_tps = entry["ar"]["decode_tps_median"]
        for name in configs:
            e = entry[name]
            rows.append((wl.name, name, e["acceptance_length"], e["decode_tps_median"],
                         e["decode_tps_median"] / ar_tps if ar_tps else 0.0, e["exact_match"]))
            print(f"progress: {wl.name} {name} AL {e['acceptance_length']:.2f}", flush=True)
        if args.out:  # keep what is measured so far
            Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"{'set':<16}{'config':<14}{'AL':>7}{'tok/s':>10}{'vs AR':>8}{'exact':>8}")
    for s, name, al, tps, sp, ex in rows:
        print(f"{s:<16}{name:<14}{al:>7.2f}{tps:>10.1f}{sp:>8.2f}{'' if ex is None else f'{ex:.2f}':>8}")
    for s, entry in report["sets"].items():
        for name in configs:
            print(f"al_{s}_{name}: {entry[name]['acceptance_length']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
