"""GGUF weights kept quantized (``engine.load(..., weights="native")``) on the CPU: a tiny quantized
file decodes token for token as its dequantized twin (AR, chain and DDTree through ``engine.bench``),
holds fewer bytes, reports which tensors it keeps in blocks, and refuses what it cannot hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import engine
from engine import EngineConfig, EngineInputError
from engine.models.common import Linear, unfused_state_dict
from engine.models.quant import QuantEmbedding, QuantFusedLinear, QuantLinear
from tests.engine.gguf_files import bpe_tokenizer, tiny_hf, write_gguf

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# name: (arch, default type, per-tensor types, tiny_hf overrides, the formats kept native and how many of each:
# the projections, and an untied embedding, of the default type)
CASES = {
    # llama.cpp's Q4_K_M mix: Q4_K, with Q6_K for attn_v, ffn_down and the output head; one ffn_up in
    # TQ2_0 (no native form: it falls back to floats, and its gate/up group stays unfused).
    "llama-q4_k_m": ("llama", Q.Q4_K, {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "output": Q.Q6_K,
                                      "blk.1.ffn_up": Q.TQ2_0}, {}, {"Q4_K": 10, "Q6_K": 5}),
    "qwen3-q8_0-tied": ("qwen3", Q.Q8_0, {}, {"tie_word_embeddings": True}, {"Q8_0": 14}),
    "qwen2-q5_k-bias": ("qwen2", Q.Q5_K, {}, {}, {"Q5_K": 16}),
    "llama-q4_1-q4_0-q5_0": ("llama", Q.Q4_1, {"attn_output": Q.Q4_0, "ffn_down": Q.Q5_0, "output": Q.Q8_0}, {},
                             {"Q4_1": 11, "Q4_0": 2, "Q5_0": 2, "Q8_0": 1}),
    "qwen3-q4_k_m-tied": ("qwen3", Q.Q4_K, {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K}, {"tie_word_embeddings": True},
                          {"Q4_K": 10, "Q6_K": 4}),
    # Qwen3.5 (issue #28): 2 Gated DeltaNet layers (in_proj qkv/z/b/a, out_proj, MLP: 8 each) and 2
    # attention layers (7 each), the head. Q8_0 blocks (32 wide) move with the value heads (64 wide)
    # llama.cpp tiled; Q4_K blocks (256) cannot: out_proj reads its input permuted instead.
    "qwen35-q8_0": ("qwen35", Q.Q8_0, {}, {}, {"Q8_0": 32}),
    "qwen35-q4_k_m": ("qwen35", Q.Q4_K, {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "output": Q.Q6_K}, {},
                      {"Q4_K": 25, "Q6_K": 7}),
}
CONFIGS = [EngineConfig(verify="ar"), EngineConfig(verify="chain", block_size=8),
           EngineConfig(verify="ddtree", budget=8, top_k=3, block_size=8)]


def _file(tmp_path, case: str):
    arch, qtype, qtypes, overrides, _ = CASES[case]
    path = tmp_path / f"{case}.gguf"
    write_gguf(path, tiny_hf(arch, **overrides), arch, qtype, tokenizer=bpe_tokenizer(), qtypes=qtypes)
    return str(path)


def _pairs(path: str, dtype: str = "float32"):
    return tuple(engine.load(path, "random", device="cpu", dtype=dtype, weights=w) for w in ("native", "dequantized"))


@pytest.mark.parametrize("case", CASES)
def test_native_decodes_as_its_dequantized_twin(case, tmp_path):
    native, twin = _pairs(_file(tmp_path, case))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (9, 14)]
    reference = engine.bench(twin, CONFIGS[0], prompts, 12, ignore_eos=True).outputs
    for config in CONFIGS:
        got = engine.bench(native, config, prompts, 12, reference=reference, ignore_eos=True)
        assert got.outputs == engine.bench(twin, config, prompts, 12, ignore_eos=True).outputs == reference, config
        assert all(p.exact for p in got.prompts) and got.new_tokens == 24
    assert engine.generate(native, prompts[1], CONFIGS[2], 12, ignore_eos=True).tokens == reference[1]

    summary, twin_summary = native.weight_summary(), twin.weight_summary()
    assert summary["mode"] == "native" and summary["formats"] == CASES[case][4]
    assert twin_summary["native"] == {} and twin_summary["native_bytes"] == 0
    # what a native load keeps, known from either form (the weights dimension's rule: autotune.dimensions)
    assert summary["native_projections"] == twin_summary["native_projections"] == len(summary["native"]) \
        == sum(CASES[case][4].values())
    state = unfused_state_dict(twin.target)
    float_bytes = sum(state[name].numel() * 4 for name in summary["native"])
    assert summary["weight_bytes"] == twin_summary["weight_bytes"] - float_bytes + summary["native_bytes"]
    assert summary["weight_bytes"] < twin_summary["weight_bytes"] * 0.75
    # an untied embedding in its blocks (a lookup dequantizes its rows), a tied one float (the head multiplies by it)
    tied = CASES[case][3].get("tie_word_embeddings", False)
    assert isinstance(native.target.embed_tokens, torch.nn.Embedding if tied else QuantEmbedding)
    held = summary["dequantized"] if tied else summary["native"]
    assert held["embed_tokens.weight"] == CASES[case][1].name
    assert summary["dequantized"]["layers.0.input_layernorm.weight"] == "F32"
    assert set(summary["native"]) | set(summary["dequantized"]) == set(native.target.weight_types)


def test_a_file_of_floats_keeps_no_projection_native(tmp_path):
    """An F16 GGUF (every type a float, none with a block form) loads native as it loads dequantized:
    both forms say so before the other is loaded (``native_projections`` 0)."""
    path = tmp_path / "f16.gguf"
    write_gguf(path, tiny_hf("qwen3"), "qwen3", Q.F16, tokenizer=bpe_tokenizer())
    native, twin = _pairs(str(path))
    for pair in (native, twin):
        summary = pair.weight_summary()
        assert summary["native_projections"] == 0 and summary["native"] == {} and summary["fallback"] == {}
        assert summary["dequantized"]["layers.0.mlp.down_proj.weight"] == "F16"


def test_q4_k_m_fuses_what_shares_a_format_and_keeps_the_rest_apart(tmp_path):
    """The Q4_K_M file's layers: gate/up (both Q4_K) one block tensor; q/k (Q4_K) beside v (Q6_K)
    three layers in their own blocks; layer 1's TQ2_0 up_proj a float, row-invariant Linear beside
    its gate's blocks, listed as the one fallback; the untied head Q6_K."""
    native, _ = _pairs(_file(tmp_path, "llama-q4_k_m"))
    first, second = native.target.layers
    assert isinstance(first.mlp.gate_up_proj, QuantFusedLinear) and first.mlp.gate_up_proj.fmt.name == "Q4_K"
    assert first.mlp.gate_up_proj.blocks.shape == (2 * 512, 144) and first.mlp.gate_up_proj.blocks.is_contiguous()
    attn = first.self_attn
    assert "qkv_proj" not in attn._modules
    assert [attn.q_proj.fmt.name, attn.k_proj.fmt.name, attn.v_proj.fmt.name] == ["Q4_K", "Q4_K", "Q6_K"]
    assert type(second.mlp.up_proj) is Linear and isinstance(second.mlp.gate_proj, QuantLinear)
    assert native.target.lm_head.fmt.name == "Q6_K" and native.target.lm_head.out_features == 300
    summary = native.weight_summary()
    assert summary["fallback"] == {"layers.1.mlp.up_proj.weight": "TQ2_0"}
    assert summary["native"]["layers.0.self_attn.v_proj.weight"] == "Q6_K"
    assert summary["native"]["layers.0.mlp.up_proj.weight"] == "Q4_K"  # a fused part by its own name


def test_an_untied_embedding_in_blocks_holds_the_dequantized_rows(tmp_path):
    """The Q4_K_M file's untied token embedding (Q4_K) stays in its blocks: in bfloat16 its rows are the
    dequantized load's bits, the model's dtype and device are read from it, and a training run's record
    of the target (a sample of the embedding's values) is the dequantized twin's: a draft trained on one
    resumes on the other."""
    from engine.training.checkpoint import target_record

    native, twin = _pairs(_file(tmp_path, "llama-q4_k_m"), "bfloat16")
    embed = native.target.embed_tokens
    assert isinstance(embed, QuantEmbedding) and embed.fmt.name == "Q4_K" and embed.nbytes == 300 * 144
    assert native.target.dtype == torch.bfloat16 and native.target.device.type == "cpu"
    assert torch.equal(embed.dequantized(torch.bfloat16), twin.target.embed_tokens.weight)
    ids = torch.tensor([0, 299, 17, 17])
    assert torch.equal(embed(ids), twin.target.embed_tokens(ids))
    assert target_record(native.target) == target_record(twin.target)


def test_native_bf16_holds_the_dequantized_load_values(tmp_path):
    """In bfloat16 each block layer dequantizes to the bits the dequantized load holds, tied embedding
    and head still one tensor (built on the meta device, then given memory)."""
    native, twin = _pairs(_file(tmp_path, "qwen3-q8_0-tied"), "bfloat16")
    assert native.target.lm_head.weight is native.target.embed_tokens.weight
    assert native.target.inv_freq.dtype == torch.float32
    assert torch.equal(native.target.inv_freq, twin.target.inv_freq)
    layers = {name: m for name, m in native.target.named_modules() if isinstance(m, QuantLinear)}
    twin_modules = dict(twin.target.named_modules())
    assert len(layers) == 2 * 4  # per layer: qkv and gate/up fused, o_proj and down_proj
    for name, layer in layers.items():
        assert torch.equal(layer.dequantized(torch.bfloat16), twin_modules[name].weight), name
    prompt = list(range(3, 15))
    assert engine.generate(native, prompt, CONFIGS[0], 8, ignore_eos=True).tokens == \
        engine.generate(twin, prompt, CONFIGS[0], 8, ignore_eos=True).tokens


def test_native_refuses_a_bad_mode_a_float_target_and_nan_scales(tmp_path):
    with pytest.raises(EngineInputError, match=r"weights must be one of \['dequantized', 'native'\], but got 'q4'"):
        engine.load("tiny-dense", "none", device="cpu", weights="q4")
    with pytest.raises(EngineInputError, match=r"weights='native' keeps a GGUF file's quantized blocks, but target "
                                               r"'tiny-dense' is not read from one"):
        engine.load("tiny-dense", "none", device="cpu", weights="native")
    path = tmp_path / "nan.gguf"
    write_gguf(path, tiny_hf("qwen3"), "qwen3", Q.Q8_0, tokenizer=bpe_tokenizer())
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == "blk.1.attn_k.weight")
    data = bytearray(path.read_bytes())
    offset = int(t.data_offset) + 34 * 5  # the sixth block's scale
    data[offset : offset + 2] = np.array([np.inf], np.float16).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(EngineInputError, match=r"nan.gguf: tensor 'blk.1.attn_k.weight' \(Q8_0\) holds 1 NaN or "
                                               r"inf block scales in 2,048 blocks: the weights are corrupt"):
        engine.load(str(path), "none", device="cpu", weights="native")
    with pytest.raises(EngineInputError, match=r"'layers.1.self_attn.k_proj.weight' holds 32 non-finite values"):
        engine.load(str(path), "none", device="cpu", weights="dequantized")
