"""A driver killed mid-trial (kill -9) or stopped with Ctrl-C, then the same command again."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from autotune_helpers import env, run_autotune, tiny_experiment
from optuna.trial import TrialState

from autotune import study as st

N = 7


def _start(exp: Path, db: Path, cwd: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "autotune", "sweep", str(exp), "--storage", f"sqlite:///{db}",
           "--tracking-uri", "none", "--n-trials", str(N), "--no-progress"]
    return subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _states(db: Path) -> dict[str, int]:
    """Read trial states straight from SQLite (read-only), without touching the driver's storage.
    ``RUNNING_WITH_PARAMS`` counts running trials whose config (all sampled params) is stored."""
    if not db.exists():
        return {}
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as con:
            states = dict(con.execute("select state, count(*) from trials group by state").fetchall())
            states["RUNNING_WITH_PARAMS"] = con.execute(
                "select count(*) from trials t join trial_user_attributes a on a.trial_id = t.trial_id "
                "where t.state = 'RUNNING' and a.key = 'config' and a.value_json like ? "
                "and a.value_json not like ?", ('%"verify"%', '%"ar"%')).fetchone()[0]
            return states
    except sqlite3.OperationalError:  # tables not created yet, or a write lock for a moment
        return {}


def _wait_for_running_trial(proc: subprocess.Popen, db: Path, min_done: int, with_params: bool,
                            timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"driver exited early: {proc.communicate()}"
        s = _states(db)
        running = s.get("RUNNING_WITH_PARAMS" if with_params else "RUNNING", 0)
        if min_done <= s.get("COMPLETE", 0) < N - 2 and running == 1:
            return
        time.sleep(0.02)
    raise AssertionError(f"no running trial seen in time: {_states(db)}")


def _experiment(tmp_path: Path) -> Path:
    # a few more tokens than elsewhere, so most of the driver's time is spent inside a trial
    return tiny_experiment(tmp_path / "exp", workload={"sets": ["prompts.jsonl"], "n_prompts": 2,
                                                       "max_new_tokens": 16, "seed": 0},
                           study={"n_trials": N, "sampler": "tpe", "seed": 0})


def _load(db: Path) -> optuna.Study:
    return optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}")


@pytest.mark.slow
def test_kill_9_then_resume_finishes_exactly_n_trials(tmp_path):
    exp, db = _experiment(tmp_path), tmp_path / "autotune.db"
    proc = _start(exp, db, tmp_path)
    _wait_for_running_trial(proc, db, min_done=2, with_params=True)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert _states(db).get("RUNNING") == 1
    killed = next(t for t in _load(db).get_trials() if t.state == TrialState.RUNNING)

    resumed = run_autotune(["sweep", str(exp), "--storage", f"sqlite:///{db}", "--tracking-uri", "none",
                            "--n-trials", str(N), "--no-progress"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "stale_trials_failed: 1" in resumed.stdout
    study = _load(db)
    trials = study.get_trials()
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    assert sum(st.counts_toward_budget(t) for t in trials) == N  # n_trials counts configs (search + reference)
    stale = trials[killed.number]
    assert stale.state == TrialState.FAIL and stale.user_attrs["interrupted"] is True
    assert "interrupted" in stale.user_attrs["fail_reason"]
    retries = [t for t in trials if t.user_attrs.get("retry_of") is not None]
    assert [t.user_attrs["retry_of"] for t in retries] == [killed.number]  # retried exactly once
    assert stale.params and retries[0].params == stale.params  # the same config, measured again
    assert st.role_of(retries[0]) == st.role_of(stale) == "search"
    assert sum(st.role_of(t) == "reference" for t in trials) == 1
    assert sum(st.role_of(t) == "search" and st.counts_toward_budget(t) for t in trials) == N - 1
    # Baselines, beside the configs (issue #23): the killed driver measured one, trial 0 (it was killed
    # before its 4th config, so before any re-measurement). The restart measured none when it started:
    # it reuses trial 0 (same machine, code, models, prompts and settings, seconds old), and measures
    # AR again only after every baseline_every (4) configs of its own, as any worker does.
    baselines = [t for t in trials if st.role_of(t) == "baseline"]
    assert [t.number for t in baselines if t.user_attrs["worker"] == killed.user_attrs["worker"]] == [0]
    restart = retries[0].user_attrs["worker"]
    assert restart != killed.user_attrs["worker"] and st.baseline_reuse(study, restart)["trial"] == 0
    configs = [t for t in trials if t.user_attrs.get("worker") == restart and st.counts_toward_budget(t)]
    assert len(baselines) == 1 + (len(configs) - 1) // 4
    assert all(t.state == TrialState.COMPLETE for t in baselines)
    assert configs[0].user_attrs["baseline_trial"] == 0 and configs[0].user_attrs["baseline_reused"] is True
    # nothing else: the N configs, the killed trial and the baselines
    assert len(trials) == N + 1 + len(baselines)
    assert sorted(t.number for t in trials) == list(range(len(trials)))


def test_ctrl_c_fails_the_running_trial_and_exits_130(tmp_path):
    exp, db = _experiment(tmp_path), tmp_path / "autotune.db"
    proc = _start(exp, db, tmp_path)
    _wait_for_running_trial(proc, db, min_done=1, with_params=False)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "exit: interrupted" in out
    trials = _load(db).get_trials()
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert len(failed) == 1 and "Ctrl-C" in failed[0].user_attrs["fail_reason"]
