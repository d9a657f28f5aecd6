"""The DFlash drafter keeps each committed position's context K/V: same logits as the full forward."""

import pytest
import torch

from tests.engine.engine_pairs import pair_for


@pytest.mark.parametrize("window", [0, 5])
def test_cached_context_gives_the_full_forwards_logits_step_after_step(window):
    pair = pair_for("tiny-dense", "random")
    drafter, draft, target = pair.drafter, pair.drafter.draft, pair.target
    block = drafter.block_size
    torch.manual_seed(0)
    seq = torch.randint(0, 256, (64,))
    features = torch.randn(64, len(drafter.feature_layers) * target.cfg.hidden_size)
    drafter.reset()
    for start in (3, 4, 9, 20, 21, 40):  # positions only move forward within a generation
        cached = drafter.propose(seq, start, block, window, features)
        lo = 0 if window <= 0 else max(0, start - window)
        ids = torch.full((block,), draft.cfg.mask_token_id)
        ids[0] = seq[start]
        h = draft(target.embed_tokens(ids), features[lo:start], torch.arange(lo, start),
                  torch.arange(start, start + block))
        torch.testing.assert_close(cached, target.lm_head(h[1:]), rtol=1e-4, atol=1e-4)
    assert drafter._cached == 40


def test_reset_or_a_shorter_prefix_recomputes_the_context():
    pair = pair_for("tiny-dense", "random")
    drafter, block = pair.drafter, pair.drafter.block_size
    seq = torch.randint(0, 256, (32,))
    f1 = torch.randn(32, len(drafter.feature_layers) * pair.target.cfg.hidden_size)
    f2 = torch.randn_like(f1)  # another generation: other features at the same positions
    drafter.reset()
    expected_10 = drafter.propose(seq, 10, block, 0, f2)
    drafter.reset()
    expected_5 = drafter.propose(seq, 5, block, 0, f2)
    drafter.reset()
    drafter.propose(seq, 10, block, 0, f1)
    drafter.reset()  # a new generation
    assert torch.equal(drafter.propose(seq, 10, block, 0, f2), expected_10)
    drafter.reset()
    drafter.propose(seq, 10, block, 0, f1)
    # no reset, but the position went back: what was cached past it cannot be trusted
    assert torch.equal(drafter.propose(seq, 5, block, 0, f2), expected_5)
