"""Whole sweeps on the tiny seeded target: storages, roles, exactness, failures, samplers, resume."""

from __future__ import annotations

import io
import json
import threading
import uuid
from pathlib import Path

import optuna
import pytest
from autotune_helpers import TINY_SPACE, tiny_experiment
from faulty_worker import FaultyWorker
from optuna.trial import TrialState

from autotune import experiment, results
from autotune import study as st
from autotune.errors import InputError
from autotune.executors import LocalExecutor
from autotune.storage import parse_storage
from autotune.sweep import SweepOptions, run_sweep
from autotune.worker import Worker

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def sweep(exp_path: Path, storage: str, n_trials: int | None = None, study_name: str | None = None,
          tracking: str | None = None, output_hook=None, faults=None):
    exp = experiment.load(exp_path)
    workloads = experiment.load_workloads(exp)
    executor = None
    if output_hook is not None or faults is not None:
        executor = LocalExecutor(lambda: FaultyWorker.load(exp.model.target, exp.model.draft, exp.model.device,
                                                           exp.model.dtype, workloads, exp.fixed_engine,
                                                           output_hook=output_hook, faults=faults))
    opts = SweepOptions(n_trials=n_trials or exp.study.n_trials, storage=parse_storage(storage),
                        study_name=study_name or exp.name, tracking_uri=tracking, progress=False)
    out = io.StringIO()
    outcome = run_sweep(exp, opts, workloads, executor=executor, out=out)
    return outcome, out.getvalue()


def _postgres_or_skip() -> str:
    import sqlalchemy

    try:
        with sqlalchemy.create_engine(PG_URL).connect():
            pass
    except Exception as exc:  # any reason PostgreSQL is unusable here means: skip, not fail
        pytest.skip(f"PostgreSQL not reachable at 127.0.0.1:5432 ({type(exc).__name__})")
    return PG_URL


@pytest.fixture(params=["sqlite", "memory", "journal", "postgresql"])
def storage(request, tmp_path):
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'autotune.db'}", name
    elif request.param == "memory":
        yield "memory", name
    elif request.param == "journal":
        yield f"journal:{tmp_path / 'journal.log'}", name
    else:
        url = _postgres_or_skip()
        yield url, name
        optuna.delete_study(study_name=name, storage=url)


def test_full_sweep_roles_scores_and_resume(storage, tmp_path):
    url, name = storage
    exp_path = tiny_experiment(tmp_path / "exp")
    outcome, text = sweep(exp_path, url, study_name=name)
    assert outcome.exit_code == 0
    trials = outcome.study.get_trials()
    # n_trials (5) counts the configs measured; the AR baselines (first, then after every 4) come beside
    roles = [st.role_of(t) for t in trials]
    assert roles == ["baseline", "reference", "search", "search", "search", "baseline", "search"]
    assert st.n_finished(outcome.study) == 5 and all(t.state == TrialState.COMPLETE for t in trials)
    assert outcome.study.metric_names == ["decode_tps"]  # what optuna-dashboard labels the objective
    assert trials[0].user_attrs["config"]["verify"] == "ar"
    assert st.REFERENCE.items() <= trials[1].user_attrs["config"].items()
    for t in trials:
        a = t.user_attrs
        assert len(a["decode_tps_runs"]) >= 2 and t.value == pytest.approx(a["decode_tps_median"] - a["spread"])
        assert a["exact_match"] == 1.0 and t.constraints == {"exactness": 0.0}
        assert a["worker"] == st.me() and a["speedup_vs_ar"] > 0
        assert set(a["phase_ms_per_step"]) == {"draft", "topk", "tree", "verify", "walk", "commit"}
        assert a["decode_loops"] == {"generic": 2}  # the CPU runs no graphs: what ran is recorded per trial
    assert trials[0].user_attrs["speedup_vs_ar"] == 1.0
    for t in trials[1:]:
        a = t.user_attrs
        if st.role_of(t) == "baseline":
            continue
        assert a["baseline_trial"] == max(b.number for b in trials[: t.number] if st.role_of(b) == "baseline")
        assert a["break_even_al"] == pytest.approx(a["step_ms"] * a["ar_decode_tps"] / 1000)
        assert 0 <= a["oracle_gate_fraction"] <= 1
        assert a["per_set"]["prompts"]["oracle_gate"]["ideal_tps"] > 0
    conf = outcome.study.user_attrs["confirmation"]
    assert conf["winner"] in [c["trial"] for c in conf["candidates"]]
    # AR (a baseline) always competes in the confirmation
    assert any(st.role_of(trials[c["trial"]]) == "baseline" for c in conf["candidates"])
    assert "trials_finished: 5\nbaselines: 2\nbaselines_reused: 0\n" in text and f"best_trial: {conf['winner']}" in text
    if url == "memory":
        return
    again, _ = sweep(exp_path, url, study_name=name)  # same command: resumes, nothing left to do
    assert len(again.study.get_trials()) == 7
    more, _ = sweep(exp_path, url, n_trials=7, study_name=name)
    trials = more.study.get_trials()
    assert st.n_finished(more.study) == 7
    assert len(trials) == 7 + sum(st.role_of(t) == "baseline" for t in trials)
    assert sum(st.role_of(t) == "reference" for t in trials) == 1


def test_a_sweep_whose_every_trial_fails_exits_1_with_the_first_reason(tmp_path):
    """Nothing measured is not "done": exit 1 and the first failure's reason (issue #23)."""
    outcome, text = sweep(tiny_experiment(tmp_path), "memory", n_trials=3, faults={i: "oom" for i in range(10)})
    assert outcome.exit_code == 1
    assert outcome.facts["trials_complete"] == 0 and outcome.facts["trials_failed"] == 4  # the baseline too
    assert "exit: failed: every trial failed; the first: OutOfMemoryError: injected" in text


def _corrupt_chain(config, outputs):
    """FaultyWorker's output hook: pretend the chain path changed the last token of every output."""
    if config.get("verify") != "chain":
        return outputs
    return [out[:-1] + [(out[-1] + 1) % 256] for out in outputs]


def _grid_experiment(folder: Path, exactness: str) -> Path:
    space = {"verify": {"type": "categorical", "choices": ["chain", "ddtree"]}}
    return tiny_experiment(folder, space=space, study={"n_trials": 4, "sampler": "grid", "seed": 0},
                           measure={"warmup": 0, "repeats": 2, "max_rel_mad": 0.5, "exactness": exactness,
                                    "confirm_top": 2, "confirm_repeats": 2})


def test_inexact_config_is_infeasible_and_never_wins(tmp_path):
    outcome, text = sweep(_grid_experiment(tmp_path, "strict"), "memory", output_hook=_corrupt_chain)
    s = outcome.study
    chain = [t for t in s.get_trials() if t.params.get("verify") == "chain"]
    assert len(chain) == 1
    bad = chain[0]
    assert bad.state == TrialState.COMPLETE
    assert bad.user_attrs["exact_match"] == 0.0 and bad.user_attrs["first_divergence"] == 7
    _assert_forensics(bad)
    for t in s.get_trials():  # checked and exact: no divergence, every verdict counted at zero
        if t.number != bad.number and t.state == TrialState.COMPLETE:
            a = t.user_attrs
            assert (a["inexact_count"], a["divergences"]) == (0, [])
            assert a["divergence_verdicts"] == {"numeric tie": 0, "mismatch": 0}
    assert bad.constraints["exactness"] == 1.0 and not results.feasible(bad)
    assert s.best_trial.number != bad.number
    assert results.winner(s).trial != bad.number
    assert bad.number not in [c["trial"] for c in s.user_attrs["confirmation"]["candidates"]]
    assert "trials_infeasible: 1" in text


def _assert_forensics(t: optuna.trial.FrozenTrial) -> None:
    """The chain trial's divergence records: both prompts at the rewritten last token (position 7),
    re-decoded by AR and chain, which pick the true token from the same row (equal margins, far
    wider than float32's tie bound: a mismatch), and which the rewritten outputs do not reproduce."""
    a = t.user_attrs
    assert a["inexact_count"] == 2 and a["divergence_verdicts"] == {"numeric tie": 0, "mismatch": 2}
    divs = a["divergences"]
    assert [d["prompt"] for d in divs] == ["prompts[0]", "prompts[1]"]
    for d in divs:
        assert d["position"] == 7 and d["verdict"] == "mismatch" and d["reproduced"] is False
        assert d["ar_margin"] == pytest.approx(d["run_margin"], abs=1e-4)
        assert d["ar_margin"] > d["tie_bound"] > 0 and d["tie_bound"] < 1e-4  # float32: a few 1e-6


def test_exactness_report_records_without_rejecting(tmp_path):
    from mlflow import MlflowClient

    from autotune.report import write_report

    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    outcome, text = sweep(_grid_experiment(tmp_path, "report"), "memory", output_hook=_corrupt_chain, tracking=db)
    chain = [t for t in outcome.study.get_trials() if t.params.get("verify") == "chain"][0]
    assert chain.user_attrs["exact_match"] == 0.0 and chain.constraints == {}
    _assert_forensics(chain)
    # MLflow: the counts as metrics, the records as an artifact
    client = MlflowClient(db)
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id],
                              f"tags.`autotune.trial` = '{chain.number}'")
    assert len(runs) == 1
    m = runs[0].data.metrics
    assert (m["inexact_count"], m["verdict.mismatch"], m["verdict.numeric_tie"]) == (2, 2, 0)
    local = client.download_artifacts(runs[0].info.run_id, "divergences.json", str(tmp_path))
    assert json.loads(Path(local).read_text()) == chain.user_attrs["divergences"]
    # the report: the trial's counts and a row per divergence with both margins and the verdict
    md = write_report(outcome.study, tmp_path / "rep")[0].read_text()
    assert "### Divergences" in md and "numeric tie 0, mismatch 2" in md
    for d in chain.user_attrs["divergences"]:
        assert (f"| {chain.number} | {d['prompt']} | 7 | {d['ar_margin']:.4f} | {d['run_margin']:.4f} | "
                f"{d['tie_bound']:.3g} | mismatch (not reproduced) |") in md


def test_a_config_the_engine_refuses_is_infeasible_with_its_reason(tmp_path):
    """``draft_path: runtime`` with the oracle draft (it proposes on the host): the engine refuses it
    instead of decoding in another loop. The trial completes unmeasured and infeasible (constraint
    ``runnable``), its reason in the study, the report, the summary and MLflow; it never wins."""
    from mlflow import MlflowClient

    from autotune.report import write_report

    space = {"verify": {"type": "categorical", "choices": ["chain"]},
             "draft_path": {"type": "categorical", "choices": ["generic", "runtime"]}}
    exp_path = tiny_experiment(tmp_path, space=space, study={"n_trials": 4, "sampler": "grid", "seed": 0},
                               measure={"warmup": 0, "repeats": 2, "max_rel_mad": 0.5, "exactness": "report",
                                        "confirm_top": 2, "confirm_repeats": 2})
    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    outcome, text = sweep(exp_path, "memory", tracking=db)
    s = outcome.study
    refused = [t for t in s.get_trials() if t.params.get("draft_path") == "runtime"]
    assert len(refused) == 1
    bad = refused[0]
    assert bad.state == TrialState.COMPLETE and bad.value == 0.0
    assert "proposes on the host" in bad.user_attrs["refused"] and "decode_tps_median" not in bad.user_attrs
    assert bad.constraints == {"runnable": 1.0} and not results.feasible(bad)
    assert results.refused(s) == [bad] and results.infeasible(s) == []  # not an exactness failure
    assert results.winner(s).trial != bad.number
    assert bad.number not in [c["trial"] for c in s.user_attrs["confirmation"]["candidates"]]
    assert "trials_refused: 1" in text and "trials_infeasible: 0" in text
    md = write_report(s, tmp_path / "rep")[0].read_text()
    assert "## Refused by the engine" in md and f"| {bad.number} | {bad.user_attrs['refused']} |" in md
    assert "1 refused by the engine" in md and "EXACTNESS FAILURES" not in md
    client = MlflowClient(db)
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id],
                              f"tags.`autotune.trial` = '{bad.number}'")
    assert runs[0].data.tags["refused"] == bad.user_attrs["refused"] and runs[0].data.tags["feasible"] == "False"


def test_engine_failures_become_failed_trials_and_the_sweep_goes_on(tmp_path):
    # a pair loaded without a draft: AR works, every speculative config fails inside the engine
    exp_path = tiny_experiment(tmp_path, model={"target": "tiny-dense", "draft": "none", "device": "cpu"},
                               study={"n_trials": 4, "sampler": "random", "seed": 0})
    outcome, text = sweep(exp_path, "memory")
    trials = outcome.study.get_trials()
    assert outcome.exit_code == 0 and len(trials) == 5  # 4 configs and the baseline (n_trials counts configs)
    assert trials[0].state == TrialState.COMPLETE and st.role_of(trials[0]) == "baseline"
    for t in trials[1:]:
        assert t.state == TrialState.FAIL
        assert "needs a draft" in t.user_attrs["fail_reason"]
    assert "trials_failed: 4" in text and "best_role: baseline" in text


@pytest.mark.parametrize("sampler,pruner", [("gp", "none"), ("random", "wilcoxon"), ("tpe", "wilcoxon")])
def test_other_samplers_and_the_wilcoxon_pruner(tmp_path, sampler, pruner):
    exp_path = tiny_experiment(tmp_path, study={"n_trials": 5, "sampler": sampler, "pruner": pruner, "seed": 1})
    outcome, _ = sweep(exp_path, "memory")
    trials = outcome.study.get_trials()
    assert st.n_finished(outcome.study) == 5 and len(trials) == 5 + sum(st.role_of(t) == "baseline" for t in trials)
    assert {t.state for t in trials} <= {TrialState.COMPLETE, TrialState.PRUNED}
    for t in trials:  # per-prompt TPS are the pruner's steps
        assert sorted(t.intermediate_values) == [0, 1]


def test_baseline_is_remeasured_every_n_trials(tmp_path):
    exp_path = tiny_experiment(tmp_path, measure={"warmup": 0, "repeats": 1, "max_rel_mad": 0.9,
                                                  "baseline_every": 2, "confirm_top": 0},
                               study={"n_trials": 6, "sampler": "random", "seed": 0})
    outcome, _ = sweep(exp_path, "memory")
    roles = [st.role_of(t) for t in outcome.study.get_trials()]
    # 6 configs (n_trials), an AR baseline before them and after every 2
    assert roles == ["baseline", "reference", "search", "baseline", "search", "search", "baseline", "search", "search"]
    last = outcome.study.get_trials()[8]
    assert last.user_attrs["baseline_trial"] == 6  # the nearest AR measurement, not the first one
    assert "confirmation" not in outcome.study.user_attrs  # confirm_top: 0 turns the phase off


def test_resume_refuses_a_changed_experiment(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    sweep(tiny_experiment(tmp_path / "a", study={"n_trials": 2, "sampler": "random"}), url, study_name="s")
    changed = tiny_experiment(tmp_path / "b", space={**TINY_SPACE, "top_k": {"type": "int", "low": 1, "high": 5,
                                                                            "when": {"verify": "ddtree"}}})
    with pytest.raises(InputError, match="different experiment"):
        sweep(changed, url, study_name="s")


def test_a_confirmation_re_measurement_that_fails_is_said_not_dropped_silently(tmp_path, monkeypatch, capsys):
    """The AR baseline failing its confirmation re-measurement (on the H200 a poisoned CUDA graph pool
    did this, 2026-12-04) leaves no confirmed speedup: the confirmation keeps the trial and its
    reason, the sweep says so, and the report names it beside the winner's missing ratio."""
    from autotune.report import write_report

    measure = Worker.measure

    def failing_ar_confirm(self, job, on_first_pass=None, on_progress=None):
        rec = measure(self, job, on_first_pass, on_progress)
        if job.role == "confirm" and job.config.get("verify") == "ar":
            rec.ok, rec.fail_reason = False, "RuntimeError: capturing the 'ar' step as a CUDA graph failed"
        return rec

    monkeypatch.setattr(Worker, "measure", failing_ar_confirm)
    outcome, _ = sweep(tiny_experiment(tmp_path), "memory")
    conf = outcome.study.user_attrs["confirmation"]
    ar = conf["dropped"][0]["trial"]  # the baseline the confirmation re-measures (one of the AR trials)
    assert st.role_of(outcome.study.trials[ar]) == "baseline"
    assert conf["dropped"] == [{"trial": ar, "role": "baseline",
                                "reason": "RuntimeError: capturing the 'ar' step as a CUDA graph failed"}]
    assert conf["ar_median_tps"] is None and ar not in [c["trial"] for c in conf["candidates"]]
    assert f"confirmation: trial {ar} (baseline) dropped: RuntimeError: capturing" in capsys.readouterr().err
    md = write_report(outcome.study, tmp_path / "rep")[0].read_text()
    assert (f"**Trial {ar} (baseline) was dropped from the confirmation** (the AR baseline: no speedup is "
            "confirmed): RuntimeError: capturing the 'ar' step") in md
    assert "No conclusion vs AR: the AR baseline was not re-measured" in md and "treat as a tie" not in md


def test_a_confirmation_where_every_re_measurement_fails_is_reported_with_the_reasons(tmp_path, monkeypatch):
    """Nothing re-measured (a worker whose every capture fails): no winner is confirmed, and the
    study and the report keep each dropped trial's reason rather than only "did not run"."""
    from autotune.report import write_report

    measure = Worker.measure

    def failing_confirm(self, job, on_first_pass=None, on_progress=None):
        rec = measure(self, job, on_first_pass, on_progress)
        if job.role == "confirm":
            rec.ok, rec.fail_reason = False, f"RuntimeError: capture failed on trial {job.trial}"
        return rec

    monkeypatch.setattr(Worker, "measure", failing_confirm)
    outcome, _ = sweep(tiny_experiment(tmp_path), "memory")
    attrs = outcome.study.user_attrs
    assert "confirmation" not in attrs and attrs["confirmation_failed"]["dropped"]
    ar = next(d["trial"] for d in attrs["confirmation_failed"]["dropped"] if d["role"] == "baseline")
    assert {d["trial"] for d in attrs["confirmation_failed"]["dropped"]} >= {ar, 1}
    md = write_report(outcome.study, tmp_path / "rep")[0].read_text()
    assert "**Every re-measurement failed** after 5 trials" in md
    assert f"- Trial {ar} (baseline): RuntimeError: capture failed on trial {ar}" in md


def test_the_progress_bar_says_the_phase_and_the_best_by_the_study_s_own_value(tmp_path, capsys):
    """The bar names what runs now (the AR baseline, config i of n, the confirmation) and the best
    so far by its conservative value, the median beside it (issue #24); where inside a trial it is
    (the pass and the prompt); its elapsed time moves while one trial runs (a refresher thread,
    stopped at the end)."""
    exp = experiment.load(tiny_experiment(tmp_path / "exp", study={"n_trials": 3, "sampler": "random", "seed": 0}))
    opts = SweepOptions(n_trials=3, storage=parse_storage("memory"), study_name="bar", tracking_uri=None,
                        progress=True)
    outcome = run_sweep(exp, opts, experiment.load_workloads(exp), out=io.StringIO())
    err = capsys.readouterr().err
    assert outcome.exit_code == 0
    for phase in ("bar: AR baseline (trial 0)", "bar: reference DDTree (trial 1)", "bar: config 2/3",
                  "bar: confirming the best"):
        assert phase in err, phase
    # the tiny experiment: 2 prompts, no warm-up, 2 repeats (and 2 in the confirmation)
    for where in ("(trial 0) · AR outputs: prompts 2/2", "(trial 0) · pass 1/2: prompts 1/2",
                  "(trial 1) · pass 2/2: prompts 2/2", "configs · pass 2/2: prompts 1/2"):
        assert where in err, where
    w = results.winner(outcome.study)
    assert f"best #{w.trial}: value {w.value:.1f} (median {w.median_tps:.1f}) tok/s" in err
    assert "config/s" in err or "s/config" in err  # configs counted, not baselines
    assert not [t for t in threading.enumerate() if t.name == "autotune-progress"]
