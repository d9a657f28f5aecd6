"""A restart reuses a recent AR baseline instead of measuring a new one (issue #23).

A worker that starts without a baseline (here: a new `autotune sweep` process on the same study,
as after a crash or kill -9) takes the study's latest baseline measured under the same identity
(machine, code, models, prompts, settings) within ``measure.baseline_max_age``; otherwise it
measures its own. Every config trial names the baseline its speedup used.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import io
import socket
import sqlite3
from pathlib import Path

import optuna
import pytest
from autotune_helpers import run_autotune, tiny_experiment
from optuna.trial import TrialState

from autotune import experiment
from autotune import study as st
from autotune.executors import LocalExecutor
from autotune.storage import parse_storage
from autotune.sweep import SweepOptions, run_sweep
from autotune.worker import Worker


def _sweep(exp: Path, db: Path, n_trials: int, **extra_env: str):
    proc = run_autotune(["sweep", str(exp), "--storage", f"sqlite:///{db}", "--tracking-uri", "none",
                         "--n-trials", str(n_trials), "--no-progress"], cwd=db.parent, **extra_env)
    assert proc.returncode == 0, proc.stderr
    return proc


def _trials(db: Path) -> tuple[optuna.Study, list[optuna.trial.FrozenTrial]]:
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}")
    return study, study.get_trials()


def _baselines(trials: list[optuna.trial.FrozenTrial]) -> list[int]:
    return [t.number for t in trials if st.role_of(t) == "baseline"]


@pytest.mark.slow
def test_a_restart_with_the_same_identity_reuses_the_baseline_and_says_so(tmp_path):
    exp, db = tiny_experiment(tmp_path / "exp"), tmp_path / "autotune.db"
    _sweep(exp, db, 2)  # baseline 0, reference 1, search 2
    resumed = _sweep(exp, db, 4)  # a new process: another worker, the same machine and settings
    study, trials = _trials(db)
    assert _baselines(trials) == [0]  # no baseline measured by the restart
    assert "baselines: 1\nbaselines_reused: 1\n" in resumed.stdout
    first, second = trials[0].user_attrs["worker"], trials[-1].user_attrs["worker"]
    assert first != second
    reuse = st.baseline_reuse(study, second)
    assert reuse["trial"] == 0 and reuse["worker"] == second and 0 <= reuse["age_s"] < 300
    assert f"baseline: trial 0 reused by worker {second}" in resumed.stderr
    ar = trials[0].user_attrs["decode_tps_median"]
    new = [t for t in trials if t.user_attrs["worker"] == second]
    assert [st.role_of(t) for t in new] == ["search", "search"]  # n_trials counts configs: 2 more
    for t in trials[1:]:  # every speedup names its baseline; the restart's name the reused one
        a = t.user_attrs
        assert a["baseline_trial"] == 0 and a["baseline_reused"] is (a["worker"] == second)
        assert a["ar_decode_tps"] == ar and a["speedup_vs_ar"] == pytest.approx(a["decode_tps_median"] / ar)
    # the identity a reuse must match, recorded on the baseline
    ident = trials[0].user_attrs["identity"]
    assert {k: ident[k] for k in ("target", "draft", "device", "dtype", "accelerator", "host", "max_new_tokens",
                                  "warmup", "repeats", "workload_hash", "threads", "loop", "kernels")} == {
        "target": "tiny-dense", "draft": "oracle:0.3", "device": "cpu", "dtype": "float32", "accelerator": "cpu",
        "host": socket.gethostname(), "max_new_tokens": 8, "warmup": 0, "repeats": 2,
        "workload_hash": study.user_attrs["workload_hash"], "threads": 1, "loop": "generic", "kernels": "eager"}
    assert ident["ar_config"]["verify"] == "ar" and len(ident["code"]) == 16
    # the report says which baseline each speedup used, and that a restart reused it
    rep = run_autotune(["report", "tiny", "--storage", f"sqlite:///{db}", "--out", "rep"], cwd=tmp_path)
    assert rep.returncode == 0, rep.stderr
    md = (tmp_path / "rep" / "report.md").read_text()
    assert f"- baseline: trial 0, reused by the restart at {reuse['at']} (worker {second}" in md
    assert "| 0 (reused) |" in md
    row = next(line for line in md.splitlines() if line.startswith(f"| 0 | {first} | "))
    assert row.endswith("| 4 |")  # the baseline's row: the speedups of trials 1-4 used it


@pytest.mark.slow
def test_a_restart_under_other_threads_measures_its_own_baseline(tmp_path):
    """Torch's thread count changes AR's speed on a CPU: it is part of the identity."""
    exp, db = tiny_experiment(tmp_path / "exp"), tmp_path / "autotune.db"
    _sweep(exp, db, 2)
    resumed = _sweep(exp, db, 4, OMP_NUM_THREADS="2")
    study, trials = _trials(db)
    assert _baselines(trials) == [0, 3] and "baselines: 2\nbaselines_reused: 0\n" in resumed.stdout
    assert trials[3].user_attrs["identity"]["threads"] == 2 and trials[0].user_attrs["identity"]["threads"] == 1
    for t in trials[4:]:
        assert t.user_attrs["baseline_trial"] == 3 and t.user_attrs["baseline_reused"] is False
    assert st.baseline_reuses(study) == []


def test_a_restart_on_other_prompts_measures_its_own_baseline(tmp_path):
    """The prompts actually used can change while the experiment file does not (a named set's data
    was updated): the restart's prompt set hashes differently, so it measures AR on its own."""
    from engine import load_workload

    exp = experiment.load(tiny_experiment(tmp_path / "exp"))
    other = tmp_path / "other" / "prompts.jsonl"
    other.parent.mkdir()
    other.write_text('{"prompt": "def sub(a, b):"}\n{"prompt": "Hello"}\n')
    opts = SweepOptions(n_trials=2, storage=parse_storage(f"sqlite:///{tmp_path / 'autotune.db'}"),
                        study_name="tiny", tracking_uri=None, progress=False)
    run_sweep(exp, opts, experiment.load_workloads(exp), out=io.StringIO())

    def restarted() -> Worker:  # a new process: another worker id on the same machine
        w = Worker.load(exp.model.target, exp.model.draft, exp.model.device, exp.model.dtype,
                        [load_workload(str(other), other.parent, 2, 0)], exp.fixed_engine)
        w.id = f"{w.id}-restarted"
        return w

    more = dataclasses.replace(opts, n_trials=4)
    outcome = run_sweep(exp, more, [load_workload(str(other), other.parent, 2, 0)],
                        executor=LocalExecutor(restarted), out=io.StringIO())
    trials = outcome.study.get_trials()
    assert _baselines(trials) == [0, 3] and st.baseline_reuses(outcome.study) == []
    assert trials[3].user_attrs["identity"]["workload_hash"] != trials[0].user_attrs["identity"]["workload_hash"]
    assert all(t.user_attrs["baseline_trial"] == 3 for t in trials[4:])


def _age(db: Path, number: int, hours: float) -> None:
    """Move a finished trial ``hours`` into the past (Optuna keeps naive local times)."""
    with sqlite3.connect(db) as con:
        for col in ("datetime_start", "datetime_complete"):
            (raw,) = con.execute(f"select {col} from trials where number = ?", (number,)).fetchone()
            old = dt.datetime.fromisoformat(raw) - dt.timedelta(hours=hours)
            con.execute(f"update trials set {col} = ? where number = ?", (old.isoformat(sep=" "), number))


@pytest.mark.slow
def test_a_baseline_older_than_the_bound_is_not_reused(tmp_path):
    exp, db = tiny_experiment(tmp_path / "exp"), tmp_path / "autotune.db"
    _sweep(exp, db, 2)
    _age(db, 0, hours=6.1)  # the default measure.baseline_max_age: 6 h
    resumed = _sweep(exp, db, 4)
    study, trials = _trials(db)
    assert _baselines(trials) == [0, 3] and "baselines: 2\nbaselines_reused: 0\n" in resumed.stdout
    assert trials[3].user_attrs["identity"] == trials[0].user_attrs["identity"]  # only its age differs
    assert all(t.user_attrs["baseline_trial"] == 3 and not t.user_attrs["baseline_reused"] for t in trials[4:])
    # the fresh one would be reused by a next restart, unless measure.baseline_max_age is 0
    ident = trials[3].user_attrs["identity"]
    assert st.reusable_baseline(study, "next:1", ident, 6 * 3600).number == 3
    assert st.reusable_baseline(study, "next:1", ident, 0) is None


def test_an_interrupted_baseline_is_not_retried():
    """Its worker is gone; the one that replaces it measures or reuses its own baseline, so a retry
    would only add a second baseline right after that one. Other roles are retried once."""
    study = optuna.create_study(direction="maximize")
    for role in ("baseline", "search"):
        st.enqueue(study, role, {} if role == "baseline" else {"x": 1.0})
        trial = study.ask()
        if role == "search":
            trial.suggest_float("x", 0.0, 2.0)
        st.fail_trial(study, trial.number, "interrupted: its driver stopped", interrupted=True)
    assert all(t.state == TrialState.FAIL for t in study.trials)
    assert [st.role_of(t) for t in st.pending_retries(study)] == ["search"]
