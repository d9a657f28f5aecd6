"""Checkpoint loading: parity with transformers for HF folders and GGUF files, DFlash draft round trip,
and clear errors for every malformed input."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineInputError
from engine.gguf_loading import load_target_gguf
from engine.loading import load_draft_folder, load_target_folder, save_draft_folder
from engine.models.dense import DenseConfig, DenseModel
from engine.models.draft import DFlashConfig, DFlashDraft
from engine.models.quant import QuantLinear
from engine.registry import init_random_
from tests.engine.gguf_files import write_gguf

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

VOCAB, HIDDEN = 300, 64
PROMPT = torch.tensor([5, 17, 42, 99, 3, 250, 7, 61, 128, 33, 201, 8, 77, 140, 19, 2])


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny matrices: thread hand-offs cost more than they save, worst on a shared CPU.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------ tiny HF targets

def _hf_model(kind: str, seed: int = 0, **overrides):
    """A seeded tiny transformers model; norms and biases perturbed so a swapped name shows up."""
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)  # no eos: generate runs 16 steps
    common.update(overrides)
    cls, cfg_cls = {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
        "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
    }[kind]
    torch.manual_seed(seed)
    model = cls(cfg_cls(**common)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    return model


def _greedy_ours(model, prompt: torch.Tensor, n: int) -> list[int]:
    cache = model.new_cache(len(prompt) + n)
    logits, _ = model.forward(prompt, cache, 0)
    out = [int(logits[-1].argmax())]
    for _ in range(n - 1):
        logits, _ = model.forward(torch.tensor(out[-1:]), cache, cache.length)
        out.append(int(logits[-1].argmax()))
    return out


def _assert_parity(hf, ours, n_new: int = 16, exact_greedy: bool = True, rel: float = 1e-4) -> float:
    with torch.no_grad():
        want = hf(PROMPT[None]).logits[0]
        got, _ = ours.forward(PROMPT, ours.new_cache(len(PROMPT)), 0)
    err = float((got - want).abs().max() / want.abs().max())
    assert err < rel, f"relative logit error {err:.2e} >= {rel}"
    if exact_greedy:
        with torch.no_grad():
            hf_tokens = hf.generate(PROMPT[None], max_new_tokens=n_new, do_sample=False)[0, len(PROMPT):]
            assert _greedy_ours(ours, PROMPT, n_new) == hf_tokens.tolist()
    return err


CASES = {
    "llama-gqa": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 8}}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qknorm-headdim": ("qwen3", {"head_dim": 32}),  # head_dim != hidden / heads
}


@pytest.mark.parametrize("case", CASES)
def test_hf_folder_matches_transformers(case, tmp_path):
    kind, overrides = CASES[case]
    hf = _hf_model(kind, **overrides)
    hf.save_pretrained(tmp_path)
    names = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in names) == (not overrides.get("tie_word_embeddings", False))
    ours = load_target_folder(tmp_path, "cpu", torch.float32)
    assert isinstance(ours, DenseModel) and not ours.training
    assert not any(p.requires_grad for p in ours.parameters())
    assert ours.cfg.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    _assert_parity(hf, ours)


def test_sharded_folder_and_bf16_cast(tmp_path):
    hf = _hf_model("llama", seed=1)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    _assert_parity(hf, load_target_folder(tmp_path, "cpu", torch.float32))
    low = load_target_folder(tmp_path, "cpu", torch.bfloat16)
    assert low.embed_tokens.weight.dtype == torch.bfloat16
    assert low.inv_freq.dtype == torch.float32  # RoPE frequencies stay exact
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(EngineInputError, match=rf"index.json: shard file\(s\) \['{shard.name}'\]"):
        load_target_folder(tmp_path, "cpu", torch.float32)


@pytest.mark.skipif(importlib.util.find_spec("engine.models.hybrid") is None, reason="no hybrid model yet")
def test_qwen3_5_folder_loads(tmp_path):
    from engine.models.hybrid import HybridModel

    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        initializer_range=0.1, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    ours = load_target_folder(tmp_path, "cpu", torch.float32)
    assert isinstance(ours, HybridModel) and ours.lm_head.weight is ours.embed_tokens.weight
    _assert_parity(hf, ours)


# ------------------------------------------------------------------------------------------ GGUF

GGUF_CASES = {
    "llama-f32": ("llama", "F32", {}),
    "llama-tied-f32": ("llama", "F32", {"tie_word_embeddings": True}),
    "llama3-rope-freqs-f32": ("llama", "F32", CASES["llama3-rope"][1]),
    "qwen3-f32": ("qwen3", "F32", {"head_dim": 32}),
    "llama-q8_0": ("llama", "Q8_0", {}),
    "llama-bf16": ("llama", "BF16", {}),
    "llama-f16": ("llama", "F16", {}),
    "llama-q4_0": ("llama", "Q4_0", {}),
    "llama-q4_1": ("llama", "Q4_1", {}),
}


@pytest.mark.parametrize("case", GGUF_CASES)
def test_gguf_matches_transformers(case, tmp_path):
    arch, qname, overrides = GGUF_CASES[case]
    hf = _hf_model(arch, seed=2, **overrides)
    path = tmp_path / "model.gguf"
    write_gguf(path, hf, arch, gguf.GGMLQuantizationType[qname])
    ours, meta = load_target_gguf(path, "cpu", torch.float32)
    assert isinstance(ours, DenseModel) and not ours.training
    assert ours.cfg.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    assert meta["general.architecture"] == arch and meta[f"{arch}.block_count"] == 3
    assert meta["tokenizer.ggml.tokens"][:2] == ["t0", "t1"] and len(meta["tokenizer.ggml.tokens"]) == VOCAB
    json.dumps(meta)  # plain Python values only
    # Quantisation is per row and llama.cpp's permutation moves whole rows, so they commute: the
    # reference is the transformers model with each matrix quantised and dequantised in place.
    qtype = gguf.GGMLQuantizationType[qname]
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 2 and qname != "F32":
                rounded = gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), qtype), qtype)
                p.copy_(torch.from_numpy(rounded))
    _assert_parity(hf, ours)


def test_gguf_bad_inputs(tmp_path):
    with pytest.raises(EngineInputError, match="nope.gguf does not exist"):
        load_target_gguf(tmp_path / "nope.gguf", "cpu", torch.float32)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(EngineInputError, match="junk.gguf: not a readable GGUF"):
        load_target_gguf(junk, "cpu", torch.float32)
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(EngineInputError, match=r"general.architecture 'gpt2' is not supported.*llama"):
        load_target_gguf(tmp_path / "gpt2.gguf", "cpu", torch.float32)


def _mutations(data: bytes, seed: int, n: int, header: int) -> list[tuple[str, bytes]]:
    """Corrupt copies of a checkpoint file: cut short, a byte flipped within its first ``header``
    bytes, and (for GGUF's tensor and key counts at bytes 8..24) counts grown."""
    rng = np.random.default_rng(seed)
    out = [(f"cut at {k}", data[:k]) for k in sorted(set(rng.integers(0, len(data), n).tolist()))]
    for k in rng.integers(0, min(header, len(data)), n).tolist():
        b = bytearray(data)
        b[k] ^= 1 << int(rng.integers(0, 8))
        out.append((f"bit flipped at {k}", bytes(b)))
    return out


def _loads_or_refuses(load, path, what: str) -> bool:
    """``load(path)`` either loads finite weights or raises EngineInputError naming the file; True if loaded."""
    try:
        model = load(path)
    except EngineInputError as exc:
        assert str(path.name) in str(exc) or str(path.parent.name) in str(exc), (what, str(exc)[:300])
        assert len(str(exc)) < 2000, (what, len(str(exc)))
        return False
    model = model[0] if isinstance(model, tuple) else model
    assert all(bool(torch.isfinite(t).all()) for t in model.state_dict().values() if t.is_floating_point()), what
    blocks = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert all(bool(torch.isfinite(m.dequantized()).all()) for m in blocks), what
    return True


@pytest.mark.parametrize("weights", ["dequantized", "native"])
def test_corrupt_gguf_files_load_or_are_refused_never_a_traceback_nor_nan(tmp_path, weights):
    """Issue #23: truncated, bit-flipped and grown-count GGUF files: a clear refusal or a model of
    finite weights, never another exception and never NaN decoded silently; the same with the
    projections kept in their blocks (issue #28: each block layer's values finite too)."""
    good = tmp_path / "good.gguf"
    write_gguf(good, _hf_model("llama", seed=3), "llama", gguf.GGMLQuantizationType.Q8_0)
    data = good.read_bytes()
    cases = _mutations(data, seed=0, n=12, header=2048)
    for field in (8, 16):  # tensor count, key count: grown far past the file
        b = bytearray(data)
        b[field : field + 8] = (2**40).to_bytes(8, "little")
        cases.append((f"count at {field} grown", bytes(b)))
    nan = bytearray(data)
    nan[-64:] = np.full(16, np.nan, np.float32).tobytes()  # the last tensor's data (F32 norms) made NaN
    cases.append(("NaN weights", bytes(nan)))
    refused = 0
    for what, blob in cases:
        path = tmp_path / "bad.gguf"
        path.write_bytes(blob)
        refused += not _loads_or_refuses(lambda q: load_target_gguf(q, "cpu", torch.float32, weights), path, what)
    assert refused >= len(cases) // 2


def test_corrupt_safetensors_load_or_are_refused(tmp_path, llama_folder):
    """The same for a safetensors file: its header (8-byte length, then JSON) cut, flipped or grown."""
    weights = llama_folder / "model.safetensors"
    data = weights.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    cases = _mutations(data, seed=1, n=10, header=header)
    cases.append(("header length grown", (2**40).to_bytes(8, "little") + data[8:]))
    refused = 0
    for what, blob in cases:
        weights.write_bytes(blob)
        refused += not _loads_or_refuses(lambda q: load_target_folder(q, "cpu", torch.float32), llama_folder, what)
    assert refused >= len(cases) // 2


def test_non_finite_weights_are_refused_by_name(llama_folder):
    path = llama_folder / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.2.self_attn.o_proj.weight"][3, :5] = float("nan")
    save_file(tensors, path)
    with pytest.raises(EngineInputError, match=r"'layers.2.self_attn.o_proj.weight' holds 5 non-finite values"):
        load_target_folder(llama_folder, "cpu", torch.float32)


def test_shard_paths_stay_inside_the_model_folder(tmp_path):
    folder = tmp_path / "model"
    _hf_model("llama", seed=1).save_pretrained(folder, max_shard_size="40KB")
    index = folder / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    first = next(iter(doc["weight_map"]))
    shard = folder / doc["weight_map"][first]
    (tmp_path / "elsewhere.safetensors").write_bytes(shard.read_bytes())
    for evil in ("../elsewhere.safetensors", str(tmp_path / "elsewhere.safetensors")):
        doc["weight_map"][first] = evil
        index.write_text(json.dumps(doc))
        with pytest.raises(EngineInputError, match="outside the model folder"):
            load_target_folder(folder, "cpu", torch.float32)


def test_a_config_too_large_for_memory_is_refused_before_allocating(llama_folder):
    _edit_config(llama_folder, hidden_size=10_000_000, intermediate_size=40_000_000)
    with pytest.raises(EngineInputError, match=r"DenseModel with this config needs [\d,.]+ GiB .* GiB free "
                                               r"\(hidden_size 10000000"):
        load_target_folder(llama_folder, "cpu", torch.float32)


# ---------------------------------------------------------------------------------------- drafts

def _tiny_target() -> DenseModel:
    target = DenseModel(DenseConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=128))
    init_random_(target, 0)
    return target


def _draft(**overrides) -> DFlashDraft:
    fields = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, vocab_size=VOCAB, target_layer_ids=(1, 2), num_target_layers=4,
                  block_size=8, mask_token_id=VOCAB - 1, rope_theta=50000.0)
    fields.update(overrides)
    draft = DFlashDraft(DFlashConfig(**fields))
    init_random_(draft, 1)
    return draft


def test_draft_round_trip(tmp_path):
    target, draft = _tiny_target(), _draft()
    save_draft_folder(draft, tmp_path, extra={"trained_on": "unit-test"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["trained_on"] == "unit-test"
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 2] and cfg["dflash_config"]["mask_token_id"] == 299
    assert set(load_file(tmp_path / "model.safetensors")) == set(draft.state_dict())
    loaded = load_draft_folder(tmp_path, target, "cpu", torch.float32)
    assert loaded.cfg == dataclasses.replace(draft.cfg, head_dim=16) and not loaded.training

    gen = torch.Generator().manual_seed(0)
    args = (torch.randn(8, HIDDEN, generator=gen), torch.randn(5, 2 * HIDDEN, generator=gen),
            torch.arange(5), torch.arange(5, 13))
    with torch.no_grad():
        assert torch.equal(loaded(*args), draft(*args))

    # The public variants: block_size only at the top level, rope only in rope_parameters.
    del cfg["dflash_config"]["block_size"], cfg["rope_theta"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    again = load_draft_folder(tmp_path, target, "cpu", torch.float32)
    assert again.cfg.block_size == 8 and again.cfg.rope_theta == 50000.0


@pytest.mark.parametrize("overrides, numbers", [
    ({"hidden_size": 48}, ["hidden_size 48", "hidden_size 64"]),
    ({"vocab_size": 301}, ["vocab_size 301", "vocab_size 300"]),
    ({"target_layer_ids": (1, 7)}, ["[1, 7]", "4 layers", "got 7"]),
    ({"mask_token_id": 300}, ["mask_token_id 300", "vocab_size 300"]),
])
def test_draft_target_mismatch(overrides, numbers, tmp_path):
    save_draft_folder(_draft(**overrides), tmp_path)
    with pytest.raises(EngineInputError) as info:
        load_draft_folder(tmp_path, _tiny_target(), "cpu", torch.float32)
    assert str(tmp_path) in str(info.value)
    for text in numbers:
        assert text in str(info.value)


@pytest.mark.parametrize("edit, message", [
    ({"architectures": ["DFlash2DraftModel"]}, "DFlash2DraftModel"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_attention"),
    ({"dflash_config": {"target_layer_ids": [2, 1], "mask_token_id": 1}}, r"strictly ascending.*\[2, 1\]"),
    ({"dflash_config": {"target_layer_ids": [1, 2]}}, "'mask_token_id' is missing"),
])
def test_draft_unsupported_config(edit, message, tmp_path):
    save_draft_folder(_draft(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(edit)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineInputError, match=message):
        load_draft_folder(tmp_path, _tiny_target(), "cpu", torch.float32)


# ------------------------------------------------------------------------------------ bad inputs

@pytest.fixture
def llama_folder(tmp_path):
    folder = tmp_path / "llama"
    _hf_model("llama").save_pretrained(folder)
    return folder


def _edit_config(folder, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(EngineInputError, match=r"target folder .*nope does not exist"):
        load_target_folder(tmp_path / "nope", "cpu", torch.float32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineInputError, match=r"empty has no config.json"):
        load_target_folder(tmp_path / "empty", "cpu", torch.float32)
    (tmp_path / "empty" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(EngineInputError, match=r"empty: no weights: expected model.safetensors"):
        load_target_folder(tmp_path / "empty", "cpu", torch.float32)


def test_unsupported_architecture(llama_folder):
    _edit_config(llama_folder, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(EngineInputError, match=r"config.json: model_type 'gpt2'.*supported.*llama.*qwen3"):
        load_target_folder(llama_folder, "cpu", torch.float32)


def test_unsupported_rope_and_window(llama_folder):
    _edit_config(llama_folder, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(EngineInputError, match="rope type 'yarn' is not supported"):
        load_target_folder(llama_folder, "cpu", torch.float32)
    _edit_config(llama_folder, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                 model_type="mistral", sliding_window=4096)
    with pytest.raises(EngineInputError, match="sliding_window=4096"):
        load_target_folder(llama_folder, "cpu", torch.float32)


def test_missing_unexpected_and_misshapen_tensors(llama_folder):
    path = llama_folder / "model.safetensors"
    tensors = load_file(path)
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    tensors["model.layers.1.extra.weight"] = torch.zeros(2)
    save_file(tensors, path)
    with pytest.raises(EngineInputError) as info:
        load_target_folder(llama_folder, "cpu", torch.float32)
    assert "layers.1.mlp.up_proj.weight" in str(info.value) and "layers.1.extra.weight" in str(info.value)
    assert str(llama_folder) in str(info.value)

    _hf_model("llama").save_pretrained(llama_folder)
    _edit_config(llama_folder, intermediate_size=96)
    with pytest.raises(EngineInputError, match=r"'layers.0.mlp.gate_proj.weight' has shape \[128, 64\], "
                                               r"but the model expects \[96, 64\]"):
        load_target_folder(llama_folder, "cpu", torch.float32)


def test_untied_config_without_lm_head(tmp_path):
    _hf_model("llama", tie_word_embeddings=True).save_pretrained(tmp_path)
    _edit_config(tmp_path, tie_word_embeddings=False)
    with pytest.raises(EngineInputError, match=r"missing \['lm_head.weight'\].*tie_word_embeddings"):
        load_target_folder(tmp_path, "cpu", torch.float32)


@pytest.mark.parametrize("name", ["qwen3-8b-shape", "qwen35-27b-shape"])
def test_shape_presets_are_gpu_only_with_a_clear_message(name):
    import engine
    from engine.registry import DRAFTS, TARGETS

    assert TARGETS[name].build_on is not None and DRAFTS[f"{name}-dflash"].target == name
    with pytest.raises(EngineInputError, match="GPU timing presets.*use device cuda"):
        engine.load(name, f"{name}-dflash", device="cpu")
