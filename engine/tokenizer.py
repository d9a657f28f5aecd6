"""Tokenizers: the byte-level one of the tiny presets, and the common interface the engine uses."""

from __future__ import annotations

import json
import re
from typing import Any, Protocol


class Tokenizer(Protocol):
    vocab_size: int
    stop_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> str: ...


def render_chatml(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  add_generation_prompt: bool) -> str:
    """ChatML with tool definitions in the system turn and <tool_call> blocks (Hermes/Qwen style)."""
    parts = []
    msgs = list(messages)
    if tools:
        tool_text = "\n".join(json.dumps(t, sort_keys=True) for t in tools)
        system = msgs.pop(0)["content"] if msgs and msgs[0].get("role") == "system" else ""
        system = (system + "\n\n" if system else "") + (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n"
            "<tools>\n" + tool_text + "\n</tools>\n\nFor each function call, return a json object "
            "within <tool_call></tool_call> tags."
        )
        parts.append(f"<|im_start|>system\n{system}<|im_end|>\n")
    for m in msgs:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "".join(
                "<tool_call>\n" + json.dumps(c.get("function", c), sort_keys=True) + "\n</tool_call>"
                for c in m["tool_calls"]
            )
            content = (content + "\n" if content else "") + calls
        if role == "tool":
            parts.append(f"<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n")
            continue
        parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


class ByteTokenizer:
    """Bytes 0..255 plus a few specials; what the seeded tiny presets speak."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")

    def __init__(self, vocab_size: int = 272) -> None:
        if vocab_size < 256 + len(self.SPECIALS):
            raise ValueError(f"ByteTokenizer needs vocab_size >= {256 + len(self.SPECIALS)}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.special_ids = {s: 256 + i for i, s in enumerate(self.SPECIALS)}
        self.eos_id = self.special_ids["<|endoftext|>"]
        self.mask_id = self.special_ids["<|mask|>"]
        self.stop_ids = (self.eos_id, self.special_ids["<|im_end|>"])
        self._split = re.compile("(" + "|".join(re.escape(s) for s in self.SPECIALS) + ")")

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._split.split(text):
            if piece in self.special_ids:
                ids.append(self.special_ids[piece])
            elif piece:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: list[int]) -> str:
        names = {v: k for k, v in self.special_ids.items()}
        out, buf = [], bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            out.append(names.get(i, f"<|unused_{i}|>"))
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def render_chat(self, messages, tools=None, add_generation_prompt=True) -> str:
        return render_chatml(messages, tools, add_generation_prompt)


class JsonTokenizer:
    """An HF ``tokenizer.json`` read with the `tokenizers` package (when it is installed)."""

    def __init__(self, path, eos_tokens: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>", "</s>")) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        self._tok = _HFTokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        ids = [self._tok.token_to_id(t) for t in eos_tokens]
        self.stop_ids = tuple(i for i in ids if i is not None)
        self.mask_id = None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def render_chat(self, messages, tools=None, add_generation_prompt=True) -> str:
        return render_chatml(messages, tools, add_generation_prompt)


def tokenizer_from_folder(folder) -> JsonTokenizer | None:
    """The folder's tokenizer.json, or None (then prompts must be given as token ids)."""
    from pathlib import Path

    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return JsonTokenizer(path)
    except ImportError:
        return None


def tokenizer_from_gguf_metadata(meta: dict) -> None:
    """GGUF tokenizers come with the SmolLM2 issue; until then GGUF targets take token ids."""
    return None
