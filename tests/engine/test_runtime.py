"""The dedicated runtime's step functions (engine/runtime.py), run eagerly on the CPU: the same
functions the CUDA graphs capture. Output must equal AR and the generic loop token for token."""

import pytest
import torch

import engine
from engine import EngineConfig
from engine.decode import generate_ar, generate_speculative
from engine.runtime import bucket_for, key_mask, supports
from tests.engine.engine_pairs import pair_for


def test_key_mask_sees_the_committed_slots_and_the_trees_ancestors():
    inner = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # root, two children
    mask = key_mask(torch.tensor([4]), 8, inner)
    assert mask.shape == (3, 8)
    assert mask[0].tolist() == [True] * 4 + [True, False, False, False]
    assert mask[2].tolist() == [True] * 4 + [True, False, True, False]
    assert not mask[:, 7].any()  # past the tree: nothing


def test_buckets_are_powers_of_two_capped_at_the_buffer():
    assert bucket_for(1, 4096) == 128 and bucket_for(129, 4096) == 256 and bucket_for(3000, 2500) == 2500


def test_supports_unconstrained_runtime_with_a_dflash_draft():
    dense = pair_for("tiny-dense", "random")
    assert supports(dense, EngineConfig(verify="ddtree"), False, cuda_only=False)
    assert not supports(dense, EngineConfig(verify="ddtree"), False)  # CPU: no graphs
    assert not supports(dense, EngineConfig(verify="ddtree", draft_path="generic"), False, cuda_only=False)
    assert not supports(dense, EngineConfig(verify="ddtree"), True, cuda_only=False)  # grammar
    assert not supports(pair_for("tiny-dense", "oracle:0.3"), EngineConfig(verify="chain"), False, cuda_only=False)
    hybrid = pair_for("tiny-hybrid", "random")
    assert supports(hybrid, EngineConfig(verify="chain"), False, cuda_only=False)
    assert supports(hybrid, EngineConfig(verify="ar", rollback="replay"), False, cuda_only=False)
    # replay re-runs a variable number of tokens: not a fixed-shape step
    assert not supports(hybrid, EngineConfig(verify="ddtree", rollback="replay"), False, cuda_only=False)


CONFIGS = [
    dict(verify="chain"),
    dict(verify="ddtree", budget=12, top_k=4),
    dict(verify="ddtree", budget=6, top_k=2, chain_seed=2, target_feat_ctx=5),
    dict(verify="ddtree", budget=8, top_k=3, temperature=0.8, seed=3),
]


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
@pytest.mark.parametrize("params", CONFIGS, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
def test_static_steps_equal_ar_and_the_generic_loop(params, target):
    pair = pair_for(target, "random")
    ids = pair.encode("The static runtime must not change a single token.")
    temp = dict(temperature=params.get("temperature", 0.0), seed=params.get("seed", 0))
    ar = generate_ar(pair, ids, EngineConfig(verify="ar", **temp), 40).tokens
    assert generate_ar(pair, ids, EngineConfig(verify="ar", **temp), 40, static=True).tokens == ar
    cfg = EngineConfig(**params)
    generic = generate_speculative(pair, ids, cfg, 40, static=False)
    static = generate_speculative(pair, ids, cfg, 40, static=True)
    assert static.tokens == generic.tokens == ar
    assert static.stats.accept_lengths == generic.stats.accept_lengths


@pytest.fixture(scope="module")
def smollm2():
    return engine.load("smollm2-135m-instruct", "smollm2-135m-dflash", device="cpu", dtype="float32")


@pytest.mark.parametrize("verify", ["chain", "ddtree"])
def test_static_steps_on_the_real_pair_accept_and_stay_exact(smollm2, verify):
    from engine.workloads import Prompt

    ask = {"role": "user", "content": "Write a Python function that adds two numbers."}
    ids = smollm2.encode(Prompt(messages=[ask]))
    ar = engine.generate(smollm2, ids, EngineConfig(verify="ar", draft_path="generic"), 32, ignore_eos=True).tokens
    cfg = EngineConfig(verify=verify, budget=16, top_k=4)
    gen = generate_speculative(smollm2, ids, cfg, 32, static=True)
    assert gen.tokens == ar
    assert max(gen.stats.accept_lengths) > 1  # the compaction of several accepted nodes is exercised


def test_hybrid_static_steps_accept_through_side_branches_and_stay_exact():
    """The device commit of recurrent state (accepted node's state, conv window along its path)
    under real acceptance: the oracle's proposals through a DFlash-shaped step are not available
    to the runtime, so a random draft is made to accept by proposing the target's own tokens."""
    pair = pair_for("tiny-hybrid", "random")
    ids = pair.encode("Recurrent state moves on the device.")
    ar = generate_ar(pair, ids, EngineConfig(verify="ar"), 48).tokens

    drafter = pair.drafter
    real = drafter.propose_static
    truth = torch.tensor(ar, dtype=torch.long)

    def peeking(seq, start, block_size, window, features):
        """The draft's own forward runs (its shapes and buffers are the runtime's), then its logits
        are replaced: the AR token first, except at every third position, where a decoy is first
        and the AR token second (so accepted paths take side branches)."""
        logits = real(seq, start, block_size, window, features)
        pos = start - len(ids) + torch.arange(1, block_size)
        true_tok = truth[pos.clamp(0, truth.numel() - 1)]
        side = pos % 3 == 0
        fake = torch.zeros_like(logits)
        fake.scatter_(1, ((true_tok + 1) % logits.shape[1])[:, None], torch.where(side, 10.0, 0.0)[:, None])
        return fake.scatter(1, true_tok[:, None], torch.where(side, 9.0, 10.0)[:, None])

    drafter.propose_static = peeking
    try:
        gen = generate_speculative(pair, ids, EngineConfig(verify="ddtree", budget=12, top_k=3, chain_seed=0), 48,
                                   static=True)
    finally:
        drafter.propose_static = real
    assert gen.tokens == ar
    assert max(gen.stats.accept_lengths) >= 4 and gen.stats.side_branch_steps > 0
