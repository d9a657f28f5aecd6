"""The oracle test drafts (engine/decoding/drafters.py): ``oracle:P1,P2,...`` gives each prompt its own P,
honoured in what the target accepts; the taught oracle runs on the runtime's steps with the P it was
assigned per text. Every output equals AR's (float32, CPU)."""

import pytest
import torch

import engine
from engine import EngineConfig, EngineInputError
from engine.decoding import runtime
from engine.decoding.drafters import OracleDrafter, TaughtOracleDrafter
from engine.decoding.policy import StepCosts
from engine.registry import check_draft_spec, parse_oracle
from tests.engine.decoding.runtime_helpers import NoHostRead

TEXTS = ["Hello there, how are you today?", "def add(a, b):\n    return", "The weather is", "Once upon a time"]


def _group_al(result, ps):
    """Committed tokens per step of the prompts of each P."""
    steps, tokens = {}, {}
    for r, p in zip(result.prompts, ps, strict=True):
        steps[p] = steps.get(p, 0) + r.steps
        tokens[p] = tokens.get(p, 0) + r.acceptance_length * r.steps
    return {p: tokens[p] / steps[p] for p in steps}


def test_parse_oracle_reads_one_p_or_one_per_prompt():
    assert parse_oracle("oracle:0.3") == (0.3,)
    assert parse_oracle("oracle:0.1,0.5,0.9") == (0.1, 0.5, 0.9)
    check_draft_spec("oracle:0,1")


@pytest.mark.parametrize("spec, says", [
    ("oracle:", "P='' is not a number"),
    ("oracle:x", "P='x' is not a number"),
    ("oracle:1.5", "0 <= P <= 1, but got P='1.5'"),
    ("oracle:0.1,,0.5", "P number 2 ('') is not a number"),
    ("oracle:0.1,0.5,-0.2", "0 <= P <= 1, but got P number 3 ('-0.2')"),
    ("oracle:0.1,nan", "P number 2 ('nan')"),
])
def test_a_bad_oracle_spec_names_the_item_and_the_rule(spec, says):
    with pytest.raises(EngineInputError) as err:
        check_draft_spec(spec)
    assert says in str(err.value) and repr(spec) in str(err.value)


def test_each_prompt_keeps_its_p_in_the_order_first_met_and_outputs_equal_ar():
    """``oracle:0,1``: the first and third prompts met take P = 0 (the chain accepts whole blocks), the
    second P = 1 (every slot corrupted: the chain accepts nothing); a later pass in another order keeps
    each prompt's P."""
    pair = engine.load("tiny-dense", "oracle:0,1", device="cpu", dtype="float32")
    prompts = [pair.encode(t) for t in TEXTS[:3]]
    ar = engine.bench(pair, EngineConfig(verify="ar"), prompts, 24, ignore_eos=True).outputs
    first = engine.bench(pair, EngineConfig(verify="chain"), prompts, 24, reference=ar, ignore_eos=True)
    again = engine.bench(pair, EngineConfig(verify="chain"), prompts[::-1], 24, reference=ar[::-1], ignore_eos=True)
    assert [r.acceptance_length for r in first.prompts] == [16.0, 1.0, 16.0]
    assert [r.acceptance_length for r in again.prompts] == [16.0, 1.0, 16.0]
    assert first.exact_match == again.exact_match == 1.0
    assert [pair.drafter.p_for(p) for p in prompts] == [0.0, 1.0, 0.0]


def test_a_mixed_oracle_accepts_as_each_prompts_p_says():
    """P = 0.2 and 0.8 cycling over four prompts: the chain's AL per P near 1 + sum (1 - P)^j (4.86 and
    1.25 over 15 slots; the generation's end cuts its last step short: 4.5 and 1.27 measured), a tree's
    ordered alike and higher, all exact."""
    pair = engine.load("tiny-dense", "oracle:0.2,0.8", device="cpu", dtype="float32")
    prompts = [pair.encode(t) for t in TEXTS]
    ar = engine.bench(pair, EngineConfig(verify="ar"), prompts, 48, ignore_eos=True).outputs
    ps = [0.2, 0.8, 0.2, 0.8]
    chain = engine.bench(pair, EngineConfig(verify="chain"), prompts, 48, reference=ar, ignore_eos=True)
    al = _group_al(chain, ps)
    assert 3.5 < al[0.2] < 6.0 and 1.0 <= al[0.8] < 1.6, al
    tree = engine.bench(pair, EngineConfig(verify="ddtree", budget=32), prompts, 48, reference=ar, ignore_eos=True)
    tree_al = _group_al(tree, ps)
    assert tree_al[0.2] > tree_al[0.8] > 1.2, tree_al  # side branches recover the corrupted slots' true tokens
    assert chain.exact_match == tree.exact_match == 1.0


def test_the_host_oracle_refuses_no_probability():
    with pytest.raises(EngineInputError):
        OracleDrafter(torch.nn.Linear(2, 2), [])


def _taught(target: str, n_new: int = 40):
    """A fresh pair (its drafter replaced) with the random draft taught AR's texts of the first three prompts."""
    pair = engine.load(target, "random", device="cpu", dtype="float32")
    prompts = [pair.encode(t) for t in TEXTS[:3]]
    block = pair.drafter.block_size
    taught = engine.bench(pair, EngineConfig(verify="ar"), prompts, n_new + block, ignore_eos=True).outputs
    base = pair.drafter
    pair.drafter = TaughtOracleDrafter(base.draft, base.target, [p + t for p, t in zip(prompts, taught, strict=True)])
    return pair, prompts, [t[:n_new] for t in taught]


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_the_taught_oracle_gives_each_text_its_p_on_the_runtime_and_generic_loops(target):
    pair, prompts, ar = _taught(target)
    assert pair.drafter.assign([0.0, 1.0]) == [0.0, 1.0, 0.0]
    for path in ("runtime", "generic"):
        chain = engine.bench(pair, EngineConfig(verify="chain", draft_path=path), prompts, 40, reference=ar,
                             ignore_eos=True)
        assert chain.loops == {path: 3} and chain.exact_match == 1.0
        als = [r.acceptance_length for r in chain.prompts]
        assert als[0] == als[2] == 16.0 and als[1] < 1.2, als  # (a decoy may be the true token: 1 in 272)
        cfg = EngineConfig(verify="ddtree", budget=16, policy="adaptive", policy_levels=2, draft_path=path)
        pair.step_costs(cfg, costs=StepCosts({0: 1.0, 8: 1.4, 16: 1.6}))  # (scripted: nothing measured)
        adaptive = engine.bench(pair, cfg, prompts, 40, reference=ar, ignore_eos=True)
        assert adaptive.exact_match == 1.0 and {0, 16} <= set(adaptive.step_budgets)  # AR steps at P = 1
    pair.drafter.assign([0.5])  # in place: the same tables, another P
    half = engine.bench(pair, EngineConfig(verify="chain", draft_path="runtime"), prompts, 40, reference=ar,
                        ignore_eos=True)
    assert half.exact_match == 1.0 and 1.6 < half.acceptance_length < 2.6  # (chain at P = 0.5: 2.0 expected)


def test_the_taught_oracles_proposal_reads_nothing_back_on_the_host(monkeypatch):
    """Every step the runtime would capture (propose, verify; the adaptive policy's too) with the oracle's
    logits: no op that reads a device value back (it would invalidate a CUDA graph's capture)."""
    pair, prompts, ar = _taught("tiny-dense", 24)
    pair.drafter.assign([0.3])
    original, kinds = runtime.Graphs.run, set()

    def checked(graphs, key, fn, *args):
        def guarded(*a):
            with NoHostRead():
                return fn(*a)
        kinds.add(key[0])
        return original(graphs, key, guarded, *args)

    monkeypatch.setattr(runtime.Graphs, "run", checked)
    adaptive = EngineConfig(verify="ddtree", budget=8, policy="adaptive", policy_levels=2, draft_path="runtime")
    pair.step_costs(adaptive, costs=StepCosts({0: 1.0, 4: 1.2, 8: 1.3}))
    for cfg in (EngineConfig(verify="ddtree", budget=8, draft_path="runtime"), adaptive):
        assert engine.bench(pair, cfg, prompts[:1], 24, reference=ar[:1], ignore_eos=True).exact_match == 1.0
    assert kinds == {"propose", "verify"}


def test_the_taught_oracle_on_a_text_it_was_not_taught_is_slow_but_exact():
    pair, _, _ = _taught("tiny-dense")
    pair.drafter.assign([0.0])
    other = pair.encode("Something else entirely, never taught.")
    ar = engine.generate(pair, other, EngineConfig(verify="ar"), 24, ignore_eos=True).tokens
    gen = engine.generate(pair, other, EngineConfig(verify="chain", draft_path="runtime"), 24, ignore_eos=True)
    assert gen.tokens == ar


def test_the_taught_oracle_refuses_bad_probabilities_and_a_longer_block():
    pair, prompts, _ = _taught("tiny-dense", 8)
    for bad in ([], [1.5]):
        with pytest.raises(EngineInputError, match="probabilities in"):
            pair.drafter.assign(bad)
    with pytest.raises(EngineInputError, match="a block of 32 was asked for"):
        engine.generate(pair, prompts[0], EngineConfig(verify="chain", block_size=32, draft_path="runtime"), 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_the_taught_oracle_on_captured_graphs_equals_ar_in_bfloat16_and_follows_each_assign(target):
    """What ``gpu_bench.py oracle`` times: the taught oracle inside the runtime's CUDA graphs (AR's
    text taught from the graphs' AR), fixed, chain and adaptive steps equal to AR; a later ``assign``
    changes the P the same captured proposals read."""
    pair = engine.load(target, "random", device="cuda", dtype="bfloat16")
    prompts = [pair.encode(t) for t in TEXTS[:3]]
    ar_cfg = EngineConfig(verify="ar", draft_path="runtime")
    taught = engine.bench(pair, ar_cfg, prompts, 56, ignore_eos=True).outputs
    ar = [t[:40] for t in taught]
    base = pair.drafter
    pair.drafter = oracle = TaughtOracleDrafter(base.draft, base.target, [p + t for p, t in zip(prompts, taught,
                                                                                                 strict=True)])
    oracle.assign([0.0, 1.0])
    chain = EngineConfig(verify="chain", draft_path="runtime")
    first = engine.bench(pair, chain, prompts, 40, reference=ar, ignore_eos=True)
    assert first.loops == {"graphs": 3} and first.exact_match == 1.0
    als = [r.acceptance_length for r in first.prompts]
    assert als[0] == als[2] == 16.0 and als[1] < 1.2, als
    for cfg in (EngineConfig(verify="ddtree", budget=32, draft_path="runtime"),
                EngineConfig(verify="ddtree", budget=32, policy="adaptive", policy_levels=3, draft_path="runtime")):
        assert engine.bench(pair, cfg, prompts, 40, reference=ar, ignore_eos=True, ar_config=ar_cfg).exact_match == 1.0
    oracle.assign([1.0])
    assert engine.bench(pair, chain, prompts, 40, reference=ar, ignore_eos=True).acceptance_length < 1.2
