"""The Ray executor on a local 2-CPU cluster: dispatch, timeouts, crashes, reloads, injected faults.

One cluster serves the whole module (starting one takes seconds); each test starts and closes its
own actors. Tests assert behaviour (trial states, reasons, worker ids, load counts), never speed.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import time
from pathlib import Path

import optuna
import pytest
from autotune_helpers import run_autotune, tiny_experiment
from faulty_worker import SPEC_NAME
from optuna.trial import TrialState

from autotune import experiment
from autotune import study as st
from autotune.errors import InputError
from autotune.record import Job
from autotune.sweep import SweepOptions, run_sweep

ray = pytest.importorskip("ray")

from autotune.executors.ray_executor import RayExecutor, WorkerSpec, default_temp_dir  # noqa: E402
from autotune.storage import parse_storage  # noqa: E402

pytestmark = pytest.mark.xdist_group("ray")  # one Ray cluster at a time, on one worker


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """A private 2-CPU cluster (the CI machine's size); executors join it instead of starting one.
    Its actors can import ``faulty_worker`` (this folder on their PYTHONPATH), the test double
    ``_spec(..., faults=...)`` names."""
    if ray.is_initialized():
        ray.shutdown()
    default_temp_dir().mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(default_temp_dir()), log_to_driver=False,
             logging_level="ERROR", object_store_memory=128 * 1024**2,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


def _exp(folder: Path, n_trials: int = 6, **sections):
    path = tiny_experiment(folder, study={"n_trials": n_trials, "sampler": "random", "seed": 0},
                           measure={"warmup": 0, "repeats": 2, "max_rel_mad": 0.9, "baseline_every": 100,
                                    "confirm_top": 0}, **sections)
    exp = experiment.load(path)
    return exp, experiment.load_workloads(exp)


def _spec(exp, workloads, faults=None, **model) -> WorkerSpec:
    """The experiment's spec; with ``faults``, its actors measure on the fault-injecting test double."""
    m = {"target": exp.model.target, "draft": exp.model.draft, "device": exp.model.device, "dtype": exp.model.dtype,
         **model}
    worker = {"worker": SPEC_NAME, "worker_kwargs": {"faults": dict(faults)}} if faults else {}
    return WorkerSpec(m["target"], m["draft"], m["device"], m["dtype"], tuple(workloads), dict(exp.fixed_engine),
                      **worker)


def _job(trial: int, verify: str = "chain") -> Job:
    return Job(trial=trial, role="search", config={"verify": verify}, max_new_tokens=8, warmup=0, repeats=1,
               max_rel_mad=0.9, remeasure_if_noisy=False)


def _sweep(exp, workloads, executor, n_trials):
    opts = SweepOptions(n_trials=n_trials, storage=parse_storage("memory"), study_name=exp.name,
                        tracking_uri=None, progress=False)
    out = io.StringIO()
    outcome = run_sweep(exp, opts, workloads, executor=executor, out=out)
    return outcome, out.getvalue()


def _drain(ex: RayExecutor, n: int) -> dict[int, object]:
    """Wait until ``n`` records came back; return them by trial number."""
    got: dict[int, object] = {}
    while len(got) < n:
        for rec in ex.wait():
            got[rec.trial] = rec
    return got


def test_sweep_dispatches_across_two_warm_workers(tmp_path):
    exp, workloads = _exp(tmp_path, n_trials=8)
    ex = RayExecutor(_spec(exp, workloads), workers=2)
    outcome, text = _sweep(exp, workloads, ex, 8)
    trials = outcome.study.get_trials()
    baselines = sum(st.role_of(t) == "baseline" for t in trials)  # beside the n_trials configs
    assert outcome.exit_code == 0 and st.n_finished(outcome.study) == 8 and len(trials) == 8 + baselines
    assert all(t.state == TrialState.COMPLETE for t in trials)
    workers = {t.user_attrs["worker"] for t in trials}
    assert len(workers) == 2 and all(w != st.me() for w in workers)  # measured in the actors, not the driver
    for w in workers:  # every worker measured its own AR baseline, and speedups use it
        mine = [t for t in trials if t.user_attrs["worker"] == w]
        base = [t for t in mine if st.role_of(t) == "baseline"]
        assert len(base) == 1
        assert all(t.user_attrs["baseline_trial"] == base[0].number for t in mine)
    assert sum(st.role_of(t) == "reference" for t in trials) == 1
    for t in trials:  # warm: one load per actor for the whole sweep; utilisation came back with each result
        assert t.user_attrs["worker_model_loads"] == 1
        assert t.user_attrs["utilisation"]["kind"] == "cpu" and t.user_attrs["util_percent"] > 0
        assert 0 < t.user_attrs["engine_s"] <= t.user_attrs["trial_wall_s"]
    # the two workers really measured at the same time
    spans = {w: [(t.datetime_start, t.datetime_complete) for t in trials if t.user_attrs["worker"] == w]
             for w in workers}
    a, b = spans.values()
    assert any(s1 < e2 and s2 < e1 for s1, e1 in a for s2, e2 in b)
    assert "executor: ray" in text and "workers: 2" in text and "trials_running: 0" in text


def test_a_busy_worker_tells_where_its_job_is(tmp_path):
    """With ``on_progress`` set (the sweep's bar), ``wait`` asks the busy actor every second where its
    job is and passes it on: the pass and the prompt, as an in-process worker tells them."""
    exp, workloads = _exp(tmp_path)
    told: list[str] = []
    with RayExecutor(_spec(exp, workloads), workers=1) as ex:
        ex.on_progress = told.append
        ex.start()
        # long enough for a few looks (24 passes over 2 prompts: seconds even on a fast machine)
        ex.submit(Job(trial=5, role="search", config={"verify": "chain"}, max_new_tokens=16, warmup=0, repeats=24,
                      max_rel_mad=0.9, remeasure_if_noisy=False))
        rec = _drain(ex, 1)[5]
    assert rec.ok and len(rec.decode_tps_runs) == 24
    assert told and all(re.fullmatch(r"(AR outputs|pass \d+/24): prompts [12]/2", t) for t in told), told[:5]
    assert any(t.startswith("pass ") for t in told)


def _measured_timeout(ex: RayExecutor) -> float:
    """A per-trial timeout derived from a healthy trial measured now, on this (possibly loaded)
    machine: ten times its wall time, 8 s at least. A fixed few seconds failed healthy trials when
    the machine was busy (issue #24); a hung trial still ends within seconds."""
    ex.start()
    t0 = time.monotonic()
    ex.submit(_job(999))  # not a faulty trial number
    (rec,) = _drain(ex, 1).values()
    assert rec.ok, rec.fail_reason
    ex.trial_timeout_s = round(max(8.0, 10 * (time.monotonic() - t0)), 1)
    return ex.trial_timeout_s


@pytest.mark.slow
def test_timeout_kills_and_restarts_the_worker(tmp_path):
    exp, workloads = _exp(tmp_path)
    ex = RayExecutor(_spec(exp, workloads, faults={1: "hang"}), workers=2)
    try:
        timeout = _measured_timeout(ex)
        before = set(ex.start())
        hung_on = ex.idle_workers()[0]
        ex.submit(_job(1), worker=hung_on)
        ex.submit(_job(2))
        got = _drain(ex, 2)
        assert got[2].ok
        assert not got[1].ok and got[1].fail_reason.startswith(f"timeout: no result after {timeout:g} s")
        assert "killed and restarted" in got[1].fail_reason and got[1].worker == hung_on
        while len(ex.idle_workers()) < 2:  # the restarted actor loads its model, then takes jobs again
            assert ex.wait() == []
        after = set(ex.idle_workers())
        assert hung_on not in after and len(after - before) == 1  # a new process took the hung one's place
        new = (after - before).pop()
        ex.submit(_job(3), worker=new)
        (rec,) = _drain(ex, 1).values()
        assert rec.ok and rec.worker == new and rec.model_loads == 1
        assert ex.describe()["restarts"] == 1
    finally:
        ex.close()


@pytest.mark.slow
def test_crash_fails_the_trial_and_retries_its_params_once(tmp_path):
    exp, workloads = _exp(tmp_path, n_trials=6)
    ex = RayExecutor(_spec(exp, workloads, faults={3: "crash"}), workers=2)
    outcome, text = _sweep(exp, workloads, ex, 6)
    trials = outcome.study.get_trials()
    crashed = trials[3]
    assert crashed.state == TrialState.FAIL and crashed.user_attrs["interrupted"] is True
    assert crashed.user_attrs["fail_reason"].startswith("worker crashed:")
    retries = [t for t in trials if "retry_of" in t.user_attrs]
    assert [t.user_attrs["retry_of"] for t in retries] == [3]
    assert retries[0].state == TrialState.COMPLETE and retries[0].params == crashed.params
    assert st.role_of(retries[0]) == st.role_of(crashed)
    assert st.n_finished(outcome.study) == 6 and len(trials) == 7 + sum(st.role_of(t) == "baseline" for t in trials)
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    assert "worker_restarts: 1" in text


def test_model_reloads_only_when_the_model_changes(tmp_path):
    exp, workloads = _exp(tmp_path)
    spec = _spec(exp, workloads)
    ex = RayExecutor(spec, workers=1)
    try:
        ex.start()
        for n in (1, 2):
            ex.submit(_job(n))
            assert _drain(ex, 1)[n].model_loads == 1
        ex.use_model(_spec(exp, workloads[:1] * 2))  # other prompts, same model: no reload
        ex.submit(_job(3))
        assert _drain(ex, 1)[3].model_loads == 1
        ex.use_model(_spec(exp, workloads, draft="oracle:0.5"))  # another draft: one reload
        ex.submit(_job(4))
        rec = _drain(ex, 1)[4]
        assert rec.ok and rec.model_loads == 2
        ex.submit(_job(5))
        assert _drain(ex, 1)[5].model_loads == 2
        (facts,) = ex.facts()
        assert facts["loads"] == 2 and facts["worker"] == rec.worker
    finally:
        ex.close()


@pytest.mark.slow
def test_fault_injected_sweep_records_every_fault_and_leaves_nothing_running(tmp_path):
    """20 trials, 4 of them faulty (20%): a crash, a hang, an out-of-memory error, a poisoned device."""
    exp, workloads = _exp(tmp_path, n_trials=20)
    faults = {4: "crash", 8: "hang", 12: "oom", 16: "device"}
    ex = RayExecutor(_spec(exp, workloads, faults=faults), workers=2)
    timeout = _measured_timeout(ex)
    outcome, text = _sweep(exp, workloads, ex, 20)
    trials = outcome.study.get_trials()
    assert outcome.exit_code == 0
    assert st.n_finished(outcome.study) == 20
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    reasons = {n: trials[n].user_attrs.get("fail_reason", "") for n in faults}
    assert all(trials[n].state == TrialState.FAIL for n in faults)
    assert reasons[4].startswith("worker crashed:")
    assert reasons[8].startswith(f"timeout: no result after {timeout:g} s")
    assert reasons[12].startswith("OutOfMemoryError: injected out-of-memory fault on trial 12")
    assert "illegal memory access" in reasons[16] and "worker was restarted" in reasons[16]
    # only the crash is retried (the others are verdicts on the config); everything else completed
    assert [t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs] == [4]
    assert {t.number for t in trials if t.state == TrialState.FAIL} == set(faults)
    assert len(trials) == 21 + sum(st.role_of(t) == "baseline" for t in trials) and "worker_restarts: 3" in text
    # one AR baseline per actor at the start; a restarted actor (a new process, the same host and
    # settings) reuses one instead of measuring AR again (issue #23)
    baselines = [t.number for t in trials if st.role_of(t) == "baseline"]
    assert len(baselines) == 2 and all(r["trial"] in baselines for r in st.baseline_reuses(outcome.study))
    assert st.baseline_reuses(outcome.study) and "baselines_reused: " in text


@pytest.mark.slow
def test_cli_sweep_on_its_own_local_cluster_logs_utilisation(tmp_path):
    """`--executor ray` from the command line: a private cluster under the cache folder, stopped at the end."""
    exp = tiny_experiment(tmp_path / "exp", study={"n_trials": 4, "sampler": "random", "seed": 0},
                          measure={"warmup": 0, "repeats": 2, "max_rel_mad": 0.9, "confirm_top": 1,
                                   "confirm_repeats": 2})
    db, mlflow_db = tmp_path / "autotune.db", tmp_path / "mlflow.db"
    proc = run_autotune(["sweep", str(exp), "--executor", "ray", "--workers", "2", "--trial-timeout", "5m",
                         "--storage", f"sqlite:///{db}", "--tracking-uri", f"sqlite:///{mlflow_db}",
                         "--no-progress"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "executor: ray" in proc.stdout and "workers: 2" in proc.stdout and "trials_finished: 4" in proc.stdout
    trials = optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}").get_trials()
    assert len({t.user_attrs["worker"] for t in trials}) == 2
    assert optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}").user_attrs["confirmation"]["winner"] >= 0
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{mlflow_db}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string="tags.`autotune.trial` = '0'")
    assert runs and runs[0].data.metrics["util_percent"] > 0 and "trial_wall_s" in runs[0].data.metrics


def test_a_worker_the_actors_cannot_import_fails_the_start_naming_it(tmp_path, monkeypatch):
    """The driver imports the worker's module (so the spec is accepted), the actors cannot: the
    actor's refusal reaches the driver as the same InputError, naming the value and the rule."""
    (tmp_path / "driver_only_worker.py").write_text("from autotune.worker import Worker as DriverOnly\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    exp, workloads = _exp(tmp_path / "exp")
    ex = RayExecutor(dataclasses.replace(_spec(exp, workloads), worker="driver_only_worker:DriverOnly"), workers=1)
    try:
        with pytest.raises(InputError, match=r"^WorkerSpec: worker: must be 'module:callable' .*importing "
                                             r"'driver_only_worker' failed \(ModuleNotFoundError.*but got "
                                             r"'driver_only_worker:DriverOnly'$"):
            ex.start()
    finally:
        ex.close()


def test_more_cpu_workers_than_cpus_is_refused(tmp_path):
    exp, workloads = _exp(tmp_path)
    ex = RayExecutor(_spec(exp, workloads), workers=3)
    with pytest.raises(InputError, match=r"--workers: each CPU worker needs a CPU of its own.*has 2.*got 3"):
        ex.start()
    ex.close()
    assert ray.is_initialized()  # a cluster the executor joined is not its to stop
