"""Float weights into GGUF blocks (``engine.models.quantize``): the 32-value formats as gguf's reference
quantizers write them, the K formats decoded by gguf's reference to what ``quant.dequantize`` gives and
closer to the weights than a min/max quantizer, requantization stable; ``quantize_model_`` gives a model
llama.cpp's Q4_K_M mix and leaves it computing what its blocks hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from engine.models.common import FusedLinear, Linear, fuse_projections_
from engine.models.dense import DenseConfig, DenseModel
from engine.models.quant import FORMATS, QuantEmbedding, QuantFusedLinear, QuantLinear, dequantize, weights_summary
from engine.models.quantize import FALLBACK, more_bits, quantize, quantize_model_
from engine.registry import init_random_
from tests.engine.gguf_files import quantize as minmax_quantize

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def _weights(rows: int = 96, cols: int = 1024, seed: int = 0) -> torch.Tensor:
    """Gaussian weights with a few outlier columns, a zero block, a constant one and a tiny one."""
    x = 0.02 * torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    x[:, :7] *= 20
    x[1, :256] = 0
    x[2, :256] = 0.5
    x[3, :256] *= 1e-12
    return x


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_the_32_value_formats_are_ggufs_reference_quantizers_bit_for_bit(name):
    x = _weights()
    assert np.array_equal(quantize(x, FORMATS[name]).numpy(), gguf.quants.quantize(x.numpy(), Q[name]))


# Relative RMS error on Gaussian weights with outliers (measured 0.087, 0.049, 0.022; llama.cpp's own
# are of this size): a bound the search must keep, well under the min/max quantizer's
K_ERROR = {"Q4_K": 0.095, "Q5_K": 0.055, "Q6_K": 0.025}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_the_k_formats_search_beats_min_max_and_decode_as_ggufs_reference(name):
    fmt = FORMATS[name]
    x = _weights()
    blocks = quantize(x, fmt)
    y = dequantize(blocks, fmt, x.shape[1])
    assert np.array_equal(gguf.quants.dequantize(blocks.numpy(), Q[name]), y.numpy())  # the layout gguf reads
    err = _rel(y, x)
    minmax = _rel(torch.from_numpy(gguf.quants.dequantize(minmax_quantize(x.numpy(), Q[name]), Q[name])), x)
    assert 0 < err < K_ERROR[name] and err < 0.95 * minmax, (err, minmax)
    assert torch.equal(y[1, :256], torch.zeros(256))  # a zero block stays zero
    assert _rel(y[2, :256], x[2, :256]) < 1e-3  # a constant one: its value, near enough


@pytest.mark.parametrize("name", list(FORMATS))
def test_requantizing_the_dequantized_weight_is_stable(name):
    """Quantize -> dequantize -> quantize: the 32-value formats land on the same values (their grid holds
    them exactly); the K formats' search may pick another scale for a sub-block, within a fraction of the
    first rounding's error (measured 11-22%)."""
    fmt = FORMATS[name]
    x = _weights(seed=1)
    y = dequantize(quantize(x, fmt), fmt, x.shape[1])
    again = dequantize(quantize(y, fmt), fmt, x.shape[1])
    if fmt.values == 32:
        assert torch.equal(again, y)
    else:
        assert _rel(again, y) < 0.3 * _rel(y, x)


def test_bad_weights_are_refused_with_the_rule():
    with pytest.raises(ValueError, match="Q4_K quantizes rows of whole 256-value blocks, but the weight has 96 col"):
        quantize(torch.zeros(2, 96), FORMATS["Q4_K"])
    w = torch.zeros(2, 64)
    w[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize(w, FORMATS["Q8_0"])


def test_more_bits_is_llamacpps_layer_choice():
    assert [i for i in range(8) if more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(16) if more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]


def _model(hidden: int, intermediate: int, layers: int, tied: bool = False) -> DenseModel:
    cfg = DenseConfig(vocab_size=320, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, intermediate_size=intermediate, qk_norm=True, arch="qwen3",
                      tie_word_embeddings=tied)
    model = DenseModel(cfg)
    init_random_(model, 3)
    return fuse_projections_(model.eval().requires_grad_(False))


def _logits(model: DenseModel, ids: torch.Tensor) -> torch.Tensor:
    """A prefill's logits [T, V] (a fresh cache)."""
    return model(ids, model.new_cache(ids.numel()), 0)[0]


def _float_twin(model: nn.Module, dtype: torch.dtype = torch.float32) -> None:
    """Each quantized projection back as floats in ``dtype``: its dequantized values (what a dequantized
    load holds), in the same place and grouping, on the row-invariant float layers (``Linear``,
    ``FusedLinear``), so that each product runs on the same plan as its blocks did."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, QuantFusedLinear):
                group = FusedLinear([nn.Linear(child.in_features, s, bias=False, device="meta") for s in child.sizes])
                group.weight = nn.Parameter(child.dequantized(dtype), requires_grad=False)
                setattr(module, name, group)
            elif isinstance(child, QuantLinear):
                linear = Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                linear.weight = nn.Parameter(child.dequantized(dtype), requires_grad=False)
                linear.bias = child.bias
                setattr(module, name, linear)
            elif isinstance(child, QuantEmbedding):
                embed = nn.Embedding(child.num_embeddings, child.embedding_dim, device="meta")
                embed.weight = nn.Parameter(child.dequantized(dtype), requires_grad=False)
                setattr(module, name, embed)


def test_quantize_model_gives_llamacpps_q4_k_m_mix_and_computes_what_its_blocks_hold():
    """8 layers of a 256-wide model: Q6_K for the head and for v_proj and down_proj on layers 0, 3, 6, 7
    (``more_bits``), Q4_K elsewhere, the untied embedding included (a ``QuantEmbedding``); a q/k/v group
    with a Q6_K v is left as its parts, the others and gate/up stay fused. Its logits are its dequantized
    twin's, and near the float model's."""
    model = _model(256, 512, 8)
    ids = torch.randint(0, 320, (12,), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    formats = quantize_model_(model)
    six = {f"layers.{i}.{p}.weight" for i in (0, 3, 6, 7) for p in ("self_attn.v_proj", "mlp.down_proj")}
    assert {n for n, f in formats.items() if f == "Q6_K"} == six | {"lm_head.weight"}
    assert set(formats.values()) == {"Q4_K", "Q6_K"} and len(formats) == 8 * 7 + 2
    assert formats["embed_tokens.weight"] == "Q4_K" and isinstance(model.embed_tokens, QuantEmbedding)
    attn, mlp = model.layers[0].self_attn, model.layers[1].mlp
    assert "qkv_proj" not in attn._modules and attn.v_proj.fmt.name == "Q6_K" and attn.q_proj.fmt.name == "Q4_K"
    assert isinstance(model.layers[1].self_attn.qkv_proj, QuantFusedLinear)
    assert isinstance(mlp.gate_up_proj, QuantFusedLinear) and mlp.down_proj.fmt.name == "Q4_K"
    assert not any(type(m) in (nn.Linear, Linear, FusedLinear) for m in model.modules())
    summary = weights_summary(model, "native")
    assert summary["native"] == formats and summary["formats"] == {"Q4_K": 49, "Q6_K": 9}
    after = _logits(model, ids)
    _float_twin(model)
    assert torch.allclose(after, _logits(model, ids), rtol=0, atol=1e-4)
    # quantized: near the float model (4-bit noise through 8 random layers: 0.19), not equal to it
    assert _rel(after, before) < 0.3
    assert _rel(after, before) > 0


def test_quantize_model_q8_0_gives_every_projection_q8_0():
    """The ``q8_0`` recipe (a DFlash draft's ``@q8_0``): every projection and the untied embedding Q8_0, the
    groups fused in blocks; logits its dequantized twin's, and nearer the float model's than Q4_K_M's."""
    model = _model(256, 512, 2)
    ids = torch.randint(0, 320, (12,), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    formats = quantize_model_(model, "q8_0")
    assert set(formats.values()) == {"Q8_0"} and len(formats) == 2 * 7 + 2
    assert isinstance(model.layers[0].self_attn.qkv_proj, QuantFusedLinear)
    after = _logits(model, ids)
    _float_twin(model)
    assert torch.allclose(after, _logits(model, ids), rtol=0, atol=1e-4)
    assert 0 < _rel(after, before) < 0.02  # 8-bit noise through 2 random layers


def test_widths_that_are_not_whole_k_blocks_take_llamacpps_fallbacks():
    """A 64-wide model (tied head): Q4_K falls back to Q5_0 and Q6_K to Q8_0 (rows of 64 values are not
    whole 256-value blocks); the head gets its own blocks, the embedding keeps its floats; a width that is
    not whole 32-value blocks stays float."""
    model = _model(64, 160, 2, tied=True)
    formats = quantize_model_(model)
    assert formats["lm_head.weight"] == FALLBACK["Q6_K"] == "Q8_0"
    # of 2 layers more_bits picks the last (7 * 2 // 8 = 1)
    assert formats["layers.0.mlp.down_proj.weight"] == "Q5_0" and formats["layers.1.mlp.down_proj.weight"] == "Q8_0"
    assert formats["layers.0.self_attn.q_proj.weight"] == FALLBACK["Q4_K"] == "Q5_0"
    assert isinstance(model.layers[0].self_attn.qkv_proj, QuantFusedLinear)  # q, k, v all Q5_0: one group
    assert isinstance(model.embed_tokens, nn.Embedding) and model.embed_tokens.weight.dtype == torch.float32
    odd = nn.Sequential(nn.Linear(48, 8))
    assert quantize_model_(odd) == {} and type(odd[0]) is nn.Linear
    with pytest.raises(ValueError, match="unknown quantization recipe 'q2_k'"):
        quantize_model_(odd, "q2_k")


def test_a_quantized_hybrid_target_decodes_and_speculation_equals_ar():
    """A loaded tiny hybrid pair (Gated DeltaNet and attention layers, fused groups) quantized in place:
    its groups become blocks (the GDN's four input projections one ``QuantFusedLinear``), and DDTree and
    chain commit AR's tokens (float32 on the CPU: the PyTorch form)."""
    import engine
    from engine import EngineConfig

    pair = engine.load("tiny-hybrid", "oracle:0.3", device="cpu", dtype="float32")
    formats = quantize_model_(pair.target)
    assert formats and set(formats.values()) <= {"Q5_0", "Q8_0"}  # 64-wide rows: the 32-value fallbacks
    assert isinstance(pair.target.layers[0].linear_attn.in_proj, QuantFusedLinear)
    ids = pair.encode("Hello there")
    ar = engine.generate(pair, ids, EngineConfig(verify="ar"), 24, ignore_eos=True).tokens
    for cfg in (EngineConfig(verify="chain"), EngineConfig(verify="ddtree", budget=8, top_k=3)):
        gen = engine.generate(pair, ids, cfg, 24, ignore_eos=True)
        assert gen.tokens == ar and gen.stats.acceptance_length > 1.0, cfg


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the shape presets are built on a GPU")
def test_on_the_gpu_a_quantized_preset_decodes_its_twins_tokens_and_speculation_equals_ar():
    """SmolLM2-135M's shapes with random weights, quantized in memory (its 576-wide rows: Q5_0 and Q8_0;
    the down projections' 1536: Q4_K and Q6_K), in bf16 through the in-register kernel: chain and DDTree
    equal AR token for token, and AR equals AR of the dequantized twin (the same values on the dense
    kernel, each projection on the same plan)."""
    import engine
    from engine import EngineConfig

    pair = engine.load("smollm2-135m-shape", "random", device="cuda", dtype="bfloat16")
    formats = quantize_model_(pair.target)
    assert set(formats.values()) == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    prompts = [list(range(10 + i, 40 + i)) for i in range(3)]
    ar = EngineConfig(verify="ar")
    ref = engine.bench(pair, ar, prompts, 48, ignore_eos=True)
    for cfg in (EngineConfig(verify="chain"), EngineConfig(verify="ddtree", budget=16, top_k=4),
                EngineConfig(verify="ddtree", budget=64, top_k=8)):
        res = engine.bench(pair, cfg, prompts, 48, reference=ref.outputs, ignore_eos=True, ar_config=ar)
        assert res.exact_match == 1.0, cfg
    _float_twin(pair.target, torch.bfloat16)
    pair._workspace = pair._runtime_decoder = None  # new buffers, new graphs: those captured launched the blocks
    assert engine.bench(pair, ar, prompts, 48, ignore_eos=True).outputs == ref.outputs


def test_a_q4_k_m_hybrids_decode_step_takes_the_kernel_for_every_projection(monkeypatch):
    """Issue #28's 27B Q4_K_M AR ran far under its roofline: no projection of a step may dequantize its
    weight per call on the GPU. A Qwen3.5-like hybrid of 256-wide rows (Q4_K, Q6_K for the head and
    llama.cpp's down/v share) in bf16, quantized as the registry's presets are, decodes with the kernel
    dispatch's CUDA rule applied on the CPU (the kernel itself: ``test_quant_kernel.py``): every AR step
    launches each projection in blocks once at 1 row (the Q6_K head, the GDN's fused inputs, a mixed q/k/v
    group's parts) and nothing is dequantized per call; the tokens equal the PyTorch form's."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    import engine
    from engine import EngineConfig, registry
    from engine.data.tokenizer import ByteTokenizer
    from engine.models import quant, quant_embedding, quant_kernel
    from engine.models.hybrid import HybridModel
    from engine.models.hybrid_config import HybridConfig

    cfg = HybridConfig(vocab_size=300, hidden_size=256, num_hidden_layers=4, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=128, intermediate_size=512, full_attention_interval=2,
                       linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=64,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4, partial_rotary_factor=0.25)
    base = registry.TargetPreset("q-hybrid", "test", lambda device=registry.CPU: (
        registry._random(lambda: HybridModel(cfg), 5, device), ByteTokenizer(300)))
    monkeypatch.setitem(registry.TARGETS, "q-hybrid", base)
    monkeypatch.setitem(registry.TARGETS, "q-hybrid-q4_k_m", registry.quantized_preset("q-hybrid", "test"))
    pair = engine.load("q-hybrid-q4_k_m", "none", device="cpu", dtype="bfloat16", weights="native")
    layers = {(m.fmt.name, m.out_features, m.in_features) for m in pair.target.modules() if isinstance(m, QuantLinear)}
    assert {f for f, _, _ in layers} == {"Q4_K", "Q6_K"} and ("Q6_K", 300, 256) in layers
    ids, ar = list(range(10, 30)), EngineConfig(verify="ar", draft_path="runtime")
    eager = engine.generate(pair, ids, ar, 6, ignore_eos=True).tokens

    launches, per_call, dequantize = [], [], quant.dequantize

    def kernel(x, blocks, fmt, cols, bias=None):  # the kernel's values (test_quant_kernel): the blocks' own
        launches.append((fmt.name, blocks.shape[0], cols, x.numel() // cols))
        return F.linear(x, dequantize(quant.unhold(blocks, fmt), fmt, cols, x.dtype), bias)

    on_cuda = SimpleNamespace(use_kernels=lambda *tensors: True)  # as on CUDA (the embedding: its kernel, interpreted)
    monkeypatch.setattr(quant_kernel, "fused", on_cuda)
    monkeypatch.setattr(quant_embedding, "fused", on_cuda)
    monkeypatch.setattr(quant_kernel, "linear", kernel)
    monkeypatch.setattr(quant, "dequantize", lambda *a, **kw: per_call.append(a[1].name) or dequantize(*a, **kw))
    gen = engine.generate(pair, ids, ar, 6, ignore_eos=True)
    assert gen.tokens == eager and not per_call
    steps = [launch[:3] for launch in launches if launch[3] == 1]  # (and the prefill's head on its last row)
    held = len([m for m in pair.target.modules() if isinstance(m, QuantLinear)])
    assert len(steps) == gen.stats.steps * held + 1 and set(steps) == layers
