"""A prompt (plain text, or a chat with tools) and its fixed train/eval split: what the workloads
(``engine.data.workloads``) select from and the data assets (``engine.data.datasets``) build, so that neither
imports the other for it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any


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
