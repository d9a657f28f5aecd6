"""GPU checks (skipped without CUDA): float32 stays exact on the device; bf16 runs every path."""

import itertools

import pytest
import torch

import engine
from engine import EngineConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PATHS = list(itertools.product(["chain", "ddtree"], ["replay", "fast"], ["generic", "runtime"]))


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_float32_on_cuda_equals_ar_on_every_path(target):
    pair = engine.load(target, "oracle:0.3", device="cuda", dtype="float32")
    ids = pair.encode("Hello there, how are you today?")
    ar = engine.generate(pair, ids, EngineConfig(verify="ar"), 48, ignore_eos=True).tokens
    for verify, rollback, path in PATHS:
        cfg = EngineConfig(verify=verify, rollback=rollback, draft_path=path, budget=16, top_k=4, block_size=8)
        gen = engine.generate(pair, ids, cfg, 48, ignore_eos=True)
        assert gen.tokens == ar, (verify, rollback, path)
        assert gen.stats.acceptance_length > 1.0


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_bfloat16_runs_every_path_and_reports_divergence(target):
    pair = engine.load(target, "random", device="cuda", dtype="bfloat16")
    prompts = [pair.encode("Hello there"), pair.encode("def f(x):")]
    ref = engine.bench(pair, EngineConfig(verify="ar"), prompts, 32, ignore_eos=True)
    for verify, rollback, path in PATHS:
        res = engine.bench(pair, EngineConfig(verify=verify, rollback=rollback, draft_path=path), prompts, 32,
                           reference=ref.outputs, ignore_eos=True)
        assert res.exact_match is not None and res.new_tokens == 64
        for p in res.prompts:
            assert p.exact == (p.first_divergence is None)


RUNTIME_CONFIGS = [
    dict(verify="chain"),
    dict(verify="ddtree", budget=16, top_k=4),
    dict(verify="ddtree", budget=8, top_k=3, target_feat_ctx=12, temperature=0.7, seed=5),
]


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
@pytest.mark.parametrize("params", RUNTIME_CONFIGS, ids=lambda p: f"{p['verify']}-{p.get('budget', 0)}")
def test_cuda_graph_runtime_equals_generic_and_ar_in_float32(params, target):
    """The captured steps replay correctly across key-span buckets (200 tokens cross 128); on the
    hybrid the recurrent state is restored after each warm-up and committed on the device."""
    pair = engine.load(target, "random", device="cuda", dtype="float32")
    ids = pair.encode("Graphs replay the same kernels on new positions.")
    temp = dict(temperature=params.get("temperature", 0.0), seed=params.get("seed", 0))
    ar_generic = engine.generate(pair, ids, EngineConfig(verify="ar", draft_path="generic", **temp), 200,
                                 ignore_eos=True).tokens
    ar = engine.generate(pair, ids, EngineConfig(verify="ar", **temp), 200, ignore_eos=True).tokens
    assert ar == ar_generic
    spans = {k[1] for k in pair._static_decoder.graphs._captured if k[0] == "ar"}
    assert 128 in spans and len(spans) >= 2  # the second bucket is capped at the cache's capacity
    generic = engine.generate(pair, ids, EngineConfig(**params, draft_path="generic"), 200, ignore_eos=True)
    runtime = engine.generate(pair, ids, EngineConfig(**params), 200, ignore_eos=True)
    assert runtime.tokens == generic.tokens == ar
    assert runtime.stats.accept_lengths == generic.stats.accept_lengths
    captured = pair._static_decoder.graphs._captured
    for kind in ("propose", "verify"):
        spans = {k[1] for k in captured if k[0] == kind}
        assert 128 in spans and len(spans) >= 2, (kind, spans)
    again = engine.generate(pair, ids, EngineConfig(**params), 200, ignore_eos=True)  # replay only
    assert again.tokens == ar


def test_hybrid_graphs_recapture_when_the_tree_buffers_grow():
    """A larger budget reallocates the per-node recurrent buffers: graphs captured on the old ones
    must not be replayed."""
    pair = engine.load("tiny-hybrid", "random", device="cuda", dtype="float32")
    ids = pair.encode("Buffers grow, graphs follow.")
    ar = engine.generate(pair, ids, EngineConfig(verify="ar"), 64, ignore_eos=True).tokens
    for budget in (4, 16, 4):
        cfg = EngineConfig(verify="ddtree", budget=budget, top_k=4, block_size=8)
        assert engine.generate(pair, ids, cfg, 64, ignore_eos=True).tokens == ar, budget


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_grammar_on_cuda_graphs_equals_constrained_ar(target):
    """AR with the bitmask inside its captured step, and `commit` on the captured speculative steps."""
    pytest.importorskip("xgrammar")
    from engine.workloads import Prompt

    tools = ({"type": "function", "function": {"name": "n", "description": "note", "parameters": {
        "type": "object", "properties": {"t": {"type": "string"}}, "required": ["t"]}}},)
    pair = engine.load(target, "random", device="cuda", dtype="float32")
    ids = pair.encode(Prompt(messages=({"role": "user", "content": "Take a note."},), tools=tools))
    g = pair.grammar_for(tools)
    want = engine.generate(pair, ids, EngineConfig(verify="ar", grammar="commit", draft_path="generic"), 96,
                           ignore_eos=True, grammar=g).tokens
    for params in (dict(verify="ar"), dict(verify="chain"), dict(verify="ddtree", budget=8, top_k=3)):
        got = engine.generate(pair, ids, EngineConfig(**params, grammar="commit"), 96, ignore_eos=True, grammar=g)
        assert got.tokens == want, params
        assert got.stats.loop == "graphs", params
        if params["verify"] == "ar":  # the bitmask is read inside the captured AR step
            assert any(k[0] == "ar" and k[2] for k in pair._static_decoder.graphs._captured)
