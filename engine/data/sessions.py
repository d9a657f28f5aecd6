"""Multi-turn sessions: conversations a client replays turn by turn against a server, feeding the
model's own replies back (``benchmarks/session_replay.py``), so that every turn resends the whole
conversation, as agents and chat front ends do.

A session is a workload line (``engine.data.workloads``: ``messages`` + ``tools``, read and checked
by ``load_workload``) whose ``messages`` are the script: every ``assistant`` message marks a model
turn, whose content the replay replaces with the model's reply; the script ends with the request of
the last turn (a user or tool message). ``turns(prompt)`` counts the replies a session asks for,
``request(prompt, replies)`` is what the next turn sends.

Built from the data assets (``named_sessions``):

- ``agent``: BFCL v4 ``multi_turn_base`` and ``multi_turn_long_context`` entries: the tools of their
  involved API classes (minus excluded functions, OpenAI format as in ``engine.data.datasets``) and
  all their user turns, each followed by a model turn (its scripted content: BFCL's ground-truth
  calls). BFCL ships no tool responses (they come from executing its simulated back ends, which we
  do not run), so none are in the script: the model's replies (its tool calls, as text) go back as
  they are and the next user turn follows. The tool schemas make the shared prefix long (2-6k
  tokens with SmolLM2's tokenizer).
- ``chat``: ShareGPT conversation starts, whole: the system turn if any, then the user and
  assistant turns while they alternate, each under ``CHAT_MAX_CHARS`` (up to ``CHAT_TURNS_MAX_CHARS``
  in all), ending at the last user turn.

Sessions with fewer than ``min_turns`` model turns are left out; the selection is deterministic
(by content hash, then ``seed``).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.config import EngineInputError
from engine.data.assets import default_cache_dir, ensure_asset
from engine.data.datasets import (
    BFCL_CLASS_DOCS,
    CHAT_MAX_CHARS,
    CHAT_TURNS_MAX_CHARS,
    _bfcl_lines,
    _call_from_source,
    _messages,
    _read_jsonl,
    openai_tool,
)
from engine.data.prompts import Prompt
from engine.data.workloads import Workload, read_jsonl, workload_hash

SESSION_SETS = ("agent", "chat")
BFCL_MULTI_TURN = ("multi_turn_base", "multi_turn_long_context")
AGENT_SESSION_MAX_CHARS = 40_000  # the scripted conversation and its tools (the replies add more)


def turns(prompt: Prompt) -> int:
    """The model turns ``prompt`` asks for as a session: its assistant messages, and the last one."""
    return sum(m["role"] == "assistant" for m in prompt.messages) + 1


def request(prompt: Prompt, replies: Sequence[str]) -> list[dict[str, Any]]:
    """The messages the session's turn ``len(replies)`` sends: the script up to that turn's model
    message, each earlier model message replaced by the model's reply (content only: a scripted
    message's tool calls are the data's, not the model's)."""
    out: list[dict[str, Any]] = []
    k = 0  # model turns so far
    for m in prompt.messages:
        if m["role"] != "assistant":
            out.append(dict(m))
        elif k == len(replies):
            return out
        else:
            out.append({"role": "assistant", "content": replies[k]})
            k += 1
    if k != len(replies):
        raise ValueError(f"the session has {turns(prompt)} turns; {len(replies)} replies were given")
    return out


def request_prompt(prompt: Prompt, replies: Sequence[str] = ()) -> Prompt:
    """``request`` as the prompt a client sends: those messages, with the session's tools."""
    return Prompt(messages=tuple(request(prompt, replies)), tools=prompt.tools)


def check_session(prompt: Prompt, where: str) -> None:
    """A workload line that can be replayed: messages that end with a request (not a model message)."""
    if not prompt.messages:
        raise EngineInputError(f"{where}: a session needs 'messages' (a 'prompt' string has no turns)")
    if prompt.messages[-1]["role"] == "assistant":
        raise EngineInputError(f"{where}: a session's messages must end with the last turn's request (user or "
                               "tool), not an assistant message")


def agent_sessions(folder: Path, max_chars: int = AGENT_SESSION_MAX_CHARS) -> list[Prompt]:
    data = folder / "data"
    docs = {cls: _bfcl_lines(data / "multi_turn_func_doc" / f) for cls, f in BFCL_CLASS_DOCS.items()}
    out = []
    for category in BFCL_MULTI_TURN:
        answers = {r["id"]: r["ground_truth"] for r in _bfcl_lines(data / f"possible_answer/BFCL_v4_{category}.json")}
        for rec in _bfcl_lines(data / f"BFCL_v4_{category}.json"):
            excluded = set(rec.get("excluded_function", []))
            fns = [f for cls in rec.get("involved_classes", []) for f in docs.get(cls, [])
                   if f["name"] not in excluded]
            by_name = {f["name"]: f for f in fns}
            truth = answers.get(rec["id"]) or []
            msgs: list[dict[str, Any]] = []
            last = None  # the turn the model answers next
            for t, turn in enumerate(rec["question"]):
                user = _messages(turn, rec["id"])
                if not user:  # (a turn BFCL fills with a missed function's docs: nothing to say)
                    continue
                if last is not None:  # the model's turn: its scripted content, BFCL's calls for that turn
                    sources = truth[last] if last < len(truth) else []
                    calls = [c for c in (_call_from_source(s, by_name) for s in sources) if c is not None]
                    msgs.append({"role": "assistant", "content": ""} | ({"tool_calls": calls} if calls else {}))
                msgs.extend(user)
                last = t
            p = Prompt(messages=tuple(msgs), tools=tuple(openai_tool(f) for f in fns) or None)
            if fns and msgs and msgs[-1]["role"] == "user" and len(json.dumps(p.to_json())) <= max_chars:
                out.append(p)
    if not out:
        raise EngineInputError(f"{data}: no BFCL multi-turn entries found (expected BFCL_v4_multi_turn_*.json)")
    return out


def chat_sessions(folder: Path, max_chars: int = CHAT_MAX_CHARS, max_total: int = CHAT_TURNS_MAX_CHARS
                  ) -> list[Prompt]:
    out = []
    for rec in _read_jsonl(folder / "sharegpt.jsonl"):
        if not str(rec.get("id", "")).endswith("_0"):
            continue  # a later part of a split conversation begins mid-conversation
        msgs: list[dict[str, Any]] = []
        total = 0
        for turn in rec.get("conversations", []):
            who, text = (turn.get("from"), turn.get("value")) if isinstance(turn, dict) else (None, None)
            role = {"system": "system", "human": "user", "user": "user", "gpt": "assistant"}.get(who)
            expected = ("system", "user") if not msgs else ("assistant",) if msgs[-1]["role"] == "user" else ("user",)
            if role not in expected or not isinstance(text, str) or not text.strip() or len(text) > max_chars:
                break
            total += len(text)
            if total > max_total:
                break
            msgs.append({"role": role, "content": text})
        while msgs and msgs[-1]["role"] != "user":
            msgs.pop()
        if msgs:
            out.append(Prompt(messages=tuple(msgs)))
    return out


def named_sessions(name: str, n: int, min_turns: int = 4, seed: int = 0,
                   cache_dir: Path | None = None) -> list[Prompt]:
    """``n`` sessions of the set ``name`` (``SESSION_SETS``) with at least ``min_turns`` model turns,
    picked deterministically; fewer where the set has fewer."""
    if name not in SESSION_SETS:
        raise EngineInputError(f"unknown session set {name!r}; known: {list(SESSION_SETS)}")
    if n < 1 or min_turns < 1:
        raise EngineInputError(f"n and min_turns must be >= 1, but got n={n}, min_turns={min_turns}")
    cache = cache_dir if cache_dir is not None else default_cache_dir()
    pool = agent_sessions(ensure_asset("bfcl", cache)) if name == "agent" else \
        chat_sessions(ensure_asset("sharegpt", cache))
    fit = sorted((p for p in pool if turns(p) >= min_turns),
                 key=lambda p: hashlib.sha256(json.dumps(p.to_json(), sort_keys=True).encode()).hexdigest())
    return random.Random(seed).sample(fit, min(n, len(fit)))


def load_sessions(spec: str, base_dir: Path, n: int, seed: int = 0, min_turns: int | None = None,
                  cache_dir: Path | None = None) -> Workload:
    """A session workload: ``n`` sessions of a named set (``SESSION_SETS``: ``named_sessions``, at least
    ``min_turns`` model turns each, 4 when None), or of a JSONL file of sessions (relative to
    ``base_dir``; every line must be one: ``check_session``; those of at least ``min_turns`` model
    turns, every one when None; ``n`` chosen by ``seed`` as ``load_workload`` chooses)."""
    if spec in SESSION_SETS:
        return _workload(spec, named_sessions(spec, n, 4 if min_turns is None else min_turns, seed, cache_dir))
    if n < 1 or (min_turns is not None and min_turns < 1):
        raise EngineInputError(f"n and min_turns must be >= 1, but got n={n}, min_turns={min_turns}")
    path = Path(spec)
    path = path if path.is_absolute() else Path(base_dir) / path
    pool = read_jsonl(path)
    for i, p in enumerate(pool, 1):
        check_session(p, f"{path}:{i}")
    pool = [p for p in pool if min_turns is None or turns(p) >= min_turns]
    chosen = pool if len(pool) <= n else random.Random(seed).sample(pool, n)
    return _workload(path.stem, chosen)


def _workload(name: str, chosen: Sequence[Prompt]) -> Workload:
    prompts = tuple(chosen)
    return Workload(name=name, prompts=prompts, hash=workload_hash(prompts), sessions=True)
