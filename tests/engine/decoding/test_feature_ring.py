"""The runtime's target features as a ring (``decode.feature_rows``): without a prefix cache a generation
holds the last ``FEATURE_RING_ROWS`` positions' features, not every position's, and its prompt's are
projected into the draft's context a chunk at a time as the prefill makes them. Here the ring, the
context chunk and the prefill chunk are shrunk (64, 64, 32 rows) so that a 300-token prompt wraps the
ring four times: every output equals AR's, and the draft's context K/V of every committed position are
the bits a row-a-position run gives (the same chunks projected from the same rows)."""

from __future__ import annotations

import pytest
import torch

import engine
from engine import EngineConfig
from engine.decoding import decode, drafters, runtime
from engine.decoding import prefix_cache as prefix_cache_mod
from engine.decoding.policy import StepCosts, policy_budgets
from engine.memory import held_memory, plan_memory, release_memory, reserve_memory

RING = 64
CONFIGS = [EngineConfig(budget=8, top_k=4, block_size=8, draft_path="runtime"),
           EngineConfig(verify="chain", block_size=8, draft_path="runtime"),
           EngineConfig(budget=8, top_k=4, block_size=8, draft_path="runtime", policy="adaptive",
                        probe_every=4, probe_max=8)]


@pytest.fixture
def small_ring(monkeypatch):
    monkeypatch.setattr(decode, "FEATURE_RING_ROWS", RING)
    monkeypatch.setattr(drafters, "CONTEXT_ROWS", RING)
    monkeypatch.setattr(runtime, "CONTEXT_ROWS", RING)
    monkeypatch.setattr(prefix_cache_mod, "PREFILL_CHUNK", 32)


def _run(pair, prompt, cfg, ring: bool, monkeypatch):
    monkeypatch.setattr(decode, "FEATURE_RING_ROWS", RING if ring else 1 << 30)
    release_memory(pair)
    gen = engine.generate(pair, prompt, cfg, 40, ignore_eos=True)
    n = len(prompt) + len(gen.tokens) - 1  # committed positions with K/V
    k, v = pair._runtime_decoder._draft_kv
    assert cfg.policy != "adaptive" or {0, 1} <= set(gen.stats.step_budgets)  # AR runs, then catch-up proposals
    return gen.tokens, pair._workspace.features.shape[0], k[:, :n].clone(), v[:, :n].clone()


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["ddtree", "chain", "adaptive"])
def test_a_ring_of_features_drafts_as_a_row_a_position_does(small_ring, monkeypatch, target, cfg):
    pair = engine.load(target, "random", device="cpu", dtype="float32")
    if cfg.policy == "adaptive":  # a cost table of its own, not timed: both runs choose the same budgets
        budgets = policy_budgets(cfg.budget, cfg.policy_levels)
        pair.step_costs(cfg, costs=StepCosts({b: 1.0 + b / 8 for b in budgets}))
    prompt = torch.randint(5, 250, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    ar = engine.generate(pair, prompt, EngineConfig(verify="ar"), 40, ignore_eos=True).tokens
    tokens, rows, k, v = _run(pair, prompt, cfg, True, monkeypatch)
    full_tokens, full_rows, full_k, full_v = _run(pair, prompt, cfg, False, monkeypatch)
    assert rows == RING and full_rows > len(prompt) + 40
    assert tokens == full_tokens == ar
    assert torch.equal(k, full_k) and torch.equal(v, full_v)
    assert k.abs().sum() > 0


def test_the_ring_only_where_nothing_reads_an_older_position(small_ring):
    """A row a position on the generic loop (its draft projects a prompt's features when it first
    proposes), with a prefix cache (it keeps every position's), and where a step's rows pass the ring
    (the verify's nodes, the context rows and the block); the plan and a reserved workspace agree."""
    pair = engine.load("tiny-dense", "random", device="cpu", dtype="float32")
    cfg = CONFIGS[0]
    assert decode.feature_rows(pair, cfg, True, False) == RING
    assert decode.feature_rows(pair, cfg, False, False) is None
    assert decode.feature_rows(pair, cfg, True, True) is None
    assert decode.feature_rows(pair, cfg.replace(budget=48), True, False) is None  # 49 nodes + 8 + 8 > 64
    assert decode.feature_rows(pair, CONFIGS[2].replace(probe_max=64), True, False) is None  # catch-up rows
    width = len(pair.drafter.feature_layers) * pair.target.cfg.hidden_size * 4
    at = (300, 40)
    assert plan_memory(pair, cfg, *at).parts["features"] == RING * width
    assert plan_memory(pair, cfg.replace(draft_path="generic"), *at).parts["features"] > 340 * width
    assert plan_memory(pair, cfg, *at, prefix_cache_bytes=1 << 20).parts["features"] > 340 * width
    reserve_memory(pair, cfg, *at)
    assert held_memory(pair)["features"] == RING * width
    reserve_memory(pair, cfg, *at, prefix_cache=True)
    assert held_memory(pair)["features"] == plan_memory(pair, cfg, *at, prefix_cache_bytes=1 << 20).parts["features"]


def test_a_run_that_would_wrap_a_ring_says_so():
    features = torch.zeros(64, 4)
    assert drafters.feature_slice(features, 130, 150) == slice(2, 22)
    with pytest.raises(RuntimeError, match="positions 60..69 wrap around a ring of 64 feature rows"):
        drafters.feature_slice(features, 60, 70)


def test_a_short_prompts_draft_context_is_projected_whole(small_ring, monkeypatch):
    """A prompt of one forward (at most ``PREFILL_CHUNK`` tokens): its draft context is projected after that
    forward (``on_span(n)``), the bits ``fill_context`` gives from its features (the positions no
    proposal recomputed)."""
    pair = engine.load("tiny-dense", "random", device="cpu", dtype="float32")
    prompt = list(range(5, 35))
    cfg = CONFIGS[0]
    tokens, rows, k, v = _run(pair, prompt, cfg, False, monkeypatch)  # (a row a position: its features all kept)
    want = pair.drafter.new_context(pair._workspace.max_len)
    pair.drafter.fill_context(want, pair._workspace.features, len(prompt))
    kept = len(prompt) - cfg.block_size  # (the first proposal recomputes the last block's)
    assert torch.equal(k[:, :kept], want[0][:, :kept]) and torch.equal(v[:, :kept], want[1][:, :kept])
    assert k[:, :kept].abs().sum() > 0


def test_loops_that_hold_features_otherwise_share_one_workspace_length(small_ring, monkeypatch):
    """A ring's workspace, then the generic loop (a row a position), then the ring again: each output AR's,
    the workspace reallocated for the other layout at the same length, not doubled; on the CPU ``auto``
    runs the generic loop, and the plan and ``reserve_memory`` hold what it holds."""
    pair = engine.load("tiny-dense", "random", device="cpu", dtype="float32")
    prompt = torch.randint(5, 250, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    ar = engine.generate(pair, prompt, EngineConfig(verify="ar"), 24, ignore_eos=True).tokens
    release_memory(pair)
    lengths = []
    for path in ("runtime", "generic", "runtime"):
        gen = engine.generate(pair, prompt, CONFIGS[0].replace(draft_path=path), 24, ignore_eos=True)
        assert gen.tokens == ar, path
        lengths.append((pair._workspace.max_len, pair._workspace.features.shape[0]))
    assert lengths[0][0] == lengths[1][0] == lengths[2][0]
    assert lengths[0][1] == RING < lengths[1][1] == lengths[1][0] == lengths[2][1]  # (a row a position serves a ring)
    auto = CONFIGS[0].replace(draft_path="auto")
    plan = plan_memory(pair, auto, len(prompt), 24)
    reserve_memory(pair, auto, len(prompt), 24)
    held = pair._workspace.max_len
    engine.generate(pair, prompt, auto, 24, ignore_eos=True)
    assert plan.loop == "generic" and pair._workspace.max_len == held
    assert held_memory(pair)["features"] == plan.parts["features"] == held * pair._workspace.features.shape[1] * 4


def test_the_sizes_the_ring_rests_on_agree():
    """The ring's rows are whole context chunks (a chunk is whole in it when projected) and whole prefill
    chunks (a prefill's span never wraps); a context chunk is rows the few-row kernel takes (a draft in
    blocks reads them in place)."""
    from engine.models import quant_kernel

    assert decode.FEATURE_RING_ROWS % drafters.CONTEXT_ROWS == 0
    assert decode.FEATURE_RING_ROWS % prefix_cache_mod.PREFILL_CHUNK == 0
    assert drafters.CONTEXT_ROWS <= quant_kernel.MAX_ROWS
