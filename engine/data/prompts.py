"""A prompt (plain text, or a chat with tools) and its fixed train/eval split: what the workloads
(``engine.data.workloads``) select from and the data assets (``engine.data.datasets``) build, so that neither
imports the other for it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from engine.config import EngineInputError
from engine.files import preview

MAX_TOOL_NAME = 256  # characters of a tool's name (BFCL's dotted names included)


@dataclass(frozen=True)
class Prompt:
    """A plain-text prompt, or a chat (messages, optional tools) rendered by the chat template."""

    text: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    tools: tuple[dict[str, Any], ...] | None = None

    def to_json(self) -> dict[str, Any]:
        if self.messages is not None:
            d: dict[str, Any] = {"messages": list(self.messages)}
            if self.tools:
                d["tools"] = list(self.tools)
            return d
        return {"prompt": self.text}


def split_of(prompt: Prompt) -> str:
    """A fixed train/eval split by content hash: 80% train, 20% eval, stable across versions."""
    digest = hashlib.sha256(json.dumps(prompt.to_json(), sort_keys=True).encode()).digest()
    return "eval" if digest[0] < 52 else "train"


def check_tools(tools: Any, where: str) -> None:
    """A chat's tool definitions, OpenAI's shape: a list of ``{"type": "function", "function":
    {"name", "description"?, "parameters"?}}`` (a name a non-empty string, parameters a JSON-schema
    object). Anything else raises ``EngineInputError`` naming the entry (``where``: ``tools`` or a
    workload line), the rule and a preview of the value: a tool the grammar and the chat template
    would misread is refused before it decodes."""
    if not isinstance(tools, list):
        raise EngineInputError(f"{where}: must be a list of tool objects, but got {preview(tools)}")
    for i, tool in enumerate(tools):
        at = f"{where}.{i}"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise EngineInputError(f"{at}: must be an object of type 'function', but got {preview(tool)}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise EngineInputError(f"{at}.function: must be an object with a name, but got {preview(fn)}")
        _check_name(fn.get("name"), f"{at}.function.name")
        if not isinstance(fn.get("description", ""), str):
            raise EngineInputError(f"{at}.function.description: must be a string, but got {preview(fn['description'])}")
        if not isinstance(fn.get("parameters", {}), dict):
            raise EngineInputError(f"{at}.function.parameters: must be a JSON-schema object, but got "
                                   f"{preview(fn['parameters'])}")


def check_tool_calls(calls: Any, where: str) -> None:
    """An assistant turn's tool calls: a list of ``{"type"?: "function", "function": {"name",
    "arguments"}}`` (arguments a JSON string, as OpenAI sends them, or an object)."""
    if not isinstance(calls, list):
        raise EngineInputError(f"{where}: must be a list of tool calls, but got {preview(calls)}")
    for i, call in enumerate(calls):
        at = f"{where}.{i}"
        if not isinstance(call, dict) or call.get("type", "function") != "function" \
                or not isinstance(call.get("function"), dict):
            raise EngineInputError(f"{at}: must be an object with a 'function' object, but got {preview(call)}")
        _check_name(call["function"].get("name"), f"{at}.function.name")
        if not isinstance(call["function"].get("arguments", "{}"), (str, dict)):
            raise EngineInputError(f"{at}.function.arguments: must be a JSON string or an object, but got "
                                   f"{preview(call['function']['arguments'])}")


def _check_name(name: Any, where: str) -> None:
    if not isinstance(name, str) or not name or len(name) > MAX_TOOL_NAME or any(c.isspace() for c in name):
        raise EngineInputError(f"{where}: must be a non-empty name without spaces of at most {MAX_TOOL_NAME} "
                               f"characters, but got {preview(name)}")
