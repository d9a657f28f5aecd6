"""``model.weights`` (issue #28): a GGUF target held native through a whole sweep. The value reaches
the worker's ``engine.load``, the study's fingerprint and each baseline's identity, MLflow's
``model.weights`` param, the report's model line (with the formats and bytes the worker reported),
``autotune export`` and ``autotune serve``; a study measured native is not resumed dequantized.
(A bad value and native on a float target are refused in test_bad_input.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import optuna
import pytest
import yaml
from autotune_helpers import tiny_experiment

import engine
from autotune import experiment
from autotune.cli import main
from autotune.executors.ray_executor import WorkerSpec, _Measurer
from tests.engine.gguf_files import bpe_tokenizer, tiny_hf, write_gguf

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
pytestmark = pytest.mark.xdist_group("test_weights")  # its module fixture runs a sweep with MLflow: once

MODEL = {"target": "target.gguf", "draft": "oracle:0.3", "device": "cpu", "dtype": "float32"}


def _in(folder: Path, args: list[str]) -> int:
    here = os.getcwd()
    os.chdir(folder)
    try:
        return main(args)
    finally:
        os.chdir(here)


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A tiny Q8_0 GGUF target and a two-trial sweep of it with ``model.weights: native``, with the
    default storages (autotune.db, mlflow.db) in a fresh folder."""
    folder = tmp_path_factory.mktemp("native")
    (folder / "exp").mkdir()
    write_gguf(folder / "exp" / "target.gguf", tiny_hf("qwen3"), "qwen3", gguf.GGMLQuantizationType.Q8_0,
               tokenizer=bpe_tokenizer())
    exp = tiny_experiment(folder / "exp", model={**MODEL, "weights": "native"}, study={"n_trials": 2, "seed": 0})
    # plain prompts: the file has no chat template for the helper's chat line
    (folder / "exp" / "prompts.jsonl").write_text('{"prompt": "the sea of day is"}\n{"prompt": "the key of night"}\n')
    assert _in(folder, ["sweep", str(exp), "--no-progress"]) == 0
    return folder


@pytest.fixture(scope="module")
def summary(swept):
    """What the engine itself says of the file loaded native: the truth the sweep must report."""
    return engine.load(str(swept / "exp" / "target.gguf"), "none", device="cpu", dtype="float32",
                       weights="native").weight_summary()


def _study(folder: Path) -> optuna.Study:
    return optuna.load_study(study_name="tiny", storage=f"sqlite:///{folder / 'autotune.db'}")


def test_the_worker_loaded_native_and_the_study_records_it(swept, summary):
    study = _study(swept)
    assert study.user_attrs["model"]["weights"] == "native"
    reported = study.user_attrs["weight_summary"]  # Worker.limits(), from the pair the worker loaded
    assert reported["mode"] == "native" and reported["formats"] == summary["formats"]
    assert set(reported["formats"]) == {"Q8_0"} and reported["fallback"] == {}
    assert reported["native_bytes"] == summary["native_bytes"] and 0 < reported["native_bytes"]
    assert reported["native_bytes"] < reported["weight_bytes"] == summary["weight_bytes"]
    baselines = [t for t in study.trials if t.user_attrs.get("role") == "baseline"]
    assert baselines and all(t.user_attrs["identity"]["weights"] == "native" for t in baselines)
    assert any(t.state == optuna.trial.TrialState.COMPLETE and t.user_attrs.get("role") == "search"
               for t in study.trials)


def test_mlflow_param_and_report_line(swept, summary, capsys):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{swept / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tiny")
    parent = client.search_runs([exp.experiment_id], "tags.`autotune.role` = 'sweep'")[0]
    assert parent.data.params["model.weights"] == "native"
    assert _in(swept, ["report", "tiny", "--out", "rep"]) == 0
    md = (swept / "rep" / "report.md").read_text()
    line = next(ln for ln in md.splitlines() if ln.startswith("- model: "))
    n = summary["formats"]["Q8_0"]
    mib = summary["native_bytes"] / 2**20
    assert line.startswith("- model: target `") and "target.gguf`, draft `oracle:0.3`, weights native (" in line
    assert f"(Q8_0 x{n} in blocks; {mib:.3g} of {summary['weight_bytes'] / 2**20:.3g} MiB in blocks)" in line


def test_export_carries_weights_and_serve_loads_native(swept, monkeypatch):
    assert _in(swept, ["export", "tiny", "--format", "engine", "--out", "best.yaml"]) == 0
    assert _in(swept, ["export", "tiny", "--format", "json", "--out", "best.json"]) == 0
    assert yaml.safe_load((swept / "best.yaml").read_text())["model"]["weights"] == "native"
    assert json.loads((swept / "best.json").read_text())["model"]["weights"] == "native"
    import engine.api

    asked = {}

    def load(target, draft, **kw):  # what `autotune serve` asks the engine for, then stop there
        asked.update(kw, target=target)
        raise engine.EngineInputError("stopped by the test")

    monkeypatch.setattr(engine.api, "load", load)
    assert _in(swept, ["serve", "best.yaml", "--port", "0"]) == 2
    assert asked["weights"] == "native" and asked["target"].endswith("target.gguf")


def test_a_native_study_is_not_resumed_dequantized(swept, capsys):
    data = yaml.safe_load((swept / "exp" / "tiny.yaml").read_text())
    data["model"]["weights"] = "dequantized"
    (swept / "exp" / "dequantized.yaml").write_text(yaml.safe_dump(data))
    capsys.readouterr()
    before = len(_study(swept).trials)
    code = _in(swept, ["sweep", str(swept / "exp" / "dequantized.yaml"), "--study-name", "tiny", "--n-trials", "3",
                       "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "study 'tiny' in this storage was made from a different experiment" in err
    assert len(_study(swept).trials) == before  # refused before any model loaded or trial ran


def test_fingerprint_keeps_old_studies_and_tells_native_apart(tmp_path):
    plain = experiment.load(tiny_experiment(tmp_path / "a"))
    spelled = experiment.load(tiny_experiment(tmp_path / "b", model={"target": "tiny-dense", "draft": "oracle:0.3",
                                                                      "device": "cpu", "dtype": "float32",
                                                                      "weights": "dequantized"}))
    assert plain.model.weights == spelled.model.weights == "dequantized"
    # the fingerprint this experiment had before model.weights existed: its studies still resume
    assert plain.fingerprint() == spelled.fingerprint() == "4db9d202eebcfd9c"
    (tmp_path / "c").mkdir()
    write_gguf(tmp_path / "c" / "target.gguf", tiny_hf("qwen3"), "qwen3", gguf.GGMLQuantizationType.Q8_0,
               tokenizer=bpe_tokenizer())
    native = experiment.load(tiny_experiment(tmp_path / "c", model={**MODEL, "weights": "native"}))
    dequantized = experiment.load(tiny_experiment(tmp_path / "c", model=MODEL))
    assert native.model.weights == "native" and native.fingerprint() != dequantized.fingerprint()


def test_a_ray_actor_loads_the_weights_of_its_spec_and_reloads_when_they_change(tmp_path):
    """The Ray executor's actor body, without Ray: ``WorkerSpec.weights`` reaches ``engine.load``,
    the facts it reports say so, and a spec that differs only in weights is another model."""
    path = tmp_path / "target.gguf"
    write_gguf(path, tiny_hf("qwen3"), "qwen3", gguf.GGMLQuantizationType.Q8_0, tokenizer=bpe_tokenizer())
    measurer = _Measurer(threads=None)
    measurer.prepare(WorkerSpec(str(path), "oracle:0.3", "cpu", "float32", (), weights="native"))
    assert measurer.worker.pair.weights == "native" and measurer.facts()["weights"]["mode"] == "native"
    assert set(measurer.facts()["weights"]["formats"]) == {"Q8_0"}
    measurer.prepare(WorkerSpec(str(path), "oracle:0.3", "cpu", "float32", ()))
    assert measurer.loads == 2 and measurer.worker.pair.weights == "dequantized"
    assert measurer.facts()["weights"] == {**measurer.facts()["weights"], "mode": "dequantized", "formats": {},
                                           "native_bytes": 0}
