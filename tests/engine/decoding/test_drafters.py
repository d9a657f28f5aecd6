"""The DFlash drafter keeps each committed position's context K/V: same logits as the full forward."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine.models import draft as draft_module
from engine.models.attention import SMALL_QUERIES
from tests.engine.engine_pairs import pair_for


def _full_forward_logits(pair, seq, start: int, window: int, features):
    """The draft's logits from its full forward over the window's features (no cache)."""
    draft, target, block = pair.drafter.draft, pair.target, pair.drafter.block_size
    lo = 0 if window <= 0 else max(0, start - window)
    ids = torch.full((block,), draft.cfg.mask_token_id)
    ids[0] = seq[start]
    h = draft(target.embed_tokens(ids), features[lo:start], torch.arange(lo, start), torch.arange(start, start + block))
    return target.lm_head(h[1:])


@pytest.mark.parametrize("window", [0, 5])
def test_cached_context_gives_the_full_forwards_logits_step_after_step(window):
    pair = pair_for("tiny-dense", "random")
    drafter, target, block = pair.drafter, pair.target, pair.drafter.block_size
    torch.manual_seed(0)
    seq = torch.randint(0, 256, (64,))
    features = torch.randn(64, len(drafter.feature_layers) * target.cfg.hidden_size)
    drafter.reset()
    for start in (3, 4, 9, 20, 21, 40):  # positions only move forward within a generation
        cached = drafter.propose(seq, start, block, window, features)
        torch.testing.assert_close(cached, _full_forward_logits(pair, seq, start, window, features),
                                   rtol=1e-4, atol=1e-4)
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


@pytest.mark.parametrize("window", [0, 5])
def test_static_propose_over_its_own_context_cache_gives_the_full_forwards_logits(window):
    """The runtime's step: context K/V from ``fill_context`` (the prompt) and from each step's
    recomputed last ``block`` positions (whatever a step committed), the block attending over a
    fixed key span; positions as a device tensor. A prompt shorter than the block included."""
    pair = pair_for("tiny-dense", "random")
    drafter, target, block = pair.drafter, pair.target, pair.drafter.block_size
    torch.manual_seed(1)
    seq = torch.randint(0, 256, (80,))
    features = torch.randn(80, len(drafter.feature_layers) * target.cfg.hidden_size)
    for prompt, starts in ((3, (3, 4, 9, 20)), (18, (18, 19, 22, 37, 40))):  # steps commit 1..block tokens
        context = drafter.new_context(80)
        drafter.fill_context(context, features, prompt)
        for start in starts:
            got = drafter.propose_static(seq, torch.tensor([start]), block, window, features, context, 64)
            torch.testing.assert_close(got, _full_forward_logits(pair, seq, start, window, features),
                                       rtol=1e-4, atol=1e-4)


def test_a_long_context_is_projected_in_chunks_that_start_at_multiples_of_context_rows(monkeypatch):
    """``project_context`` (the runtime's ``fill_context``, the generic form's catch-up) projects at most
    ``CONTEXT_ROWS`` positions at once, each chunk from a multiple of it, so a long prompt's transient is a
    chunk's; the keys and values are those of one projection of every position, wherever a call starts."""
    from engine.decoding import drafters

    pair = pair_for("tiny-dense", "random")
    drafter, target = pair.drafter, pair.target
    torch.manual_seed(2)
    features = torch.randn(50, len(drafter.feature_layers) * target.cfg.hidden_size)
    whole = drafter.new_context(50)
    drafter.fill_context(whole, features, 50)  # 50 <= CONTEXT_ROWS: one projection
    monkeypatch.setattr(drafters, "CONTEXT_ROWS", 8)
    spans = []
    context_kv = drafter.draft.context_kv
    monkeypatch.setattr(drafter.draft, "context_kv", lambda f, p: spans.append((int(p[0]), int(p[-1]) + 1))
                        or context_kv(f, p))
    parts = drafter.new_context(50)
    drafter.fill_context(parts, features, 20)
    drafter.project_context(parts, features, 20, 50)
    assert spans == [(0, 8), (8, 16), (16, 20), (20, 24), (24, 32), (32, 40), (40, 48), (48, 50)]
    for got, want in zip(parts, whole, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_inference_draft_is_fused_and_saves_in_the_checkpoint_layout(tmp_path):
    from engine.loading import load_draft_folder, save_draft_folder

    pair = pair_for("tiny-dense", "random")
    attn = pair.drafter.draft.layers[0].self_attn
    assert "qkv_proj" in attn._modules and not hasattr(attn, "q_proj")  # one GEMM per input
    save_draft_folder(pair.drafter.draft, tmp_path)
    loaded = load_draft_folder(tmp_path, pair.target, "cpu", torch.float32)
    assert hasattr(loaded.layers[0].self_attn, "q_proj")
    feats = torch.randn(6, len(pair.drafter.feature_layers) * pair.target.cfg.hidden_size)
    block = torch.randn(4, pair.target.cfg.hidden_size)
    args = (block, feats, torch.arange(6), torch.arange(6, 10))
    torch.testing.assert_close(loaded(*args), pair.drafter.draft(*args), rtol=1e-5, atol=1e-5)


class _NewBytes(TorchDispatchMode):
    """Bytes of the tensors the ops make (an output sharing no input's storage), except while ``paused``."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)}
            self.bytes += sum(t.untyped_storage().nbytes() for t in tree_flatten(out)[0]
                              if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs)
        return out


def test_a_generic_proposal_attends_over_its_context_buffers_in_place(monkeypatch):
    """The generic loop's proposal (``DFlashDrafter.propose``) writes the block's keys and values after the
    context's in the drafter's own buffers and attends over them in place through a mask, as the runtime's
    captured step does, so that on CUDA the few-row kernel takes it (a mask, few query rows, unit-stride K/V):
    no op of it outside that attention makes anything that grows with the context but the mask (a bool per
    block row and key). Each layer's ``torch.cat`` of the context's K/V with the block's, unmasked, took
    ``attention_torch`` instead: the K/V widened to every query head, then cast to float32 and the keys scaled
    by SDPA's math path (3-D inputs): 3.2 GiB per step on the Qwen3.5-27B shape's draft at 32k positions,
    which the memory plan prices at a block's."""
    pair = pair_for("tiny-dense", "random")
    drafter, target, block = pair.drafter, pair.target, pair.drafter.block_size
    layers = drafter.draft.cfg.num_hidden_layers
    torch.manual_seed(3)
    seq = torch.randint(0, 256, (640,))
    features = torch.randn(640, len(drafter.feature_layers) * target.cfg.hidden_size)
    real, calls, made = draft_module.attention, [], _NewBytes()

    def spy(q, k, v, mask, *rest):
        calls.append((q.shape[0], None if mask is None else tuple(mask.shape), k.untyped_storage().data_ptr(),
                      v.untyped_storage().data_ptr(), k.stride(-1), v.stride(-1)))
        made.paused = True
        try:
            return real(q, k, v, mask, *rest)
        finally:
            made.paused = False

    monkeypatch.setattr(draft_module, "attention", spy)
    grown = {}
    for start in (64, 512):
        drafter.reset()
        drafter.propose(seq, start, block, 0, features)  # the context projected (a chunk at a time)
        calls.clear()
        made.bytes = 0
        with made:
            drafter.propose(seq, start + 1, block, 0, features)  # one more position: the decode's step
        buffers = (drafter._ctx_k.untyped_storage().data_ptr(), drafter._ctx_v.untyped_storage().data_ptr())
        assert calls == [(block, (block, start + 1 + block), *buffers, 1, 1)] * layers
        assert block <= SMALL_QUERIES
        grown[start] = made.bytes
    assert 0 < grown[512] - grown[64] <= (512 - 64) * block  # the mask's bools, no K/V of the context
