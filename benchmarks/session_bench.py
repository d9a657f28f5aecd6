"""Multi-turn sessions in the engine, with and without the prefix cache: each config's session tok/s,
decode tok/s and time to first token of first and later turns, every turn checked against AR's.

    python benchmarks/session_bench.py --sessions agent --n 8 --min-turns 4 --max-new-tokens 128 \\
        --device cuda --dtype bfloat16 --config ar:verify=ar \\
        --config ddtree:verify=ddtree,budget=48,top_k=8,draft_path=runtime --md sessions.md --out sessions.json

AR replays the sessions first (``engine.replay_sessions``, through a prefix cache, its own replies fed
back): that fixes every turn's request and is the reference. Then each config decodes those requests
in order (``engine.bench``), through one fresh prefix cache per pass (``--prefix-cache-mb``) and with
none (every turn prefilled whole): one untimed pass, then ``--repeats`` timed ones. The cached and the
cold outputs must both equal AR's, turn for turn. The time is the engine's (prefill and decode of each
turn); ``session_replay.py`` measures the same sessions against a live server, HTTP included. Ends with a
greppable ``key: value`` summary (``ttft_later_ratio_NAME``: later turns' TTFT without the cache over
with it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import env_record, named_config, spread  # noqa: E402

import engine  # noqa: E402
from autotune import sessions as sess  # noqa: E402  (the sweep's session figures: the same arithmetic)
from engine import EngineConfig, EngineInputError  # noqa: E402

REPLAY = EngineConfig(verify="ar")  # the config whose replay fixes the requests and answers them


def measure(pair: engine.Pair, cfg: EngineConfig, replay: engine.SessionReplay, new: int, repeats: int,
            cache_mb: float) -> dict[str, Any]:
    """One config's passes over the replay's turns (``cache_mb``: a fresh cache a pass; 0: none)."""
    def cache() -> engine.PrefixCache | None:
        return sess.prefix_cache(cache_mb)

    # exact against AR decoded the way cfg decodes (its loop and kernels: in bf16 two loops round
    # otherwise), on the replay's requests
    twin = pair.ar_twin(cfg)
    reference = replay.outputs if twin == REPLAY else engine.bench(pair, twin, replay.prompts, new,
                                                                   prefix_cache=cache()).outputs
    engine.bench(pair, cfg, replay.prompts, new, prefix_cache=cache())  # graphs captured, kernels warm
    runs = [engine.bench(pair, cfg, replay.prompts, new, reference=reference, prefix_cache=cache())
            for _ in range(repeats)]
    first_ms, later_ms = sess.ttft_ms(runs, [replay.session_of] * len(runs))
    return {
        "session_tps": [sess.pass_session_tps([r]) for r in runs],
        "decode_tps": [r.decode_tps for r in runs],
        "ttft_first_ms": first_ms,
        "ttft_later_ms": later_ms,
        "cached_share_later": sess.cached_share(runs[:1], [replay.session_of]),
        "acceptance_length": runs[0].acceptance_length,
        "exact": all(p.exact for r in runs for p in r.prompts),
        "inexact_turns": sorted({p.index for r in runs for p in r.prompts if not p.exact}),
    }


def _fmt(v: float | None, nd: int = 1) -> str:
    return "–" if v is None else f"{v:.{nd}f}"


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| config | prefix cache | session tok/s | decode tok/s | AL | TTFT first turn (ms) | TTFT later turns "
           "(ms) | later turns' prompt cached | exact |", "|" + "---|" * 9]
    for r in rows:
        out.append(f"| {r['name']} | {r['cache']} | {spread(r['session_tps'])} | {spread(r['decode_tps'])} | "
                   f"{r['acceptance_length']:.2f} | {_fmt(r['ttft_first_ms'])} | {_fmt(r['ttft_later_ms'])} | "
                   f"{'–' if r['cached_share_later'] is None else format(r['cached_share_later'], '.0%')} | "
                   f"{'yes' if r['exact'] else 'NO: turns ' + str(r['inexact_turns'])} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-dflash")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--sessions", default="agent", help="a session set (agent, chat) or a JSONL of sessions")
    ap.add_argument("--n", type=int, default=8, help="sessions (default 8)")
    ap.add_argument("--min-turns", type=int, default=None,
                    help="sessions of fewer model turns are left out (default: 4 for a named set, none for a file)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=128, help="per turn (default 128)")
    ap.add_argument("--repeats", type=int, default=2, help="timed passes per config and cache setting")
    ap.add_argument("--prefix-cache-mb", type=float, default=engine.DEFAULT_PREFIX_CACHE_MB)
    ap.add_argument("--config", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                    type=lambda t: named_config(t, "--config"), help="a config to measure (default: AR alone)")
    ap.add_argument("--md", help="the table and the environment as markdown")
    ap.add_argument("--out", help="every figure as JSON")
    args = ap.parse_args(argv)
    for name in ("n", "min_turns", "max_new_tokens", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, but got {getattr(args, name)}")
    if not 0 < args.prefix_cache_mb < float("inf"):
        ap.error(f"--prefix-cache-mb must be a finite number > 0 (the cold runs are measured beside it), "
                 f"but got {args.prefix_cache_mb}")
    configs = args.config or [("ar", {"verify": "ar"})]
    names = [n for n, _ in configs]
    if len(set(names)) != len(names):
        ap.error(f"--config names must differ, but got {names}")
    try:
        pair = engine.load(args.target, args.draft, device=args.device, dtype=args.dtype)
        sessions = engine.load_sessions(args.sessions, Path.cwd(), args.n, args.seed, args.min_turns).prompts
        replay = engine.replay_sessions(pair, REPLAY, sessions, args.max_new_tokens,
                                        engine.PrefixCache(int(args.prefix_cache_mb * 2**20)))
    except EngineInputError as exc:
        print(f"session_bench: error: {exc}", file=sys.stderr)
        return 2
    rows = []
    for name, fields in configs:
        cfg = EngineConfig.from_dict(fields, source=f"--config {name}")
        for label, mb in (("on", args.prefix_cache_mb), ("off", 0.0)):
            rows.append({"name": name, "cache": label, "config": cfg.to_dict(),
                         **measure(pair, cfg, replay, args.max_new_tokens, args.repeats, mb)})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    env = env_record()
    head = (f"{len(sessions)} sessions ({args.sessions}), {len(replay.prompts)} turns, {args.max_new_tokens} new "
            f"tokens a turn, {args.repeats} timed passes; {pair.target_name} + {pair.draft_name}, {pair.device} "
            f"{pair.dtype}; {env['gpu']}, torch {env['torch']}, {env['date']}")
    cut = [f"- session {s}: {why}" for s, why in replay.cut.items()]
    text = "\n".join([head, "", table(rows), *([""] + cut if cut else [])])
    print(text)
    if args.md:
        Path(args.md).write_text(f"`{env['command']}`\n\n{text}\n")
    if args.out:
        Path(args.out).write_text(json.dumps({"env": env, "sessions": len(sessions), "turns": len(replay.prompts),
                                              "cut": replay.cut, "rows": rows}, indent=1))
    by = {(r["name"], r["cache"]): r for r in rows}
    print(f"sessions: {len(sessions)}\nturns: {len(replay.prompts)}\n"
          f"max_prompt_tokens: {max((len(p) for p in replay.prompts), default=0)}\n"
          f"exact_all: {all(r['exact'] for r in rows)}")
    for name in names:
        on, off = by[(name, "on")], by[(name, "off")]
        ratio = off["ttft_later_ms"] / on["ttft_later_ms"] if on["ttft_later_ms"] and off["ttft_later_ms"] else None
        print(f"ttft_later_ratio_{name}: {_fmt(ratio, 2)}\n"
              f"session_tps_{name}: {statistics.median(on['session_tps']):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
