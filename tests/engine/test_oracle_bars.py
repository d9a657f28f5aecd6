"""benchmarks/oracle_bars.py (``gpu_bench.py oracle``) on the CPU: the section on a tiny preset (every
output equal to AR's, each prompt's P honoured in what the chain accepts) and its arithmetic."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from bench_modules import load_benchmark


def test_the_section_runs_on_a_tiny_preset_exact_with_each_prompts_p(tmp_path):
    gb = load_benchmark("gpu_bench")
    out, md = tmp_path / "oracle.json", tmp_path / "oracle.md"
    assert gb.main(["oracle", "--device", "cpu", "--dtype", "float32", "--presets", "tiny-dense", "--n-prompts",
                    "2", "--context", "8", "--new-tokens", "10", "--budgets", "4", "--oracles", "oracle:0,1",
                    "--repeats", "1", "--out", str(out), "--md", str(md)]) == 0
    run = json.loads(out.read_text())["presets"]["tiny-dense"]["paths"]["runtime"]
    assert run["ar"]["outputs_equal_taught"]
    mixed = run["sets"]["oracle:0,1"]
    assert mixed["ps_by_prompt"] == [0.0, 1.0]
    configs = mixed["configs"]
    assert set(configs) == {"chain", "ddtree-b4", "adaptive (0/4)"}
    assert all(c["exact"] == c["n"] == 2 for c in configs.values())
    assert configs["chain"]["al_by_p"]["0.0"] == 16.0 and configs["chain"]["al_by_p"]["1.0"] < 1.2
    assert configs["ddtree-b4"]["al_by_p"]["0.0"] == 5.0  # four drafted nodes, all accepted, and the bonus token
    assert sum(configs["adaptive (0/4)"]["budget_steps"].values()) > 0
    by_p = configs["adaptive (0/4)"]["budget_steps_by_p"]  # the mix's prompts apart: P 0 and P 1
    assert set(by_p) == {"0.0", "1.0"} and by_p["0.0"] and by_p["1.0"]
    assert {b: sum(c.get(b, 0) for c in by_p.values()) for b in configs["adaptive (0/4)"]["budget_steps"]} == \
        configs["adaptive (0/4)"]["budget_steps"]
    assert configs["chain"]["budget_steps_by_p"] == {}  # no policy: no budgets
    assert mixed["bar"]["bar"] == 1.03 and mixed["bar"]["best_fixed"] == "ddtree-b4"
    text = md.read_text()  # the chain's AL per P beside its expectation; the set's bar
    assert "| 0,1 | chain |" in text and "0: 16.00 (16.00), 1: " in text and "| >= 1.03x: " in text
    assert "(P 0: " in text and "; P 1: " in text  # the mix's budgets per P in the bar line


def test_the_chain_expectation_and_the_al_per_p():
    ob = load_benchmark("oracle_bars")
    assert ob.chain_al(0.0, 15) == 16.0 and ob.chain_al(1.0, 15) == 1.0
    assert math.isclose(ob.chain_al(0.5, 3), 1.875)
    results = [SimpleNamespace(steps=4, acceptance_length=3.0), SimpleNamespace(steps=10, acceptance_length=1.0),
               SimpleNamespace(steps=2, acceptance_length=6.0)]
    assert ob.al_by_p(results, [0.1, 0.9, 0.1]) == {0.1: 4.0, 0.9: 1.0}  # (12 + 12) / 6 and 10 / 10
    bench = SimpleNamespace(prompts=results, step_budgets=[8] * 3 + [0] + [0] * 10 + [16, 0])
    assert ob.budgets_by_p(bench, [0.1, 0.9, 0.1]) == {0.1: {0: 2, 8: 3, 16: 1}, 0.9: {0: 10}}
    assert ob.budgets_by_p(SimpleNamespace(prompts=results, step_budgets=[]), [0.1, 0.9, 0.1]) == {}


def test_the_configs_and_the_bar():
    ob = load_benchmark("oracle_bars")
    configs, fixed, adaptive = ob.configs_for([64, 8, 32, 16], 8)
    assert fixed == ["ddtree-b8", "ddtree-b16", "ddtree-b32", "ddtree-b64"] and adaptive == "adaptive (0/8/16/32/64)"
    assert configs[-1] == (adaptive, dict(verify="ddtree", budget=64, top_k=8, policy="adaptive", policy_levels=4))
    rows = {name: {"tps_median": t} for name, t in zip([*fixed, adaptive], [70.0, 80.0, 90.0, 85.0, 92.0],
                                                                   strict=True)}
    single = ob.bar_of([0.5] * 6, rows, 94.0, fixed, adaptive)  # AR is the best: 92 / 94 = 0.979
    assert single["best_fixed"] == "ddtree-b32" and single["bar"] == 0.97 and single["met"]
    assert single["ratio"] == pytest.approx(92.0 / 94.0)
    assert not ob.bar_of([0.5], rows, 95.0, fixed, adaptive)["met"]  # 92 / 95 = 0.968
    mixed = ob.bar_of([0.1, 0.5, 0.9] * 2, rows, 60.0, fixed, adaptive)  # 92 / 90 < 1.03
    assert mixed["bar"] == 1.03 and not mixed["met"] and mixed["ratio"] == pytest.approx(92.0 / 90.0)
