"""The user's files as autotune reads them: experiments and search spaces (YAML), workload lines
(JSONL), through the engine's one reader (``engine.read_yaml``, ``engine.read_text``,
``engine.parse_json``: bounded, strict UTF-8, no duplicate YAML key, aliases and nesting bounded);
a refusal becomes an ``InputError`` naming the file (exit 2 at the CLI)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune.errors import InputError


def read_yaml_file(path: Path) -> Any:
    """An experiment or search-space file as YAML."""
    import engine  # (torch loads with it: only once a file is read)

    try:
        return engine.read_yaml(path, str(path))
    except engine.FileRefused as exc:
        raise InputError(str(path), None, exc.rule) from None


def read_jsonl_lines(path: Path) -> list[tuple[int, Any, str]]:
    """A workload file's non-blank lines as (line number, parsed JSON, the line's first characters)."""
    import engine

    try:
        text = engine.read_text(path, str(path), engine.MAX_WORKLOAD_BYTES)
    except engine.FileRefused as exc:
        raise InputError(str(path), None, exc.rule) from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((n, engine.parse_json(line, f"{path}:{n}"), line[:80]))
        except engine.FileRefused as exc:
            raise InputError(f"{path}:{n}", None, f"each line must be a JSON object ({exc.rule})", line[:80]) from None
    return out
