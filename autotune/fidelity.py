"""Multi-fidelity: a config is measured on cheap slices of the workload before the full measurement,
and one far behind the incumbent there stops (successive halving over prompts and tokens).

A rung is a slice: the first ``prompts`` prompts of every workload set, ``max_new_tokens`` tokens
each, with fewer passes than the full measurement (``rung_warmup`` and ``rung_repeats``, at most the
experiment's: a rung only has to tell a config 2x behind, and the runtime path's spread is well under
1%). A search trial runs its rungs in order, then the
full measurement. After each rung the driver compares it with the incumbent (the study's best
feasible trial among those measured at that rung, ``autotune.results.ranked``) on the *same* rung:
like with like, since short generations and the first prompts run at other rates than the whole
workload. It stops there when
even its optimistic figure (median + spread) is ``stop_ratio`` times slower than the incumbent's
pessimistic one (median − spread, the spread the protocol uses everywhere: 1.4826·MAD):
:func:`autotune.measure.far_behind`. A stopped trial is PRUNED with no value (its rung's median in
``partial_decode_tps``, the reason in ``pruned_reason``, the rung in ``pruned_at_rung``).

What a rung measures is kept per rung in the trial's ``fidelity`` attribute, exactness included, as
measured on that slice only: a trial stopped at a rung is not called exact or inexact (its
top-level ``exact_match`` stays unset). The AR baseline runs every rung too (never stopped), so each
rung's speedup divides by AR measured on the same slice; the reference config runs every rung and
is never stopped either (the report compares the winner with it). With no rungs (``fidelity:
{rungs: []}``) a trial is the one full measurement, as before.

Experiment YAML (``fidelity:``; every key optional)::

    fidelity:
      rungs: [{prompts: 1, max_new_tokens: 32}]   # cheapest first; [] turns multi-fidelity off
      stop_ratio: 2.0                              # stop a config this many times slower (after the spread)
      rung_warmup: 1                               # passes per rung, at most measure.warmup / repeats
      rung_repeats: 3

Without ``rungs`` the default ladder is one rung of 1 prompt per set and 32 tokens, used where the
full measurement is at least :data:`DEFAULT_MIN_SAVING` times its work (prompts × tokens per set);
a smaller workload (the CPU quickstart, the tests) is measured in full at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from optuna.trial import FrozenTrial

from autotune import measure
from autotune.record import Job, Record

DEFAULT_STOP_RATIO = 2.0
MAX_STOP_RATIO = 1000.0
DEFAULT_MIN_SAVING = 4  # the default rung runs where the full measurement is at least this many times its work
# Passes of a rung (each capped by the experiment's own): on the H200's flagship experiment (2 warm-ups
# + 5 repeats) a generic-path trial stopped at the rung still took 7-17 s of its 7 passes (2026-12-04).
DEFAULT_RUNG_WARMUP = 1
DEFAULT_RUNG_REPEATS = 3


@dataclass(frozen=True)
class Rung:
    prompts: int  # the first N prompts of every workload set
    max_new_tokens: int

    def label(self) -> str:
        return f"{self.prompts} prompt{'s' if self.prompts != 1 else ''} per set, {self.max_new_tokens} tokens"

    def matches(self, measured: dict[str, Any]) -> bool:
        return measured.get("prompts") == self.prompts and measured.get("max_new_tokens") == self.max_new_tokens


DEFAULT_RUNG = Rung(prompts=1, max_new_tokens=32)


@dataclass(frozen=True)
class FidelitySpec:
    rungs: tuple[Rung, ...] | None = None  # None: the default ladder, decided against the workload
    stop_ratio: float = DEFAULT_STOP_RATIO
    rung_warmup: int = DEFAULT_RUNG_WARMUP  # passes a rung runs, each at most the full measurement's
    rung_repeats: int = DEFAULT_RUNG_REPEATS

    def ladder(self, n_prompts: int, max_new_tokens: int) -> tuple[Rung, ...]:
        """The rungs a trial runs before its full measurement of ``n_prompts`` × ``max_new_tokens``."""
        if self.rungs is not None:
            return self.rungs
        work = DEFAULT_RUNG.prompts * DEFAULT_RUNG.max_new_tokens
        return (DEFAULT_RUNG,) if n_prompts * max_new_tokens >= DEFAULT_MIN_SAVING * work else ()


def jobs(full: Job, ladder: tuple[Rung, ...], spec: FidelitySpec) -> list[Job]:
    """The jobs of one trial: each rung with the spec's passes, capped by the full measurement's (no
    re-measurement of a noisy rung: its spread speaks), then the full measurement."""
    warmup, repeats = min(full.warmup, spec.rung_warmup), min(full.repeats, spec.rung_repeats)
    # (dataclasses.replace: the rest of the full job, its memory plan's context and limit, carries over)
    return [dataclasses.replace(full, max_new_tokens=r.max_new_tokens, warmup=warmup, repeats=repeats,
                                remeasure_if_noisy=False, prompts=r.prompts, rung=i)
            for i, r in enumerate(ladder)] + [full]


def stage(job: Job, ladder: tuple[Rung, ...]) -> str | None:
    """Where a trial with a ladder is, for the progress bar: ``rung 0 (1 prompt per set, 32 tokens)``
    or ``full measurement``; None without a ladder (there is one stage)."""
    if not ladder:
        return None
    return "full measurement" if job.rung is None else f"rung {job.rung} ({ladder[job.rung].label()})"


def rung_record(rung: Rung, index: int, rec: Record, max_rel_mad: float,
                ar: dict[str, Any] | None, objective: str = "decode_tps") -> dict[str, Any]:
    """What one rung measured (JSON-friendly), with its speedup over AR measured on the same slice
    (``ar``: the baseline's record of this rung, None when there is none). ``median`` and ``spread``
    are the ``objective``'s (a session rung's slice: its first sessions, shorter replies)."""
    score = measure.score(rec.runs(objective), max_rel_mad)
    ar_tps = ar.get("median") if ar else None
    return {"rung": index, "prompts": rung.prompts, "max_new_tokens": rung.max_new_tokens,
            "decode_tps_runs": rec.decode_tps_runs,
            **({"session_tps_runs": rec.session_tps_runs} if objective == "session_tps" else {}),
            "median": score.median, "spread": score.spread,
            f"ar_{objective}": ar_tps, "speedup_vs_ar": measure.speedup(score.median, ar_tps),
            "acceptance_length": rec.acceptance_length, "exact_match": rec.exact_match,
            "elapsed_s": round(rec.elapsed_s, 4), "engine_s": round(rec.engine_s, 4)}


def measured_at(t: FrozenTrial, rung: Rung) -> dict[str, Any] | None:
    """``t``'s record of ``rung`` (matched by the slice, not the index: a resumed study may have
    another ladder), or None."""
    return next((r for r in t.user_attrs.get("fidelity", []) if rung.matches(r)), None)


def inexact_reason(rung: Rung, measured: dict[str, Any], exactness: str) -> str | None:
    """Why a search trial stops at ``rung`` under ``exactness: strict``: an output of the slice that
    differs from AR's (None: all equal, or exactness is only reported). Decoding is deterministic per
    prompt, and the full measurement decodes the same prompts further: it cannot make the config exact."""
    share = measured.get("exact_match")
    if exactness != "strict" or share is None or share >= 1.0:
        return None
    return (f"stopped at rung {measured['rung']} ({rung.label()}): {1.0 - share:.0%} of its outputs differ "
            f"from AR's (exactness: strict; decoding further cannot make them equal)")


def stop_reason(ranked: list[FrozenTrial], rung: Rung, measured: dict[str, Any], ratio: float) -> str | None:
    """Why a search trial stops at ``rung`` (None: it goes on): far behind the incumbent, the best
    of ``ranked`` (the study's feasible trials, best first) measured at the same rung. Trials measured
    without that rung (before a ladder was set, on a resume) are passed over: comparing with a weaker
    trial that has the rung only stops less. None measured there yet: it goes on."""
    incumbent = next((t for t in ranked if measured_at(t, rung) is not None), None)
    if incumbent is None:
        return None
    theirs = measured_at(incumbent, rung)
    if not measure.far_behind(measured["median"], measured["spread"], theirs["median"], theirs["spread"], ratio):
        return None
    return (f"stopped at rung {measured['rung']} ({rung.label()}): {measured['median']:.2f} ± "
            f"{measured['spread']:.2f} tok/s is {ratio:g}x or more slower, after the spread, than the incumbent "
            f"trial {incumbent.number} measured there ({theirs['median']:.2f} ± {theirs['spread']:.2f})")
