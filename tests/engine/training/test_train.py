"""Draft training: batched target forward, self-distillation, block masks, a CPU smoke run."""

import json
import math
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import engine
from engine import EngineConfig
from engine.cli import main
from engine.config import EngineInputError
from engine.loading import load_draft_folder, save_draft_folder
from engine.models.common import unfused_state_dict
from engine.models.dense import forward_padded
from engine.models.draft import DFlashDraft
from engine.training.features import target_features
from engine.training.sequences import (
    generate_responses,
    length_batches,
    load_sequence_records,
    load_sequences,
    save_sequences,
)
from engine.training.train import (
    TrainConfig,
    block_batch,
    grow_draft,
    learning_rate,
    new_draft_for,
    sample_anchors,
    train_draft,
)

pytestmark = pytest.mark.xdist_group("test_train")  # its module fixture trains a draft: once


def test_learning_rate_warms_up_then_decays_over_steps_or_time():
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, steps=100)
    assert learning_rate(cfg, 0, 0.0) == pytest.approx(1e-4)  # 1 of 10 warm-up steps
    assert learning_rate(cfg, 9, 0.0) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(0.09 * math.pi)))  # warm, decaying
    assert learning_rate(cfg, 50, 0.0) == pytest.approx(0.5e-3)  # half way: half the peak
    assert learning_rate(cfg, 99, 0.0) < 1e-6
    timed = TrainConfig(lr=1e-3, warmup_steps=10, steps=100, time_budget_s=60.0)
    # the time budget half spent at step 20: the schedule follows whichever runs out first
    assert learning_rate(timed, 20, 30.0) == pytest.approx(0.5e-3)
    assert learning_rate(timed, 20, 90.0) == pytest.approx(0.0, abs=1e-12)  # past the budget: the floor


def test_batched_forward_equals_one_sequence_forward(pair):
    model = pair.target
    seqs = [pair.encode("left padded prompt"), pair.encode("short"), pair.encode("a somewhat longer prompt here")]
    width = max(map(len, seqs))
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    valid = torch.zeros(len(seqs), width, dtype=torch.bool)
    for r, s in enumerate(seqs):
        tokens[r, width - len(s):] = torch.tensor(s)
        valid[r, width - len(s):] = True
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    logits, feats = forward_padded(model, tokens, positions, valid, feature_layers=(1, 2))
    for r, s in enumerate(seqs):
        ref_logits, ref_feats = model(torch.tensor(s), model.new_cache(64), 0, feature_layers=(1, 2))
        torch.testing.assert_close(logits[r, width - len(s):], ref_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(feats[r, width - len(s):], ref_feats, rtol=1e-4, atol=1e-4)
    last, _ = forward_padded(model, tokens, positions, valid, last_only=True)  # a prefill's next-token logits
    assert last.shape == (len(seqs), 1, logits.shape[-1])
    torch.testing.assert_close(last, logits[:, -1:], rtol=1e-5, atol=1e-5)


def test_self_distillation_is_the_targets_own_greedy_answer(pair):
    prompts = [pair.encode(t) for t in ["Hi", "What is 2+2?", "def f(x):", "Tell me a story about a cat"]]
    answers = generate_responses(pair.target, prompts, 24, batch_size=3, stop_ids=pair.stop_ids)
    for p, a in zip(prompts, answers, strict=True):
        assert a == engine.generate(pair, p, EngineConfig(verify="ar"), 24).tokens


def test_sampled_self_distillation_draws_the_targets_tokens_reproducibly(pair):
    """At a temperature each answer is a draw from the target's own distribution: the same seed gives the
    same answers, another seed other ones, a prompt given twice two draws; at a temperature near 0 (however
    small: the scaled logits stay finite) the draw is the greedy answer."""
    prompts = [pair.encode(t) for t in ["Hi", "What is 2+2?", "def f(x):", "Hi"]]
    a = generate_responses(pair.target, prompts, 12, batch_size=4, stop_ids=pair.stop_ids, temperature=1.0, seed=3)
    assert a == generate_responses(pair.target, prompts, 12, batch_size=4, stop_ids=pair.stop_ids, temperature=1.0,
                                   seed=3)
    b = generate_responses(pair.target, prompts, 12, batch_size=4, stop_ids=pair.stop_ids, temperature=1.0, seed=4)
    assert a != b and a[0] != a[3]  # (tiny-dense's random weights: near-uniform distributions)
    greedy = generate_responses(pair.target, prompts, 12, batch_size=4, stop_ids=pair.stop_ids)
    for cold in (1e-4, 1e-40):
        assert generate_responses(pair.target, prompts, 12, batch_size=4, stop_ids=pair.stop_ids,
                                  temperature=cold) == greedy
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(EngineInputError, match="temperature must be a finite number >= 0"):
            generate_responses(pair.target, prompts, 4, batch_size=4, stop_ids=pair.stop_ids, temperature=bad)


def test_a_token_budget_gives_short_prompts_big_batches_and_answers_stay_the_targets(pair):
    lengths = [30, 2, 3, 90, 4, 5, 31]
    assert length_batches(lengths, 3) == [[1, 2, 4], [5, 0, 6], [3]]  # rows alone, shortest first
    # 100 cache positions: 10 new tokens + the longest prompt, times the rows
    batches = length_batches(lengths, 8, batch_tokens=100, max_new_tokens=10)
    assert batches == [[1, 2, 4, 5], [0, 6], [3]]
    for b in batches:
        assert len(b) == 1 or len(b) * (max(lengths[i] for i in b) + 10) <= 100
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    prompts = [pair.encode(t) for t in ["Hi", "What is 2+2?", "def f(x):", "Tell me a story about a cat", "Ok"]]
    answers = generate_responses(pair.target, prompts, 16, batch_size=8, stop_ids=pair.stop_ids, batch_tokens=60)
    for p, a in zip(prompts, answers, strict=True):
        assert a == engine.generate(pair, p, EngineConfig(verify="ar"), 16).tokens


def test_self_distillation_time_budget_keeps_a_sample_of_every_length(pair, monkeypatch):
    """No new batch starts after the budget: the prompts answered are exactly the target's answers,
    the others None, and (batches in a seeded random order) not just the shortest ones."""
    from engine.training import sequences

    prompts = [pair.encode("x" * n) for n in (2, 3, 40, 41, 80, 81, 120, 121)]
    clock = iter(range(0, 1000, 10))  # each look at the clock is 10 s later: two batches start within 25 s
    monkeypatch.setattr(sequences.time, "perf_counter", lambda: float(next(clock)))
    answers = generate_responses(pair.target, prompts, 8, batch_size=2, stop_ids=pair.stop_ids, time_budget_s=25,
                                 seed=1)
    done = [i for i, a in enumerate(answers) if a is not None]
    assert len(done) == 4 and done != [0, 1, 2, 3]  # two batches of the four: not the two shortest
    for i in done:
        assert answers[i] == engine.generate(pair, prompts[i], EngineConfig(verify="ar"), 8).tokens


def test_block_mask_sees_context_strictly_before_its_anchor_and_its_own_block():
    tokens = torch.stack([torch.arange(10), torch.cat([torch.arange(100, 106), torch.zeros(4, dtype=torch.long)])])
    lens = torch.tensor([10, 6])
    anchors = torch.tensor([[4, 7], [3, 0]])
    valid = torch.tensor([[True, True], [True, False]])
    b = block_batch(tokens, lens, anchors, valid, block=4, mask_token_id=99)
    mask, width = b["mask"], 10
    assert mask.shape == (2, 8, 10 + 8)
    # seq 0, block 0 (anchor 4): context positions 0..3 only
    assert mask[0, 0, :width].nonzero().flatten().tolist() == [0, 1, 2, 3]
    # seq 1, block 0 (anchor 3): positions 0..2 of its own sequence (the other is another batch row)
    assert mask[1, 2, :width].nonzero().flatten().tolist() == [0, 1, 2]
    # bidirectional inside the block, blind to the other blocks
    assert mask[0, 5, width:].nonzero().flatten().tolist() == [4, 5, 6, 7]
    assert b["tokens"][0, :4].tolist() == [4, 99, 99, 99]
    assert b["labels"][0, :4].tolist() == [-100, 5, 6, 7]
    assert b["labels"][0, 4:8].tolist() == [-100, 8, 9, -100]  # past the end of the sequence
    assert b["labels"][1, :4].tolist() == [-100, 104, 105, -100]  # past the end, not into the padding
    assert b["labels"][1, 4:].tolist() == [-100] * 4  # an unused anchor slot predicts nothing
    assert not mask[1, 4:, :width].any()  # ... and sees no context (it only attends to itself)
    assert b["q_pos"][0, :4].tolist() == [4, 5, 6, 7]


def test_anchors_are_distinct_generated_positions_and_short_sequences_pad():
    gen = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors(torch.tensor([5, 5]), torch.tensor([20, 6]), width=20, n=8, gen=gen)
    a = anchors[0][valid[0]]
    assert valid[0].all() and a.unique().numel() == 8 and int(a.min()) >= 5 and int(a.max()) <= 18
    assert a.tolist() == sorted(a.tolist())
    assert not valid[1].any()  # prompt 5 of 6 tokens: no position has a label after it
    anchors, valid = sample_anchors(torch.tensor([2]), torch.tensor([6]), width=6, n=8, gen=gen)
    assert valid.sum() == 3 and anchors[0][valid[0]].tolist() == [2, 3, 4]


def test_batched_draft_forward_equals_one_sequence_at_a_time(pair):
    draft = engine.load("tiny-dense", "random", device="cpu", dtype="float32").drafter.draft
    feats = torch.randn(2, 9, len(draft.cfg.target_layer_ids) * draft.cfg.hidden_size)
    blocks = torch.randn(2, 4, draft.cfg.hidden_size)
    ctx_pos, q_pos = torch.arange(9).expand(2, 9), torch.arange(9, 13).expand(2, 4)
    out = draft(blocks, feats, ctx_pos, q_pos)
    for r in range(2):
        torch.testing.assert_close(out[r], draft(blocks[r], feats[r], ctx_pos[r], q_pos[r]), rtol=1e-5, atol=1e-5)


def test_smoke_training_learns_and_round_trips_into_exact_decoding(pair, tmp_path):
    torch.manual_seed(0)
    prompts = [pair.encode(f"Question {i}: what is {i} plus {i * 3}?") for i in range(16)]
    answers = generate_responses(pair.target, prompts, 32, batch_size=8, stop_ids=pair.stop_ids)
    seqs = [p + a for p, a in zip(prompts, answers, strict=True)]
    cfg = TrainConfig(layers=1, block_size=8, steps=40, batch_size=4, num_anchors=8, lr=3e-3, warmup_steps=5)
    logs = []
    draft, summary = train_draft(pair.target, seqs, [len(p) for p in prompts], cfg, pair.tokenizer.mask_id,
                                 log=logs.append)
    steps = [line for line in logs if line.startswith("step ")]
    assert steps and steps[0].startswith("step 0 loss")
    first_loss = float(steps[0].split()[3])
    assert summary["steps"] == 40 and summary["final_loss"] < 0.7 * first_loss
    save_draft_folder(draft, tmp_path / "draft", extra={"training": {"steps": summary["steps"]}})
    loaded = load_draft_folder(tmp_path / "draft", pair.target, "cpu", torch.float32)
    assert loaded.cfg.block_size == 8
    trained = engine.load("tiny-dense", str(tmp_path / "draft"), device="cpu")
    ids = prompts[0]
    ar = engine.generate(trained, ids, EngineConfig(verify="ar"), 32, ignore_eos=True)
    for verify in ("chain", "ddtree"):
        out = engine.generate(trained, ids, EngineConfig(verify=verify, budget=10, top_k=3), 32, ignore_eos=True)
        assert out.tokens == ar.tokens
    # Training's forward and decoding agree: at the anchors the chain's steps had (each root at the prompt's end
    # plus the tokens committed before it), the blocks training scores accept exactly what decoding accepted.
    chain = engine.generate(trained, ids, EngineConfig(verify="chain"), 32, ignore_eos=True).stats.accept_lengths
    assert max(chain) > 1  # the smoke draft proposes something: the comparison is not of empty blocks
    assert _teacher_forced_accepts(pair.target, loaded, ids, ar.tokens, chain[:-1]) == chain[:-1]


def _teacher_forced_accepts(target, draft, prompt: list[int], answer: list[int], accepts: list[int]) -> list[int]:
    """Per anchor (a decoding step's root), the tokens a chain step accepts there: 1 + the drafted prefix that
    matches the answer, from training's batched block forward over the target's features."""
    seq = torch.tensor(prompt + answer)
    anchors = [len(prompt)]
    for a in accepts[:-1]:
        anchors.append(anchors[-1] + a)
    at = torch.tensor(anchors)[None]
    batch = block_batch(seq[None], torch.tensor([seq.numel()]), at, torch.ones_like(at, dtype=torch.bool),
                        draft.cfg.block_size, draft.cfg.mask_token_id)
    feats = target_features(target, [seq], draft.cfg.target_layer_ids)[None]
    with torch.no_grad():
        h = draft(target.embed_tokens(batch["tokens"]), feats, batch["ctx_pos"], batch["q_pos"], batch["mask"])
        hit = (target.lm_head(h).argmax(-1) == batch["labels"]).view(len(anchors), -1)[:, 1:]
    return [1 + int(row.long().cumprod(0).sum()) for row in hit]


def test_a_deadline_bounds_training_from_after_the_target_features(pair, monkeypatch):
    """--wall-budget's deadline is measured once the features are in: a slow feature pass (host
    memory) shortens the training instead of overrunning the budget, and a spent one is an error."""
    import time

    import engine.training.features as features_mod

    prompts = [pair.encode(f"Count {i} and {i + 2}.") for i in range(8)]
    answers = generate_responses(pair.target, prompts, 12, batch_size=8, stop_ids=pair.stop_ids)
    seqs, plens = [p + a for p, a in zip(prompts, answers, strict=True)], [len(p) for p in prompts]
    cfg = TrainConfig(layers=1, block_size=4, steps=100000, batch_size=2, num_anchors=4, time_budget_s=600.0)
    features = features_mod.target_features

    def slow_features(*args, **kwargs):
        time.sleep(1.0)  # as a feature pass into host memory would take minutes
        return features(*args, **kwargs)

    monkeypatch.setattr(features_mod, "target_features", slow_features)
    with pytest.raises(EngineInputError, match="spent before training starts"):
        train_draft(pair.target, seqs, plens, cfg, pair.tokenizer.mask_id, log=lambda m: None,
                    deadline=time.perf_counter() + 0.5)
    logs = []
    t0 = time.perf_counter()
    _, summary = train_draft(pair.target, seqs, plens, cfg, pair.tokenizer.mask_id, log=logs.append,
                             deadline=time.perf_counter() + 3.0)
    budget = next(float(line.split()[2].rstrip("s")) for line in logs if line.startswith("training budget"))
    kept = summary["config"]["time_budget_s"]
    assert kept <= 2.0 and kept == pytest.approx(budget, abs=0.5)  # what the deadline left, not the 600 s asked
    assert time.perf_counter() - t0 < 60.0 and summary["steps"] < 100000


def test_held_out_sequences_are_scored_and_the_best_draft_is_kept(pair):
    """A held-out share is never trained on and is scored on fixed blocks; the draft returned is the
    one of the lowest held-out loss (rescoring it gives that loss)."""
    from engine.training.features import TokenStore
    from engine.training.train import _held_out, held_out_key, held_out_stats

    torch.manual_seed(0)
    prompts = [pair.encode(f"Item {i}: say {i} then {i + 1}.") for i in range(60)]
    answers = generate_responses(pair.target, prompts, 16, batch_size=30, stop_ids=pair.stop_ids)
    seqs, plens = [p + a for p, a in zip(prompts, answers, strict=True)], [len(p) for p in prompts]
    cfg = TrainConfig(layers=1, block_size=4, steps=30, batch_size=4, num_anchors=4, lr=3e-3, warmup_steps=3,
                      val_fraction=0.1, val_every=10)
    logs = []
    draft, summary = train_draft(pair.target, seqs, plens, cfg, pair.tokenizer.mask_id, log=logs.append)
    assert summary["held_out_sequences"] == 6 and summary["feature_store"] == "device"
    assert [v["step"] for v in summary["held_out"]] == [10, 20, 30]
    best = min(summary["held_out"], key=lambda v: v["loss"])
    assert summary["kept_step"] == best["step"]
    assert sum(line.startswith("held-out at step") for line in logs) == 3
    # rescoring the returned draft on the same fixed blocks gives the kept scoring's loss
    data = [torch.tensor(sq) for sq in seqs]
    lens = torch.tensor([len(sq) for sq in seqs])
    store = TokenStore(tokens=torch.cat(data), feats=target_features(pair.target, data, draft.cfg.target_layer_ids),
                       starts=torch.cumsum(lens, 0) - lens, lens=lens, prompt_lens=torch.tensor(plens))
    keys = [held_out_key(sq[:n]) for sq, n in zip(seqs, plens, strict=True)]
    train_idx, batches = _held_out(store, cfg, pair.tokenizer.mask_id, torch.device("cpu"), keys)
    assert len(batches) == 2 and train_idx.numel() == 54
    held = torch.cat([b["pick"] for b in batches])
    assert not set(held.tolist()) & set(train_idx.tolist())
    assert sorted(held.tolist()) == sorted(sorted(range(60), key=lambda i: keys[i])[:6])  # by prompt hash
    rescored = held_out_stats(draft.float(), pair.target, batches, store, cfg.gamma, False)
    assert rescored["loss"] == pytest.approx(best["loss"], rel=1e-5)
    # a warm start is scored before its first step, and kept if nothing after it scores better
    _, cont = train_draft(pair.target, seqs, plens, cfg, pair.tokenizer.mask_id, log=lambda m: None, init=draft)
    assert [v["step"] for v in cont["held_out"]] == [0, 10, 20, 30]
    assert cont["held_out"][0]["loss"] == pytest.approx(best["loss"], rel=1e-5)
    assert cont["kept_step"] == min(cont["held_out"], key=lambda v: v["loss"])["step"]
    # too little data: no held-out set, the last draft is kept
    _, small = train_draft(pair.target, seqs[:20], plens[:20], cfg, pair.tokenizer.mask_id, log=lambda m: None)
    assert small["held_out_sequences"] == 0 and small["held_out"] == [] and small["kept_step"] == 30
    with pytest.raises(EngineInputError, match="val_fraction"):
        TrainConfig(val_fraction=0.7)


def test_the_draft_is_kept_by_its_greedy_answers_when_sampled_ones_are_held_out_too(pair):
    """Data of greedy and sampled answers: each scoring gives the greedy answers' loss (what the draft is
    kept by: a greedy decode proposes against them) and the sampled ones' beside it; rescoring the greedy
    blocks alone gives the kept loss. One temperature a sequence, or a clear refusal."""
    from engine.training.features import TokenStore
    from engine.training.train import _held_out, held_out_key, held_out_stats

    torch.manual_seed(0)
    prompts = [pair.encode(f"Item {i}: say {i} then {i + 1}.") for i in range(40)]
    greedy = generate_responses(pair.target, prompts, 16, batch_size=40, stop_ids=pair.stop_ids)
    hot = generate_responses(pair.target, prompts, 16, batch_size=40, stop_ids=pair.stop_ids, temperature=1.0)
    seqs = [p + a for p, a in zip(prompts, greedy, strict=True)] + [p + a for p, a in zip(prompts, hot, strict=True)]
    plens, temps = [len(p) for p in prompts] * 2, [0.0] * 40 + [1.0] * 40
    cfg = TrainConfig(layers=1, block_size=4, steps=20, batch_size=4, num_anchors=4, lr=3e-3, warmup_steps=3,
                      val_fraction=0.1, val_every=10)
    logs = []
    draft, summary = train_draft(pair.target, seqs, plens, cfg, pair.tokenizer.mask_id, log=logs.append,
                                 temperatures=temps)
    assert summary["held_out_sequences"] == 8 and summary["held_out_sampled_sequences"] == 4  # 4 prompts, 2 each
    for v in summary["held_out"]:
        assert v.keys() >= {"loss", "acc1", "chain_al", "loss_sampled", "acc1_sampled", "chain_al_sampled"}
    assert any("sampled answers: loss" in line for line in logs)
    best = min(summary["held_out"], key=lambda v: v["loss"])
    assert summary["kept_step"] == best["step"] and summary["held_out_loss"] == best["loss"]
    data = [torch.tensor(sq) for sq in seqs]
    lens = torch.tensor([len(sq) for sq in seqs])
    store = TokenStore(tokens=torch.cat(data), feats=target_features(pair.target, data, draft.cfg.target_layer_ids),
                       starts=torch.cumsum(lens, 0) - lens, lens=lens, prompt_lens=torch.tensor(plens))
    keys = [held_out_key(sq[:n]) for sq, n in zip(seqs, plens, strict=True)]
    _, batches = _held_out(store, cfg, pair.tokenizer.mask_id, torch.device("cpu"), keys, [t > 0 for t in temps])
    rescored = held_out_stats(draft.float(), pair.target, [b for b in batches if not b["sampled"]], store, cfg.gamma,
                              False)
    assert rescored["loss"] == pytest.approx(best["loss"], rel=1e-5)
    with pytest.raises(EngineInputError, match="one temperature a sequence"):
        train_draft(pair.target, seqs, plens, cfg, pair.tokenizer.mask_id, log=lambda m: None, temperatures=temps[:3])
    # a resumed run must hold out the same answers: the flags are in the data's fingerprint once one is sampled
    from engine.training.checkpoint import data_fingerprint

    t, lens, plens_t = torch.tensor([5, 6, 7, 8]), torch.tensor([2, 2]), torch.tensor([1, 1])
    assert data_fingerprint(t, lens, plens_t) == data_fingerprint(t, lens, plens_t, [False, False])
    assert data_fingerprint(t, lens, plens_t, [False, True]) not in (data_fingerprint(t, lens, plens_t),
                                                                    data_fingerprint(t, lens, plens_t, [True, False]))
    for bad in (float("nan"), -0.5, True, None, "0.8"):
        with pytest.raises(EngineInputError, match=r"temperatures\[41\] must be a finite number >= 0"):
            train_draft(pair.target, seqs, plens, cfg, pair.tokenizer.mask_id, log=lambda m: None,
                        temperatures=temps[:41] + [bad] + temps[42:])


def test_recomputed_features_train_as_the_kept_ones(pair):
    """feature_store="recompute" keeps no features: each batch's come from the target's forward over
    it, the same numbers (float32) as the pass that keeps them, so training follows the same losses."""
    prompts = [pair.encode(f"Item {i}: say {i} then {i + 1}.") for i in range(24)]
    answers = generate_responses(pair.target, prompts, 16, batch_size=24, stop_ids=pair.stop_ids)
    seqs, plens = [p + a for p, a in zip(prompts, answers, strict=True)], [len(p) for p in prompts]
    runs, drafts = {}, {}
    for store in ("device", "recompute"):
        cfg = TrainConfig(layers=1, block_size=4, steps=6, batch_size=4, num_anchors=4, lr=3e-3, warmup_steps=2,
                          val_fraction=0.0, feature_store=store)
        torch.manual_seed(0)
        drafts[store], runs[store] = train_draft(pair.target, seqs, plens, cfg, pair.tokenizer.mask_id,
                                                 log=lambda m: None)
    assert runs["recompute"]["feature_store"] == "recompute" and runs["device"]["feature_store"] == "device"
    assert runs["recompute"]["final_loss"] == pytest.approx(runs["device"]["final_loss"], rel=1e-4)
    for (name, a), b in zip(drafts["device"].named_parameters(), drafts["recompute"].parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5, msg=name)
    assert not torch.equal(drafts["device"].fc.weight, new_draft_for(pair.target, cfg, 0).fc.weight)  # it trained


def test_sequences_round_trip_compressed_and_bad_records_name_the_line(tmp_path):
    seqs, plens = [[1, 2, 3, 4], [5, 6, 7]], [2, 1]
    for name in ("sd.jsonl", "sd.jsonl.gz", "sd.jsonl.xz"):
        save_sequences(tmp_path / name, seqs, plens)
        assert load_sequences(tmp_path / name) == (seqs, plens)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": [1, 2, 3], "prompt_len": 1}\n{"tokens": [1, 2], "prompt_len": 2}\n')
    with pytest.raises(EngineInputError, match=r"bad.jsonl:2: 'tokens' must be"):
        load_sequences(bad)
    bad.write_text("not json\n")
    with pytest.raises(EngineInputError, match=r"bad.jsonl:1: not a sequence record"):
        load_sequences(bad)
    # A sampled answer keeps its temperature; a greedy one writes none (files written before read the same).
    save_sequences(tmp_path / "mixed.jsonl.xz", seqs, plens, [0.0, 0.8])
    assert load_sequence_records(tmp_path / "mixed.jsonl.xz") == (seqs, plens, [0.0, 0.8])
    assert load_sequences(tmp_path / "mixed.jsonl.xz") == (seqs, plens)
    for temp in ('"hot"', "-1", "true", "null", "9" * 400):
        bad.write_text(json.dumps({"tokens": [1, 2, 3], "prompt_len": 1})[:-1] + f', "temperature": {temp}}}\n')
        with pytest.raises(EngineInputError, match=r"bad.jsonl:1: 'temperature' must be a finite number >= 0"):
            load_sequences(bad)


QUICKSTART = str(Path(__file__).resolve().parents[3] / "experiments" / "prompts" / "quickstart.jsonl")


def _step0_loss(log: str) -> float:
    return float(next(line for line in log.splitlines() if line.startswith("step 0 loss")).split()[3])


def _a_first_run(tmp_path: Path, capsys) -> tuple[list[str], Path, float]:
    """A 1-layer draft trained 30 steps into tmp_path/a, its data saved: the flags common to the runs
    after it, the data file and the first run's step-0 loss."""
    data = tmp_path / "sd.jsonl.gz"
    common = ["train-draft", "--target", "tiny-dense", "--device", "cpu", "--prompts", QUICKSTART, "--n-prompts", "6",
              "--gen-max-new-tokens", "24", "--batch-size", "4", "--num-anchors", "8", "--lr", "3e-3"]
    assert main(common + ["--out", str(tmp_path / "a"), "--layers", "1", "--block-size", "8", "--steps", "30",
                          "--save-data", str(data)]) == 0
    return common, data, _step0_loss(capsys.readouterr().out)


def test_warm_start_continues_the_checkpoint_and_keeps_its_architecture(tmp_path, capsys):
    common, data, fresh_start = _a_first_run(tmp_path, capsys)
    assert main(common + ["--out", str(tmp_path / "b"), "--init", str(tmp_path / "a"), "--data", str(data),
                          "--steps", "10"]) == 0
    log = capsys.readouterr().out
    assert "warm start from" in log and "30 steps so far" in log
    second = json.loads((tmp_path / "b" / "training.json").read_text())
    assert second["config"]["layers"] == 1 and second["config"]["block_size"] == 8
    assert second["init_training"]["steps"] == 30 and second["total_steps"] == 40
    # It starts where the first run ended, not from a random draft's loss.
    assert _step0_loss(log) < 0.8 * fresh_start
    # A flag that contradicts the checkpoint is a usage error that names both values.
    assert main(common + ["--out", str(tmp_path / "c"), "--init", str(tmp_path / "a"), "--data", str(data),
                          "--block-size", "16"]) == 2
    err = capsys.readouterr().err
    assert "--block-size 16 disagrees with the --init draft" in err and "block_size 8" in err
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_a_grown_draft_computes_what_it_grew_from_and_its_new_blocks_learn(pair):
    loaded = engine.load("tiny-dense", "random", device="cpu", dtype="float32").drafter.draft
    draft = DFlashDraft(loaded.cfg)  # as training holds it: each projection apart
    draft.load_state_dict(unfused_state_dict(loaded))
    grown = grow_draft(draft, draft.cfg.num_hidden_layers + 2, seed=3)
    assert grown.cfg.num_hidden_layers == draft.cfg.num_hidden_layers + 2
    feats = torch.randn(2, 9, len(draft.cfg.target_layer_ids) * draft.cfg.hidden_size)
    blocks = torch.randn(2, 4, draft.cfg.hidden_size)
    ctx_pos, q_pos = torch.arange(9).expand(2, 9), torch.arange(9, 13).expand(2, 4)
    torch.testing.assert_close(grown(blocks, feats, ctx_pos, q_pos), draft(blocks, feats, ctx_pos, q_pos),
                               rtol=0, atol=0)
    # The new blocks are not dead: their zeroed output projections get a gradient.
    grown(blocks, feats, ctx_pos, q_pos).square().sum().backward()
    new = grown.layers[-1]
    assert new.self_attn.o_proj.weight.grad.abs().sum() > 0 and new.mlp.down_proj.weight.grad.abs().sum() > 0
    assert grow_draft(draft, draft.cfg.num_hidden_layers) is draft
    # Wider too: every block's MLP widened, the same function; the new units learn.
    width = draft.cfg.intermediate_size
    wide = grow_draft(draft, draft.cfg.num_hidden_layers + 1, seed=4, intermediate_size=width + 24)
    assert wide.cfg.intermediate_size == width + 24 and wide.layers[0].mlp.gate_proj.weight.shape[0] == width + 24
    torch.testing.assert_close(wide(blocks, feats, ctx_pos, q_pos), draft(blocks, feats, ctx_pos, q_pos),
                               rtol=0, atol=0)
    wide(blocks, feats, ctx_pos, q_pos).square().sum().backward()
    assert wide.layers[0].mlp.down_proj.weight.grad[:, width:].abs().sum() > 0
    with pytest.raises(EngineInputError, match="can widen the --init draft's MLP"):
        grow_draft(draft, draft.cfg.num_hidden_layers, intermediate_size=width - 1)
    with pytest.raises(EngineInputError, match="can add layers to the --init draft's"):
        grow_draft(grown, 1)
    # A draft with attention biases: the new blocks' output biases start at zero too.
    biased = DFlashDraft(replace(draft.cfg, attention_bias=True))
    with torch.no_grad():
        for p in biased.parameters():
            p.normal_(0, 0.05)
    grown = grow_draft(biased, biased.cfg.num_hidden_layers + 1, seed=3)
    torch.testing.assert_close(grown(blocks, feats, ctx_pos, q_pos), biased(blocks, feats, ctx_pos, q_pos),
                               rtol=0, atol=0)


def test_warm_start_with_more_layers_grows_the_draft_and_begins_where_it_ended(tmp_path, capsys):
    common, data, fresh_start = _a_first_run(tmp_path, capsys)
    assert main(common + ["--out", str(tmp_path / "b"), "--init", str(tmp_path / "a"), "--data", str(data),
                          "--layers", "3", "--steps", "5"]) == 0
    log = capsys.readouterr().out
    assert "warm start from" in log and "3 layers, MLP width" in log and "(grown from 1 layers:" in log
    summary = json.loads((tmp_path / "b" / "training.json").read_text())
    assert summary["config"]["layers"] == 3 and summary["grown_from_layers"] == 1 and summary["total_steps"] == 35
    assert load_draft_folder(tmp_path / "b", engine.load("tiny-dense", "none", device="cpu").target, "cpu",
                             torch.float32).cfg.num_hidden_layers == 3
    assert _step0_loss(log) < 0.8 * fresh_start  # the grown draft starts as the trained one
    # (no held-out set on 6 prompts: the warning for a grown draft that never beat its start stays silent)
    assert "idle layers" not in log
    from engine.training.train_cli import grown_but_idle

    held = [{"step": 0, "loss": 2.41}, {"step": 250, "loss": 2.59}]
    run12 = {"grown_from_layers": 3, "kept_step": 0, "held_out": held, "config": {"layers": 5}}
    assert "the --init draft with 2 idle layers" in grown_but_idle(run12, Path("d"))
    assert grown_but_idle({**run12, "kept_step": 250}, Path("d")) is None
    assert grown_but_idle({**run12, "grown_from_layers": None}, Path("d")) is None
    wider = {**run12, "grown_from_layers": 5, "grown_from_intermediate_size": 640,
             "config": {"layers": 5, "intermediate_size": 1536}}
    assert "the --init draft with 896 idle MLP units a layer" in grown_but_idle(wider, Path("d"))
    # Fewer layers than the --init draft: a usage error naming both.
    assert main(common + ["--out", str(tmp_path / "c"), "--init", str(tmp_path / "b"), "--data", str(data),
                          "--layers", "2"]) == 2
    assert "--layers 2: a warm start can add layers to the --init draft's 3" in capsys.readouterr().err
    # A wider MLP: every block widened, the draft starting where it ended; a narrower one refused.
    width = json.loads((tmp_path / "b" / "training.json").read_text())["config"]["intermediate_size"]
    assert main(common + ["--out", str(tmp_path / "w"), "--init", str(tmp_path / "b"), "--data", str(data),
                          "--intermediate-size", str(2 * width), "--steps", "3"]) == 0
    log = capsys.readouterr().out
    assert f"MLP width {2 * width} (grown from MLP width {width}:" in log
    assert _step0_loss(log) < 0.8 * fresh_start
    summary = json.loads((tmp_path / "w" / "training.json").read_text())
    assert summary["grown_from_intermediate_size"] == width and summary["config"]["intermediate_size"] == 2 * width
    assert main(common + ["--out", str(tmp_path / "n"), "--init", str(tmp_path / "w"), "--data", str(data),
                          "--intermediate-size", str(width)]) == 2
    assert f"--intermediate-size {width}: a warm start can widen the --init draft's MLP ({2 * width})" in \
        capsys.readouterr().err


def test_gen_more_answers_only_the_prompts_the_reused_data_lacks(tmp_path, capsys):
    common = ["train-draft", "--target", "tiny-dense", "--device", "cpu", "--prompts", QUICKSTART,
              "--gen-max-new-tokens", "12", "--batch-size", "2", "--num-anchors", "4", "--steps", "2",
              "--layers", "1", "--block-size", "4"]
    first, both = tmp_path / "first.jsonl.xz", tmp_path / "both.jsonl.xz"
    assert main(common + ["--n-prompts", "3", "--out", str(tmp_path / "a"), "--save-data", str(first)]) == 0
    seqs, plens = load_sequences(first)
    assert len(seqs) == 3
    assert main(common + ["--n-prompts", "6", "--out", str(tmp_path / "b"), "--data", str(first), "--gen-more",
                          "--save-data", str(both)]) == 0
    assert "--gen-more: 3 sequences reused, 3 answers to give (1 a prompt at temperature 0)" in \
        capsys.readouterr().out
    all_seqs, all_plens = load_sequences(both)
    assert all_seqs[:3] == seqs and len(all_seqs) == 6
    assert len({tuple(s[:n]) for s, n in zip(all_seqs, all_plens, strict=True)}) == 6  # no prompt twice
    summary = json.loads((tmp_path / "b" / "training.json").read_text())
    assert summary["reused_sequences"] == 3 and summary["sequences"] == 6
    # --gen-more alone has nothing to add to: a usage error before any model loads.
    assert main(common + ["--out", str(tmp_path / "c"), "--gen-more"]) == 2
    assert "--gen-more adds to the sequences of --data" in capsys.readouterr().err
    # Sampled answers on top: two a prompt at 0.8, the greedy ones kept; a second call adds only the missing.
    sampled, more = tmp_path / "sampled.jsonl.xz", tmp_path / "more.jsonl.xz"
    assert main(common + ["--n-prompts", "6", "--out", str(tmp_path / "s"), "--data", str(both), "--gen-more",
                          "--gen-temperature", "0.8", "--gen-samples", "2", "--save-data", str(sampled)]) == 0
    assert "--gen-more: 6 sequences reused, 12 answers to give (2 a prompt at temperature 0.8)" in \
        capsys.readouterr().out
    s_seqs, s_plens, s_temps = load_sequence_records(sampled)
    assert s_seqs[:6] == all_seqs and s_temps == [0.0] * 6 + [0.8] * 12
    per_prompt = Counter(tuple(s[:n]) for s, n, t in zip(s_seqs, s_plens, s_temps, strict=True) if t)
    assert sorted(per_prompt.values()) == [2] * 6
    assert json.loads((tmp_path / "s" / "training.json").read_text())["sampled_sequences"] == {"0.8": 12}
    assert main(common + ["--n-prompts", "6", "--out", str(tmp_path / "t"), "--data", str(sampled), "--gen-more",
                          "--gen-temperature", "0.8", "--gen-samples", "3", "--save-data", str(more)]) == 0
    assert "--gen-more: 18 sequences reused, 6 answers to give (3 a prompt at temperature 0.8)" in \
        capsys.readouterr().out
    m_seqs, _, _ = load_sequence_records(more)
    assert len(m_seqs) == 24 and len(set(map(tuple, m_seqs[18:])) - set(map(tuple, m_seqs[:18]))) > 0
    # Flags that cannot make sampled data: usage errors naming the flag and the rule.
    for flags, message in ((["--gen-samples", "2"], "--gen-samples 2 at --gen-temperature 0"),
                           (["--data", str(both), "--gen-temperature", "0.8"], "add --gen-more to answer"),
                           (["--gen-samples", "0"], "--gen-samples must be >= 1"),
                           (["--gen-temperature", "-1"], "--gen-temperature must be a finite number >= 0")):
        assert main(common + ["--out", str(tmp_path / "x"), *flags]) == 2
        assert message in capsys.readouterr().err


def test_held_out_prompts_take_all_their_answers():
    """A prompt's answers (greedy and sampled) share its held-out key: the last prompt held out takes them
    all, so no answer of a held-out prompt trains; with one answer a prompt the split is the plain one."""
    from engine.training import train as train_mod

    class Store:  # the two things _held_out reads of a TokenStore
        def __init__(self, n):
            self.lens = torch.full((n,), 12)

        def tokens_of(self, pick):
            k = pick.numel()
            return torch.ones(k, 12, dtype=torch.long), torch.full((k,), 12), torch.full((k,), 4)

    cfg = TrainConfig(val_fraction=0.1, batch_size=4, num_anchors=2, block_size=4)
    keys = [bytes([i // 3]) for i in range(60)]  # 20 prompts, 3 answers each: 10% is 6 answers, 2 prompts
    keys[5], keys[6] = bytes([1]), bytes([1])  # prompt 1 has 4 answers, one past the first 6 in key order
    train_idx, batches = train_mod._held_out(Store(60), cfg, 0, torch.device("cpu"), keys)
    held = torch.cat([b["pick"] for b in batches]).tolist()
    assert {keys[i] for i in held} == {bytes([0]), bytes([1])} and len(held) == 7
    assert not {keys[i] for i in train_idx.tolist()} & {keys[i] for i in held}
    assert sorted(held + train_idx.tolist()) == list(range(60))
    train_idx, batches = train_mod._held_out(Store(60), cfg, 0, torch.device("cpu"), [bytes([i]) for i in range(60)])
    assert torch.cat([b["pick"] for b in batches]).tolist() == list(range(6))
    # Every answer one prompt's: holding it out would leave nothing to train on, so it trains.
    train_idx, batches = train_mod._held_out(Store(60), cfg, 0, torch.device("cpu"), [b"p"] * 60)
    assert batches == [] and train_idx.tolist() == list(range(60))
    # Greedy and sampled answers held out: the same split, the greedy answers' blocks first, each batch
    # saying which it holds; all greedy, the blocks of the split without the flags
    sampled = [i % 3 != 0 for i in range(60)]
    plain_idx, plain = train_mod._held_out(Store(60), cfg, 0, torch.device("cpu"), keys)
    train_idx, batches = train_mod._held_out(Store(60), cfg, 0, torch.device("cpu"), keys, sampled)
    assert torch.equal(train_idx, plain_idx)
    assert [(b["pick"].tolist(), b["sampled"]) for b in batches] == [([0, 3, 6], False), ([1, 2, 4, 5], True)]
    _, flagged = train_mod._held_out(Store(60), cfg, 0, torch.device("cpu"), keys, [False] * 60)
    assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if k != "sampled")
               for a, b in zip(flagged, plain, strict=True))
