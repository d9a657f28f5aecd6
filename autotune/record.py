"""What crosses the worker's process boundary: a :class:`Job` in (one config to measure, and how), a
:class:`Record` out (plain, JSON-friendly data), and how a pass's ``engine.BenchResult``s are scored into it
(decode tok/s, step ms, per-prompt rates, the adaptive policy's steps). ``autotune.worker`` measures;
the driver, executors, confirmation and fidelity ladder read and write these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Job:
    trial: int
    role: str  # baseline | reference | search | confirm
    config: dict[str, Any]  # EngineConfig fields of this trial (fixed fields already merged in)
    max_new_tokens: int
    warmup: int
    repeats: int
    max_rel_mad: float
    remeasure_if_noisy: bool = True
    prompts: int | None = None  # measure the first N prompts of every set only (a fidelity rung); None: all
    rung: int | None = None  # the fidelity rung this job measures (autotune.fidelity); None: the full measurement
    # (longest prompt, max_new_tokens) of the whole workload: where the config's device memory is planned,
    # reserved and measured (autotune.vram.memory_at; None: not at all); over vram_limit bytes by its plan,
    # the config is not measured
    memory_at: tuple[int, int] | None = None
    vram_limit: int | None = None
    # a session workload's prefix cache, MiB (a fresh one per set and pass; 0: none); prompts ignore it
    prefix_cache_mb: float = 0.0


@dataclass
class Record:
    """What one job measured. Plain data (JSON-friendly), so it can cross a process boundary."""

    trial: int
    role: str
    worker: str
    config: dict[str, Any]
    rung: int | None = None  # the job's fidelity rung (None: the full measurement)
    ok: bool = True
    fail_reason: str | None = None
    # the engine cannot run the config as asked (engine.Pair.refusal): nothing measured, the
    # reason kept; the driver records the trial as infeasible (constraint "runnable")
    refused: str | None = None
    pruned: bool = False
    device: str = ""
    dtype: str = ""
    decode_tps_runs: list[float] = field(default_factory=list)
    e2e_tps_runs: list[float] = field(default_factory=list)
    # a session workload (empty / None otherwise): per pass, completion tokens / the turns' time (prefill
    # and the prefix cache's commit included); per session its median over passes; time to first token
    # (ms, median over passes and turns) of first and later turns; the later turns' prompt share the
    # prefix cache gave; sessions the replay ended early ("set[i]" -> why)
    session_tps_runs: list[float] = field(default_factory=list)
    per_session_tps: list[float] = field(default_factory=list)
    ttft_first_ms: float | None = None
    ttft_later_ms: float | None = None
    cached_share_later: float | None = None
    turns: int = 0
    sessions_cut: dict[str, str] = field(default_factory=dict)
    remeasured: bool = False
    acceptance_length: float = 0.0
    al_histogram: dict[str, int] = field(default_factory=dict)
    accept_lengths: list[int] = field(default_factory=list)
    # the adaptive step policy (engine.decoding.policy): steps per chosen budget ("0": AR steps), and
    # over its tree steps the mean E[AL] it chose by and the mean AL observed; empty / None when fixed
    budget_histogram: dict[str, int] = field(default_factory=dict)
    policy_predicted_al: float | None = None
    policy_observed_al: float | None = None
    steps: int = 0
    step_ms: float = 0.0
    phase_ms_per_step: dict[str, float] = field(default_factory=dict)
    exact_match: float | None = None
    first_divergence: int | None = None
    inexact_prompts: list[str] = field(default_factory=list)  # "set[i]@position", one per distinct output
    inexact_count: int = 0  # prompts whose output differed from AR's in any pass
    # engine.Divergence of each inexact prompt (the first MAX_DIAGNOSED) as a dict, with its "prompt"
    # ("set[i]"), and their count per verdict (every verdict, zeros included, once outputs are checked)
    divergences: list[dict[str, Any]] = field(default_factory=list)
    divergence_verdicts: dict[str, int] = field(default_factory=dict)
    per_prompt_tps: list[float] = field(default_factory=list)
    per_set: dict[str, dict[str, Any]] = field(default_factory=dict)
    peak_memory_bytes: int = 0  # the passes' peak as the device saw it (every pair the worker holds)
    # engine.MemoryBreakdown.to_dict() at the job's memory_at: measured on CUDA (with the plan's
    # "planned_total", and "idle_pair_bytes": the other weight form's pair, in the device's peak,
    # left out of this config's), else planned; over_vram:
    # why its plan is over the job's vram_limit (nothing measured; the driver records it infeasible)
    memory: dict[str, Any] = field(default_factory=dict)
    over_vram: str | None = None
    loops: dict[str, int] = field(default_factory=dict)  # generations per decode loop that ran (engine stats)
    elapsed_s: float = 0.0
    engine_s: float = 0.0  # wall time inside the engine: bench passes, forensics (overhead = trial wall − this)
    utilisation: dict[str, Any] = field(default_factory=dict)  # {"kind": "gpu"|"cpu", "percent": ...}
    device_unusable: bool = False  # the engine error poisoned the device: the worker process must restart
    interrupted: bool = False  # the worker died mid-job: the trial is failed and its params retried once
    model_loads: int = 0  # how many times this worker process loaded a model pair (Ray actors set it)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def runs(self, objective: str) -> list[float]:
        """The measured passes of ``objective`` (``decode_tps`` or ``session_tps``): what is scored."""
        return self.session_tps_runs if objective == "session_tps" else self.decode_tps_runs


def policy_record(results: Sequence[Any]) -> dict[str, Any]:
    """The adaptive policy's steps over ``results`` (one pass's BenchResults, one per set or one set),
    JSON-friendly (budgets as strings): ``engine.decoding.stats.policy_summary`` of them together."""
    from engine import policy_summary

    got = policy_summary([b for r in results for b in r.step_budgets], [p for r in results for p in r.predicted_al],
                  [a for r in results for a in r.accept_lengths])
    return {**got, "budget_histogram": {str(b): n for b, n in got["budget_histogram"].items()}}


def pass_tps(results: Sequence[Any]) -> float:
    """Decode-only TPS of one pass over every set: Σ(tokens − 1) / Σ decode seconds."""
    tokens = sum(max(p.new_tokens - 1, 0) for r in results for p in r.prompts)
    seconds = sum(r.decode_s for r in results)
    return tokens / seconds if seconds > 0 else 0.0


def pass_step_ms(results: Sequence[Any]) -> float:
    steps = sum(r.steps for r in results)
    return 1000.0 * sum(r.decode_s for r in results) / steps if steps else 0.0


def per_prompt_tps(results: Sequence[Any]) -> list[float]:
    return [p.decode_tps for r in results for p in r.prompts]

