"""``engine.training.features``: where the frozen target's features live while a draft trains (all on the
device, a part of them, host memory, or none: recomputed), and that each gives a batch the same features."""

from __future__ import annotations

import pytest
import torch

import engine.training.features as features
from engine.config import EngineInputError
from engine.training.features import TokenStore, feature_placement, kept_sequences, target_features
from engine.training.train import TrainConfig, train_draft


def test_target_features_go_to_the_gpu_when_they_fit_and_in_part_when_a_quarter_does():
    """auto: the GPU while the features take at most 70% of its free memory; a part of them while that 70% holds
    at least a quarter; recomputed each batch beyond; every other choice taken as asked; off CUDA host and
    partial are the device's memory."""
    gpu, cpu, gib = torch.device("cuda"), torch.device("cpu"), 2**30
    assert feature_placement("auto", 60 * gib, gpu, 100 * gib) == "device"
    assert feature_placement("auto", 80 * gib, gpu, 100 * gib) == "partial"
    assert feature_placement("auto", 280 * gib, gpu, 100 * gib) == "partial"  # 70 of 280 GiB: a quarter
    assert feature_placement("auto", 281 * gib, gpu, 100 * gib) == "recompute"
    assert feature_placement("auto", 14 * gib, gpu, 18 * gib) == "partial"  # a 24 GB card
    for choice in ("host", "device", "partial", "recompute"):
        assert feature_placement(choice, 80 * gib, gpu, 100 * gib) == choice
    assert feature_placement("auto", 80 * gib, cpu, None) == "device"
    assert feature_placement("host", 80 * gib, cpu, None) == "device"
    assert feature_placement("partial", 80 * gib, cpu, None) == "device"
    assert feature_placement("recompute", 1 * gib, cpu, None) == "recompute"
    with pytest.raises(EngineInputError, match="feature_store must be one of"):
        TrainConfig(feature_store="disk")


def test_a_partial_store_keeps_a_seeded_random_subset_that_fits_its_budget():
    """A prefix of a seeded random order (no bias to short sequences, the same subset on a resume)."""
    lens = torch.tensor([10, 20, 30, 40, 50, 60, 70, 80] * 4)
    kept = kept_sequences(lens, bytes_per_token=4, budget_bytes=700)
    assert kept.dtype == torch.bool and int((lens * kept).sum()) * 4 <= 700
    assert int((lens * kept).sum()) * 4 > 700 - 4 * int(lens.max())  # filled until the next in order did not fit
    assert torch.equal(kept, kept_sequences(lens, 4, 700))  # seeded: the same subset on a resume
    assert not torch.equal(kept, torch.arange(lens.numel()) < int(kept.sum()))  # not the first file's sequences
    assert kept_sequences(lens, 4, 10**9).all() and not kept_sequences(lens, 4, 0).any()


def test_a_partial_store_gives_a_batch_the_features_a_whole_store_gives(pair, sequences):
    """Kept sequences' rows gathered (the same bits as a store of every feature), the others' from the target's
    forward over those rows alone (the same numbers, float32), in one batch."""
    seqs, plens = sequences
    data = [torch.tensor(sq) for sq in seqs]
    lens, ids = torch.tensor([len(sq) for sq in seqs]), (0, pair.target.cfg.num_hidden_layers - 1)
    whole = TokenStore(tokens=torch.cat(data), feats=target_features(pair.target, data, ids),
                       starts=torch.cumsum(lens, 0) - lens, lens=lens, prompt_lens=torch.tensor(plens))
    kept = torch.arange(len(seqs)) % 3 == 0
    kept_lens = lens * kept
    kept_data = [d for d, k in zip(data, kept.tolist(), strict=True) if k]
    part = TokenStore(tokens=whole.tokens, feats=target_features(pair.target, kept_data, ids),
                      starts=whole.starts, lens=lens, prompt_lens=whole.prompt_lens, target=pair.target,
                      layer_ids=ids, kept=kept, feat_starts=torch.cumsum(kept_lens, 0) - kept_lens)
    assert part.placement == "partial" and whole.placement == "device"
    pick = torch.tensor([0, 1, 3, 5, 6, 23])  # kept 0, 3, 6; recomputed 1, 5, 23
    tokens, feats, got_lens, got_plens = part.batch(pick)
    want_tokens, want, _, _ = whole.batch(pick)
    assert torch.equal(tokens, want_tokens) and torch.equal(got_lens, lens[pick])
    inside = torch.arange(tokens.shape[1])[None, :] < got_lens[:, None]
    for r, seq in enumerate(pick.tolist()):
        if kept[seq]:
            assert torch.equal(feats[r][inside[r]], want[r][inside[r]])
        else:
            torch.testing.assert_close(feats[r][inside[r]], want[r][inside[r]], rtol=1e-4, atol=1e-5)


def test_a_partial_store_trains_as_the_kept_one(pair, sequences, monkeypatch):
    """feature_store="partial" (half of the sequences' features kept, forced here: off CUDA it keeps them all)
    follows the losses of a run that keeps every feature."""
    seqs, plens = sequences
    monkeypatch.setattr(features, "feature_placement", lambda choice, *a: choice)
    real = features.kept_sequences
    monkeypatch.setattr(features, "kept_sequences", lambda lens, per_token, room: real(lens, per_token, room / 2))
    runs, logs = {}, []
    for store in ("device", "partial"):
        cfg = TrainConfig(layers=1, block_size=4, steps=6, batch_size=4, num_anchors=4, lr=3e-3, warmup_steps=2,
                          val_fraction=0.0, feature_store=store)
        torch.manual_seed(0)
        _, runs[store] = train_draft(pair.target, seqs, plens, cfg, pair.tokenizer.mask_id, log=logs.append)
    assert runs["partial"]["feature_store"] == "partial"
    assert runs["partial"]["final_loss"] == pytest.approx(runs["device"]["final_loss"], rel=1e-4)
    line = next(m for m in logs if m.startswith("target features") and "recomputed each batch" in m)
    kept = int(line.split("(")[1].split()[0])
    assert 0 < kept < len(seqs) and f"of {len(seqs)} sequences" in line


def test_a_partial_store_with_room_for_no_sequence_recomputes_every_batch(pair, sequences, monkeypatch):
    seqs, plens = sequences
    monkeypatch.setattr(features, "feature_placement", lambda choice, *a: choice)
    monkeypatch.setattr(features, "kept_sequences", lambda lens, per_token, room: torch.zeros_like(lens, dtype=bool))
    cfg = TrainConfig(layers=1, block_size=4, steps=2, batch_size=4, num_anchors=4, val_fraction=0.0,
                      feature_store="partial")
    logs = []
    _, summary = train_draft(pair.target, seqs, plens, cfg, pair.tokenizer.mask_id, log=logs.append)
    assert summary["feature_store"] == "recompute" and any("recomputed each batch (not kept)" in m for m in logs)
