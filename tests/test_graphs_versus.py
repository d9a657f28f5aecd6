"""``benchmarks/graphs_versus.py``: two ``gpu_bench.py graphs --out`` runs compared launch by launch (the graphs'
walls and sums, the kernels by name, matched launches grouped by the kernel before them), and a bad file refused by
name with exit 2."""

from __future__ import annotations

import json

import pytest

from tests.engine.bench_modules import load_benchmark

gv = load_benchmark("graphs_versus")

# a step of two layers: norm, product (in_proj), attention, product (o_proj), norm, product (gate_up), product (down)
LAYER = ["rms_norm", "_gluon_kernel", "attention", "_gluon_kernel", "rms_norm", "_gluon_kernel", "_q6_kernel"]


def _graphs(path, times: dict[str, list[float]], wall: float, names: list[str] | None = None) -> str:
    """A ``gpu_bench.py graphs --out`` file with one graph ("m/ar/ar@1"): ``names`` (two layers of ``LAYER``) timed
    by ``times`` (each name's launches in order)."""
    names = names or LAYER * 2
    seen: dict[str, int] = {}
    order = []
    for name in names:
        k = seen.get(name, 0)
        seen[name] = k + 1
        order.append([name, times[name][k % len(times[name])]])
    run = {"wall_us": wall, "kernel_us": sum(us for _, us in order), "kernels": len(order), "order": order}
    path.write_text(json.dumps({"env": {}, "runs": {"m/ar/ar@1": run}}), encoding="utf-8")
    return str(path)


def test_the_launches_that_moved_are_grouped_by_the_kernel_before_them(tmp_path, capsys):
    """B's gate_up (the product after the second norm) is slower by 3 us a launch, its in_proj faster by 1: the
    by-name row nets them (+4.0 over four launches), the grouped rows split them, largest change first."""
    a = _graphs(tmp_path / "a.json", {"rms_norm": [2.0], "_gluon_kernel": [30.0, 14.0, 54.0], "attention": [5.0],
                                      "_q6_kernel": [32.0]}, wall=300.0)
    b = _graphs(tmp_path / "b.json", {"rms_norm": [2.0], "_gluon_kernel": [29.0, 14.0, 57.0], "attention": [5.0],
                                      "_q6_kernel": [32.0]}, wall=305.0)
    md = tmp_path / "out.md"
    assert gv.main(["--a", a, "--b", b, "--md", str(md)]) == 0
    out = capsys.readouterr().out
    assert md.read_text(encoding="utf-8").strip() == out.strip()
    assert "**m/ar/ar@1**: wall 300.0 -> 305.0 us (+5.0); kernels 14 -> 14" in out
    assert "| `_gluon_kernel` | 6 / 6 | 196.0 | 200.0 | +4.0 |" in out
    grouped = [line for line in out.splitlines() if line.count("|") == 8 and "`" in line]
    assert grouped[0] == "| `_gluon_kernel` | `rms_norm` | 4 | 168.0 | 172.0 | +4.0 | 42.00 -> 43.00 |"
    # (the in_proj and gate_up both follow a norm: one group; the o_proj after the attention unchanged)
    assert "| `_gluon_kernel` | `attention` | 2 | 28.0 | 28.0 | +0.0 | 14.00 -> 14.00 |" in out
    assert "14 of 14 / 14 launches matched" in out


def test_launches_one_side_lacks_are_left_unmatched():
    """A kernel B adds (a merge after each attention) leaves the rest matched in order."""
    a = [("norm", 1.0), ("prod", 10.0), ("attn", 3.0), ("prod", 5.0)]
    b = [("norm", 1.0), ("prod", 9.0), ("attn", 3.0), ("merge", 1.0), ("prod", 5.0)]
    assert gv.matched(a, b) == [(0, 0), (1, 1), (2, 2), (3, 4)]
    assert gv.matched(a, a) == [(0, 0), (1, 1), (2, 2), (3, 3)]


@pytest.mark.parametrize("content, says", [
    ("not json", "not JSON"),
    (json.dumps({"presets": {}}), "no 'runs' (a gpu_bench.py graphs --out file has one per step graph)"),
    (json.dumps({"runs": {"g": {"wall_us": 1.0, "kernel_us": 1.0}}}), "graph g: not a gpu_bench.py graphs run"),
    (json.dumps({"runs": {"g": {"wall_us": 1.0, "kernel_us": 1.0, "order": [["k", "x"]]}}}),
     "graph g: not a gpu_bench.py graphs run"),
])
def test_a_file_that_is_not_a_graphs_run_exits_2_naming_it(tmp_path, capsys, content, says):
    bad = tmp_path / "bad.json"
    bad.write_text(content, encoding="utf-8")
    good = _graphs(tmp_path / "good.json", {"rms_norm": [1.0], "_gluon_kernel": [1.0], "attention": [1.0],
                                            "_q6_kernel": [1.0]}, wall=10.0)
    assert gv.main(["--a", good, "--b", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"graphs_versus: {bad}: {says}" in err


def test_two_runs_with_no_graph_in_common_and_a_missing_file_are_refused(tmp_path, capsys):
    a = _graphs(tmp_path / "a.json", {"rms_norm": [1.0], "_gluon_kernel": [1.0], "attention": [1.0],
                                      "_q6_kernel": [1.0]}, wall=10.0)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"runs": {"x/ar": {"wall_us": 1.0, "kernel_us": 1.0, "order": []}}}),
                     encoding="utf-8")
    assert gv.main(["--a", a, "--b", str(other)]) == 2
    assert "no graph in common: A has ['m/ar/ar@1'], B ['x/ar']" in capsys.readouterr().err
    assert gv.main(["--a", a, "--b", str(tmp_path / "missing.json")]) == 2
    assert "missing.json: cannot be read" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        gv.main(["--a", a, "--b", a, "--top", "0"])
    assert exc.value.code == 2
