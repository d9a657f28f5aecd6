"""``weights`` as a search dimension (issue #28): each config measured on a pair that holds the GGUF
target's weights as it names them (quantized blocks, or dequantized on load), exact against AR with
the same weights; the report compares the forms; the export loads the winner's form."""

from __future__ import annotations

import dataclasses
import io

import optuna
import pytest
import yaml
from autotune_helpers import tiny_experiment

import engine
from autotune import confirm, experiment, export, measure, results
from autotune.errors import InputError
from autotune.report import write_report
from autotune.storage import parse_storage
from autotune.sweep import SweepOptions, run_sweep

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

SPACE = {"verify": {"type": "categorical", "choices": ["ar", "ddtree"]},
         "weights": {"type": "categorical", "choices": ["dequantized", "native"]}}


@pytest.fixture
def target(tmp_path):
    from tests.engine.gguf_files import bpe_tokenizer, tiny_hf, write_gguf

    path = tmp_path / "q8.gguf"
    write_gguf(path, tiny_hf("qwen3"), "qwen3", gguf.GGMLQuantizationType.Q8_0, tokenizer=bpe_tokenizer())
    return path


def _exp(tmp_path, target, **sections):
    path = tiny_experiment(tmp_path / "exp", name="w", space=SPACE, **{
        "model": {"target": str(target), "draft": "oracle:0.3", "device": "cpu", "dtype": "float32"},
        "engine": {"budget": 4, "top_k": 2},
        "study": {"n_trials": 8, "sampler": "grid", "pruner": "none", "seed": 0}, **sections})
    (tmp_path / "exp" / "prompts.jsonl").write_text('{"prompt": "def add(a, b):"}\n{"prompt": "hello there"}\n')
    return path


def test_a_pair_refuses_a_config_that_names_the_other_weights(target):
    pair = engine.load(str(target), "random", device="cpu", dtype="float32", weights="native")
    assert pair.refusal(engine.EngineConfig(weights="native")) is None
    assert "holds its target's weights native" in pair.refusal(engine.EngineConfig(weights="dequantized"))
    with pytest.raises(engine.EngineInputError, match="weights must be one of"):
        engine.EngineConfig(weights="q4")


def test_each_form_is_measured_on_its_own_pair_and_exact_against_its_own_ar(tmp_path, target):
    exp = experiment.load(_exp(tmp_path, target))
    opts = SweepOptions(n_trials=8, storage=parse_storage("memory"), study_name="w", tracking_uri=None,
                        progress=False)
    outcome = run_sweep(exp, opts, experiment.load_workloads(exp), out=io.StringIO())
    study = outcome.study
    search = [t for t in results.completed(study) if t.user_attrs["role"] == "search"]
    assert sorted((t.params["verify"], t.params["weights"]) for t in search) == [
        ("ar", "dequantized"), ("ar", "native"), ("ddtree", "dequantized"), ("ddtree", "native")]
    held = {}
    for t in search:
        a = t.user_attrs
        assert a["exact_match"] == 1.0 and a["config"]["weights"] == t.params["weights"]
        held.setdefault(t.params["weights"], set()).add(a["memory"]["parts"]["target_weights"])
    # planned on the pair that ran it: the blocks take fewer bytes than the float weights
    assert len(held["native"]) == len(held["dequantized"]) == 1 and max(held["native"]) < min(held["dequantized"])
    assert study.user_attrs["fixed_dimensions"] == []  # Q8_0 projections: native is another program
    # break-even AL against AR with the same weights: the native tree's against the native AR trial's
    # (when the grid measured that AR after the tree, the reading side finds it: results.break_even_al)
    by = {(t.params["verify"], t.params["weights"]): t for t in search}
    native_ar, native_tree = by[("ar", "native")], by[("ddtree", "native")]
    want = measure.break_even_al(native_tree.user_attrs["step_ms"], native_ar.user_attrs["decode_tps_median"])
    assert results.break_even_al(study, native_tree) == pytest.approx(want, rel=1e-12)
    told = native_tree.user_attrs
    if native_ar.number < native_tree.number:
        assert told["break_even_ar_trial"] == native_ar.number and told["break_even_al"] == pytest.approx(want)
    else:
        assert told["break_even_ar_trial"] is None and told["break_even_al"] is None
    tree = by[("ddtree", "dequantized")].user_attrs  # the baseline's form: against the baseline
    base = study.trials[tree["break_even_ar_trial"]]
    assert base.user_attrs["role"] == "baseline"
    assert tree["break_even_al"] == pytest.approx(measure.break_even_al(tree["step_ms"],
                                                                        base.user_attrs["decode_tps_median"]))
    report = write_report(study, tmp_path / "report")[0].read_text()
    assert "## Weights: native vs dequantized" in report and "The same config in both forms:" in report
    section = report.split("## Weights: native vs dequantized")[1].split("\n## ")[0]
    assert "| native |" in section and "| dequantized |" in section
    doc = export.build(study)
    w = results.winner(study)
    assert "weights" not in doc["engine"]
    assert doc["model"]["weights"] == (w.config.get("weights") or "dequantized")


def test_weights_are_not_searched_where_native_would_keep_nothing(tmp_path, capsys, monkeypatch):
    """An F16 GGUF: a native load keeps no projection in blocks, so the forms are one program; the sweep
    fixes ``weights`` at the loaded form, says why, and never loads a second pair; nor does the plan."""
    from autotune import cli
    from tests.engine.gguf_files import bpe_tokenizer, tiny_hf, write_gguf

    path = tmp_path / "f16.gguf"
    write_gguf(path, tiny_hf("qwen3"), "qwen3", gguf.GGMLQuantizationType.F16, tokenizer=bpe_tokenizer())
    exp = experiment.load(_exp(tmp_path, path, study={"n_trials": 4, "sampler": "grid", "pruner": "none",
                                                      "seed": 0}))
    loads = []
    load = engine.load
    monkeypatch.setattr(engine, "load", lambda *a, **kw: loads.append(kw.get("weights")) or load(*a, **kw))
    opts = SweepOptions(n_trials=4, storage=parse_storage("memory"), study_name="w", tracking_uri=None,
                        progress=False)
    study = run_sweep(exp, opts, experiment.load_workloads(exp), out=io.StringIO()).study
    (fixed,) = study.user_attrs["fixed_dimensions"]
    assert fixed["name"] == "weights" and fixed["value"] == "dequantized" and "same program" in fixed["why"]
    search = [t for t in results.completed(study) if t.user_attrs["role"] == "search"]
    assert sorted(t.params["verify"] for t in search) == ["ar", "ddtree"]
    assert all("weights" not in t.params and t.user_attrs["config"]["weights"] == "dequantized" for t in search)
    assert loads == ["dequantized"]  # the one pair the experiment names
    capsys.readouterr()
    assert cli.main(["plan", str(exp.path)]) == 0  # planned once, as the sweep measures: one form
    assert loads == ["dequantized"] * 2 and "\nar_bytes: " in capsys.readouterr().out


def test_weights_searched_where_they_cannot_be_is_refused(tmp_path, target):
    with pytest.raises(InputError, match="both fixed here and searched") as err:
        experiment.load(_exp(tmp_path, target, model={"target": str(target), "draft": "random", "device": "cpu",
                                                      "dtype": "float32", "weights": "native"}))
    assert "model.weights" in str(err.value)
    with pytest.raises(InputError, match="native must suit model.target") as err:
        experiment.load(_exp(tmp_path, target, model={"target": "tiny-dense", "draft": "random", "device": "cpu",
                                                      "dtype": "float32"}))
    assert "weights.choices" in str(err.value)


def test_an_export_that_names_native_weights_serves_them(tmp_path, target):
    from engine.serving.server import load_served

    doc = {"engine": {"verify": "ar"}, "model": {"target": str(target), "draft": "none", "weights": "native"}}
    f = tmp_path / "best.yaml"
    f.write_text(yaml.safe_dump(doc))
    cfg, model = load_served(f)
    assert model["weights"] == "native" and cfg.weights is None


def test_the_other_forms_pair_is_left_out_of_a_measured_peak(tmp_path, target, monkeypatch):
    """On CUDA a pass's peak (``max_memory_allocated``) counts every tensor on the device, the weights
    of the pair the worker holds for the other form included, which the config does not use: the
    breakdown and the verdict leave them out and the record says how much. Faked on the CPU: the
    device's peak is a fixed figure and the worker takes it as the allocator's."""
    import autotune.worker as worker_mod
    from autotune import vram
    from autotune.record import Job
    from autotune.worker import Worker

    device_peak = 2**30
    bench = engine.bench

    def on_a_gpu(*args, **kw):
        result = bench(*args, **kw)
        return dataclasses.replace(result, peak_memory_bytes=device_peak)

    monkeypatch.setattr(engine, "bench", on_a_gpu)
    monkeypatch.setattr(worker_mod, "_peak_is_allocated", lambda device: True)
    exp = experiment.load(_exp(tmp_path, target))
    worker = Worker.load(str(target), "oracle:0.3", "cpu", "float32", experiment.load_workloads(exp),
                         exp.fixed_engine)
    at = vram.memory_at(worker.limits()["longest_prompt"], exp.workload.max_new_tokens)

    def job(weights: str) -> Job:
        return Job(trial=0, role="search", config={**exp.fixed_engine, "verify": "ddtree", "weights": weights},
                   max_new_tokens=exp.workload.max_new_tokens, warmup=0, repeats=1, max_rel_mad=1.0,
                   remeasure_if_noisy=False, memory_at=at)

    alone = worker.measure(job("dequantized"))
    assert alone.ok and alone.memory["kind"] == "measured" and alone.memory["idle_pair_bytes"] == 0
    assert alone.memory["total"] == device_peak  # one pair: the device's peak is the config's
    rec = worker.measure(job("native"))  # loads the native pair; the dequantized one stays, weights only
    idle = engine.held_memory(worker._pairs["dequantized"])
    held = sum(idle.values())
    assert held == idle["target_weights"] > rec.memory["parts"]["target_weights"] > 0  # its weights alone
    assert rec.ok and rec.peak_memory_bytes == device_peak  # the device's figure, as it was
    assert rec.memory["idle_pair_bytes"] == held and rec.memory["total"] == device_peak - held
    # a limit the config fits only without the other pair: feasible
    limit = device_peak - held // 2
    assert vram.over_reason(rec.memory, limit) is None and vram.over_reason(alone.memory, limit) is not None


def _told(number: int, role: str, verify: str, weights: str | None, tps: float, step_ms: float, **attrs):
    config = {"verify": verify, **({"weights": weights} if weights else {})}
    return optuna.trial.create_trial(value=tps, user_attrs={
        "role": role, "config": config, "worker": "w", "workload_hash": "h", "decode_tps_median": tps,
        "step_ms": step_ms, **attrs})


def _weights_study() -> optuna.Study:
    study = optuna.create_study(direction="maximize")
    study.set_user_attr("model", {"weights": "dequantized"})
    study.add_trial(_told(0, "baseline", "ar", None, 100.0, 10.0, break_even_al=None))
    study.add_trial(_told(1, "search", "ddtree", "native", 150.0, 20.0, break_even_al=None, break_even_ar_trial=None))
    study.add_trial(_told(2, "search", "ar", "native", 80.0, 12.5, break_even_al=1.25, break_even_ar_trial=0))
    study.add_trial(_told(3, "search", "ddtree", "dequantized", 140.0, 20.0, break_even_al=2.0,
                          break_even_ar_trial=0))
    return study


def test_break_even_uses_ar_with_the_configs_weights():
    """A native config told before native AR was measured: its break-even AL is read against that AR
    (not the dequantized baseline), and the confirmation picks that AR to re-measure beside it."""
    study = _weights_study()
    tree, _, tree_deq = (study.trials[i] for i in (1, 2, 3))
    assert results.break_even_al(study, tree) == pytest.approx(20.0 / (1000.0 / 80.0))  # native AR's 12.5 ms/token
    assert results.break_even_al(study, tree_deq) == 2.0  # as told, against the baseline
    assert results.winner(study).break_even_al == pytest.approx(1.6)
    assert [n for n, _ in confirm.picks(study, 1)] == [0, 1, 2]  # the winner's form's AR joins the baseline


def test_the_confirmation_re_measures_each_forms_ar_for_its_break_even(tmp_path, target):
    from autotune.record import Record

    study = _weights_study()
    step_ms = {0: 10.0, 1: 25.0, 2: 12.5, 3: 20.0}  # the re-measurement's
    tps = {0: 100.0, 1: 150.0, 2: 50.0, 3: 140.0}

    def measure_now(job, worker):
        return Record(trial=job.trial, role=job.role, worker="w", config=job.config,
                      decode_tps_runs=[tps[job.trial]] * 2, step_ms=step_ms[job.trial], exact_match=1.0)

    class Tracker:
        def log_confirmation(self, conf):
            pass

    confirm.run(experiment.load(_exp(tmp_path, target)), study, measure_now, Tracker())
    conf = study.user_attrs["confirmation"]
    be = {c["trial"]: c["break_even_al"] for c in conf["candidates"]}
    # the native tree against the native AR re-measured (20 ms/token), not the baseline (10 ms/token)
    assert be == {0: None, 1: pytest.approx(25.0 / 20.0), 2: None} and conf["winner"] == 1
    assert results.winner(study).break_even_al == pytest.approx(1.25)


def test_autotune_plan_plans_each_searched_weight_form_on_its_own_pair(tmp_path, target, capsys):
    from autotune import cli, vram

    code = cli.main(["plan", str(_exp(tmp_path, target)), "--vram-limit", "1GiB"])
    out = capsys.readouterr().out
    assert code == 0 and "weights dequantized (searched) and native (searched)" in out
    header = next(line for line in out.splitlines() if line.startswith("| part |"))
    assert header == ("| part | AR baseline (dequantized) | reference (dequantized) | hungriest in the space "
                      "(dequantized) | AR baseline (native) | reference (native) | hungriest in the space (native) |")
    summary = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line and " " not in line.split(":")[0])
    sizes = {}
    for form in ("dequantized", "native"):
        pair = engine.load(str(target), "oracle:0.3", device="cpu", dtype="float32", weights=form)
        want = engine.plan_memory(pair, engine.EngineConfig(verify="ar", weights=form), *vram.memory_at(
            int(summary["context"]) - 8, 8))
        assert summary[f"ar_bytes_{form}"] == str(want.total)
        sizes[form] = want.parts["target_weights"]
        assert summary[f"fits_{form}"] == "yes" and summary[f"largest_budget_{form}"] != "none"
        assert f"largest tree budget that fits ({form}): " in out
    assert sizes["native"] < sizes["dequantized"]  # the blocks: fewer bytes than the floats
    assert "ar_bytes" not in summary and "fits" not in summary  # every key names its form


def test_the_idle_pair_left_out_of_a_peak_is_logged_and_reported():
    """What a weights search's worker held beside the winner's pair reaches MLflow and the report."""
    from types import SimpleNamespace

    from autotune.report import _memory
    from autotune.tracking import trial_metrics

    memory = {"kind": "measured", "total": 3 << 20, "dominant": "target_weights", "idle_pair_bytes": 5 << 20,
              "parts": {"target_weights": 2 << 20, "activations": 1 << 20}, "planned_total": 3 << 20}
    study = optuna.create_study(direction="maximize")
    study.add_trial(_told(0, "search", "ddtree", "native", 150.0, 20.0, memory=memory))
    trial = study.trials[0]
    assert trial_metrics(trial)["memory.idle_pair_bytes"] == 5 << 20
    text = "\n".join(_memory(study, SimpleNamespace(trial=0)))
    assert "other weight form's pair (5.0 MiB), left out of this peak" in text
    alone = optuna.create_study(direction="maximize")
    alone.add_trial(_told(0, "search", "ddtree", None, 150.0, 20.0, memory={**memory, "idle_pair_bytes": 0}))
    assert "memory.idle_pair_bytes" not in trial_metrics(alone.trials[0])
    assert "other weight form" not in "\n".join(_memory(alone, SimpleNamespace(trial=0)))


def test_the_weights_section_says_when_a_forms_ar_was_stopped_at_a_rung():
    """A multi-fidelity rung can stop a slow form's AR before its full measurement: the section names the
    rung and its rate instead of leaving the form's AR blank."""
    from autotune.report import _weights_forms

    study = optuna.create_study(direction="maximize", storage=optuna.storages.InMemoryStorage())
    for cfg, value, state in (({"verify": "ar", "weights": "dequantized"}, 1042.6, "complete"),
                              ({"verify": "chain", "weights": "native"}, 1777.4, "complete"),
                              ({"verify": "ar", "weights": "native"}, None, "pruned")):
        t = study.ask()
        t.set_user_attr("config", cfg)
        if state == "pruned":
            t.set_user_attr("partial_decode_tps", 763.24)
            t.set_user_attr("pruned_at_rung", 0)
            study.tell(t, state=optuna.trial.TrialState.PRUNED)
            continue
        t.set_user_attr("decode_tps_median", value)
        t.set_user_attr("acceptance_length", 2.74 if cfg["verify"] == "chain" else 1.0)
        t.set_constraint("exactness", 0.0)
        study.tell(t, value)
    rows = {line.split(" | ")[0]: line for line in _weights_forms(study) if line.startswith("| native")
            or line.startswith("| dequantized")}
    assert rows["| native"].endswith("| stopped at rung 0: 763.24 (2) |")
    assert rows["| dequantized"].endswith(" (0) |") and "1042.6" in rows["| dequantized"]


def test_the_report_says_how_many_weights_in_blocks_were_held_as_operand_planes():
    """``report._weights``: a worker on an sm_90 GPU in bf16 reports ``operand_projections`` (the weights held as
    the planes of the decode into the matrix unit's registers); the model line says how many, and nothing where
    there are none."""
    from autotune import report

    summary = {"mode": "native", "formats": {"Q4_K": 9, "Q6_K": 5}, "fallback": {}, "native_bytes": 3 * 2**20,
               "weight_bytes": 4 * 2**20}
    assert report._weights({}, summary) == "weights native (Q4_K x9, Q6_K x5 in blocks; 3 of 4 MiB in blocks)"
    held = report._weights({}, {**summary, "operand_projections": 14})
    assert held == "weights native (Q4_K x9, Q6_K x5 in blocks, 14 of them as operand planes; 3 of 4 MiB in blocks)"
