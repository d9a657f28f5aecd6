"""Search spaces and experiment files: conditional suggestions, grids, the shipped templates."""

import itertools
from pathlib import Path

import optuna
import pytest
import yaml
from autotune_helpers import REPO, TINY_SPACE, tiny_experiment

from autotune import experiment, space
from autotune.errors import InputError


def _space(tmp_path: Path, spec: dict) -> space.SearchSpace:
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(spec, sort_keys=False))
    return space.load_space(p)


def test_conditional_params_exist_only_on_their_path(tmp_path):
    sp = _space(tmp_path, TINY_SPACE)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(30):
        t = study.ask()
        params = sp.suggest(t)
        seen.add(params["verify"])
        if params["verify"] == "chain":
            assert "budget" not in params and "top_k" not in params
        else:
            assert 2 <= params["budget"] <= 8 and 1 <= params["top_k"] <= 3
        study.tell(t, 1.0)
    assert seen == {"chain", "ddtree"}


def test_enqueued_params_come_back_unchanged(tmp_path):
    sp = _space(tmp_path, TINY_SPACE)
    study = optuna.create_study(direction="maximize")
    study.enqueue_trial({"verify": "ddtree", "draft_path": "generic", "budget": 5, "top_k": 2})
    assert sp.suggest(study.ask()) == {"verify": "ddtree", "draft_path": "generic", "budget": 5, "top_k": 2}


def test_grid_of_a_small_space(tmp_path):
    sp = _space(tmp_path, {"verify": {"type": "categorical", "choices": ["chain", "ddtree"]},
                           "proposal_temp": {"type": "float", "low": 0.5, "high": 1.0, "step": 0.25}})
    assert sp.grid() == {"verify": ["chain", "ddtree"], "proposal_temp": [0.5, 0.75, 1.0]}
    cont = _space(tmp_path, {"proposal_temp": {"type": "float", "low": 0.5, "high": 1.0}})
    with pytest.raises(InputError, match="grid"):
        cont.grid()


def test_a_grid_over_conditional_parameters_measures_each_distinct_config_once(tmp_path):
    """``budget`` is only active for ``ddtree``: the product's 2 x 3 x 2 points are 2 x (1 + 1 + 2) = 8 configs.
    A plain product sampler measured ``ar`` and ``chain`` once per budget and, with the trials left at 10,
    never reached native DDTree (the H100 weights sweep of 2026-12-06)."""
    from autotune.study import _Grid

    sp = _space(tmp_path, {"weights": {"type": "categorical", "choices": ["dequantized", "native"]},
                           "verify": {"type": "categorical", "choices": ["ar", "chain", "ddtree"]},
                           "budget": {"type": "categorical", "choices": [22, 48], "when": {"verify": ["ddtree"]}}})
    assert len({sp.grid_key(dict(zip(sp.grid(), c, strict=True))) for c in itertools.product(*sp.grid().values())}) == 8
    study = optuna.create_study(direction="maximize", sampler=_Grid(sp, seed=0))
    study.enqueue_trial({"weights": "dequantized", "verify": "ar"})  # a baseline asked first takes no grid point
    configs = []
    while not study.sampler.exhausted(study):
        t = study.ask()
        configs.append(tuple(sorted(sp.suggest(t).items())))
        study.tell(t, 1.0)
    assert configs[0] == (("verify", "ar"), ("weights", "dequantized"))
    assert len(configs[1:]) == 8 and len(set(configs[1:])) == 8
    assert {c for c in configs[1:] if dict(c)["verify"] == "ddtree"} == {
        (("budget", b), ("verify", "ddtree"), ("weights", w)) for b in (22, 48) for w in ("dequantized", "native")}


def test_a_grid_study_begun_on_the_whole_product_resumes_to_every_distinct_config(tmp_path):
    """A study whose first trials took grid ids into Optuna's whole product (before the grid was deduplicated)
    resumes by config: every distinct config is measured, none is taken for visited because an old id names it."""
    from autotune.study import _Grid

    sp = _space(tmp_path, {"weights": {"type": "categorical", "choices": ["dequantized", "native"]},
                           "verify": {"type": "categorical", "choices": ["ar", "chain", "ddtree"]},
                           "budget": {"type": "categorical", "choices": [22, 48], "when": {"verify": ["ddtree"]}}})
    everything = {sp.grid_key(dict(zip(sp.grid(), c, strict=True))) for c in itertools.product(*sp.grid().values())}
    for before in range(1, 12):
        storage = optuna.storages.InMemoryStorage()
        study = optuna.create_study(direction="maximize", storage=storage, study_name="s",
                                    sampler=optuna.samplers.GridSampler(sp.grid(), seed=0))
        for _ in range(before):
            t = study.ask()
            sp.suggest(t)
            study.tell(t, 1.0)
        study = optuna.load_study(study_name="s", storage=storage, sampler=_Grid(sp, seed=0))
        while not study.sampler.exhausted(study):
            t = study.ask()
            sp.suggest(t)
            study.tell(t, 1.0)
            assert len(study.trials) <= before + len(everything), before
        assert {sp.grid_key(t.params) for t in study.trials} == everything, before


@pytest.mark.parametrize("name", ["dflash_ddtree.yaml", "quick.yaml"])
def test_shipped_search_spaces_load(name):
    sp = space.load_space(REPO / "search_spaces" / name)
    assert sp.names[0] == "verify"
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(10):  # every suggestion is an EngineConfig the engine accepts
        from engine.config import EngineConfig

        EngineConfig.from_dict(sp.suggest(study.ask()))


def test_quickstart_experiment_validates():
    exp = experiment.load(REPO / "experiments" / "quickstart.yaml")
    assert (exp.model.target, exp.model.draft) == ("smollm2-135m-instruct", "smollm2-135m-dflash")
    workloads = experiment.load_workloads(exp)
    assert [w.name for w in workloads] == ["humaneval", "chat"]
    assert all(len(w.prompts) == exp.workload.n_prompts for w in workloads)


def test_smollm2_template_validates():
    import engine

    try:
        engine.check_model_spec("smollm2-135m-instruct", "smollm2-135m-dflash")
    except engine.EngineInputError as exc:
        pytest.skip(f"the SmolLM2 pair is not in the engine registry yet (issue #4): {exc}")
    exp = experiment.load(REPO / "experiments" / "smollm2-h200.yaml")
    assert exp.study.pruner == "wilcoxon"


def test_qwen35_template_validates_except_model_existence():
    exp = experiment.load(REPO / "experiments" / "qwen35-27b-agent.yaml", check_models=False)
    assert exp.model.target == "/models/Qwen3.5-27B"
    assert exp.fixed_engine == {"temperature": 0.0}
    try:
        workloads = experiment.load_workloads(exp)
    except InputError as exc:
        if "fetching" not in str(exc):
            raise
        pytest.skip(f"the `agent` data asset cannot be fetched here: {exc}")
    assert [w.name for w in workloads] == ["agent", "agent_tools"] and all(w.prompts for w in workloads)
    if not Path(exp.model.target).exists():
        with pytest.raises(InputError, match="Qwen3.5-27B"):
            experiment.load(REPO / "experiments" / "qwen35-27b-agent.yaml")


def test_the_27b_q4_k_m_24gb_template_plans_on_any_machine(capsys):
    """The seed user's question as an experiment: the 27B shape quantized to the Q4_K_M-like mix, held
    native, its draft, a 24 GiB limit; ``autotune plan --context 32768`` plans it here (no GPU, no
    weights), the target at its blocks' bytes."""
    import engine
    from autotune import cli, vram

    exp = experiment.load(REPO / "experiments" / "qwen35-27b-q4km-24gb.yaml")
    assert (exp.model.target, exp.model.weights) == ("qwen35-27b-shape-q4_k_m", "native")
    assert exp.model.vram_limit == 24 << 30
    assert cli.main(["plan", str(exp.path), "--context", "32768"]) == 0
    out = capsys.readouterr().out
    assert "weights native; planned for cuda in bfloat16" in out and "context: 32,768 tokens" in out
    pair = engine.load(exp.model.target, exp.model.draft, device="meta", dtype="bfloat16", weights="native")
    plan = engine.plan_memory(pair, engine.EngineConfig(verify="ar"), 32768 - 256, 256, device="cuda")
    assert f"| target_weights | {vram.size(plan.parts['target_weights'])} |" in out
    assert f"ar_bytes: {plan.total}" in out.splitlines()


def test_the_vram_sweep_s_limit_falls_between_its_trees(capsys):
    """experiments/qwen35-27b-q4km-vram.yaml (issue #28's sweep under a limit): by the plan, its grid's budgets
    8-32 and the reference fit the limit and 64-128 do not, so the sweep on a GPU refuses exactly those."""
    from autotune import cli

    exp = experiment.load(REPO / "experiments" / "qwen35-27b-q4km-vram.yaml")
    assert exp.model.weights == "native"
    assert exp.study.n_trials == len(exp.space.grid()["budget"]) + 1  # the reference counts toward the trials
    assert cli.main(["plan", str(exp.path)]) == 0
    summary = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines()
                   if ": " in line and " " not in line.split(":")[0])
    assert 32 <= int(summary["largest_budget"]) < 64 and summary["fits"] == "no"  # the hungriest: b128
    assert int(summary["reference_bytes"]) <= exp.model.vram_limit < int(summary["hungriest_bytes"])


def test_fingerprint_ignores_trial_budget_but_not_the_space(tmp_path):
    a = experiment.load(tiny_experiment(tmp_path / "a"))
    b = experiment.load(tiny_experiment(tmp_path / "b", study={"n_trials": 50}))
    assert a.fingerprint() == b.fingerprint()
    other = dict(TINY_SPACE, top_k={"type": "int", "low": 1, "high": 4, "when": {"verify": "ddtree"}})
    c = experiment.load(tiny_experiment(tmp_path / "c", space=other))
    assert c.fingerprint() != a.fingerprint()


def test_a_grid_point_whose_trial_failed_before_its_parameters_counts_as_measured(tmp_path):
    """A trial that failed before every parameter was suggested names its config by its grid point (as Optuna's
    grid does): the sampler neither crashes on the missing parameters nor hands that point out again."""
    from autotune.study import _Grid

    sp = _space(tmp_path, {"verify": {"type": "categorical", "choices": ["ar", "chain"]},
                           "budget": {"type": "categorical", "choices": [22, 48]}})
    study = optuna.create_study(direction="maximize", sampler=_Grid(sp, seed=0))
    t = study.ask()
    t.suggest_categorical("verify", ["ar", "chain"])  # then it fails: no budget
    study.tell(t, state=optuna.trial.TrialState.FAIL)
    configs = []
    while not study.sampler.exhausted(study):
        t = study.ask()
        configs.append(tuple(sorted(sp.suggest(t).items())))
        study.tell(t, 1.0)
    assert len(configs) == 3 and len(set(configs)) == 3
