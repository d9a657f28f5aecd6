"""Prompt pools built from the data assets: HumanEval (code), ShareGPT (chat), BFCL (agent traffic), and
two training-only pools: later ShareGPT turns and the running interpreter's standard library.

Every pool is a deterministic list (file order, duplicates dropped); engine.data.workloads splits it into
train/eval by content hash and samples from it by seed.

- ``humaneval``: the 164 problems. Each ``prompt`` field (a signature + docstring to complete) is
  presented as one chat user turn, ``"Complete the following Python function:\\n```python\\n{prompt}```"``,
  because the target is an instruct model driven through its chat template, as in chat-style code
  benchmarks; the reply (code) is what the draft must predict.
- ``chat``: the first user turn of each ShareGPT conversation (with its system turn, if any). Only
  conversation starts (ids ``*_0``: ShareGPT V3 splits long conversations into parts whose later
  parts begin mid-conversation); empty turns and turns over ``CHAT_MAX_CHARS`` are skipped.
- ``agent``: BFCL v4 questions with their tool schemas in OpenAI format (BFCL type names such as
  ``dict`` / ``float`` mapped to JSON-schema ones the way BFCL's own OpenAI handler does). Single-turn
  categories (python/java/javascript, multiple, parallel, live, irrelevance) give their question;
  ``multi_turn_base`` gives a multi-turn conversation: the tools of its involved API classes (minus
  excluded functions) and, up to a turn chosen by a hash of its id, the earlier user turns each
  followed by the assistant's ground-truth tool calls. BFCL ships no tool responses (they come from
  executing its simulated backends, which we do not run), so none are included; messages that the
  data does carry (system and assistant turns) are kept. ``web_search`` questions get the web-search
  tools; the memory category is left out (it needs BFCL's memory back-ends and prerequisite chats).
  Prompts whose messages + tools exceed ``AGENT_MAX_CHARS`` are skipped.
- ``chat-turns`` (training only): the later user turns of each ShareGPT conversation start, each with
  the conversation before it (system turn if any, then user/assistant turns, the ``gpt`` replies as
  assistant messages). A conversation ends at its first empty, non-string or over-``CHAT_MAX_CHARS``
  turn, at a break in the user/assistant alternation, or where its content passes
  ``CHAT_TURNS_MAX_CHARS`` in all. A conversation whose first turn (its ``chat`` prompt) is in the eval
  split gives nothing: the eval chat workload is first turns, and a later turn contains the first.
  Needs whole conversations in the asset's ``sharegpt.jsonl``; a copy that holds only each
  conversation's first exchange (``n_turns`` above the turns it has) is refused with a message.
- ``stdlib`` (training only, no asset): functions of the running interpreter's standard library
  (top-level modules and packages; tests, IDLE, lib2to3 and ``encodings`` left out), presented like
  HumanEval: the ``def`` line(s) (dedented for methods) and the docstring exactly as in the source, no
  body. Public module-level functions and methods of public module-level classes (``async def``
  too) whose docstring has at least 2 non-empty lines and whose body does more than ``pass``,
  ``...`` or ``raise NotImplementedError``; a def + docstring over ``STDLIB_MAX_CHARS`` is skipped,
  and so are files that do not decode or parse. The pool depends on the Python version (CPython 3.11.7:
  2,479 prompts).
- ``stdlib-rest`` (training only, no asset): the same library's functions that ``stdlib`` leaves out, posed the
  same way: private names, methods of private classes, docstrings of one line, and functions without a
  docstring (their def line(s) alone); bodies that are stubs, one-line defs and unclean cuts are still
  skipped (CPython 3.11.7: 7,840 prompts). More code to train on: HumanEval is the set whose acceptance
  length the draft has furthest to go.
"""

from __future__ import annotations

import ast
import functools
import gc
import gzip
import hashlib
import json
import re
import sysconfig
from importlib.util import decode_source
from pathlib import Path
from typing import Any

from engine.config import EngineInputError
from engine.data.assets import default_cache_dir, ensure_asset
from engine.data.prompts import Prompt, split_of

HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"
CHAT_MAX_CHARS = 2000
CHAT_TURNS_MAX_CHARS = 6000  # all of a chat-turns prompt's content
STDLIB_MAX_CHARS = 1500  # the def + docstring
STDLIB_SKIP = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__", "encodings"})
AGENT_MAX_CHARS = 24_000  # ~6k SmolLM2 tokens: leaves room for generation in its 8k context

BFCL_SINGLE_TURN = (
    "simple_python", "simple_java", "simple_javascript", "multiple", "parallel", "parallel_multiple",
    "irrelevance", "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple",
    "live_irrelevance", "live_relevance",
)
BFCL_CLASS_DOCS = {
    "GorillaFileSystem": "gorilla_file_system.json", "MathAPI": "math_api.json", "MessageAPI": "message_api.json",
    "TwitterAPI": "posting_api.json", "TicketAPI": "ticket_api.json", "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json", "VehicleControlAPI": "vehicle_control.json",
    "WebSearchAPI": "web_search.json",
}
# BFCL's GORILLA_TO_OPENAPI (bfcl_eval/constants/type_mappings.py)
BFCL_TYPES = {
    "float": "number", "double": "number", "bool": "boolean", "list": "array", "tuple": "array", "dict": "object",
    "any": "string", "Any": "string", "byte": "integer", "short": "integer", "long": "integer", "char": "string",
    "ArrayList": "array", "Array": "array", "HashMap": "object", "Hashtable": "object", "Queue": "array",
    "Stack": "array", "String": "string", "Bigint": "integer",
}
_CODE_HINT = re.compile(
    r"```|\bdef |\bclass |#include|console\.log|\bimport |\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|"
    r"sql|html|css|react|regex|bash|script|function|code|coding|program|algorithm|api)\b", re.IGNORECASE,
)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise EngineInputError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
    return out


def _dedup_json(prompts: list[Prompt]) -> list[Prompt]:
    seen, out = set(), []
    for p in prompts:
        key = json.dumps(p.to_json(), sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


# --- HumanEval ----------------------------------------------------------------------------------


def humaneval_prompts(folder: Path) -> list[Prompt]:
    path = folder / "HumanEval.jsonl.gz"
    out = []
    for i, rec in enumerate(_read_jsonl(path)):
        if not isinstance(rec.get("prompt"), str) or not rec["prompt"].strip():
            raise EngineInputError(f"{path}: record {i} has no 'prompt' string")
        out.append(Prompt(messages=({"role": "user", "content": HUMANEVAL_TEMPLATE.format(prompt=rec["prompt"])},)))
    return _dedup_json(out)


# --- ShareGPT -----------------------------------------------------------------------------------


def _chat_start(turns: list[Any], max_chars: int) -> list[dict[str, Any]]:
    """A conversation's first prompt: its system turn, if any, and first user turn; [] if it has none."""
    msgs: list[dict[str, Any]] = []
    for turn in turns:
        who, text = turn.get("from"), turn.get("value")
        if who == "system" and not msgs and isinstance(text, str) and text.strip():
            msgs.append({"role": "system", "content": text})
            continue
        if who in ("human", "user") and isinstance(text, str) and text.strip() and len(text) <= max_chars:
            msgs.append({"role": "user", "content": text})
            return msgs
        break
    return []


def chat_prompts(folder: Path, max_chars: int = CHAT_MAX_CHARS) -> list[Prompt]:
    out = []
    for rec in _read_jsonl(folder / "sharegpt.jsonl"):
        if str(rec.get("id", "")).endswith("_0"):
            msgs = _chat_start(rec.get("conversations", []), max_chars)
            if msgs:
                out.append(Prompt(messages=tuple(msgs)))
    return _dedup_json(out)


def chat_turn_prompts(folder: Path, max_chars: int = CHAT_MAX_CHARS,
                      max_total: int = CHAT_TURNS_MAX_CHARS) -> list[Prompt]:
    path = folder / "sharegpt.jsonl"
    out = []
    for rec in _read_jsonl(path):
        if not str(rec.get("id", "")).endswith("_0"):
            continue
        turns = rec.get("conversations", [])
        if isinstance(rec.get("n_turns"), int) and rec["n_turns"] > len(turns):
            raise EngineInputError(
                f"{path}: conversation {rec['id']!r} holds {len(turns)} of its {rec['n_turns']} turns; this "
                f"copy of the sharegpt asset keeps only each conversation's first exchange, and chat-turns "
                f"needs whole conversations (an asset layout that keeps them, then a refetch of the asset)")
        msgs = _chat_start(turns, max_chars)
        if not msgs or split_of(Prompt(messages=tuple(msgs))) == "eval":
            continue  # every later turn contains the first: an eval first turn must never reach the draft
        total = sum(len(m["content"]) for m in msgs)
        for turn in turns[len(msgs):]:
            role = "assistant" if msgs[-1]["role"] == "user" else "user"
            who, text = (turn.get("from"), turn.get("value")) if isinstance(turn, dict) else (None, None)
            if who not in (("gpt",) if role == "assistant" else ("human", "user")):
                break
            if not isinstance(text, str) or not text.strip() or len(text) > max_chars:
                break
            total += len(text)
            if total > max_total:
                break
            msgs.append({"role": role, "content": text})
            if role == "user":
                out.append(Prompt(messages=tuple(msgs)))
    return _dedup_json(out)


def is_code_like(prompt: Prompt) -> bool:
    """A chat prompt that asks for or about code (a heuristic used to pick code-like training prompts)."""
    text = prompt.text if prompt.messages is None else "\n".join(m.get("content") or "" for m in prompt.messages)
    return bool(_CODE_HINT.search(text or ""))


# --- BFCL ---------------------------------------------------------------------------------------


def _schema(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: _schema(v) for k, v in node.items()}
        if isinstance(out.get("type"), str):
            out["type"] = BFCL_TYPES.get(out["type"], out["type"])
        return out
    if isinstance(node, list):
        return [_schema(v) for v in node]
    return node


def openai_tool(fn: dict[str, Any]) -> dict[str, Any]:
    """A BFCL function doc as an OpenAI tool (its ``response`` description is not part of that format)."""
    params = _schema(fn.get("parameters") or {"type": "dict", "properties": {}})
    return {"type": "function",
            "function": {"name": fn["name"], "description": fn.get("description", ""), "parameters": params}}


def _call_from_source(src: str, tools: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """``"mv(source='a', destination='b')"`` -> an OpenAI tool call; positional args get parameter names."""
    try:
        node = ast.parse(src.strip(), mode="eval").body
        if not isinstance(node, ast.Call):
            return None
        name = ast.unparse(node.func)
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
        names = list(tools.get(name, {}).get("parameters", {}).get("properties", {}))
        for i, a in enumerate(node.args):
            args[names[i] if i < len(names) else f"arg{i}"] = ast.literal_eval(a)
    except (SyntaxError, ValueError, TypeError):
        return None
    return {"type": "function", "function": {"name": name, "arguments": args}}


def _bfcl_lines(path: Path) -> list[dict[str, Any]]:
    return _read_jsonl(path) if path.is_file() else []


def _messages(turn: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(turn, list):
        raise EngineInputError(f"{where}: a question turn must be a list of messages")
    return [{"role": m["role"], "content": m.get("content") or ""} for m in turn
            if isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")]


def _turn_index(entry_id: str, n: int) -> int:
    return int.from_bytes(hashlib.sha256(entry_id.encode()).digest()[:4], "big") % n


def agent_prompts(folder: Path, max_chars: int = AGENT_MAX_CHARS) -> list[Prompt]:
    data = folder / "data"
    out: list[Prompt] = []
    for cat in BFCL_SINGLE_TURN:
        path = data / f"BFCL_v4_{cat}.json"
        for rec in _bfcl_lines(path):
            msgs = _messages(rec["question"][0], f"{path} {rec.get('id')}")
            tools = [openai_tool(f) for f in rec.get("function", [])]
            if msgs and msgs[-1]["role"] == "user":
                out.append(Prompt(messages=tuple(msgs), tools=tuple(tools) or None))
    docs = {cls: _bfcl_lines(data / "multi_turn_func_doc" / f) for cls, f in BFCL_CLASS_DOCS.items()}
    answers = {r["id"]: r["ground_truth"] for r in _bfcl_lines(data / "possible_answer/BFCL_v4_multi_turn_base.json")}
    for rec in _bfcl_lines(data / "BFCL_v4_multi_turn_base.json"):
        excluded = set(rec.get("excluded_function", []))
        fns = [f for cls in rec.get("involved_classes", []) for f in docs.get(cls, []) if f["name"] not in excluded]
        by_name = {f["name"]: f for f in fns}
        turns, truth = rec["question"], answers.get(rec["id"])
        k = _turn_index(rec["id"], len(turns)) if truth is not None else 0
        msgs: list[dict[str, Any]] = []
        for t in range(k):
            msgs.extend(_messages(turns[t], rec["id"]))
            calls = [c for c in (_call_from_source(s, by_name) for s in truth[t]) if c is not None]
            msgs.append({"role": "assistant", "content": "", "tool_calls": calls} if calls
                        else {"role": "assistant", "content": ""})
        msgs.extend(_messages(turns[k], rec["id"]))
        if fns and msgs and msgs[-1]["role"] == "user":
            out.append(Prompt(messages=tuple(msgs), tools=tuple(openai_tool(f) for f in fns)))
    web = [openai_tool(f) for f in docs.get("WebSearchAPI", [])]
    for rec in _bfcl_lines(data / "BFCL_v4_web_search.json"):
        msgs = _messages(rec["question"][0], rec.get("id", "web_search"))
        if web and msgs:
            out.append(Prompt(messages=tuple(msgs), tools=tuple(web)))
    if not out:
        raise EngineInputError(f"{data}: no BFCL questions found (expected BFCL_v4_*.json files)")
    return [p for p in _dedup_json(out) if len(json.dumps(p.to_json(), ensure_ascii=False)) <= max_chars]


# --- the Python standard library ----------------------------------------------------------------


def _stdlib_files(root: Path) -> list[Path]:
    """The top-level modules and the packages' modules, minus the ``STDLIB_SKIP`` folders, by relative path."""
    files = [p for p in root.glob("*.py") if p.is_file()]
    for pkg in root.iterdir():
        if pkg.name not in STDLIB_SKIP and (pkg / "__init__.py").is_file():
            files += [p for p in pkg.rglob("*.py") if not STDLIB_SKIP & set(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _is_stub(stmt: ast.stmt) -> bool:
    if isinstance(stmt, ast.Pass):
        return True
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and stmt.value.value is Ellipsis:
        return True
    if isinstance(stmt, ast.Raise) and stmt.exc is not None:
        exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return False


def _dedent(line: str, n: int) -> str:
    """``line`` less up to ``n`` leading blanks (a docstring line indented less than its def loses fewer)."""
    return line[min(n, len(line) - len(line.lstrip(" \t"))):]


def _function_prompt(fn: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str], min_doc_lines: int = 2
                     ) -> str | None:
    """The def line(s) and the docstring of ``fn`` as in the source, dedented to column 0; None if unfit.
    ``min_doc_lines`` 0: a function without a docstring gives its def line(s) alone."""
    first = fn.body[0]
    has_doc = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
               and isinstance(first.value.value, str))
    doc_lines = sum(1 for line in first.value.value.splitlines() if line.strip()) if has_doc else 0
    if doc_lines < min_doc_lines or all(map(_is_stub, fn.body[1 if has_doc else 0:])):
        return None
    if has_doc and (lines[first.lineno - 1][:first.col_offset].strip()
                    or (len(fn.body) > 1 and fn.body[1].lineno <= first.end_lineno)):
        return None  # the docstring shares a line with the signature or with code: no clean cut
    if first.lineno == fn.lineno:
        return None  # a one-line def: the body shares the signature's line
    head = lines[fn.lineno - 1:first.lineno - 1]  # fn.lineno is the def line, after any decorators
    while head and (not head[-1].strip() or head[-1].lstrip().startswith("#")):
        head.pop()  # blank lines and comments between the signature and the docstring (or the body)
    kept = head + (lines[first.lineno - 1:first.end_lineno] if has_doc else [])
    text = "".join(_dedent(line, fn.col_offset) + "\n" for line in kept)
    try:  # without a docstring the signature needs a body to parse
        ok = [type(n) for n in ast.parse(text if has_doc else text + "    pass\n").body] == [type(fn)]
    except SyntaxError:  # a dedent that breaks the code (tabs, odd continuation lines)
        ok = False
    return text if ok else None


def _functions(tree: ast.Module) -> list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, bool]]:
    """Module-level functions and methods of module-level classes, in source order, each with
    whether it is public (a public name, and for a method a public class)."""
    out = []
    for node in tree.body:
        hidden = isinstance(node, ast.ClassDef) and node.name.startswith("_")
        members = node.body if isinstance(node, ast.ClassDef) else [node]
        out += [(f, not (hidden or f.name.startswith("_"))) for f in members
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return out


def _parse(path: Path) -> tuple[str, ast.Module] | None:
    """A module's source (its coding cookie applied, newlines made \\n) and tree; None if it has none."""
    collect = gc.isenabled()
    gc.disable()  # a tree is a heap of small objects and no cycles: collections triggered by them cost ~1/3
    try:
        source = decode_source(path.read_bytes())
        return source, ast.parse(source, filename=str(path))
    except (OSError, SyntaxError, ValueError, LookupError):  # unreadable, undecodable, unparsable: skipped
        return None
    finally:
        if collect:
            gc.enable()


def _stdlib_pools(root: Path, max_chars: int) -> tuple[tuple[Prompt, ...], tuple[Prompt, ...]]:
    """``stdlib`` and ``stdlib-rest`` from one pass over the library's sources (parsing is the cost:
    ``stdlib-rest`` is what ``stdlib`` does not take)."""
    main, rest = [], []
    for path in _stdlib_files(root):
        parsed = _parse(path)
        if parsed is None:
            continue
        source, tree = parsed
        lines = source.split("\n")
        for fn, public in _functions(tree):
            for pool, prompt in ((main, _function_prompt(fn, lines) if public else None),
                                 (rest, _function_prompt(fn, lines, min_doc_lines=0))):
                if prompt is not None and len(prompt) <= max_chars:
                    pool.append(Prompt(messages=({"role": "user",
                                                  "content": HUMANEVAL_TEMPLATE.format(prompt=prompt)},)))
    main = _dedup_json(main)
    taken = {json.dumps(p.to_json(), sort_keys=True) for p in main}
    return tuple(main), tuple(p for p in _dedup_json(rest) if json.dumps(p.to_json(), sort_keys=True) not in taken)


def stdlib_prompts(root: Path, max_chars: int = STDLIB_MAX_CHARS) -> list[Prompt]:
    """The ``stdlib`` pool of the standard library at ``root`` (see the module docstring)."""
    return list(_stdlib_pools(root, max_chars)[0])


def stdlib_rest_prompts(root: Path, max_chars: int = STDLIB_MAX_CHARS) -> list[Prompt]:
    """The ``stdlib-rest`` pool: every other function ``stdlib`` leaves out (see the module docstring)."""
    return list(_stdlib_pools(root, max_chars)[1])


# --- pools --------------------------------------------------------------------------------------

# name -> (asset, builder of the pool from the asset's folder); asset None: the interpreter's stdlib
POOLS = {"humaneval": ("humaneval", humaneval_prompts), "chat": ("sharegpt", chat_prompts),
         "agent": ("bfcl", agent_prompts), "chat-turns": ("sharegpt", chat_turn_prompts),
         "stdlib": (None, stdlib_prompts), "stdlib-rest": (None, stdlib_rest_prompts)}


@functools.lru_cache(maxsize=16)
def _pool(name: str, cache_dir: str) -> tuple[Prompt, ...]:
    asset, build = POOLS[name]
    folder = Path(sysconfig.get_paths()["stdlib"]) if asset is None else ensure_asset(asset, Path(cache_dir))
    return tuple(build(folder))


def named_pool(name: str, cache_dir: Path | None = None) -> tuple[Prompt, ...]:
    """All prompts of a named set (fetching its asset on first use), in a fixed order."""
    if name not in POOLS:
        raise EngineInputError(f"unknown workload set {name!r}; known: {sorted(POOLS)}")
    if POOLS[name][0] is None:
        return _pool(name, "")  # no asset: one pool whatever the cache
    return _pool(name, str(cache_dir if cache_dir is not None else default_cache_dir()))
