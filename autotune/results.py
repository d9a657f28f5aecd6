"""Reading a finished (or running) study: trial views, the winner, the facts a summary prints.

Every command that reads (`status`, `best`, `report`, `export`, the end-of-sweep summary) goes
through here, so they agree on what "best" means: the confirmed winner when the confirmation
phase ran, otherwise the highest conservative value among feasible trials, marked unconfirmed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune import measure
from autotune.dimensions import describe as describe_fixed
from autotune.study import (
    FINISHED,
    baseline_reuse,
    baseline_reuses,
    counts_toward_budget,
    nearest_form_ar,
    role_of,
    weights_form,
)


def objective(study: optuna.Study) -> str:
    """What the study maximises (the experiment's ``objective``; a study made before the key: decode)."""
    return study.user_attrs.get("objective") or "decode_tps"


def median_key(study: optuna.Study) -> str:
    """The trial attribute holding the objective's median: ``decode_tps_median``, ``session_tps_median``."""
    return f"{objective(study)}_median"


def feasible(t: FrozenTrial) -> bool:
    return all(v <= 0 for v in t.constraints.values())


def completed(study: optuna.Study) -> list[FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))


def ranked(study: optuna.Study) -> list[FrozenTrial]:
    """Feasible completed trials, best conservative value first."""
    return sorted((t for t in completed(study) if feasible(t)), key=lambda t: -(t.value or 0.0))


def refused(study: optuna.Study) -> list[FrozenTrial]:
    """Completed trials the engine could not run as asked (``Record.refused``): infeasible, unmeasured."""
    return [t for t in completed(study) if t.user_attrs.get("refused") is not None]


def infeasible(study: optuna.Study) -> list[FrozenTrial]:
    """Measured, completed trials whose output broke exactness (constraint ``exactness``); refused ones
    and those over the memory limit are apart (``refused``, ``over_vram``)."""
    return [t for t in completed(study) if t.constraints.get("exactness", 0.0) > 0]


def over_vram(study: optuna.Study) -> list[FrozenTrial]:
    """Completed trials over ``model.vram_limit`` (constraint ``vram``): refused on their plan, or
    measured over it (``autotune.vram``)."""
    return [t for t in completed(study) if t.constraints.get("vram", 0.0) > 0]


def state_counts(study: optuna.Study) -> dict[str, int]:
    trials = study.get_trials(deepcopy=False)
    counts = {s.name.lower(): sum(t.state == s for t in trials) for s in TrialState}
    counts["finished"] = sum(counts_toward_budget(t) for t in trials)
    counts["baselines"] = sum(t.state in FINISHED and role_of(t) == "baseline" for t in trials)
    counts["baselines_reused"] = len(baseline_reuses(study))  # workers that took a baseline instead of measuring
    counts["interrupted"] = sum(bool(t.user_attrs.get("interrupted")) for t in trials)
    counts["infeasible"] = len(infeasible(study))
    counts["refused"] = len(refused(study))
    counts["over_vram"] = len(over_vram(study))
    return counts


@dataclass(frozen=True)
class ArMeasurement:
    """One AR measurement of a machine: a baseline trial's, or the confirmation's re-measurement."""

    label: str  # "trial 3" or "trial 3, re-measured in the confirmation"
    median: float
    spread: float


@dataclass(frozen=True)
class Drift:
    """The two AR measurements of one machine that disagree most, when they disagree beyond the
    noise (``measure.drifted``): the study's speedups are not comparable with each other."""

    machine: str
    low: ArMeasurement
    high: ArMeasurement

    @property
    def ratio(self) -> float:
        return self.high.median / self.low.median if self.low.median > 0 else float("inf")

    def describe(self) -> str:
        return (f"AR baselines on {self.machine} disagree {self.ratio:.2f}x: {self.low.label} "
                f"{self.low.median:.2f} ± {self.low.spread:.2f} tok/s against {self.high.label} "
                f"{self.high.median:.2f} ± {self.high.spread:.2f}")


def _machine(t: FrozenTrial) -> str:
    """A baseline's machine: its identity's host and accelerator (one GPU of several by UUID),
    else its worker: AR speeds are compared within one machine only."""
    ident = t.user_attrs.get("identity") or {}
    if ident.get("host"):
        gpu = f" {ident['gpu_uuid']}" if ident.get("gpu_uuid") else ""
        return f"{ident['host']} ({ident.get('accelerator')}{gpu})"
    return f"worker {t.user_attrs.get('worker', '?')}"


def ar_drift(study: optuna.Study) -> Drift | None:
    """Whether the study's AR measurements of one machine disagree beyond the noise: every finished
    baseline trial and the confirmation's AR re-measurement, grouped by machine; the widest pair
    (lowest and highest median) of the first machine that drifted, else None."""
    groups: dict[str, list[ArMeasurement]] = {}
    worker_machine: dict[str, str] = {}
    key = median_key(study)  # the confirmation re-measures the objective: compared in its unit
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        a = t.user_attrs
        if role_of(t) != "baseline" or a.get(key) is None:
            continue
        machine = _machine(t)
        worker_machine[a.get("worker", "")] = machine
        groups.setdefault(machine, []).append(ArMeasurement(f"trial {t.number}", a[key],
                                                            a.get("spread", 0.0)))
    conf = study.user_attrs.get("confirmation") or {}
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    for c in conf.get("candidates", []):
        t = by_number.get(c["trial"])
        if t is not None and role_of(t) == "baseline":
            machine = worker_machine.get(conf.get("worker") or "") or (next(iter(groups)) if len(groups) == 1
                                                                       else f"worker {conf.get('worker')}")
            groups.setdefault(machine, []).append(ArMeasurement(
                f"trial {t.number}, re-measured in the confirmation", c["score"]["median"], c["score"]["spread"]))
    for machine, ms in groups.items():
        low, high = min(ms, key=lambda m: m.median), max(ms, key=lambda m: m.median)
        if measure.drifted(asdict(low), asdict(high), study.user_attrs.get("max_ar_drift", measure.DRIFT_FLOOR)):
            return Drift(machine, low, high)
    return None


@dataclass(frozen=True)
class Winner:
    trial: int
    role: str
    config: dict[str, Any]
    confirmed: bool
    median_tps: float
    spread: float
    value: float
    speedup_vs_ar: float | None
    ar_median_tps: float | None
    positive_vs_ar: bool | None
    positive_vs_reference: bool | None
    acceptance_length: float | None
    break_even_al: float | None
    exact_match: float | None
    device: str
    workload_hash: str
    drift: Drift | None = None  # AR baselines that disagree: no "confirmed" or positive conclusion across it
    # what median_tps, spread, value, speedup_vs_ar and ar_median_tps measure (results.objective);
    # decode_tps: the winner's decode tok/s where the objective is another
    objective: str = "decode_tps"
    decode_tps: float | None = None

    def figures(self, digits: int) -> dict[str, float | None]:
        """The measured figures rounded to ``digits`` (None where not measured), under one set of
        names: what ``summary`` and ``export.provenance`` print under theirs. The objective's median
        and AR's are named after it (``decode_tps``, ``ar_decode_tps``; ``session_tps``, ...), with
        ``decode_tps`` beside them under another objective."""
        def r(v: float | None) -> float | None:
            return None if v is None else round(v, digits)

        other = {"decode_tps": r(self.decode_tps)} if self.objective != "decode_tps" else {}
        return {self.objective: r(self.median_tps), "spread": r(self.spread), "value": r(self.value),
                "speedup_vs_ar": r(self.speedup_vs_ar), f"ar_{self.objective}": r(self.ar_median_tps), **other,
                "acceptance_length": r(self.acceptance_length), "break_even_al": r(self.break_even_al)}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def break_even_al(study: optuna.Study, t: FrozenTrial) -> float | None:
    """``t``'s break-even AL against AR with its own weights: as the driver recorded it, or for a
    config on the other weight form told before any AR of that form was measured (a grid meets them in
    any order), against the nearest AR of its form measured since (``study.nearest_form_ar``)."""
    a = t.user_attrs
    config = a.get("config") or {}
    if a.get("break_even_al") is not None or role_of(t) == "baseline" or "break_even_ar_trial" not in a:
        return a.get("break_even_al")  # (a study told before the key: as it was recorded)
    own = nearest_form_ar(study, t.number, a.get("worker"), a.get("workload_hash"), weights_form(study, config))
    return measure.break_even_al(a.get("step_ms") or 0.0, own.user_attrs["decode_tps_median"] if own else None)


def winner(study: optuna.Study) -> Winner | None:
    conf = study.user_attrs.get("confirmation")
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    if conf and conf.get("winner") is not None and conf["winner"] in by_number:
        t = by_number[conf["winner"]]
        cand = next(c for c in conf["candidates"] if c["trial"] == conf["winner"])
        w = Winner(
            trial=t.number, role=role_of(t), config=t.user_attrs.get("config", {}), confirmed=True,
            median_tps=cand["score"]["median"], spread=cand["score"]["spread"], value=cand["score"]["value"],
            speedup_vs_ar=cand.get("speedup_vs_ar"), ar_median_tps=conf.get("ar_median_tps"),
            positive_vs_ar=conf.get("positive_vs_ar"), positive_vs_reference=conf.get("positive_vs_reference"),
            acceptance_length=t.user_attrs.get("acceptance_length"),
            # re-measured beside the AR of its weights, else as the trial measured it
            break_even_al=cand["break_even_al"] if cand.get("break_even_al") is not None else break_even_al(study, t),
            exact_match=cand.get("exact_match"), device=t.user_attrs.get("device", ""),
            workload_hash=t.user_attrs.get("workload_hash", ""), objective=objective(study),
            decode_tps=cand.get("decode_tps_median", t.user_attrs.get("decode_tps_median")),
        )
        return _across(w, ar_drift(study))
    top = ranked(study)
    if not top:
        return None
    t = top[0]
    a = t.user_attrs
    return Winner(
        trial=t.number, role=role_of(t), config=a.get("config", {}), confirmed=False,
        median_tps=a.get(median_key(study), 0.0), spread=a.get("spread", 0.0), value=t.value or 0.0,
        speedup_vs_ar=a.get("speedup_vs_ar"), ar_median_tps=a.get(f"ar_{objective(study)}"), positive_vs_ar=None,
        positive_vs_reference=None, acceptance_length=a.get("acceptance_length"),
        break_even_al=break_even_al(study, t), exact_match=a.get("exact_match"), device=a.get("device", ""),
        workload_hash=a.get("workload_hash", ""), drift=ar_drift(study), objective=objective(study),
        decode_tps=a.get("decode_tps_median"),
    )


def _across(w: Winner, drift: Drift | None) -> Winner:
    """A confirmed winner across a drift is neither confirmed nor a positive conclusion: the
    machine's AR speed moved beyond the noise within the study (docs/measurement.md)."""
    if drift is None:
        return w
    return replace(w, confirmed=False, positive_vs_ar=None, positive_vs_reference=None, drift=drift)


def baseline_used(study: optuna.Study, t: FrozenTrial) -> str | None:
    """The AR baseline ``t``'s speedup divides by, in words: ``trial N``, and when ``t``'s worker
    reused it (a restart), ``trial N, reused by the restart at WHEN``. None: no speedup."""
    number = t.user_attrs.get("baseline_trial")
    if number is None:
        return None
    if not t.user_attrs.get("baseline_reused"):
        return f"trial {number}"
    reuse = baseline_reuse(study, t.user_attrs.get("worker", ""))
    return f"trial {number}, reused by the restart at {reuse['at'] if reuse else '?'}"


def winner_baseline(study: optuna.Study, w: Winner) -> str | None:
    """The AR measurement the winner's speedup divides by: in a confirmation, the re-measurement of
    the baseline trial it picked; otherwise the winner's own baseline (:func:`baseline_used`)."""
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    if not w.confirmed:
        return baseline_used(study, by_number[w.trial]) if w.trial in by_number else None
    conf = study.user_attrs.get("confirmation") or {}
    ar = next((c["trial"] for c in conf.get("candidates", [])
               if c["trial"] in by_number and role_of(by_number[c["trial"]]) == "baseline"), None)
    return None if ar is None else f"trial {ar}, re-measured in the confirmation"


def applicable_config(config: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``config`` that apply to its verify mode (``EngineConfig.applicable``, the one
    place that knows): an AR or chain config has no budget or top-k. What `best`, the report, the
    export and MLflow show. A config the engine refuses is returned as it is."""
    from engine import EngineConfig, EngineInputError

    try:
        return EngineConfig.from_dict(dict(config), source="config").applicable()
    except EngineInputError:
        return dict(config)


def path_of(config: dict[str, Any]) -> str:
    """The implementation path a config takes (what a tuner must not confuse with parameters)."""
    verify = config.get("verify", "?")
    if verify == "ar":
        return "ar"
    return f"{verify}/{config.get('draft_path', '?')}/{config.get('rollback', '?')}"


def best_per_path(study: optuna.Study, w: Winner | None = None) -> list[tuple[str, FrozenTrial]]:
    """The best feasible trial of each implementation path, best search value first. With ``w`` (the
    study's winner) its path is represented by the winner's own trial and comes first: the
    confirmation can pick another trial than the highest search value (a tie broken toward the
    simpler config), and every section of a report names one winner."""
    best: dict[str, FrozenTrial] = {}
    for t in ranked(study):
        best.setdefault(path_of(t.user_attrs.get("config", {})), t)
    rows = sorted(best.items(), key=lambda kv: -(kv[1].value or 0.0))
    if w is None:
        return rows
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    if w.trial not in by_number:
        return rows
    lead = path_of(w.config)
    return [(lead, by_number[w.trial])] + [(p, t) for p, t in rows if p != lead]


def summary(study: optuna.Study) -> dict[str, Any]:
    """The greppable facts, in a stable order."""
    counts = state_counts(study)
    w = winner(study)
    out: dict[str, Any] = {
        "study": study.study_name,
        "trials_finished": counts["finished"],
        "baselines": counts["baselines"],
        "baselines_reused": counts["baselines_reused"],
        "trials_complete": counts["complete"],
        "trials_pruned": counts["pruned"],
        "trials_failed": counts["fail"],
        "trials_interrupted": counts["interrupted"],
        "trials_running": counts["running"],
        "trials_infeasible": counts["infeasible"],
        "trials_refused": counts["refused"],
        "trials_over_vram": counts["over_vram"],
    }
    if "fixed_dimensions" in study.user_attrs:  # dimensions not searched, and why (autotune.dimensions)
        out["fixed_dimensions"] = describe_fixed(study.user_attrs["fixed_dimensions"]) or None
    drift = w.drift if w is not None else ar_drift(study)  # (the winner carries it: computed once)
    out["reliable"] = drift is None
    if drift is not None:
        out["unreliable_because"] = drift.describe()
    if w is None:
        out["best_trial"] = None
        return out
    f = w.figures(3)
    out.update({
        "best_trial": w.trial,
        "best_role": w.role,
        "best_path": path_of(w.config),
        "best_confirmed": w.confirmed,
        f"best_{w.objective}": f[w.objective],
        "best_spread": f["spread"],
        "best_value": f["value"],
        "best_speedup_vs_ar": f["speedup_vs_ar"],
        f"ar_{w.objective}": f[f"ar_{w.objective}"],
        **({"best_decode_tps": f["decode_tps"]} if w.objective != "decode_tps" else {}),
        "ar_baseline": winner_baseline(study, w),
        "best_acceptance_length": f["acceptance_length"],
        "best_break_even_al": f["break_even_al"],
        "positive_vs_ar": w.positive_vs_ar,
        "positive_vs_reference": w.positive_vs_reference,
        "device": w.device,
        "workload_hash": w.workload_hash,
    })
    return out


def format_summary(facts: dict[str, Any]) -> str:
    return "\n".join(f"{k}: {'none' if v is None else v}" for k, v in facts.items())


PHASES = ("draft", "topk", "tree", "verify", "walk", "commit")  # a speculative step's timed phases, in order

# what each objective's tok/s is, in a table header and in the winner's line
UNITS = {"decode_tps": ("decode tok/s", "decode-only"),
         "session_tps": ("session tok/s", "session tok/s (completion tokens / session time, prefill included)")}


def unit(study: optuna.Study, long: bool = False) -> str:
    return UNITS.get(objective(study), UNITS["decode_tps"])[int(long)]


def speculative_lead(study: optuna.Study, w: Winner | None) -> list[FrozenTrial]:
    """The winner when it is speculative, else the best speculative trial (at most one)."""
    if w is not None and w.role != "baseline":
        found = [t for t in completed(study) if t.number == w.trial]
        if found:
            return found
    return [t for t in ranked(study) if role_of(t) != "baseline"][:1]
