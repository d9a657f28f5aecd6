"""benchmarks/runbook.sh, the GPU runbook: its stages and flags, checked without a GPU (--dry-run
prints each stage's command; a GPU stage on a machine without CUDA is refused before any work)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _runbook(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    cmd = ["bash", str(REPO / "benchmarks" / "runbook.sh"), "--out", str(tmp_path / "out"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})


def test_dry_run_lists_every_stage_in_order_with_its_size(tmp_path):
    full = _runbook("--dry-run", tmp_path=tmp_path)
    assert full.returncode == 0, full.stderr
    stages = [line.split(":")[0].removeprefix("stage ") for line in full.stdout.splitlines()]
    assert stages == ["install", "assets", "kernel_check", "kernel_tests", "gpu_tests", "pair", "large", "exact",
                      "sweep", "report"]
    assert "--n-prompts 24 --max-new-tokens 128 --repeats 3" in full.stdout
    assert "experiments/smollm2-h200-short.yaml --timeout 30m" in full.stdout
    assert "autotune report smollm2-h200-short" in full.stdout  # the study named as the experiment names it
    quick = _runbook("--dry-run", "--quick", "--stages", "large,pair", tmp_path=tmp_path)
    assert quick.returncode == 0
    lines = quick.stdout.splitlines()
    # the runbook's order, not the flag's
    assert [line.split(":")[0] for line in lines] == ["stage pair", "stage large"]
    assert "--n-prompts 4 --max-new-tokens 64 --repeats 1" in lines[0]


def test_bad_flags_and_a_missing_gpu_are_refused_with_exit_2(tmp_path):
    bad = _runbook("--stages", "pair,benchmark", tmp_path=tmp_path)
    assert bad.returncode == 2 and "unknown stage 'benchmark'; the stages are: install assets" in bad.stderr
    assert _runbook("--frobnicate", tmp_path=tmp_path).returncode == 2
    missing = _runbook("--wheel-dir", str(tmp_path / "nowhere"), tmp_path=tmp_path)
    assert missing.returncode == 2 and "--wheel-dir: no folder" in missing.stderr
    import torch

    if not torch.cuda.is_available():
        cpu = _runbook("--stages", "assets,large", tmp_path=tmp_path)
        assert cpu.returncode == 2 and "stage 'large' needs a CUDA GPU" in cpu.stderr
        assert not (tmp_path / "out" / "runbook.log").exists()  # refused before any stage ran


def test_help_from_any_folder_and_a_dry_run_writes_nothing(tmp_path):
    help_ = subprocess.run(["bash", "runbook.sh", "--help"], cwd=REPO / "benchmarks", capture_output=True, text=True,
                           timeout=60)
    assert help_.returncode == 0 and help_.stdout.startswith("The GPU runbook") and "set -u" not in help_.stdout
    assert "--quick: a few prompts" in help_.stdout
    dry = subprocess.run(["bash", str(REPO / "benchmarks" / "runbook.sh"), "--dry-run", "--stages", "pair",
                          "--out", "rel-out"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    assert dry.returncode == 0 and f"--md {tmp_path}/rel-out/pair.md" in dry.stdout  # relative to the caller
    assert not (tmp_path / "rel-out").exists()
