"""Offline replay of the adaptive step policy (engine/decoding/policy.py) against fixed budgets and an oracle.

    python benchmarks/policy_sim.py --sets humaneval chat agent --n-prompts 12 --cache .sim/smollm2.json
    python benchmarks/policy_sim.py --draft random --sets humaneval --n-prompts 12 --cache .sim/random.json

Every policy commits the target's own tokens, so a generation's text is AR's whatever budgets its steps
take. The table (built once, cached as JSON): each prompt's AR text (greedy, stop tokens ignored), then at
every position p of it the draft's tree at the largest budget rooted there, as the engine builds it
(``DFlashDrafter.propose``, ``loop.scored_tree``, ``policy.path_probabilities``), and the nodes the target
accepts in it (``walk_host`` against the AR text: the target's pick after a node on the accepted path is
the next AR token). The tree of budget b is the first b nodes, so the step at p of budget b accepts the
path's nodes <= b (``accepted_within``). Any policy then replays exactly: at p choose b, advance by
accepted(b) + 1, charge ``--costs`` ms[b]. The real ``AdaptivePolicy`` replays through its choose/record
API, a step chosen ``--lag`` steps before the one before it is read (1: the runtime, which launches the
next step before reading the current one; 0: the generic loop); the oracle is the fastest sequence of
budgets in hindsight (a shortest path over positions), so it is >= every fixed budget.

Default costs (ms a step, the H200, bf16, SmolLM2 pair, RESULTS.md "2026-12-04, seventh session ... budget-0
step"): plain AR 0.941; the policy's AR step that plus its feature-row copy, 0.945; DDTree-48 1.29; the
probes (budget 6 for an unaccepted draft) 1.2-1.3, a tree step's cost nearly flat in the budget: b -> 1.21 +
b / 600, i.e. 6: 1.22, 12: 1.23, 24: 1.25, 48: 1.29 (the 6-24 entries interpolated, not measured).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import engine  # noqa: E402
from engine import EngineConfig  # noqa: E402
from engine.decoding import loop  # noqa: E402
from engine.decoding.policy import (  # noqa: E402
    AdaptivePolicy,
    StepCosts,
    accepted_within,
    path_probabilities,
    policy_budgets,
    root_row,
)
from engine.decoding.tree import walk_host  # noqa: E402

H200_COSTS = "0:0.945,6:1.22,12:1.23,24:1.25,48:1.29"
H200_AR_MS = 0.941


def positions(pair, cfg: EngineConfig, prompt: list[int], new_tokens: int) -> list[dict]:
    """One row per decode step's root position of the AR text after ``prompt`` (the prefill's token is
    the first root): the largest tree's node path probabilities (fixed point) and accepted node indices."""
    drafter, block = pair.drafter, pair.drafter.block_size
    # AR past the last root by a block: every tree rooted before it has its truth
    ar = engine.generate(pair, prompt, EngineConfig(verify="ar"), new_tokens + block, ignore_eos=True).tokens
    seq = torch.tensor(prompt + ar)
    target = pair.target
    with torch.inference_mode():
        _, feats = target(seq, target.new_cache(seq.numel() + 1), 0, feature_layers=drafter.feature_layers)
        drafter.reset()
        rows, n = [], len(prompt)
        for p in range(n, n + new_tokens - 1):  # the prefill committed the first token; steps the rest
            logits = drafter.propose(seq, p, block, cfg.target_feat_ctx, feats)
            tree, anc, top_lp = loop.scored_tree(cfg, logits, seq[p], loop.UNTIMED, block - 1, host=False)
            probs = path_probabilities(top_lp, tree, anc, root_row(top_lp.shape[1], seq.device))
            truth = seq[(p + tree.depths + 1).clamp(max=seq.numel() - 1)].tolist()
            path = walk_host(tree.tokens.tolist(), tree.parents.tolist(), truth)
            rows.append({"probs": probs[1:].tolist(), "path": path[1:]})
    return rows


def build(args) -> dict:
    pair = engine.load(args.target, args.draft, "cpu", "float32")
    cfg = EngineConfig(verify="ddtree", budget=args.budget, top_k=args.top_k)
    table = {"key": _key(args), "depth": pair.drafter.block_size - 1, "sets": {}}
    for spec in args.sets:
        wl = engine.load_workload(spec, Path.cwd(), args.n_prompts, 0, split="eval")
        rows = table["sets"][Path(spec).stem] = []
        for i, prompt in enumerate(wl.prompts):
            rows.append(positions(pair, cfg, pair.encode(prompt), args.max_new_tokens))
            print(f"built: {spec} {i + 1}/{len(wl.prompts)}", file=sys.stderr, flush=True)
    return table


def _key(args) -> dict:
    return {k: getattr(args, k) for k in ("target", "draft", "sets", "n_prompts", "max_new_tokens", "budget", "top_k")}


def accepted(row: dict, budget: int) -> int:
    return accepted_within(row["path"], [budget])[0] if budget > 0 else 0


def replay(rows: list[dict], choose, record, lag: int, preview=None) -> list[tuple[int, float, int]]:
    """(budget, the E[AL] it was chosen by, accepted nodes) per step over one prompt's rows; ``record(budget,
    row)`` is called ``lag`` steps after the step's ``choose`` (the runtime reads a step after launching the next);
    ``preview(row)`` before the first step's ``choose`` (``AdaptivePolicy.preview``: the generation's first
    proposal is the estimate its budget is chosen by)."""
    steps, unread, p = [], [], 0
    while p < len(rows):
        if preview is not None and not steps:
            preview(rows[p])
        b, expected = choose()
        a = accepted(rows[p], b)
        steps.append((b, expected, a))
        unread.append((b, rows[p]))
        if len(unread) > lag:
            record(*unread.pop(0))
        p += a + 1
    return steps


def oracle(rows: list[dict], budgets: tuple[int, ...], costs: StepCosts) -> list[tuple[int, float, int]]:
    """The fastest sequence of budgets over the rows in hindsight: ms to the end from each position,
    backwards (every sequence commits the same tokens, so the fastest is the best rate)."""
    n = len(rows)
    best: list[tuple[float, int]] = [(0.0, 0)] * (n + 1)
    for p in range(n - 1, -1, -1):
        best[p] = min((costs.ms[b] + best[min(n, p + accepted(rows[p], b) + 1)][0], b) for b in budgets)
    steps, p = [], 0
    while p < n:
        b = best[p][1]
        steps.append((b, 0.0, accepted(rows[p], b)))
        p += steps[-1][2] + 1
    return steps


def run_set(prompts: list[list[dict]], cfg: EngineConfig, depth: int, costs: StepCosts, ar_ms: float,
            lag: int) -> dict:
    """Tokens per ms of AR, each fixed budget, the adaptive policy and the oracle over a prompt set (summed
    over its prompts, as tok/s over a set), and the adaptive policy's budgets."""
    budgets = policy_budgets(cfg.budget, cfg.policy_levels)
    runs: dict[str, list] = {f"fixed {b}": [] for b in budgets if b > 0}
    runs["adaptive"], runs["oracle"] = [], []
    for rows in prompts:
        for b in budgets[1:]:
            runs[f"fixed {b}"] += replay(rows, lambda b=b: (b, 0.0), lambda *_: None, 0)
        policy = AdaptivePolicy.for_config(cfg, depth, costs)
        runs["adaptive"] += replay(rows, policy.choose, lambda b, r, p=policy: p.observe(b, r["probs"], r["path"]), lag,
                                   (lambda r, p=policy: p.preview(r["probs"])) if policy.previews else None)
        runs["oracle"] += oracle(rows, budgets, costs)
    tokens = sum(len(rows) for rows in prompts)  # steps commit this many tokens whatever their budgets
    rate = {name: tokens / sum(costs.ms[b] for b, _, _ in steps) for name, steps in runs.items()}
    ar = 1.0 / ar_ms
    best = max((r, name) for name, r in rate.items() if name.startswith("fixed"))
    adaptive = runs["adaptive"]
    per_budget = {b: [(e, a + 1) for bb, e, a in adaptive if bb == b] for b in budgets}
    return {"tokens": tokens, "vs_ar": {name: r / ar for name, r in rate.items()}, "best_fixed": best[1],
            "adaptive_vs_best": rate["adaptive"] / best[0], "oracle_vs_best": rate["oracle"] / best[0],
            "histogram": dict(sorted(Counter(b for b, _, _ in adaptive).items())),
            "al": {name: tokens / len(steps) for name, steps in runs.items()},
            "predicted_observed": {b: (sum(e for e, _ in v) / len(v), sum(o for _, o in v) / len(v))
                                   for b, v in per_budget.items() if v}}


def parse_costs(text: str) -> StepCosts:
    try:
        pairs = [item.split(":") for item in text.split(",")]
        return StepCosts({int(b): float(ms) for b, ms in pairs})
    except ValueError as exc:
        raise SystemExit(f"--costs: expected budget:ms pairs separated by commas (e.g. {H200_COSTS}), "
                         f"but got {text!r} ({exc})") from None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-dflash", help="a draft spec (random: a useless draft)")
    ap.add_argument("--sets", nargs="+", default=["humaneval", "chat", "agent"])
    ap.add_argument("--n-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=48)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--levels", type=int, default=4, help="policy_levels")
    ap.add_argument("--probe-every", type=int, default=8)
    ap.add_argument("--probe-max", type=int, default=EngineConfig.probe_max)
    ap.add_argument("--calibration-window", type=int, default=16)
    ap.add_argument("--switch-margin", type=float, default=EngineConfig.switch_margin)
    ap.add_argument("--no-preview", action="store_true",
                    help="policy_preview false: a generation's first steps run the configured tree blind")
    ap.add_argument("--costs", default=H200_COSTS, help=f"budget:ms,... a step (default the H200's: {H200_COSTS})")
    ap.add_argument("--ar-ms", type=float, default=H200_AR_MS, help="plain AR's ms a step (the reference)")
    ap.add_argument("--lag", type=int, default=1, help="steps launched before one is read (runtime 1, generic 0)")
    ap.add_argument("--cache", help="the per-position table (JSON): read when it was built for these arguments")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    cfg = EngineConfig(verify="ddtree", budget=args.budget, top_k=args.top_k, policy="adaptive",
                       policy_levels=args.levels, probe_every=args.probe_every, probe_max=args.probe_max,
                       calibration_window=args.calibration_window, switch_margin=args.switch_margin,
                       policy_preview=not args.no_preview)
    costs = parse_costs(args.costs)
    costs.check(policy_budgets(cfg.budget, cfg.policy_levels))
    cache = Path(args.cache) if args.cache else None
    table = json.loads(cache.read_text()) if cache is not None and cache.exists() else None
    if table is None or table["key"] != _key(args):
        table = build(args)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(table))
    report = {spec: run_set(prompts, cfg, table["depth"], costs, args.ar_ms, args.lag)
              for spec, prompts in table["sets"].items()}
    _print(report, args.draft)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


def _print(report: dict, draft: str) -> None:
    names = list(next(iter(report.values()))["vs_ar"])
    print(f"| set ({draft}) | " + " | ".join(names) + " | adaptive / best fixed | oracle / best fixed |")
    print("|---" * (len(names) + 3) + "|")
    for spec, r in report.items():
        cells = [f"{r['vs_ar'][n]:.3f}x (AL {r['al'][n]:.2f})" for n in names]
        print(f"| {spec} | " + " | ".join(cells) + f" | **{r['adaptive_vs_best']:.3f}** ({r['best_fixed']}) | "
              f"{r['oracle_vs_best']:.3f} |")
    for spec, r in report.items():
        po = ", ".join(f"{b}: {p:.2f}/{o:.2f}" for b, (p, o) in r["predicted_observed"].items())
        print(f"{spec}: budgets {r['histogram']}; E[AL] predicted/observed by budget {po}")
    for spec, r in report.items():  # the greppable summary
        print(f"{spec}_adaptive_vs_ar: {r['vs_ar']['adaptive']:.4f}")
        print(f"{spec}_adaptive_vs_best_fixed: {r['adaptive_vs_best']:.4f}")
    assert all(math.isfinite(r["adaptive_vs_best"]) for r in report.values())


if __name__ == "__main__":
    main()
