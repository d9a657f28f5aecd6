"""MLflow's parent run answers at a glance (issue #24): the winner's figures, its applicable config,
the conclusion and the report on the sweep's own row; child runs named by path and role.

Studies here are built from trial records (no model runs), so each winner kind is certain: the
tiny sweep in test_outputs.py checks the same on a real run.
"""

from __future__ import annotations

from typing import Any

import optuna
import pytest
from optuna.distributions import FloatDistribution

from autotune import results
from autotune.errors import InputError
from autotune.storage import parse_storage
from autotune.tracking import (
    Tracker,
    applicable_config,
    conclusion,
    config_label,
    description,
    exactness,
    headline,
    run_name,
)
from engine import EngineConfig

pytestmark = pytest.mark.xdist_group("test_tracking")  # its module fixture runs a sweep with MLflow: once

TREE_ONLY = {"budget", "top_k", "proposal_temp", "chain_seed"}


def _config(**fields: Any) -> dict[str, Any]:
    return EngineConfig.from_dict(fields).to_dict()  # every field, as a sweep records it


DDTREE = _config(verify="ddtree", draft_path="runtime", budget=48, top_k=4, proposal_temp=0.7)
CHAIN = _config(verify="chain", draft_path="generic")
AR = _config(verify="ar")


def _trial(number: int, role: str, config: dict[str, Any], median: float, spread: float = 1.0,
           ar: float | None = 100.0, exact: float = 1.0, al: float = 3.0) -> optuna.trial.FrozenTrial:
    attrs = {"role": role, "config": config, "worker": "host:1", "decode_tps_median": median, "spread": spread,
             "decode_tps_runs": [median - spread, median, median + spread], "acceptance_length": al,
             "exact_match": exact, "ar_decode_tps": ar, "speedup_vs_ar": median / ar if ar else None,
             "baseline_trial": 0, "workload_hash": "h", "device": "cpu", "step_ms": 10.0,
             "phase_ms_per_step": {"draft": 2.0, "verify": 7.0}, "per_set": {}}
    return optuna.trial.create_trial(value=median - spread, params={"x": float(number)},
                                     distributions={"x": FloatDistribution(0, 100)}, user_attrs=attrs)


def _study(name: str, winner_config: dict[str, Any], positive: bool | None = True,
           confirmed: bool = True) -> optuna.Study:
    """AR baseline (trial 0, 100 tok/s), the reference (trial 1), and the winner (trial 2, 150 tok/s)."""
    study = optuna.create_study(study_name=name, direction="maximize")
    study.set_user_attr("model", {"target": "tiny-dense", "draft": "oracle:0.3"})
    study.add_trial(_trial(0, "baseline", AR, 100.0, ar=100.0, al=1.0))
    study.add_trial(_trial(1, "reference", _config(), 120.0))
    study.add_trial(_trial(2, "search", winner_config, 150.0, spread=4.0))
    if confirmed:
        cands = [{"trial": n, "config": c, "score": {"median": m, "spread": s, "value": m - s},
                  "speedup_vs_ar": m / 100.0, "break_even_al": None if n == 0 else 1.5, "exact_match": 1.0}
                 for n, c, m, s in ((0, AR, 100.0, 1.0), (1, _config(), 121.0, 1.0), (2, winner_config, 151.0, 4.0))]
        study.set_user_attr("confirmation", {
            "finished_trials": 2, "repeats": 3, "worker": "host:1", "when": "now", "winner": 2, "ties": [],
            "ar_median_tps": 100.0, "winner_median_tps": 151.0, "winner_spread": 4.0, "winner_speedup_vs_ar": 1.51,
            "positive_vs_ar": positive, "positive_vs_reference": True, "dropped": [], "candidates": cands})
    return study


@pytest.fixture(scope="module")
def uri(tmp_path_factory) -> str:
    """One MLflow store for the module (creating its tables takes seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def _swept(uri: str, study: optuna.Study, status: str = "FINISHED") -> Tracker:
    tracker = Tracker(uri, study, study.study_name)
    tracker.sync()
    tracker.finish(status)
    return tracker


def _parent(tracker: Tracker):
    return tracker.client.get_run(tracker.parent)


# ------------------------------------------------------------------ pure functions


def test_only_the_fields_of_the_verify_mode_apply():
    assert TREE_ONLY <= set(applicable_config(DDTREE))
    assert not TREE_ONLY & set(applicable_config(CHAIN)) and "rollback" in applicable_config(CHAIN)
    assert not (TREE_ONLY | {"rollback", "block_size", "target_feat_ctx"}) & set(applicable_config(AR))
    assert {"verify", "draft_path", "kernels"} <= set(applicable_config(AR))
    assert applicable_config({"verify": "nonsense"}) == {"verify": "nonsense"}  # refused: shown as recorded


def test_labels_name_the_path_and_key_parameters():
    assert config_label(DDTREE) == "ddtree/runtime b48 k4 t0.7"
    assert config_label(_config()) == "ddtree/auto b22 k8"  # a tree's size even at the defaults
    assert config_label(CHAIN) == "chain/generic"
    assert config_label({**CHAIN, "budget": 5, "rollback": "replay", "kernels": "eager"}) == \
        "chain/generic replay eager"  # a budget does not apply to a chain
    assert config_label(AR) == "ar/auto"
    assert [run_name(t) for t in _study("names", DDTREE).trials] == [
        "AR baseline (worker host:1, #0)", "reference ddtree/auto b22 k8 (#1)", "ddtree/runtime b48 k4 t0.7 (#2)"]


def test_conclusion_words():
    def w(**kw: Any) -> results.Winner:
        base = dict(trial=2, role="search", config=DDTREE, confirmed=True, median_tps=150.0, spread=4.0,
                    value=146.0, speedup_vs_ar=1.5, ar_median_tps=100.0, positive_vs_ar=True,
                    positive_vs_reference=None, acceptance_length=3.0, break_even_al=1.5, exact_match=1.0,
                    device="cpu", workload_hash="h")
        return results.Winner(**{**base, **kw})

    assert conclusion(w())[0] == "positive"
    assert conclusion(w(positive_vs_ar=False))[0] == "tie"
    assert conclusion(w(role="baseline", config=AR, positive_vs_ar=None))[0] == "ar won"
    assert conclusion(w(confirmed=False, positive_vs_ar=None))[0] == "no conclusion"
    assert conclusion(None)[0] == "no conclusion"
    assert [exactness(w()), exactness(w(exact_match=0.5)), exactness(w(exact_match=None))] == \
        ["true", "false", "unknown"]
    counts = {"finished": 5, "baselines": 2, "baselines_reused": 1, "fail": 0, "infeasible": 1, "refused": 0}
    text = description("s", w(), counts, "FINISHED")
    assert "**1.50x AR**" in text and "150.00 ± 4.00 tok/s" in text and "AR's 100.00 tok/s" in text
    assert "**exact**" in text and "**Conclusion: positive.**" in text and "5 configs and 2 AR baselines" in text
    assert "INEXACT" in headline("s", w(exact_match=0.5)) and headline("s", None) == "s"


# ------------------------------------------------------------------ the parent run of a sweep


def test_parent_run_carries_the_winner_its_config_and_the_report(uri):
    tracker = _swept(uri, _study("ddtree-wins", DDTREE))
    run = _parent(tracker)
    m, p, t = run.data.metrics, run.data.params, run.data.tags
    assert m["winner.decode_tps_median"] == 151.0 and m["winner.decode_tps_spread"] == 4.0
    assert m["winner.conservative_tps"] == 147.0 and m["ar.decode_tps_median"] == 100.0
    assert m["winner.speedup_vs_ar"] == pytest.approx(1.51) and m["winner.acceptance_length"] == 3.0
    assert m["winner.exact_match"] == 1.0 and m["configs_measured"] == 2 and m["baselines_measured"] == 1
    winner_params = {k.removeprefix("winner."): v for k, v in p.items() if k.startswith("winner.")}
    assert winner_params.pop("trial") == "2"
    assert set(winner_params) == set(applicable_config(DDTREE))
    assert winner_params["budget"] == "48" and winner_params["top_k"] == "4" and winner_params["verify"] == "ddtree"
    assert t["winner_trial"] == "2" and t["winner_config"] == "ddtree/runtime b48 k4 t0.7"
    assert t["exact"] == "true" and t["conclusion"] == "positive" and t["confirmed"] == "true"
    assert t["reliable"] == "true"
    note = t["mlflow.note.content"]
    assert "Trial 2" in note and "`ddtree/runtime b48 k4 t0.7`" in note and "**1.51x AR**" in note
    assert "151.00 ± 4.00 tok/s" in note and "**exact**" in note and "**Conclusion: positive.**" in note
    assert "2 configs and 1 AR baselines" in note and "`report/report.md`" in note
    assert run.info.run_name == "ddtree-wins: ddtree/runtime b48 k4 t0.7 1.51x AR, 151.0 tok/s, AL 3.00, exact, " \
        "positive"
    arts = {a.path for a in tracker.client.list_artifacts(tracker.parent, "report")}
    assert "report/report.md" in arts and any(a.endswith(".png") for a in arts)
    assert "report" not in t  # it was written, not failed
    md = tracker.client.download_artifacts(tracker.parent, "report/report.md")
    assert "## Winner" in open(md).read()
    exp = tracker.client.get_experiment(tracker.experiment_id)
    assert exp.tags["mlflow.note.content"].startswith("Latest sweep (finished): ddtree-wins: ddtree/runtime")


@pytest.mark.parametrize(("config", "absent"), [(CHAIN, TREE_ONLY), (AR, TREE_ONLY | {"rollback", "block_size"})])
def test_a_chain_or_ar_winner_has_no_tree_params(uri, config, absent):
    tracker = _swept(uri, _study(f"{config['verify']}-wins", config))
    run = _parent(tracker)
    logged = {k.removeprefix("winner.") for k in run.data.params if k.startswith("winner.")}
    assert logged == {"trial", *applicable_config(config)} and not logged & absent
    assert run.data.tags["winner_config"] == config_label(config)


def test_child_runs_are_named_and_tagged_by_role(uri):
    tracker = _swept(uri, _study("children", DDTREE))
    runs = tracker.client.search_runs([tracker.experiment_id], f"tags.mlflow.parentRunId = '{tracker.parent}'")
    by_trial = {int(r.data.tags["autotune.trial"]): r for r in runs}
    assert {n: (r.info.run_name, r.data.tags["role"]) for n, r in by_trial.items()} == {
        0: ("AR baseline (worker host:1, #0)", "baseline"),
        1: ("reference ddtree/auto b22 k8 (#1)", "reference"),
        2: ("ddtree/runtime b48 k4 t0.7 (#2)", "search")}
    assert "budget" not in by_trial[0].data.params and "rollback" not in by_trial[0].data.tags
    assert by_trial[2].data.params["budget"] == "48"


def test_unconfirmed_and_tie_conclusions_are_said(uri):
    tie = _parent(_swept(uri, _study("tie", DDTREE, positive=False)))
    assert tie.data.tags["conclusion"] == "tie" and "**Conclusion: tie.**" in tie.data.tags["mlflow.note.content"]
    open_ = _parent(_swept(uri, _study("unconfirmed", DDTREE, confirmed=False), status="KILLED"))
    assert open_.data.tags["conclusion"] == "no conclusion" and open_.data.tags["confirmed"] == "false"
    assert "winner.trial" not in open_.data.params  # params only once a sweep FINISHED: they never change
    assert "not confirmed" in open_.data.tags["mlflow.note.content"] and open_.info.status == "KILLED"


def test_a_report_that_fails_is_said_and_the_run_still_ends(uri, monkeypatch):
    from autotune import report

    def broken(study, out_dir, top=10):
        raise KeyError("per_set")

    monkeypatch.setattr(report, "write_report", broken)
    run = _parent(_swept(uri, _study("no-report", DDTREE)))
    assert run.info.status == "FINISHED" and run.data.tags["report"] == "failed: KeyError: 'per_set'"
    assert "The report could not be written (KeyError: 'per_set')." in run.data.tags["mlflow.note.content"]
    assert run.data.params["winner.trial"] == "2"


def test_a_drifted_study_is_unreliable_and_concludes_nothing(uri):
    study = _study("drifted", DDTREE)
    study.add_trial(_trial(3, "baseline", AR, 300.0, ar=300.0, al=1.0))  # the machine got 3x faster
    run = _parent(_swept(uri, study))
    t = run.data.tags
    assert t["reliable"] == "false" and t["conclusion"] == "no conclusion" and t["confirmed"] == "false"
    assert "the study is unreliable (AR baselines on worker host:1 disagree 3.00x" in t["mlflow.note.content"]


def test_a_resume_that_changes_the_winner_says_the_params_are_the_old_ones(uri):
    study = _study("resumed", DDTREE)
    first = _swept(uri, study)
    assert _parent(first).data.params["winner.trial"] == "2"
    study.add_trial(_trial(3, "search", CHAIN, 300.0))  # a better config, measured after a resume
    conf = study.user_attrs["confirmation"]
    study.set_user_attr("confirmation", {**conf, "winner": 3, "candidates": [*conf["candidates"], {
        "trial": 3, "config": CHAIN, "score": {"median": 300.0, "spread": 1.0, "value": 299.0},
        "speedup_vs_ar": 3.0, "break_even_al": 1.5, "exact_match": 1.0}]})
    again = Tracker(uri, study, "resumed")
    assert again.parent == first.parent and _parent(again).info.status == "RUNNING"
    assert "best so far" in _parent(again).data.tags["mlflow.note.content"]
    again.sync()
    again.finish("FINISHED")
    run = _parent(again)
    assert run.data.tags["winner_trial"] == "3" and run.data.tags["winner_config"] == "chain/generic"
    assert run.data.params["winner.trial"] == "2" and run.data.params["winner.budget"] == "48"  # MLflow keeps them
    assert "are trial 2's config" in run.data.tags["mlflow.note.content"]
    assert run.data.metrics["winner.decode_tps_median"] == 300.0


def test_a_sweep_that_crashes_ends_its_run_failed_without_final_params(uri, tmp_path, monkeypatch):
    """An error that ends the sweep (here, in the confirmation) is not a FINISHED sweep: the parent
    run ends FAILED, with the best so far and the report, and no winner params."""
    import io

    from autotune_helpers import tiny_experiment

    from autotune import experiment, sweep
    from autotune.sweep import SweepOptions, run_sweep

    def boom(self) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(sweep._Driver, "confirm", boom)
    exp = experiment.load(tiny_experiment(tmp_path, study={"n_trials": 1, "sampler": "random", "seed": 0}))
    opts = SweepOptions(n_trials=1, storage=parse_storage("memory"), study_name="crashed", tracking_uri=uri,
                        progress=False)
    with pytest.raises(RuntimeError, match="boom"):
        run_sweep(exp, opts, experiment.load_workloads(exp), out=io.StringIO())
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    run = client.search_runs([client.get_experiment_by_name("tiny").experiment_id],
                             "tags.`autotune.study` = 'crashed'")[0]
    assert run.info.status == "FAILED" and "The sweep ended: FAILED" in run.data.tags["mlflow.note.content"]
    assert run.data.tags["winner_trial"] != "none" and "winner.trial" not in run.data.params
    assert "report/report.md" in {a.path for a in client.list_artifacts(run.info.run_id, "report")}


def test_an_adaptive_trial_logs_its_budget_histogram(uri):
    """The adaptive policy's choices reach MLflow: steps per budget as metrics, the share of AR steps,
    and the histogram as an artifact."""
    study = optuna.create_study(study_name="adaptive", direction="maximize")
    study.set_user_attr("model", {"target": "tiny-dense", "draft": "oracle:0.3"})
    study.add_trial(_trial(0, "baseline", AR, 100.0, ar=100.0, al=1.0))
    study.add_trial(_trial(1, "reference", _config(), 120.0))
    t = _trial(2, "search", _config(verify="ddtree", budget=48, policy="adaptive"), 150.0)
    study.add_trial(optuna.trial.create_trial(
        value=t.value, params=t.params, distributions=t.distributions,
        user_attrs={**t.user_attrs, "budget_histogram": {"0": 30, "12": 10, "48": 60}, "policy_ar_step_fraction": 0.3}))
    tracker = _swept(uri, study)
    runs = tracker.client.search_runs([tracker.experiment_id], f"tags.mlflow.parentRunId = '{tracker.parent}'")
    run = next(r for r in runs if r.data.tags["autotune.trial"] == "2")
    m = run.data.metrics
    assert (m["budget_steps.0"], m["budget_steps.12"], m["budget_steps.48"], m["policy_ar_step_fraction"]) == (
        30, 10, 60, 0.3)
    assert run.data.params["policy"] == "adaptive"
    artifacts = {f.path for f in tracker.client.list_artifacts(run.info.run_id)}
    assert "budget_histogram.json" in artifacts


def test_a_relative_sqlite_tracking_uri_is_made_absolute_where_the_command_runs(tmp_path, monkeypatch):
    """MLflow keeps one store per URI string in a process: the relative default must name this folder's file."""
    from autotune.tracking import check_tracking_uri

    monkeypatch.chdir(tmp_path)
    assert check_tracking_uri("sqlite:///mlflow.db") == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    assert check_tracking_uri("none") is None
    assert check_tracking_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    with pytest.raises(InputError, match="needs a file"):
        check_tracking_uri("sqlite:///:memory:")
