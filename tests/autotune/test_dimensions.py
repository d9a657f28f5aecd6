"""Only dimensions that matter (issue #25): rollback on a dense target, the grammar's placement
without tools and the kernels off CUDA are fixed, not searched, and the study, the summary and the
report say which and why."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import yaml
from autotune_helpers import TINY_SPACE, tiny_experiment

from autotune import experiment
from autotune import study as st
from autotune.dimensions import Facts, FixedDimension, facts_from, irrelevant
from autotune.report import write_report
from autotune.space import load_space
from autotune.storage import parse_storage
from autotune.sweep import SweepOptions, run_sweep

SPACE = {**TINY_SPACE,
         "rollback": {"type": "categorical", "choices": ["replay", "fast"]},
         "kernels": {"type": "categorical", "choices": ["eager", "fused"]},
         "grammar": {"type": "categorical", "choices": ["walk", "commit"]},
         # conditional on a dimension that gets fixed: kept where the fixed value allows it
         "chain_seed": {"type": "categorical", "choices": [None, 0], "when": {"rollback": "fast", "verify": "ddtree"}},
         "proposal_temp": {"type": "float", "low": 0.5, "high": 1.5, "when": {"rollback": "replay"}}}


def _space(tmp_path: Path):
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(SPACE, sort_keys=False))
    return load_space(path)


def test_the_facts_decide_which_dimensions_are_fixed(tmp_path):
    space = _space(tmp_path)
    dense_cpu = irrelevant(space, Facts(recurrent_state=False, tools=False, device="cpu"), {})
    assert [(f.name, f.value) for f in dense_cpu] == [("rollback", "fast"), ("grammar", "walk"),
                                                      ("kernels", "fused")]
    assert dense_cpu[0].describe() == "rollback=fast (dense target: no recurrent state to roll back)"
    # a hybrid target, prompts with tools, a GPU: every dimension can change the result
    assert irrelevant(space, Facts(recurrent_state=True, tools=True, device="cuda:0"), {}) == ()
    assert irrelevant(space, Facts(), {}) == ()  # unknown facts fix nothing
    # the baseline's grammar (the experiment's fixed value) is the one a fixed grammar takes
    assert irrelevant(space, Facts(tools=False), {"grammar": "commit"})[0].value == "commit"


def test_weights_are_fixed_where_a_native_load_would_keep_no_projection(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"weights": {"type": "categorical", "choices": ["native", "dequantized"]},
                                    "verify": {"type": "categorical", "choices": ["ar", "ddtree"]}}))
    space = load_space(path)
    # what Worker.limits() reports of a dequantized F16 GGUF: native would keep nothing
    described = {"device": "cuda:0", "weights": {"mode": "dequantized", "native_projections": 0}}
    (fixed,) = irrelevant(space, facts_from(described), {})
    # at the form the workers loaded (not the space's first choice: no second pair for nothing)
    assert (fixed.name, fixed.value) == ("weights", "dequantized") and "same program" in fixed.why
    quantized = {"device": "cuda:0", "weights": {"mode": "dequantized", "native_projections": 15}}
    assert irrelevant(space, facts_from(quantized), {}) == ()
    assert irrelevant(space, facts_from({"device": "cuda:0", "weights": {"mode": "dequantized"}}), {}) == ()  # unknown


def test_a_fixed_dimension_resolves_the_conditions_on_it(tmp_path):
    fixed = _space(tmp_path).fix({"rollback": "fast", "grammar": "walk", "kernels": "fused"})
    by_name = {p.name: p for p in fixed.params}
    assert not {"rollback", "grammar", "kernels", "proposal_temp"} & set(by_name)  # replay-only: never active
    assert by_name["chain_seed"].when == (("verify", ("ddtree",)),)


def test_a_sweep_does_not_search_what_cannot_matter(tmp_path):
    exp_path = tiny_experiment(tmp_path, space=SPACE, study={"n_trials": 3, "sampler": "random", "seed": 0},
                               measure={"warmup": 0, "repeats": 1, "max_rel_mad": 0.9, "max_ar_drift": 10.0,
                                        "confirm_top": 0})
    exp = experiment.load(exp_path)
    workloads = experiment.load_workloads(exp)
    out = io.StringIO()
    outcome = run_sweep(exp, SweepOptions(n_trials=3, storage=parse_storage("memory"), study_name="dims",
                                          tracking_uri=None, progress=False), workloads, out=out)
    assert outcome.exit_code == 0
    study = outcome.study
    assert study.user_attrs["fixed_dimensions"] == [
        {"name": "rollback", "value": "fast", "why": "dense target: no recurrent state to roll back"},
        {"name": "grammar", "value": "walk", "why": "no prompt of the workload has tools: every prompt decodes "
                                                      "unconstrained under any placement"},
        {"name": "kernels", "value": "fused", "why": "no CUDA: the Triton kernels do not run here, fused and eager "
                                                     "are the same PyTorch code"}]
    search = [t for t in study.trials if st.role_of(t) == "search"]
    assert len(search) == 2
    for t in search:
        assert not {"rollback", "grammar", "kernels", "proposal_temp"} & set(t.params)
        cfg = t.user_attrs["config"]
        assert (cfg["rollback"], cfg["grammar"], cfg["kernels"]) == ("fast", "walk", "fused")
    assert "fixed_dimensions: rollback=fast (dense target: no recurrent state to roll back); grammar=walk" \
        in out.getvalue()
    write_report(study, tmp_path / "rep")
    assert "- fixed, not searched: rollback=fast (dense target" in (tmp_path / "rep" / "report.md").read_text()


def test_the_grid_covers_only_the_searched_dimensions(tmp_path):
    space = {"verify": {"type": "categorical", "choices": ["chain", "ddtree"]},
             "rollback": {"type": "categorical", "choices": ["replay", "fast"]}}
    exp = experiment.load(tiny_experiment(tmp_path, space=space, study={"n_trials": 4, "sampler": "grid"}))
    narrowed = replace(exp, fixed_dimensions=(FixedDimension("rollback", "fast", "dense"),))
    assert st.make_sampler(narrowed, 4)._search_space == {"verify": ["chain", "ddtree"]}
    assert narrowed.fingerprint() == exp.fingerprint()  # the same file resumes the same study
