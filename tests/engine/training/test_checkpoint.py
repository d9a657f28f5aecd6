"""Resumable draft training (issue #26): a run stopped, checkpointed and resumed is the run that
never stopped, bit for bit on a CPU; checkpoints are atomic, split into checked parts, and refuse
to continue a different run."""

import copy
import json
from pathlib import Path

import pytest
import torch

import engine
from engine.cli import main
from engine.config import EngineInputError
from engine.loading import load_draft_folder
from engine.training import checkpoint as ckpt
from engine.training.checkpoint import (
    CheckpointConfig,
    check_resumable,
    load_checkpoint,
    read_manifest,
)
from engine.training.sequences import generate_responses
from engine.training.train import TrainConfig, learning_rate, train_draft

pytestmark = pytest.mark.xdist_group("test_checkpoint")

QUICKSTART = str(Path(__file__).resolve().parents[3] / "experiments" / "prompts" / "quickstart.jsonl")
K, K1 = 10, 4  # steps in all, steps before the interruption


@pytest.fixture(scope="module")
def data(answered):
    return answered(12)


CFG = TrainConfig(layers=1, block_size=4, steps=K, batch_size=3, num_anchors=4, lr=3e-3, warmup_steps=3,
                  decay_over="steps")


def _train(pair, data, folder: Path, **kw):
    seqs, plens = data
    return train_draft(pair.target, seqs, plens, kw.pop("cfg", CFG), pair.tokenizer.mask_id, log=lambda m: None,
                       checkpoint=CheckpointConfig(folder, every=kw.pop("every", 1000)), **kw)


def _state(folder: Path) -> dict:
    return load_checkpoint(folder, read_manifest(folder))


def read_manifest_raw(folder: Path) -> dict:
    """The manifest as written (read_manifest wants a training run's keys)."""
    return json.loads((folder / ckpt.MANIFEST).read_text())


def _interrupted(pair, data, folder: Path):
    """K1 steps, a checkpoint, and (as a later call would) K - K1 more from it."""
    _, first = _train(pair, data, folder, stop_after=K1)
    assert first["steps"] == K1 and not first["complete"]
    return _train(pair, data, folder, resume=folder)


def test_resumed_training_equals_uninterrupted_training(pair, data, tmp_path):
    """The done-when of issue #26: k steps in one go, and k1 steps -> checkpoint -> resume for
    k - k1, give the same loss at every step after the resume, the same weights and the same
    AdamW moments (float32, CPU: exactly)."""
    draft_a, sum_a = _train(pair, data, tmp_path / "a")
    draft_b, sum_b = _interrupted(pair, data, tmp_path / "b")
    a, b = _state(tmp_path / "a"), _state(tmp_path / "b")
    assert a["history"].shape == (K, 3)
    assert torch.equal(a["history"], b["history"])  # the next-step loss (step K1 + 1) and every later one
    for name, w in draft_a.state_dict().items():
        assert torch.equal(w, draft_b.state_dict()[name]), name
    for key, st in a["optimizer"]["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(st[name], b["optimizer"]["state"][key][name]), (key, name)
    assert sum_a["steps"] == sum_b["steps"] == K and sum_b["complete"]
    assert sum_a["final_loss"] == sum_b["final_loss"]
    # the resume history: two calls for b, each with where it started and ended and why it stopped
    assert [(c["start_step"], c["end_step"], c["stopped"]) for c in sum_b["calls"]] == [
        (0, K1, "stop-after"), (K1, K, "steps")]
    assert [(c["start_step"], c["end_step"]) for c in sum_a["calls"]] == [(0, K)]


@pytest.mark.parametrize("broken", ["optimizer", "sampler rng", "schedule"])
def test_the_resume_test_fails_when_a_piece_of_state_is_not_restored(pair, data, tmp_path, monkeypatch, broken):
    """The equality above is not a rubber stamp: leave out the AdamW moments, the sampler's RNG
    state or the schedule's position and the resumed run parts from the uninterrupted one."""
    _train(pair, data, tmp_path / "a")
    if broken == "optimizer":
        monkeypatch.setattr(torch.optim.AdamW, "load_state_dict", lambda self, sd: None)
    elif broken == "sampler rng":
        restore_rng = ckpt.set_rng_states
        monkeypatch.setattr(ckpt, "set_rng_states", lambda states, sampler: restore_rng(
            dict(states, sampler=torch.Generator().manual_seed(CFG.seed).get_state()), sampler))
    else:  # the schedule restarted at step 0 after the resume
        import engine.training.train as train_mod

        calls = []

        def restarted(cfg, step, elapsed):
            calls.append(step)
            return learning_rate(cfg, step - K1 if len(calls) > K1 else step, elapsed)

        monkeypatch.setattr(train_mod, "learning_rate", restarted)
    _interrupted(pair, data, tmp_path / "b")
    a, b = _state(tmp_path / "a"), _state(tmp_path / "b")
    assert torch.equal(a["history"][:K1], b["history"][:K1])
    assert not torch.equal(a["history"][K1:], b["history"][K1:])


def test_the_best_held_out_draft_and_history_survive_a_resume(pair, tmp_path):
    """With a held-out set: the scorings before the interruption, the best draft's weights and its
    step come back, so the draft returned at the end is the best of the whole run."""
    prompts = [pair.encode(f"Row {i}: count {i}, {i + 1}.") for i in range(52)]
    answers = generate_responses(pair.target, prompts, 10, batch_size=52, stop_ids=pair.stop_ids)
    data = ([p + a for p, a in zip(prompts, answers, strict=True)], [len(p) for p in prompts])
    cfg = TrainConfig(layers=1, block_size=4, steps=8, batch_size=3, num_anchors=4, lr=3e-3, warmup_steps=2,
                      val_every=2, decay_over="steps")
    _, first = _train(pair, data, tmp_path / "ck", cfg=cfg, stop_after=4)
    manifest = read_manifest(tmp_path / "ck")
    assert [v["step"] for v in manifest["val_history"]] == [2, 4]
    # the best draft's weights travel only when they are not the current ones
    assert (_state(tmp_path / "ck")["best"] is None) == (manifest["best"]["step"] == 4)
    draft, second = _train(pair, data, tmp_path / "ck", cfg=cfg, resume=tmp_path / "ck")
    assert [v["step"] for v in second["held_out"]] == [2, 4, 6, 8]
    assert second["held_out"][:2] == first["held_out"]
    best = min(second["held_out"], key=lambda v: v["loss"])
    assert second["kept_step"] == best["step"] and second["held_out_loss"] == best["loss"]
    assert len(second["held_out"][-1]["slot_acc"]) == cfg.block_size - 1  # acceptance per block slot
    assert (tmp_path / "ck" / "curves.png").stat().st_size > 1000
    # cut between two scorings (step 3 of val_every 2): the held-out steps are an uninterrupted run's
    _, whole = _train(pair, data, tmp_path / "whole", cfg=cfg)
    _train(pair, data, tmp_path / "cut", cfg=cfg, stop_after=3)
    _, cut = _train(pair, data, tmp_path / "cut", cfg=cfg, resume=tmp_path / "cut")
    assert [v["step"] for v in cut["held_out"]] == [v["step"] for v in whole["held_out"]] == [2, 4, 6, 8]
    assert cut["kept_step"] == whole["kept_step"] and cut["held_out"] == whole["held_out"]


def test_parts_are_checked_joined_and_written_atomically(pair, data, tmp_path, monkeypatch):
    """A checkpoint split into parts of at most --part-mb loads back; a missing or corrupt part is
    named; a write killed before the manifest leaves the previous checkpoint whole; superseded parts go."""
    folder = tmp_path / "ck"
    seqs, plens = data
    ck = CheckpointConfig(folder, every=2, part_mb=0.05)  # ~50 KiB parts: the tiny draft's state takes several
    train_draft(pair.target, seqs, plens, CFG, pair.tokenizer.mask_id, log=lambda m: None, checkpoint=ck,
                stop_after=2)
    manifest = read_manifest(folder)
    parts = [p["name"] for p in manifest["parts"]]
    assert len(parts) >= 3 and all((folder / n).stat().st_size <= 0.05 * 2**20 for n in parts)
    assert sorted(p.name for p in folder.glob("state-*")) == parts
    good = _state(folder)
    # killed while writing the next checkpoint: its parts written, the manifest not
    real_write = ckpt._atomic_write

    def killed(path, blob):
        if path.name == ckpt.MANIFEST:
            raise KeyboardInterrupt("killed mid-write")
        real_write(path, blob)

    monkeypatch.setattr(ckpt, "_atomic_write", killed)
    with pytest.raises(KeyboardInterrupt):
        train_draft(pair.target, seqs, plens, CFG, pair.tokenizer.mask_id, log=lambda m: None, checkpoint=ck,
                    resume=folder)
    monkeypatch.setattr(ckpt, "_atomic_write", real_write)
    assert read_manifest(folder)["step"] == 2
    assert torch.equal(_state(folder)["history"], good["history"])
    # the next successful write removes every part it does not name (the old ones and the orphans)
    train_draft(pair.target, seqs, plens, CFG, pair.tokenizer.mask_id, log=lambda m: None, checkpoint=ck,
                resume=folder, stop_after=2)
    manifest = read_manifest(folder)
    assert manifest["step"] == 4
    assert sorted(p.name for p in folder.glob("state-*")) == [p["name"] for p in manifest["parts"]]
    assert not list(folder.glob(".*tmp*"))
    # a corrupt part, then a missing one
    victim = folder / manifest["parts"][1]["name"]
    blob = bytearray(victim.read_bytes())
    blob[10] ^= 0xFF
    victim.write_bytes(bytes(blob))
    with pytest.raises(EngineInputError, match=rf"part {victim} is corrupt"):
        load_checkpoint(folder, manifest)
    victim.unlink()
    with pytest.raises(EngineInputError, match=rf"part {victim.name} of .* is missing"):
        load_checkpoint(folder, manifest)


def test_a_bfloat16_checkpoint_is_half_the_size_and_resumes_close(pair, data, tmp_path):
    """--state-dtype bfloat16 (for state that must travel through size limits): about half the
    bytes, and the resumed run follows the exact one closely, though not bit for bit."""
    _train(pair, data, tmp_path / "a")
    seqs, plens = data
    ck = CheckpointConfig(tmp_path / "b", state_dtype="bfloat16")
    train_draft(pair.target, seqs, plens, CFG, pair.tokenizer.mask_id, log=lambda m: None, checkpoint=ck,
                stop_after=K1)
    exact = CheckpointConfig(tmp_path / "c")
    train_draft(pair.target, seqs, plens, CFG, pair.tokenizer.mask_id, log=lambda m: None, checkpoint=exact,
                stop_after=K1)
    small, full = read_manifest(tmp_path / "b")["bytes"], read_manifest(tmp_path / "c")["bytes"]
    assert small < 0.6 * full and read_manifest(tmp_path / "b")["state_dtype"] == "bfloat16"
    assert _state(tmp_path / "b")["optimizer"]["state"][0]["exp_avg"].dtype == torch.bfloat16
    train_draft(pair.target, seqs, plens, CFG, pair.tokenizer.mask_id, log=lambda m: None, checkpoint=ck,
                resume=tmp_path / "b")
    a, b = _state(tmp_path / "a")["history"], _state(tmp_path / "b")["history"]
    assert torch.equal(a[:K1], b[:K1])
    torch.testing.assert_close(b[K1:, 0], a[K1:, 0], rtol=0.05, atol=0.05)  # the loss, within rounding
    with pytest.raises(EngineInputError, match="--state-dtype must be one of"):
        CheckpointConfig(tmp_path, state_dtype="float16")


def test_an_int8_checkpoint_is_a_third_of_the_size_and_resumes_close(pair, data, tmp_path, monkeypatch):
    """--state-dtype int8 (bfloat16 weights, 8-bit blockwise moments): exactly the bytes claimed (2
    a weight, 1 a moment value, 4 + 8 bytes of scales per 256 values), under 40% of float32's file
    here, and the resumed run ends close to the uninterrupted one: every later loss within 0.01,
    every weight within 1% of its tensor's largest (measured: 0.0005 and 0.4%, the bfloat16
    weights' rounding). Resetting the moments instead (what a lost or broken state does) misses
    both by far (0.4 and 12%)."""
    from engine.training.quantized_state import BLOCK

    draft_a, _ = _train(pair, data, tmp_path / "a")
    seqs, plens = data

    def cut_and_resume(folder):
        ck = CheckpointConfig(folder, state_dtype="int8")
        train_draft(pair.target, seqs, plens, CFG, pair.tokenizer.mask_id, log=lambda m: None, checkpoint=ck,
                    stop_after=K1)
        size, state = read_manifest(folder)["bytes"], _state(folder)
        draft, _ = train_draft(pair.target, seqs, plens, CFG, pair.tokenizer.mask_id, log=lambda m: None,
                               checkpoint=ck, resume=folder)
        return size, state, draft, _state(folder)["history"]

    size, state, draft_b, hist_b = cut_and_resume(tmp_path / "b")
    assert read_manifest(tmp_path / "b")["state_dtype"] == "int8"
    params = list(draft_a.parameters())
    weights = sum(t.numel() * t.element_size() for t in state["draft"].values())
    codes = sum(t.numel() * t.element_size() for st in state["optimizer"]["state"].values()
                for enc in (st["exp_avg"], st["exp_avg_sq"]) for k, t in enc.items() if isinstance(t, torch.Tensor))
    blocks = sum(-(-p.numel() // BLOCK) for p in params)
    assert weights == 2 * sum(p.numel() for p in params)
    assert codes == blocks * (2 * BLOCK + 4 + 8)
    train_draft(pair.target, seqs, plens, CFG, pair.tokenizer.mask_id, log=lambda m: None,
                checkpoint=CheckpointConfig(tmp_path / "c"), stop_after=K1)
    assert size < 0.4 * read_manifest(tmp_path / "c")["bytes"]

    def apart(draft, history) -> tuple[float, float]:
        a = _state(tmp_path / "a")["history"]
        assert torch.equal(a[:K1], history[:K1])
        loss = (history[K1:, 0] - a[K1:, 0]).abs().max().item()
        weight = max((x - y).abs().max().item() / x.abs().max().item()
                     for x, y in zip(draft_a.state_dict().values(), draft.state_dict().values(), strict=True))
        return loss, weight

    loss, weight = apart(draft_b, hist_b)
    assert 0 < weight and loss <= 0.01 and weight <= 0.01
    monkeypatch.setattr(ckpt, "decode_moments", lambda sd: {**sd, "state": {}})
    _, _, draft_r, hist_r = cut_and_resume(tmp_path / "r")
    loss, weight = apart(draft_r, hist_r)
    assert loss > 0.01 and weight > 0.01


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_int8_checkpoint_written_on_the_gpu_resumes_close_on_the_gpu(data, tmp_path):
    """The moments coded and decoded as CUDA tensors (the device's train_long.sh writes int8):
    the resumed run's later losses stay within 0.05 of the uninterrupted one's (bf16 autocast on
    the GPU: not bit for bit even in float32)."""
    gpu = engine.load("tiny-dense", "none", device="cuda", dtype="float32")
    seqs, plens = data
    run = dict(log=lambda m: None)
    train_draft(gpu.target, seqs, plens, CFG, gpu.tokenizer.mask_id, checkpoint=CheckpointConfig(tmp_path / "a"), **run)
    ck = CheckpointConfig(tmp_path / "b", state_dtype="int8")
    train_draft(gpu.target, seqs, plens, CFG, gpu.tokenizer.mask_id, checkpoint=ck, stop_after=K1, **run)
    assert _state(tmp_path / "b")["optimizer"]["state"][0]["exp_avg"]["codec"] == "ratio8"
    train_draft(gpu.target, seqs, plens, CFG, gpu.tokenizer.mask_id, checkpoint=ck, resume=tmp_path / "b", **run)
    a, b = _state(tmp_path / "a")["history"], _state(tmp_path / "b")["history"]
    assert (b[K1:, 0] - a[K1:, 0]).abs().max() <= 0.05


def test_smollm2_drafts_int8_state_is_the_size_the_docs_give(tmp_path):
    """The 3-layer SmolLM2 draft (7.64 M parameters): 44.1 MiB in int8 with the best draft beside
    the latest (29.6 without it; docs/own-model.md, the model card, benchmarks/DEVICE.md), in three
    parts of at most 15 MiB."""
    from engine.loading import _draft_config_from_hf
    from engine.models.draft import DFlashDraft
    from engine.training.checkpoint import RunState, save_checkpoint

    folder = Path(engine.__file__).parent / "checkpoints" / "smollm2-135m-dflash"
    cfg = _draft_config_from_hf(json.loads((folder / "config.json").read_text()), folder, 30)
    torch.manual_seed(0)
    draft = DFlashDraft(cfg)
    assert sum(p.numel() for p in draft.parameters()) == 7_635_840
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-4, betas=(0.9, 0.95))
    for p in draft.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    state = RunState(step=2, best=(1.0, 1, {k: v.clone() for k, v in draft.state_dict().items()}))
    save_checkpoint(CheckpointConfig(tmp_path, state_dtype="int8"), state, draft, opt, torch.Generator(),
                    {"config": {}})
    manifest = read_manifest_raw(tmp_path)
    assert abs(manifest["bytes"] / 2**20 - 44.1) < 0.1 and len(manifest["parts"]) == 3


def test_export_draft_writes_the_checkpoints_draft_without_the_target(pair, data, tmp_path):
    """export_draft (device_kit.py --receive uses it: a checkpoint that came back without its draft
    folder): the checkpoint's draft in the public layout, loadable for the target, equal to the one
    train_draft returned (in bfloat16); a checkpoint without its draft's config is refused by name."""
    draft, summary = _train(pair, data, tmp_path / "ck", stop_after=K1)
    ckpt.export_draft(tmp_path / "ck", tmp_path / "out", training=summary)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["training"]["steps"] == K1 and config["dtype"] == "bfloat16"
    assert engine.load("tiny-dense", str(tmp_path / "out"), device="cpu").drafter is not None
    back = load_draft_folder(tmp_path / "out", pair.target, "cpu", torch.float32)
    for name, w in draft.state_dict().items():
        assert torch.equal(back.state_dict()[name], w.to(torch.bfloat16).float()), name
    manifest = read_manifest_raw(tmp_path / "ck")
    manifest.pop("draft_config")
    (tmp_path / "ck" / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(EngineInputError, match="no 'draft_config'"):
        ckpt.export_draft(tmp_path / "ck", tmp_path / "out2")


def test_a_different_run_is_refused_naming_the_field_and_both_values(pair, data, tmp_path):
    folder = tmp_path / "ck"
    _train(pair, data, folder, stop_after=2)
    manifest = read_manifest(folder)
    with pytest.raises(EngineInputError, match=r"trained with lr=0.003, this run asks for lr=0.001 \(--lr\)"):
        check_resumable(manifest, folder, TrainConfig(**{**manifest["config"], "lr": 1e-3}))
    with pytest.raises(EngineInputError, match=r"block_size=4, this run asks for block_size=8"):
        check_resumable(manifest, folder, TrainConfig(**{**manifest["config"], "block_size": 8}))
    # what may change: the total steps, the budgets, when to score, where features live
    check_resumable(manifest, folder, TrainConfig(**{**manifest["config"], "steps": 50, "time_budget_s": 60.0,
                                                     "val_every": 7, "feature_store": "host"}))
    with pytest.raises(EngineInputError, match="past --steps 1; give --steps of at least 2"):
        check_resumable(manifest, folder, TrainConfig(**{**manifest["config"], "steps": 1}))
    seqs, plens = data
    with pytest.raises(EngineInputError, match=r"has data '[0-9a-f]+', this run has '[0-9a-f]+' \(give the "):
        train_draft(pair.target, seqs[:-1], plens[:-1], CFG, pair.tokenizer.mask_id, log=lambda m: None,
                    resume=folder)
    with pytest.raises(EngineInputError, match="has mask_token_id"):
        train_draft(pair.target, seqs, plens, CFG, pair.tokenizer.mask_id + 1, log=lambda m: None, resume=folder)
    with pytest.raises(EngineInputError, match=r"no checkpoint.json there"):
        read_manifest(tmp_path)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "checkpoint.json").write_text("{not json")
    with pytest.raises(EngineInputError, match=r"bad/checkpoint.json: not JSON"):
        read_manifest(tmp_path / "bad")
    with pytest.raises(EngineInputError, match="--part-mb must be at least"):
        CheckpointConfig(folder, part_mb=0)


def test_train_draft_resumes_across_calls_on_your_own_prompts(tmp_path, capsys):
    """The CLI on a JSONL of prompts (the workload format): call 1 self-distils, saves the data and
    stops after 3 steps; call 2 resumes on the saved data and finishes. training.json keeps the
    run's steps, data, device, wall time, held-out loss and both calls; curves.png is drawn; the
    progress bar goes to stderr, and --no-progress silences it."""
    ck, out, seqs = tmp_path / "ck", tmp_path / "draft", tmp_path / "sd.jsonl.gz"
    common = ["train-draft", "--target", "tiny-dense", "--device", "cpu", "--prompts", QUICKSTART,
              "--gen-max-new-tokens", "16", "--batch-size", "2", "--num-anchors", "4", "--steps", "6",
              "--layers", "1", "--block-size", "4", "--out", str(out), "--checkpoint-dir", str(ck)]
    assert main(common + ["--save-data", str(seqs), "--stop-after", "3"]) == 0
    captured = capsys.readouterr()
    assert "step 3" in captured.err and "tok/s" in captured.err and "eta" in captured.err  # the progress bar
    assert "steps: 3\n" in captured.out and f"resumable: {ck} (step 3 of 6)" in captured.out
    first = json.loads((out / "training.json").read_text())
    assert first["steps"] == 3 and not first["complete"]
    # a fresh run may not overwrite the checkpoint
    assert main(common + ["--out", str(tmp_path / "other")]) == 2
    assert f"--checkpoint-dir {str(ck)!r} holds a checkpoint (step 3)" in capsys.readouterr().err
    # a changed flag is refused before any model loads, naming the field and both values
    assert main(common + ["--data", str(seqs), "--resume", str(ck), "--lr", "1e-3"]) == 2
    assert "lr=0.0006, this run asks for lr=0.001 (--lr)" in capsys.readouterr().err
    assert main(common + ["--data", str(seqs), "--resume", str(ck), "--init", str(out)]) == 2
    assert "leave --init out" in capsys.readouterr().err
    # call 2: the same flags, the saved data, --resume; --out holds this run's draft and is replaced
    assert main(common + ["--data", str(seqs), "--resume", str(ck), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "tok/s" not in captured.err
    assert f"resumed {ck} at step 3 of 6 (call 2" in captured.out and "steps: 6\n" in captured.out
    summary = json.loads((out / "training.json").read_text())
    assert summary["steps"] == 6 and summary["complete"] and summary["run_id"] == first["run_id"]
    assert [(c["start_step"], c["end_step"], c["stopped"]) for c in summary["calls"]] == [
        (0, 3, "stop-after"), (3, 6, "steps")]
    assert summary["prompts"] == [QUICKSTART] and summary["data"] == [str(seqs)]
    assert summary["sequences"] == 6 and summary["tokens"] > 0 and summary["device"] == "cpu"
    assert summary["wall_seconds"] > 0 and summary["config"]["decay_over"] == "steps"
    assert "held_out_loss" in summary and summary["resumed_from"] == str(ck)
    assert (ck / "curves.png").is_file() and read_manifest(ck)["step"] == 6
    loaded = engine.load("tiny-dense", str(out), device="cpu")  # the draft written is a working draft
    assert loaded.drafter is not None


def test_a_warm_started_run_resumes_with_its_architecture_and_history(tmp_path, capsys):
    """--init in the first call, --resume without it and without the architecture flags: the
    checkpoint's sizes are kept, and training.json still counts the warm start's steps."""
    data = tmp_path / "sd.jsonl"
    base = ["train-draft", "--target", "tiny-dense", "--device", "cpu", "--batch-size", "2", "--num-anchors", "4",
            "--no-progress"]
    assert main(base + ["--prompts", QUICKSTART, "--gen-max-new-tokens", "12", "--steps", "3", "--layers", "1",
                        "--block-size", "4", "--out", str(tmp_path / "a"), "--save-data", str(data)]) == 0
    run = base + ["--data", str(data), "--steps", "8", "--out", str(tmp_path / "b")]
    assert main(run + ["--init", str(tmp_path / "a"), "--checkpoint-dir", str(tmp_path / "ck"),
                       "--stop-after", "2"]) == 0
    assert main(run + ["--resume", str(tmp_path / "ck")]) == 0
    assert "resumed" in capsys.readouterr().out
    summary = json.loads((tmp_path / "b" / "training.json").read_text())
    assert summary["config"]["layers"] == 1 and summary["config"]["block_size"] == 4
    assert summary["steps"] == 8 and summary["init_training"]["steps"] == 3 and summary["total_steps"] == 11


def test_a_warm_start_with_its_own_architecture_resumes_as_that_draft(pair, data, tmp_path):
    """--init with a draft the target's config would not build (other target layers, rope, width, two
    heads): the checkpoint records the draft's own config, so the resumed call rebuilds that draft and
    ends where the uninterrupted warm-started run ends."""
    from engine.models.draft import DFlashConfig, DFlashDraft

    tc = pair.target.cfg
    own = DFlashConfig(hidden_size=tc.hidden_size, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=96, vocab_size=tc.vocab_size, target_layer_ids=(0, 2),
                       num_target_layers=tc.num_hidden_layers, block_size=CFG.block_size,
                       mask_token_id=pair.tokenizer.mask_id, head_dim=32, rope_theta=5e5)
    torch.manual_seed(0)
    init = DFlashDraft(own)
    straight, _ = _train(pair, data, tmp_path / "straight", init=copy.deepcopy(init))  # trained in place
    _train(pair, data, tmp_path / "cut", init=copy.deepcopy(init), stop_after=K1)
    assert read_manifest(tmp_path / "cut")["draft_config"]["target_layer_ids"] == [0, 2]
    resumed, _ = _train(pair, data, tmp_path / "cut", resume=tmp_path / "cut")
    assert resumed.cfg == own
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_the_resume_help_names_every_setting_a_resume_may_change():
    """--resume's help is the user's list of what may differ between calls: each field the checkpoint
    lets change (RESUMABLE_CHANGES) is named there by its flag."""
    import argparse

    from engine.training.train_cli import add_parser

    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers())
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices["train-draft"]
    flags = {o for a in sub._actions for o in a.option_strings}
    text = " ".join(next(a for a in sub._actions if "--resume" in a.option_strings).help.split())
    for field in ckpt.RESUMABLE_CHANGES:
        flag = "--" + field.removesuffix("_s").replace("_", "-")
        assert flag in flags and flag in text, field
