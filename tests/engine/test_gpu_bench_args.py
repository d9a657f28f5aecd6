"""benchmarks/gpu_bench.py's command line on the CPU: ``--also`` names a config to time beside the
pair's, and a bad one is refused before any model loads."""

from __future__ import annotations

import argparse

import pytest
from bench_modules import load_benchmark, usage_error


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


def test_a_mix_interleaves_its_sets_prompts():
    gb = load_benchmark("gpu_bench")
    assert gb.interleave([["h1", "h2", "h3"], ["c1"], ["a1", "a2"]]) == ["h1", "c1", "a1", "h2", "a2", "h3"]
    assert gb._mix_name(["humaneval", ".device/workloads/eval_chat.jsonl", "agent"]) == "mix(humaneval+eval_chat+agent)"


@pytest.mark.parametrize("argv, says", [
    (["pair", "--mix", "humaneval"], "a mix interleaves at least two different sets"),
    (["pair", "--mix", "chat", "chat"], "a mix interleaves at least two different sets"),
    (["oracle", "--oracles", "oracle:0.1,x"], "P number 2 ('x') is not a number"),
    (["oracle", "--oracles", "random"], "expected oracle:P or oracle:P1,P2,..."),
    (["oracle", "--oracles", "oracle:1.2"], "0 <= P <= 1"),
    (["oracle", "--n-prompts", "2", "--oracles", "oracle:0.1,0.5,0.9"], "give at least 3"),
    (["oracle", "--budgets", "0", "8"], "--budgets 0 8 --top-k 8: EngineConfig.budget must be >= 1"),
    (["oracle", "--top-k", "0"], "EngineConfig.top_k must be >= 1"),
    (["large", "--gluon-warps", "8"], "--gluon-warps: a setting of the Gluon decode, not of --q4k-decode engine"),
    (["large", "--q4k-decode", "kernel", "--gluon-min-rows", "8"],
     "--gluon-min-rows: a setting of the Gluon decode (engine or gluon*), not of --q4k-decode kernel"),
    (["large", "--q4k-decode", "kernel", "--gluon-stages", "3"],
     "--gluon-stages: a setting of the Gluon decode (engine or gluon*), not of --q4k-decode kernel"),
    (["large", "--q4k-decode", "kernel", "--gluon-stages", "0"],
     "--gluon-stages: a setting of the Gluon decode (engine or gluon*), not of --q4k-decode kernel"),
    (["large", "--q4k-decode", "gluon-pairs-ahead", "--gluon-stages", "3"],
     "--gluon-stages 3: shared-memory stages take the pair decode with x staged beside the planes"),
    (["large", "--q4k-decode", "kernel", "--gluon-few-rows-stages", "6"],
     "--gluon-few-rows-stages: a setting of the Gluon decode (engine or gluon*), not of --q4k-decode kernel"),
    (["large", "--q4k-decode", "gluon", "--gluon-few-rows-stages", "4"],
     "--gluon-few-rows-stages 4: shared-memory stages take the pair decode with x staged beside the planes"),
    (["large", "--q4k-decode", "packed", "--gluon-staged-rows", "64"],
     "--gluon-staged-rows: a setting of the Gluon decode (engine or gluon*), not of --q4k-decode packed"),
    (["large", "--q4k-decode", "kernel", "--gluon-tails", "on"],
     "--gluon-tails: a setting of the Gluon decode (engine or gluon*), not of --q4k-decode kernel"),
    (["large", "--q4k-decode", "packed", "--gluon-tails", "off"],
     "--gluon-tails: a setting of the Gluon decode (engine or gluon*), not of --q4k-decode packed"),
    (["large", "--q4k-decode", "kernel", "--gluon-maxnreg", "0"],
     "--gluon-maxnreg: a setting of the Gluon decode (engine or gluon*), not of --q4k-decode kernel"),
    (["large", "--gluon-tails", "off", "--gluon-maxnreg", "128"],
     "--gluon-maxnreg 128: it caps a tail's launch, and --gluon-tails off takes none"),
    (["large", "--q4k-decode", "kernel", "--gluon-wide-warps", "16"],
     "--gluon-wide-warps: a setting of the Gluon decode (engine or gluon*), not of --q4k-decode kernel"),
    (["large", "--gluon-wide-warps", "16", "--gluon-stages", "3"],
     "--gluon-wide-warps 16: a verify's launches on the register path at the engine's own warps, not with "
     "--gluon-stages 3"),
    (["large", "--q4k-decode", "kernel", "--gluon-fold-from", "0"],
     "--gluon-fold-from: a setting of the Gluon decode (engine or gluon*), not of --q4k-decode kernel"),
    (["large", "--q4k-decode", "packed", "--gluon-programs-per-sm", "4"],
     "--gluon-programs-per-sm: a setting of the Gluon decode (engine or gluon*), not of --q4k-decode packed"),
    (["large", "--q4k-decode", "packed", "--gluon-pdl", "on"],
     "--gluon-pdl: a setting of the Gluon decode (engine or gluon*), not of --q4k-decode packed"),
    (["large", "--q4k-decode", "packed", "--gluon-warps", "4"],
     "--gluon-warps: a setting of the Gluon decode, not of --q4k-decode packed"),
    (["large", "--q4k-decode", "kernel", "--gluon-verify-sliver", "8"],
     "--gluon-verify-sliver: a setting of the Gluon decode (engine or gluon*), not of --q4k-decode kernel"),
    (["large", "--q4k-decode", "gluon-pairs", "--gluon-verify-sliver", "8"],
     "--gluon-verify-sliver 8: the engine's weights fold the doubled parts (OperandWeight), not --q4k-decode "
     "gluon-pairs's launches"),
    (["large", "--gluon-verify-sliver", "8", "--gluon-tails", "off"],
     "--gluon-verify-sliver 8 with --gluon-tails off: its rule counts a verify's launch as 32 rows and a tail"),
    (["large", "--gluon-verify-sliver", "4", "--gluon-stages", "3"], "--gluon-verify-sliver 4 with --gluon-stages 3"),
    (["large", "--gluon-verify-sliver", "8", "--gluon-maxnreg", "0"], "--gluon-verify-sliver 8 with --gluon-maxnreg 0"),
])
def test_a_bad_mix_or_oracle_set_exits_2_before_loading(capsys, argv, says):
    assert says in usage_error(capsys, "gpu_bench", argv)


def test_the_gluon_flags_set_only_what_they_ask_for():
    """``--gluon-*`` (``q4k_decode.settings``): each flag given sets its ``quant_gluon`` setting (``--gluon-tails
    off`` the power of two, ``16`` 17-24 rows' tails too, ``--gluon-maxnreg 0`` ptxas' own registers,
    ``--gluon-verify-sliver 0`` never); a flag not given leaves the engine's."""
    def settings(**flags):
        asked = dict(gluon_min_rows=None, gluon_stages=None, gluon_few_rows_stages=None, gluon_staged_rows=None,
                     gluon_pdl=None, gluon_tails=None, gluon_maxnreg=None, gluon_wide_warps=None, gluon_fold_from=None,
                     gluon_programs_per_sm=None, gluon_verify_sliver=None)
        return load_benchmark("q4k_decode").settings(argparse.Namespace(**(asked | flags)))

    assert settings() == {}
    assert settings(gluon_tails="off", gluon_maxnreg=0) == {"TAILS": False, "MAXNREG": None}
    assert settings(gluon_tails="16", gluon_maxnreg=168) == {"TAILS": True, "TAIL_FROM": 32, "MAXNREG": 168}
    assert settings(gluon_tails="on", gluon_min_rows=16, gluon_stages=0, gluon_pdl="on") == {
        "TAILS": True, "MIN_BLOCK_M": 16, "STAGES": 0, "PDL": True}
    assert settings(gluon_pdl="off") == {"PDL": False}
    assert settings(gluon_few_rows_stages=6) == {"FEW_ROWS_STAGES": 6}
    assert settings(gluon_staged_rows=64) == {"STAGED_ROWS": 64}
    assert settings(gluon_wide_warps=16) == {"WIDE_WARPS": 16}
    assert settings(gluon_fold_from=0) == {"FOLD_FROM": None} and settings(gluon_fold_from=32) == {"FOLD_FROM": 32}
    assert settings(gluon_programs_per_sm=4) == {"PROGRAMS_PER_SM": 4}
    assert settings(gluon_verify_sliver=0) == {"VERIFY_SLIVER": None}
    assert settings(gluon_verify_sliver=8) == {"VERIFY_SLIVER": 8}


def test_the_summary_puts_each_adaptive_config_against_the_best_fixed_one():
    gb = load_benchmark("gpu_bench")
    configs = [("ar", dict(verify="ar")), ("chain", dict(verify="chain")), ("ddtree-b48", dict(budget=48)),
               ("ddtree-b48-adaptive", dict(budget=48, policy="adaptive")), ("b32", dict(budget=32)),
               ("a2", dict(budget=32, policy="adaptive"))]
    tps = {"ar": 1000.0, "chain": 2000.0, "ddtree-b48": 2600.0, "ddtree-b48-adaptive": 2730.0, "b32": 2500.0,
           "a2": 2900.0}
    rows = {f"{n}/runtime": {"tps": [t - 10, t, t + 50]} for n, t in tps.items()}
    assert gb._adaptive_vs_fixed("mix(x+y)", rows, configs, ["runtime"]) == [
        "| mix(x+y) | runtime | ddtree-b48 2600.0 | ddtree-b48-adaptive 2730.0 | **1.050x** |",
        "| mix(x+y) | runtime | ddtree-b48 2600.0 | a2 2900.0 | **1.115x** |"]


def test_the_large_rooflines_bytes_are_what_a_step_reads_float_or_quantized():
    """``large --weights``: the bytes an AR step reads are the stored weights once, one embedding row
    (the float head reads the whole embedding only when tied to it); quantized in memory to the
    q4_k_m mix, the projections count at their blocks' size, fewer bytes than the floats."""
    import engine
    from engine.models.quantize import quantize_model_

    gb = load_benchmark("gpu_bench")
    for name in ("tiny-dense", "tiny-hybrid"):
        target = engine.load(name, "none", device="cpu", dtype="float32").target
        embed = target.embed_tokens.weight
        tied = target.lm_head.weight is embed
        floats = sum(p.numel() * p.element_size() for n, p in target.named_parameters()
                     if "embed_tokens" not in n or tied) + embed.shape[1] * embed.element_size()
        assert gb.bytes_read_per_token(target) == floats
        formats = quantize_model_(target, "q4_k_m")
        assert formats and gb.bytes_read_per_token(target) < floats
    with pytest.raises(SystemExit) as exit_:
        gb.main(["large", "--weights", "q2_k"])
    assert exit_.value.code == 2


def test_large_with_q4_k_m_times_the_registrys_quantized_presets_and_refuses_others(capsys):
    """``large --weights q4_k_m`` loads each shape's registry twin ``<shape>-q4_k_m`` held native with the
    shape's own draft (one way to build it: the preset); a preset with no such twin is refused at the
    command line, before any GPU is asked for."""
    import engine

    gb = load_benchmark("gpu_bench")
    assert gb.large_pair("qwen35-27b-shape", "q4_k_m") == ("qwen35-27b-shape-q4_k_m", "qwen35-27b-shape-dflash",
                                                           "native")
    assert gb.large_pair("qwen3-8b-shape", "bf16") == ("qwen3-8b-shape", "qwen3-8b-shape-dflash", "dequantized")
    target, draft, weights = gb.large_pair("qwen3-8b-shape", "q4_k_m")
    pair = engine.load(target, draft, device="meta", dtype="bfloat16", weights=weights)  # (shapes only)
    assert set(pair.weight_summary()["formats"]) == {"Q4_K", "Q6_K"}
    for presets in (["tiny-dense"], ["qwen3-8b-shape", "smollm2-135m-shape"]):
        with pytest.raises(SystemExit) as exit_:
            gb.main(["large", "--weights", "q4_k_m", "--presets", *presets])
        assert exit_.value.code == 2
        assert f"--presets {presets[-1]} --weights q4_k_m: needs the registry preset {presets[-1]}-q4_k_m" in \
            capsys.readouterr().err


def test_profile_and_graphs_take_the_quantized_twins_with_weights(capsys):
    """``profile`` / ``graphs --presets P --weights q4_k_m`` time ``P``'s quantized twin held native (as
    ``large`` pairs it), so a quantized step's kernels are profiled; without ``--presets`` the
    ``--target`` / ``--draft`` pair as given; a preset with no twin is refused before a GPU is asked for."""
    gb = load_benchmark("gpu_bench")
    sp = load_benchmark("step_profile")
    quantized = argparse.Namespace(presets_given=True, presets=["qwen35-27b-shape"], weights="q4_k_m")
    assert sp._targets(quantized) == [("qwen35-27b-shape-q4_k_m", "qwen35-27b-shape-dflash", "native", True)]
    plain = argparse.Namespace(presets_given=False, target="smollm2-135m-instruct", draft="smollm2-135m-dflash",
                               weights="q4_k_m")
    assert sp._targets(plain) == [("smollm2-135m-instruct", "smollm2-135m-dflash", "dequantized", False)]
    for section in ("profile", "graphs"):
        with pytest.raises(SystemExit) as exit_:
            gb.main([section, "--weights", "q4_k_m", "--presets", "tiny-dense"])
        assert exit_.value.code == 2
        assert "--presets tiny-dense --weights q4_k_m: needs the registry preset tiny-dense-q4_k_m" in \
            capsys.readouterr().err


def test_profile_and_graphs_hold_a_gguf_targets_blocks_with_weights_native_and_only_there(capsys):
    """``--weights native`` (issue #28: SmolLM2's Q4_1 file as the engine holds it natively): ``profile`` and
    ``graphs`` of ``--target`` load it with weights native and name it so in their tables; with ``--presets`` or in
    another section it is refused before a GPU is asked for (exit 2, naming the flag and what takes it)."""
    gb = load_benchmark("gpu_bench")
    sp = load_benchmark("step_profile")
    native = argparse.Namespace(presets_given=False, target="smollm2-135m-instruct", draft="smollm2-135m-dflash",
                                weights="native")
    assert sp._targets(native) == [("smollm2-135m-instruct", "smollm2-135m-dflash", "native", False)]
    assert sp._shown("smollm2-135m-instruct", "native", native) == "smollm2-135m-instruct-native"
    for argv, says in [(["graphs", "--weights", "native", "--presets", "qwen3-8b-shape"], "not --presets"),
                       (["large", "--weights", "native"], "not section large"),
                       (["pair", "--weights", "native"], "not section pair"),
                       (["graphs", "--weights", "native", "--target", "qwen3-8b-shape"], "qwen3-8b-shape")]:
        with pytest.raises(SystemExit) as exit_:
            gb.main(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "--weights native" in err and says in err, err
        assert ("a GGUF --target's own blocks, for profile and graphs" in err) != ("keeps a GGUF file's" in err), err
