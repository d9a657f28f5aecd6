"""Exactness: every speculative path yields exactly the AR tokens (float32, CPU)."""

import hashlib
import itertools
import subprocess
import sys

import pytest
import torch

import engine
from engine import EngineConfig
from tests.engine.engine_pairs import assert_margins_equal, direct_margins, pair_for

PROMPTS = ["Hello there, how are you today?", "def add(a, b):\n    return"]
MAX_NEW = 40
TARGETS = ["tiny-dense", "tiny-hybrid"]
DRAFTS = ["oracle:0", "oracle:0.3", "oracle:0.7", "random"]
# A spread of tree / draft parameters; each path combination below gets a different one.
PARAM_SETS = [
    dict(budget=22, top_k=8, chain_seed=None, proposal_temp=1.0, target_feat_ctx=0, block_size=None),
    dict(budget=5, top_k=2, chain_seed=0, proposal_temp=0.5, target_feat_ctx=8, block_size=4),
    dict(budget=40, top_k=4, chain_seed=3, proposal_temp=1.5, target_feat_ctx=32, block_size=8),
    dict(budget=1, top_k=1, chain_seed=0, proposal_temp=0.7, target_feat_ctx=4, block_size=2),
    dict(budget=12, top_k=3, chain_seed=None, proposal_temp=0.3, target_feat_ctx=16, block_size=6),
    dict(budget=64, top_k=8, chain_seed=1, proposal_temp=1.0, target_feat_ctx=0, block_size=16),
]
# draft paths: the generic loop with host top-k and tree, and with the device's (``auto`` on a CPU, and
# with a draft that proposes on the host); a DFlash draft also takes the runtime's steps (eagerly here),
# which refuse replay rollback on a hybrid target
PATHS = list(itertools.product(["chain", "ddtree"], ["replay", "fast"], ["generic", "auto"]))

_ar: dict = {}



def ar_tokens(target: str, prompt_ids: tuple[int, ...], temperature: float = 0.0, seed: int = 0) -> list[int]:
    key = (target, prompt_ids, temperature, seed)
    if key not in _ar:
        pair = pair_for(target, "none")
        cfg = EngineConfig(verify="ar", temperature=temperature, seed=seed)
        _ar[key] = engine.generate(pair, list(prompt_ids), cfg, MAX_NEW, ignore_eos=True).tokens
    return _ar[key]


def _cases():
    for t_i, target in enumerate(TARGETS):
        for d_i, draft in enumerate(DRAFTS):
            for p_i, (verify, rollback, path) in enumerate(PATHS):
                params = PARAM_SETS[(t_i + 3 * d_i + p_i) % len(PARAM_SETS)]
                if path == "auto" and draft == "random" and not (rollback == "replay" and target == "tiny-hybrid"):
                    path = "runtime"
                yield pytest.param(target, draft, verify, rollback, path, params,
                                   id=f"{target}-{draft}-{verify}-{rollback}-{path}-b{params['budget']}")


@pytest.mark.parametrize("target,draft,verify,rollback,path,params", list(_cases()))
def test_speculative_equals_ar(target, draft, verify, rollback, path, params):
    pair = pair_for(target, draft)
    cfg = EngineConfig(verify=verify, rollback=rollback, draft_path=path, **params)
    for text in PROMPTS:
        ids = tuple(pair.encode(text))
        gen = engine.generate(pair, list(ids), cfg, MAX_NEW, ignore_eos=True)
        assert gen.tokens == ar_tokens(target, ids)
        assert sum(gen.stats.accept_lengths) >= len(gen.tokens) - 1  # every committed token counted


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("path", ["generic", "auto"])
def test_oracle_partial_acceptance_takes_side_branches(target, path):
    pair = pair_for(target, "oracle:0.3")
    ids = pair.encode(PROMPTS[0])
    tree = engine.generate(pair, ids, EngineConfig(verify="ddtree", draft_path=path, budget=30, top_k=4),
                           MAX_NEW, ignore_eos=True)
    chain = engine.generate(pair, ids, EngineConfig(verify="chain", draft_path=path), MAX_NEW, ignore_eos=True)
    assert tree.stats.acceptance_length > 1.5
    assert tree.stats.side_branch_steps > 0
    assert chain.stats.side_branch_steps == 0
    assert min(tree.stats.accept_lengths) >= 1
    # oracle:0 proposes the true continuation: whole blocks are accepted
    perfect = engine.generate(pair_for(target, "oracle:0"), ids, EngineConfig(verify="chain", block_size=8),
                              MAX_NEW, ignore_eos=True)
    assert perfect.stats.accept_lengths[:-1] == [8] * (len(perfect.stats.accept_lengths) - 1)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("verify,path", [("chain", "auto"), ("ddtree", "generic"), ("ddtree", "auto")])
def test_sampling_commits_exactly_the_ar_samples(target, verify, path):
    pair = pair_for(target, "oracle:0.3")
    ids = tuple(pair.encode(PROMPTS[1]))
    cfg = EngineConfig(verify=verify, draft_path=path, temperature=0.8, seed=5, budget=16, top_k=4, block_size=8)
    gen = engine.generate(pair, list(ids), cfg, MAX_NEW, ignore_eos=True)
    assert gen.tokens == ar_tokens(target, ids, temperature=0.8, seed=5)
    assert gen.tokens != ar_tokens(target, ids)  # really sampled, not greedy


@pytest.mark.slow
def test_stop_token_ends_speculative_and_ar_alike():
    pair = pair_for("tiny-dense", "oracle:0.3")
    stop = pair.stop_ids
    found = False
    for text in ["a", "b", "Hi", "xyz", "q", "0", "Hello", "The"]:  # until one reaches a stop token
        ids = pair.encode(text)
        ar = engine.generate(pair, ids, EngineConfig(verify="ar"), 120)
        spec = engine.generate(pair, ids, EngineConfig(verify="ddtree", budget=10, top_k=3), 120)
        assert spec.tokens == ar.tokens
        if ar.tokens[-1] in stop:
            found = True
            assert all(t not in stop for t in ar.tokens[:-1])
            break
    assert found, "no prompt reached a stop token; pick other prompts"


def _state_hash_in_subprocess(name: str) -> str:
    code = (
        "import hashlib, engine;"
        f"p = engine.load({name!r}, 'random', device='cpu', dtype='float32');"
        "h = hashlib.sha256();"
        "[h.update(v.numpy().tobytes()) for _, v in sorted(p.target.state_dict().items())];"
        "[h.update(v.numpy().tobytes()) for _, v in sorted(p.drafter.draft.state_dict().items())];"
        "print(h.hexdigest())"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("name", TARGETS)
def test_tiny_presets_are_identical_across_processes(name):
    pair = pair_for(name, "random")
    h = hashlib.sha256()
    for _, v in sorted(pair.target.state_dict().items()):
        h.update(v.numpy().tobytes())
    for _, v in sorted(pair.drafter.draft.state_dict().items()):
        h.update(v.numpy().tobytes())
    assert _state_hash_in_subprocess(name) == h.hexdigest()


def test_bench_reports_exactness_and_phases():
    pair = pair_for("tiny-dense", "oracle:0.3")
    prompts = [pair.encode(t) for t in PROMPTS]
    ref = engine.bench(pair, EngineConfig(verify="ar"), prompts, 24, ignore_eos=True)
    res = engine.bench(pair, EngineConfig(verify="ddtree", budget=8, top_k=2), prompts, 24,
                       reference=ref.outputs, ignore_eos=True)
    assert res.exact_match == 1.0 and all(p.first_divergence is None for p in res.prompts)
    assert all(p.divergence is None for p in res.prompts)
    assert res.new_tokens == 48 and res.steps == len(res.accept_lengths)
    assert set(res.phase_ms_per_step) == {"draft", "topk", "tree", "verify", "walk", "commit"}
    assert all(v > 0 for v in res.phase_ms_per_step.values())
    assert res.decode_tps > 0 and res.acceptance_length > 1
    assert res.bonus_tokens + res.correction_tokens == res.steps
    # a wrong reference is detected, with the first divergence position
    bad = [list(o) for o in ref.outputs]
    bad[1][5] = (bad[1][5] + 1) % 256
    res2 = engine.bench(pair, EngineConfig(verify="chain"), prompts, 24, reference=bad, ignore_eos=True)
    assert res2.exact_match == 0.5 and res2.prompts[1].first_divergence == 5
    # ... and its forensics: AR and chain re-decoded to position 5 pick the same token from the same
    # row, which the rewritten reference does not hold (not reproduced); a clear margin: a mismatch
    div = res2.prompts[1].divergence
    want = direct_margins(pair, prompts[1], ref.outputs[1][:6])[5].tolist()
    assert res2.prompts[0].divergence is None and div.position == 5 and not div.reproduced
    assert div.ar_margin == pytest.approx(want[1], abs=1e-4) and div.run_margin == pytest.approx(want[1], abs=1e-4)
    assert div.tie_bound == 4 * engine.decoding.stats.ulp(torch.float32, want[0]) and div.verdict == "mismatch"


def test_a_real_divergence_is_diagnosed_at_its_position_with_both_margins():
    """Sampling (temperature 0.8) against a greedy reference: the outputs really differ, both runs
    are re-decoded and reproduce them; at the first difference both picked from the same logits row
    (the prefix is equal), so both margins are that row's, and it is no tie in float32."""
    pair = pair_for("tiny-dense", "oracle:0.3")
    prompts = [pair.encode(PROMPTS[1])]
    greedy = EngineConfig(verify="ar")
    ref = engine.bench(pair, greedy, prompts, 24, ignore_eos=True).outputs
    sampled = EngineConfig(verify="ddtree", budget=8, top_k=2, temperature=0.8, seed=5)
    res = engine.bench(pair, sampled, prompts, 24, reference=ref, ignore_eos=True, ar_config=greedy)
    p = res.prompts[0]
    pos = p.first_divergence
    assert pos is not None and res.outputs[0][:pos] == ref[0][:pos]
    top, margin = direct_margins(pair, prompts[0], ref[0][: pos + 1])[pos].tolist()
    d = p.divergence
    assert (d.position, d.reproduced, d.verdict) == (pos, True, "mismatch")
    assert d.ar_margin == pytest.approx(margin, abs=1e-4) and d.run_margin == pytest.approx(margin, abs=1e-4)
    assert d.tie_bound == pytest.approx(4 * 2.0 ** (torch.tensor(abs(top)).log2().floor().item() - 23))
    assert d.ar_margin > d.tie_bound
    # the default AR config is the run's own with verify=ar: here it samples, so AR is not the reference
    assert engine.diagnose(pair, sampled, prompts[0], res.outputs[0], ref[0], ignore_eos=True).reproduced is False


@pytest.mark.parametrize("target", TARGETS)
def test_margins_of_the_generic_loops_are_those_of_a_direct_forward(target):
    """Each new token's margin is the one of the target row that picked it: the prefill's last row,
    an AR step's row, a verify's rows along the accepted paths (side branches included)."""
    pair = pair_for(target, "oracle:0.3")
    ids = pair.encode(PROMPTS[0])
    ar = engine.generate(pair, ids, EngineConfig(verify="ar", draft_path="generic"), MAX_NEW, ignore_eos=True,
                         record_margins=True)
    want = direct_margins(pair, ids, ar.tokens)
    assert_margins_equal(ar, want)
    spec = engine.generate(pair, ids, EngineConfig(verify="ddtree", draft_path="generic", budget=30, top_k=4),
                           MAX_NEW, ignore_eos=True, record_margins=True)
    assert spec.tokens == ar.tokens and max(spec.stats.accept_lengths) > 2 and spec.stats.side_branch_steps > 0
    assert_margins_equal(spec, want)
    plain = engine.generate(pair, ids, EngineConfig(verify="chain", draft_path="generic"), MAX_NEW, ignore_eos=True)
    assert plain.margins is None and plain.top_logits is None  # off unless asked for


def test_peak_memory_and_devices_are_reported():
    pair = pair_for("tiny-dense", "random")
    res = engine.bench(pair, EngineConfig(verify="chain"), [pair.encode("hi")], 4, ignore_eos=True)
    assert res.device == "cpu" and res.peak_memory_bytes > 0
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize("host", [True, False])
@pytest.mark.parametrize("max_depth", [15, 4])
def test_a_chain_proposal_comes_with_its_ancestor_mask(host, max_depth):
    """The chain's mask is built as a band (not ancestor_mask's loop over depth): the same mask."""
    from engine.decoding.loop import UNTIMED, scored_tree
    from engine.decoding.tree import ancestor_mask

    logits = torch.randn(15, 50, generator=torch.Generator().manual_seed(0))
    tree, mask, _ = scored_tree(EngineConfig(verify="chain"), logits, torch.tensor([7]), UNTIMED, max_depth, host)
    assert tree.tokens.tolist() == [7, *torch.argmax(logits, -1).tolist()]
    assert torch.equal(mask, ancestor_mask(tree.parents, max_depth))
