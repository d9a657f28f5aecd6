"""Write the prompts of a workload selection to JSONL (to carry them to a machine without the assets).

    python benchmarks/export_workload.py chat --n-prompts 12 --seed 0 --split eval --out chat_eval.jsonl

Loading the file back with the same n_prompts selects the same prompts in the same order, so the
workload hash is the same as the named set's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.data.workloads import TRAINING_MIX, load_workload, training_prompts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="humaneval | chat | agent | a JSONL file | train (the draft-training mix)")
    ap.add_argument("--n-prompts", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", default="eval", choices=["train", "eval", "all"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.spec == "train":
        prompts, digest = training_prompts(TRAINING_MIX, args.n_prompts, args.seed), "-"
    else:
        wl = load_workload(args.spec, Path.cwd(), args.n_prompts, args.seed, split=args.split)
        prompts, digest = wl.prompts, wl.hash
    with open(args.out, "w", encoding="utf-8") as fh:
        for p in prompts:
            fh.write(json.dumps(p.to_json()) + "\n")
    print(f"prompts: {len(prompts)}\nworkload_hash: {digest}\nout: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
