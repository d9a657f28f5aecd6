"""The prefix cache (engine.decoding.prefix_cache): a generation that reuses cached positions equals a
cold run token for token (float32, CPU), on dense and hybrid targets, both rollbacks, AR, chain and
DDTree, the generic loop and the runtime's steps; partial hits, eviction, and what is (not) kept."""

import pytest
import torch

import engine
from engine import EngineConfig, PrefixCache
from engine.decoding.prefix_cache import _Node, prefill_spans
from tests.engine.engine_pairs import pair_for

SYSTEM = "System: you are a terse agent. Tools: get_weather(city), add(a, b). Answer in one line. "
TURNS = [" User: weather in Paris?", " Tool: 21C sunny. User: and Rome?", " Tool: 25C. User: thanks"]
MAX_NEW = 16
BIG = 1 << 24
CHUNK = 16  # small, so that prompts take several chunks

CONFIGS = [
    EngineConfig(verify="ar"),
    EngineConfig(verify="ar", draft_path="runtime"),
    EngineConfig(verify="chain", rollback="replay", draft_path="generic", block_size=6),
    EngineConfig(verify="chain", rollback="fast", draft_path="runtime", block_size=6),
    EngineConfig(verify="ddtree", rollback="replay", draft_path="generic", budget=8, top_k=2),
    EngineConfig(verify="ddtree", rollback="fast", draft_path="generic", budget=8, top_k=2),
    EngineConfig(verify="ddtree", rollback="fast", draft_path="runtime", budget=8, top_k=2),
    EngineConfig(verify="ddtree", rollback="fast", draft_path="runtime", budget=6, top_k=2, temperature=0.8, seed=3),
]


def _id(cfg: EngineConfig) -> str:
    return f"{cfg.verify}-{cfg.rollback}-{cfg.draft_path}" + (f"-t{cfg.temperature}" if cfg.temperature else "")


def _reference(pair, ids, cfg, n=MAX_NEW, **kw) -> list[int]:
    """AR without a cache (the reference every exact config equals)."""
    ar = EngineConfig(verify="ar", temperature=cfg.temperature, seed=cfg.seed)
    return engine.generate(pair, ids, ar, n, ignore_eos=True, **kw).tokens


def _scramble(pair) -> None:
    """Overwrite the pair's workspace (K/V, features, the token buffer) with finite noise."""
    ws = pair._workspace
    if ws is not None:
        gen = torch.Generator().manual_seed(0)
        with torch.inference_mode():  # (the buffers are inference tensors)
            for t in (ws.cache.k, ws.cache.v) + ((ws.features,) if ws.features is not None else ()):
                t.copy_(10 * torch.randn(t.shape, generator=gen))
            ws.seq.copy_(torch.randint(0, 256, ws.seq.shape, generator=gen))


def _prompt_state(pair, n: int, cfg: EngineConfig) -> list[torch.Tensor]:
    """After a generation: its prompt's K/V, and its features where it drafted (copies)."""
    ws = pair._workspace
    state = [ws.cache.k[:, :n].clone(), ws.cache.v[:, :n].clone()]
    return state + ([ws.features[:n].clone()] if cfg.verify != "ar" else [])


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=_id)
def test_a_session_with_the_cache_equals_cold_runs_turn_by_turn(target, cfg):
    pair = pair_for(target, "random")  # a DFlash draft: its context features are cached too
    if pair.refusal(cfg) is not None:
        pytest.skip(pair.refusal(cfg))  # the runtime refuses replay on a hybrid target
    cache = PrefixCache(BIG, chunk=CHUNK)
    prompt = pair.encode(SYSTEM + TURNS[0])
    previous = None
    for turn in range(len(TURNS)):
        _scramble(pair)  # nothing the last generation left in the workspace may pass for restored
        hit = engine.generate(pair, prompt, cfg, MAX_NEW, ignore_eos=True, prefix_cache=cache)
        restored = _prompt_state(pair, len(prompt), cfg)
        cold = engine.generate(pair, prompt, cfg, MAX_NEW, ignore_eos=True, prefix_cache=PrefixCache(BIG, CHUNK))
        assert hit.tokens == cold.tokens == _reference(pair, prompt, cfg), turn
        # the prompt's K/V and the draft's features as a cold prefill computes them (to float32 rounding:
        # on the CPU a row's bits depend on the rows computed with it); the draft proposed alike
        for got, want in zip(restored, _prompt_state(pair, len(prompt), cfg), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert hit.stats.accept_lengths == cold.stats.accept_lengths
        assert cold.stats.cached_tokens == 0
        if previous is None:
            assert hit.stats.cached_tokens == 0
        else:  # the previous prompt and all its answer but the last token (no K/V yet)
            n, out = previous
            whole = n + len(out) - 1
            if target == "tiny-dense":
                assert hit.stats.cached_tokens == whole
            else:  # a hybrid resumes at a state checkpoint: the answer's end, or the prompt's last token but one
                assert hit.stats.cached_tokens in (whole, n - 1)
        previous = (len(prompt), hit.tokens)
        prompt = prompt + hit.tokens + pair.encode(TURNS[(turn + 1) % len(TURNS)])
    assert cache.hits == len(TURNS) - 1 and cache.misses == 1 and 0 < cache.bytes <= BIG


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_partial_prefix_hits_split_the_tree_and_equal_cold_runs(target):
    pair = pair_for(target, "random")
    cfg = EngineConfig(verify="ddtree", budget=8, top_k=2, draft_path="generic")
    cache = PrefixCache(BIG, chunk=CHUNK)
    shared = pair.encode(SYSTEM)
    a, b = shared + pair.encode("first question?"), shared + pair.encode("other one!")  # they part at once
    for ids, want in ((a, 0), (b, len(shared) if target == "tiny-dense" else 0), (a, len(a) - 1), (b, len(b) - 1)):
        _scramble(pair)
        gen = engine.generate(pair, ids, cfg, MAX_NEW, ignore_eos=True, prefix_cache=cache)
        # a hybrid's state is kept at two boundaries per generation, not where two prompts part
        assert gen.stats.cached_tokens == want
        assert gen.tokens == _reference(pair, ids, cfg)
    # the first prompt's node was split where the second left it: the shared part is one node
    root = cache._root
    assert len(root.children) == 1
    node = next(iter(root.children.values()))
    assert node.tokens == list(shared) and len(node.children) == 2 and node.k.shape[1] == len(shared)


def _held_nodes(cache: PrefixCache) -> list:
    """Weak references to every node of ``cache``'s tree below the root (each holds K/V)."""
    import weakref

    out, stack = [], list(cache._root.children.values())
    while stack:
        node = stack.pop()
        out.append(weakref.ref(node))
        stack.extend(node.children.values())
    return out


def test_a_dropped_cleared_or_evicted_tree_frees_its_memory_at_once():
    """A node holds its parent weakly, so a tree is no reference cycle: a cache dropped (a session sweep's
    pass), cleared or evicted frees its K/V, features and states when the last reference goes, not when
    Python's cyclic collector gets round to it (with the collector off here). A split node's halves keep
    their places."""
    import gc

    pair = pair_for("tiny-dense", "random")
    cfg = EngineConfig(verify="ddtree", budget=8, top_k=2, draft_path="generic")
    shared = pair.encode(SYSTEM)
    was = gc.isenabled()
    gc.disable()
    try:
        for end in ("drop", "clear"):
            cache = PrefixCache(BIG, chunk=CHUNK)
            for tail in ("first question?", "other one!"):
                engine.generate(pair, shared + pair.encode(tail), cfg, MAX_NEW, ignore_eos=True, prefix_cache=cache)
            nodes = _held_nodes(cache)
            assert len(nodes) == 3 and all(n().parent is not None for n in nodes)  # the split: one shared node
            split = next(n() for n in nodes if n().children)
            assert all(child.parent is split for child in split.children.values()) and split.parent is cache._root
            del split
            if end == "drop":
                del cache
            else:
                cache.clear()
            assert [n() for n in nodes] == [None, None, None], end
        cache = PrefixCache(BIG, chunk=CHUNK)
        engine.generate(pair, shared + pair.encode("first question?"), cfg, MAX_NEW, ignore_eos=True,
                        prefix_cache=cache)
        nodes = _held_nodes(cache)
        cache._evict(0, set())
        assert cache.bytes == 0 and [n() for n in nodes] == [None]
    finally:
        if was:
            gc.enable()


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_eviction_keeps_the_budget_and_an_evicted_prompt_is_cold_again(target):
    pair = pair_for(target, "random")
    cfg = EngineConfig(verify="ddtree", budget=8, top_k=2, draft_path="generic")
    probe = PrefixCache(BIG, chunk=CHUNK)
    first = pair.encode("Alpha alpha alpha: tell me a story about a cat.")
    engine.generate(pair, first, cfg, MAX_NEW, ignore_eos=True, prefix_cache=probe)
    one = probe.bytes  # one prompt and its answer
    cache = PrefixCache(int(one * 1.5), chunk=CHUNK)
    others = [pair.encode(t) for t in ("Beta beta: a poem about the sea, please.", "Gamma: list three primes now.")]
    for ids in [first, *others]:
        engine.generate(pair, ids, cfg, MAX_NEW, ignore_eos=True, prefix_cache=cache)
        assert cache.bytes <= cache.budget_bytes
    assert cache.evictions >= 2  # the oldest went to make room, twice
    again = engine.generate(pair, first, cfg, MAX_NEW, ignore_eos=True, prefix_cache=cache)
    assert again.stats.cached_tokens == 0  # evicted: prefilled again, and the same tokens
    assert again.tokens == _reference(pair, first, cfg)
    latest = engine.generate(pair, first, cfg, MAX_NEW, ignore_eos=True, prefix_cache=cache)
    assert latest.stats.cached_tokens == len(first) - 1 and latest.tokens == again.tokens
    # a generation larger than the whole budget keeps what fits: a dense target's first positions, a
    # hybrid's positions up to a state checkpoint that fits with them (none here)
    tiny = PrefixCache(one // 4, chunk=CHUNK)
    fits = 0 if target == "tiny-hybrid" else tiny.budget_bytes // (one // (len(first) + MAX_NEW - 1))
    for want in (0, fits):
        gen = engine.generate(pair, first, cfg, MAX_NEW, ignore_eos=True, prefix_cache=tiny)
        assert gen.stats.cached_tokens == want and gen.tokens == again.tokens
        assert tiny.bytes <= tiny.budget_bytes and (tiny.bytes > 0) == (target == "tiny-dense")


def test_features_come_only_from_speculative_generations():
    """An AR generation keeps K/V without the draft's features: a speculative request cannot use
    them, prefills, and adds its features to the same nodes; the next one reuses both."""
    pair = pair_for("tiny-dense", "random")
    spec = EngineConfig(verify="ddtree", budget=8, top_k=2, draft_path="runtime")
    cache = PrefixCache(BIG, chunk=CHUNK)
    ids = pair.encode(SYSTEM + TURNS[0])
    ar = engine.generate(pair, ids, EngineConfig(verify="ar"), MAX_NEW, ignore_eos=True, prefix_cache=cache)
    assert engine.generate(pair, ids, EngineConfig(verify="ar"), MAX_NEW, ignore_eos=True,
                           prefix_cache=cache).stats.cached_tokens == len(ids) - 1
    first = engine.generate(pair, ids, spec, MAX_NEW, ignore_eos=True, prefix_cache=cache)
    assert first.stats.cached_tokens == 0 and first.tokens == ar.tokens
    second = engine.generate(pair, ids, spec, MAX_NEW, ignore_eos=True, prefix_cache=cache)
    assert second.stats.cached_tokens == len(ids) - 1 and second.tokens == ar.tokens


def test_a_generation_ended_by_an_exception_keeps_its_prompt():
    pair = pair_for("tiny-hybrid", "random")
    cfg = EngineConfig(verify="ddtree", budget=8, top_k=2, draft_path="runtime")
    cache = PrefixCache(BIG, chunk=CHUNK)
    ids = pair.encode(SYSTEM + TURNS[1])

    class Enough(Exception):
        pass

    def hook(tokens):
        raise Enough

    with pytest.raises(Enough):
        engine.generate(pair, ids, cfg, MAX_NEW, on_tokens=hook, prefix_cache=cache)
    assert cache.last_hit == 0 and cache.bytes > 0
    gen = engine.generate(pair, ids, cfg, MAX_NEW, ignore_eos=True, prefix_cache=cache)
    assert gen.stats.cached_tokens == len(ids) - 1 and gen.tokens == _reference(pair, ids, cfg)
    # a refused generation never prefilled: it keeps nothing and leaves the counters alone
    before = cache.stats()
    with pytest.raises(engine.EngineInputError, match="cannot run"):
        engine.generate(pair, ids, cfg.replace(rollback="replay"), MAX_NEW, prefix_cache=cache)
    assert cache.stats() == before


class _RanAhead(PrefixCache):
    """As the runtime leaves a hybrid after a step launched past the generation's end: the state
    advanced past the committed length, marked ``ahead`` (``RuntimeDecoder._ran_ahead``)."""

    target = None

    def commit(self, tokens):
        cur = self._current
        if cur is not None and tokens is not None:
            cache = cur.ws.cache
            length = cache.length
            with torch.inference_mode():  # one more token through the recurrent state
                self.target(cur.ws.seq[length : length + 1], cache, length)
            cache.length, cache.ahead = length, True
        super().commit(tokens)


@pytest.mark.parametrize("how", ["ahead", "truncated"])
def test_a_hybrid_state_past_the_answer_is_not_kept(how):
    """The answer's end is a checkpoint only where the state is exactly there: not after a step
    launched ahead (the runtime), nor after a step whose tokens were cut at max_new_tokens (the
    oracle's blocks are accepted whole, so the last is cut). The next turn resumes at the prompt's
    checkpoint instead, and equals a cold run."""
    pair = pair_for("tiny-hybrid", "oracle:0")
    cfg = EngineConfig(verify="ar") if how == "ahead" else EngineConfig(verify="chain", block_size=8)
    if how == "ahead":
        cache = _RanAhead(BIG, chunk=CHUNK)
        cache.target = pair.target
    else:
        cache = PrefixCache(BIG, chunk=CHUNK)
    ids = pair.encode(SYSTEM + TURNS[0])
    first = engine.generate(pair, ids, cfg, 13, ignore_eos=True, prefix_cache=cache)
    if how == "truncated":
        assert first.stats.accept_lengths[:2] == [8, 8] and len(first.tokens) == 13
    nxt = ids + first.tokens + pair.encode(TURNS[1])
    gen = engine.generate(pair, nxt, cfg, MAX_NEW, ignore_eos=True, prefix_cache=cache)
    assert gen.stats.cached_tokens == len(ids) - 1
    assert gen.tokens == _reference(pair, nxt, cfg)


def test_another_target_empties_the_cache():
    dense, hybrid = pair_for("tiny-dense", "none"), pair_for("tiny-hybrid", "none")
    cache = PrefixCache(BIG, chunk=CHUNK)
    ids = dense.encode(SYSTEM)
    engine.generate(dense, ids, EngineConfig(verify="ar"), 4, prefix_cache=cache)
    held = cache.bytes
    gen = engine.generate(hybrid, ids, EngineConfig(verify="ar"), 4, prefix_cache=cache)
    assert held > 0 and gen.stats.cached_tokens == 0  # the dense target's K/V are not the hybrid's
    assert gen.tokens == engine.generate(hybrid, ids, EngineConfig(verify="ar"), 4).tokens


def test_prefill_spans_end_at_chunk_multiples_and_a_hybrid_checkpoint():
    assert prefill_spans(0, 40, 16) == [(0, 16), (16, 32), (32, 40)]
    assert prefill_spans(20, 40, 16) == [(20, 32), (32, 40)]
    assert prefill_spans(0, 33, 16, (32,)) == [(0, 16), (16, 32), (32, 33)]
    assert prefill_spans(0, 34, 16, (33,)) == [(0, 16), (16, 32), (32, 33), (33, 34)]
    assert prefill_spans(32, 33, 16, (32,)) == [(32, 33)]  # a boundary at the start is no span
    assert isinstance(PrefixCache(BIG, chunk=16)._root, _Node)


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget_bytes=-1), "budget_bytes must be >= 0"),
    (dict(budget_bytes=1, chunk=0), "chunk must be between 1 and 1024"),
    (dict(budget_bytes=1, chunk=4096), "chunk must be between 1 and 1024"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrefixCache(**kwargs)


def test_a_cache_that_cannot_grow_is_emptied_and_the_answer_still_returned(monkeypatch):
    """Out of device memory while keeping a finished generation: the request keeps its answer and
    its cached_tokens; the cache is emptied (it cannot grow here), not the request failed."""
    pair = pair_for("tiny-dense", "random")
    cfg = EngineConfig(verify="ddtree", budget=8, top_k=2)
    cache = PrefixCache(BIG, chunk=CHUNK)
    ids = pair.encode(SYSTEM + TURNS[1])
    engine.generate(pair, ids, cfg, MAX_NEW, ignore_eos=True, prefix_cache=cache)
    assert cache.bytes > 0

    def full(tokens):
        raise torch.OutOfMemoryError("CUDA out of memory (scripted)")

    monkeypatch.setattr(cache, "commit", full)
    gen = engine.generate(pair, ids, cfg, MAX_NEW, ignore_eos=True, prefix_cache=cache)
    assert gen.tokens == _reference(pair, ids, cfg) and gen.stats.cached_tokens == len(ids) - 1
    assert cache.bytes == 0


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_a_generation_stopped_by_its_hook_keeps_the_tokens_it_delivered(target):
    """A server's stop string raises from the token hook with the ids delivered so far (``committed``):
    the cache keeps their positions (a hybrid: up to its last state checkpoint), so the
    next turn, which carries the answer, hits past the prompt and still equals a cold run."""
    pair = pair_for(target, "random")
    cfg = EngineConfig(verify="ddtree", budget=8, top_k=2)
    cache = PrefixCache(BIG, chunk=CHUNK)
    ids = pair.encode(SYSTEM + TURNS[1])
    seen: list[int] = []

    class Stop(Exception):
        def __init__(self, committed):
            super().__init__()
            self.committed = list(committed)

    def hook(tokens):
        seen.extend(tokens)
        if len(seen) >= 12:
            raise Stop(seen)

    with pytest.raises(Stop):
        engine.generate(pair, ids, cfg, MAX_NEW, ignore_eos=True, on_tokens=hook, prefix_cache=cache)
    follow = ids + seen + pair.encode(" and then?")
    gen = engine.generate(pair, follow, cfg, MAX_NEW, ignore_eos=True, prefix_cache=cache)
    if target == "tiny-dense":
        assert gen.stats.cached_tokens == len(ids) + len(seen) - 1
    else:  # the state after the cut answer is checkpointed only where the loop left it exactly there
        assert len(ids) - 1 <= gen.stats.cached_tokens <= len(ids) + len(seen) - 1
    assert gen.tokens == _reference(pair, follow, cfg)
