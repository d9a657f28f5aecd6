"""Test helpers: a tiny experiment written into a temp folder, and ways to run the CLI.

(A module of its own, not conftest: tests import these names; tests/ folders are not packages,
because `tests/autotune` as a package would shadow the real `autotune`.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]

# Small on purpose: a trial is a few short generations on the tiny seeded target, so a whole
# sweep takes seconds on a 2-core CPU. Tests assert behaviour, never speed.
TINY_SPACE = {
    "verify": {"type": "categorical", "choices": ["chain", "ddtree"]},
    "draft_path": {"type": "categorical", "choices": ["generic", "auto"]},
    "budget": {"type": "int", "low": 2, "high": 8, "when": {"verify": "ddtree"}},
    "top_k": {"type": "int", "low": 1, "high": 3, "when": {"verify": "ddtree"}},
}
PROMPTS = ['{"prompt": "def add(a, b):"}', '{"messages": [{"role": "user", "content": "hi there"}]}']


def tiny_experiment(folder: Path, name: str = "tiny", space: dict | None = None, **sections: Any) -> Path:
    """Write experiment + search space + prompts into ``folder``; ``sections`` override YAML keys."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prompts.jsonl").write_text("\n".join(PROMPTS) + "\n")
    (folder / "space.yaml").write_text(yaml.safe_dump(space or TINY_SPACE, sort_keys=False))
    exp = {
        "name": name,
        "model": {"target": "tiny-dense", "draft": "oracle:0.3", "device": "cpu", "dtype": "float32"},
        "workload": {"sets": ["prompts.jsonl"], "n_prompts": 2, "max_new_tokens": 8, "seed": 0},
        "search_space": "space.yaml",
        "objective": "decode_tps",
        # max_ar_drift: a tiny model's CPU timings on a busy test machine move more than a GPU's; the
        # drift guard is tested apart (test_drift.py)
        "measure": {"warmup": 0, "repeats": 2, "max_rel_mad": 0.5, "exactness": "strict", "baseline_every": 4,
                    "max_ar_drift": 10.0, "confirm_top": 1, "confirm_repeats": 2},
        "study": {"n_trials": 5, "sampler": "tpe", "pruner": "none", "seed": 0},
        "executor": {"kind": "local"},
    }
    exp.update(sections)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(exp, sort_keys=False))
    return path


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = "1"  # tiny models run fastest, and least disturbed by a busy machine, on one thread
    return {**e, **extra}


def run_autotune(args: list[str], cwd: Path, timeout: float = 300, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autotune", *args], cwd=cwd, env=env(**extra_env),
                          capture_output=True, text=True, timeout=timeout)
