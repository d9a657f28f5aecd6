"""benchmarks/exact_bench.py on a tiny pair on the CPU: every config it lists runs, its outputs are
compared with AR's, and the table, the JSON and the exit code say so (the GPU runs are in
benchmarks/RESULTS.md)."""

from __future__ import annotations

import json

import pytest
from bench_modules import REPO, load_benchmark


def _exact_bench():
    return load_benchmark("exact_bench")


def test_exact_bench_checks_every_config_against_ar(tmp_path):
    out, md = tmp_path / "exact.json", tmp_path / "exact.md"
    rc = _exact_bench().main([
        "--target", "tiny-dense", "--draft", "random", "--device", "cpu", "--dtype", "float32",
        "--random-prompts", "2", "--prompt-len", "12", "--max-new-tokens", "10", "--budgets", "4", "8",
        "--top-ks", "1", "3", "--paths", "runtime", "generic", "--eos-configs", "chain",
        "--oracle", "0.3", "--oracle-configs", "ddtree b8 k3", "--out", str(out), "--md", str(md)])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 0
    seen = {(r["draft"], r["config"], r["path"], r["to"]) for r in rows}
    for name in ("chain", "ddtree b4 k1", "ddtree b4 k3", "ddtree b8 k1", "ddtree b8 k3"):
        for path in ("runtime", "generic"):
            assert ("random", name, path, "max") in seen
    assert ("random", "chain", "runtime", "eos") in seen and ("random", "ddtree b8 k3", "runtime", "eos") not in seen
    assert ("oracle:0.3", "ddtree b8 k3", "generic", "max") in seen
    assert all(r["exact"] == r["n"] == 2 and not r["divergences"] for r in rows)
    oracle = next(r for r in rows if r["draft"] == "oracle:0.3")
    assert oracle["al"] > 1.5  # the oracle's deep paths: the check covers accepted trees, not only roots
    assert f"total: {2 * len(rows)}/{2 * len(rows)} outputs equal to AR" in md.read_text()


def test_exact_bench_reports_a_divergence_with_its_margins_and_verdict(tmp_path, monkeypatch):
    """A reference rewritten at position 3 (as a kernel that rounded a verify's row otherwise would
    leave it): the row counts the prompt inexact with the ``Divergence`` record, and the exit code is 1."""
    module = _exact_bench()
    bench = module.engine.bench

    def rewritten(pair, cfg, prompts, max_new, reference=None, **kw):
        if reference is not None:
            reference = [list(r) for r in reference]
            reference[0][3] = (reference[0][3] + 1) % pair.target.cfg.vocab_size
        return bench(pair, cfg, prompts, max_new, reference=reference, **kw)

    monkeypatch.setattr(module.engine, "bench", rewritten)
    out = tmp_path / "exact.json"
    rc = module.main(["--target", "tiny-dense", "--draft", "random", "--device", "cpu", "--dtype", "float32",
                      "--random-prompts", "2", "--prompt-len", "12", "--max-new-tokens", "8", "--budgets", "4",
                      "--top-ks", "2", "--eos-configs", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 1
    assert all(r["exact"] == 1 for r in rows)
    div = rows[0]["divergences"][0]
    assert div["prompt"] == 0 and div["first_divergence"] == div["position"] == 3
    assert div["verdict"] == "mismatch" and div["reproduced"] is False
    assert div["ar_margin"] >= 0 and div["run_margin"] >= 0
    assert "p0 div 3: mismatch" in rows[0]["text"]



def test_step_attention_candidate_is_parsed_and_refused_by_its_rule(monkeypatch, capsys):
    """``--step-attention``: every field of BLOCK_NxWARPS[xSPAN][mBLOCK_M][fFOLD] reaches the launch; a bad value is
    refused with the rule and the value, and exact_bench exits 2 before loading anything."""
    import sys

    from engine.models import attention

    sys.path.insert(0, str(REPO / "benchmarks"))
    monkeypatch.setattr(attention, "step_attention_launch", attention.step_attention_launch)
    import step_attention

    step_attention.override_step_attention("64x8x128")
    launch = attention.step_attention_launch(64)
    assert (launch["BLOCK_N"], launch["num_warps"], launch["SPLIT"]) == (64, 8, 128)
    assert launch["BLOCK_M"] == attention.ATTN_BLOCK_M  # the engine's rows unless named
    step_attention.override_step_attention("32x8m64f8")
    launch = attention.step_attention_launch(256)
    assert (launch["BLOCK_N"], launch["num_warps"], launch["BLOCK_M"], launch["FOLD"]) == (32, 8, 64, 8)
    for bad in ("32x4x48", "32x3", "16x4x64x2", "wide", "32x4m24", "32x4m8", "32x4m256", "32x4mx", "32x4f0",
                "32x4f8m64"):
        assert not step_attention.apply_step_attention(bad)
        assert f"got {bad!r}" in capsys.readouterr().err
    assert _exact_bench().main(["--step-attention", "32x4x48", "--device", "cpu"]) == 2


def test_exact_bench_holds_a_native_target_and_its_oracle_twin_natively(tmp_path):
    """``--weights native`` on a quantized GGUF: the oracle twin is built on the same target, so it
    reports the weights as loaded (not the Pair default), and both decode exactly as AR."""
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from tests.engine.gguf_files import bpe_tokenizer, tiny_hf, write_gguf

    target, out = tmp_path / "target.gguf", tmp_path / "exact.json"
    write_gguf(target, tiny_hf("qwen3"), "qwen3", gguf.GGMLQuantizationType.Q8_0, tokenizer=bpe_tokenizer())
    rc = _exact_bench().main([
        "--target", str(target), "--draft", "random", "--device", "cpu", "--dtype", "float32", "--weights", "native",
        "--random-prompts", "1", "--prompt-len", "8", "--max-new-tokens", "6", "--budgets", "4", "--top-ks", "2",
        "--paths", "generic", "--eos-configs", "--oracle", "0.3", "--oracle-configs", "ddtree b4 k2", "--out",
        str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 0 and {r["draft"] for r in rows} == {"random", "oracle:0.3"}
    assert all(r["weights"] == "native" and r["exact"] == r["n"] == 1 for r in rows)
