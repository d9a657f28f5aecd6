"""Sampler, pruner, roles, baselines, resume: everything about the Optuna study except measuring
and where it is stored (``autotune.storage``).

Resume: the same command finds the study by name. A RUNNING trial whose driver is gone (same
host and its pid is dead, or no heartbeat for ``STALE_AFTER_S``) is marked FAIL with a
``fail_reason`` and ``interrupted: true``; its params are retried once (an interrupted AR baseline
is not: the worker that replaces it measures or reuses its own). A worker that starts without an
AR baseline (a restarted driver's, a restarted Ray actor's) reuses the study's most recent one
measured under the same identity within ``measure.baseline_max_age`` (:func:`reusable_baseline`),
recorded as the study attribute ``baseline_reuse:WORKER``.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import threading
import warnings
from typing import Any

import optuna
from optuna.samplers import BaseSampler, GPSampler, GridSampler, RandomSampler, TPESampler
from optuna.trial import FrozenTrial, TrialState

from autotune.errors import InputError
from autotune.experiment import Experiment
from autotune.space import SearchSpace
from autotune.storage import StorageSpec, open_storage

HEARTBEAT_S = 30.0
STALE_AFTER_S = 600.0  # another host's trial without a heartbeat for this long is dead
ROLES = ("baseline", "reference", "search")
# The public DDTree defaults (budget 22, top-k 8, proposal temperature 1.0, the whole top-1 chain
# seeded, fast rollback), with the experiment's fixed fields over it.
REFERENCE = {"verify": "ddtree", "budget": 22, "top_k": 8, "proposal_temp": 1.0, "chain_seed": None,
             "rollback": "fast"}
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
REUSE_PREFIX = "baseline_reuse:"  # + worker id: the study attribute saying which baseline that worker reuses


def make_sampler(exp: Experiment, n_trials: int) -> BaseSampler:
    seed = exp.study.seed
    # Few trials overnight on a big model: do not spend most of them on random start-up.
    startup = max(2, min(10, n_trials // 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if exp.study.sampler == "tpe":
            # multivariate + group: TPE models each conditional sub-space (the paths) on its own
            return TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=startup)
        if exp.study.sampler == "gp":
            return GPSampler(seed=seed, n_startup_trials=startup, warn_independent_sampling=False)
        if exp.study.sampler == "random":
            return RandomSampler(seed=seed)
        return _Grid(exp.space, seed=seed)


class _Grid(GridSampler):
    """GridSampler over the space's distinct configs (``SearchSpace.grid_key``: a condition's inactive
    parameters do not multiply the trials), leaving stopping to the driver (its own stop() only works
    inside optimize). Optuna's sampler walks the product of every parameter's values, in its seeded
    order; here each config keeps its first point of that order, so a trial's grid id names one config
    (and a space without conditions keeps Optuna's order)."""

    def __init__(self, space: SearchSpace, seed: int | None = None) -> None:
        super().__init__(space.grid(), seed=seed)
        first: dict[tuple, tuple] = {}  # each config's first point, in order
        for point in self._all_grids:
            first.setdefault(space.grid_key(dict(zip(self._param_names, point, strict=True))), point)
        self._all_grids, self._keys = list(first.values()), list(first)
        self._n_min_trials = len(self._all_grids)
        self._space = space

    def _get_unvisited_grid_ids(self, study: optuna.Study) -> list[int]:
        """Optuna's rule (finished points first, then those only running) by config rather than by grid id: a
        study begun before the grid was deduplicated stored ids into the whole product, which name other points
        here; a finished trial's own parameters say which config it measured."""
        keys = self._keys
        visited, running = set(), set()
        for t in study._storage.get_all_trials(study._study_id, deepcopy=False):
            if "grid_id" not in t.system_attrs or not self._same_search_space(t.system_attrs["search_space"]):
                continue
            gid = t.system_attrs["grid_id"]
            try:  # its parameters, where all were suggested (a trial can fail or still run before they are)
                key = self._space.grid_key(t.params)
            except KeyError:  # else its point (an old study's id into the whole product names none here)
                key = keys[gid] if gid < len(keys) else None
            if t.state.is_finished():
                visited.add(key)
            elif t.state == TrialState.RUNNING:
                running.add(keys[gid] if gid < len(keys) else key)
        unvisited = [i for i, k in enumerate(keys) if k not in visited and k not in running]
        return unvisited or [i for i, k in enumerate(keys) if k not in visited]

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        # Optuna gives trial n grid point n while n is below the grid's size, visited or not; keep that (it sets the
        # order of a fresh study) only where point n is unvisited, else choose among the unvisited as it does later
        if ("grid_id" in trial.system_attrs or "fixed_params" in trial.system_attrs
                or (trial.number < self._n_min_trials and trial.number in self._get_unvisited_grid_ids(study))):
            return super().before_trial(study, trial)
        target = self._get_unvisited_grid_ids(study) or list(range(len(self._all_grids)))
        study._storage.set_trial_system_attr(trial._trial_id, "search_space", self._search_space)
        study._storage.set_trial_system_attr(trial._trial_id, "grid_id", int(self._rng.rng.choice(target)))

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState, values: Any) -> None:
        return None

    def exhausted(self, study: optuna.Study) -> bool:
        return not self._get_unvisited_grid_ids(study)


def grid_exhausted(study: optuna.Study) -> bool:
    return isinstance(study.sampler, _Grid) and study.sampler.exhausted(study)


def make_pruner(exp: Experiment) -> optuna.pruners.BasePruner:
    if exp.study.pruner == "wilcoxon":
        # steps are prompts: a config is dropped once its per-prompt TPS is significantly below the best's
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.pruners.WilcoxonPruner(p_threshold=0.1, n_startup_steps=2)
    return optuna.pruners.NopPruner()


def open_study(storage: optuna.storages.BaseStorage, name: str, exp: Experiment, n_trials: int,
               meta: dict[str, Any]) -> optuna.Study:
    """Create or resume; a resumed study must come from the same experiment."""
    study = optuna.create_study(storage=storage, study_name=name, direction="maximize",
                                sampler=make_sampler(exp, n_trials), pruner=make_pruner(exp), load_if_exists=True)
    if study.direction != optuna.study.StudyDirection.MAXIMIZE:
        raise InputError("--study-name", None, "an existing study with this name minimizes; autotune maximizes "
                         "decode TPS: pick another --study-name", name)
    if "fingerprint" not in study.user_attrs:
        study.set_user_attr("fingerprint", exp.fingerprint())
        for key, value in {"experiment": exp.name, "experiment_path": str(exp.path), "objective": exp.objective,
                           "model": {"target": exp.model.target, "draft": exp.model.draft,
                                     "device": exp.model.device, "dtype": exp.model.dtype,
                                     "weights": exp.model.weights, "vram_limit": exp.model.vram_limit},
                           "fixed_engine": exp.fixed_engine, "exactness": exp.measure.exactness,
                           "created": _now(), **meta}.items():
            study.set_user_attr(key, value)
    # not in the fingerprint (how a study is judged, not what it measures): a resume may loosen it
    study.set_user_attr("max_ar_drift", exp.measure.max_ar_drift)
    if study.metric_names != [exp.objective]:  # optuna-dashboard names the objective, not "Objective 0"
        with warnings.catch_warnings():  # "experimental" since Optuna 3.2: said once here, not to every user
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names([exp.objective])
    check_fingerprint(study, exp)
    return study


def check_fingerprint(study: optuna.Study, exp: Experiment) -> None:
    fp = study.user_attrs.get("fingerprint")
    if fp is not None and fp != exp.fingerprint():
        raise InputError(str(exp.path), None, f"study {study.study_name!r} in this storage was made from a different "
                         "experiment (model, workload, search space or measure changed); resume it with the same "
                         "file, or start a new study with --study-name", study.user_attrs.get("experiment_path"))


def peek(spec: StorageSpec, name: str, exp: Experiment) -> optuna.Study | None:
    """The existing study, if any, read before the models load (nothing is created here)."""
    if not spec.exists():
        return None
    storage = open_storage(spec, create=False)
    if name not in [s.study_name for s in optuna.get_all_study_summaries(storage)]:
        return None
    study = optuna.load_study(study_name=name, storage=storage)
    check_fingerprint(study, exp)
    return study


def me() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def is_stale(trial: FrozenTrial, now: dt.datetime | None = None) -> bool:
    """A RUNNING trial is stale when its driver is provably gone, or silent for too long."""
    driver = trial.user_attrs.get("driver")
    if driver:
        host, _, pid = driver.rpartition(":")
        if host == socket.gethostname() and pid.isdigit():
            return int(pid) != os.getpid() and not _pid_alive(int(pid))
    now = now or dt.datetime.now(dt.UTC)
    beat = trial.user_attrs.get("heartbeat")
    last = dt.datetime.fromisoformat(beat) if beat else trial.datetime_start
    if last is None:
        return True
    return (now - _aware(last)).total_seconds() > STALE_AFTER_S


def _aware(when: dt.datetime) -> dt.datetime:
    """Optuna stores naive local datetimes; comparisons here are in UTC."""
    return when.astimezone(dt.UTC) if when.tzinfo is None else when


def fail_trial(study: optuna.Study, trial_number: int, reason: str, interrupted: bool) -> None:
    """Mark a RUNNING trial FAIL with its reason (attributes first: a finished trial is read-only)."""
    trial = optuna.trial.Trial(study, _trial_id(study, trial_number))
    trial.set_user_attr("fail_reason", reason)
    if interrupted:
        trial.set_user_attr("interrupted", True)
    study.tell(trial, state=TrialState.FAIL)


def tell_pruned(study: optuna.Study, trial: optuna.trial.Trial, partial: float | None, reason: str) -> None:
    """Tell ``trial`` PRUNED with no objective value; its partial measurement is kept as the user
    attribute ``partial_decode_tps`` and why it stopped as ``pruned_reason``.

    ``study.tell(trial, state=PRUNED)`` would store the last reported intermediate value (one prompt's
    tok/s, or a cheap rung's) as the trial's value, where ``best_trial``, optuna-dashboard and anyone
    reading the study take it for a result, possibly above the winner's. This is Optuna's tell (the
    sampler's ``after_trial``, then the state) without that value. TPE still ranks pruned trials by
    their intermediate values.
    """
    study._thread_local.cached_all_trials = None  # as Study.tell: the cache is valid within a trial only
    state = study._storage.get_trial(trial._trial_id).state
    if state != TrialState.RUNNING:
        raise ValueError(f"Cannot tell a {state.name} trial.")
    trial.set_user_attr("partial_decode_tps", partial)
    trial.set_user_attr("pruned_reason", reason)
    frozen = study._storage.get_trial(trial._trial_id)
    try:
        study.sampler.after_trial(optuna.pruners._filter_study(study, frozen), frozen, TrialState.PRUNED, None)
    finally:
        study._storage.set_trial_state_values(frozen._trial_id, TrialState.PRUNED, None)


def _trial_id(study: optuna.Study, number: int) -> int:
    return study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)


def recover_stale(study: optuna.Study) -> list[int]:
    """Fail the RUNNING trials whose driver is gone; return their numbers."""
    failed = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if is_stale(t):
            fail_trial(study, t.number, f"interrupted: its driver {t.user_attrs.get('driver', '?')} stopped "
                       "while the trial was running", interrupted=True)
            failed.append(t.number)
    return failed


def pending_retries(study: optuna.Study) -> list[FrozenTrial]:
    """Interrupted trials whose params were not retried yet (a retry is never retried again). An
    interrupted baseline is not retried: its worker is gone, and the one that replaces it measures
    or reuses its own (a retry would be a second baseline right after that one)."""
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get("retry_of") for t in trials}
    return [t for t in trials if t.state == TrialState.FAIL and t.user_attrs.get("interrupted")
            and "retry_of" not in t.user_attrs and t.number not in retried and role_of(t) != "baseline"]


def enqueue(study: optuna.Study, role: str, params: dict[str, Any] | None = None, **attrs: Any) -> None:
    study.enqueue_trial(params or {}, user_attrs={"role": role, **attrs})


def counts_toward_budget(t: FrozenTrial) -> bool:
    """``n_trials`` counts configs measured: finished search and reference trials. AR baselines are
    the yardstick, not the search (reported beside it, ``results.state_counts``), and an interrupted
    trial does not count (its retry will)."""
    return t.state in FINISHED and not t.user_attrs.get("interrupted") and role_of(t) != "baseline"


def n_finished(study: optuna.Study) -> int:
    return sum(counts_toward_budget(t) for t in study.get_trials(deepcopy=False))


def budget_state(study: optuna.Study) -> tuple[int, int]:
    """(finished trials that count, RUNNING trials of every driver), read from one snapshot.

    Two separate reads race with another driver's tell: a trial RUNNING in the first read and
    COMPLETE by the second counts in neither, and a driver would start one trial too many.
    """
    trials = study.get_trials(deepcopy=False)
    return (sum(counts_toward_budget(t) for t in trials),
            sum(t.state == TrialState.RUNNING and role_of(t) != "baseline" for t in trials))


def role_of(t: FrozenTrial) -> str:
    return t.user_attrs.get("role", "search")


def needs_baseline(study: optuna.Study, worker: str, every: int) -> bool:
    """No baseline attempt on this worker yet and none reused, or ``every`` other trials measured in
    full since the last one (a reused baseline counts as the worker's first). A trial stopped at a
    cheap rung does not count: the baseline is re-measured against drift in the full measurements it
    divides, and on the H200 (2026-12-04) the flagship's AR at full fidelity took 37-43 s, as long as
    ten rung-stopped trials."""
    trials = study.get_trials(deepcopy=False)
    if any(t.state == TrialState.WAITING and role_of(t) == "baseline" for t in trials):
        return False
    mine = [t for t in trials if t.user_attrs.get("worker") == worker and t.state in FINISHED]
    last = max((t.number for t in mine if role_of(t) == "baseline"), default=None)
    if last is None:
        reuse = baseline_reuse(study, worker)
        last = reuse["trial"] if reuse else None
    if last is None:
        return True
    return sum(t.number > last and counts_toward_budget(t) and "pruned_at_rung" not in t.user_attrs
               for t in mine) >= every


def reusable_baseline(study: optuna.Study, worker: str, identity: dict[str, Any] | None, max_age_s: float,
                      now: dt.datetime | None = None) -> FrozenTrial | None:
    """The baseline ``worker`` may take instead of measuring AR: the most recently finished COMPLETE,
    not noisy baseline of the study whose ``identity`` attribute equals ``identity`` and that
    finished at most ``max_age_s`` before ``now``. None when nothing fits, the identity is unknown,
    or the worker already has a baseline: its periodic re-measurement measures AR again (drift)."""
    if not identity or max_age_s <= 0:
        return None
    trials = study.get_trials(deepcopy=False)
    if baseline_reuse(study, worker) or any(role_of(t) == "baseline" and t.user_attrs.get("worker") == worker
                                            for t in trials):
        return None
    now = now or dt.datetime.now(dt.UTC)
    fits = [t for t in trials if t.state == TrialState.COMPLETE and role_of(t) == "baseline"
            and not t.user_attrs.get("noisy") and t.user_attrs.get("identity") == identity
            and t.datetime_complete is not None
            and (now - _aware(t.datetime_complete)).total_seconds() <= max_age_s]
    return max(fits, key=lambda t: _aware(t.datetime_complete), default=None)


def reuse_baseline(study: optuna.Study, worker: str, baseline: FrozenTrial) -> dict[str, Any]:
    """Record that ``worker`` reuses ``baseline`` (one attribute per worker: drivers sharing a study
    never write the same key); returns the record."""
    finished = _aware(baseline.datetime_complete) if baseline.datetime_complete else None
    record = {"trial": baseline.number, "worker": worker, "driver": me(), "at": _now(),
              "age_s": round((dt.datetime.now(dt.UTC) - finished).total_seconds()) if finished else None}
    study.set_user_attr(REUSE_PREFIX + worker, record)
    return record


def baseline_reuse(study: optuna.Study, worker: str) -> dict[str, Any] | None:
    """The baseline ``worker`` reuses (``reuse_baseline``'s record), if any."""
    return study.user_attrs.get(REUSE_PREFIX + worker)


def baseline_reuses(study: optuna.Study) -> list[dict[str, Any]]:
    """Every reuse in the study, oldest first."""
    return sorted((v for k, v in study.user_attrs.items() if k.startswith(REUSE_PREFIX)), key=lambda r: r["at"])


def has_role(study: optuna.Study, role: str) -> bool:
    return any(role_of(t) == role for t in study.get_trials(deepcopy=False)
               if not (t.state == TrialState.FAIL and t.user_attrs.get("interrupted")))


def nearest_baseline(study: optuna.Study, number: int, worker: str, workload_hash: str) -> FrozenTrial | None:
    """The AR measurement closest in trial order on the same worker (or the one it reuses) and
    prompt set."""
    reuse = baseline_reuse(study, worker)
    reused = reuse["trial"] if reuse else None
    candidates = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                  if role_of(t) == "baseline" and (t.user_attrs.get("worker") == worker or t.number == reused)
                  and t.user_attrs.get("workload_hash") == workload_hash and t.number != number]
    return min(candidates, key=lambda t: (abs(t.number - number), -t.number), default=None)


def weights_form(study: optuna.Study, config: dict[str, Any]) -> str:
    """The weight form ``config`` decodes with (``EngineConfig.weights``; unnamed: the pair's,
    ``model.weights``)."""
    return config.get("weights") or (study.user_attrs.get("model") or {}).get("weights") or "dequantized"


def nearest_form_ar(study: optuna.Study, number: int, worker: str | None, workload_hash: str | None,
                    form: str) -> FrozenTrial | None:
    """AR decoded on the weight form ``form`` (a ``verify: ar`` config of a study searching ``weights``,
    where ``form`` is not the baseline's): the measured one nearest in trial order on the same worker
    and prompt set, ``number`` itself excluded; None where there is none yet."""
    candidates = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                  if t.number != number and t.user_attrs.get("worker") == worker
                  and t.user_attrs.get("workload_hash") == workload_hash
                  and t.user_attrs.get("decode_tps_median") is not None
                  and (t.user_attrs.get("config") or {}).get("verify") == "ar"
                  and weights_form(study, t.user_attrs["config"]) == form]
    return min(candidates, key=lambda t: (abs(t.number - number), -t.number), default=None)


class Heartbeat:
    """Writes ``heartbeat`` on a RUNNING trial every ``HEARTBEAT_S`` so drivers on other hosts can
    tell a long trial from a dead one. The driver process stays the only writer."""

    def __init__(self, trial: optuna.trial.Trial) -> None:
        self._trial = trial
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autotune-heartbeat", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._trial.set_user_attr("heartbeat", _now())
            except (RuntimeError, optuna.exceptions.UpdateFinishedTrialError):
                return  # the trial finished meanwhile

    def __enter__(self) -> Heartbeat:
        self._trial.set_user_attr("heartbeat", _now())
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
