"""Quantized presets (``engine.registry.quantized_preset``): a float preset's projections quantized in
memory to the Q4_K_M-like mix while it is built, held native (the blocks) or dequantized (their values),
as a GGUF of that mix is. On tiny presets on the CPU (their 64-wide rows take the 32-value fallbacks;
two 256-wide ones, one with a tied head, take Q4_K and Q6_K) a quantized preset holds, bit for bit, what
``quantize_model_`` makes of the float preset loaded in the same dtype; the 27B and 8B shapes' presets
are planned on the meta device (``test_meta_load.py``: their meta plans equal real ones)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import engine
from engine import EngineConfig, EngineInputError
from engine.data.tokenizer import ByteTokenizer
from engine.models.common import unfused_state_dict
from engine.models.dense import DenseConfig, DenseModel
from engine.models.quant import QuantEmbedding, QuantFusedLinear, QuantLinear
from engine.models.quantize import quantize_model_
from engine.registry import CPU, DRAFTS, TARGETS, TINY_SEED, TargetPreset, draft_for, init_random_, quantized_preset
from tests.engine.test_meta_load import _assert_plans_equal as assert_plans_equal

WIDE_SEED = 99


def _wide(tied: bool, device: torch.device = CPU) -> tuple[nn.Module, object]:
    """A seeded 8-layer dense model of 256-wide rows (512 in the MLP): Q4_K, and Q6_K where llama.cpp's
    recipe gives more bits."""
    tok = ByteTokenizer(272)
    cfg = DenseConfig(vocab_size=tok.vocab_size, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, intermediate_size=512, qk_norm=True, arch="qwen3",
                      tie_word_embeddings=tied)
    with torch.device(device):
        model = DenseModel(cfg)
    if device.type != "meta":
        init_random_(model, WIDE_SEED)
    return model, tok


# base preset -> the seed its weights are drawn with (the quantized twin draws the same values)
BASES = {"tiny-dense": TINY_SEED, "tiny-hybrid": TINY_SEED + 1, "wide": WIDE_SEED, "wide-tied": WIDE_SEED}


@pytest.fixture
def quantized(monkeypatch):
    """Registers ``<base>-q4_k_m`` for every base of ``BASES`` (and the two wide float presets) for the test."""
    monkeypatch.setitem(TARGETS, "wide", TargetPreset("wide", "test", lambda device=CPU: _wide(False, device)))
    monkeypatch.setitem(TARGETS, "wide-tied", TargetPreset("wide-tied", "test", lambda device=CPU: _wide(True, device)))
    for base, seed in BASES.items():
        monkeypatch.setitem(TARGETS, f"{base}-q4_k_m", quantized_preset(base, "test", seed=seed))
    return {base: f"{base}-q4_k_m" for base in BASES}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("base", list(BASES))
def test_a_quantized_preset_holds_what_quantize_model_makes_of_its_base(quantized, base, dtype):
    """Same formats per projection, same module layout (fused groups of one format, mixed groups as
    parts), same blocks and floats bit for bit; the weights' summary reads it as a native GGUF load."""
    ref = engine.load(base, "none", device="cpu", dtype=dtype)
    formats = quantize_model_(ref.target)
    pair = engine.load(quantized[base], "none", device="cpu", dtype=dtype, weights="native")
    summary = pair.weight_summary()
    assert summary["mode"] == "native" and summary["native"] == formats
    assert summary["native_projections"] == len(formats) and summary["fallback"] == {}
    held = "F32" if dtype == "float32" else "BF16"
    assert set(summary["dequantized"].values()) == {held}  # the embedding and the norms, as floats
    assert set(summary["native"]) | set(summary["dequantized"]) == set(pair.target.weight_types)
    assert {n: type(m) for n, m in pair.target.named_modules()} == {n: type(m) for n, m in ref.target.named_modules()}
    mine, theirs = pair.target.state_dict(), ref.target.state_dict()
    assert mine.keys() == theirs.keys()
    assert [n for n in mine if not torch.equal(mine[n], theirs[n])] == []
    kinds = set(formats.values())
    assert kinds == ({"Q4_K", "Q6_K"} if base.startswith("wide") else {"Q5_0", "Q8_0"})
    if base == "wide-tied":  # the head its own blocks, the embedding its floats
        assert isinstance(pair.target.lm_head, QuantLinear) and pair.target.embed_tokens.weight.dtype.is_floating_point
    if base == "wide":  # a q/k/v group with a Q6_K v stays as its parts; one all Q4_K is one block tensor
        assert formats["layers.0.self_attn.v_proj.weight"] == "Q6_K"
        assert isinstance(pair.target.layers[0].self_attn.v_proj, QuantLinear)
        assert isinstance(pair.target.layers[1].self_attn.qkv_proj, QuantFusedLinear)


def _blocks_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the values of each weight ``model`` holds in blocks (a fused group's by part)."""
    out = {}
    for owner, module in model.named_modules():
        for child_name, child in module.named_children():
            if isinstance(child, QuantFusedLinear):
                parts = zip(module.FUSED[child_name], child.dequantized().split(child.sizes), strict=True)
            elif isinstance(child, (QuantLinear, QuantEmbedding)):
                parts = [(child_name, child.dequantized())]
            else:
                continue
            out.update({f"{owner}.{part}.weight" if owner else f"{part}.weight": w for part, w in parts})
    return out


@pytest.mark.parametrize("base", ["tiny-hybrid", "wide-tied"])
def test_dequantized_it_holds_the_blocks_values_and_decodes_as_native(quantized, base):
    """``weights="dequantized"``: each quantized projection as floats equal to its blocks' values (a tied
    head untied, holding its own blocks' values), the summary naming what a native load keeps; in
    float32 both forms decode the same tokens, and chain and DDTree equal AR on each."""
    native = engine.load(quantized[base], "random", device="cpu", dtype="float32", weights="native")
    floats = engine.load(quantized[base], "random", device="cpu", dtype="float32")
    summary = floats.weight_summary()
    assert summary["mode"] == "dequantized" and summary["native"] == {}
    assert summary["native_projections"] == native.weight_summary()["native_projections"] > 0
    assert not any(isinstance(m, QuantLinear) for m in floats.target.modules())
    held = unfused_state_dict(floats.target)
    values = _blocks_values(native.target)
    assert values.keys() == set(summary["dequantized"]) - {n for n, t in summary["dequantized"].items() if t == "F32"}
    assert [n for n, w in values.items() if not torch.equal(held[n], w)] == []
    if base == "wide-tied":
        assert floats.target.lm_head.weight is not floats.target.embed_tokens.weight
    ids = native.encode("the quick brown fox")
    ar = engine.generate(native, ids, EngineConfig(verify="ar"), 20, ignore_eos=True).tokens
    assert engine.generate(floats, ids, EngineConfig(verify="ar"), 20, ignore_eos=True).tokens == ar
    for pair in (native, floats):
        for cfg in (EngineConfig(verify="chain"), EngineConfig(verify="ddtree", budget=8, top_k=3)):
            assert engine.generate(pair, ids, cfg, 20, ignore_eos=True).tokens == ar, (pair.weights, cfg)


@pytest.mark.parametrize("weights", ["native", "dequantized"])
@pytest.mark.parametrize("base", ["tiny-hybrid", "wide", "wide-tied"])
def test_on_the_meta_device_it_plans_as_loaded_with_nothing_allocated(quantized, base, weights):
    """Blocks as uint8 meta tensors of the bytes the real quantization holds: every config's plan, per
    part, and the weights' summary equal the loaded pair's."""
    real = engine.load(quantized[base], "random", device="cpu", dtype="bfloat16", weights=weights)
    meta = engine.load(quantized[base], "random", device="meta", dtype="bfloat16", weights=weights)
    assert_plans_equal(meta, real)
    blocks = {n: (tuple(b.shape), b.dtype) for n, b in meta.target.named_buffers() if n.endswith("blocks")}
    assert blocks == {n: (tuple(b.shape), b.dtype) for n, b in real.target.named_buffers() if n.endswith("blocks")}
    assert bool(blocks) == (weights == "native")


def test_the_shape_presets_quantized_twins_are_gpu_presets_paired_with_the_shapes_drafts():
    for base in ("qwen3-8b-shape", "qwen35-27b-shape"):
        name = f"{base}-q4_k_m"
        assert TARGETS[name].base == base and draft_for(name) == f"{base}-dflash" == draft_for(base)
        assert DRAFTS[draft_for(name)].target == base
        engine.check_model_spec(name, f"{base}-dflash", "native")  # native is theirs to keep; not the float shape's
        with pytest.raises(EngineInputError, match="weights='native' keeps a GGUF file's quantized blocks"):
            engine.check_model_spec(base, f"{base}-dflash", "native")
        for weights in ("native", "dequantized"):
            with pytest.raises(EngineInputError, match="GPU timing presets.*use device cuda"):
                engine.load(name, f"{base}-dflash", device="cpu", weights=weights)
