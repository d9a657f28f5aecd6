"""Replay multi-turn sessions against an OpenAI-compatible server, feeding the model's own replies back.

    python benchmarks/session_replay.py build agent --n 8 --min-turns 4 --out agent_sessions.jsonl
    autotune serve best.yaml --port 8000 &            # (--prefix-cache-mb 0: the same without the cache)
    python benchmarks/session_replay.py replay agent_sessions.jsonl --url http://127.0.0.1:8000/v1 \\
        --max-tokens 128 --out with_cache.json
    python benchmarks/session_replay.py compare with_cache.json without_cache.json

``build`` writes sessions (``engine.data.sessions``: BFCL multi-turn agents with their tools, or
ShareGPT chats) as workload JSONL lines. ``replay`` drives each session through the official
``openai`` client, streamed with usage at temperature 0: every turn sends the whole conversation so
far, the model's earlier replies in place of the script's assistant messages. Per turn it records the
time to first token (from the request to the first chunk with text: the server's role chunk does not
count), the turn's time, prompt, cached (``usage.prompt_tokens_details.cached_tokens``) and completion
tokens, and the reply; per session its wall time and session tokens/s (completion tokens / wall,
prefill included). ``--concurrency`` sessions run at once, each turn after the previous one. A turn
the server refuses (a conversation past the model's context) ends its session, with the reason.
``compare`` says whether two replays answered alike, turn by turn (a cache hit must equal a cold run).
Each command ends with a ``key: value`` summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from engine import EngineInputError
from engine.data.prompts import Prompt
from engine.data.sessions import SESSION_SETS, check_session, named_sessions, request, turns
from engine.data.workloads import read_jsonl


def build(args: argparse.Namespace) -> dict[str, Any]:
    chosen = named_sessions(args.set, args.n, args.min_turns, args.seed)
    with open(args.out, "w", encoding="utf-8") as fh:
        for p in chosen:
            fh.write(json.dumps(p.to_json(), ensure_ascii=False) + "\n")
    return {"sessions": len(chosen), "turns": sum(turns(p) for p in chosen), "out": args.out}


def replay_turn(client: Any, model: str, prompt: Prompt, replies: list[str], max_tokens: int) -> dict[str, Any]:
    """One turn: the conversation so far sent, the reply streamed and timed."""
    kw = {"tools": list(prompt.tools)} if prompt.tools else {}
    t0 = time.perf_counter()
    first, text, usage = None, [], None
    stream = client.chat.completions.create(model=model, messages=request(prompt, replies), max_tokens=max_tokens,
                                            temperature=0, stream=True, stream_options={"include_usage": True}, **kw)
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            if c.delta.content:
                first = first if first is not None else time.perf_counter()
                text.append(c.delta.content)
    end = time.perf_counter()
    details = getattr(usage, "prompt_tokens_details", None)
    return {"ttft_s": (first if first is not None else end) - t0, "turn_s": end - t0, "text": "".join(text),
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "cached_tokens": (details.cached_tokens or 0) if details is not None else 0}


def replay_session(client: Any, model: str, index: int, prompt: Prompt, max_tokens: int,
                   max_turns: int | None) -> dict[str, Any]:
    import openai

    done: list[dict[str, Any]] = []
    error = None
    t0 = time.perf_counter()
    for _ in range(min(turns(prompt), max_turns or turns(prompt))):
        try:
            done.append(replay_turn(client, model, prompt, [t["text"] for t in done], max_tokens))
        except openai.BadRequestError as exc:  # e.g. the conversation outgrew the model's context
            error = f"turn {len(done) + 1}: {exc.message}"
            break
    wall = time.perf_counter() - t0
    tokens = sum(t["completion_tokens"] for t in done)
    return {"session": index, "turns": done, "wall_s": wall, "completion_tokens": tokens,
            "session_tps": tokens / wall if wall > 0 else 0.0, "error": error}


def replay(args: argparse.Namespace) -> dict[str, Any]:
    import openai

    prompts = read_jsonl(Path(args.sessions))
    for i, p in enumerate(prompts, 1):
        check_session(p, f"{args.sessions}:{i}")
    client = openai.OpenAI(base_url=args.url, api_key=args.api_key or "unused", max_retries=0, timeout=args.timeout)
    model = args.model or client.models.list().data[0].id
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        sessions = list(pool.map(lambda ip: replay_session(client, model, ip[0], ip[1], args.max_tokens, args.turns),
                                 enumerate(prompts)))
    wall = time.perf_counter() - t0
    if args.out:
        Path(args.out).write_text(json.dumps({"model": model, "url": args.url, "max_tokens": args.max_tokens,
                                              "sessions": sessions}, indent=1, ensure_ascii=False))
    return summary(sessions, wall) | {"out": args.out or "-"}


def summary(sessions: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """The replay in brief: time to first token of first and later turns (median, ms), session
    tokens/s (mean over sessions, and all completion tokens over the whole run's wall)."""
    first = [s["turns"][0]["ttft_s"] for s in sessions if s["turns"]]
    later = [t["ttft_s"] for s in sessions for t in s["turns"][1:]]
    prompt_later = sum(t["prompt_tokens"] for s in sessions for t in s["turns"][1:])
    tokens = sum(s["completion_tokens"] for s in sessions)
    return {
        "sessions": len(sessions), "turns": sum(len(s["turns"]) for s in sessions),
        "sessions_cut": sum(s["error"] is not None for s in sessions),
        "completion_tokens": tokens,
        "max_prompt_tokens": max((t["prompt_tokens"] for s in sessions for t in s["turns"]), default=0),
        "ttft_first_turn_ms": 1000 * statistics.median(first) if first else 0.0,
        "ttft_later_turns_ms": 1000 * statistics.median(later) if later else 0.0,
        "cached_share_later_turns": sum(t["cached_tokens"] for s in sessions for t in s["turns"][1:])
        / prompt_later if prompt_later else 0.0,
        "session_tps_mean": statistics.fmean(s["session_tps"] for s in sessions) if sessions else 0.0,
        "session_tps_all": tokens / wall if wall > 0 else 0.0,
        "wall_s": wall,
    }


def compare(args: argparse.Namespace) -> dict[str, Any]:
    a, b = (json.loads(Path(p).read_text(encoding="utf-8"))["sessions"] for p in (args.a, args.b))
    pairs = [(s["session"], i, ta["text"], tb["text"]) for s, o in zip(a, b, strict=False)
             for i, (ta, tb) in enumerate(zip(s["turns"], o["turns"], strict=False))]
    differ = [(s, i) for s, i, x, y in pairs if x != y]
    return {"turns_compared": len(pairs), "turns_equal": len(pairs) - len(differ),
            "first_difference": f"session {differ[0][0]} turn {differ[0][1] + 1}" if differ else "none"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="sessions from the data assets, as workload JSONL")
    b.add_argument("set", choices=SESSION_SETS)
    b.add_argument("--n", type=int, default=8, help="sessions (default 8)")
    b.add_argument("--min-turns", type=int, default=4, help="model turns a session has at least (default 4)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", required=True)
    r = sub.add_parser("replay", help="replay sessions against a server")
    r.add_argument("sessions", help="a sessions JSONL file (build writes one)")
    r.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's base URL")
    r.add_argument("--model", help="model id (default: the server's first)")
    r.add_argument("--api-key")
    r.add_argument("--max-tokens", type=int, default=128, help="per turn (default 128)")
    r.add_argument("--turns", type=int, help="at most this many turns a session")
    r.add_argument("--concurrency", type=int, default=1, help="sessions at once (default 1)")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    r.add_argument("--out", help="the replay as JSON (every turn's timings and reply)")
    c = sub.add_parser("compare", help="whether two replays answered alike, turn by turn")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args(argv)
    for name in ("n", "min_turns", "max_tokens", "concurrency", "turns"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            print(f"session_replay: error: --{name.replace('_', '-')} must be >= 1, but got {value}", file=sys.stderr)
            return 2
    try:
        result = {"build": build, "replay": replay, "compare": compare}[args.cmd](args)
    except (EngineInputError, FileNotFoundError, KeyError, json.JSONDecodeError) as exc:
        print(f"session_replay: error: {exc}", file=sys.stderr)
        return 2
    for key, value in result.items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
