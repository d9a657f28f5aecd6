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


def test_with_end_to_end_shares_the_groups_compare_them_not_the_gpu_times(tmp_path, capsys):
    """Files with each launch's end-to-end share (``kernel_timing.end_to_end``): the grouped rows add those (a
    product's GPU time under PDL counts its wait for the launch before), the by-name rows still the GPU times."""
    def run(path, gate_up_gpu: float, gate_up_ends: float, wall: float) -> str:
        order = [["rms_norm", 2.0, 2.0], ["_gluon_kernel", gate_up_gpu, gate_up_ends], ["_q6_kernel", 30.0, 28.0]]
        run = {"wall_us": wall, "kernel_us": sum(e[1] for e in order), "order": order}
        path.write_text(json.dumps({"runs": {"m/ar/ar@1": run}}), encoding="utf-8")
        return str(path)

    # B's gate_up: more GPU time (it starts earlier, beside the norm) but less of the span
    a, b = run(tmp_path / "a.json", 50.0, 48.0, 78.0), run(tmp_path / "b.json", 52.0, 45.0, 75.0)
    assert gv.main(["--a", a, "--b", b]) == 0
    out = capsys.readouterr().out
    assert "by kernel and the kernel before it, end-to-end us (from the latest end of the launches before):" in out
    assert "| `_gluon_kernel` | `rms_norm` | 1 | 48.0 | 45.0 | -3.0 | 48.00 -> 45.00 |" in out
    assert "| `_gluon_kernel` | 1 / 1 | 50.0 | 52.0 | +2.0 |" in out
    # one file without the shares (from before them): both sides compare GPU times, and say so
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"runs": {"m/ar/ar@1": {"wall_us": 78.0, "kernel_us": 82.0, "order": [
        ["rms_norm", 2.0], ["_gluon_kernel", 50.0], ["_q6_kernel", 30.0]]}}}), encoding="utf-8")
    assert gv.main(["--a", str(old), "--b", b]) == 0
    out = capsys.readouterr().out
    assert "GPU us (a launch's own" in out and "| `_gluon_kernel` | `rms_norm` | 1 | 50.0 | 52.0 | +2.0 |" in out


def test_end_to_end_shares_add_to_the_span_whatever_the_overlap():
    """``kernel_timing.end_to_end``: a launch's share runs from the latest end before it to its own end (0 if it
    ends inside what ran before), so the shares add to the replay's span."""
    from types import SimpleNamespace

    kt = load_benchmark("kernel_timing")

    def ev(start: float, end: float):
        return SimpleNamespace(time_range=SimpleNamespace(start=start, end=end))

    # a norm 0-3; a PDL product started at 1 (beside the norm), ending at 40; one inside it (5-30); then 40-52
    kernels = [ev(0.0, 3.0), ev(1.0, 40.0), ev(5.0, 30.0), ev(40.0, 52.0)]
    assert kt.end_to_end(kernels) == [3.0, 37.0, 0.0, 12.0]
    assert sum(kt.end_to_end(kernels)) == 52.0 - 0.0


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
    (json.dumps({"runs": {"g": {"wall_us": 1.0, "kernel_us": 1.0, "order": [["k", 1.0, 1.0], ["k", 1.0]]}}}),
     "graph g: not a gpu_bench.py graphs run ('wall_us', 'kernel_us' and 'order' as [kernel, us] or [kernel, us, "
     "end-to-end us]): ValueError('each launch [kernel, us] or [kernel, us, end-to-end us], all alike')"),
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
