"""The user's and a checkpoint's small files read as mappings (a config, an HF config.json, a
safetensors index): one rule for all, refused with the file named (``EngineInputError``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from engine.config import EngineInputError


def read_mapping(path: str | Path, fmt: str, label: str = "") -> dict[str, Any]:
    """The mapping in ``path`` (``fmt``: "json" or "yaml"); ``label`` names the file in the errors
    (default: its path). A missing file, a parse error or a top level that is not a mapping raises."""
    name = label or str(path)
    p = Path(path)
    if not p.is_file():
        raise EngineInputError(f"{name} not found")
    try:
        text = p.read_text()
        data = json.loads(text) if fmt == "json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise EngineInputError(f"{name} is not valid {fmt.upper()}: {exc}") from None
    if not isinstance(data, dict):
        raise EngineInputError(f"{name}: expected a mapping, got {type(data).__name__}")
    return data
