"""Where a config's measured peak passes its plan, on CUDA (issue #28's "plan within 10%"): for each config
(``--config NAME:KEY=VALUE,...``; AR and DDTree-22 by default) the pair is reserved at the prompts' longest
(``engine.reserve_memory``), then a warm-up pass and a measured pass over the prompts (``engine.bench``, as a sweep's
trial measures), and the measured breakdown is printed beside the plan, part by part. Then the allocations still
alive after the pass outside the graphs' pools, summed by the engine frames that made them (the allocator's history):
what a part does not name (a cuBLAS workspace, a table kept on a module) shows up by its maker.
``--lengths``: the same per prompt length alone (random tokens), to tell which prefill path carries a gap (one masked
forward up to 512 tokens, chunks past it).

    python benchmarks/memory_probe.py --sets humaneval eval_chat.jsonl agent --n 24 --lengths 300 700 1791

Measured on 2026-12-07 (an H100), a SmolLM2 sweep's AR peaks read 78 MiB of activations against 39 planned, where one
1,024- or 4,096-token prompt agreed within 8 MiB: this says what the rest is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import named_config, set_prompts  # noqa: E402

import engine  # noqa: E402
from engine import EngineConfig, EngineInputError  # noqa: E402
from engine.memory import MEMORY_PARTS, measure_memory, plan_memory, reserve_memory  # noqa: E402

MiB = 2**20
DEFAULT_CONFIGS = ["ar:verify=ar", "ddtree-22:verify=ddtree,budget=22,top_k=8"]
OWN_FILES = ("/engine/", "/autotune/", "/benchmarks/")


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-dflash")
    ap.add_argument("--weights", choices=engine.WEIGHTS, default="dequantized")
    ap.add_argument("--sets", nargs="*", default=["humaneval"], help="eval workloads (names or JSONL files)")
    ap.add_argument("--n", type=int, default=24, help="prompts a set")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--config", action="append", default=None, metavar="NAME:KEY=VALUE,...",
                    type=lambda s: named_config(s, "--config"), help="a config to measure (repeat; default: "
                    + " and ".join(DEFAULT_CONFIGS) + ")")
    ap.add_argument("--lengths", nargs="*", type=int, default=[], help="also each prompt length alone")
    ap.add_argument("--top", type=int, default=12, help="makers listed per config")
    ap.add_argument("--md", default=None, help="write the tables here too")
    args = ap.parse_args(argv)
    for flag, value, least in (("--n", args.n, 1), ("--new-tokens", args.new_tokens, 1), ("--top", args.top, 1)):
        if value < least:
            ap.error(f"{flag} must be >= {least}, not {value}")
    if any(n < 2 for n in args.lengths):
        ap.error(f"--lengths: every length must be >= 2 tokens, not {min(args.lengths)}")
    if not args.sets and not args.lengths:
        ap.error("nothing to measure: give --sets or --lengths")
    if args.config is None:
        args.config = [named_config(s, "--config") for s in DEFAULT_CONFIGS]
    return args


def _measure(pair, cfg: EngineConfig, prompts: list[list[int]], new: int, before: int) -> tuple:
    """The plan and the measured breakdown of ``cfg`` over ``prompts``, reserved at their longest."""
    at = (max(map(len, prompts)), new)
    plan = plan_memory(pair, cfg, *at)
    reserve_memory(pair, cfg, *at)
    engine.bench(pair, cfg, prompts, new, ignore_eos=True)  # warm-up: every key span's graphs captured
    peak = engine.bench(pair, cfg, prompts, new, ignore_eos=True).peak_memory_bytes - before
    return plan, measure_memory(pair, cfg, *at, peak)


def _makers(top: int) -> list[tuple[int, int, str]]:
    """The allocations alive now outside private pools (the graphs'), summed by the first three of our frames that
    made them: (bytes, blocks, frames), largest first."""
    sums: dict[str, list[int]] = {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):
            continue
        for block in seg["blocks"]:
            if block["state"] != "active_allocated":
                continue
            ours = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in block.get("frames", [])
                    if any(s in f["filename"] for s in OWN_FILES)][:3]
            key = " <- ".join(ours) or "(no frame of ours: made outside the engine, or before the history began)"
            entry = sums.setdefault(key, [0, 0])
            entry[0] += block["size"]
            entry[1] += 1
    return sorted(((b, n, k) for k, (b, n) in sums.items()), reverse=True)[:top]


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    if not torch.cuda.is_available():
        print("memory_probe.py needs CUDA: it measures the device allocator's peaks", file=sys.stderr)
        raise SystemExit(2)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    before = torch.cuda.memory_allocated()
    try:
        pair = engine.load(args.target, args.draft, device="cuda", dtype="bfloat16", weights=args.weights)
        sets = {spec: set_prompts(pair, spec, args.n) for spec in args.sets}
    except EngineInputError as exc:
        print(f"memory_probe.py: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    prompts = [p for ps in sets.values() for p in ps]
    lines = [f"`python benchmarks/memory_probe.py {' '.join(sys.argv[1:] if argv is None else argv)}`", "",
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.target} ({args.weights}) + "
             f"{args.draft}; {len(prompts)} prompts ({', '.join(f'{k}: {len(v)}' for k, v in sets.items())}), "
             f"the longest {max(map(len, prompts), default=0)} tokens, {args.new_tokens} new", ""]

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    for name, fields in args.config:
        cfg = EngineConfig.from_dict(fields, source=f"--config {name}")
        if prompts:
            plan, measured = _measure(pair, cfg, prompts, args.new_tokens, before)
            say(f"### {name} over the sets: planned {plan.total / MiB:.1f} MiB, measured {measured.total / MiB:.1f} "
                f"({(plan.total - measured.total) / measured.total:+.1%}; {plan.loop})")
            say()
            say("| part | planned MiB | measured MiB |")
            say("|---|---|---|")
            for part in MEMORY_PARTS:
                if plan.parts[part] or measured.parts[part]:
                    say(f"| {part} | {plan.parts[part] / MiB:.2f} | {measured.parts[part] / MiB:.2f} |")
            say()
            say("Alive after the pass outside the graphs' pools, by maker:")
            say()
            say("| MiB | blocks | made by (our first frames) |")
            say("|---|---|---|")
            for size, n, key in _makers(args.top):
                say(f"| {size / MiB:.2f} | {n} | {key} |")
            say()
        if args.lengths:
            say(f"### {name}, one prompt of each length")
            say()
            say("| prompt tokens | activations planned / measured MiB | graph pools planned / measured MiB | "
                "total gap |")
            say("|---|---|---|---|")
            gen = torch.Generator().manual_seed(0)
            for n in args.lengths:
                prompt = torch.randint(10, pair.target.cfg.vocab_size, (n,), generator=gen).tolist()
                plan, measured = _measure(pair, cfg, [prompt], args.new_tokens, before)
                say(f"| {n} | {plan.parts['activations'] / MiB:.1f} / {measured.parts['activations'] / MiB:.1f} | "
                    f"{plan.parts['graph_pools'] / MiB:.1f} / {measured.parts['graph_pools'] / MiB:.1f} | "
                    f"{(plan.total - measured.total) / measured.total:+.1%} |")
            say()
    if args.md:
        Path(args.md).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
