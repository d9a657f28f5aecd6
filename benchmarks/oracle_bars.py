"""``gpu_bench.py oracle``: the adaptive step policy against AR and fixed DDTree budgets on a large
shape preset, with ``oracle:P`` drafts of known acceptance (issue #27's third bar).

Per preset (random weights; its ``-dflash`` draft, ``random`` for a preset without one):

1. ``--n-prompts`` prompts of ``--context`` random token ids (seeded by their index).
2. AR on each ``--paths`` path: one untimed pass a block longer than ``--new-tokens`` (the warm-up,
   and the text the oracle is taught), then ``--repeats`` timed passes whose outputs are the reference.
3. The preset's DFlash draft becomes a ``TaughtOracleDrafter``: it runs as it would (its cost on the
   captured runtime) and its logits are replaced by the oracle's, the truth read from the taught text.
   ``OracleDrafter`` (``--draft oracle:P``) runs the target block - 1 times a proposal on the host: it
   could not time a policy against AR.
4. Per ``--oracles`` set (``oracle:P``; ``oracle:P1,P2,...``: prompt i takes P number i mod the
   list's length, the engine's rule): chain, DDTree at each ``--budgets`` budget and the adaptive
   policy up to the largest (choosing among ``policy_budgets(max, len(budgets))`` and AR steps), each
   timed as ``gpu_bench.py pair`` times (a warm-up pass, the median of ``--repeats``), every output
   compared with AR's.

The bar of a set: adaptive / max(AR, the best fixed budget) >= 0.97 for one P, >= 1.03 for a mix.
The oracle's acceptance does not depend on the text (the random target's output repeats itself):
each slot is the target's own token unless corrupted, with probability P, so a chain accepts
1 + sum_{j=1..block-1} (1 - P)^j tokens a step on average; the table shows that beside the AL
measured per P.
"""

from __future__ import annotations

import gc
import statistics
from collections import Counter
from collections.abc import Sequence

import torch
from bench_common import env_record, spread, timed

import engine
from engine import EngineConfig
from engine.decoding.drafters import DFlashDrafter, TaughtOracleDrafter
from engine.decoding.policy import policy_budgets
from engine.registry import DRAFTS, parse_oracle

SINGLE_BAR, MIX_BAR = 0.97, 1.03


def oracle_prompts(vocab: int, n: int, context: int) -> list[list[int]]:
    """``n`` prompts of ``context`` random token ids in [0, vocab), prompt i seeded by i."""
    return [torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(i)).tolist()
            for i in range(n)]


def chain_al(p: float, depth: int) -> float:
    """A chain's expected AL when each of its ``depth`` slots is corrupted with probability ``p``."""
    return 1.0 + sum((1.0 - p) ** j for j in range(1, depth + 1))


def al_by_p(prompts: Sequence, ps: Sequence[float]) -> dict[float, float]:
    """AL (committed tokens per step) of the prompts of each P (``PromptResult``s; ``ps`` per prompt)."""
    steps: Counter = Counter()
    tokens: Counter = Counter()
    for r, p in zip(prompts, ps, strict=True):
        steps[p] += r.steps
        tokens[p] += r.acceptance_length * r.steps
    return {p: tokens[p] / steps[p] for p in sorted(steps) if steps[p]}


def budgets_by_p(result, ps: Sequence[float]) -> dict[float, dict[int, int]]:
    """The adaptive policy's budgets (steps at each) of the prompts of each P: ``result.step_budgets`` holds
    every prompt's steps in order (``PromptResult.steps`` of them each); {} under a fixed policy."""
    flat = list(result.step_budgets)
    if len(flat) != sum(r.steps for r in result.prompts):
        return {}
    out: dict[float, Counter] = {}
    at = 0
    for r, p in zip(result.prompts, ps, strict=True):
        out.setdefault(p, Counter()).update(flat[at:at + r.steps])
        at += r.steps
    return {p: dict(sorted(c.items())) for p, c in sorted(out.items())}


def configs_for(budgets: Sequence[int], top_k: int) -> tuple[list[tuple[str, dict]], list[str], str]:
    """(every config's name and fields, the fixed budgets' names, the adaptive config's name): chain, DDTree
    at each budget, the adaptive policy up to the largest (its budgets halving from it, as many as given)."""
    budgets = sorted(budgets)
    fixed = [f"ddtree-b{b}" for b in budgets]
    adaptive = f"adaptive ({'/'.join(map(str, policy_budgets(budgets[-1], len(budgets))))})"
    configs = [("chain", dict(verify="chain"))]
    configs += [(name, dict(verify="ddtree", budget=b, top_k=top_k)) for name, b in zip(fixed, budgets, strict=True)]
    configs.append((adaptive, dict(verify="ddtree", budget=budgets[-1], top_k=top_k, policy="adaptive",
                                   policy_levels=len(budgets))))
    return configs, fixed, adaptive


def bar_of(ps: Sequence[float], rows: dict, ar_tps: float, fixed: list[str], adaptive: str) -> dict:
    """A set's bar: the adaptive config against the best of AR and the fixed budgets (decode tok/s medians)."""
    best = max(fixed, key=lambda k: rows[k]["tps_median"])
    ratio = rows[adaptive]["tps_median"] / max(ar_tps, rows[best]["tps_median"])
    bar = MIX_BAR if len(set(ps)) > 1 else SINGLE_BAR
    return {"ar_tps": ar_tps, "best_fixed": best, "best_fixed_tps": rows[best]["tps_median"],
            "adaptive_tps": rows[adaptive]["tps_median"], "ratio": ratio, "bar": bar, "met": ratio >= bar}


def _time_set(pair, configs: list[tuple[str, dict]], path: str, prompts: list[list[int]], ps: list[float],
              reference: list[list[int]], ar_cfg: EngineConfig, ar_tps: float, args, set_name: str,
              block: int) -> tuple[dict, list[str]]:
    """Every config on one oracle set: its rows (for the JSON) and table lines."""
    rows, table = {}, []
    for name, params in configs:
        runs = timed(pair, EngineConfig(**params, draft_path=path), prompts, args.new_tokens, args.repeats,
                     reference, ar_config=ar_cfg)
        r0, tps = runs[-1], [r.decode_tps for r in runs]
        by_p = al_by_p(r0.prompts, ps)
        row = rows[name] = {
            "tps": tps, "tps_median": statistics.median(tps), "al": r0.acceptance_length, "al_by_p": by_p,
            "ms_per_step": 1000 * r0.decode_s / max(r0.steps, 1), "exact": sum(bool(p.exact) for p in r0.prompts),
            "n": len(prompts), "budget_steps": dict(Counter(r0.step_budgets)),
            "budget_steps_by_p": budgets_by_p(r0, ps),
            "divergences": [{"prompt": p.index, **p.divergence.to_dict()} for p in r0.prompts
                            if p.divergence is not None]}
        expected = (lambda p: f" ({chain_al(p, block - 1):.2f})") if name == "chain" else (lambda p: "")
        shown = ", ".join(f"{p:g}: {al:.2f}{expected(p)}" for p, al in by_p.items())
        table.append(f"| {set_name} | {name} | {spread(tps)} | {row['tps_median'] / ar_tps:.2f}x | {row['al']:.2f} "
                     f"| {shown} | {row['ms_per_step']:.2f} | {row['exact']}/{len(prompts)} |")
        print(table[-1], flush=True)
    return rows, table


def _bar_line(set_name: str, path: str, bar: dict, rows: dict, adaptive: str) -> str:
    chosen = " ".join(f"{b}:{n}" for b, n in sorted(rows[adaptive]["budget_steps"].items()))
    by_p = rows[adaptive].get("budget_steps_by_p") or {}
    if len(by_p) > 1:  # a mix: which prompts took which budgets
        chosen += " (" + "; ".join(f"P {p:g}: " + " ".join(f"{b}:{n}" for b, n in c.items())
                                   for p, c in by_p.items()) + ")"
    return (f"| {set_name} | {path} | {bar['ar_tps']:.1f} | {bar['best_fixed']} {bar['best_fixed_tps']:.1f} | "
            f"{bar['adaptive_tps']:.1f} | **{bar['ratio']:.3f}x** | >= {bar['bar']:.2f}x: "
            f"{'met' if bar['met'] else 'not met'} | {chosen} |")


def run(args) -> tuple[str, dict]:
    """The section (``gpu_bench.py oracle``): its markdown and JSON report."""
    lines: list[str] = []
    report: dict = {"env": env_record(), "presets": {}}
    configs, fixed, adaptive = configs_for(args.budgets, args.top_k)
    for target in args.presets:
        draft = f"{target}-dflash" if f"{target}-dflash" in DRAFTS else "random"
        pair = engine.load(target, draft, device=args.device, dtype=args.dtype)
        base = pair.drafter
        if not isinstance(base, DFlashDrafter):  # (the presets' drafts and ``random`` are)
            raise RuntimeError(f"{target}'s draft {draft!r} is not a DFlash draft: nothing to teach")
        prompts = oracle_prompts(pair.target.cfg.vocab_size, args.n_prompts, args.context)
        block = base.block_size
        rep: dict = {"draft": draft, "prompts": len(prompts), "context": args.context,
                     "new_tokens": args.new_tokens, "paths": {}}
        report["presets"][target] = rep
        for path in args.paths:
            pair.drafter = base
            ar_cfg = EngineConfig(verify="ar", draft_path=path)
            # the warm-up pass, a block longer: the text the oracle is taught (a step near the end
            # proposes past the generation's end)
            taught = engine.bench(pair, ar_cfg, prompts, args.new_tokens + block, ignore_eos=True).outputs
            ar_runs = [engine.bench(pair, ar_cfg, prompts, args.new_tokens, ignore_eos=True)
                       for _ in range(args.repeats)]
            reference = ar_runs[0].outputs
            same = all(t[: args.new_tokens] == r for t, r in zip(taught, reference, strict=True))
            ar_tps = [r.decode_tps for r in ar_runs]
            ar_ms = 1000 * ar_runs[-1].decode_s / max(ar_runs[-1].steps, 1)
            pair.drafter = oracle = TaughtOracleDrafter(base.draft, base.target,
                                                        [p + t for p, t in zip(prompts, taught, strict=True)])
            # graphs captured over another path's oracle would read its tables: a new decoder
            pair._runtime_decoder = None
            head = (f"**{target}** ({path}; draft {draft} under the taught oracle, block {block}; {len(prompts)} "
                    f"prompts x {args.context} random tokens, {args.new_tokens} new; AR {spread(ar_tps)} tok/s, "
                    f"{ar_ms:.2f} ms/step; AR's timed outputs equal its taught text: {same})")
            lines += [head, "", "| set | config | decode TPS | x AR | AL | AL by P (chain: expected) | ms/step | "
                      "exact |", "|" + "---|" * 8]
            bars = ["| set | path | AR | best fixed | adaptive | adaptive / best of both | bar | adaptive's "
                    "budgets (steps) |", "|" + "---|" * 8]
            print(head, flush=True)
            prep: dict = {"ar": {"tps": ar_tps, "ms_per_step": ar_ms, "outputs_equal_taught": same}, "sets": {}}
            rep["paths"][path] = prep
            for spec in args.oracles:
                ps = oracle.assign(parse_oracle(spec))
                name = spec.removeprefix("oracle:")
                rows, table = _time_set(pair, configs, path, prompts, ps, reference, ar_cfg,
                                        statistics.median(ar_tps), args, name, block)
                bar = bar_of(ps, rows, statistics.median(ar_tps), fixed, adaptive)
                bars.append(_bar_line(name, path, bar, rows, adaptive))
                print(bars[-1], flush=True)
                lines += table
                prep["sets"][spec] = {"ps_by_prompt": ps, "configs": rows, "bar": bar}
            lines += ["", *bars, ""]
        pair.drafter = base
        del pair, base, oracle
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return "\n".join(lines), report
