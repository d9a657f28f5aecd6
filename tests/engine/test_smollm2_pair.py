"""The real pair: SmolLM2-135M-Instruct (fetched from the package registry on first use) and our
shipped DFlash draft. Float32 on the CPU: chain and DDTree reproduce AR token for token."""

import json

import pytest

import engine
from engine import EngineConfig
from engine.registry import CHECKPOINTS, DRAFTS

pytestmark = pytest.mark.xdist_group("test_smollm2_pair")  # its module fixture loads the real pair: once


@pytest.fixture(scope="module")
def pair():
    return engine.load("smollm2-135m-instruct", "smollm2-135m-dflash", device="cpu", dtype="float32")


def test_shipped_draft_is_small_in_the_public_layout_and_documented():
    folder = CHECKPOINTS / "smollm2-135m-dflash"
    assert "smollm2-135m-dflash" in DRAFTS
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert set(config["dflash_config"]) >= {"mask_token_id", "target_layer_ids", "block_size"}
    assert (folder / "model.safetensors").stat().st_size <= 16 * 1024 * 1024
    card = (folder / "README.md").read_text()
    for needle in ("train-draft", "final loss", "acceptance length"):
        assert needle in card.lower()


def test_pair_loads_with_matching_shapes(pair):
    draft = pair.drafter.draft.cfg
    assert draft.hidden_size == pair.target.cfg.hidden_size == 576
    assert draft.vocab_size == pair.target.cfg.vocab_size == 49152
    assert draft.mask_token_id == pair.tokenizer.mask_id


@pytest.mark.parametrize("path", ["generic", "runtime"])
def test_chain_and_ddtree_equal_ar_in_float32(pair, path):
    from engine.data.prompts import Prompt

    ids = pair.encode(Prompt(messages=({"role": "user", "content": "Write a Python function that adds two numbers."},)))
    ar = engine.generate(pair, ids, EngineConfig(verify="ar"), 32, ignore_eos=True)
    for cfg in (EngineConfig(verify="chain", draft_path=path),
                EngineConfig(verify="ddtree", draft_path=path, budget=22, top_k=8)):
        out = engine.generate(pair, ids, cfg, 32, ignore_eos=True)
        assert out.tokens == ar.tokens
        assert out.stats.acceptance_length > 1.0  # the trained draft really proposes the target's tokens


def test_native_weights_keep_the_q4_1_blocks_and_decode_the_same_tokens(pair):
    """The packaged GGUF (written by llama.cpp, Q4_1) with weights="native": its 210 projections stay
    in their blocks (the tied embedding, the norms: floats), a third of the bytes, and AR and DDTree
    decode the dequantized pair's tokens (issue #28)."""
    native = engine.load("smollm2-135m-instruct", "smollm2-135m-dflash", device="cpu", dtype="float32",
                         weights="native")
    summary = native.weight_summary()
    assert summary["formats"] == {"Q4_1": 30 * 7} and summary["fallback"] == {}
    assert summary["weight_bytes"] < pair.weight_summary()["weight_bytes"] / 2.5
    ids = pair.encode("Write a haiku about the sea.")
    for cfg in (EngineConfig(verify="ar"), EngineConfig(verify="ddtree", budget=22, top_k=8)):
        assert engine.generate(native, ids, cfg, 16, ignore_eos=True).tokens == \
            engine.generate(pair, ids, cfg, 16, ignore_eos=True).tokens
