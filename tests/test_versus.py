"""``benchmarks/versus.py``: two trees' ``gpu_bench.py large --out`` runs pooled per tree into one table, and a bad run
file refused by name (``benchmarks/device/versus.sh`` alternates the runs on the lent GPU)."""

from __future__ import annotations

import json

import pytest

from tests.engine.bench_modules import load_benchmark

versus = load_benchmark("versus")


def _run(path, ar_ms, verify_ms, roofline_ms=5.0, budgets=(32,), preset="qwen35-27b-shape"):
    """A ``gpu_bench.py large --out`` file of one process: its AR runs and a verify per budget."""
    data = {"env": {"gpu": "test"}, "presets": {preset: {
        "weights": "q4_k_m", "roofline_ms": roofline_ms, "ar_ms": list(ar_ms),
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
     "preset x has no AR runs"),
    (lambda p: None, "cannot be read"),
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
