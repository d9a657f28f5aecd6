"""Qwen3.5 hybrid target: parity with transformers, tree verify and both rollback modes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from engine.config import EngineInputError
from engine.decoding.tree import ancestor_mask, build_tree_host
from engine.models.common import VerifyTree
from engine.models.hybrid import HybridModel
from engine.models.hybrid_cache import HybridCache
from engine.models.hybrid_config import HybridConfig, hybrid_config_from_hf, hybrid_state_dict_from_hf

transformers = pytest.importorskip("transformers")

TEXT_CFG = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2,
    initializer_range=0.1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.5},
)


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """A tiny random HF Qwen3.5 text model and the same weights loaded into our HybridModel."""
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TEXT_CFG)).eval()
    with torch.no_grad():  # move zero-init / one-init norms off identity so their layout matters
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith(("dt_bias", "A_log")):
                p.add_(0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("qwen35")
    hf.save_pretrained(path)
    cfg = hybrid_config_from_hf(json.loads((path / "config.json").read_text()))
    ours = HybridModel(cfg).eval()
    ours.load_state_dict(hybrid_state_dict_from_hf(load_file(str(path / "model.safetensors"))))
    return hf, ours


def _prompt(n: int = 20, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TEXT_CFG["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_logits_match_transformers(hf_pair):
    hf, ours = hf_pair
    prompt = _prompt()
    ref = hf(prompt[None]).logits[0]
    got, _ = ours(prompt, ours.new_cache(64), 0)
    assert (got - ref).abs().max() / ref.abs().max() <= 1e-4


@torch.no_grad()
def test_greedy_matches_transformers_generate(hf_pair):
    hf, ours = hf_pair
    prompt, n_new = _prompt(), 20
    ref = hf.generate(prompt[None], max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                      pad_token_id=0)[0, prompt.numel():].tolist()
    cache = ours.new_cache(64)
    logits, _ = ours(prompt, cache, 0, last_only=True)
    out = [int(logits[-1].argmax())]
    while len(out) < n_new:
        logits, _ = ours(torch.tensor(out[-1:]), cache, cache.length)
        out.append(int(logits[-1].argmax()))
    assert out == ref


def test_config_from_nested_hf_and_errors(hf_pair):
    _, ours = hf_pair
    text = dict(TEXT_CFG, layer_types=None)
    del text["layer_types"]
    nested = {"model_type": "qwen3_5", "text_config": text, "vision_config": {"depth": 2}}
    got = hybrid_config_from_hf(nested)
    # The saved config.json lists layer_types; the hand-written one derives them from the interval.
    same = dict(full_attention_interval=4, max_position_embeddings=0)
    assert dataclasses.replace(got, **same) == dataclasses.replace(ours.cfg, **same)
    assert ours.cfg.layer_types == ("linear_attention", "full_attention") * 2
    assert ours.cfg.rotary_dim == 8
    broken = dict(text)
    del broken["linear_num_value_heads"]
    with pytest.raises(EngineInputError, match="linear_num_value_heads"):
        hybrid_config_from_hf({"text_config": broken})


def test_state_dict_names_from_multimodal_checkpoint():
    w = torch.zeros(1)
    sd = {"model.language_model.norm.weight": w, "model.visual.blocks.0.norm1.weight": w,
          "mtp.fc.weight": w, "lm_head.weight": w, "model.language_model.layers.0.mlp.up_proj.weight": w}
    want = {"norm.weight", "lm_head.weight", "layers.0.mlp.up_proj.weight"}
    assert set(hybrid_state_dict_from_hf(sd)) == want
    tied = hybrid_state_dict_from_hf({"model.embed_tokens.weight": w}, tie_word_embeddings=True)
    assert tied["lm_head.weight"] is w


# --- tree verify and rollback -------------------------------------------------------------------

START_PROMPT = 12


def _tree(root: int, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    depth, k = 5, 3
    lp = torch.log_softmax(3 * torch.randn(depth, 50, generator=gen), -1)
    top_lp, top_ids = lp.topk(k, dim=-1)
    tree = build_tree_host(top_lp, top_ids + 7, root, budget=10, chain_seed=3)
    vt = VerifyTree(tree.parents, tree.depths, ancestor_mask(tree.parents, depth))
    return tree, vt


def _path_to(parents: list[int], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def _prefilled(model: HybridModel, extra: list[int] = ()) -> tuple[HybridCache, torch.Tensor]:
    """Prompt prefill, then ``extra`` tokens one at a time (AR); returns the cache and last logits."""
    cache = model.new_cache(64)
    logits, _ = model(_prompt(START_PROMPT), cache, 0)
    for tok in extra:
        logits, _ = model(torch.tensor([tok]), cache, cache.length)
    return cache, logits[-1]


def _assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    # float32 rounding differs between a T-token and a 1-token matmul: compare at the logits' scale.
    torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-5)


def _assert_same_state(a: HybridCache, b: HybridCache, n_slots: int) -> None:
    assert a.length == b.length == n_slots
    torch.testing.assert_close(a.rec, b.rec, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.conv, b.conv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.k[:, :n_slots], b.k[:, :n_slots], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.v[:, :n_slots], b.v[:, :n_slots], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def model(hf_pair):
    return hf_pair[1]


@torch.no_grad()
def test_tree_logits_equal_ar_along_each_path(model):
    cache, last = _prefilled(model)
    tree, vt = _tree(int(last.argmax()))
    before = cache.snapshot()
    logits, _ = model(tree.tokens, cache, START_PROMPT, tree=vt)
    # The committed state is untouched by a tree forward.
    length, rec, conv = before
    assert cache.length == length and torch.equal(cache.rec, rec) and torch.equal(cache.conv, conv)
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    assert len(tokens) == 11 and max(tree.depths.tolist()) >= 3
    for node in range(len(tokens)):
        path = [tokens[i] for i in _path_to(parents, node)]
        _, ar_last = _prefilled(model, path)
        _assert_logits_close(logits[node], ar_last)


@torch.no_grad()
@pytest.mark.parametrize("accept", ["deepest", "side", "root"])
def test_fast_commit_equals_replay_and_ar(model, accept):
    _, last = _prefilled(model)
    tree, vt = _tree(int(last.argmax()))
    parents, tokens, depths = tree.parents.tolist(), tree.tokens.tolist(), tree.depths.tolist()
    if accept == "deepest":  # AL 5: the new conv state comes from tree nodes only
        node = depths.index(max(depths))
    elif accept == "side":  # AL 2 through a rank-1 sibling: slots move, conv mixes old and new inputs
        node = next(i for i in range(len(tokens)) if depths[i] == 1 and tree.ranks[i] == 1)
    else:  # AL 1: only the root
        node = 0
    path = _path_to(parents, node)
    al = len(path)
    assert al == {"deepest": 5, "side": 2, "root": 1}[accept]
    path_tokens = [tokens[i] for i in path]
    # Pad the path the way walk_device does: the tail past al must be ignored.
    padded = torch.tensor(path + [n for n in range(len(tokens)) if n not in path])

    fast, _ = _prefilled(model)
    model(tree.tokens, fast, START_PROMPT, tree=vt)
    fast.commit_path(START_PROMPT, padded, al)

    replay, _ = _prefilled(model)
    snap = replay.snapshot()
    model(tree.tokens, replay, START_PROMPT, tree=vt)
    replay.restore(snap)
    model(torch.tensor(path_tokens), replay, START_PROMPT)

    ar, _ = _prefilled(model, path_tokens)

    n = START_PROMPT + al
    _assert_same_state(fast, ar, n)
    _assert_same_state(replay, ar, n)
    # And decoding continues identically from every one of them.
    nxt = torch.tensor([5, 17])
    want, _ = model(nxt, ar, n)
    for c in (fast, replay):
        got, _ = model(nxt, c, n)
        _assert_logits_close(got, want)


@pytest.mark.slow
@torch.no_grad()
@pytest.mark.parametrize("accept", ["deepest", "side"])
def test_fast_commit_through_the_kernels_equals_ar(model, accept, monkeypatch):
    """The Triton path (interpreted here, as on a GPU): the tree forward walks each root-to-leaf path
    in its own program, stores no node's state and records every node's inputs in the cache, and the
    commit recomputes the accepted path from them (``delta_rule_path``); the state and what follows
    equal AR's."""
    pytest.importorskip("triton")
    from engine.models import delta_rule, fused

    if not torch.cuda.is_available():  # off CUDA the dispatchers take the PyTorch forms: force the kernels
        monkeypatch.setattr(fused, "use_kernels", lambda *t: fused.kernels_enabled())
        monkeypatch.setattr(delta_rule, "_backend", lambda backend, x: "triton")
    fast, last = _prefilled(model)  # the root's logits, and the cache the tree forward runs on
    tree, vt = _tree(int(last.argmax()))
    parents, tokens, depths = tree.parents.tolist(), tree.tokens.tolist(), tree.depths.tolist()
    node = depths.index(max(depths)) if accept == "deepest" else next(
        i for i in range(len(tokens)) if depths[i] == 1 and tree.ranks[i] == 1)
    path = _path_to(parents, node)
    padded = torch.tensor(path + [n for n in range(len(tokens)) if n not in path])
    model(tree.tokens, fast, START_PROMPT, tree=vt)
    assert int((delta_rule.leaf_paths(tree.parents).counts > 0).sum()) > 1  # paths in programs of their own
    fast.commit_path(START_PROMPT, padded, len(path))
    ar, _ = _prefilled(model, [tokens[i] for i in path])
    n = START_PROMPT + len(path)
    _assert_same_state(fast, ar, n)
    nxt = torch.tensor([5, 17])
    _assert_logits_close(model(nxt, fast, n)[0], model(nxt, ar, n)[0])


@torch.no_grad()
def test_commit_guards(model):
    cache, _ = _prefilled(model)
    with pytest.raises(RuntimeError, match="tree forward"):
        cache.commit_path(START_PROMPT, torch.tensor([0]), 1)
    with pytest.raises(RuntimeError, match="recurrent state"):
        model(torch.tensor([1]), cache, START_PROMPT + 3)


def test_config_rejects_bad_layer_types():
    base = dict(vocab_size=10, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=4, intermediate_size=8, linear_num_key_heads=1,
                linear_num_value_heads=2, linear_key_head_dim=4, linear_value_head_dim=4)
    derived = HybridConfig(**base, full_attention_interval=2).layer_types
    assert derived == ("linear_attention", "full_attention")
    with pytest.raises(EngineInputError, match="layer_types"):
        HybridConfig(**base, layer_types=("full_attention",))
