"""Several drivers on one PostgreSQL study: together they finish exactly N trials, none twice.

Each test run gets a database of its own (created here, dropped afterwards). The tests skip, with
the reason, when no PostgreSQL answers on 127.0.0.1:5432 (`.ci/run` starts one where it is installed).
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import optuna
import pytest
from autotune_helpers import env, tiny_experiment
from optuna.trial import TrialState

from autotune import study as st

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432"
N = 10


@pytest.fixture(scope="module")
def pg_url():
    sqlalchemy = pytest.importorskip("sqlalchemy")
    admin = sqlalchemy.create_engine(f"{SERVER}/postgres", isolation_level="AUTOCOMMIT",
                                     poolclass=sqlalchemy.pool.NullPool)
    name = f"autotune_test_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as con:
            con.execute(sqlalchemy.text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # no server, no driver, no permission: the shared-study tests cannot run here
        pytest.skip(f"PostgreSQL not usable at {SERVER} ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
    yield f"{SERVER}/{name}"
    with admin.connect() as con:
        con.execute(sqlalchemy.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def _driver(exp: Path, url: str, cwd: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "autotune", "sweep", str(exp), "--storage", url, "--study-name", "shared",
           "--tracking-uri", "none", "--n-trials", str(N), "--no-progress"]
    return subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_drivers_finish_exactly_n_trials_without_duplicates(pg_url, tmp_path):
    exp = tiny_experiment(tmp_path / "exp", study={"n_trials": N, "sampler": "tpe", "seed": 0},
                          workload={"sets": ["prompts.jsonl"], "n_prompts": 2, "max_new_tokens": 16, "seed": 0},
                          measure={"warmup": 0, "repeats": 2, "max_rel_mad": 0.9, "baseline_every": 100,
                                   "confirm_top": 0})
    drivers = [_driver(exp, pg_url, tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in drivers]
    for p, (out, err) in zip(drivers, outs, strict=True):
        assert p.returncode == 0, err
        assert "exit: done" in out
    study = optuna.load_study(study_name="shared", storage=pg_url)
    trials = study.get_trials()
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    # nothing lost, nothing extra: N configs measured (n_trials), and the AR baselines beside them
    baselines = sum(st.role_of(t) == "baseline" for t in trials)
    assert sum(st.counts_toward_budget(t) for t in trials) == N == len(trials) - baselines
    assert sorted(t.number for t in trials) == list(range(len(trials)))
    by_driver = {t.user_attrs["driver"] for t in trials}
    assert len(by_driver) == 2  # both measured
    for d in by_driver:
        # Each driver's worker measured its own AR baseline, or (issue #23), when the other's had
        # finished before it planned its first trial, reused that one: the same machine and settings.
        own = sum(st.role_of(t) == "baseline" and t.user_attrs["driver"] == d for t in trials)
        reused = st.baseline_reuse(study, d)  # a local worker's id is its driver's
        assert (own, reused is None) in ((1, True), (0, False))
    assert sum(st.role_of(t) == "reference" for t in trials) == 1
    assert sum(st.role_of(t) == "search" for t in trials) == N - 1
