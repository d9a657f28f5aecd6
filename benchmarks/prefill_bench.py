"""A long prompt's prefill, a chunk at a time in the decode steps' form (``loop.prefill``, the engine's
way since 2026-12-05) against one whole-prompt forward (the way before): time and, on CUDA, the peak
memory the prefill adds; the first token of both checked equal.

    python benchmarks/prefill_bench.py --target qwen35-27b-shape --draft random --device cuda \\
        --dtype bfloat16 --lengths 1024 4096 16384 --repeats 3 --md prefill.md

The whole-prompt form is had by raising ``PREFILL_CHUNK`` past the prompt for the run, so both are
the engine's code. Random prompt tokens (seeded): the prefill's cost does not depend on the text.
A prompt past 512 tokens is what changed; a short one is prefilled whole either way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import env_record, spread  # noqa: E402

import engine  # noqa: E402
from engine import EngineConfig, EngineInputError  # noqa: E402
from engine.decoding import prefix_cache as prefix_cache_mod  # noqa: E402

FORMS = ("chunked", "whole")


def measure(pair: engine.Pair, prompt: list[int], form: str, repeats: int) -> dict:
    """Prefill seconds per run and the peak bytes above the held ones (CUDA), ``form`` as said."""
    chunk = prefix_cache_mod.PREFILL_CHUNK
    if form == "whole":
        prefix_cache_mod.PREFILL_CHUNK = len(prompt)
    try:
        cfg = EngineConfig(verify="ar")
        engine.reserve_memory(pair, cfg, len(prompt), 2)
        engine.generate(pair, prompt, cfg, 2, ignore_eos=True)  # warm-up: kernels compiled
        cuda = str(pair.device).startswith("cuda")
        times, peak, first = [], 0, None
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            g = engine.generate(pair, prompt, cfg, 2, ignore_eos=True)
            times.append(g.stats.prefill_s)
            first = g.tokens[0]
            if cuda:
                peak = max(peak, torch.cuda.max_memory_allocated() - base)
        return {"prefill_s": times, "peak_bytes": peak if cuda else None, "first_token": first,
                "rows": prefix_cache_mod.prefill_rows(pair.target, len(prompt), prefix_cache_mod.PREFILL_CHUNK)
                if form == "chunked" and len(prompt) > chunk else len(prompt)}
    finally:
        prefix_cache_mod.PREFILL_CHUNK = chunk


def _measure_or_oom(pair: engine.Pair, prompt: list[int], form: str, repeats: int) -> dict:
    """``measure``, or where the GPU runs out of memory (a whole 16k-token prompt's attention scores on
    the 27B shape: 24 GiB) the error in place of the figures, so the other form and lengths still run."""
    try:
        return measure(pair, prompt, form, repeats)
    except torch.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        print(f"{len(prompt)} tokens, {form}: out of memory ({str(exc).splitlines()[0]})", file=sys.stderr)
        return {"prefill_s": None, "peak_bytes": None, "first_token": None, "rows": len(prompt),
                "error": f"out of memory: {str(exc).splitlines()[0]}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="random")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096], help="prompt tokens (default 1024 4096)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--transient-mib", type=float, default=None,
                    help="the chunks' attention transient budget (PREFILL_TRANSIENT_BYTES) for this run, in MiB: "
                         "larger means more rows a chunk (default: the engine's, 512)")
    ap.add_argument("--md", help="the table and the environment as markdown")
    ap.add_argument("--out", help="every figure as JSON")
    args = ap.parse_args(argv)
    if args.repeats < 1 or any(n < 2 for n in args.lengths):
        ap.error(f"--repeats must be >= 1 and every --lengths >= 2, but got {args.repeats} and {args.lengths}")
    if args.transient_mib is not None and not 0 < args.transient_mib < float("inf"):
        ap.error(f"--transient-mib must be a finite number > 0, but got {args.transient_mib}")
    budget = prefix_cache_mod.PREFILL_TRANSIENT_BYTES
    try:
        if args.transient_mib is not None:
            prefix_cache_mod.PREFILL_TRANSIENT_BYTES = int(args.transient_mib * 2**20)
        return _run(args)
    finally:
        prefix_cache_mod.PREFILL_TRANSIENT_BYTES = budget


def _run(args: argparse.Namespace) -> int:
    try:
        pair = engine.load(args.target, args.draft, device=args.device, dtype=args.dtype)
    except EngineInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    most = getattr(pair.target.cfg, "max_position_embeddings", None)
    if most and max(args.lengths) + 2 > most:
        print(f"error: --lengths: {max(args.lengths)} tokens and 2 new ones exceed the target's context of {most}",
              file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    rows, out = [], {"env": env_record(), "lengths": {}}
    for n in args.lengths:
        prompt = torch.randint(10, pair.target.cfg.vocab_size, (n,), generator=gen).tolist()
        got = {form: _measure_or_oom(pair, prompt, form, args.repeats) for form in FORMS}
        out["lengths"][n] = got
        ms = {f: [t * 1e3 for t in got[f]["prefill_s"]] if got[f]["prefill_s"] else None for f in FORMS}
        cell = {f: spread(ms[f]) if ms[f] else "out of memory" for f in FORMS}
        ratio = (f"{statistics.median(ms['chunked']) / statistics.median(ms['whole']):.2f}"
                 if ms["chunked"] and ms["whole"] else "-")
        peak = " | ".join("-" if got[f]["peak_bytes"] is None else f"{got[f]['peak_bytes'] / 2**20:.0f} MiB"
                          for f in FORMS)
        firsts = [got[f]["first_token"] for f in FORMS]
        same = "-" if None in firsts else ("yes" if firsts[0] == firsts[1] else "no")
        rows.append(f"| {n} | {got['chunked']['rows']} | {cell['chunked']} | {cell['whole']} | "
                    f"{ratio} | {peak} | {same} |")
        print(rows[-1], flush=True)
    head = ["| prompt tokens | chunk rows | chunked ms, median (min..max) | whole ms | chunked / whole "
            "| peak added: chunked | whole | first token equal |", "|---|---|---|---|---|---|---|---|"]
    budget = prefix_cache_mod.PREFILL_TRANSIENT_BYTES / 2**20
    text = "\n".join([f"{pair.target_name}, {pair.device}, {pair.dtype}; {args.repeats} runs; chunk transient "
                      f"budget {budget:.0f} MiB", "",
                      *head, *rows, "", "```json", json.dumps(out["env"], indent=1), "```"])
    if args.md:
        Path(args.md).write_text(text + "\n")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
