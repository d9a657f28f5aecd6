"""Exactness of speculative decoding against plain AR, config by config: does every output equal AR's
token for token in the dtype users run (bf16 on the GPU)?

    python benchmarks/exact_bench.py --target smollm2-135m-instruct --draft smollm2-135m-dflash \
        --sets humaneval chat agent --n-prompts 24 --max-new-tokens 256 --budgets 8 22 48 64 \
        --top-ks 1 2 3 4 5 6 7 8 --md exact.md --out exact.json
    python benchmarks/exact_bench.py --target qwen35-27b-shape --draft qwen35-27b-shape-dflash \
        --random-prompts 8 --prompt-len 64 --max-new-tokens 128 --rollbacks fast replay --md exact27.md

Per set, AR runs once (the reference); then chain and DDTree at every (budget, top_k), on each
``--paths`` (``auto``, the default: the runtime's graphs where they run, else the generic loop) and
``--rollbacks`` entry, each one untimed pass over the prompts, outputs compared with
AR's (the first divergence, both runs' top-2 margins there and the verdict: ``engine.diagnose``). ``--eos-configs``
also runs those configs to each prompt's stop token. ``--oracle P`` adds an ``oracle:P`` draft on
the same target (the target's own greedy continuation, corrupted per slot with probability P: deep
accepted paths on random weights; it takes the generic loop). Prints a markdown table and a total
line; ``--out`` writes every divergence as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "benchmarks"))

from step_attention import STEP_ATTENTION_HELP, apply_step_attention  # noqa: E402

import engine  # noqa: E402
from engine import EngineConfig  # noqa: E402
from engine.api import Pair  # noqa: E402
from engine.data.workloads import load_workload  # noqa: E402
from engine.models.quant import WEIGHTS  # noqa: E402
from engine.registry import load_drafter  # noqa: E402


def _prompt_sets(pair, args) -> dict[str, list[list[int]]]:
    if args.random_prompts:
        gen = torch.Generator().manual_seed(0)
        vocab = pair.target.cfg.vocab_size
        return {"random": [torch.randint(10, vocab, (args.prompt_len,), generator=gen).tolist()
                           for _ in range(args.random_prompts)]}
    return {Path(spec).stem: [pair.encode(p) for p in load_workload(spec, Path.cwd(), args.n_prompts, 0,
                                                                      split="eval").prompts]
            for spec in args.sets}


def _configs(args) -> list[tuple[str, dict]]:
    out = [("chain", dict(verify="chain"))]
    out += [(f"ddtree b{b} k{k}", dict(verify="ddtree", budget=b, top_k=k)) for b in args.budgets for k in args.top_ks]
    return out


def _divergence_text(p) -> str:
    """``prompt@position``, with the ``Divergence`` record's margins and verdict."""
    return f"p{p.index}@{p.first_divergence}" if p.divergence is None else f"p{p.index} {p.divergence.describe()}"


def _check(pair: Pair, name: str, params: dict, path: str, rollback: str, prompts, reference, max_new: int,
           ignore_eos: bool) -> dict:
    cfg = EngineConfig(**params, draft_path=path, rollback=rollback)
    t0 = time.perf_counter()
    res = engine.bench(pair, cfg, prompts, max_new, reference=reference, ignore_eos=ignore_eos)
    bad = [p for p in res.prompts if not p.exact]
    al = sum(res.accept_lengths) / len(res.accept_lengths) if res.accept_lengths else 1.0
    divs = [{"prompt": p.index, "first_divergence": p.first_divergence,
             **(p.divergence.to_dict() if p.divergence is not None else {})} for p in bad]
    return dict(config=name, path=path, rollback=rollback, weights=pair.weights, exact=len(prompts) - len(bad),
                n=len(prompts), al=al,
                loops=res.loops, seconds=time.perf_counter() - t0, divergences=divs,
                text=", ".join(_divergence_text(p) for p in bad[:4]) + (" ..." if len(bad) > 4 else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-dflash")
    ap.add_argument("--sets", nargs="+", default=["humaneval", "chat", "agent"], help="workloads or JSONL files")
    ap.add_argument("--n-prompts", type=int, default=24, help="eval prompts per set")
    ap.add_argument("--random-prompts", type=int, default=0, help="N random-token prompts instead of --sets")
    ap.add_argument("--prompt-len", type=int, default=64, help="tokens per random prompt")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--budgets", nargs="+", type=int, default=[8, 22, 48, 64])
    ap.add_argument("--top-ks", nargs="+", type=int, default=[1, 2, 3, 4, 5, 6, 7, 8])
    ap.add_argument("--paths", nargs="+", choices=["auto", "generic", "runtime"], default=["auto"])
    ap.add_argument("--rollbacks", nargs="+", choices=["fast", "replay"], default=["fast"])
    ap.add_argument("--eos-configs", nargs="*", default=["chain", "ddtree b22 k8", "ddtree b48 k8"],
                    help="configs also run to each prompt's stop token (names as in the table)")
    ap.add_argument("--oracle", type=float, nargs="*", default=[], help="also oracle:P drafts (generic loop)")
    ap.add_argument("--oracle-configs", nargs="*", default=["chain", "ddtree b22 k4", "ddtree b64 k8"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--weights", choices=WEIGHTS, default="dequantized",
                    help="native: a GGUF target's quantized projections kept in their blocks (engine.load)")
    ap.add_argument("--md")
    ap.add_argument("--step-attention", default=None, metavar="BLOCK_NxWARPS[xSPAN][mBLOCK_M][fFOLD]",
                    help=STEP_ATTENTION_HELP)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not apply_step_attention(args.step_attention):
        return 2

    pair = engine.load(args.target, args.draft, device=args.device, dtype=args.dtype, weights=args.weights)
    pairs = [(args.draft, pair)]
    for p in args.oracle:
        drafter = load_drafter(f"oracle:{p}", pair.target, pair.tokenizer, pair.target.device, pair.target.dtype)
        # the same target, held as loaded: its weights mode travels with it
        pairs.append((f"oracle:{p}", Pair(pair.target, drafter, pair.tokenizer, args.target, f"oracle:{p}",
                                          pair.device, pair.dtype, weights=pair.weights)))
    configs = _configs(args)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [f"{args.target} + {args.draft}, {args.dtype}, weights {pair.weights} on {where}, {when}",
             "", "| set | draft | config | path | rollback | to | exact | AL | loops | divergences (prompt, "
             "position: verdict AR/run margin) |", "|" + "---|" * 10]
    rows, total, exact = [], 0, 0
    for set_name, prompts in _prompt_sets(pair, args).items():
        for ignore_eos in (True, False):
            if not ignore_eos and not args.eos_configs:
                continue
            reference = engine.bench(pair, EngineConfig(verify="ar"), prompts, args.max_new_tokens,
                                     ignore_eos=ignore_eos).outputs
            for draft, p in pairs:
                chosen = args.oracle_configs if draft != args.draft else (
                    None if ignore_eos else args.eos_configs)
                for name, params in configs:
                    if chosen is not None and name not in chosen:
                        continue
                    for path in args.paths if draft == args.draft else ["generic"]:
                        for rollback in args.rollbacks:
                            row = _check(p, name, params, path, rollback, prompts, reference, args.max_new_tokens,
                                         ignore_eos)
                            row.update(set=set_name, draft=draft, to="max" if ignore_eos else "eos")
                            rows.append(row)
                            total += row["n"]
                            exact += row["exact"]
                            lines.append(f"| {set_name} | {draft} | {name} | {path} | {rollback} | {row['to']} | "
                                         f"{row['exact']}/{row['n']} | {row['al']:.2f} | "
                                         f"{','.join(row['loops'])} | {row['text']} |")
                            print(lines[-1], flush=True)
    lines += ["", f"total: {exact}/{total} outputs equal to AR ({len(rows)} config runs, "
                  f"{args.max_new_tokens} new tokens)"]
    print(lines[-1], flush=True)
    if args.md:
        Path(args.md).write_text("\n".join(lines) + "\n")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": "python " + " ".join(sys.argv), "rows": rows}, indent=1))
    return 0 if exact == total else 1


if __name__ == "__main__":
    sys.exit(main())
