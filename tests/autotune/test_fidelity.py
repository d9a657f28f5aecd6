"""Multi-fidelity (issue #25): a config far behind the incumbent on a cheap slice stops there,
pruned with its rung and reason and no value; a good one goes on to the full measurement; the AR
baseline is measured on every slice it is compared on. The ladder's YAML is validated at the edge."""

from __future__ import annotations

import io

import optuna
import pytest
from autotune_helpers import tiny_experiment
from faulty_worker import FaultyWorker
from optuna.trial import TrialState

from autotune import experiment, measure
from autotune import study as st
from autotune.errors import InputError
from autotune.executors import LocalExecutor
from autotune.fidelity import DEFAULT_RUNG, FidelitySpec, Rung, jobs, stop_reason
from autotune.record import Job
from autotune.report import write_report
from autotune.storage import parse_storage
from autotune.sweep import SweepOptions, run_sweep

SPACE = {"verify": {"type": "categorical", "choices": ["chain"]},
         "draft_path": {"type": "categorical", "choices": ["generic", "auto"]}}
RUNGS = [{"prompts": 1, "max_new_tokens": 4}, {"prompts": 2, "max_new_tokens": 4}]


def test_far_behind_needs_the_ratio_beyond_both_spreads():
    assert measure.far_behind(10.0, 1.0, 100.0, 5.0, 2.0)  # 2 × 11 <= 95
    assert not measure.far_behind(45.0, 5.0, 100.0, 2.0, 2.0)  # 2 × 50 > 98: within the noise of 2x
    assert not measure.far_behind(60.0, 0.0, 100.0, 0.0, 2.0)  # slower, not twice as slow


def _ranked(*rungs):
    """Feasible trials, best first, each with its rung-0 record (None: measured without the ladder)."""
    return [optuna.trial.create_trial(value=100.0 - i, user_attrs={} if r is None else {"fidelity": [
        {"rung": 0, "prompts": 1, "max_new_tokens": 4, "median": r[0], "spread": r[1]}]})
        for i, r in enumerate(rungs)]


def test_the_incumbent_is_the_best_trial_measured_on_the_same_rung():
    rung, slow = Rung(1, 4), {"rung": 0, "median": 10.0, "spread": 1.0}
    # the leader was measured before the ladder (a resume): the best trial that has the rung decides
    reason = stop_reason(_ranked(None, (100.0, 5.0)), rung, slow, 2.0)
    assert reason.endswith("measured there (100.00 ± 5.00)")
    assert stop_reason(_ranked((20.0, 2.0)), rung, slow, 2.0) is None  # 2 x 11 > 18: within the noise, goes on
    assert stop_reason(_ranked(None), rung, slow, 2.0) is None  # nothing to compare with on this slice
    assert stop_reason([], rung, slow, 2.0) is None


def test_a_slow_config_stops_at_the_cheap_rung_and_a_good_one_is_measured_in_full(tmp_path, capsys):
    exp = experiment.load(tiny_experiment(
        tmp_path, space=SPACE, fidelity={"rungs": RUNGS, "stop_ratio": 20},
        study={"n_trials": 3, "sampler": "grid", "pruner": "none", "seed": 0}))
    workloads = experiment.load_workloads(exp)
    # the generic loop made really slower (a sleep before every target forward): ~100x here, while the
    # real chain on the tiny pair runs ~5x slower than AR on 4 tokens (2026-12-04): stop_ratio 20 parts them
    executor = LocalExecutor(lambda: FaultyWorker.load(exp.model.target, exp.model.draft, exp.model.device,
                                                       exp.model.dtype, workloads, exp.fixed_engine,
                                                       slow=({"draft_path": "generic"}, 0.05)))
    out = io.StringIO()
    outcome = run_sweep(exp, SweepOptions(n_trials=3, storage=parse_storage("memory"), study_name="fid",
                                          tracking_uri=None, progress=True), workloads, executor=executor, out=out)
    assert outcome.exit_code == 0
    bar = capsys.readouterr().err  # the bar names the stage of each trial: its rungs, then the full measurement
    for stage in ("(trial 0, rung 0 (1 prompt per set, 4 tokens))", "(trial 0, rung 1 (2 prompts per set, 4 tokens))",
                  "(trial 0, full measurement)"):
        assert stage in bar, stage
    trials = {st.role_of(t) if st.role_of(t) != "search" else t.params["draft_path"]: t
              for t in outcome.study.trials}
    base, slow, good = trials["baseline"], trials["generic"], trials["auto"]

    # the slow config: stopped at rung 0, with the reason, its rung's figures, and no value
    assert slow.state == TrialState.PRUNED and slow.value is None
    assert slow.user_attrs["pruned_at_rung"] == 0
    assert slow.user_attrs["pruned_reason"].startswith("stopped at rung 0 (1 prompt per set, 4 tokens): ")
    [rung] = slow.user_attrs["fidelity"]
    assert (rung["rung"], rung["prompts"], rung["max_new_tokens"]) == (0, 1, 4)
    assert slow.user_attrs["partial_decode_tps"] == rung["median"]
    assert rung["exact_match"] == 1.0  # what the slice showed, kept with the slice
    assert "exact_match" not in slow.user_attrs  # not declared exact beyond what was measured
    # compared like with like: AR measured on the same slice
    ar_rung, ar_rung1 = base.user_attrs["fidelity"]  # AR runs every rung
    assert (ar_rung["prompts"], ar_rung["max_new_tokens"]) == (1, 4) and base.state == TrialState.COMPLETE
    assert (ar_rung1["prompts"], ar_rung1["max_new_tokens"], ar_rung1["rung"]) == (2, 4, 1)
    assert rung["ar_decode_tps"] == ar_rung["median"] and rung["speedup_vs_ar"] < 0.25

    # the good config passed both rungs and was measured in full
    assert good.state == TrialState.COMPLETE and good.value is not None
    assert [r["rung"] for r in good.user_attrs["fidelity"]] == [0, 1]
    assert good.user_attrs["fidelity"][1]["ar_decode_tps"] == ar_rung1["median"]
    assert good.user_attrs["exact_match"] == 1.0 and len(good.user_attrs["decode_tps_runs"]) >= 2
    assert outcome.study.best_trial.number != slow.number
    assert outcome.facts["trials_pruned"] == 1
    assert "trials_pruned: 1" in out.getvalue()
    write_report(outcome.study, tmp_path / "rep")
    stopped = (tmp_path / "rep" / "report.md").read_text().split("## Stopped early", 1)[1]
    assert f"| {slow.number} | chain/generic/fast | rung 0 | {rung['median']:.2f} | stopped at rung 0" in stopped


def test_an_inexact_config_stops_at_the_rung_under_strict_exactness_and_not_under_report(tmp_path):
    """An output of the slice that differs from AR's is a fact decoding further cannot undo: under
    ``exactness: strict`` the search trial stops at the rung, with the reason; under ``report`` it is
    measured in full and reported inexact."""
    def wrong_first_token(config, outputs):  # the generic path's outputs made to differ from AR's
        if config.get("draft_path") != "generic":
            return outputs
        return [[(out[0] + 1) % 256, *out[1:]] if out else out for out in outputs]

    for exactness in ("strict", "report"):
        exp = experiment.load(tiny_experiment(
            tmp_path / exactness, space=SPACE, fidelity={"rungs": RUNGS[:1], "stop_ratio": 1000},
            measure={"warmup": 0, "repeats": 2, "max_rel_mad": 0.9, "exactness": exactness, "confirm_top": 0},
            study={"n_trials": 2, "sampler": "grid", "pruner": "none", "seed": 0}))
        workloads = experiment.load_workloads(exp)
        executor = LocalExecutor(lambda exp=exp, workloads=workloads: FaultyWorker.load(
            exp.model.target, exp.model.draft, exp.model.device, exp.model.dtype, workloads, exp.fixed_engine,
            output_hook=wrong_first_token))
        outcome = run_sweep(exp, SweepOptions(n_trials=2, storage=parse_storage("memory"), study_name=exactness,
                                              tracking_uri=None, progress=False), workloads, executor=executor,
                            out=io.StringIO())
        assert outcome.exit_code == 0
        [bad] = [t for t in outcome.study.trials if t.params.get("draft_path") == "generic"]
        [rung] = bad.user_attrs["fidelity"]
        assert rung["exact_match"] == 0.0
        if exactness == "strict":
            assert bad.state == TrialState.PRUNED and bad.value is None and bad.user_attrs["pruned_at_rung"] == 0
            assert bad.user_attrs["pruned_reason"] == (
                "stopped at rung 0 (1 prompt per set, 4 tokens): 100% of its outputs differ from AR's "
                "(exactness: strict; decoding further cannot make them equal)")
        else:
            assert bad.state == TrialState.COMPLETE and bad.user_attrs["exact_match"] == 0.0


def _load(tmp_path, **sections):
    return experiment.load(tiny_experiment(tmp_path, **sections))


def test_the_ladder_defaults_to_one_cheap_rung_where_it_pays_and_can_be_turned_off(tmp_path):
    big = {"sets": ["prompts.jsonl"], "n_prompts": 8, "max_new_tokens": 256, "seed": 0}
    assert _load(tmp_path / "a", workload=big).ladder == (DEFAULT_RUNG,) == (Rung(1, 32),)
    assert _load(tmp_path / "b").ladder == ()  # 2 prompts x 8 tokens: measured in full at once
    assert _load(tmp_path / "c", workload=big, fidelity={"rungs": []}).ladder == ()
    two = [{"prompts": 1, "max_new_tokens": 16}, {"prompts": 4, "max_new_tokens": 64}]
    assert _load(tmp_path / "d", workload=big, fidelity={"rungs": two}).ladder == (Rung(1, 16), Rung(4, 64))


@pytest.mark.parametrize("fidelity,key,rule", [
    ({"rungs": [{"prompts": 3, "max_new_tokens": 4}]}, "fidelity.rungs[0]", "a slice of the workload"),
    ({"rungs": [{"prompts": 2, "max_new_tokens": 8}]}, "fidelity.rungs[0]", "cheaper than the full measurement"),
    ({"rungs": [{"prompts": 1, "max_new_tokens": 6}, {"prompts": 1, "max_new_tokens": 4}]}, "fidelity.rungs[1]",
     "from the cheapest up"),
    ({"rungs": [{"prompts": 1}]}, "fidelity.rungs[0].max_new_tokens", "is required"),
    ({"rungs": [{"prompts": 1, "max_new_tokens": 4, "repeats": 2}]}, "fidelity.rungs[0].repeats", "unknown key"),
    ({"stop_ratio": 1}, "fidelity.stop_ratio", "must be > 1"),
    ({"rung_repeats": 0}, "fidelity.rung_repeats", "must be >= 1"),
    ({"rung_warmup": -1}, "fidelity.rung_warmup", "must be >= 0"),
    ({"rung_warmup": 1.5}, "fidelity.rung_warmup", "int"),
    ({"ladder": []}, "fidelity.ladder", "unknown key"),
])
def test_a_bad_ladder_is_refused_naming_the_key(tmp_path, fidelity, key, rule):
    with pytest.raises(InputError, match=rule) as err:
        _load(tmp_path, fidelity=fidelity)
    assert key in str(err.value)


def test_a_rung_runs_fewer_passes_than_the_full_measurement_and_never_more(tmp_path):
    full = Job(trial=3, role="search", config={"verify": "chain"}, max_new_tokens=256, warmup=2, repeats=5,
               max_rel_mad=0.05)
    first, second, last = jobs(full, (Rung(1, 32), Rung(4, 64)), FidelitySpec())
    assert (first.prompts, first.max_new_tokens, first.rung, first.warmup, first.repeats) == (1, 32, 0, 1, 3)
    assert (second.rung, second.warmup, second.repeats) == (1, 1, 3) and last is full
    assert not first.remeasure_if_noisy  # a rung's spread speaks for itself
    few = Job(trial=4, role="search", config={}, max_new_tokens=64, warmup=0, repeats=2, max_rel_mad=0.1)
    rung, _ = jobs(few, (Rung(1, 16),), FidelitySpec(rung_warmup=4, rung_repeats=9))
    assert (rung.warmup, rung.repeats) == (0, 2)  # capped by the experiment's own passes
    exp = _load(tmp_path, fidelity={"rung_warmup": 0, "rung_repeats": 4})
    assert (exp.fidelity.rung_warmup, exp.fidelity.rung_repeats) == (0, 4)
    assert (_load(tmp_path / "d").fidelity.rung_warmup, _load(tmp_path / "d").fidelity.rung_repeats) == (1, 3)


def test_trials_stopped_at_a_rung_do_not_bring_the_baseline_round_sooner():
    """``baseline_every`` counts trials measured in full: the AR re-measurement guards the full
    measurements against drift, and on a GPU it costs as much as ten rung-stopped trials."""
    study = optuna.create_study(direction="maximize")

    def add(role, state=TrialState.COMPLETE, **attrs):
        study.add_trial(optuna.trial.create_trial(
            state=state, value=1.0 if state == TrialState.COMPLETE else None,
            user_attrs={"worker": "w", "role": role, **attrs}))

    add("baseline")
    for _ in range(5):  # stopped at the rung: not counted
        add("search", TrialState.PRUNED, pruned_at_rung=0, pruned_reason="far behind")
    add("search")
    assert not st.needs_baseline(study, "w", 2)
    add("search", TrialState.PRUNED, pruned_reason="wilcoxon")  # pruned during its full measurement: counted
    assert st.needs_baseline(study, "w", 2)
