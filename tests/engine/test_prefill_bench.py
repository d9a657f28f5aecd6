"""benchmarks/prefill_bench.py on the tiny target: a prompt past the chunk is timed in chunks and whole,
the first token equal, the chunk's rows and the prompt's recorded; bad flags exit 2."""

from __future__ import annotations

import json

import pytest
from bench_modules import load_benchmark

from engine.decoding import prefix_cache as prefix_cache_mod

pb = load_benchmark("prefill_bench")
TINY = ["--target", "tiny-dense", "--draft", "random", "--device", "cpu", "--dtype", "float32"]


def test_a_long_prompt_is_timed_both_ways_and_the_engine_s_chunk_is_restored(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert pb.main([*TINY, "--lengths", "40", "600", "--repeats", "1", "--out", str(out), "--md",
                    str(tmp_path / "p.md")]) == 0
    got = json.loads(out.read_text())["lengths"]
    assert got["600"]["chunked"]["rows"] == 512 and got["600"]["whole"]["rows"] == 600
    assert got["40"]["chunked"]["rows"] == 40  # within a chunk: whole either way
    assert all(g["chunked"]["first_token"] == g["whole"]["first_token"] for g in got.values())
    assert "| 600 | 512 |" in capsys.readouterr().out and prefix_cache_mod.PREFILL_CHUNK == 512


@pytest.mark.parametrize("flags", [["--repeats", "0"], ["--lengths", "1"], ["--transient-mib", "0"]])
def test_bad_flags_exit_2(flags):
    with pytest.raises(SystemExit) as exc:
        pb.main([*TINY, *flags])
    assert exc.value.code == 2


def test_a_prompt_past_the_context_exits_2_and_the_budget_is_restored(capsys):
    budget = prefix_cache_mod.PREFILL_TRANSIENT_BYTES
    assert pb.main([*TINY, "--lengths", "100000", "--transient-mib", "1"]) == 2
    assert "exceed the target's context" in capsys.readouterr().err
    assert prefix_cache_mod.PREFILL_TRANSIENT_BYTES == budget


def test_a_smaller_budget_takes_fewer_rows_a_chunk(tmp_path):
    out = tmp_path / "p.json"
    assert pb.main([*TINY, "--lengths", "600", "--repeats", "1", "--transient-mib", "0.1", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["lengths"]["600"]["chunked"]["rows"] < 512


def test_a_form_that_runs_out_of_memory_says_so_and_the_rest_still_runs(tmp_path, monkeypatch, capsys):
    """The 27B shape's whole 16k-token prompt does not fit an H100 (24 GiB of scores): that form's row says
    out of memory, the other form and the other lengths are still timed, and the chunk is restored."""
    import torch

    measure = pb.measure

    def whole_too_big(pair, prompt, form, repeats):
        if form == "whole" and len(prompt) > 512:
            pb.prefix_cache_mod.PREFILL_CHUNK = len(prompt)  # as measure sets it before the forward
            try:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 GiB")
            finally:
                pb.prefix_cache_mod.PREFILL_CHUNK = 512
        return measure(pair, prompt, form, repeats)

    monkeypatch.setattr(pb, "measure", whole_too_big)
    out = tmp_path / "p.json"
    assert pb.main([*TINY, "--lengths", "40", "600", "--repeats", "1", "--out", str(out)]) == 0
    got = json.loads(out.read_text())["lengths"]
    assert got["600"]["whole"]["error"].startswith("out of memory") and got["600"]["whole"]["prefill_s"] is None
    assert got["600"]["chunked"]["prefill_s"] and got["40"]["whole"]["prefill_s"]
    captured = capsys.readouterr()
    assert "| 600 | 512 |" in captured.out and "| out of memory | - |" in captured.out
    assert "600 tokens, whole: out of memory" in captured.err and prefix_cache_mod.PREFILL_CHUNK == 512
