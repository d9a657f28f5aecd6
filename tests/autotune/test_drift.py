"""The drift guard (issue #24): AR baselines of one machine that disagree beyond the noise make a
study unreliable; the summary, the report, `best` and the export say so, and no winner is
confirmed or a positive conclusion across it."""

from __future__ import annotations

import optuna
import pytest
from optuna.trial import TrialState, create_trial

from autotune import export, measure, results
from autotune.report import write_report


@pytest.mark.parametrize("a, b, floor, drifted", [
    ((2.23, 0.05), (23.49, 0.2), 0.25, True),  # the 10.5x of 2026-12-02
    ((1000.0, 1.0), (1030.0, 1.0), 0.25, False),  # 3%: beyond twice the spread, within the floor
    ((1000.0, 1.0), (1030.0, 1.0), 0.02, True),  # ... beyond a tighter floor
    ((100.0, 40.0), (160.0, 40.0), 0.25, False),  # 60% apart, but within twice the spread
])
def test_drifted(a, b, floor, drifted):
    to = lambda m: {"median": m[0], "spread": m[1]}  # noqa: E731
    assert measure.drifted(to(a), to(b), floor) is drifted
    assert measure.drifted(to(b), to(a), floor) is drifted


def _trial(number_role: str, tps: float, spread: float, worker: str = "w1", value: float | None = None):
    return create_trial(state=TrialState.COMPLETE, value=value if value is not None else tps - spread, user_attrs={
        "role": number_role, "decode_tps_median": tps, "spread": spread, "worker": worker, "device": "cpu",
        "config": {"verify": "ar"} if number_role == "baseline" else {"verify": "ddtree", "budget": 8, "top_k": 2},
        "speedup_vs_ar": None if number_role == "baseline" else tps / 2.23, "ar_decode_tps": 2.23,
        "exact_match": 1.0, "acceptance_length": 2.0})


def _study(second_ar: float, max_drift: float = 0.25) -> optuna.Study:
    study = optuna.create_study(direction="maximize", study_name="drifty")
    study.set_user_attr("max_ar_drift", max_drift)
    study.set_user_attr("model", {"target": "tiny-dense", "draft": "oracle:0.3"})
    for t in (_trial("baseline", 2.23, 0.05), _trial("search", 30.0, 0.5), _trial("baseline", second_ar, 0.2)):
        study.add_trial(t)
    study.set_user_attr("confirmation", {
        "finished_trials": 2, "repeats": 2, "when": "2026-12-04T00:00:00", "worker": "w1", "winner": 1,
        "ties": [1], "ar_median_tps": second_ar,
        "winner_median_tps": 30.0, "winner_spread": 0.5, "winner_speedup_vs_ar": 30.0 / second_ar,
        "positive_vs_ar": True, "positive_vs_reference": None, "dropped": [],
        "candidates": [{"trial": 0, "config": {"verify": "ar"}, "score": {"median": second_ar, "spread": 0.2,
                                                                         "value": second_ar - 0.2}},
                       {"trial": 1, "config": {"verify": "ddtree"}, "score": {"median": 30.0, "spread": 0.5,
                                                                             "value": 29.5},
                        "speedup_vs_ar": 30.0 / second_ar, "exact_match": 1.0}]})
    return study


def test_a_drifting_study_is_unreliable_and_claims_nothing(tmp_path):
    study = _study(second_ar=23.49)
    drift = results.ar_drift(study)
    assert drift is not None and drift.low.label == "trial 0" and drift.high.median == 23.49
    assert "10.53x" in drift.describe()
    w = results.winner(study)
    assert w.trial == 1 and not w.confirmed and w.positive_vs_ar is None and w.drift == drift
    facts = results.summary(study)
    assert facts["reliable"] is False and "disagree 10.53x" in facts["unreliable_because"]
    prov = export.build(study)["provenance"]
    assert prov["reliable"] is False and prov["confirmed"] is False and "10.53x" in prov["unreliable_because"]
    write_report(study, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "## Unreliable study" in md and "No conclusion: the AR baselines drifted" in md
    assert "Positive conclusion" not in md


def test_a_steady_study_keeps_its_confirmed_winner(tmp_path):
    study = _study(second_ar=2.25)  # 1% apart: the same machine
    assert results.ar_drift(study) is None
    w = results.winner(study)
    assert w.confirmed and w.positive_vs_ar is True and w.drift is None
    assert results.summary(study)["reliable"] is True and "unreliable_because" not in results.summary(study)
    write_report(study, tmp_path)
    assert "Unreliable" not in (tmp_path / "report.md").read_text()


def test_the_experiment_sets_how_much_drift_is_tolerated():
    assert results.ar_drift(_study(second_ar=2.7, max_drift=0.25)) is None  # 21% apart, beyond twice the spread
    assert results.ar_drift(_study(second_ar=2.7, max_drift=0.1)) is not None


def test_machines_are_compared_with_themselves_only():
    study = optuna.create_study(direction="maximize")
    study.set_user_attr("max_ar_drift", 0.25)
    study.add_trial(_trial("baseline", 2.23, 0.05, worker="slow-cpu"))
    study.add_trial(_trial("baseline", 23.49, 0.2, worker="gpu"))
    assert results.ar_drift(study) is None  # two machines, one baseline each: nothing drifted
