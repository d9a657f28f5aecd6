"""The prefix cache's invariant on a GPU (skipped without CUDA): in bf16 with the row-invariant
kernels, the positions a generation commits (any loop, any tree) carry the bits a step-form prefill
of the same tokens computes, whatever its chunks, so a cache hit equals a cold run token for token
(docs/exactness.md, "The prefix cache").

    python -m pytest -q -p no:cacheprovider tests/engine/test_gpu_prefix_cache.py
"""

import pytest
import torch

import engine
from engine import EngineConfig, PrefixCache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BIG = 1 << 30
TARGETS = ["tiny-dense", "tiny-hybrid", "smollm2-135m-shape"]  # the last: SmolLM2's shapes (random weights)
CONFIGS = [
    EngineConfig(verify="ar"),  # the runtime's captured steps
    EngineConfig(verify="ar", draft_path="generic"),
    EngineConfig(verify="chain", rollback="fast"),
    EngineConfig(verify="ddtree", rollback="fast", budget=16, top_k=4),
    EngineConfig(verify="ddtree", rollback="replay", budget=16, top_k=4, draft_path="generic"),
    EngineConfig(verify="ddtree", rollback="fast", budget=16, top_k=4, draft_path="generic"),
]
TEXTS = ["Hello there, how are you today? " * 6, "def fib(n):\n    return n if n < 2 else", "The capital of France"]
_pairs: dict = {}


def _pair(target: str) -> engine.Pair:
    if target not in _pairs:
        _pairs[target] = engine.load(target, "random", device="cuda", dtype="bfloat16")
    return _pairs[target]


def _committed(pair, n: int, features: bool) -> list[torch.Tensor]:
    ws = pair._workspace
    return [ws.cache.k[:, :n].clone(), ws.cache.v[:, :n].clone()] + ([ws.features[:n].clone()] if features else [])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.verify}-{c.rollback}-{c.draft_path}")
def test_committed_positions_equal_a_step_form_prefill_bit_for_bit(target, cfg):
    pair = _pair(target)
    if pair.refusal(cfg) is not None:
        pytest.skip(pair.refusal(cfg))
    spec = cfg.verify != "ar"
    for text in TEXTS:
        ids = pair.encode(text)
        gen = engine.generate(pair, ids, cfg, 48, ignore_eos=True, prefix_cache=PrefixCache(BIG))
        seq = ids + gen.tokens[:-1]  # every committed position with K/V
        kept = _committed(pair, len(seq), spec)
        prefill = EngineConfig(verify="ddtree", budget=16, top_k=4) if spec else EngineConfig(verify="ar")
        for chunk in (1, 7, 64, 512):
            engine.generate(pair, seq, prefill, 1, prefix_cache=PrefixCache(BIG, chunk=chunk))
            again = _committed(pair, len(seq), spec)
            for name, a, b in zip(("k", "v", "features"), kept, again, strict=False):
                assert torch.equal(a, b), (text[:12], chunk, name, (a != b).nonzero()[:1].tolist())


@pytest.mark.parametrize("chunk", [1, 7, 512])
def test_a_hybrid_state_is_the_same_whatever_the_chunks(chunk):
    pair = _pair("tiny-hybrid")
    ids = pair.encode(TEXTS[0])
    ar = EngineConfig(verify="ar", draft_path="generic")  # no step runs ahead: the state is the answer's end
    gen = engine.generate(pair, ids, ar, 32, ignore_eos=True, prefix_cache=PrefixCache(BIG, chunk=chunk))
    state = (pair._workspace.cache.rec.clone(), pair._workspace.cache.conv.clone())
    seq = ids + gen.tokens[:-1]
    # the prefill's state after len(seq) tokens: checkpointed at the prompt's last token but one
    cache = PrefixCache(BIG, chunk=13)
    engine.generate(pair, seq + [gen.tokens[-1]], ar, 1, prefix_cache=cache)
    (node,) = [n for n in cache._nodes() if n.state is not None and n.end == len(seq)]
    assert torch.equal(node.state[0], state[0]) and torch.equal(node.state[1], state[1])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.verify}-{c.rollback}-{c.draft_path}")
def test_bf16_sessions_with_the_cache_equal_cold_runs(target, cfg):
    """Random weights in bf16 tie often: a hit that rounded apart from a cold run would show."""
    pair = _pair(target)
    if pair.refusal(cfg) is not None:
        pytest.skip(pair.refusal(cfg))
    cache = PrefixCache(BIG)
    for text in TEXTS:
        prompt = pair.encode(text)
        for turn in range(3):
            hit = engine.generate(pair, prompt, cfg, 40, ignore_eos=True, prefix_cache=cache)
            cold = engine.generate(pair, prompt, cfg, 40, ignore_eos=True, prefix_cache=PrefixCache(BIG))
            assert hit.tokens == cold.tokens, (target, text[:12], turn)
            assert turn == 0 or hit.stats.cached_tokens > 0
            prompt = prompt + hit.tokens + pair.encode(f" and then, turn {turn}?")


@pytest.mark.parametrize("target", ["tiny-dense", "smollm2-135m-shape"])
def test_a_long_prompt_hit_inside_a_chunk_equals_a_cold_run(target):
    """An agent's prompt spans several 512-row chunks: hits that end inside a chunk (about 700 and
    1,100 tokens into a ~1,500-token prompt) leave prefills whose first chunk is short and whose
    step attention runs over 257-512 query rows in one launch; each answer equals a cold run."""
    pair = _pair(target)
    cfg = EngineConfig(verify="ddtree", rollback="fast", budget=16, top_k=4)
    base = pair.encode("You are an agent with tools. " * 300)[:1500]
    assert len(base) == 1500
    cache = PrefixCache(BIG)
    for cut in (700, 1100, 1500):
        prompt = base[:cut]
        hit = engine.generate(pair, prompt, cfg, 32, ignore_eos=True, prefix_cache=cache)
        cold = engine.generate(pair, prompt, cfg, 32, ignore_eos=True, prefix_cache=PrefixCache(BIG))
        assert hit.tokens == cold.tokens, (target, cut)
        assert cut == 700 or hit.stats.cached_tokens >= 699


@pytest.mark.parametrize("target", ["tiny-dense", "smollm2-135m-shape"])
@pytest.mark.parametrize("transient", [None, 1 << 20], ids=["default-rows", "few-rows"])
def test_a_long_prompt_without_a_cache_is_prefilled_as_a_cold_cache_prefills_it(target, transient, monkeypatch):
    """Without a cache a prompt past PREFILL_CHUNK is prefilled a chunk at a time in the steps' form
    (loop.prefill): AR and DDTree share it and agree; it equals a cold cache's run; and at 16-64 rows
    a chunk (a tiny transient budget) over ~1,500 keys it still equals the default chunks' run, since
    the step kernels do not round by rows."""
    from engine.decoding import prefix_cache as prefix_cache_mod

    pair = _pair(target)
    prompt = pair.encode("You are an agent with tools. " * 300)[:1500]
    ar, dd = EngineConfig(verify="ar"), EngineConfig(verify="ddtree", rollback="fast", budget=16, top_k=4)
    default = engine.generate(pair, prompt, ar, 32, ignore_eos=True).tokens
    if transient is not None:
        monkeypatch.setattr(prefix_cache_mod, "PREFILL_TRANSIENT_BYTES", transient)
        assert prefix_cache_mod.prefill_rows(pair.target, len(prompt)) < 128
    plain = engine.generate(pair, prompt, ar, 32, ignore_eos=True).tokens
    assert plain == default
    assert engine.generate(pair, prompt, dd, 32, ignore_eos=True).tokens == plain
    assert engine.generate(pair, prompt, ar, 32, ignore_eos=True, prefix_cache=PrefixCache(BIG)).tokens == plain
