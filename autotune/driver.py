"""The driver's loop (``autotune.sweep`` sets it up): ask → measure on a warm worker → score → tell →
log, then confirm the winner. The only writer to the Optuna storage and to MLflow; the trial order
per worker, baseline reuse, fidelity rungs and the budget shared by several drivers are described in
``autotune.sweep``'s docstring."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

import optuna
from optuna.samplers import GridSampler
from optuna.trial import TrialState
from tqdm import tqdm

from autotune import confirm, fidelity, measure, results, vram
from autotune import study as st
from autotune.executors import Executor
from autotune.experiment import Experiment
from autotune.interrupt import CtrlC
from autotune.progress import Progress
from autotune.record import Job, Record
from autotune.storage import BudgetLock
from autotune.worker import PassCallback
from engine import EngineConfig, EngineInputError

if TYPE_CHECKING:
    from autotune.sweep import SweepOptions

POLL_S = 2.0  # how often a driver with nothing to start looks at the trials other drivers still run


@dataclass
class _InFlight:
    trial: optuna.trial.Trial
    worker: str
    heartbeat: st.Heartbeat
    started: float
    reported: bool  # the pruning callback reported per-prompt values already
    todo: list[Job] = field(default_factory=list)  # the trial's jobs after the running one (fidelity rungs, full)
    prune: PassCallback | None = None  # the pruning callback, for the full measurement


class _Driver:
    def __init__(self, exp: Experiment, opts: SweepOptions, study: optuna.Study, executor: Executor,
                 tracker: Any, wl_hash: str, out: TextIO, ctrl_c: CtrlC, budget_lock: BudgetLock) -> None:
        self.exp, self.opts, self.study, self.executor = exp, opts, study, executor
        self.ctrl_c = ctrl_c
        self.tracker, self.wl_hash, self.out = tracker, wl_hash, out
        self.budget_lock = budget_lock
        self.workers: list[str] = []
        self.inflight: dict[int, _InFlight] = {}  # trial number -> the job measuring it
        self.popped: optuna.trial.Trial | None = None  # asked, not yet submitted (an interrupt may land here)
        self.progress: Progress | None = None
        self._identities: dict[str, dict[str, Any] | None] = {}  # worker -> identity (fixed per process)
        self.memory_at: tuple[int, int] | None = None  # where each trial's memory is planned (vram.memory_at)

    # ---------------------------------------------------------------- the loop
    def loop(self, started: float) -> None:
        """Keep every idle worker busy until ``n_trials`` finished (all drivers together)."""
        total = self.opts.n_trials
        self.progress = Progress(self.study.study_name, total, st.n_finished(self.study), self.opts.progress)
        self.progress.update(self.study)
        if self.opts.progress:
            self.executor.on_progress = self.progress.tick
        while True:
            self.ctrl_c.checkpoint()
            out_of_time = self.opts.timeout_s is not None and self.opts.clock() - started > self.opts.timeout_s
            grid_done = False
            if not out_of_time:
                grid_done = self._dispatch(total)
            if self.inflight or not self.executor.idle_workers():
                with self.ctrl_c.measuring():
                    records = self.executor.wait()
                for rec in records:
                    self._finish(rec)
                continue
            if out_of_time:
                tqdm.write(f"timeout: {self.opts.timeout_s:.0f}s reached, no new trials", file=sys.stderr)
                return
            if grid_done:
                tqdm.write("grid: every point was measured", file=sys.stderr)
                return
            finished, running = st.budget_state(self.study)
            if finished < total and running:
                # another driver's trials hold the rest of the budget; one may still fail and need a rerun
                time.sleep(POLL_S)
                continue
            return

    def _dispatch(self, total: int) -> bool:
        """Start a trial on every idle worker while budget is left; True when the grid is exhausted."""
        for worker in self.executor.idle_workers():
            with self.budget_lock:
                st.recover_stale(self.study)  # another driver on this host that died leaves no trial RUNNING
                if sum(st.budget_state(self.study)) >= total:  # running trials hold budget until they finish
                    return False
                self._plan(worker)
                if st.grid_exhausted(self.study) and not self._waiting():
                    return True
                self.popped = self._ask(worker)
            self.start_trial(self.popped, worker)
            self.popped = None
        return False

    def _ask(self, worker: str) -> optuna.trial.Trial:
        """Ask for the next trial, its driver recorded before it is RUNNING.

        ``ask()`` runs the sampler after the trial is already RUNNING in the storage; a driver killed
        during that window would leave a RUNNING trial that names no driver. Queuing the trial first
        (with no fixed params, so the sampler still chooses everything) closes that window. The grid
        sampler assigns grid points only to trials it was not handed, so it asks directly.
        """
        if not self._waiting() and not isinstance(self.study.sampler, GridSampler):
            st.enqueue(self.study, "search", driver=st.me(), worker=worker)
        return self.study.ask()

    def _waiting(self) -> bool:
        return bool(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def _plan(self, worker: str) -> None:
        """Queue what must run before the sampler's next suggestion (lazily, one at a time)."""
        if self._waiting():
            return
        if st.needs_baseline(self.study, worker, self.exp.measure.baseline_every) and not self._reuse_baseline(worker):
            st.enqueue(self.study, "baseline", driver=st.me(), worker=worker)
        elif retries := st.pending_retries(self.study):
            t = retries[0]
            st.enqueue(self.study, st.role_of(t), dict(t.params), retry_of=t.number, driver=st.me(), worker=worker)
        elif not st.has_role(self.study, "reference"):
            st.enqueue(self.study, "reference", driver=st.me(), worker=worker)

    def _reuse_baseline(self, worker: str) -> bool:
        """A worker without a baseline of its own takes a recent one measured under its identity
        (``st.reusable_baseline``) instead of measuring AR again; True when it did."""
        found = st.reusable_baseline(self.study, worker, self.identity(worker), self.exp.measure.baseline_max_age)
        if found is None:
            return False
        reuse = st.reuse_baseline(self.study, worker, found)
        age = "" if reuse["age_s"] is None else f", measured {reuse['age_s'] / 60:.0f} min ago"
        tqdm.write(f"baseline: trial {found.number} reused by worker {worker} (same machine, code, models, prompts "
                   f"and settings{age})", file=sys.stderr)
        return True

    def identity(self, worker: str) -> dict[str, Any] | None:
        """What an AR baseline measured on ``worker`` depends on: the models (and how the target holds
        its weights: ``model.weights``), the prompts actually
        used (their hash), ``max_new_tokens``, the measurement settings, the AR config with every
        field resolved, and the worker's environment (``Worker.environment``: host, accelerator,
        device, dtype, threads, torch, the measuring code, AR's loop and kernels). Recorded on each
        baseline as ``identity``; a baseline is reused only under an equal one. None when the
        executor cannot describe the worker."""
        if worker not in self._identities:
            env = self.executor.environment(worker)
            m = self.exp.measure
            identity = None if not env else {
                "target": self.exp.model.target, "draft": self.exp.model.draft, "weights": self.exp.model.weights,
                "workload_hash": self.wl_hash,
                "max_new_tokens": self.exp.workload.max_new_tokens, "warmup": m.warmup, "repeats": m.repeats,
                "max_rel_mad": m.max_rel_mad, "ar_config": self._full(self.config_for(None, "baseline"), "AR baseline"),
                # a reused baseline must hold AR measured at every rung of this ladder
                **({"fidelity": [[r.prompts, r.max_new_tokens] for r in self.exp.ladder]} if self.exp.ladder else {}),
                **env}
            # stored as JSON (lists for tuples): compared in the form a storage gives back
            self._identities[worker] = None if identity is None else json.loads(json.dumps(identity, sort_keys=True))
        return self._identities[worker]

    def config_for(self, trial: optuna.trial.Trial | None, role: str) -> dict[str, Any]:
        fixed = self.exp.fixed_engine
        if role == "baseline":
            return {**fixed, "verify": "ar"}
        if role == "reference":
            return {**st.REFERENCE, **fixed}
        assert trial is not None  # a search trial's config is the sampler's suggestion
        return {**fixed, **self.exp.fixed_dimension_values, **self.exp.space.suggest(trial)}

    @staticmethod
    def _full(config: dict[str, Any], source: str) -> dict[str, Any]:
        """Every field, defaults included: provenance, paths, dedup and identities need the full config."""
        try:
            return EngineConfig.from_dict(config, source=source).to_dict()
        except EngineInputError:
            return config  # the worker turns the engine's refusal into the trial's fail_reason

    def start_trial(self, trial: optuna.trial.Trial, worker: str) -> None:
        role = trial.user_attrs.get("role", "search")
        config = self._full(self.config_for(trial, role), f"trial {trial.number}")
        attrs = {"role": role, "driver": st.me(), "worker": worker, "workload_hash": self.wl_hash, "config": config}
        if role == "baseline" and (identity := self.identity(worker)) is not None:
            attrs["identity"] = identity  # what a later worker's baseline must equal to reuse this one
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        m = self.exp.measure
        full = Job(trial=trial.number, role=role, config=config, max_new_tokens=self.exp.workload.max_new_tokens,
                   warmup=m.warmup, repeats=m.repeats, max_rel_mad=m.max_rel_mad, memory_at=self.memory_at,
                   vram_limit=self.exp.model.vram_limit, prefix_cache_mb=self.exp.workload.prefix_cache_mb)
        # the cheap rungs first (fewer passes), then the full measurement
        first, *todo = fidelity.jobs(full, self.exp.ladder, self.exp.fidelity)
        prune = self._pruning_callback(trial) if role == "search" and self.exp.study.pruner != "none" else None
        heartbeat = st.Heartbeat(trial).__enter__()
        self.inflight[trial.number] = _InFlight(trial, worker, heartbeat, time.monotonic(), prune is not None,
                                                todo, prune)
        if self.progress:
            self.progress.phase(role, trial.number, self.study, fidelity.stage(first, self.exp.ladder))
        self.executor.submit(first, None if todo else prune, worker=worker)

    def _finish(self, rec: Record) -> None:
        job = self.inflight.get(rec.trial)
        if job is None:
            return  # not a trial of this loop (cannot happen with the executors here)
        stopped = None
        if rec.rung is not None and rec.ok and rec.refused is None and rec.over_vram is None:
            try:
                stopped = self._rung_done(job, rec)
            except ValueError as exc:  # NaN or negative rate: fail fast, never guess a value
                rec.ok, rec.fail_reason = False, f"bad measurement at rung {rec.rung}: {exc}"
            if rec.ok and stopped is None:
                nxt = job.todo.pop(0)  # the trial goes on at the next rung, on the same worker
                if self.progress:
                    self.progress.phase(rec.role, rec.trial, self.study, fidelity.stage(nxt, self.exp.ladder))
                self.executor.submit(nxt, None if job.todo else job.prune, worker=job.worker)
                return
            rec.pruned = stopped is not None
        del self.inflight[rec.trial]
        job.heartbeat.__exit__()
        self.tell(job.trial, rec, reported=job.reported, wall_s=time.monotonic() - job.started, stopped=stopped)
        frozen = self.study.get_trials(deepcopy=False)[job.trial.number]
        self.tracker.log_trial(frozen)
        if self.progress:
            self.progress.update(self.study, advance=int(st.counts_toward_budget(frozen)))

    def _rung_done(self, job: _InFlight, rec: Record) -> str | None:
        """Record what a fidelity rung measured on the trial (``fidelity``); a search trial inexact
        there under strict exactness, or far behind the incumbent measured at that rung, stops: the
        reason, else None (``autotune.fidelity``)."""
        rung = self.exp.ladder[rec.rung]
        role = st.role_of(job.trial)
        base = None if role == "baseline" else st.nearest_baseline(self.study, rec.trial, rec.worker, self.wl_hash)
        measured = fidelity.rung_record(rung, rec.rung, rec, self.exp.measure.max_rel_mad,
                                        fidelity.measured_at(base, rung) if base is not None else None,
                                        self.exp.objective)
        done = [*job.trial.user_attrs.get("fidelity", []), measured]
        job.trial.set_user_attr("fidelity", done)
        if role != "search":  # the baseline and the reference are measured in full: the yardsticks
            return None
        return (fidelity.inexact_reason(rung, measured, self.exp.measure.exactness)
                or fidelity.stop_reason(results.ranked(self.study), rung, measured, self.exp.fidelity.stop_ratio))

    def _pruning_callback(self, trial: optuna.trial.Trial) -> PassCallback:
        def on_first_pass(per_prompt_tps: list[float]) -> bool:
            with self.ctrl_c.holding():
                for step, tps in enumerate(per_prompt_tps):
                    trial.report(tps, step)
                return trial.should_prune()
        return on_first_pass

    # ---------------------------------------------------------------- scoring
    def tell(self, trial: optuna.trial.Trial, rec: Record, reported: bool, wall_s: float | None = None,
             stopped: str | None = None) -> None:
        """Score ``rec`` and tell the study; ``stopped``: why the trial stopped at ``rec``'s fidelity rung."""
        # trial_wall_s: the first job's submit (a rung's, with a ladder) → this record back at the driver;
        # engine_s is this job's alone: without a ladder, wall minus engine is the executor's overhead
        attrs: dict[str, Any] = {"device": rec.device, "elapsed_s": round(rec.elapsed_s, 3),
                                 "trial_wall_s": round(rec.elapsed_s if wall_s is None else wall_s, 4),
                                 "engine_s": round(rec.engine_s, 4),
                                 "worker": rec.worker or trial.user_attrs.get("worker")}
        if rec.utilisation:  # NVML GPU or process CPU utilisation of the worker during this job
            attrs.update(utilisation=rec.utilisation, util_percent=rec.utilisation.get("percent"))
        if rec.model_loads:
            attrs["worker_model_loads"] = rec.model_loads
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        if not rec.ok:
            trial.set_user_attr("fail_reason", rec.fail_reason)
            if rec.interrupted:  # the worker died: not a verdict on the config, so its params run once more
                trial.set_user_attr("interrupted", True)
            tqdm.write(f"trial {trial.number} FAIL: {rec.fail_reason}", file=sys.stderr)
            self.study.tell(trial, state=TrialState.FAIL)
            return
        if rec.refused is not None or rec.over_vram is not None:
            self.tell_refused(trial, rec.refused or rec.over_vram, rec.memory if rec.refused is None else None)
            return
        if rec.pruned:  # a partial figure, never a value
            if stopped is not None:  # at a cheap fidelity rung (its figures are in the trial's `fidelity`)
                trial.set_user_attr("pruned_at_rung", rec.rung)
                tqdm.write(f"trial {trial.number} PRUNED: {stopped}", file=sys.stderr)
            else:  # by the pruner, after the first measured pass
                trial.set_user_attr(f"{self.exp.objective}_runs", rec.runs(self.exp.objective))
            unit = "session" if self.exp.objective == "session_tps" else "prompt"
            st.tell_pruned(self.study, trial, measure.median_of(rec.decode_tps_runs), stopped or (
                f"the pruner: its per-{unit} tok/s after the first pass were significantly below the best trial's"))
            return
        try:
            score = measure.score(rec.runs(self.exp.objective), self.exp.measure.max_rel_mad)
        except ValueError as exc:  # NaN or negative rate: fail fast, never guess a value
            trial.set_user_attr("fail_reason", f"bad measurement: {exc}")
            self.study.tell(trial, state=TrialState.FAIL)
            return
        attrs = self.score_attrs(trial.number, rec, score)
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        if not reported:
            for step, tps in enumerate(rec.per_session_tps if self.exp.objective == "session_tps"
                                       else rec.per_prompt_tps):
                trial.report(tps, step)
        self._constrain(trial, rec)
        self.study.tell(trial, score.value)

    def _constrain(self, trial: optuna.trial.Trial, rec: Record) -> None:
        """A measured trial's constraints: ``exactness`` (under ``exactness: strict``) and, under
        ``model.vram_limit``, ``vram`` (its peak, measured or planned: ``autotune.vram``); each
        violation said on stderr."""
        if self.exp.measure.exactness == "strict":
            trial.set_constraint("exactness", measure.exactness_violation(rec.exact_match))
        if rec.exact_match is not None and rec.exact_match < 1.0:
            verdict = "INFEASIBLE" if self.exp.measure.exactness == "strict" else "recorded (exactness: report)"
            tqdm.write(f"trial {trial.number} INEXACT: exact_match={rec.exact_match:.2f} first_divergence="
                       f"{rec.first_divergence} prompts={rec.inexact_prompts[:4]} "
                       f"verdicts={rec.divergence_verdicts} -> {verdict}", file=sys.stderr)
        over = vram.record(trial, rec.memory, self.exp.model.vram_limit)
        if over is not None:
            tqdm.write(f"trial {trial.number} OVER VRAM: {over} -> INFEASIBLE", file=sys.stderr)

    def tell_refused(self, trial: optuna.trial.Trial, reason: str, memory: dict[str, Any] | None = None) -> None:
        """A config that cannot run as asked, nothing measured: the engine refuses it (``draft_path:
        runtime`` where the runtime cannot run it), or with ``memory`` (its plan, ``autotune.vram``) it
        needs more than ``model.vram_limit``. A complete, infeasible trial (constraint ``runnable`` 1,
        or ``vram``: the fraction over the limit; value 0), so that TPE learns to avoid the region (a
        failed trial would teach it nothing) and it never wins. A baseline or reference refused is a
        failure: nothing can be compared without it."""
        if memory is None:
            trial.set_user_attr("refused", reason)
        else:
            vram.record(trial, memory, self.exp.model.vram_limit)
        what = "refused by the engine" if memory is None else "not measured, over the memory limit"
        if trial.user_attrs.get("role", "search") != "search":
            trial.set_user_attr("fail_reason", f"{what}: {reason}")
            tqdm.write(f"trial {trial.number} FAIL: {what}: {reason}", file=sys.stderr)
            self.study.tell(trial, state=TrialState.FAIL)
            return
        if memory is None:
            trial.set_constraint("runnable", 1.0)
        tqdm.write(f"trial {trial.number} {'REFUSED' if memory is None else 'OVER VRAM'}: {reason} -> INFEASIBLE",
                   file=sys.stderr)
        self.study.tell(trial, 0.0)

    def score_attrs(self, number: int, rec: Record, score: measure.Score) -> dict[str, Any]:
        """The trial's attributes. ``score`` is the objective's (``spread``, ``rel_mad``, ``noisy`` and
        ``speedup_vs_ar`` are its); ``decode_tps_median`` is always decode tok/s, and under
        ``session_tps`` the session figures sit beside it (``session_tps_median`` the objective's)."""
        is_base = rec.role == "baseline"
        # A baseline is its own AR reference; everything else is compared with the nearest one.
        base = st.nearest_baseline(self.study, number, rec.worker, self.wl_hash)
        decode = measure.median_of(rec.decode_tps_runs)
        ar_tps = decode if is_base else (base.user_attrs.get("decode_tps_median") if base else None)
        sessions = self.exp.objective == "session_tps"
        ar_value = ar_tps if not sessions else score.median if is_base else (
            base.user_attrs.get("session_tps_median") if base else None)
        phase_sum = sum(rec.phase_ms_per_step.values())
        attrs: dict[str, Any] = {
            "decode_tps_runs": rec.decode_tps_runs, "e2e_tps_runs": rec.e2e_tps_runs,
            "decode_tps_median": decode, "spread": score.spread, "rel_mad": score.rel_mad,
            "noisy": score.noisy, "remeasured": rec.remeasured,
            "e2e_tps_median": measure.median_of(rec.e2e_tps_runs),
            "acceptance_length": rec.acceptance_length, "al_histogram": rec.al_histogram, "steps": rec.steps,
            "step_ms": rec.step_ms, "phase_ms_per_step": rec.phase_ms_per_step,
            "phase_coverage": phase_sum / rec.step_ms if rec.step_ms > 0 else None,
            "exact_match": rec.exact_match, "first_divergence": rec.first_divergence,
            "inexact_prompts": rec.inexact_prompts[:20], "inexact_count": rec.inexact_count,
            # why each inexact prompt differs: its first divergence's top-2 margins (AR's, the run's)
            # and verdict (engine.Divergence), and the count per verdict
            "divergences": rec.divergences, "divergence_verdicts": rec.divergence_verdicts,
            "peak_memory_bytes": rec.peak_memory_bytes,
            # the adaptive step policy's choices (empty / None under the fixed policy)
            "budget_histogram": rec.budget_histogram,
            "policy_ar_step_fraction": measure.ar_step_fraction(rec.budget_histogram),
            "policy_predicted_al": rec.policy_predicted_al, "policy_observed_al": rec.policy_observed_al,
            "decode_loops": rec.loops,  # what ran: `auto` takes the runtime's graphs or the generic loop
            "ar_decode_tps": ar_tps, "speedup_vs_ar": measure.speedup(score.median, ar_value),
            "baseline_trial": number if is_base else (base.number if base else None),
            # the baseline was measured by another worker and reused by this one (after a restart)
            "baseline_reused": not is_base and base is not None and base.user_attrs.get("worker") != rec.worker,
        }
        if sessions:  # the objective's figures, and decode's speedup beside them
            attrs.update(session_tps_runs=rec.session_tps_runs, session_tps_median=score.median,
                         per_session_tps=rec.per_session_tps, ar_session_tps=ar_value,
                         decode_speedup_vs_ar=measure.speedup(decode, ar_tps), ttft_first_ms=rec.ttft_first_ms,
                         ttft_later_ms=rec.ttft_later_ms, cached_share_later=rec.cached_share_later,
                         turns=rec.turns, sessions_cut=rec.sessions_cut)
        own = None  # the AR with this config's weights (break-even and the oracle gate compare with it)
        if is_base:
            key = "session_tps_median" if sessions else "decode_tps_median"
            prev_tps = base.user_attrs.get(key) if base else None
            attrs["ar_drift"] = measure.speedup(score.median, prev_tps)  # machine drift between baselines
            attrs["break_even_al"] = None  # AR has no speculative step to break even with
        else:
            # speculation against plain decoding with the same weights: on the other weight form, that
            # form's AR (a `verify: ar` trial of it), not the baseline (whose weights are model.weights)
            form = rec.config.get("weights")
            own = base if form in (None, self.exp.model.weights) else st.nearest_form_ar(
                self.study, number, rec.worker, self.wl_hash, form)
            own_tps = own.user_attrs.get("decode_tps_median") if own else None
            attrs["break_even_ar_trial"] = own.number if own else None
            attrs["break_even_al"] = measure.break_even_al(rec.step_ms, own_tps)
            gate = measure.oracle_gate(rec.accept_lengths, rec.step_ms, own_tps)
            attrs["oracle_gate_fraction"] = gate.fraction_beating if gate else None
            attrs["oracle_gate_tps"] = gate.ideal_tps if gate else None
        base_sets = base.user_attrs.get("per_set", {}) if base else {}
        own_sets = own.user_attrs.get("per_set", {}) if own else {}
        per_set = {}
        for name, s in rec.per_set.items():
            ar_set = s["decode_tps_median"] if is_base else base_sets.get(name, {}).get("decode_tps_median")
            gate = None if is_base else measure.oracle_gate(s["accept_lengths"], s["step_ms"],
                                                            own_sets.get(name, {}).get("decode_tps_median"))
            per_set[name] = {k: v for k, v in s.items() if k != "accept_lengths"}
            per_set[name]["policy_ar_step_fraction"] = measure.ar_step_fraction(s.get("budget_histogram", {}))
            per_set[name].update(ar_decode_tps=ar_set, speedup_vs_ar=measure.speedup(s["decode_tps_median"], ar_set),
                                 oracle_gate=gate.to_dict() if gate else None)
            if sessions:
                ar_sess = s["session_tps_median"] if is_base else base_sets.get(name, {}).get("session_tps_median")
                per_set[name].update(ar_session_tps=ar_sess,
                                     session_speedup_vs_ar=measure.speedup(s["session_tps_median"], ar_sess))
        attrs["per_set"] = per_set
        return attrs

    # ---------------------------------------------------------------- confirmation
    def confirm(self) -> None:
        """The confirmation phase (``autotune.confirm``) on this driver's workers."""
        confirm.run(self.exp, self.study, self._measure_now, self.tracker,
                    self.progress.confirming if self.progress else None, memory_at=self.memory_at)
        if self.progress:
            self.progress.update(self.study)  # the bar ends on the winner the summary and the report name

    def _measure_now(self, job: Job, worker: str | None) -> Record:
        """One job outside the trial loop (nothing else in flight), on ``worker`` if it is still there."""
        while not (idle := self.executor.idle_workers()):
            with self.ctrl_c.measuring():
                self.executor.wait()  # a worker is restarting
        self.executor.submit(job, worker=worker if worker in idle else idle[0])
        while True:
            with self.ctrl_c.measuring():
                records = self.executor.wait()
            for rec in records:
                if rec.trial == job.trial and rec.role == job.role:
                    return rec

    # ---------------------------------------------------------------- interruption & progress
    def fail_running(self, reason: str) -> None:
        """Fail this driver's RUNNING trials, including one popped a moment before the interrupt."""
        numbers = {t.number for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                   if t.user_attrs.get("driver") == st.me()}
        for job in self.inflight.values():
            job.heartbeat.__exit__()
            numbers.add(job.trial.number)
        if self.popped is not None:
            numbers.add(self.popped.number)
        self.inflight.clear()
        self.popped = None
        for number in sorted(numbers):
            try:
                st.fail_trial(self.study, number, reason, interrupted=True)
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # Ctrl-C arrived just after the trial was told: it is complete, nothing to fail
            self.tracker.log_trial(self.study.get_trials(deepcopy=False)[number])

    def close_progress(self) -> None:
        if self.progress is not None:
            self.progress.close()
