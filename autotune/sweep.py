"""A sweep (``run_sweep``): the workers, the storage, the study and MLflow set up, then the driver's loop
(``autotune.driver``): ask → measure on a warm worker → score → tell → log, then confirm the winner.

The driver is the only writer to the Optuna storage and to MLflow. Trial order per worker:
the AR baseline first (and again every ``baseline_every`` trials), retries of interrupted trials,
the reference config once per study, then the sampler's suggestions. A worker that starts without
a baseline (after a restart) first looks for one to reuse: measured in this study under the same
identity (:meth:`_Driver.identity`) at most ``measure.baseline_max_age`` ago. Each trial runs the
fidelity ladder's cheap rungs before its full measurement, on the same worker; a search config far
behind the incumbent on a rung stops there (``autotune.fidelity``).

With several workers (the Ray executor) the driver keeps one job on every idle worker and tells
each record as it comes back. With several drivers on one study (PostgreSQL), "is budget left?
→ plan → ask" runs under a lock shared by the drivers (:class:`autotune.storage.BudgetLock`), and the
budget counts every driver's running trials, so together they finish exactly ``n_trials``.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import optuna
from optuna.trial import TrialState
from tqdm import tqdm

from autotune import dimensions, results, vram
from autotune import study as st
from autotune.driver import _Driver
from autotune.errors import InputError
from autotune.executors import Executor, LocalExecutor
from autotune.experiment import Experiment, workload_hash
from autotune.interrupt import CtrlC
from autotune.storage import BudgetLock, StorageSpec, open_storage
from autotune.tracking import open_tracker


@dataclass(frozen=True)
class SweepOptions:
    n_trials: int
    storage: StorageSpec
    study_name: str
    tracking_uri: str | None  # None: MLflow off
    timeout_s: float | None = None
    progress: bool = True
    # what timeout_s is measured on: the wall clock; the tuner's benchmark replays a sweep on the
    # simulated seconds of its measurements (benchmarks/tuner_bench.py)
    clock: Callable[[], float] = lambda: time.monotonic()  # (read when called: a test may patch it)


@dataclass
class SweepOutcome:
    study: optuna.Study
    exit_code: int
    facts: dict[str, Any] = field(default_factory=dict)


def run_sweep(exp: Experiment, opts: SweepOptions, workloads: list[Any], *, executor: Executor | None = None,
              out: TextIO | None = None) -> SweepOutcome:
    """Run (or resume) a sweep. The inputs were validated by the caller; the model pair is loaded
    before the storage and MLflow are opened, so a model that fails to load leaves no files behind.
    ``out``: where its lines go (default: ``sys.stdout`` as it is at the call, not at import)."""
    out = out if out is not None else sys.stdout
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    done = _already_done(exp, opts)
    if done is not None:  # nothing left to measure: do not load (possibly huge) models for nothing
        facts = {**results.summary(done), "storage": opts.storage.url, "exit": "done (nothing left to run)"}
        print(results.format_summary(facts), file=out, flush=True)
        return SweepOutcome(study=done, exit_code=0, facts=facts)
    executor = executor or make_executor(exp, workloads, exp.executor.kind, exp.executor.workers,
                                         exp.executor.address, exp.executor.trial_timeout)
    with CtrlC() as ctrl_c:
        try:
            with ctrl_c.measuring():
                workers = executor.start()
            _check_fits(exp, executor.describe())
        except BaseException:
            executor.close()
            raise
        return _sweep(exp, opts, workloads, executor, workers, ctrl_c, out)


def _check_fits(exp: Experiment, described: dict[str, Any]) -> None:
    """The workload fits the loaded target's context (its longest prompt plus ``max_new_tokens``):
    checked after the model loads and before the study or MLflow is opened, so a sweep whose every
    trial would fail allocating is refused instead (exit 2). A session workload's conversations grow
    turn by turn, and a turn that would outgrow the context ends its session (reported, as a server
    refuses that request): what must fit is every session's first turn."""
    ctx = described.get("context")
    sessions = bool(described.get("session_turns"))
    longest = described.get("longest_first_request" if sessions else "longest_prompt")
    if not ctx or longest is None:
        return
    need = longest + exp.workload.max_new_tokens
    if need > ctx:
        what = "the longest session's first request" if sessions else "the longest prompt"
        raise InputError(str(exp.path), "workload.max_new_tokens",
                         f"{what} ({longest:,} tokens) plus max_new_tokens must fit the target's context "
                         f"of {ctx:,} tokens ({need:,} do not)", exp.workload.max_new_tokens)


def make_executor(exp: Experiment, workloads: list[Any], kind: str = "local", workers: int | None = None,
                  address: str | None = None, trial_timeout: float | None = None) -> Executor:
    """The executor a sweep runs on (nothing starts or loads until its ``start()``)."""
    if kind == "ray":
        from autotune.executors.ray_executor import RayExecutor, WorkerSpec

        spec = WorkerSpec(exp.model.target, exp.model.draft, exp.model.device, exp.model.dtype, tuple(workloads),
                          dict(exp.fixed_engine), weights=exp.model.weights)
        return RayExecutor(spec, workers=workers, address=address, trial_timeout_s=trial_timeout)
    return LocalExecutor.for_model(exp.model.target, exp.model.draft, exp.model.device, exp.model.dtype, workloads,
                                   exp.fixed_engine, weights=exp.model.weights)


def _sweep(exp: Experiment, opts: SweepOptions, workloads: list[Any], executor: Executor, workers: list[str],
           ctrl_c: CtrlC, out: TextIO) -> SweepOutcome:
    started = opts.clock()
    wl_hash = workload_hash(workloads)
    device = executor.describe()
    exp = _fix_dimensions(exp, device)
    storage = open_storage(opts.storage, create=True)
    study = st.open_study(storage, opts.study_name, exp, opts.n_trials,
                          meta={"git_sha": git_sha(), "workload_hash": wl_hash,
                                "workloads": [w.name for w in workloads], "device": device.get("device"),
                                "dtype": device.get("dtype"),
                                # how the loaded target holds its weights (Worker.weights): the report's model line
                                **({"weight_summary": device["weights"]} if device.get("weights") else {})})
    study.set_user_attr("fixed_dimensions", [f.to_dict() for f in exp.fixed_dimensions])
    recovered = st.recover_stale(study)
    tracker = open_tracker(opts.tracking_uri, study, exp.name)
    driver = _Driver(exp, opts, study, executor, tracker, wl_hash, out, ctrl_c, BudgetLock(opts.storage,
                                                                                             opts.study_name))
    driver.workers = workers
    driver.memory_at = vram.memory_at(device.get("longest_prompt"), exp.workload.max_new_tokens,
                                      device.get("session_turns", 0), device.get("context"))
    status, code = "FINISHED", 0
    try:
        tracker.sync()  # trials finished (or just failed as stale) before a crash get their runs now
        driver.loop(started)
        driver.confirm()
        ctrl_c.checkpoint()  # a Ctrl-C during the last bookkeeping still means "stopped by the user"
    except KeyboardInterrupt:
        driver.fail_running("interrupted by Ctrl-C; the trial was not finished")
        status, code = "KILLED", 130
    except BaseException:
        status = "FAILED"  # MLflow's parent run: not "FINISHED", and no final winner params
        raise
    finally:
        driver.close_progress()
        driver.budget_lock.close()
        device = executor.describe() or device
        executor.close()
        tracker.finish(status)
    facts = results.summary(study)
    facts.update({"storage": opts.storage.url, "stale_trials_failed": len(recovered),
                  "executor": device.get("executor", "local"), "workers": len(device.get("workers", [])),
                  "worker_restarts": device.get("restarts", 0),
                  "mlflow_parent_run": getattr(tracker, "parent", None) or "none",
                  "elapsed_s": round(opts.clock() - started, 1), "exit": "interrupted" if code else "done"})
    if code == 0 and facts.get("trials_complete") == 0 and facts.get("trials_failed", 0) > 0:
        # nothing measured at all: not "done" (a config every trial of which fails, a broken machine)
        reason = next((t.user_attrs.get("fail_reason") for t in study.trials
                       if t.state == TrialState.FAIL and t.user_attrs.get("fail_reason")), "unknown")
        code = 1
        facts["exit"] = f"failed: every trial failed; the first: {str(reason)[:300]}"
    print(results.format_summary(facts), file=out, flush=True)
    return SweepOutcome(study=study, exit_code=code, facts=facts)


def _fix_dimensions(exp: Experiment, described: dict[str, Any]) -> Experiment:
    """The experiment with the search dimensions that cannot matter on these workers fixed
    (``autotune.dimensions``), said once on stderr."""
    fixed = dimensions.irrelevant(exp.search_space, dimensions.facts_from(described), exp.fixed_engine)
    if fixed:
        tqdm.write(f"fixed, not searched: {dimensions.describe(fixed)}", file=sys.stderr)
    return dataclasses.replace(exp, fixed_dimensions=fixed)


def _already_done(exp: Experiment, opts: SweepOptions) -> optuna.Study | None:
    study = st.peek(opts.storage, opts.study_name, exp)
    if study is None or st.n_finished(study) < opts.n_trials:
        return None
    trials = study.get_trials(deepcopy=False)
    if any(t.state in (TrialState.RUNNING, TrialState.WAITING) for t in trials):
        return None  # stale trials to fail, or queued work: let the full path handle them
    conf = study.user_attrs.get("confirmation")
    if exp.measure.confirm_top and not (conf and conf.get("finished_trials") == st.n_finished(study)):
        return None
    return study


def git_sha() -> str:
    """The commit of the code that measured (provenance); 'unknown' outside a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=False,
                             cwd=here)
        if out.returncode != 0 or not out.stdout.strip():
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True,
                               text=True, timeout=10, check=False, cwd=here).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() + ("-dirty" if dirty else "")
