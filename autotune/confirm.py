"""The confirmation phase: the best configs measured again, side by side, before one is called the
winner.

After the trials, the AR baseline, the reference DDTree config and the top ``confirm_top`` feasible
configs (and, for a config on another weight form than the baseline's, that form's best AR: its
break-even AL is against AR with its weights) are measured again with ``confirm_repeats`` passes on
one worker (ratios measured on one machine, in one run). Differences within the spread are ties,
broken toward the simpler config (``autotune.measure.choose_winner``); the result is the study's
``confirmation`` attribute, read by ``autotune.results``, the report and MLflow
(docs/measurement.md). A re-measurement that fails, or whose output no longer equals AR's under
strict exactness, is dropped with its reason, which the sweep prints and the report names: without
the AR baseline no speedup is confirmed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import optuna
from tqdm import tqdm

from autotune import measure, results
from autotune import study as st
from autotune.experiment import Experiment
from autotune.record import Job, Record

MeasureNow = Callable[[Job, "str | None"], Record]  # one job now, on that worker if it is still there


def picks(study: optuna.Study, confirm_top: int) -> list[tuple[int, dict[str, Any]]]:
    """(trial number, config) to re-measure: the best AR baseline, the best reference, then the
    ``confirm_top`` best non-baseline trials, and for each weight form among them other than the
    baseline's the best AR of that form (their break-even AL is against AR with their weights);
    each config once."""
    out: list[tuple[int, dict[str, Any]]] = []
    seen: set[str] = set()
    ranked = results.ranked(study)
    chosen = ([t for t in ranked if st.role_of(t) == "baseline"][:1]  # speculation has to beat AR here too
              + [t for t in ranked if st.role_of(t) == "reference"][:1]
              + [t for t in ranked if st.role_of(t) != "baseline"][:confirm_top])
    forms = sorted({_form(study, t) for t in chosen} - {st.weights_form(study, {})})  # (the baseline's: model.weights)
    chosen += [ar for f in forms for ar in [t for t in ranked if _is_ar(t) and _form(study, t) == f][:1]]
    for t in chosen:
        cfg = t.user_attrs.get("config", {})
        key = repr(sorted(cfg.items()))
        if key not in seen:
            seen.add(key)
            out.append((t.number, cfg))
    return out


def _form(study: optuna.Study, t: optuna.trial.FrozenTrial) -> str:
    return st.weights_form(study, t.user_attrs.get("config") or {})


def _is_ar(t: optuna.trial.FrozenTrial) -> bool:
    return (t.user_attrs.get("config") or {}).get("verify") == "ar"


def run(exp: Experiment, study: optuna.Study, measure_now: MeasureNow, tracker: Any,
        on_start: Callable[[int], None] | None = None, memory_at: tuple[int, int] | None = None) -> None:
    """Re-measure ``picks`` and record the winner (the study's ``confirmation``); nothing when the
    phase is off or already ran over this many finished trials. ``on_start(n)``: the phase starts
    with n configs (a progress bar's label). If every re-measurement is dropped, the study's
    ``confirmation_failed`` keeps the reasons (the report names them). ``memory_at``: where the trials'
    memory was planned and reserved (``Job.memory_at``), so each re-measured config holds its own
    buffers at that length, as in its trial, not the last trial's."""
    m = exp.measure
    finished = st.n_finished(study)
    done = study.user_attrs.get("confirmation")
    if m.confirm_top == 0 or (done and done.get("finished_trials") == finished):
        return
    chosen = picks(study, m.confirm_top)
    if not chosen:
        return
    if on_start is not None:
        on_start(len(chosen))
    cands, ar, ref = [], None, None
    dropped: list[dict[str, Any]] = []  # re-measurements that failed or lost exactness: said, never silent
    worker: str | None = None  # every candidate on one worker: ratios measured side by side
    for number, cfg in chosen:
        job = Job(trial=number, role="confirm", config=cfg, max_new_tokens=exp.workload.max_new_tokens,
                  warmup=m.warmup, repeats=m.confirm_repeats, max_rel_mad=m.max_rel_mad, remeasure_if_noisy=False,
                  prefix_cache_mb=exp.workload.prefix_cache_mb, memory_at=memory_at,
                  vram_limit=exp.model.vram_limit)
        rec = measure_now(job, worker)
        worker = worker or (rec.worker if rec.ok else None)
        role = st.role_of(study.get_trials(deepcopy=False)[number])
        inexact = m.exactness == "strict" and rec.exact_match is not None and rec.exact_match < 1
        unmeasured = rec.refused or rec.over_vram  # (its trial ran: the machine or the limit changed since)
        if not rec.ok or inexact or unmeasured:
            dropped.append({"trial": number, "role": role, "reason": rec.fail_reason if not rec.ok
                            else f"not measured: {unmeasured}" if unmeasured
                            else f"output differs from AR on the re-measurement (exact {rec.exact_match:.2f})"})
            continue
        c = measure.Candidate(trial=number, config=cfg, score=measure.score(rec.runs(exp.objective), m.max_rel_mad))
        cands.append((c, rec))
        ar = c if role == "baseline" else ar
        ref = c if role == "reference" else ref
    for d in dropped:
        tqdm.write(f"confirmation: trial {d['trial']} ({d['role']}) dropped: {d['reason']}", file=sys.stderr)
    win = measure.choose_winner([c for c, _ in cands])
    if win is None:
        study.set_user_attr("confirmation_failed", {"finished_trials": finished, "when": st._now(),
                                                    "dropped": dropped})
        return
    ar_tps = ar.score.median if ar else None
    # break-even AL compares a step with AR's decode rate, whatever the objective, and with AR decoding
    # the same weights: the baseline for its form, another form's re-measured AR for that form's configs
    own_ar = {st.weights_form(study, c.config): (c, measure.median_of(r.decode_tps_runs))
              for c, r in sorted(cands, key=lambda cr: cr[0] is ar) if c.config.get("verify") == "ar"}

    def break_even(c: measure.Candidate, r: Record) -> float | None:
        own, tps = own_ar.get(st.weights_form(study, c.config), (None, None))
        return None if own is None or own is c else measure.break_even_al(r.step_ms, tps)

    conf = {
        "finished_trials": finished, "repeats": m.confirm_repeats, "worker": worker, "objective": exp.objective,
        "when": st._now(), "winner": win.trial, "ties": [c.trial for c in measure.ties([c for c, _ in cands])],
        "ar_median_tps": ar_tps, "winner_median_tps": win.score.median, "winner_spread": win.score.spread,
        "winner_speedup_vs_ar": measure.speedup(win.score.median, ar_tps),
        "positive_vs_ar": None if ar is None or win is ar else measure.is_positive(win.score, ar.score),
        "positive_vs_reference": None if ref is None or win is ref else measure.is_positive(win.score, ref.score),
        "dropped": dropped,
        "candidates": [{"trial": c.trial, "config": c.config, "score": c.score.to_dict(),
                        "speedup_vs_ar": measure.speedup(c.score.median, ar_tps),
                        "break_even_al": break_even(c, r),
                        "decode_tps_median": measure.median_of(r.decode_tps_runs),
                        "exact_match": r.exact_match} for c, r in cands],
    }
    study.set_user_attr("confirmation", conf)
    tracker.log_confirmation(conf)
