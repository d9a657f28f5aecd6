"""The adaptive step policy in a study (issue #27): its knobs are search dimensions, each trial
records the budgets it chose per workload, and the report shows them beside the oracle gate."""

from __future__ import annotations

import io

import pytest
from autotune_helpers import tiny_experiment

from autotune import experiment, measure
from autotune import study as st
from autotune.report import write_report
from autotune.storage import parse_storage
from autotune.sweep import SweepOptions, run_sweep

SPACE = {"verify": {"type": "categorical", "choices": ["ddtree"]},
         "policy": {"type": "categorical", "choices": ["fixed", "adaptive"], "when": {"verify": "ddtree"}},
         "probe_every": {"type": "int", "low": 3, "high": 3, "when": {"policy": "adaptive"}}}


def test_ar_step_fraction():
    assert measure.ar_step_fraction({"0": 3, "8": 1}) == 0.75
    assert measure.ar_step_fraction({"8": 4}) == 0.0
    assert measure.ar_step_fraction({}) is None  # the fixed policy records no histogram


@pytest.mark.slow
def test_a_study_records_and_reports_the_budgets_the_policy_chose(tmp_path):
    exp = experiment.load(tiny_experiment(
        tmp_path, space=SPACE, study={"n_trials": 3, "sampler": "grid", "pruner": "none", "seed": 0},
        measure={"warmup": 0, "repeats": 2, "max_rel_mad": 0.9, "exactness": "strict", "confirm_top": 0}))
    assert [p.name for p in exp.search_space.params] == ["verify", "policy", "probe_every"]
    outcome = run_sweep(exp, SweepOptions(n_trials=3, storage=parse_storage("memory"), study_name="adaptive",
                                          tracking_uri=None, progress=False), experiment.load_workloads(exp),
                        out=io.StringIO())
    assert outcome.exit_code == 0
    search = {t.params["policy"]: t for t in outcome.study.trials if st.role_of(t) == "search"}
    fixed, adaptive = search["fixed"], search["adaptive"]
    # the fixed policy records no choice; the adaptive one a budget for every step, exact either way
    assert fixed.user_attrs["budget_histogram"] == {} and fixed.user_attrs["policy_ar_step_fraction"] is None
    hist = adaptive.user_attrs["budget_histogram"]
    assert hist and all(k.isdigit() for k in hist) and sum(hist.values()) == adaptive.user_attrs["steps"]
    assert adaptive.user_attrs["config"]["probe_every"] == 3
    assert 0.0 <= adaptive.user_attrs["policy_ar_step_fraction"] <= 1.0
    assert adaptive.user_attrs["exact_match"] == 1.0 and fixed.user_attrs["exact_match"] == 1.0
    per_set = adaptive.user_attrs["per_set"]
    assert sum(sum(s["budget_histogram"].values()) for s in per_set.values()) == sum(hist.values())
    write_report(outcome.study, tmp_path / "rep")
    table = (tmp_path / "rep" / "report.md").read_text().split("## Break-even AL and oracle gate per workload")[1]
    shown = " ".join(f"{b}:{n}" for b, n in sorted(next(iter(per_set.values()))["budget_histogram"].items(),
                                                     key=lambda kv: int(kv[0])))
    assert f"| {adaptive.number} | " in table and shown in table
