"""Workloads: prompt sets by name or JSONL path, selected deterministically, hashed for provenance."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import EngineInputError
from engine.data.prompts import Prompt, check_tool_calls, check_tools, split_of
from engine.files import MAX_WORKLOAD_BYTES, parse_json, preview, read_text

NAMED_WORKLOADS = ("humaneval", "chat", "agent")
SPLITS = ("train", "eval", "all")


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: tuple[Prompt, ...]
    hash: str
    # each prompt is a multi-turn session (engine.data.sessions.load_sessions), replayed turn by turn
    sessions: bool = False


def _prompt_from_record(rec: Any, where: str) -> Prompt:
    if not isinstance(rec, dict):
        raise EngineInputError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    unknown = sorted(set(rec) - {"prompt", "messages", "tools", "id"})
    if unknown:
        raise EngineInputError(f"{where}: unknown key(s) {unknown}; allowed: prompt | messages (+ tools), id")
    if "prompt" in rec:
        if "messages" in rec:
            raise EngineInputError(f"{where}: give either 'prompt' or 'messages', not both")
        if not isinstance(rec["prompt"], str) or not rec["prompt"]:
            raise EngineInputError(f"{where}: 'prompt' must be a non-empty string, got {preview(rec['prompt'])}")
        return Prompt(text=rec["prompt"])
    msgs = rec.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise EngineInputError(f"{where}: needs 'prompt' (string) or 'messages' (non-empty list)")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise EngineInputError(f"{where}: messages[{j}] needs a role of system|user|assistant|tool, "
                                   f"got {preview(m)}")
        if not isinstance(m.get("content", ""), (str, type(None))):
            raise EngineInputError(f"{where}: messages[{j}].content must be a string")
        if m.get("tool_calls") is not None:
            check_tool_calls(m["tool_calls"], f"{where}: messages[{j}].tool_calls")
    tools = rec.get("tools")
    if tools is not None:
        check_tools(tools, f"{where}: tools")
    return Prompt(messages=tuple(msgs), tools=tuple(tools) if tools else None)


def read_jsonl(path: Path) -> list[Prompt]:
    """A workload file's prompts, one JSON object a line (``engine.files``: bounded, UTF-8, nesting
    bounded; a broken line refused with its number)."""
    if not path.is_file():
        raise EngineInputError(f"workload file {str(path)!r} not found")
    prompts = []
    for lineno, line in enumerate(read_text(path, max_bytes=MAX_WORKLOAD_BYTES).splitlines(), 1):
        if not line.strip():
            continue
        rec = parse_json(line, f"{path}:{lineno}")
        prompts.append(_prompt_from_record(rec, f"{path}:{lineno}"))
    if not prompts:
        raise EngineInputError(f"workload file {str(path)!r} holds no prompts")
    return prompts


def workload_hash(prompts: tuple[Prompt, ...]) -> str:
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps(p.to_json(), sort_keys=True).encode())
        h.update(b"\n")
    return h.hexdigest()


def _named(spec: str, cache_dir: Path | None = None) -> tuple[Prompt, ...]:
    from engine.data.datasets import named_pool  # the data assets are only touched for named sets

    return named_pool(spec, cache_dir)


def load_workload(spec: str, base_dir: Path, n_prompts: int, seed: int, split: str = "eval",
                  cache_dir: Path | None = None) -> Workload:
    """Select ``n_prompts`` prompts deterministically (by ``seed``) from a named set or JSONL file.

    Named sets (fetched into the asset cache on first use) are split into train/eval by content
    hash; a JSONL file is the user's own set and is used whole (``split`` does not apply to it).
    """
    if split not in SPLITS:
        raise EngineInputError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if isinstance(n_prompts, bool) or not isinstance(n_prompts, int) or n_prompts < 1:
        raise EngineInputError(f"n_prompts must be an integer >= 1, got {n_prompts!r}")
    if spec in NAMED_WORKLOADS:
        pool = [p for p in _named(spec, cache_dir) if split == "all" or split_of(p) == split]
        name = spec
    else:
        path = Path(spec)
        path = path if path.is_absolute() else Path(base_dir) / path
        pool = read_jsonl(path)
        name = path.stem
    rng = random.Random(seed)
    chosen = pool if len(pool) <= n_prompts else rng.sample(pool, n_prompts)
    chosen_t = tuple(chosen)
    return Workload(name=name, prompts=chosen_t, hash=workload_hash(chosen_t))


# the last three: training only
TRAINING_SETS = ("chat", "agent", "code", "humaneval", "stdlib", "chat-turns", "stdlib-rest")
TRAINING_MIX = ("code", "chat", "agent", "stdlib", "chat-turns", "stdlib-rest")  # what a draft trains on by default


def training_pool(name: str, cache_dir: Path | None = None) -> list[Prompt]:
    """Train-split prompts of one training set.

    ``code`` is HumanEval's train split (only ~130 of its 164 problems) plus the train-split ShareGPT
    first turns that ask for or about code (``engine.data.datasets.is_code_like``); BFCL's python questions
    are agent traffic and stay in ``agent``. ``stdlib`` (standard-library functions posed like HumanEval),
    ``stdlib-rest`` (the library's other functions) and ``chat-turns`` (later ShareGPT turns, none from a
    conversation whose first turn is eval) are no workloads (``NAMED_WORKLOADS``): they exist to train on.
    """
    from engine.data.datasets import is_code_like

    if name not in TRAINING_SETS:
        raise EngineInputError(f"unknown training set {name!r}; known: {list(TRAINING_SETS)}")
    if name == "code":
        pool = list(_named("humaneval", cache_dir)) + [p for p in _named("chat", cache_dir) if is_code_like(p)]
    else:
        pool = list(_named(name, cache_dir))
    return [p for p in pool if split_of(p) == "train"]


def training_prompts(sets: tuple[str, ...] | list[str] = ("chat", "agent", "code"), n: int = 1000, seed: int = 0,
                     cache_dir: Path | None = None) -> list[Prompt]:
    """``n`` train-split prompts drawn evenly from ``sets`` (deterministic by ``seed``), never eval ones.

    Each set gets an equal share; a set with fewer prompts than its share gives the rest to the others.
    A prompt found in two sets (a code-like chat turn) is used once. Fewer than ``n`` come back only
    when all the sets together hold fewer.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise EngineInputError(f"n must be an integer >= 1, got {n!r}")
    if not sets:
        raise EngineInputError("training_prompts needs at least one set")
    rng = random.Random(seed)
    pools = []
    for name in dict.fromkeys(sets):
        pool = training_pool(name, cache_dir)
        rng.shuffle(pool)
        pools.append(pool)
    chosen: dict[str, Prompt] = {}
    while len(chosen) < n and any(pools):
        for pool in pools:  # round robin: equal shares, and a short set leaves room for the others
            while pool:
                p = pool.pop()
                key = json.dumps(p.to_json(), sort_keys=True)
                if key not in chosen:
                    chosen[key] = p
                    break
            if len(chosen) >= n:
                break
    out = list(chosen.values())
    rng.shuffle(out)
    return out
