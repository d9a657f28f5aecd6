"""benchmarks/gpu_bench.py's command line on the CPU: ``--also`` names a config to time beside the
pair's, and a bad one is refused before any model loads."""

from __future__ import annotations

import argparse

import pytest
from bench_modules import load_benchmark


def test_also_reads_a_named_config_with_yaml_values():
    gb = load_benchmark("gpu_bench")
    name, fields = gb._named_config("winner:verify=ddtree,budget=30,proposal_temp=1.11,chain_seed=null")
    assert name == "winner"
    assert fields == {"verify": "ddtree", "budget": 30, "proposal_temp": 1.11, "chain_seed": None}


@pytest.mark.parametrize("text, says", [
    ("winner", "NAME:KEY=VALUE"),
    ("winner:", "NAME:KEY=VALUE"),
    (":budget=3", "NAME:KEY=VALUE"),
    ("w:budget", "NAME:KEY=VALUE"),
    ("w:budgett=3", "unknown EngineConfig field(s) ['budgett']"),
    ("w:verify=ddtree,budget=0", "budget"),
    ("w:verify=chain,draft_path=generic", "draft_path is --paths'"),
    ("w:budget=[", "a value is not YAML"),
])
def test_also_refuses_a_bad_config_naming_it(text, says):
    gb = load_benchmark("gpu_bench")
    with pytest.raises(argparse.ArgumentTypeError, match=None) as err:
        gb._named_config(text)
    assert says in str(err.value)


def test_a_bad_also_exits_2_before_loading(capsys):
    gb = load_benchmark("gpu_bench")
    with pytest.raises(SystemExit) as exit_:
        gb.main(["pair", "--also", "w:top_k=zero"])
    assert exit_.value.code == 2
    assert "--also" in capsys.readouterr().err


def test_an_also_name_the_pair_uses_is_refused(capsys):
    gb = load_benchmark("gpu_bench")
    for argv in (["--also", "chain:verify=chain"], ["--budget", "30", "--also", "ddtree-b30:budget=30"],
                 ["--also", "w:budget=3", "--also", "w:budget=4"]):
        with pytest.raises(SystemExit) as exit_:
            gb.main(["pair", *argv])
        assert exit_.value.code == 2 and "the name is taken" in capsys.readouterr().err
