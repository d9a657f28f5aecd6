"""Per-step cost of the grammar placements (walk vs commit) on agent traffic.

Every config runs the same agent prompts (BFCL tools, each prompt with its tool-call grammar);
repeats are interleaved (config A, B, C, A, B, C, ...) so machine drift hits all alike. Reported
per config: step ms, the walk and commit phases per step, grammar host time per step, AL and
decode tok/s, as medians over repeats with the min-max spread; exactness against constrained AR.

Run: python benchmarks/grammar_bench.py --n-prompts 4 --max-new-tokens 64 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import engine
from engine import EngineConfig
from engine.data.workloads import load_workload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-dflash")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--workload", default="agent", help="agent, or a JSONL of agent prompts (with tools)")
    ap.add_argument("--n-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=22)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--configs", default="ar-constrained,ddtree-off,ddtree-walk,ddtree-commit,chain-walk,chain-commit",
                    help="comma-separated subset of the configs below (ar-constrained is always the reference)")
    args = ap.parse_args()

    pair = engine.load(args.target, args.draft, device=args.device, dtype=args.dtype)
    wl = load_workload(args.workload, Path("."), args.n_prompts, 0)
    prompts = [pair.encode(p) for p in wl.prompts]
    grammars = [pair.grammar_for(getattr(p, "tools", None)) for p in prompts]  # compiled outside timing
    tree = dict(budget=args.budget, top_k=args.top_k)
    configs = {
        "ar-constrained": EngineConfig(verify="ar", grammar="commit"),
        "ddtree-off": EngineConfig(verify="ddtree", grammar="off", **tree),
        "ddtree-walk": EngineConfig(verify="ddtree", grammar="walk", **tree),
        "ddtree-commit": EngineConfig(verify="ddtree", grammar="commit", **tree),
        "chain-walk": EngineConfig(verify="chain", grammar="walk"),
        "chain-commit": EngineConfig(verify="chain", grammar="commit"),
        # The default draft path is `runtime`: AR and `commit` run its (graph-captured) steps, `walk`
        # cannot (its masks sit between the verify forward and the commit) and runs the generic
        # loop. These pin the generic loop, to compare the placements on the same loop too.
        "ar-constrained-generic": EngineConfig(verify="ar", grammar="commit", draft_path="generic"),
        "ddtree-commit-generic": EngineConfig(verify="ddtree", grammar="commit", draft_path="generic", **tree),
    }
    configs = {k: v for k, v in configs.items() if k in args.configs.split(",")}
    constrained_ar = EngineConfig(verify="ar", grammar="commit")
    ref = engine.bench(pair, constrained_ar, prompts, args.max_new_tokens, grammars=grammars).outputs
    for cfg in configs.values():  # warm-up
        engine.bench(pair, cfg, prompts[:1], 8, grammars=grammars[:1])
    runs: dict[str, list] = {k: [] for k in configs}
    for _ in range(args.repeats):
        for name, cfg in configs.items():
            runs[name].append(engine.bench(pair, cfg, prompts, args.max_new_tokens, reference=ref, grammars=grammars))

    def stat(xs: list[float]) -> str:
        return f"{statistics.median(xs):7.2f} [{min(xs):.2f}-{max(xs):.2f}]"

    print(f"target: {args.target}  draft: {args.draft}  device: {args.device}  prompts: {len(prompts)} "
          f"(constrained {sum(g is not None for g in grammars)})  max_new_tokens: {args.max_new_tokens}  "
          f"repeats: {args.repeats}  budget/top_k: {args.budget}/{args.top_k}")
    print(f"{'config':15s} {'step_ms':>20s} {'walk_ms/step':>20s} {'commit_ms/step':>20s} "
          f"{'grammar_ms/step':>20s} {'AL':>5s} {'decode_tps':>20s} exact  loop")
    for name, rs in runs.items():
        ph = [r.phase_ms_per_step for r in rs]
        print(f"{name:15s} {stat([r.step_ms for r in rs]):>20s} {stat([p['walk'] for p in ph]):>20s} "
              f"{stat([p['commit'] for p in ph]):>20s} {stat([r.grammar_ms_per_step for r in rs]):>20s} "
              f"{rs[0].acceptance_length:5.2f} {stat([r.decode_tps for r in rs]):>20s} "
              f"{min(r.exact_match for r in rs):.2f}   {','.join(sorted(rs[0].loops))}")


if __name__ == "__main__":
    main()
