"""What a sweep leaves behind: MLflow runs, `status`, `best`, `report`, `export` (and its round trip)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from autotune_helpers import env, tiny_experiment

from autotune import export
from autotune.cli import main

pytestmark = pytest.mark.xdist_group("test_outputs")  # its module fixture runs a sweep with MLflow: once

N = 5


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """One sweep with the default storages (autotune.db, mlflow.db) in a fresh folder, run twice:
    the second command asks for one more trial, so it resumes into the same MLflow parent run."""
    folder = tmp_path_factory.mktemp("swept")
    exp = tiny_experiment(folder / "exp")
    here = os.getcwd()
    os.chdir(folder)
    try:
        assert main(["sweep", str(exp), "--n-trials", str(N - 1), "--no-progress"]) == 0
        assert main(["sweep", str(exp), "--n-trials", str(N), "--no-progress"]) == 0
    finally:
        os.chdir(here)
    return folder


def _cli(folder: Path, args: list[str], capsys) -> tuple[int, str]:
    here = os.getcwd()
    os.chdir(folder)
    try:
        code = main(args)
    finally:
        os.chdir(here)
    return code, capsys.readouterr().out


def test_mlflow_parent_and_nested_runs(swept):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{swept / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tiny")
    parents = client.search_runs([exp.experiment_id], "tags.`autotune.role` = 'sweep'")
    assert len(parents) == 1  # the resumed command reused its parent run
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.tags["autotune.study"] == "tiny"
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    # a run per trial: the N configs (n_trials) and the AR baselines beside them
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{swept / 'autotune.db'}")
    assert sorted(int(r.data.tags["autotune.trial"]) for r in children) == [t.number for t in study.trials]
    assert len(children) > N
    by_role = {r.data.tags["autotune.role"] for r in children}
    assert by_role == {"baseline", "reference", "search"}
    for run in children:
        assert run.data.tags["autotune.state"] == "COMPLETE" and run.info.status == "FINISHED"
        m = run.data.metrics
        assert {"value", "decode_tps_median", "spread", "acceptance_length", "speedup_vs_ar", "exact_match",
                "phase_ms.verify"} <= set(m)
        assert run.data.params["verify"] in ("ar", "chain", "ddtree")
        arts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"phases.json", "per_workload.json"} <= arts
        if run.data.tags["autotune.role"] != "baseline":
            assert "break_even_al" in m and "al_histogram.json" in arts
        # the AR baseline its speedup used (one process measured everything here: none reused)
        trial = study.trials[int(run.data.tags["autotune.trial"])]
        assert run.data.tags["baseline_trial"] == str(trial.user_attrs["baseline_trial"])
        assert "baseline_reused" not in run.data.tags
    history = client.get_metric_history(children[0].info.run_id, "decode_tps_run")
    assert len(history) >= 2  # every measured pass, not just the median
    plots = {a.path for a in client.list_artifacts(parent.info.run_id, "optuna")}
    assert "optuna/optimization_history.png" in plots
    assert "confirmation.json" in {a.path for a in client.list_artifacts(parent.info.run_id)}


def test_mlflow_parent_row_answers_at_a_glance(swept, monkeypatch):
    """The experiment's runs table (``mlflow.search_runs``, default columns, nothing expanded): the
    sweep's own row has the winner's decode tok/s, speedup, AL and exactness, the conclusion and the
    report; each child row is named by its path or as an AR baseline, and tagged with its role.
    (The issue asks for a browser screenshot; no browser runs here: this is the same table's data.)"""
    import mlflow
    from mlflow import MlflowClient

    from autotune import results
    from autotune.tracking import applicable_config, config_label

    uri = f"sqlite:///{swept / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("tiny")
    table = mlflow.search_runs([exp.experiment_id])
    parent = table[table["tags.autotune.role"] == "sweep"].iloc[0]
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{swept / 'autotune.db'}")
    w = results.winner(study)
    assert parent["metrics.winner.decode_tps_median"] == pytest.approx(w.median_tps)
    assert parent["metrics.winner.speedup_vs_ar"] == pytest.approx(w.speedup_vs_ar)
    assert parent["metrics.winner.acceptance_length"] == pytest.approx(w.acceptance_length)
    assert parent["metrics.winner.exact_match"] == pytest.approx(w.exact_match)
    assert parent["metrics.winner.conservative_tps"] == pytest.approx(w.value)
    assert parent["metrics.ar.decode_tps_median"] == pytest.approx(w.ar_median_tps)
    assert parent["tags.exact"] == ("true" if w.exact_match == 1.0 else "false")
    assert parent["tags.winner_trial"] == str(w.trial) and parent["tags.winner_config"] == config_label(w.config)
    assert parent["tags.conclusion"] in ("positive", "tie", "ar won", "no conclusion")
    assert parent["tags.mlflow.runName"].startswith(f"tiny: {config_label(w.config)} ")
    note = parent["tags.mlflow.note.content"]
    assert f"Trial {w.trial} ({w.role})" in note and f"{w.median_tps:.2f} ± {w.spread:.2f} tok/s" in note
    assert f"**Conclusion: {parent['tags.conclusion']}.**" in note and f"Measured {N} configs" in note
    params = client.get_run(parent["run_id"]).data.params
    if params["winner.trial"] == str(w.trial):  # the first command's winner held (MLflow params never change)
        assert {k.removeprefix("winner.") for k in params if k.startswith("winner.")} == \
            {"trial", *applicable_config(w.config)}
    else:
        assert f"are trial {params['winner.trial']}'s config" in note
    arts = {a.path for a in client.list_artifacts(parent["run_id"], "report")}
    assert "report/report.md" in arts and any(a.endswith(".png") for a in arts)
    children = table[table["tags.mlflow.parentRunId"] == parent["run_id"]]
    for _, child in children.iterrows():
        trial = study.trials[int(child["tags.autotune.trial"])]
        role = child["tags.role"]
        assert role == trial.user_attrs["role"]
        if role == "baseline":
            assert child["tags.mlflow.runName"] == f"AR baseline (worker {trial.user_attrs['worker']}, #{trial.number})"
            assert _isna(child.get("params.budget"))  # tree parameters do not apply to AR
        else:
            label = config_label(trial.user_attrs["config"])
            prefix = "reference " if role == "reference" else ""
            assert child["tags.mlflow.runName"] == f"{prefix}{label} (#{trial.number})"


def _isna(value) -> bool:
    import pandas as pd

    return bool(pd.isna(value))


def test_status_and_best(swept, capsys):
    code, out = _cli(swept, ["status"], capsys)
    assert code == 0 and "study: tiny" in out and f"trials_finished: {N}" in out
    code, out = _cli(swept, ["best", "tiny", "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and set(doc) == {"engine", "model", "provenance"}
    p = doc["provenance"]
    for key in ("study", "trial", "git_sha", "device", "workload_hash", "decode_tps", "decode_tps_spread",
                "speedup_vs_ar", "confirmed"):
        assert key in p
    assert p["study"] == "tiny" and p["confirmed"] is True and p["device"] == "cpu"
    code, out = _cli(swept, ["best", "tiny"], capsys)
    assert code == 0 and f"trial: {p['trial']}" in out and "config:" in out


def test_report_files_written(swept, capsys):
    code, out = _cli(swept, ["report", "tiny", "--out", "rep"], capsys)
    assert code == 0
    md = (swept / "rep" / "report.md").read_text()
    for section in ("## Winner", "## Top trials", "## Speedup vs AR", "Break-even AL and oracle gate",
                    "## Per-phase breakdown", "## Which path won", "## Exactness"):
        assert section in md
    for png in ("top_trials.png", "speedup_vs_ar.png", "phases.png", "al_histogram.png", "paths.png"):
        f = swept / "rep" / png
        assert f.stat().st_size > 1000 and f"plot: rep/{png}" in out


def _generate(args: list[str], cwd: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "engine", "generate", *args, "--json"], cwd=cwd, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_export_engine_round_trip(swept, capsys):
    code, out = _cli(swept, ["export", "tiny", "--format", "engine", "--out", "best.yaml"], capsys)
    assert code == 0 and "exported: best.yaml" in out
    doc = yaml.safe_load((swept / "best.yaml").read_text())
    assert doc["model"]["target"] == "tiny-dense" and doc["provenance"]["study"] == "tiny"
    prompt = ["--prompt", "def square(x):", "--max-new-tokens", "12"]
    got = _generate(["--config", "best.yaml", *prompt], swept)
    from engine import EngineConfig

    # the engine read every exported field back unchanged, and only fields that apply were exported
    assert {k: got["config"][k] for k in doc["engine"]} == doc["engine"]
    assert doc["engine"] == EngineConfig.from_dict(got["config"]).applicable()
    ar = _generate(["--config", "best.yaml", "--verify", "ar", *prompt], swept)
    assert got["tokens"] == ar["tokens"]  # and the exported config is exact on a prompt it never saw


def test_export_never_overwrites_a_store_and_replaces_a_file_only_with_force(swept, capsys):
    """``--out`` naming the study database or the MLflow store is refused even with --force; a
    folder is refused; an existing file is replaced only with --force (issue #23: nothing destroyed)."""
    def export_to(*args: str) -> tuple[int, str]:
        here = os.getcwd()
        os.chdir(swept)
        try:
            code = main(["export", "tiny", "--out", *args])
        finally:
            os.chdir(here)
        return code, capsys.readouterr().err

    stores = {name: (swept / name).read_bytes() for name in ("autotune.db", "mlflow.db")}
    for name in stores:
        code, err = export_to(name, "--force")
        assert code == 2 and "SQLite database" in err and "never overwritten" in err and len(err) < 1000
    assert {name: (swept / name).read_bytes() for name in stores} == stores
    code, err = export_to("exp")
    assert code == 2 and "not a folder" in err
    (swept / "mine.yaml").write_text("keep me\n")
    code, err = export_to("mine.yaml")
    assert code == 2 and "--force" in err
    assert (swept / "mine.yaml").read_text() == "keep me\n"
    code, _ = export_to("mine.yaml", "--force")
    assert code == 0 and yaml.safe_load((swept / "mine.yaml").read_text())["provenance"]["study"] == "tiny"


def test_export_json_and_llama_server(swept, capsys):
    code, out = _cli(swept, ["export", "tiny", "--format", "json"], capsys)
    assert code == 0 and json.loads(out)["provenance"]["study"] == "tiny"
    here = os.getcwd()
    os.chdir(swept)
    try:
        code = main(["export", "tiny", "--format", "llama-server"])
    finally:
        os.chdir(here)
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith("#!/bin/sh") and "# workload_hash:" in out and "--port" in out
    # tiny-dense is a preset, not a GGUF file the port could load: said on stderr and in the script
    assert "warning: target 'tiny-dense' is not a .gguf file" in err and "# WARNING: target 'tiny-dense'" in out


def test_llama_server_mapping_for_a_ddtree_config():
    doc = {"engine": {"verify": "ddtree", "budget": 22, "top_k": 8, "proposal_temp": 0.8, "chain_seed": None,
                      "target_feat_ctx": 128, "rollback": "fast", "draft_path": "runtime", "block_size": None,
                      "temperature": 0.0, "seed": 0},
           "model": {"target": "/m/target.gguf", "draft": "/m/draft"}, "provenance": {"study": "s", "trial": 3}}
    text = export.render(doc, "llama-server")
    cmd = text.splitlines()[-1]
    # flag names as lucebox-hub's dflash_server parses them (docs/serving.md cites the source files)
    assert cmd.startswith("dflash_server /m/target.gguf --draft /m/draft --ddtree --ddtree-budget 22 --host 127.0.0.1")
    assert "test_dflash /m/target.gguf /m/draft --daemon --ddtree --ddtree-budget=22 --ddtree-temp=0.8" in text
    assert "target_feat_ctx=128" in text and "top_k=8" in text  # listed as not mapped, not guessed
