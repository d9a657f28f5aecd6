"""AR and a speculative config timed in two source trees on the same prompts, compared like with like.

    # 1. the prompts as token ids, with this tree's tokenizer (so both trees decode the same ids):
    python benchmarks/tree_compare.py prompts --sets humaneval --n-prompts 24 --out ids.json
    # 2. each tree times AR and DDTree on them (PYTHONPATH picks the tree whose engine runs):
    PYTHONPATH=old python benchmarks/tree_compare.py run --prompts ids.json --budget 48 --out old.json
    python benchmarks/tree_compare.py run --prompts ids.json --budget 48 --out new.json
    # 3. the ratios, overall and on the prompts both trees decode to the same text:
    python benchmarks/tree_compare.py compare old.json new.json --md compare.md

Why: a tree whose speculative outputs differ from AR's (b19bdf7 in bf16: 6 of 24 equal, issue #21)
decodes other text after a near-tie, with another acceptance length, so its tok/s is not the same
measure as an exact tree's. ``compare`` gives the tok/s ratio over every prompt and over the prompts
where both trees' speculative outputs equal the same AR text (the same tokens decoded: the per-step
cost and the draft's acceptance on that text are what differ). ``run`` uses only the engine API both
trees have (``engine.load``, ``engine.bench``, ``EngineConfig``), one pass per repeat, caches reset
between generations, every generation ``max_new_tokens`` long (stop tokens ignored).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _prompts(args: argparse.Namespace) -> int:
    import engine

    pair = engine.load(args.target, args.draft, device="cpu", dtype="float32")
    sets = {}
    for spec in args.sets:
        wl = engine.load_workload(spec, Path.cwd(), args.n_prompts, args.seed)
        sets[wl.name] = [pair.encode(p) for p in wl.prompts]
    Path(args.out).write_text(json.dumps({"target": args.target, "sets": sets}), encoding="utf-8")
    print(f"prompts: {sum(len(v) for v in sets.values())} in {len(sets)} set(s) -> {args.out}")
    return 0


def _run(args: argparse.Namespace) -> int:
    import engine
    from engine import EngineConfig

    doc = json.loads(Path(args.prompts).read_text(encoding="utf-8"))
    pair = engine.load(doc["target"], args.draft, device=args.device, dtype=args.dtype)
    configs = {"ar": EngineConfig(verify="ar"), f"ddtree-b{args.budget}": EngineConfig(
        verify="ddtree", budget=args.budget, top_k=args.top_k)}
    out: dict[str, Any] = {"engine": str(Path(engine.__file__).resolve().parents[1]), "device": args.device,
                           "max_new_tokens": args.max_new_tokens, "sets": {}}
    for name, prompts in doc["sets"].items():
        per_config = {}
        for label, cfg in configs.items():
            engine.bench(pair, cfg, prompts[:2], args.max_new_tokens, ignore_eos=True)  # warm-up: compiles, graphs
            passes = [engine.bench(pair, cfg, prompts, args.max_new_tokens, ignore_eos=True)
                      for _ in range(args.repeats)]
            per_config[label] = {
                "outputs": [list(map(int, o)) for o in passes[0].outputs],
                "new_tokens": [p.new_tokens for p in passes[0].prompts],
                "steps": [p.steps for p in passes[0].prompts],
                "decode_s": [[p.decode_s for p in r.prompts] for r in passes],  # [pass][prompt]
            }
            print(f"{name} {label}: {_tps(per_config[label], range(len(prompts))):.1f} tok/s", flush=True)
        out["sets"][name] = per_config
    Path(args.out).write_text(json.dumps(out), encoding="utf-8")
    return 0


def _tps(rec: dict[str, Any], idx: Any) -> float:
    """Median over passes of sum(tokens - 1) / sum(decode seconds) over the prompts ``idx``: the
    engine's decode tok/s (the first token comes from the prefill)."""
    idx = list(idx)
    tokens = sum(rec["new_tokens"][i] - 1 for i in idx)
    return statistics.median(tokens / max(sum(p[i] for i in idx), 1e-12) for p in rec["decode_s"])


def _al(rec: dict[str, Any], idx: Any) -> float:
    idx = list(idx)
    return sum(rec["new_tokens"][i] - 1 for i in idx) / max(sum(rec["steps"][i] for i in idx), 1)


def _pooled(sets: Any) -> dict[str, Any]:
    """The sets' runs as one, config by config: prompts concatenated, each pass's times side by side."""
    sets = list(sets)
    out: dict[str, Any] = {}
    for label in sets[0]:
        recs = [s[label] for s in sets]
        passes = len(recs[0]["decode_s"])
        out[label] = {"outputs": [o for r in recs for o in r["outputs"]],
                      "new_tokens": [t for r in recs for t in r["new_tokens"]],
                      "steps": [t for r in recs for t in r["steps"]],
                      "decode_s": [[t for r in recs for t in r["decode_s"][k]] for k in range(passes)]}
    return out


def compare(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    lines = ["| set | config | prompts | old tok/s | new tok/s | new / old | old AL | new AL | old ms/step | "
             "new ms/step |", "|" + "---|" * 10]
    sets = [(name, o_set, new["sets"][name]) for name, o_set in old["sets"].items()]
    if len(sets) > 1:  # and every set's prompts as one: the figure over all of them
        sets.append(("all sets", _pooled(old["sets"].values()), _pooled(new["sets"][k] for k in old["sets"])))
    for name, o_set, n_set in sets:
        spec = next(label for label in o_set if label != "ar")
        n = len(o_set["ar"]["outputs"])
        same_text = [i for i in range(n) if o_set[spec]["outputs"][i] == o_set["ar"]["outputs"][i]
                     == n_set["ar"]["outputs"][i] == n_set[spec]["outputs"][i]]
        rows = [("ar", "all", range(n)), (spec, "all", range(n)), (spec, "same text", same_text)]
        for label, which, idx in rows:
            idx = list(idx)
            if not idx:
                lines.append(f"| {name} | {label} | {which}: 0 of {n} | - | - | - | - | - | - | - |")
                continue
            o, nw = o_set[label], n_set[label]
            to, tn = _tps(o, idx), _tps(nw, idx)
            ms = [1000.0 * statistics.median(sum(p[i] for i in idx) for p in r["decode_s"])
                  / max(sum(r["steps"][i] for i in idx), 1) for r in (o, nw)]
            lines.append(f"| {name} | {label} | {which}: {len(idx)} of {n} | {to:.1f} | {tn:.1f} | {tn / to:.3f} | "
                         f"{_al(o, idx):.2f} | {_al(nw, idx):.2f} | {ms[0]:.4f} | {ms[1]:.4f} |")
        exact = {k: sum(d[spec]["outputs"][i] == d["ar"]["outputs"][i] for i in range(n))
                 for k, d in (("old", o_set), ("new", n_set))}
        lines.append(f"| {name} | {spec} outputs equal to the tree's AR | | {exact['old']}/{n} | {exact['new']}/{n} "
                     f"| | | | | |")
    return lines


def _compare(args: argparse.Namespace) -> int:
    old, new = (json.loads(Path(p).read_text(encoding="utf-8")) for p in (args.old, args.new))
    if set(old["sets"]) != set(new["sets"]) or old["max_new_tokens"] != new["max_new_tokens"]:
        print("tree_compare.py: error: the two runs are not of the same prompts and tokens", file=sys.stderr)
        return 2
    text = "\n".join([f"old: {old['engine']}  new: {new['engine']}  ({old['max_new_tokens']} tokens a prompt; "
                      "decode tok/s median of the passes)", "", *compare(old, new)]) + "\n"
    print(text)
    if args.md:
        Path(args.md).write_text(text, encoding="utf-8")
    return 0


# (flag, type, default, help) of each subcommand's options; None: required
_PROMPTS_OPTIONS = (
    ("--sets", str, ["humaneval"], "workloads or JSONL files (nargs +)"),
    ("--n-prompts", int, 24, "eval prompts per set (>= 1)"),
    ("--seed", int, 0, "the workload's selection seed"),
    ("--target", str, "smollm2-135m-instruct", "the target whose tokenizer encodes the prompts"),
    ("--draft", str, "none", "a draft to load with it (none: the tokenizer is all that is needed)"),
    ("--out", str, None, "the JSON of token ids to write"),
)
_RUN_OPTIONS = (
    ("--prompts", str, None, "the JSON `prompts` wrote"),
    ("--draft", str, "smollm2-135m-dflash", "the draft (a name or a checkpoint folder)"),
    ("--budget", int, 48, "DDTree's budget (>= 1)"),
    ("--top-k", int, 8, "DDTree's top_k (>= 1)"),
    ("--max-new-tokens", int, 128, "tokens a prompt (>= 2), stop tokens ignored"),
    ("--repeats", int, 3, "timed passes (>= 1)"),
    ("--device", str, "cuda", "the engine's device"),
    ("--dtype", str, "bfloat16", "the engine's dtype"),
    ("--out", str, None, "the run's JSON to write"),
)
_AT_LEAST = {"n_prompts": 1, "budget": 1, "top_k": 1, "max_new_tokens": 2, "repeats": 1}


def _add(parser: argparse.ArgumentParser, options: tuple) -> None:
    for flag, kind, default, text in options:
        many = {"nargs": "+"} if isinstance(default, list) else {}
        parser.add_argument(flag, type=kind, default=default, required=default is None, help=text, **many)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tree_compare.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    _add(sub.add_parser("prompts", help="the eval prompts as token ids (this tree's tokenizer)"), _PROMPTS_OPTIONS)
    _add(sub.add_parser("run", help="time AR and DDTree on the prompts with the engine on PYTHONPATH"), _RUN_OPTIONS)
    c = sub.add_parser("compare", help="the two runs' ratios")
    c.add_argument("old", help="the earlier tree's run (JSON)")
    c.add_argument("new", help="this tree's run (JSON)")
    c.add_argument("--md", help="also write the table here")
    args = p.parse_args(argv)
    for name, low in _AT_LEAST.items():
        if getattr(args, name, low) < low:
            p.error(f"--{name.replace('_', '-')} must be >= {low}, but got {getattr(args, name)}")
    return {"prompts": _prompts, "run": _run, "compare": _compare}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
