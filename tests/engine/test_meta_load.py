"""A pair of shapes only (``engine.load(..., device="meta")``, what ``autotune plan`` plans on): its
``plan_memory`` equals a loaded pair's byte for byte, every part, for AR and speculative configs
(presets, GGUF files of one format, of mixed formats, a hybrid, native or dequantized, an HF
folder and a DFlash checkpoint folder, the packaged SmolLM2 pair), with no tensor data read; it
refuses what a load refuses by shape, and refuses to decode."""

from __future__ import annotations

import pytest
import torch

import engine
from engine import EngineConfig, EngineInputError
from engine.memory import plan_memory, reserve_memory
from tests.engine.gguf_files import headers_only

CONFIGS = [  # (config, a prompt has a grammar)
    (EngineConfig(verify="ar"), False),
    (EngineConfig(verify="ddtree", draft_path="runtime", budget=12, top_k=4), False),
    (EngineConfig(verify="ddtree", draft_path="runtime", budget=5, top_k=2, grammar="commit"), True),
    (EngineConfig(verify="chain", draft_path="generic", block_size=8, rollback="replay"), False),
]


def _assert_plans_equal(meta: engine.Pair, real: engine.Pair) -> None:
    """Every config's plan (for the CPU and for CUDA, as ``autotune plan`` asks) and the weights'
    summary of the meta pair equal the loaded pair's; the meta pair holds no memory."""
    assert real.target.device.type == "cpu" and meta.device == "meta"
    held = [*meta.target.parameters(), *meta.target.buffers()]
    if meta.drafter is not None and hasattr(meta.drafter, "draft"):
        held += [*meta.drafter.draft.parameters(), *meta.drafter.draft.buffers()]
    assert held and all(t.is_meta for t in held)
    for cfg, constrained in CONFIGS:
        for device in ("cpu", "cuda"):
            want = plan_memory(real, cfg, 40, 12, device=device, constrained=constrained)
            got = plan_memory(meta, cfg, 40, 12, device=device, constrained=constrained)
            assert got.to_dict() == want.to_dict(), (cfg, device)
            assert want.parts["target_weights"] > 0 and want.parts["draft_weights"] > 0 and want.total > 0
    assert meta.weight_summary() == real.weight_summary()


def _pairs(target: str, draft: str, dtype: str, weights: str = "dequantized") -> tuple[engine.Pair, engine.Pair]:
    return tuple(engine.load(target, draft, device=d, dtype=dtype, weights=weights) for d in ("meta", "cpu"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_a_preset_plans_on_the_meta_device_as_loaded(target, dtype):
    _assert_plans_equal(*_pairs(target, "random", dtype))


# --------------------------------------------------------------------------------------------- GGUF
@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """Tiny GGUF targets: one format (Q8_0, tied), llama.cpp's Q4_K_M mix on llama (rows permuted, a
    TQ2_0 projection with no native form), and on the Qwen3.5 hybrid (out_proj's input reordered)."""
    pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")
    from tests.engine.gguf_files import bpe_tokenizer, tiny_hf, write_gguf

    Q = gguf.GGMLQuantizationType
    q4_k_m = {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "output": Q.Q6_K}
    cases = {"qwen3-q8_0-tied": ("qwen3", Q.Q8_0, {}, {"tie_word_embeddings": True}),
             "llama-q4_k_m": ("llama", Q.Q4_K, {**q4_k_m, "blk.1.ffn_up": Q.TQ2_0}, {}),
             "qwen35-q4_k_m": ("qwen35", Q.Q4_K, q4_k_m, {})}
    folder, tok = tmp_path_factory.mktemp("gguf"), bpe_tokenizer()
    files = {}
    for name, (arch, qtype, qtypes, overrides) in cases.items():
        files[name] = str(folder / f"{name}.gguf")
        write_gguf(files[name], tiny_hf(arch, **overrides), arch, qtype, tokenizer=tok, qtypes=qtypes)
    return files


@pytest.mark.parametrize("weights", ["native", "dequantized"])
@pytest.mark.parametrize("case", ["qwen3-q8_0-tied", "llama-q4_k_m", "qwen35-q4_k_m"])
def test_a_gguf_target_plans_from_its_header_as_loaded(gguf_files, case, weights, monkeypatch):
    real = engine.load(gguf_files[case], "random", device="cpu", dtype="bfloat16", weights=weights)
    with monkeypatch.context() as patched:
        headers_only(patched)  # for the meta load alone
        meta = engine.load(gguf_files[case], "random", device="meta", dtype="bfloat16", weights=weights)
    _assert_plans_equal(meta, real)
    if weights == "native":  # blocks at a real load's bytes, as uint8, in the same formats
        blocks = {n: (tuple(b.shape), b.dtype) for n, b in meta.target.named_buffers() if n.endswith("blocks")}
        assert blocks and blocks == {n: (tuple(b.shape), b.dtype) for n, b in real.target.named_buffers()
                                     if n.endswith("blocks")}
        assert meta.weight_summary()["native_bytes"] == real.weight_summary()["native_bytes"] > 0
    assert meta.encode("the sea of day") == real.encode("the sea of day")  # the tokenizer loads as ever


def test_the_reader_patch_catches_a_real_load(gguf_files, monkeypatch):
    headers_only(monkeypatch)
    # (the loader names a tensor it cannot read: the failed read inside its refusal)
    with pytest.raises(EngineInputError, match="its data was read"):
        engine.load(gguf_files["qwen3-q8_0-tied"], "none", device="cpu", dtype="float32", weights="native")


# --------------------------------------------------------------------------- HF folders, DFlash drafts
def _hf_folders(tmp_path):
    """A sharded llama folder and a tied Qwen3.5 folder, each with a DFlash checkpoint folder shaped for it."""
    transformers = pytest.importorskip("transformers")
    from engine.loading import load_target_folder, save_draft_folder
    from engine.registry import random_draft_for

    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    models = {"llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=3, **common)),
              "qwen35": transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
                  num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=True, **common))}
    out = {}
    for name, hf in models.items():
        target, draft = tmp_path / name, tmp_path / f"{name}-dflash"
        hf.save_pretrained(target, max_shard_size="40KB" if name == "llama" else "5GB")
        save_draft_folder(random_draft_for(load_target_folder(target, "cpu", torch.float32), None, num_layers=2),
                          draft)
        out[name] = (str(target), str(draft))
    return out


def test_hf_folders_plan_from_their_headers_as_loaded(tmp_path, monkeypatch):
    pytest.importorskip("gguf")  # (the reader patch imports it)
    for target, draft in _hf_folders(tmp_path).values():
        real = engine.load(target, draft, device="cpu", dtype="bfloat16")
        with monkeypatch.context() as patched:
            headers_only(patched)
            meta = engine.load(target, draft, device="meta", dtype="bfloat16")
        _assert_plans_equal(meta, real)


def test_a_meta_load_refuses_what_a_load_refuses_by_shape(tmp_path):
    import json

    target, draft = _hf_folders(tmp_path)["llama"]
    config = tmp_path / "llama" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "intermediate_size": 96}))
    with pytest.raises(EngineInputError, match=r"'layers.0.mlp.gate_proj.weight' has shape \[128, 64\], "
                                               r"but the model expects \[96, 64\]"):
        engine.load(target, "none", device="meta")
    with pytest.raises(EngineInputError, match="weights='native' keeps a GGUF file's quantized blocks"):
        engine.load("tiny-dense", "none", device="meta", weights="native")


# ------------------------------------------------------------------------------ what a meta pair is
def test_the_shape_presets_plan_on_the_meta_device_anywhere():
    pair = engine.load("qwen35-27b-shape", "qwen35-27b-shape-dflash", device="meta", dtype="bfloat16")
    params = sum(p.numel() for p in pair.target.parameters())
    assert 26e9 < params < 28e9 and all(p.is_meta for p in pair.target.parameters())
    plan = plan_memory(pair, EngineConfig(budget=22), 32768 - 256, 256, device="cuda")
    assert plan.parts["target_weights"] == 2 * params + pair.target.inv_freq.numel() * 4
    assert plan.parts["draft_weights"] > 0 and plan.loop == "graphs"


@pytest.mark.parametrize("base", ["qwen3-8b-shape", "qwen35-27b-shape"])
def test_the_quantized_shape_presets_plan_their_q4_k_m_bytes_on_the_meta_device(base):
    """``<shape>-q4_k_m`` held native plans, with nothing allocated, its float shape's tensors with each
    projection at the bytes of the blocks llama.cpp's Q4_K_M gives it (counted here from the float
    shape's projections and ``q4_k_m_format``), its untied embedding at Q4_K's: about 4.8 bits a weight;
    held dequantized, the float shape's bytes."""
    from torch import nn

    from engine.models.quant import FORMATS, QuantEmbedding
    from engine.models.quantize import q4_k_m_format
    from engine.registry import TARGETS

    pair = engine.load(f"{base}-q4_k_m", f"{base}-dflash", device="meta", dtype="bfloat16", weights="native")
    assert all(t.is_meta for t in [*pair.target.parameters(), *pair.target.buffers()])
    floats, _ = TARGETS[base].build_on(torch.device("meta"), torch.bfloat16)
    linears = {name: m for name, m in floats.named_modules() if isinstance(m, nn.Linear)}
    v = [name for name in linears if name.endswith(".v_proj")]
    blocks = 0
    for name, m in linears.items():
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        fmt = FORMATS[q4_k_m_format(name, layer, floats.cfg.num_hidden_layers, v.index(name) if name in v else None,
                                    len(v))]
        assert m.in_features % 256 == 0 and fmt.name in ("Q4_K", "Q6_K")  # no fallback at these widths
        blocks += m.out_features * m.in_features // fmt.values * fmt.nbytes
    embed = floats.embed_tokens
    assert floats.lm_head.weight is not embed.weight and isinstance(pair.target.embed_tokens, QuantEmbedding)
    blocks += embed.weight.numel() // 256 * 144
    linears["embed_tokens"] = embed
    rest = sum(p.numel() for name, p in floats.named_parameters() if name.rpartition(".")[0] not in linears)
    plan = plan_memory(pair, EngineConfig(budget=22), 32768 - 256, 256, device="cuda")
    assert plan.parts["target_weights"] == blocks + 2 * rest + 4 * floats.inv_freq.numel()
    assert pair.weight_summary()["native_bytes"] == blocks
    assert 4.75 < 8 * blocks / sum(m.weight.numel() for m in linears.values()) < 4.95
    float_pair = engine.load(base, f"{base}-dflash", device="meta", dtype="bfloat16")
    held_floats = engine.load(f"{base}-q4_k_m", f"{base}-dflash", device="meta", dtype="bfloat16")
    want = plan_memory(float_pair, EngineConfig(budget=22), 4096, 256, device="cuda").parts
    assert plan_memory(held_floats, EngineConfig(budget=22), 4096, 256, device="cuda").parts["target_weights"] == \
        want["target_weights"] and plan.parts["draft_weights"] == want["draft_weights"]


def test_a_meta_pair_refuses_to_decode():
    pair = engine.load("tiny-dense", "random", device="meta")
    for call in (lambda: engine.generate(pair, [5, 6, 7], EngineConfig(verify="ar"), 4),
                 lambda: engine.bench(pair, EngineConfig(), [[5, 6, 7]], 4),
                 lambda: reserve_memory(pair, EngineConfig(), 3, 4)):
        with pytest.raises(EngineInputError, match="is on the meta device .*holds no weights to decode with"):
            call()


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["native", "dequantized"])
def test_the_smollm2_pair_plans_on_the_meta_device_as_loaded(weights, monkeypatch):
    from engine.data.assets import default_cache_dir, is_cached, resolve_spec

    if not is_cached(resolve_spec("smollm2"), default_cache_dir()):
        pytest.skip("the SmolLM2 asset is not fetched here (a real load would fetch it)")
    pytest.importorskip("gguf")
    real = engine.load("smollm2-135m-instruct", "smollm2-135m-dflash", device="cpu", dtype="float32",
                       weights=weights)
    with monkeypatch.context() as patched:
        headers_only(patched)
        meta = engine.load("smollm2-135m-instruct", "smollm2-135m-dflash", device="meta", dtype="float32",
                           weights=weights)
    _assert_plans_equal(meta, real)
