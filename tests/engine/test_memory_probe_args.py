"""benchmarks/memory_probe.py's command line on the CPU: a bad flag or config exits 2 naming it before any model
loads, and without CUDA the probe says it needs it (exit 2): it measures the device allocator's peaks."""

from __future__ import annotations

import pytest
import torch
from bench_modules import load_benchmark, usage_error


@pytest.mark.parametrize("argv, says", [
    (["--n", "0"], "--n must be >= 1, not 0"),
    (["--new-tokens", "0"], "--new-tokens must be >= 1, not 0"),
    (["--lengths", "300", "1"], "--lengths: every length must be >= 2 tokens, not 1"),
    (["--sets", "--lengths"], "nothing to measure: give --sets or --lengths"),
    (["--config", "w:budgett=3"], "unknown EngineConfig field(s) ['budgett']"),
    (["--config", "w"], "NAME:KEY=VALUE"),
    (["--weights", "fp8"], "invalid choice: 'fp8'"),
])
def test_a_bad_flag_exits_2_naming_it(capsys, argv, says):
    assert says in usage_error(capsys, "memory_probe", argv)


def test_the_default_configs_are_ar_and_ddtree_22():
    probe = load_benchmark("memory_probe")
    args = probe._args([])
    assert [name for name, _ in args.config] == ["ar", "ddtree-22"]
    assert args.config[1][1] == {"verify": "ddtree", "budget": 22, "top_k": 8}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal off CUDA")
def test_without_cuda_it_says_so_and_exits_2(capsys):
    assert "needs CUDA" in usage_error(capsys, "memory_probe", ["--lengths", "300"])
