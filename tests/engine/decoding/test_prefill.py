"""A long prompt's prefill without a prefix cache (engine.decoding.loop.prefill): a chunk at a time in
the decode steps' form, as a cold prefix cache prefills it, so its transient is a chunk's and not the
prompt's square; the chunk's rows (prefix_cache.prefill_rows) shrink as the keys grow; the memory plan
prices it so."""

import pytest
import torch

import engine
from engine import EngineConfig, PrefixCache
from engine.decoding import prefix_cache as prefix_cache_mod
from engine.decoding.prefix_cache import prefill_rows
from tests.engine.engine_pairs import pair_for

CHUNK = 16  # PREFILL_CHUNK for these tests: a 40-token prompt takes 3 chunks
# (draft, config): the oracle's host proposals on the generic loop; a DFlash draft (random weights), whose
# context is the target features the chunks wrote, on the runtime's steps
CONFIGS = [("oracle:0.3", EngineConfig(verify="chain", block_size=6, draft_path="generic")),
           ("oracle:0.3", EngineConfig(verify="ddtree", budget=8, top_k=2, draft_path="generic")),
           ("random", EngineConfig(verify="chain", block_size=6, draft_path="runtime")),
           ("random", EngineConfig(verify="ddtree", budget=8, top_k=2, draft_path="runtime"))]


def _rows_forwarded(pair, monkeypatch) -> list[tuple[int, int]]:
    """(start, rows) of each target forward, recorded."""
    seen = []
    forward = type(pair.target).forward

    def spy(self, tokens, cache, start, *a, **kw):
        seen.append((start, int(tokens.shape[0]), kw.get("as_steps", False)))
        return forward(self, tokens, cache, start, *a, **kw)

    monkeypatch.setattr(type(pair.target), "forward", spy)
    return seen


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_a_long_prompt_is_prefilled_a_chunk_at_a_time_as_a_cold_cache_prefills_it(target, monkeypatch):
    pair = pair_for(target, "oracle:0.3")
    monkeypatch.setattr(prefix_cache_mod, "PREFILL_CHUNK", CHUNK)
    ids = list(range(3, 43))  # 40 tokens
    seen = _rows_forwarded(pair, monkeypatch)
    plain = engine.generate(pair, ids, EngineConfig(verify="ar"), 8, ignore_eos=True, record_margins=True)
    prefill = [(s, r, steps) for s, r, steps in seen if s < len(ids)]
    # a recurrent target's last span ends a token early, where a prefix cache keeps the prompt's state
    want = [(0, 16, True), (16, 16, True)] + ([(32, 7, True), (39, 1, True)] if target == "tiny-hybrid" else
                                              [(32, 8, True)])
    assert prefill == want
    cold = engine.generate(pair, ids, EngineConfig(verify="ar"), 8, ignore_eos=True, record_margins=True,
                           prefix_cache=PrefixCache(1 << 24, chunk=CHUNK))
    # the same forwards, so the same bits (on any device): a cold cache's run is the plain run
    assert cold.tokens == plain.tokens and cold.margins == plain.margins and cold.top_logits == plain.top_logits


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_a_prompt_within_a_chunk_is_still_one_whole_forward(target, monkeypatch):
    pair = pair_for(target, "oracle:0.3")
    monkeypatch.setattr(prefix_cache_mod, "PREFILL_CHUNK", CHUNK)
    seen = _rows_forwarded(pair, monkeypatch)
    engine.generate(pair, list(range(3, 3 + CHUNK)), EngineConfig(verify="ar"), 4, ignore_eos=True)
    assert seen[0] == (0, CHUNK, False)


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
@pytest.mark.parametrize("draft, cfg", CONFIGS, ids=lambda c: c.verify if isinstance(c, EngineConfig) else c)
def test_speculative_decoding_after_a_chunked_prefill_equals_ar(target, draft, cfg, monkeypatch):
    pair = pair_for(target, draft)
    monkeypatch.setattr(prefix_cache_mod, "PREFILL_CHUNK", CHUNK)
    ids = list(range(5, 55))
    ar = engine.generate(pair, ids, EngineConfig(verify="ar"), 24, ignore_eos=True).tokens
    assert engine.generate(pair, ids, cfg, 24, ignore_eos=True).tokens == ar


def test_a_chunk_s_rows_shrink_as_its_keys_grow(monkeypatch):
    big = engine.load("qwen35-27b-shape", "random", device="meta", dtype="bfloat16").target
    assert [prefill_rows(big, k) for k in (2048, 8192, 32768, 131072)] == [512, 256, 64, 16]
    small = pair_for("tiny-dense", "oracle:0.3").target
    assert prefill_rows(small, 4096) == prefix_cache_mod.PREFILL_CHUNK
    monkeypatch.setattr(prefix_cache_mod, "PREFILL_TRANSIENT_BYTES", 100_000)
    rows = [prefill_rows(small, k) for k in (64, 256, 1024, 4096)]
    assert rows == sorted(rows, reverse=True) and all(r & (r - 1) == 0 for r in rows)  # powers of two
    assert rows[-1] == prefix_cache_mod.MIN_PREFILL_ROWS and prefill_rows(small, 4096, 8) == 8


def test_the_plan_prices_a_long_prompt_s_prefill_by_its_chunks():
    """The 27B shape at 32k tokens: a whole-prompt prefill's mask and scores would be ~9 GiB."""
    pair = engine.load("qwen35-27b-shape", "random", device="meta", dtype="bfloat16")
    plan = engine.plan_memory(pair, EngineConfig(verify="ar"), 32768 - 256, 256, device="cuda", dtype=torch.bfloat16)
    assert plan.parts["activations"] < 1 << 30
    short = engine.plan_memory(pair, EngineConfig(verify="ar"), 256, 256, device="cuda", dtype=torch.bfloat16)
    assert short.parts["activations"] < plan.parts["activations"]


def test_the_plan_never_shrinks_as_the_prompt_grows():
    """A chunk's rows halve where its keys pass a threshold: the prompt just short of it forwards twice
    the rows over nearly the keys, so a plan at the longer prompt prices that chunk too (a sweep plans
    at its longest prompt; ``longest_context`` searches assuming the plan only grows)."""
    pair = engine.load("qwen35-27b-shape", "random", device="meta", dtype="bfloat16")
    target, ar = pair.target, EngineConfig(verify="ar")
    halvings = [k for k in range(20_000, 23_000, 4) if prefill_rows(target, k + 4) < prefill_rows(target, k)]
    assert halvings  # (the 128 -> 64 threshold lies here for the 27B shape in bf16)
    k = halvings[0]
    totals = [engine.plan_memory(pair, ar, n, 256, device="cuda", dtype=torch.bfloat16).total
              for n in (k - 4, k, k + 4, k + 8, 2 * k)]
    assert totals == sorted(totals)
    assert prefix_cache_mod.widest_chunks(target, k + 4) [:2] == [(prefill_rows(target, k + 4), k + 4),
                                                                   (prefill_rows(target, k), k)]


def test_a_narrow_head_s_step_partials_are_priced_at_its_spans():
    """Head_dim 64 in half precision reduces spans of 64 keys (``step_attention_launch``), not 128."""
    from engine.models.attention import SPLIT_KEYS, step_split

    assert step_split(64) == 64 and step_split(64, fp32=True) == SPLIT_KEYS and step_split(128) == SPLIT_KEYS
    assert step_split(256) == SPLIT_KEYS and step_split(48) == 64
