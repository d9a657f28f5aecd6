"""The measurement protocol's arithmetic (docs/measurement.md), as pure functions.

- value = median − 1.4826·MAD over the measured passes (a conservative score);
- relative MAD (MAD / median) above ``max_rel_mad`` marks a measurement noisy;
- speedups are median ratios against the nearest AR baseline on the same worker and prompt set;
- break-even AL = step_ms / ar_ms_per_token;
- oracle gate: fraction of steps whose AL beat break-even, and the TPS of an ideal per-step switch;
- the winner: ties within the measured spread go to the simpler config; a positive conclusion
  needs a margin of more than twice the spread;
- drift: two AR measurements of one machine disagree when their medians differ by more than twice
  the larger spread and by more than ``max_drift`` (the experiment's ``measure.max_ar_drift``) of the
  lower; a study with such a pair is unreliable.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

MAD_SCALE = 1.4826  # makes the MAD a consistent estimator of the standard deviation under normality
DEFAULT_BLOCK = 16  # public DFlash drafts; used only to rank chain configs by node count
# AR baselines of one machine closer than this (relative) never count as drift, however tight
# their spreads (the experiment's measure.max_ar_drift overrides it): a GPU's clocks move a few
# percent over a night and a CPU's timings more, which the confirmation's side-by-side ratios absorb;
# a machine that slows 10x under another job does not.
DRIFT_FLOOR = 0.25


@dataclass(frozen=True)
class Score:
    runs: tuple[float, ...]
    median: float
    mad: float
    spread: float  # 1.4826 · MAD, in the unit of the runs
    value: float  # median − spread
    rel_mad: float  # MAD / median
    noisy: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def score(runs: Sequence[float], max_rel_mad: float) -> Score:
    """Score repeated measurements; fail fast on an empty or non-finite run (never guess)."""
    if not runs:
        raise ValueError("score() needs at least one run, but got none")
    bad = [r for r in runs if not math.isfinite(r) or r < 0]
    if bad:
        raise ValueError(f"every run must be a finite, non-negative rate, but got {bad}")
    med = statistics.median(runs)
    mad = statistics.median(abs(r - med) for r in runs)
    rel = mad / med if med > 0 else 0.0
    spread = MAD_SCALE * mad
    return Score(runs=tuple(runs), median=med, mad=mad, spread=spread, value=med - spread, rel_mad=rel,
                 noisy=rel > max_rel_mad)


def speedup(median_tps: float, ar_median_tps: float | None) -> float | None:
    if not ar_median_tps or ar_median_tps <= 0:
        return None
    return median_tps / ar_median_tps


def ar_step_fraction(budget_histogram: dict[str, int]) -> float | None:
    """The adaptive policy's share of plain AR steps (budget 0) among its steps; None without a
    histogram (the fixed policy records none)."""
    total = sum(budget_histogram.values())
    return budget_histogram.get("0", 0) / total if total else None


def break_even_al(step_ms: float, ar_tps: float | None) -> float | None:
    """Speculation beats plain decoding iff AL exceeds this (step_ms / ar_ms_per_token)."""
    if not ar_tps or ar_tps <= 0 or step_ms <= 0:
        return None
    return step_ms / (1000.0 / ar_tps)


@dataclass(frozen=True)
class OracleGate:
    break_even_al: float
    fraction_beating: float  # steps whose AL beat break-even
    speculative_tps: float  # what the per-step record implies for always speculating
    ar_tps: float
    ideal_tps: float  # an ideal per-step switch between speculation and plain decoding (upper bound)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def oracle_gate(accept_lengths: Sequence[int], step_ms: float, ar_tps: float | None) -> OracleGate | None:
    """Could any gating policy help? Each step either costs step_ms for its AL tokens, or AL plain
    decoding steps; an oracle picks the cheaper one per step (ignoring switching costs)."""
    be = break_even_al(step_ms, ar_tps)
    if be is None or not accept_lengths:
        return None
    ar_ms = 1000.0 / ar_tps
    tokens = sum(accept_lengths)
    spec_ms = step_ms * len(accept_lengths)
    ideal_ms = sum(min(step_ms, al * ar_ms) for al in accept_lengths)
    return OracleGate(break_even_al=be, fraction_beating=sum(al > be for al in accept_lengths) / len(accept_lengths),
                      speculative_tps=1000.0 * tokens / spec_ms, ar_tps=ar_tps, ideal_tps=1000.0 * tokens / ideal_ms)


def exactness_violation(exact_match: float | None) -> float:
    """Optuna constraint value: feasible iff <= 0, i.e. every output equal to the AR output."""
    return 0.0 if exact_match is None else 1.0 - exact_match


def complexity(config: dict[str, Any]) -> tuple:
    """Smaller is simpler: fewer verified nodes, a smaller draft window, then the plainer verify."""
    verify = config.get("verify", "ddtree")
    if verify == "ar":
        nodes = 0
    elif verify == "chain":
        nodes = (config.get("block_size") or DEFAULT_BLOCK) - 1
    else:
        nodes = config.get("budget", 0)
    ctx = config.get("target_feat_ctx", 0)
    window = math.inf if ctx == 0 else ctx  # 0 means "attend to everything"
    return (nodes, window, {"ar": 0, "chain": 1, "ddtree": 2}.get(verify, 3), config.get("top_k", 0))


@dataclass(frozen=True)
class Candidate:
    trial: int
    config: dict[str, Any]
    score: Score


def ties(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The leader (highest median) and everyone within the larger of the two measured spreads."""
    if not candidates:
        return []
    leader = max(candidates, key=lambda c: c.score.median)
    return [c for c in candidates
            if leader.score.median - c.score.median <= max(leader.score.spread, c.score.spread)]


def choose_winner(candidates: Sequence[Candidate]) -> Candidate | None:
    """Differences smaller than the spread are ties, broken toward the simpler config."""
    tied = ties(candidates)
    if not tied:
        return None
    return min(tied, key=lambda c: (complexity(c.config), -c.score.median))


def is_positive(best: Score, incumbent: Score) -> bool:
    """A positive conclusion needs a margin of more than twice the (larger) spread."""
    return best.median - incumbent.median > 2.0 * max(best.spread, incumbent.spread)


def far_behind(median: float, spread: float, incumbent_median: float, incumbent_spread: float,
               ratio: float) -> bool:
    """A config is far behind the incumbent when even its optimistic figure (median + spread) times
    ``ratio`` does not reach the incumbent's pessimistic one (median − spread): measured on the same
    slice, it is at least ``ratio`` times slower beyond the noise (the fidelity ladder's stop rule)."""
    return ratio * (median + spread) <= incumbent_median - incumbent_spread


def median_of(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def drifted(a: dict[str, float], b: dict[str, float], max_drift: float = DRIFT_FLOOR) -> bool:
    """Whether two AR measurements (``{"median", "spread"}``, as ``Score.to_dict`` has them)
    disagree beyond the noise: medians apart by more than twice the larger spread and by more than
    ``max_drift`` of the lower."""
    gap = abs(a["median"] - b["median"])
    return gap > 2.0 * max(a["spread"], b["spread"]) and gap > max_drift * min(a["median"], b["median"])
