"""The dedicated runtime's step functions (engine/decoding/runtime.py), run eagerly on the CPU: the same
functions the CUDA graphs capture. Output must equal AR and the generic loop token for token."""


import pytest
import torch

import engine
from engine import EngineConfig
from engine.decoding import runtime
from engine.decoding.decode import generate_ar, generate_speculative
from engine.decoding.runtime import RuntimeDecoder, bucket_for, loop_for, refusal
from tests.engine.decoding.runtime_helpers import NoHostRead, peeking_draft
from tests.engine.engine_pairs import assert_margins_equal, direct_margins, pair_for

pytestmark = pytest.mark.xdist_group("test_runtime")  # its module fixture loads the real pair: once


def test_buckets_are_powers_of_two_capped_at_the_buffer():
    assert bucket_for(1, 4096) == 128 and bucket_for(129, 4096) == 256 and bucket_for(3000, 2500) == 2500


def test_the_runtime_refuses_what_it_cannot_run_and_auto_falls_back():
    """``refusal``: a host-side draft, ``walk`` on a prompt with a grammar, replay rollback on a hybrid
    target. ``loop_for``: ``runtime`` runs eagerly off CUDA and raises the reason where refused;
    ``auto`` takes the captured runtime on CUDA only, else the generic loop; ``generic`` is generic."""
    dense = pair_for("tiny-dense", "random")
    ddtree = EngineConfig(verify="ddtree", draft_path="runtime")
    assert refusal(dense, ddtree, False) is None
    assert loop_for(dense, ddtree, False) == "runtime"  # CPU: the runtime's steps, eagerly
    assert loop_for(dense, EngineConfig(verify="ddtree"), False) == "generic"  # auto: no graphs on a CPU
    assert loop_for(dense, EngineConfig(verify="ddtree", draft_path="generic"), False) == "generic"
    # a grammar: AR masks inside its step, `commit` advances on committed tokens; `walk` is the generic loop's
    assert refusal(dense, EngineConfig(verify="ar", grammar="walk"), True) is None
    assert refusal(dense, EngineConfig(verify="ddtree", grammar="commit"), True) is None
    assert refusal(dense, EngineConfig(verify="ddtree", grammar="walk"), False) is None  # no grammar to place
    assert "grammar='walk'" in refusal(dense, EngineConfig(verify="ddtree", grammar="walk"), True)
    oracle = pair_for("tiny-dense", "oracle:0.3")
    assert "proposes on the host" in refusal(oracle, EngineConfig(verify="chain"), False)
    assert refusal(oracle, EngineConfig(verify="ar"), False) is None
    with pytest.raises(engine.EngineInputError, match="draft_path='runtime' cannot run verify='chain'.*host"):
        loop_for(oracle, EngineConfig(verify="chain", draft_path="runtime"), False)
    assert loop_for(oracle, EngineConfig(verify="chain"), False) == "generic"  # auto
    hybrid = pair_for("tiny-hybrid", "random")
    assert refusal(hybrid, EngineConfig(verify="chain"), False) is None
    assert refusal(hybrid, EngineConfig(verify="ar", rollback="replay"), False) is None
    # replay re-runs a variable number of tokens: not a fixed-shape step
    assert "rollback='replay'" in refusal(hybrid, EngineConfig(verify="ddtree", rollback="replay"), False)
    # the decode loops refuse it too, with the reason: nothing falls back silently
    with pytest.raises(engine.EngineInputError, match="rollback='replay'"):
        generate_speculative(hybrid, [1, 2, 3], EngineConfig(verify="ddtree", rollback="replay",
                                                             draft_path="runtime"), 4)
    gen = generate_speculative(hybrid, [1, 2, 3], EngineConfig(verify="ddtree", rollback="replay"), 4)
    assert gen.stats.loop == "generic"  # auto
    assert dense.refusal(ddtree) is None and hybrid.refusal(EngineConfig(verify="chain", rollback="replay")) is None
    assert "replay" in hybrid.refusal(EngineConfig(verify="chain", rollback="replay", draft_path="runtime"))


def test_the_ar_twin_decodes_as_the_config_does():
    """The AR a config is exact against runs the loop the config takes (``auto`` falls back to the
    generic loop for what the runtime refuses), not the one ``auto`` gives AR."""
    dense, hybrid = pair_for("tiny-dense", "random"), pair_for("tiny-hybrid", "random")
    twin = dense.ar_twin(EngineConfig(verify="ddtree", budget=9, draft_path="runtime", kernels="eager"))
    assert (twin.verify, twin.draft_path, twin.budget, twin.kernels) == ("ar", "runtime", 9, "eager")
    assert dense.decode_paths(twin) == dense.decode_paths(EngineConfig(verify="ddtree", draft_path="runtime"))
    assert dense.ar_twin(EngineConfig(verify="ddtree")).draft_path == "generic"  # auto, on a CPU
    replay = EngineConfig(verify="chain", rollback="replay")  # auto: refused by the runtime on a hybrid
    assert hybrid.decode_paths(replay)[0] == "generic" and hybrid.ar_twin(replay).draft_path == "generic"
    assert hybrid.ar_twin(replay.replace(rollback="fast", draft_path="runtime")).draft_path == "runtime"


def test_the_runtime_keeps_the_tree_on_the_device_whatever_draft_path_says(monkeypatch):
    """``use_runtime=True`` on a ``draft_path="generic"`` config: the runtime's steps never take the
    host's top-k and tree (a captured graph cannot read the host)."""
    import engine.decoding.loop

    def host_tree(*a, **k):
        raise AssertionError("the runtime built its tree on the host")

    monkeypatch.setattr(engine.decoding.loop, "build_tree_host", host_tree)
    pair = pair_for("tiny-dense", "random")
    ids = pair.encode("Trees stay where the graphs are.")
    ar = generate_ar(pair, ids, EngineConfig(verify="ar"), 24).tokens
    cfg = EngineConfig(verify="ddtree", budget=8, top_k=3, draft_path="generic")
    assert generate_speculative(pair, ids, cfg, 24, use_runtime=True).tokens == ar
    with pytest.raises(AssertionError, match="on the host"):  # the generic loop does build it there
        generate_speculative(pair, ids, cfg, 24, use_runtime=False)


CONFIGS = [
    dict(verify="chain"),
    dict(verify="ddtree", budget=12, top_k=4),
    dict(verify="ddtree", budget=6, top_k=2, chain_seed=2, target_feat_ctx=5),
    dict(verify="ddtree", budget=8, top_k=3, temperature=0.8, seed=3),
]


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
@pytest.mark.parametrize("params", CONFIGS, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
def test_runtime_steps_equal_ar_and_the_generic_loop(params, target):
    pair = pair_for(target, "random")
    ids = pair.encode("The runtime must not change a single token.")
    temp = dict(temperature=params.get("temperature", 0.0), seed=params.get("seed", 0))
    ar = generate_ar(pair, ids, EngineConfig(verify="ar", **temp), 40).tokens
    assert generate_ar(pair, ids, EngineConfig(verify="ar", **temp), 40, use_runtime=True).tokens == ar
    cfg = EngineConfig(**params)
    generic = generate_speculative(pair, ids, cfg, 40, use_runtime=False)
    on_runtime = generate_speculative(pair, ids, cfg, 40, use_runtime=True)
    assert on_runtime.tokens == generic.tokens == ar
    assert on_runtime.stats.accept_lengths == generic.stats.accept_lengths
    assert (on_runtime.stats.loop, generic.stats.loop) == ("runtime", "generic")  # what ran is recorded


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
@pytest.mark.parametrize("verify", ["ar", "chain", "ddtree"])
def test_the_captured_steps_read_nothing_back_with_the_pytorch_forms(monkeypatch, target, verify):
    """What the runtime captures (every function ``Graphs.run`` is given) has no op that reads a
    device value on the host, with the PyTorch forms too (``kernels: eager`` on CUDA, the forms
    these CPU runs take): a captured step can hold it. The step attention's mask was built by
    boolean indexing (a count read back): every runtime + eager trial of the 2026-12-04 sweep failed
    in capture."""
    pair = pair_for(target, "random")
    original = runtime.Graphs.run
    calls = []

    def checked(graphs, key, fn, *args):
        def guarded(*a):
            with NoHostRead():
                return fn(*a)
        calls.append(key[0])
        return original(graphs, key, guarded, *args)

    monkeypatch.setattr(runtime.Graphs, "run", checked)
    cfg = EngineConfig(verify=verify, budget=12, top_k=4, draft_path="runtime", kernels="eager")
    gen = engine.generate(pair, pair.encode("Nothing read back inside a step."), cfg, 24, ignore_eos=True)
    assert gen.stats.loop == "runtime" and len(gen.tokens) == 24
    assert set(calls) == ({"ar"} if verify == "ar" else {"propose", "verify"})


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_a_stop_token_ends_the_runtime_loops_as_the_generic_ones_and_the_step_launched_ahead_leaks_nothing(target):
    """The runtime launches each step before reading the last one: at a stop token that step is
    not part of the generation (not counted, not timed), and the next generation is unaffected."""
    pair = pair_for(target, "random")
    ids = pair.encode("A stop token in the middle.")
    free = generate_ar(pair, ids, EngineConfig(verify="ar"), 40).tokens
    stop = (free[11],)  # AR stops after its 12th token (or at an earlier occurrence of that token)
    cut = free[: free.index(stop[0]) + 1]
    for cfg in (EngineConfig(verify="ar"), EngineConfig(verify="chain"), EngineConfig(verify="ddtree", budget=8)):
        run = generate_ar if cfg.verify == "ar" else generate_speculative
        generic = run(pair, ids, cfg, 40, stop, use_runtime=False)
        on_runtime = run(pair, ids, cfg, 40, stop, use_runtime=True)
        assert on_runtime.tokens == generic.tokens == cut
        assert on_runtime.stats.steps == generic.stats.steps
        cache = pair._workspace.cache
        if target == "tiny-hybrid":  # the step launched ahead moved the recurrent state on: no continuing
            assert cache.ahead
            with pytest.raises(RuntimeError, match="advanced past the .* committed tokens"):
                pair.target(torch.tensor(cut[-1:]), cache, cache.length)
        assert run(pair, ids, cfg, 40, use_runtime=True).tokens == free  # the same workspace, again


_SMOL_AR: dict[str, list[int]] = {}


@pytest.fixture(scope="module")
def smollm2():
    return engine.load("smollm2-135m-instruct", "smollm2-135m-dflash", device="cpu", dtype="float32")


@pytest.mark.parametrize("verify", ["chain", "ddtree"])
def test_runtime_steps_on_the_real_pair_accept_and_stay_exact(smollm2, verify):
    from engine.data.prompts import Prompt

    ask = {"role": "user", "content": "Write a Python function that adds two numbers."}
    ids = smollm2.encode(Prompt(messages=[ask]))
    if "ar" not in _SMOL_AR:  # one AR reference for both verify modes
        _SMOL_AR["ar"] = engine.generate(smollm2, ids, EngineConfig(verify="ar", draft_path="generic"), 32,
                                         ignore_eos=True).tokens
    ar = _SMOL_AR["ar"]
    cfg = EngineConfig(verify=verify, budget=16, top_k=4)
    gen = generate_speculative(smollm2, ids, cfg, 32, use_runtime=True)
    assert gen.tokens == ar
    assert max(gen.stats.accept_lengths) > 1  # the compaction of several accepted nodes is exercised


def test_hybrid_runtime_steps_accept_through_side_branches_and_stay_exact():
    """The device commit of recurrent state (accepted node's state, conv window along its path)
    under real acceptance: the oracle's proposals through a DFlash-shaped step are not available
    to the runtime, so a random draft is made to accept by proposing the target's own tokens."""
    pair = pair_for("tiny-hybrid", "random")
    ids = pair.encode("Recurrent state moves on the device.")
    ar = generate_ar(pair, ids, EngineConfig(verify="ar"), 48).tokens

    drafter = pair.drafter
    real, peeking = peeking_draft(pair, len(ids), ar)
    drafter.propose_static = peeking
    try:
        gen = generate_speculative(pair, ids, EngineConfig(verify="ddtree", budget=12, top_k=3, chain_seed=0), 48,
                                   use_runtime=True)
    finally:
        drafter.propose_static = real
    assert gen.tokens == ar
    assert max(gen.stats.accept_lengths) >= 4 and gen.stats.side_branch_steps > 0


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_margins_of_the_runtime_steps_equal_the_generic_loops_and_a_direct_forward(target):
    """record_margins on the runtime: the AR step writes its row's margin at its token's position,
    the verify all its rows', moved along the accepted path (several nodes, side branches) as the
    K/V are; a step launched ahead writes past the committed tokens only. The same numbers as the
    generic loops and as one plain forward (float32)."""
    pair = pair_for(target, "random")
    ids = pair.encode("Margins move with the accepted path.")
    generic_ar = generate_ar(pair, ids, EngineConfig(verify="ar"), 48, use_runtime=False, record_margins=True)
    want = direct_margins(pair, ids, generic_ar.tokens)
    assert_margins_equal(generic_ar, want)
    runtime_ar = generate_ar(pair, ids, EngineConfig(verify="ar"), 48, use_runtime=True, record_margins=True)
    assert runtime_ar.tokens == generic_ar.tokens and runtime_ar.stats.loop == "runtime"
    assert_margins_equal(runtime_ar, want)
    cfg = EngineConfig(verify="ddtree", budget=12, top_k=3, chain_seed=0)
    drafter = pair.drafter
    real, peeking = peeking_draft(pair, len(ids), generic_ar.tokens)
    drafter.propose_static = peeking
    try:
        spec = generate_speculative(pair, ids, cfg, 48, use_runtime=True, record_margins=True)
    finally:
        drafter.propose_static = real
    assert spec.tokens == generic_ar.tokens
    assert max(spec.stats.accept_lengths) >= 4 and spec.stats.side_branch_steps > 0
    assert_margins_equal(spec, want)
    # off: the verify graph of the same key without the margins, and no margins on the generation
    assert generate_speculative(pair, ids, cfg, 48, use_runtime=True).margins is None


def test_ar_chain_and_ddtree_run_one_step_function(monkeypatch):
    """AR is the degenerate case of the runtime's one step: the root alone, no draft. AR, chain and
    DDTree go through ``RuntimeDecoder._step`` in ``RuntimeDecoder.generate``, AR without a tree."""
    from engine.decoding.runtime import RuntimeDecoder

    calls: list[tuple[str, bool]] = []
    step = RuntimeDecoder._step

    def spy(self, key_len, cfg, block, tree, anc, record, constrained):
        calls.append((cfg.verify, tree is None))
        return step(self, key_len, cfg, block, tree, anc, record, constrained)

    monkeypatch.setattr(RuntimeDecoder, "_step", spy)
    assert not hasattr(RuntimeDecoder, "_ar_step") and not hasattr(RuntimeDecoder, "_verify")
    pair = pair_for("tiny-dense", "random")
    ids = pair.encode("One step for every mode.")
    outputs = {}
    for verify in ("ar", "chain", "ddtree"):
        calls.clear()
        gen = (generate_ar if verify == "ar" else generate_speculative)(
            pair, ids, EngineConfig(verify=verify, budget=6, top_k=2), 16, use_runtime=True)
        outputs[verify] = gen.tokens
        assert calls and {c[0] for c in calls} == {verify}
        assert all(no_tree == (verify == "ar") for _, no_tree in calls)
        assert len(calls) >= gen.stats.steps  # (plus a step launched ahead, dropped at the end)
    assert outputs["chain"] == outputs["ar"] == outputs["ddtree"]


def test_margins_are_other_graphs_and_without_them_no_step_writes_any(monkeypatch):
    """The margins change what a captured step does, so they are part of its graph key; a step
    without them leaves the margin buffer alone (no extra work in the graphs that time decoding)."""
    from engine.decoding.graphs import Graphs

    keys = []
    run = Graphs.run
    monkeypatch.setattr(Graphs, "run", lambda self, key, fn, *args: keys.append(key) or run(self, key, fn, *args))
    pair = pair_for("tiny-dense", "random")
    ids = pair.encode("Keys say what a graph does.")
    cfg = EngineConfig(verify="ddtree", budget=6, top_k=2)
    on = generate_speculative(pair, ids, cfg, 12, use_runtime=True, record_margins=True)
    ws = pair._workspace
    with torch.inference_mode():  # (the buffer is an inference tensor, as the decode loops make it)
        ws.margins.fill_(float("nan"))
    assert generate_speculative(pair, ids, cfg, 12, use_runtime=True).tokens == on.tokens
    assert generate_ar(pair, ids, EngineConfig(verify="ar"), 12, use_runtime=True).tokens == on.tokens
    assert pair._workspace is ws and ws.margins.isnan().all()  # nothing written without them
    ar_on = generate_ar(pair, ids, EngineConfig(verify="ar"), 12, use_runtime=True, record_margins=True)
    assert not ws.margins[len(ids) : len(ids) + 12].isnan().any()
    assert ar_on.margins == pytest.approx(on.margins, abs=1e-4)
    # one step function, one key layout: (kind, span, ..., record, kernels) for AR and verify alike
    assert {k[-2] for k in keys if k[0] == "verify"} == {True, False}
    assert {k[-2] for k in keys if k[0] == "ar"} == {True, False}


# --- grammar-constrained decoding on the runtime ---------------------------------------------------

# A free-text argument: where the grammar leaves the choice to the model, a wrong context shows.
TOOLS = ({"type": "function", "function": {"name": "n", "description": "note", "parameters": {
    "type": "object", "properties": {"t": {"type": "string"}}, "required": ["t"]}}},)
GRAMMAR_NEW = 96  # the call's fixed prefix is ~45 byte tokens; free text follows


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_grammar_on_the_runtime_steps_equals_constrained_ar(target):
    """AR masks inside its step (the host fills the bitmask before each replay); ``commit``
    replays the unconstrained step and advances the grammar on the committed tokens."""
    pytest.importorskip("xgrammar")
    from engine.data.prompts import Prompt

    pair = pair_for(target, "random")
    ids = pair.encode(Prompt(messages=({"role": "user", "content": "Turn on the hall light."},), tools=TOOLS))
    g = pair.grammar_for(TOOLS)
    want = generate_ar(pair, ids, EngineConfig(verify="ar", grammar="commit"), GRAMMAR_NEW, gs=g.state(),
                       use_runtime=False, record_margins=True)
    got = generate_ar(pair, ids, EngineConfig(verify="ar", grammar="commit"), GRAMMAR_NEW, gs=g.state(),
                      use_runtime=True, record_margins=True)
    assert got.tokens == want.tokens and got.stats.grammar_ms > 0
    # the margins of the masked rows, the step's as the generic loop's (infinite where one token is allowed)
    assert_margins_equal(got, torch.tensor([want.top_logits, want.margins]).T)
    assert float("inf") in want.margins
    text = pair.tokenizer.decode(want.tokens)
    assert text.startswith("<tool_call>\n{")
    for params in (dict(verify="chain"), dict(verify="ddtree", budget=8, top_k=3, chain_seed=0)):
        cfg = EngineConfig(**params, grammar="commit")
        gen = generate_speculative(pair, ids, cfg, GRAMMAR_NEW, gs=g.state(), use_runtime=True)
        assert gen.tokens == want.tokens, params
    # the adaptive policy's steps (AR steps of the root alone among them) under the grammar: cut at a
    # refused token as a tree step is, on the runtime (commit) and the generic loop (walk, commit)
    from engine.decoding.policy import StepCosts

    cfg = EngineConfig(verify="ddtree", budget=8, top_k=3, chain_seed=0, policy="adaptive", policy_levels=2,
                       probe_every=3)
    for grammar, on_runtime in (("commit", True), ("walk", False), ("commit", False)):
        gen = generate_speculative(pair, ids, cfg.replace(grammar=grammar), GRAMMAR_NEW, gs=g.state(),
                                   use_runtime=on_runtime, step_costs=StepCosts({0: 1.0, 4: 1.8, 8: 2.5}))
        assert gen.tokens == want.tokens and 0 in gen.stats.step_budgets, (grammar, on_runtime)


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_grammar_cuts_after_the_device_commit_are_moved_back(target, monkeypatch):
    """The draft proposes the *unconstrained* continuation, which the device accepts (it is the
    target's own) and the grammar refuses: steps are cut after the device committed them, and the
    position, the new root and (hybrid) the recurrent state are moved back. Output: constrained AR."""
    pytest.importorskip("xgrammar")
    from engine.data.prompts import Prompt

    pair = pair_for(target, "random")
    ids = pair.encode(Prompt(messages=({"role": "user", "content": "Turn on the hall light."},), tools=TOOLS))
    g = pair.grammar_for(TOOLS)
    want = generate_ar(pair, ids, EngineConfig(verify="ar", grammar="commit"), GRAMMAR_NEW, gs=g.state(),
                       record_margins=True)
    real, target = pair.drafter.propose_static, pair.target
    committed_more, cut_at = [], []

    def unconstrained_oracle(seq, start, block_size, window, features, *context):
        logits = real(seq, start, block_size, window, features, *context)  # the runtime's own draft forward
        s = int(start)
        cache = target.new_cache(s + block_size + 2)  # not the workspace's: greedy from here, unconstrained
        last, _ = target(seq[: s + 1], cache, 0, last_only=True)
        fake = torch.zeros_like(logits)
        for j in range(block_size - 1):
            tok = int(last[-1].argmax())
            fake[j, tok] = 10.0
            last, _ = target(torch.tensor([tok]), cache, cache.length, last_only=True)
        return fake

    def spy(self, start, kept, token, path, _cut=RuntimeDecoder._cut):
        committed_more.append(int(self.start) - start > kept)
        cut_at.append(start + kept - len(ids))  # the re-picked token's index among the new tokens
        return _cut(self, start, kept, token, path)

    monkeypatch.setattr(RuntimeDecoder, "_cut", spy)
    pair.drafter.propose_static = unconstrained_oracle
    try:
        gen = generate_speculative(pair, ids, EngineConfig(verify="ddtree", budget=8, top_k=2, grammar="commit"),
                                   GRAMMAR_NEW, gs=g.state(), use_runtime=True, record_margins=True)
    finally:
        pair.drafter.propose_static = real
    assert gen.tokens == want.tokens
    assert any(committed_more)  # the device had committed past the cut, and was moved back
    # Each margin is the one of the row that picked the token: the prefill's (masked) and a cut
    # token's are masked rows, as constrained AR's (infinite where the grammar allows one token); a
    # token the grammar accepted has its unmasked verify row's.
    masked = torch.tensor([want.top_logits, want.margins]).T
    expect = direct_margins(pair, ids, want.tokens)
    picked_masked = [0] + [i for i in cut_at if i < len(want.tokens)]  # a last cut may lie past max_new_tokens
    expect[picked_masked] = masked[picked_masked]
    assert_margins_equal(gen, expect)
    assert masked[picked_masked[1:], 1].isinf().any() and not torch.equal(expect, masked)


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
@pytest.mark.parametrize("use_runtime", [False, True])
def test_ddtree_with_top_k_1_decodes_as_chain(target, use_runtime):
    """Chain is DDTree's degenerate case: top_k 1 with a budget past the draft's depth proposes the
    chain's tree every step, so both loops accept the same lengths and decode the same tokens."""
    pair = pair_for(target, "oracle:0.6" if not use_runtime else "random")
    ids = pair.encode("One path is a tree too.")
    chain = generate_speculative(pair, ids, EngineConfig(verify="chain"), 40, use_runtime=use_runtime)
    tree = generate_speculative(pair, ids, EngineConfig(verify="ddtree", top_k=1, budget=64), 40,
                                use_runtime=use_runtime)
    assert tree.tokens == chain.tokens
    assert tree.stats.accept_lengths == chain.stats.accept_lengths
    if not use_runtime:  # the oracle's paths are accepted deep (the runtime refuses a host-side draft: random there)
        assert chain.stats.acceptance_length > 1.5
