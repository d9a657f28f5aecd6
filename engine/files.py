"""The user's and a checkpoint's small files: read bounded, strict and unambiguous, or refused with
the file named.

One reader for every YAML and JSON file the project takes from a person (experiments, search
spaces, engine configs, workload lines) or from a checkpoint folder (an HF ``config.json``, a
safetensors index):

- **bounded**: a file past its size limit is refused before it is read (``MAX_CONFIG_BYTES`` for
  configs; workloads pass their own);
- **strict UTF-8**: another encoding (UTF-16 from a Windows editor, Latin-1) is refused naming the
  byte and its offset, not decoded into garbage; a UTF-8 byte-order mark is allowed;
- **YAML without surprises**: a key given twice in one mapping is refused (PyYAML keeps the last one
  silently), and so is a document with more than ``MAX_ALIASES`` aliases or whose aliases expand past
  ``MAX_EXPANDED_NODES`` values, or hold themselves (a few kilobytes of nested aliases, a "billion
  laughs", expand into gigabytes for whatever walks the result);
- **JSON nested no deeper than** ``MAX_JSON_DEPTH`` (Python's parser recurses: deeper input raises
  ``RecursionError``, a traceback instead of a message).

Every refusal is a ``FileRefused`` (an ``EngineInputError``) whose message names the file and the
rule; ``preview`` cuts any value quoted in a message to a few hundred characters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from engine.config import EngineInputError

MAX_CONFIG_BYTES = 1 << 20  # an experiment, a search space or an engine config is a few hundred bytes
MAX_ALIASES = 100  # YAML aliases (*name) in one document
MAX_EXPANDED_NODES = 100_000  # values in a YAML document once its aliases are expanded
MAX_JSON_DEPTH = 64  # nested arrays and objects in one JSON document or workload line
MAX_WORKLOAD_BYTES = 64 << 20  # a JSONL file of prompts
PREVIEW_CHARS = 200


class FileRefused(EngineInputError):
    """A file the project will not read: ``label`` names it, ``rule`` says why."""

    def __init__(self, label: str, rule: str) -> None:
        self.label, self.rule = label, rule
        super().__init__(f"{label}: {rule}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.label, self.rule))


def preview(value: Any, limit: int = PREVIEW_CHARS) -> str:
    """``repr(value)``, cut to ``limit`` characters with the full length said (error messages stay
    small whatever a file holds)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def read_text(path: str | Path, label: str = "", max_bytes: int = MAX_CONFIG_BYTES) -> str:
    """The text of ``path``: an existing file of at most ``max_bytes``, in UTF-8 (a byte-order mark
    is dropped). ``label`` names the file in refusals (default: its path)."""
    name = label or str(path)
    p = Path(path)
    if not p.is_file():
        raise FileRefused(name, "not found" if not p.exists() else "is not a file")
    size = p.stat().st_size
    if size > max_bytes:
        raise FileRefused(name, f"is {size:,} bytes; files of at most {max_bytes:,} bytes are read")
    raw = p.read_bytes()
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise FileRefused(name, "is UTF-16 (its byte-order mark says so); save it as UTF-8")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise FileRefused(name, f"is not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                                "save it as UTF-8") from None
    if "\x00" in text:
        raise FileRefused(name, f"holds a NUL character (offset {text.index(chr(0))}): UTF-16 or binary, not "
                                "UTF-8 text")
    return text


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses duplicate keys and counts aliases."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                mark = self.peek_event().start_mark
                raise yaml.constructor.ConstructorError(
                    None, None, f"more than {MAX_ALIASES} aliases (*name) in one document", mark)
        return super().compose_node(parent, index)

    def get_single_node(self) -> Any:
        node = super().get_single_node()
        if node is not None and _expanded_size(node) > MAX_EXPANDED_NODES:
            raise yaml.constructor.ConstructorError(
                None, None, f"its aliases expand to more than {MAX_EXPANDED_NODES:,} values", node.start_mark)
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: merged keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: PyYAML's own message follows
                break
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"the key {preview(key)} is given twice (first on line {first.line + 1}); "
                    "a YAML key may appear once", key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, label: str) -> Any:
    """``text`` as YAML (one document), by the rules above."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        raise FileRefused(label, f"is not valid YAML: {_cut(str(exc))}") from None
    except RecursionError:
        raise FileRefused(label, "is nested too deeply to be a config") from None


def parse_json(text: str, label: str) -> Any:
    """``text`` as JSON, nested at most ``MAX_JSON_DEPTH`` deep."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FileRefused(label, f"is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise FileRefused(label, f"is nested more than {MAX_JSON_DEPTH} deep") from None
    if _depth(data) > MAX_JSON_DEPTH:
        raise FileRefused(label, f"is nested more than {MAX_JSON_DEPTH} deep")
    return data


def read_yaml(path: str | Path, label: str = "", max_bytes: int = MAX_CONFIG_BYTES) -> Any:
    """``read_text`` then ``parse_yaml``."""
    name = label or str(path)
    return parse_yaml(read_text(path, name, max_bytes), name)


def read_mapping(path: str | Path, fmt: str, label: str = "") -> dict[str, Any]:
    """The mapping in ``path`` (``fmt``: "json" or "yaml"); ``label`` names the file in the errors
    (default: its path). A missing or unreadable file, a parse error or a top level that is not a
    mapping is refused."""
    name = label or str(path)
    text = read_text(path, name)
    data = parse_json(text, name) if fmt == "json" else parse_yaml(text, name)
    if not isinstance(data, dict):
        raise FileRefused(name, f"expected a mapping, got {type(data).__name__}")
    return data


def _expanded_size(root: Any) -> int:
    """How many values a composed YAML node holds with every alias expanded: each distinct node's
    size computed once (post-order, iteratively), so a nest of aliases is measured, not expanded."""
    size: dict[int, int] = {}
    open_: set[int] = set()  # nodes whose children are being measured: met again, a cycle
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in size:
            continue
        children = [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else (
            node.value if isinstance(node, yaml.SequenceNode) else [])
        if done:
            size[id(node)] = min(1 + sum(size[id(c)] for c in children), MAX_EXPANDED_NODES + 1)
            open_.discard(id(node))
        elif id(node) in open_:  # a structure that holds itself expands without end
            return MAX_EXPANDED_NODES + 1
        else:
            open_.add(id(node))
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in size)
    return size[id(root)]


def _depth(value: Any) -> int:
    """How deep arrays and objects nest in ``value`` (iteratively: no recursion to overflow)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            if d <= MAX_JSON_DEPTH:
                stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def _cut(text: str, limit: int = 600) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
