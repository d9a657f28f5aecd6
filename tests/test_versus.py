"""``benchmarks/versus.py``: two trees' ``gpu_bench.py large --out`` runs pooled per tree into one table, and a bad run
file refused by name (``benchmarks/device/versus.sh`` alternates the runs on the lent GPU)."""

from __future__ import annotations

import json

import pytest

from tests.engine.bench_modules import load_benchmark

versus = load_benchmark("versus")


def _run(path, ar_ms, verify_ms, roofline_ms=5.0, budgets=(32,), preset="qwen35-27b-shape", weights="q4_k_m",
         gpu="test"):
    """A ``gpu_bench.py large --out`` file of one process: its AR runs and a verify per budget."""
    data = {"env": {"gpu": gpu}, "presets": {preset: {
        "weights": weights, "roofline_ms": roofline_ms, "ar_ms": list(ar_ms),
        "budgets": {str(b): {"step_ms": [verify_ms + 2], "verify_ms": verify_ms} for b in budgets}}}}
    path.write_text(json.dumps(data), encoding="utf-8")
    return str(path)


def test_each_tree_pools_its_runs_and_the_ratio_is_of_the_medians(tmp_path, capsys):
    head = [_run(tmp_path / "h1.json", [10.0, 10.2, 10.1], 20.0), _run(tmp_path / "h2.json", [10.4, 10.3, 10.2], 21.0)]
    this = [_run(tmp_path / "t1.json", [9.0, 9.1, 9.2], 18.0), _run(tmp_path / "t2.json", [9.0, 9.3, 9.1], 19.0)]
    md = tmp_path / "versus.md"
    assert versus.main(["--head", *head, "--this", *this, "--md", str(md)]) == 0
    out = capsys.readouterr().out
    assert md.read_text(encoding="utf-8").strip() == out.strip()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| head") or line.startswith("| this")}
    # AR: six runs a tree, min / median / max; % of roofline at the median (5.0 / 10.2 and 5.0 / 9.1)
    assert rows["head"][:3] == ["6", "10.000 / **10.200** / 10.400", "49.0%"]
    assert rows["this"][:3] == ["6", "9.000 / **9.100** / 9.300", "54.9%"]
    assert rows["head"][3:] == ["20.00 / **20.50** / 21.00", "2.010x"]  # verify: one a process
    assert "this / head, medians: AR 0.8922, verify at 32 0.9024" in out


@pytest.mark.parametrize("make, says", [
    (lambda p: p.write_text("{not json", encoding="utf-8"), "not JSON"),
    (lambda p: p.write_text(json.dumps({"env": {}}), encoding="utf-8"), "no 'presets'"),
    (lambda p: p.write_text(json.dumps({"presets": {"x": {"roofline_ms": 1.0}}}), encoding="utf-8"),
     "preset x: not a gpu_bench.py large run"),
    (lambda p: None, "cannot be read"),
    (lambda p: p.write_text(json.dumps({"presets": {"x": {"roofline_ms": None, "ar_ms": [1.0]}}}), encoding="utf-8"),
     "preset x: not a gpu_bench.py large run"),
    (lambda p: p.write_text(json.dumps({"presets": {"x": {"roofline_ms": 1.0, "ar_ms": [1.0], "budgets": {
        "32": {"step_ms": [2.0]}}}}}), encoding="utf-8"), "preset x: not a gpu_bench.py large run"),
    (lambda p: p.write_text(json.dumps({"presets": {"x": {"roofline_ms": 1.0, "ar_ms": []}}}), encoding="utf-8"),
     "preset x has no AR runs"),
])
def test_a_bad_run_file_exits_2_naming_it(tmp_path, capsys, make, says):
    bad = tmp_path / "bad.json"
    make(bad)
    assert versus.main(["--head", str(bad), "--this", _run(tmp_path / "t.json", [1.0], 2.0)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and says in err


def test_trees_that_timed_different_presets_or_budgets_are_refused(tmp_path, capsys):
    this = _run(tmp_path / "t.json", [1.0], 2.0)
    assert versus.main(["--head", _run(tmp_path / "h.json", [1.0], 2.0, preset="qwen3-8b-shape"), "--this", this]) == 2
    assert "different presets" in capsys.readouterr().err
    assert versus.main(["--head", _run(tmp_path / "h2.json", [1.0], 2.0, budgets=(22,)), "--this", this]) == 2
    assert "different budgets: head [22], this [32]" in capsys.readouterr().err


def test_a_trees_runs_pool_only_alike_and_the_trees_compare_only_alike(tmp_path, capsys):
    """Within a tree every file of the first's GPU, presets, weights and budgets; between the trees the same weights
    and GPU: else exit 2 naming the file or the key."""
    this = _run(tmp_path / "t.json", [1.0], 2.0)
    for name, kwargs in (("w", {"weights": "bf16"}), ("g", {"gpu": "other"}), ("b", {"budgets": (22,)})):
        odd = _run(tmp_path / f"{name}.json", [1.0], 2.0, **kwargs)
        assert versus.main(["--head", this, odd, "--this", this]) == 2
        err = capsys.readouterr().err
        assert odd in err and "a tree's runs are pooled only alike" in err
    assert versus.main(["--head", _run(tmp_path / "hw.json", [1.0], 2.0, weights="bf16"), "--this", this]) == 2
    assert "different weights: head bf16, this q4_k_m" in capsys.readouterr().err
    assert versus.main(["--head", _run(tmp_path / "hg.json", [1.0], 2.0, gpu="H200"), "--this", this]) == 2
    assert "different gpu: head H200, this test" in capsys.readouterr().err


STAND_IN = '''import argparse, json, os, sys, time
ap = argparse.ArgumentParser()
for flag in ("kind", "--presets", "--weights", "--context", "--budgets", "--new-tokens", "--out"):
    ap.add_argument(flag)
ap.add_argument("--repeats", type=int)
a = ap.parse_args()
calls = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls")
n = len(open(calls).read().split()) if os.path.exists(calls) else 0
open(calls, "a").write(f"{n} ")
if os.environ.get("SLOW_TREE") == os.path.dirname(os.path.dirname(os.path.abspath(__file__))) and n == 1:
    time.sleep(30)  # this tree's second run outlives LARGE_LIMIT: no JSON
ar = float(os.environ["AR_" + os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))])
json.dump({"env": {"gpu": "stand-in"}, "presets": {a.presets: {"weights": a.weights, "roofline_ms": 5.0,
          "ar_ms": [ar] * a.repeats, "budgets": {a.budgets: {"verify_ms": 2 * ar}}}}}, open(a.out, "w"))
'''


def test_versus_sh_alternates_the_trees_and_pools_the_runs_that_wrote_their_json(tmp_path):
    """``benchmarks/device/versus.sh`` with stand-in ``gpu_bench.py`` scripts: the runs alternate H T T H, each
    tree's runs go to its own side, a run that outlives ``LARGE_LIMIT`` is said and left out, and the table compares
    what is left (this tree's AR 8.5 over the head's 8.7)."""
    import subprocess
    import sys

    from tests.engine.bench_modules import REPO

    trees = {}
    for name in ("head", "this"):
        tree = tmp_path / name
        (tree / "benchmarks").mkdir(parents=True)
        (tree / "benchmarks" / "gpu_bench.py").write_text(STAND_IN, encoding="utf-8")
        trees[name] = tree
    (trees["this"] / "benchmarks" / "device").symlink_to(REPO / "benchmarks" / "device")
    (trees["this"] / "benchmarks" / "versus.py").symlink_to(REPO / "benchmarks" / "versus.py")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_ / "python3").chmod(0o755)
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "HOME": str(tmp_path), "OUT": str(tmp_path / "out"),
           "SMOL_STASH": str(tmp_path / "stash"), "HEAD": str(trees["head"]), "PAIRS": "2", "LARGE_LIMIT": "5",
           "AR_head": "8.7", "AR_this": "8.5", "SLOW_TREE": str(trees["head"])}
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "device" / "versus.sh")], cwd=trees["this"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    sections = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("=== ") and "(limit" in line]
    assert sections == ["head_1", "this_1", "this_2", "head_2", "table"], r.stdout
    assert "head 2: no JSON (rc=124): not pooled" in r.stdout
    assert "table: head has 1 runs, this 2: compared as they are" in r.stdout
    table = (tmp_path / "out" / "versus.md").read_text(encoding="utf-8")
    assert "| head | 3 | 8.700 / **8.700** / 8.700 |" in table and "| this | 6 |" in table
    assert "this / head, medians: AR 0.9770, verify at 32 0.9770" in table
