"""A resumable training checkpoint carried across device calls and sessions (benchmarks/DEVICE.md,
"Long training"): a call carries at most 64 MiB in (the tree included) and brings at most 8 files
of at most 16 MiB back, and nothing outlives the session.

A checkpoint folder is a manifest (``checkpoint.json``) and its parts (``state-*``, at most
``--part-mb`` each, SHA-256 in the manifest), so moving one is moving files:

- ``plan_carries``: the parts assigned to calls, each call's group within its carry budget and the
  manifest in the last group (used by ``device_kit.py --checkpoint``, which stages the groups);
- ``gather``: parts arriving over several calls (the device's carried groups, or the files that
  came back from the device) collected in an incoming folder, and swapped in for the kept
  checkpoint only once the manifest and every part it names are there, checked: an incomplete
  transfer never replaces a whole checkpoint;
- ``give``: the manifest and the parts not sent yet copied into ``$OUT``, within the files a call
  brings back (``RETURN=2`` calls send the rest).

On the device (``benchmarks/device/train_long.sh``)::

    python3 benchmarks/device_ck.py gather .device/ck* --incoming /root/stash/ck_in --into /root/stash/ck
    python3 benchmarks/device_ck.py flags /root/stash/ck      # train-draft flags that resume it
    python3 benchmarks/device_ck.py give /root/stash/ck --out "$OUT" --sent /root/stash/ck_sent.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Standalone (no engine, no torch): on the device each call runs it two or three times, in seconds.
MANIFEST = "checkpoint.json"  # engine/training/checkpoint.py's manifest name
MAX_FILES = 8  # files a device call brings back through $OUT
MAX_FILE_BYTES = 16 * 2**20
PENDING = 10  # gather's exit status while parts wait for the rest (not an error)
# The run settings a resume must repeat, as train-draft flags (the rest are the checkpoint's own
# or may change between calls: engine/training/checkpoint.py's RESUMABLE_CHANGES).
RESUME_FLAGS = ("layers", "intermediate_size", "block_size", "num_target_ids", "num_anchors", "gamma", "lr",
                "batch_size", "max_seq_len", "seed", "val_fraction", "steps")


class CarryError(ValueError):
    """A checkpoint that cannot be carried, gathered or returned as asked; the message says why."""


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of the checkpoint in ``folder`` (the keys this module uses checked)."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CarryError(f"{folder}: no {MANIFEST} there (not a train-draft checkpoint folder)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CarryError(f"{path}: not JSON ({e})") from None
    missing = [k for k in ("run_id", "step", "parts", "sha256", "config") if not isinstance(manifest, dict)
               or k not in manifest]
    if missing:
        raise CarryError(f"{path}: keys {missing} are missing (not a train-draft checkpoint manifest)")
    return manifest


def plan_carries(parts: Sequence[tuple[str, int]], manifest: tuple[str, int], last_budget: int,
                 stash_budget: int) -> list[list[str]]:
    """The files of a checkpoint in groups, one a call, in call order: every group's bytes within
    its budget (``last_budget`` for the last call, which carries the manifest and whatever else the
    training call needs; ``stash_budget`` for each call before it, which carries nothing else).
    The last call takes as many parts as fit, so the fewest calls are spent stashing."""
    name, size = manifest
    if size > last_budget:
        raise ValueError(f"the manifest {name} ({size} bytes) alone is over the last call's budget "
                         f"of {last_budget} bytes")
    last, room = [name], last_budget - size
    bins: list[tuple[list[str], int]] = []  # stash calls: (names, bytes left)
    for part, n in sorted(parts, key=lambda p: -p[1]):  # first fit, largest first
        if n <= room:
            last.append(part)
            room -= n
            continue
        for i, (names, left) in enumerate(bins):
            if n <= left:
                names.append(part)
                bins[i] = (names, left - n)
                break
        else:
            if n > stash_budget:
                raise ValueError(f"part {part} is {n} bytes, over a call's budget ({stash_budget} bytes, "
                                 f"{room} left in the last call's): write the checkpoint with a smaller --part-mb")
            bins.append(([part], stash_budget - n))
    return [sorted(names) for names, _ in bins] + [sorted(last)]


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(2**20), b""):
            h.update(chunk)
    return h.hexdigest()


def checked_parts(folder: Path, manifest: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The parts ``manifest`` names that are missing from ``folder``, and those there but corrupt
    (size or SHA-256 not the manifest's)."""
    missing, corrupt = [], []
    for p in manifest["parts"]:
        path = folder / p["name"]
        if not path.is_file():
            missing.append(p["name"])
        elif path.stat().st_size != p["bytes"] or _sha(path) != p["sha256"]:
            corrupt.append(p["name"])
    return missing, corrupt


def _checkpoint_files(sources: Sequence[Path]) -> list[Path]:
    """The manifests and parts under ``sources`` (folders, searched through, or files)."""
    found = []
    for src in map(Path, sources):
        for path in ([src] if src.is_file() else sorted(src.rglob("*")) if src.is_dir() else []):
            if path.is_file() and (path.name == MANIFEST or path.name.startswith("state-")):
                found.append(path)
    return found


def _newer(a: dict[str, Any], b: dict[str, Any] | None) -> bool:
    """Whether manifest ``a`` may replace ``b``: no ``b``, or the same run at a later step."""
    return b is None or (a["run_id"] == b["run_id"] and a["step"] > b["step"])


def gather(sources: Sequence[Path], incoming: Path, dest: Path) -> dict[str, Any]:
    """Collect the checkpoint files under ``sources`` in ``incoming``; once its manifest and every
    part it names are there and check out, make that checkpoint ``dest`` (the old one removed
    only then) and empty ``incoming``. A manifest that is not newer than ``incoming``'s or
    ``dest``'s (the same run at an earlier step) is ignored with its parts; one of another run
    than ``dest``'s is refused. Returns ``{"status": "complete" | "pending" | "none", "step", ...}``:
    the parts missing or corrupt, those waiting for their manifest, the manifests ignored."""
    incoming, dest = Path(incoming), Path(dest)
    kept = read_manifest(dest) if (dest / MANIFEST).is_file() else None
    files = _checkpoint_files(sources)
    waiting = read_manifest(incoming) if (incoming / MANIFEST).is_file() else None
    ignored, stale = [], set()
    for path in (p for p in files if p.name == MANIFEST):
        arriving = read_manifest(path.parent)
        if kept is not None and arriving["run_id"] != kept["run_id"]:
            raise CarryError(f"{path}: run {arriving['run_id']}, but {dest} keeps run {kept['run_id']} "
                                   f"(step {kept['step']}); keep another run in another folder")
        names = {p["name"] for p in arriving["parts"]}
        if waiting is not None and arriving["sha256"] == waiting["sha256"]:
            continue  # more parts of the checkpoint waiting for them
        if kept is not None and arriving["sha256"] == kept["sha256"]:
            stale |= names  # the kept checkpoint again (a RETURN=2 call's manifest, a carry made twice)
        elif (kept is None or arriving["step"] >= kept["step"]) and _newer(arriving, waiting):
            incoming.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, incoming / MANIFEST)
            waiting = arriving
        else:
            ignored.append(f"{path} (step {arriving['step']})")
            stale |= names
    for path in files:
        if path.name != MANIFEST and path.name not in stale:
            incoming.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, incoming / path.name)
    result = gather_status(incoming, dest, kept)
    return result | {"ignored": ignored}


def gather_status(incoming: Path, dest: Path, kept: dict[str, Any] | None) -> dict[str, Any]:
    """``gather``'s second half: swap a whole incoming checkpoint in for ``dest``."""
    if not (incoming / MANIFEST).is_file():
        parts = sorted(p.name for p in incoming.glob("state-*")) if incoming.is_dir() else []
        return {"status": "pending" if parts else "none", "parts_waiting": parts,
                "step": None if kept is None else kept["step"]}
    manifest = read_manifest(incoming)
    missing, corrupt = checked_parts(incoming, manifest)
    for name in corrupt:
        (incoming / name).unlink()  # a later transfer brings it again
    if missing or corrupt:
        return {"status": "pending", "step": manifest["step"], "missing": missing, "corrupt": corrupt}
    fresh = dest.with_name(dest.name + ".new")
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir(parents=True)
    for p in manifest["parts"]:
        shutil.move(str(incoming / p["name"]), fresh / p["name"])
    shutil.move(str(incoming / MANIFEST), fresh / MANIFEST)  # last: the folder is whole from here on
    old = dest.with_name(dest.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)
    fresh.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(incoming)
    return {"status": "complete", "step": manifest["step"], "missing": [], "corrupt": []}


def give(folder: Path, out: Path, sent: Path, max_files: int = MAX_FILES) -> dict[str, Any]:
    """Copy the manifest and the parts not sent yet (``sent`` records them, per manifest) into
    ``out``, as many as fit beside the files already there within ``max_files``. Returns what
    went and what is left for a later call."""
    folder, out, sent = Path(folder), Path(out), Path(sent)
    manifest = read_manifest(folder)
    record = json.loads(sent.read_text()) if sent.is_file() else {}
    done = set(record.get("sent", [])) if record.get("sha256") == manifest["sha256"] else set()
    todo = [p["name"] for p in manifest["parts"] if p["name"] not in done]
    big = [p["name"] for p in manifest["parts"] if p["bytes"] > MAX_FILE_BYTES]
    if big:
        raise CarryError(f"{folder / MANIFEST}: parts {big} are over the {MAX_FILE_BYTES // 2**20} MiB a "
                               f"returned file may have; write the checkpoint with --part-mb 15")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(folder / MANIFEST, out / MANIFEST)
    room = max_files - sum(1 for p in out.iterdir() if p.is_file())
    now = todo[: max(room, 0)]
    for name in now:
        shutil.copyfile(folder / name, out / name)
    sent.write_text(json.dumps({"sha256": manifest["sha256"], "sent": sorted(done | set(now))}))
    return {"step": manifest["step"], "sent": now, "left": todo[len(now):]}


def resume_flags(folder: Path) -> list[str]:
    """train-draft flags that repeat the checkpoint's run settings (a resume must give them)."""
    config = read_manifest(folder)["config"]
    flags = []
    for key in RESUME_FLAGS:
        if config.get(key) is not None:
            flags += ["--" + key.replace("_", "-"), str(config[key])]
    return flags


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gather", help="collect carried parts; swap the checkpoint in once whole")
    g.add_argument("sources", nargs="*", type=Path)
    g.add_argument("--incoming", type=Path, required=True)
    g.add_argument("--into", type=Path, required=True)
    v = sub.add_parser("give", help="the manifest and the parts not sent yet into OUT")
    v.add_argument("folder", type=Path)
    v.add_argument("--out", type=Path, required=True)
    v.add_argument("--sent", type=Path, required=True)
    v.add_argument("--max-files", type=int, default=MAX_FILES)
    f = sub.add_parser("flags", help="the train-draft flags that resume the checkpoint")
    f.add_argument("folder", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "flags":
            print(" ".join(resume_flags(args.folder)))
            return 0
        if args.cmd == "give":
            r = give(args.folder, args.out, args.sent, args.max_files)
            print(f"returned: step {r['step']}, {len(r['sent'])} parts {' '.join(r['sent'])}")
            print(f"left: {len(r['left'])} parts" + (" (call again with RETURN=2)" if r["left"] else ""))
            return 0
        r = gather(args.sources, args.incoming, args.into)
    except CarryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"checkpoint: {r['status']} (step {r['step']})")
    for key in ("missing", "corrupt", "parts_waiting", "ignored"):
        if r.get(key):
            print(f"{key}: {' '.join(r[key])}")
    return PENDING if r["status"] == "pending" else 0


if __name__ == "__main__":
    sys.exit(main())
