"""A study → report.md and its PNG plots (``autotune.plots``).

Sections: the winner and whether it is a positive conclusion, exactness failures (loudly, with each
divergence's top-2 logit margins and verdict: numeric tie or mismatch), top trials with spread,
speedup vs AR and the baseline each speedup used (and which ones a restart reused), break-even AL
and oracle gate per workload, the per-phase breakdown (and what the phases do not account for),
which path won and by how much, device memory (the limit, the winner's peak per part, the trials
over the limit), failures. A study of ``objective: session_tps`` ranks by session tok/s and adds
"Sessions": both objectives side by side, with time to first token and the prefix cache's share.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune import measure, plots, results
from autotune import study as st
from autotune.dimensions import describe as describe_fixed
from autotune.study import role_of
from autotune.vram import size as vram_size

COVERAGE_TOLERANCE = 0.05  # phases must add up to the step time within a few percent


def write_report(study: optuna.Study, out_dir: Path, top: int = 10) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    ranked = results.ranked(study)
    w = results.winner(study)
    pngs = plots.write_plots(study, ranked, w, top, out_dir)
    md = out_dir / "report.md"
    md.write_text(_markdown(study, ranked, w, top, pngs))
    return [md, *pngs]


def _fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _weights(model: dict[str, Any], summary: dict[str, Any] | None) -> str:
    """How the target held its weights, for the model line: ``weights native (Q4_K x9, Q6_K x5 in
    blocks, 14 of them as operand planes; fallback TQ2_0 x1; 3.1 of 4.2 MiB in blocks)``. A study made before
    ``model.weights`` existed was dequantized; one whose worker did not report the summary shows the mode alone."""
    mode = (summary or {}).get("mode") or model.get("weights", "dequantized")
    if not summary:
        return f"weights {mode}"
    total = _mib(summary.get("weight_bytes", 0))
    if not summary.get("formats"):
        return f"weights {mode} ({total} MiB)"
    kept = ", ".join(f"{k} x{n}" for k, n in summary["formats"].items())
    if summary.get("operand_projections"):
        kept += f" in blocks, {summary['operand_projections']} of them as operand planes"
    else:
        kept += " in blocks"
    fallback = ", ".join(f"{k} x{n}" for k, n in (summary.get("fallback") or {}).items())
    return (f"weights {mode} ({kept}; {f'fallback {fallback}; ' if fallback else ''}"
            f"{_mib(summary.get('native_bytes', 0))} of {total} MiB in blocks)")


def _mib(n: int) -> str:
    """Bytes in MiB with three significant figures (a tiny test model's 0.0123, a 27B's 14,200)."""
    mib = n / 2**20
    return f"{mib:,.0f}" if mib >= 100 else f"{mib:.3g}"


def _cfg_short(cfg: dict[str, Any]) -> str:
    """The path and whatever differs from the engine's defaults (the full config is in the study)."""
    from engine import EngineConfig

    if cfg.get("verify") == "ar":
        return "verify=ar"
    cfg = results.applicable_config(cfg)  # a chain shows no budget or top-k, whatever was recorded
    defaults = EngineConfig().to_dict()
    path = [f"{k}={cfg[k]}" for k in ("verify", "draft_path", "rollback") if k in cfg]
    rest = [f"{k}={v}" for k, v in cfg.items() if k not in ("verify", "draft_path", "rollback")
            and v != defaults.get(k)]
    return " ".join(path + rest)


def _markdown(study: optuna.Study, ranked: list[FrozenTrial], w: results.Winner | None, top: int,
              pngs: list[Path]) -> str:
    a = study.user_attrs
    counts = results.state_counts(study)
    L = [f"# autotune report: {study.study_name}", ""]
    L += [f"- experiment: `{a.get('experiment')}` ({a.get('experiment_path')})",
          f"- model: target `{a.get('model', {}).get('target')}`, draft `{a.get('model', {}).get('draft')}`, "
          f"{_weights(a.get('model', {}), a.get('weight_summary'))}",
          f"- device: {a.get('device')} ({a.get('dtype')}), git {a.get('git_sha')}",
          f"- workloads: {a.get('workloads')} (hash {a.get('workload_hash')})",
          f"- trials: {counts['finished']} finished ({counts['complete']} complete, {counts['pruned']} pruned, "
          f"{counts['fail']} failed of which {counts['interrupted']} interrupted), {counts['infeasible']} infeasible, "
          f"{counts['refused']} refused by the engine"
          + (f", {counts['over_vram']} over the memory limit" if counts["over_vram"] else ""),
          f"- exactness: {a.get('exactness')}"]
    if "fixed_dimensions" in a:  # dimensions whose value cannot matter here were not searched
        L.append(f"- fixed, not searched: {describe_fixed(a['fixed_dimensions']) or 'none'}")
    L.append("")
    drift = w.drift if w is not None else results.ar_drift(study)
    if drift is not None:  # before anything else: every speedup below rests on a moving AR
        L += ["## Unreliable study", "",
              f"**{drift.describe()}** (more than twice the spread and more than "
              f"{study.user_attrs.get('max_ar_drift', measure.DRIFT_FLOOR):.0%} apart, `measure.max_ar_drift`): "
              "the machine's speed changed during the study, so its "
              "speedups are not comparable with each other. Nothing below is confirmed or a positive "
              "conclusion; find what else ran on the machine and measure again.", ""]
    L += ["## Winner", ""]
    if w is None:
        L += ["No feasible completed trial yet.", ""]
    else:
        conf = ("confirmed by re-measurement" if w.confirmed
                else "**not confirmed** (the AR baselines drifted: above)" if w.drift is not None
                else "**not confirmed** (the confirmation phase did not run)")
        base = results.winner_baseline(study, w)
        L += [f"Trial {w.trial} ({w.role}, path `{results.path_of(w.config)}`), {conf}: "
              f"**{w.median_tps:.2f} ± {w.spread:.2f} tok/s** {results.unit(study, long=True)} "
              f"(conservative {w.value:.2f}), speedup vs AR {_fmt(w.speedup_vs_ar)}x "
              f"(AR {_fmt(w.ar_median_tps)} {results.unit(study)}{f'; baseline: {base}' if base else ''}).", "",
              f"`{_cfg_short(w.config)}`", ""]
        L += _conclusions(w)
    L += _confirmation(study)
    L += _exactness(study)
    key = results.median_key(study)
    L += ["## Top trials", "", "By search value (median − spread of the search's passes); ★ marks the winner.", "",
          f"| trial | role | path | {results.unit(study)} (median ± spread) | value | speedup vs AR | "
          "AR baseline | AL | break-even AL | exact | noisy | config |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in ranked[:top]:
        u = t.user_attrs
        base = _fmt(u.get("baseline_trial")) + (" (reused)" if u.get("baseline_reused") else "")
        star = " ★" if w is not None and t.number == w.trial else ""
        L.append(f"| {t.number}{star} | {role_of(t)} | {results.path_of(u.get('config', {}))} | "
                 f"{_fmt(u.get(key))} ± {_fmt(u.get('spread'))} | {_fmt(t.value)} | "
                 f"{_fmt(u.get('speedup_vs_ar'))} | {base} | {_fmt(u.get('acceptance_length'))} | "
                 f"{_fmt(results.break_even_al(study, t))} | {_fmt(u.get('exact_match'))} | {_fmt(u.get('noisy'))} | "
                 f"`{_cfg_short(u.get('config', {}))}` |")
    L += ["", *_sessions(study, w), *_weights_forms(study), *_baselines(study), *_per_workload(study, w),
          *_phases(ranked[:5]), *_paths(study, w), *_memory(study, w), *_stopped(study), *_refusals(study),
          *_failures(study)]
    L += ["## Plots", "", *(f"![{p.stem}]({p.name})" for p in pngs), ""]
    return "\n".join(L)


def _conclusions(w: results.Winner) -> list[str]:
    if w.drift is not None:
        return ["No conclusion: the AR baselines drifted beyond the noise (Unreliable study, above).", ""]
    if not w.confirmed:
        return ["No positive conclusion without the confirmation phase.", ""]
    out = []
    if w.role == "baseline":
        out.append("**Plain AR decoding won**: no speculative config beat it on this machine and workload.")
    elif w.positive_vs_ar is None:
        out.append("No conclusion vs AR: the AR baseline was not re-measured in the confirmation (below).")
    elif w.positive_vs_ar:
        out.append("**Positive conclusion vs AR**: the margin is more than twice the measured spread.")
    else:
        out.append("Not a positive conclusion vs AR: the margin is within twice the spread (treat as a tie).")
    if w.positive_vs_reference is not None:
        out.append("Beats the reference DDTree defaults by more than twice the spread." if w.positive_vs_reference
                   else "Not distinguishable from the reference DDTree defaults (within twice the spread).")
    return out + [""]


def _confirmation(study: optuna.Study) -> list[str]:
    conf = study.user_attrs.get("confirmation")
    failed = study.user_attrs.get("confirmation_failed")
    if failed and (not conf or failed["finished_trials"] > conf["finished_trials"]):
        L = ["## Confirmation", "", f"**Every re-measurement failed** after {failed['finished_trials']} trials: "
             "nothing is confirmed.", ""]
        L += [f"- Trial {d['trial']} ({d['role']}): {d['reason']}" for d in failed["dropped"]]
        return L + [""]
    if not conf:
        return []
    L = ["## Confirmation", "", f"The top configs re-measured with {conf['repeats']} repeats after "
         f"{conf['finished_trials']} trials; differences within the spread are ties, broken toward the simpler "
         "config.", "",
         f"| trial | {results.unit(study)} (median ± spread) | speedup vs AR | break-even AL | tied | config |",
         "|---|---|---|---|---|---|"]
    for c in sorted(conf["candidates"], key=lambda c: -c["score"]["median"]):
        sc = c["score"]
        L.append(f"| {c['trial']} | {sc['median']:.2f} ± {sc['spread']:.2f} | {_fmt(c.get('speedup_vs_ar'))} | "
                 f"{_fmt(c.get('break_even_al'))} | {_fmt(c['trial'] in conf['ties'])} | "
                 f"`{_cfg_short(c['config'])}` |")
    L.append("")
    for d in conf.get("dropped", []):
        what = "the AR baseline: no speedup is confirmed" if d["role"] == "baseline" else "not a candidate"
        L += [f"- **Trial {d['trial']} ({d['role']}) was dropped from the confirmation** ({what}): {d['reason']}"]
    return L + ([""] if conf.get("dropped") else [])


def _exactness(study: optuna.Study) -> list[str]:
    bad = results.infeasible(study)
    report_mode = [t for t in results.completed(study)
                   if t.user_attrs.get("exact_match") is not None and t.user_attrs["exact_match"] < 1.0]
    if not bad and not report_mode:
        return ["## Exactness", "", "Every measured output equalled the AR output token for token.", ""]
    L = ["## ⚠ EXACTNESS FAILURES", "", "These configs produced output that differs from the AR output. "
         "They are infeasible under `exactness: strict` and never win.", "",
         "| trial | exact fraction | inexact prompts | first divergence | verdicts | prompts | config |",
         "|---|---|---|---|---|---|---|"]
    trials = list({t.number: t for t in bad + report_mode}.values())
    for t in trials:
        u = t.user_attrs
        verdicts = ", ".join(f"{v} {n}" for v, n in u.get("divergence_verdicts", {}).items()) or "–"
        L.append(f"| {t.number} | {_fmt(u.get('exact_match'))} | {_fmt(u.get('inexact_count'))} | "
                 f"{_fmt(u.get('first_divergence'))} | {verdicts} | "
                 f"{', '.join(u.get('inexact_prompts', [])[:5])} | `{_cfg_short(u.get('config', {}))}` |")
    return L + ["", *_divergences(trials)]


def _divergences(trials: list[FrozenTrial]) -> list[str]:
    """Each inexact prompt's first divergence: both runs' top-2 logit margins there and the verdict."""
    rows = [(t.number, d) for t in trials for d in t.user_attrs.get("divergences", [])]
    if not rows:
        return []
    L = ["### Divergences", "", "At each inexact prompt's first differing token, the margin top1 − top2 of the "
         "target's logits row that picked it, in the AR run and in the config's run (float32, from each run's own "
         "logits). A **numeric tie**: the smaller margin is within the tie bound (4 units in the last place of the "
         "model's dtype at the top logit), so rounding alone can swap the two tokens; a **mismatch** is not "
         "explained by rounding (`engine.decoding.stats.tie_bound`). *not reproduced*: re-decoding did not give the "
         "compared tokens again.", "",
         "| trial | prompt | position | AR margin | run margin | tie bound | verdict |",
         "|---|---|---|---|---|---|---|"]
    for number, d in rows:
        verdict = d["verdict"] + ("" if d.get("reproduced", True) else " (not reproduced)")
        L.append(f"| {number} | {d['prompt']} | {d['position']} | {_fmt(d['ar_margin'], 4)} | "
                 f"{_fmt(d['run_margin'], 4)} | {d['tie_bound']:.3g} | {verdict} |")
    return L + [""]


def _baselines(study: optuna.Study) -> list[str]:
    trials = results.completed(study)
    base = [t for t in trials if role_of(t) == "baseline"]
    users = Counter(t.user_attrs.get("baseline_trial") for t in trials if role_of(t) != "baseline")
    L = ["## Speedup vs AR", "", "Speedups are median ratios against the nearest AR baseline on the same worker "
         "and prompt set. A worker that starts without one (after a restart) reuses the study's latest baseline "
         "measured under the same identity (machine, models, prompts, settings, code) within "
         "`measure.baseline_max_age`. AR baselines measured:", "",
         f"| trial | worker | AR {results.unit(study)} (median ± spread) | drift vs previous | speedups using it |",
         "|---|---|---|---|---|"]
    key = results.median_key(study)
    for t in base:
        u = t.user_attrs
        L.append(f"| {t.number} | {u.get('worker')} | {_fmt(u.get(key))} ± {_fmt(u.get('spread'))} "
                 f"| {_fmt(u.get('ar_drift'), 3)} | {users[t.number]} |")
    L.append("")
    for r in st.baseline_reuses(study):
        age = "" if r.get("age_s") is None else f", measured {r['age_s'] / 60:.0f} min before"
        L.append(f"- baseline: trial {r['trial']}, reused by the restart at {r['at']} (worker {r['worker']}{age})")
    return L + ([""] if L[-1] else [])


def _sessions(study: optuna.Study, w: results.Winner | None) -> list[str]:
    """Both objectives side by side (a session study only): the winner, the best of each path, the
    reference and the AR baseline, per workload set."""
    if results.objective(study) != "session_tps":
        return []
    shown = [t for t in results.completed(study) if w is not None and t.number == w.trial]
    shown += [t for _, t in results.best_per_path(study, w)]
    for role in ("reference", "baseline"):  # one of each (the latest)
        shown += [t for t in results.completed(study) if role_of(t) == role][-1:]
    L = ["## Sessions", "", "Each session replayed turn by turn, every turn sending the conversation so far "
         "(the baseline AR's replies in place of the script's: the same requests for every config), through one "
         "prefix cache per set and pass as a server keeps it. Session tok/s = completion tokens / the turns' "
         "time, prefill included (the objective); decode "
         "tok/s = the same turns' decode only. Time to first token (TTFT): the prefill of what the cache did "
         "not hold, and the first token. Cached: the later turns' prompt tokens the cache gave.", "",
         "| trial | role | workload | session tok/s | speedup | decode tok/s | decode speedup | TTFT first turn "
         "(ms) | TTFT later turns (ms) | cached | sessions / turns | config |", "|" + "---|" * 12]
    cut: list[str] = []
    for t in {t.number: t for t in shown}.values():
        u = t.user_attrs
        for name, s in u.get("per_set", {}).items():
            cells = [t.number, role_of(t), name, _fmt(s.get("session_tps_median")),
                     _fmt(s.get("session_speedup_vs_ar")), _fmt(s.get("decode_tps_median")),
                     _fmt(s.get("speedup_vs_ar")), _fmt(s.get("ttft_first_ms"), 1), _fmt(s.get("ttft_later_ms"), 1),
                     "–" if s.get("cached_share_later") is None else f"{s['cached_share_later']:.0%}",
                     f"{_fmt(s.get('sessions'))} / {_fmt(s.get('turns'))}", f"`{_cfg_short(u.get('config', {}))}`"]
            L.append("| " + " | ".join(map(str, cells)) + " |")
        cut += [f"- trial {t.number}: {k}: {v}" for k, v in (u.get("sessions_cut") or {}).items()]
    if cut:
        L += ["", "Sessions the replay ended early (the conversation outgrew the target's context):", *cut[:10]]
    return L + [""]


def _stopped_at(u: dict[str, Any]) -> str:
    """Where a pruned trial stopped: its fidelity rung, or (the Wilcoxon pruner) its first pass."""
    return f"rung {u['pruned_at_rung']}" if u.get("pruned_at_rung") is not None else "first pass"


def _weights_forms(study: optuna.Study) -> list[str]:
    """What the target's weight form does (a study that searched ``weights``): per form, the best
    feasible config and AR where measured, and the acceptance of configs measured in both forms
    alike but for it (quantized blocks dequantized per call against weights dequantized on load)."""
    done = [t for t in results.completed(study) if results.feasible(t) and t.user_attrs.get("config")]
    default = (study.user_attrs.get("model") or {}).get("weights") or "dequantized"

    def form(t: FrozenTrial) -> str:
        return t.user_attrs["config"].get("weights") or default

    if not any(t.user_attrs["config"].get("weights") for t in done):
        return []
    pruned = [t for t in study.get_trials(deepcopy=False, states=(TrialState.PRUNED,)) if t.user_attrs.get("config")]
    key, unit = results.median_key(study), results.unit(study)
    L = ["## Weights: native vs dequantized", "", "`native` keeps the GGUF's quantized projections in their blocks "
         "(dequantized per call, in registers on CUDA); `dequantized` turns them into the model's dtype on load. "
         "Each config is exact against AR with its own weights.", "",
         f"| weights | best config (trial) | {unit} | AL | AR {unit} (trial) |", "|---|---|---|---|---|"]
    for f in sorted({form(t) for t in done}):
        mine = sorted((t for t in done if form(t) == f), key=lambda t: -(t.value or 0.0))
        spec = [t for t in mine if t.user_attrs["config"].get("verify") != "ar"]
        ar = [t for t in mine if t.user_attrs["config"].get("verify") == "ar"]
        best = spec[0] if spec else None
        cells = [f, "–", "–", "–", "–"]
        if best is not None:
            u = best.user_attrs
            cells[1:4] = [f"`{_cfg_short(u['config'])}` ({best.number})", _fmt(u.get(key)),
                          _fmt(u.get("acceptance_length"))]
        if ar:
            cells[4] = f"{_fmt(ar[0].user_attrs.get(key))} ({ar[0].number})"
        elif stopped := [t for t in pruned if form(t) == f and t.user_attrs["config"].get("verify") == "ar"]:
            u = stopped[0].user_attrs  # the partial rate: no full measurement (see "Stopped early")
            cells[4] = f"stopped at {_stopped_at(u)}: {_fmt(u.get('partial_decode_tps'))} ({stopped[0].number})"
        L.append("| " + " | ".join(cells) + " |")
    twins: dict[str, dict[str, FrozenTrial]] = {}
    for t in sorted(done, key=lambda t: -(t.value or 0.0)):  # each form's best measurement of the config
        rest = {k: v for k, v in t.user_attrs["config"].items() if k != "weights"}
        twins.setdefault(repr(sorted(rest.items())), {}).setdefault(form(t), t)
    both = [by for by in twins.values() if len(by) > 1 and next(iter(by.values())).user_attrs["config"].get(
        "verify") != "ar"]
    if both:
        forms = sorted({f for by in both for f in by})
        L += ["", "The same config in both forms:", "", "| config | " + " | ".join(f"AL {f}" for f in forms) + " | "
              + " | ".join(f"{unit} {f}" for f in forms) + " |", "|" + "---|" * (1 + 2 * len(forms))]
        for by in both:
            t0 = next(iter(by.values()))
            cfg = {k: v for k, v in t0.user_attrs["config"].items() if k != "weights"}
            cells = [f"`{_cfg_short(cfg)}`"] + [_fmt(by[f].user_attrs.get("acceptance_length")) if f in by else "–"
                                                 for f in forms]
            cells += [_fmt(by[f].user_attrs.get(key)) if f in by else "–" for f in forms]
            L.append("| " + " | ".join(cells) + " |")
    return L + [""]


def _per_workload(study: optuna.Study, w: results.Winner | None) -> list[str]:
    shown = results.speculative_lead(study, w)
    shown += [t for t in results.completed(study) if role_of(t) == "reference"][:1]
    # the best adaptive-policy trial too, when the lead is not one: its choices beside the oracle gate
    shown += [t for t in results.ranked(study) if t.user_attrs.get("budget_histogram")][:1]
    L = ["## Break-even AL and oracle gate per workload", "",
         "Speculation beats plain decoding iff AL > break-even AL = step_ms / AR ms-per-token. The oracle "
         "gate is the TPS of an ideal per-step switch between speculation and AR (an upper bound for any "
         "gating policy). An adaptive-policy trial (`policy: adaptive`) shows the budgets it chose, as "
         "budget:steps (0: plain AR steps), and its tok/s is what such a switch achieved; its AL counts its "
         "AR steps as 1. Break-even and the gate compare with AR decoding the trial's weights: under a `weights` "
         "search, a trial on the other form is compared with that form's AR (its trial: `break_even_ar_trial`), "
         "while its speedup is against the baseline.", "",
         "| trial | workload | decode tok/s | AR decode tok/s | speedup | AL | break-even AL "
         "| steps beating break-even | oracle-gate tok/s | budgets chosen (steps) |", "|" + "---|" * 10]
    for t in {t.number: t for t in shown}.values():
        for name, s in t.user_attrs.get("per_set", {}).items():
            g = s.get("oracle_gate") or {}
            hist = s.get("budget_histogram") or {}
            cells = [t.number, name, _fmt(s.get("decode_tps_median")), _fmt(s.get("ar_decode_tps")),
                     _fmt(s.get("speedup_vs_ar")), _fmt(s.get("acceptance_length")), _fmt(g.get("break_even_al")),
                     _fmt(g.get("fraction_beating")), _fmt(g.get("ideal_tps")),
                     " ".join(f"{b}:{n}" for b, n in sorted(hist.items(), key=lambda kv: int(kv[0]))) or "-"]
            L.append("| " + " | ".join(map(str, cells)) + " |")
    return L + [""]


def _phases(trials: list[FrozenTrial]) -> list[str]:
    L = ["## Per-phase breakdown (ms per step)", "", "| trial | " + " | ".join(results.PHASES) + " | sum | step | "
         "coverage |", "|---" * (len(results.PHASES) + 4) + "|"]
    notes = []
    for t in trials:
        u = t.user_attrs
        ph = u.get("phase_ms_per_step", {})
        total, step = sum(ph.values()), u.get("step_ms") or 0.0
        cov = total / step if step else None
        L.append(f"| {t.number} | " + " | ".join(_fmt(ph.get(p), 3) for p in results.PHASES)
                 + f" | {_fmt(total, 3)} | {_fmt(step, 3)} | {_fmt(cov)} |")
        if cov is not None and abs(cov - 1) > COVERAGE_TOLERANCE:
            what = "not timed by any phase" if cov < 1 else "double counted"
            notes.append(f"- trial {t.number}: the phases account for {cov:.0%} of the step time; "
                         f"{abs(step - total):.3f} ms/step is {what} (host overhead between phases, bookkeeping).")
    return L + [""] + notes + ([""] if notes else [])


def _paths(study: optuna.Study, w: results.Winner | None) -> list[str]:
    """The winner's path against the best of every other path, in search values (one reading for
    all: the search's conservative value); the winner is the one the "Winner" section names."""
    best = results.best_per_path(study, w)
    L = ["## Which path won", ""]
    if not best:
        return L + ["No feasible trials.", ""]
    lead_path, lead = best[0]
    lead_value = lead.value or 0.0
    what = "the winner" if w is not None and lead.number == w.trial else "best value"
    L.append(f"Best path: `{lead_path}` ({what}: trial {lead.number}, search value {lead_value:.2f}).")
    ties = set((study.user_attrs.get("confirmation") or {}).get("ties", [])) if w is not None and w.confirmed else set()
    for path, t in best[1:]:
        margin = (lead_value - t.value) / t.value if t.value else float("nan")
        tied = (" (tied with the winner in the confirmation: ties go to the simpler config)"
                if t.number in ties else "")
        L.append(f"- `{path}`: best value {t.value:.2f} (trial {t.number}); the winner is {margin:+.1%} "
                 f"ahead{tied}.")
    return L + [""]


def _memory(study: optuna.Study, w: results.Winner | None) -> list[str]:
    """The limit, the winner's peak per part, and each trial over the limit: by how much, its largest
    part, measured or planned (``autotune.vram``). Nothing when no trial recorded its memory."""
    limit = (study.user_attrs.get("model") or {}).get("vram_limit")
    recorded = {t.number: t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("memory")}
    if not recorded:
        return []
    L = ["## Device memory", "", f"Limit: {vram_size(limit) if limit else 'none'} (`model.vram_limit`). A trial's "
         "peak at the workload's longest prompt plus `max_new_tokens`, per part (`engine.memory`): measured on CUDA "
         "over the measured passes, planned elsewhere (`autotune plan` prints the plan).", ""]
    if w is not None and w.trial in recorded:
        m = recorded[w.trial].user_attrs["memory"]
        parts = ", ".join(f"{k} {vram_size(v)}" for k, v in sorted(m["parts"].items(), key=lambda kv: -kv[1]) if v)
        plan = f"; planned {vram_size(m['planned_total'])}" if m.get("planned_total") else ""
        idle = (f" The worker also held the other weight form's pair ({vram_size(m['idle_pair_bytes'])}), left "
                "out of this peak.") if m.get("idle_pair_bytes") else ""
        L += [f"Winner (trial {w.trial}): {m['kind']} peak **{vram_size(m['total'])}**{plan} ({parts}).{idle}", ""]
    over = results.over_vram(study)
    if over:
        L += [f"**{len(over)} trial(s) over the limit**: infeasible, never the winner; one over it by its plan was "
              "not measured.", "", "| trial | peak | over by | largest part | peak is | config |",
              "|---|---|---|---|---|---|"]
        for t in over:
            m = t.user_attrs["memory"]
            part, cfg = m["dominant"], _cfg_short(t.user_attrs.get("config", {}))
            L.append(f"| {t.number} | {vram_size(m['total'])} | {vram_size(m['total'] - limit)} | {part} "
                     f"({vram_size(m['parts'][part])}) | {m['kind']} | `{cfg}` |")
        L.append("")
    return L + _plan_against_measured(recorded.values())


def _plan_against_measured(trials) -> list[str]:
    """Each trial measured on CUDA beside its plan (``autotune plan``'s figure for its config): how far the
    plan is from the measured peak, and the widest gap. Nothing where no peak was measured."""
    rows = [t for t in trials if t.user_attrs["memory"].get("kind") == "measured"
            and t.user_attrs["memory"].get("planned_total")]
    if not rows:
        return []
    L = ["Planned against measured (the plan's total for the trial's config and length, `engine.memory`):", "",
         "| trial | role | config | measured | planned | plan - measured |", "|---|---|---|---|---|---|"]
    gaps = []
    for t in sorted(rows, key=lambda t: t.number):
        m = t.user_attrs["memory"]
        gaps.append((m["planned_total"] - m["total"]) / m["total"])
        L.append(f"| {t.number} | {role_of(t)} | `{_cfg_short(t.user_attrs.get('config', {}))}` | "
                 f"{vram_size(m['total'])} | {vram_size(m['planned_total'])} | {gaps[-1]:+.1%} |")
    return L + ["", f"The plan is within **{max(abs(g) for g in gaps):.1%}** of the measured peak on all "
                f"{len(gaps)} measured trial(s).", ""]


def _stopped(study: optuna.Study) -> list[str]:
    """Trials stopped early (a fidelity rung, the pruner): their partial figure and why; no value."""
    pruned = study.get_trials(deepcopy=False, states=(TrialState.PRUNED,))
    if not pruned:
        return []
    L = ["## Stopped early", "", "Pruned trials carry no value: the figure is partial (one rung's slice, or the "
         "first pass) and never ranks. A trial stopped at a rung was not judged exact or inexact.", "",
         "| trial | path | stopped at | partial tok/s | reason |", "|---|---|---|---|---|"]
    for t in pruned:
        u = t.user_attrs
        L.append(f"| {t.number} | {results.path_of(u.get('config', {}))} | {_stopped_at(u)} | "
                 f"{_fmt(u.get('partial_decode_tps'))} | {u.get('pruned_reason', '–')} |")
    return L + [""]


def _refusals(study: optuna.Study) -> list[str]:
    """Configs the engine cannot run as asked: infeasible, never measured, each with the reason."""
    refused = results.refused(study)
    if not refused:
        return []
    L = ["## Refused by the engine", "", "The engine cannot run these configs as asked (nothing was measured; "
         "they are infeasible and never win):", "", "| trial | reason | config |", "|---|---|---|"]
    L += [f"| {t.number} | {t.user_attrs['refused']} | `{_cfg_short(t.user_attrs.get('config', {}))}` |"
          for t in refused]
    return L + [""]


def _failures(study: optuna.Study) -> list[str]:
    failed = study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
    if not failed:
        return []
    L = ["## Failed trials", ""]
    L += [f"- trial {t.number} ({role_of(t)}): {t.user_attrs.get('fail_reason', 'no reason recorded')}" for t in failed]
    return L + [""]
