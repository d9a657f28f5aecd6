"""Small rules with many cases: storage URLs, durations, stale trials, the timeout."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import socket

import optuna
import pytest
from autotune_helpers import tiny_experiment
from optuna.trial import TrialState

from autotune import experiment
from autotune import study as st
from autotune.cli import parse_duration
from autotune.errors import InputError
from autotune.storage import parse_storage
from autotune.sweep import SweepOptions, run_sweep


@pytest.mark.parametrize("url,kind", [("memory", "memory"), ("sqlite:///x.db", "rdb"), ("journal:x.log", "journal"),
                                      ("postgresql+psycopg://u@h:5432/db", "rdb")])
def test_storage_urls(url, kind, in_tmp):
    spec = parse_storage(url)
    assert spec.kind == kind
    assert list(in_tmp.iterdir()) == []  # parsing creates nothing


def test_journal_absolute_path(tmp_path):
    assert parse_storage(f"journal:///{tmp_path}/j.log").path == tmp_path / "j.log"


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", "journal:", "nosuchdb://x", "x.db"])
def test_bad_storage_urls(url):
    with pytest.raises(InputError, match="--storage"):
        parse_storage(url)


@pytest.mark.parametrize("raw,seconds", [("90", 90), ("90s", 90), ("30m", 1800), ("8h", 28800),
                                         ("1h30m", 5400), ("1.5h", 5400)])
def test_durations(raw, seconds):
    assert parse_duration(raw) == seconds


@pytest.mark.parametrize("raw", ["", "0", "8 hours", "h", "-5m"])
def test_bad_durations(raw):
    with pytest.raises(InputError, match="--timeout"):
        parse_duration(raw)


def _running(driver: str | None = None, heartbeat: str | None = None, age_s: float = 0) -> optuna.trial.FrozenTrial:
    attrs = {k: v for k, v in (("driver", driver), ("heartbeat", heartbeat)) if v is not None}
    return optuna.trial.FrozenTrial(number=0, state=TrialState.RUNNING, value=None,
                                    datetime_start=dt.datetime.now() - dt.timedelta(seconds=age_s),
                                    datetime_complete=None, params={}, distributions={}, user_attrs=attrs,
                                    system_attrs={}, intermediate_values={}, trial_id=0)


def test_stale_rules():
    host = socket.gethostname()
    assert st.is_stale(_running(f"{host}:999999999"))  # our host, that process is gone
    assert not st.is_stale(_running(f"{host}:1"))  # our host, pid 1 is alive
    fresh = dt.datetime.now(dt.UTC).isoformat()
    old = (dt.datetime.now(dt.UTC) - dt.timedelta(seconds=st.STALE_AFTER_S + 60)).isoformat()
    assert not st.is_stale(_running("elsewhere:12", heartbeat=fresh))  # another host, still beating
    assert st.is_stale(_running("elsewhere:12", heartbeat=old))  # another host, silent for too long
    assert not st.is_stale(_running(None, age_s=5))  # no driver named yet: only age can tell
    assert st.is_stale(_running(None, age_s=st.STALE_AFTER_S + 60))


def test_timeout_stops_starting_trials_and_exits_cleanly(tmp_path, monkeypatch):
    import itertools

    from autotune import sweep

    clock = itertools.count(0.0, 100.0)  # a fake clock: every reading is 100 s later, so no test waits
    monkeypatch.setattr(sweep.time, "monotonic", lambda: next(clock))
    exp = experiment.load(tiny_experiment(tmp_path, study={"n_trials": 50, "sampler": "random"}))
    opts = SweepOptions(n_trials=50, storage=parse_storage("memory"), study_name="t", tracking_uri=None,
                        timeout_s=50.0, progress=False)
    out = io.StringIO()
    outcome = run_sweep(exp, opts, experiment.load_workloads(exp), out=out)
    assert outcome.exit_code == 0
    assert outcome.study.get_trials() == []  # the clock ran out before the first trial could start
    assert "trials_finished: 0" in out.getvalue() and "exit: done" in out.getvalue()


def test_a_ctrl_c_swallowed_by_a_finalizer_is_still_delivered_at_the_next_checkpoint():
    """Ctrl-C while measuring raises at once; if that lands in a garbage-collection callback Python
    drops it (as a sweep on the 2-core CI machine saw), so it stays pending for the next checkpoint."""
    from autotune.interrupt import CtrlC

    ctrl_c = CtrlC()
    with ctrl_c.measuring():
        with contextlib.suppress(KeyboardInterrupt):  # the finalizer that swallowed it
            ctrl_c._handler(2, None)
    with pytest.raises(KeyboardInterrupt):
        ctrl_c.checkpoint()
    ctrl_c.checkpoint()  # delivered once
