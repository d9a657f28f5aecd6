"""GPU checks (skipped without CUDA): float32 stays exact on the device; bf16 runs every path."""

import itertools

import pytest
import torch

import engine
from engine import EngineConfig, EngineInputError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PATHS = list(itertools.product(["chain", "ddtree"], ["replay", "fast"], ["generic", "auto", "runtime"]))


def _runs(pair, cfg) -> bool:
    """Whether ``cfg`` runs on ``pair``; ``draft_path="runtime"`` where the runtime refuses it (a
    host-side draft, replay on a hybrid target) must raise, with the reason, not fall back."""
    reason = pair.refusal(cfg)
    if reason is not None:
        with pytest.raises(EngineInputError, match="cannot run"):
            engine.generate(pair, pair.encode("refused"), cfg, 4, ignore_eos=True)
    return reason is None


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_float32_on_cuda_equals_ar_on_every_path(target):
    pair = engine.load(target, "oracle:0.3", device="cuda", dtype="float32")
    ids = pair.encode("Hello there, how are you today?")
    ar = engine.generate(pair, ids, EngineConfig(verify="ar"), 48, ignore_eos=True).tokens
    for verify, rollback, path in PATHS:
        cfg = EngineConfig(verify=verify, rollback=rollback, draft_path=path, budget=16, top_k=4, block_size=8)
        if not _runs(pair, cfg):  # the oracle proposes on the host: the runtime refuses it
            continue
        gen = engine.generate(pair, ids, cfg, 48, ignore_eos=True)
        assert gen.tokens == ar, (verify, rollback, path)
        assert gen.stats.acceptance_length > 1.0


@pytest.mark.parametrize("draft", ["random", "oracle:0.3", "random@q8_0", "random@q4_k_m"])
@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_bfloat16_equals_ar_bit_for_bit_on_every_path(target, draft):
    """The row-invariant decode steps (issue #21): every path's output equals AR's captured step
    token for token in bf16, where random weights tie often. The oracle's trees accept deep paths
    (the generic loop: it drafts on the host); the random draft's are verified whole but rarely
    accepted (the runtime's graphs); a draft in blocks (``@q8_0``, ``@q4_k_m``: at these widths its
    fallbacks) proposes through the few-row kernel, in the captured graphs too."""
    pair = engine.load(target, draft, device="cuda", dtype="bfloat16")
    prompts = [pair.encode(t) for t in ("Hello there", "def f(x):", "The capital of France is")]
    ar = EngineConfig(verify="ar")
    ref = engine.bench(pair, ar, prompts, 64, ignore_eos=True)
    assert ref.loops == {"graphs": 3}
    for verify, rollback, path in PATHS:
        cfg = EngineConfig(verify=verify, rollback=rollback, draft_path=path, budget=16, top_k=4)
        if not _runs(pair, cfg):
            continue
        res = engine.bench(pair, cfg, prompts, 64, reference=ref.outputs, ignore_eos=True, ar_config=ar)
        assert res.new_tokens == 3 * 64
        assert set(res.loops) == {pair.decode_paths(cfg)[0]}
        divs = [(p.index, p.divergence.to_dict() if p.divergence else p.first_divergence)
                for p in res.prompts if not p.exact]
        assert res.exact_match == 1.0, (verify, rollback, path, divs)


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
    spans = {k[1] for k in pair._runtime_decoder.graphs.keys() if k[0] == "ar"}
    assert 128 in spans and len(spans) >= 2  # the second bucket is capped at the cache's capacity
    generic = engine.generate(pair, ids, EngineConfig(**params, draft_path="generic"), 200, ignore_eos=True)
    runtime = engine.generate(pair, ids, EngineConfig(**params), 200, ignore_eos=True)
    assert runtime.tokens == generic.tokens == ar
    assert runtime.stats.accept_lengths == generic.stats.accept_lengths
    captured = pair._runtime_decoder.graphs.keys()
    for kind in ("propose", "verify"):
        spans = {k[1] for k in captured if k[0] == kind}
        assert 128 in spans and len(spans) >= 2, (kind, spans)
    again = engine.generate(pair, ids, EngineConfig(**params), 200, ignore_eos=True)  # replay only
    assert again.tokens == ar


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hybrid_graphs_recapture_when_the_tree_buffers_grow(dtype):
    """A larger budget reallocates the per-node recurrent buffers: graphs captured on the old ones
    must not be replayed, and the captures after them take a fresh memory pool. The order is
    exact_bench's, which tripped PyTorch's allocator on the 27B shape: AR, chain on the graphs and
    on the generic loop (replay), then trees of growing budgets, with each result kept alive."""
    pair = engine.load("tiny-hybrid", "random", device="cuda", dtype=dtype)
    ids = pair.encode("Buffers grow, graphs follow.")
    ar = engine.generate(pair, ids, EngineConfig(verify="ar"), 64, ignore_eos=True).tokens
    kept = []
    configs = [EngineConfig(verify="chain", block_size=8),
               EngineConfig(verify="chain", block_size=8, rollback="replay", draft_path="generic")]
    configs += [EngineConfig(verify="ddtree", budget=b, top_k=k, block_size=8)
                for b, k in ((4, 4), (22, 8), (64, 8), (4, 1))]
    for cfg in configs:
        kept.append(engine.generate(pair, ids, cfg, 64, ignore_eos=True))
        assert kept[-1].tokens == ar, cfg


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_the_runtime_captures_the_pytorch_forms_too(target):
    """``draft_path: runtime`` with ``kernels: eager``: the PyTorch forms inside captured steps equal
    the eager AR token for token (every such trial of the 2026-12-04 sweep failed in capture)."""
    pair = engine.load(target, "random", device="cuda", dtype="float32")
    ids = pair.encode("Captured steps, PyTorch forms.")
    ar = engine.generate(pair, ids, EngineConfig(verify="ar", kernels="eager", draft_path="generic"), 48,
                         ignore_eos=True).tokens
    for params in (dict(verify="ar"), dict(verify="chain"), dict(verify="ddtree", budget=12, top_k=4)):
        got = engine.generate(pair, ids, EngineConfig(**params, kernels="eager", draft_path="runtime"), 48,
                              ignore_eos=True)
        assert got.stats.loop == "graphs" and got.tokens == ar, params


def test_a_failed_capture_names_its_op_and_the_next_capture_works():
    """A step that cannot be captured (here it reads a count back) raises a RuntimeError naming the
    step and the first error, and leaves the allocator able to capture again (it once kept recording
    into the failed capture's pool: every later capture in the process failed)."""
    from engine.decoding.graphs import Graphs

    x = torch.arange(8, device="cuda", dtype=torch.float32)
    graphs = Graphs(True, [])
    with pytest.raises(RuntimeError, match="capturing the 'verify' step as a CUDA graph failed"):
        graphs.run(("verify", 8), lambda t: t[t > 3].sum(), x)
    out = graphs.run(("ar", 8), lambda t: t * 2, x)
    x.add_(1)
    again = graphs.run(("ar", 8), lambda t: t * 2, x)  # a replay: the captured output, rewritten
    assert again is out and torch.equal(again, (torch.arange(8, device="cuda") + 1.0) * 2)


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_grammar_on_cuda_graphs_equals_constrained_ar(target):
    """AR with the bitmask inside its captured step, and `commit` on the captured speculative steps."""
    pytest.importorskip("xgrammar")
    from engine.data.prompts import Prompt

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
            # an AR step's key: ("ar", key span, temperature, seed, keep, ar_mask, record_margins, kernels)
            assert any(k[0] == "ar" and k[-3] is True for k in pair._runtime_decoder.graphs.keys())


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_adaptive_graphs_verify_the_proposal_they_follow(monkeypatch, target):
    """The adaptive policy's captured steps (float32): AR steps are plain AR's graph plus the feature
    copy, and the first proposal after them is another captured proposal (a wider draft context
    window), whose outputs are other buffers: the tree step after it is captured on those. A draft
    proposing the target's own tokens must be accepted whole at every tree step, before AR runs and
    after them (a step replayed on another proposal's buffers would verify a stale tree and accept
    next to nothing), and every token is AR's."""
    from engine.decoding.policy import AdaptivePolicy, StepCosts

    pair = engine.load(target, "random", device="cuda", dtype="float32")
    ids = pair.encode("Captured proposals after AR steps.")
    truth = engine.generate(pair, ids, EngineConfig(verify="ar"), 112, ignore_eos=True).tokens
    truth_t = torch.tensor(truth, device="cuda")
    real = pair.drafter.propose_static

    def propose(seq, start, block_size, window, features, *context):  # tensor ops only: it is captured
        logits = real(seq, start, block_size, window, features, *context)
        pos = (start - len(ids) + torch.arange(1, block_size, device=start.device)).clamp(0, len(truth) - 1)
        return torch.zeros_like(logits).scatter(1, truth_t[pos][:, None], 10.0)

    script = itertools.cycle([0, 0, 0, 16, 16, 0, 0, 0, 16, 0, 4, 16, 0, 0, 8, 16, 0, 0, 0, 4])
    monkeypatch.setattr(pair.drafter, "propose_static", propose)
    monkeypatch.setattr(AdaptivePolicy, "choose", lambda self: (next(script), 1.0))
    cfg = EngineConfig(verify="ddtree", budget=16, top_k=3, block_size=8, policy="adaptive", policy_levels=3,
                       probe_every=4, probe_max=4)  # (the scripted AR runs: 3 at most, a window of 8 + 3)
    gen = engine.generate(pair, ids, cfg, 96, ignore_eos=True, step_costs=StepCosts({0: 1, 4: 1, 8: 1, 16: 1}))
    assert gen.stats.loop == "graphs" and gen.tokens == truth[:96]
    whole = {4: 5, 8: 8, 16: 8}  # the forced top-1 chain: 4 nodes at budget 4, the draft's depth (7) beyond
    assert [al for b, al in zip(gen.stats.step_budgets, gen.stats.accept_lengths, strict=True) if b] == \
        [whole[b] for b in gen.stats.step_budgets if b]
    keys = pair._runtime_decoder.graphs.keys()
    assert {k[-2] for k in keys if k[0] == "propose"} == {8, 8 + 3}
    assert {k[3] for k in keys if k[0] == "verify" and k[2]} == {8, 8 + 3}


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_a_ring_of_features_on_the_graphs_drafts_as_a_row_a_position_does(monkeypatch, target):
    """A 1,300-token prompt wraps the runtime's ring of 1,024 feature rows (``decode.feature_rows``): in bf16
    on the captured graphs every output equals AR's and the draft's context K/V of every committed
    position are a row-a-position run's bits."""
    from engine.decoding import decode
    from engine.memory import release_memory

    pair = engine.load(target, "random", device="cuda", dtype="bfloat16")
    prompt = torch.randint(5, 250, (1300,), generator=torch.Generator().manual_seed(0)).tolist()
    cfg = EngineConfig(budget=16, top_k=4, draft_path="runtime")
    ar = engine.generate(pair, prompt, EngineConfig(verify="ar"), 48, ignore_eos=True).tokens
    runs = []
    for ring in (decode.FEATURE_RING_ROWS, 1 << 30):
        monkeypatch.setattr(decode, "FEATURE_RING_ROWS", ring)
        release_memory(pair)
        gen = engine.generate(pair, prompt, cfg, 48, ignore_eos=True)
        assert gen.stats.loop == "graphs" and gen.tokens == ar
        k, v = pair._runtime_decoder._draft_kv
        n = len(prompt) + len(gen.tokens) - 1
        runs.append((pair._workspace.features.shape[0], k[:, :n].clone(), v[:, :n].clone()))
    assert runs[0][0] == 1024 and runs[1][0] > 1300
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2])
