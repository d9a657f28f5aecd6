"""The OpenAI-style request side of the server: bodies, their validation, and the generation job.

Every refusal is an ``ApiError`` whose message names the field, the rule and the value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from engine.config import EngineConfig, EngineInputError
from engine.data.prompts import Prompt, check_tool_calls, check_tools
from engine.files import FileRefused, parse_json, preview

DEFAULT_MAX_TOKENS = 512  # when a request gives none (and the context leaves room)
MAX_STOP_STRINGS = 4
MAX_SEED = 2**31 - 1  # the position-keyed sampler mixes the seed in 31-bit arithmetic


class ApiError(Exception):
    """A request the server refuses; becomes an OpenAI-style error body with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        kind = {401: "authentication_error", 500: "server_error", 503: "server_overloaded"}.get(
            self.status, "invalid_request_error")
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


class RequestBody(BaseModel):
    """Fields both endpoints share. Strict: "5" is not an integer, 1.0 is not an integer."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    stop: Any = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatBody(RequestBody):
    messages: list[ChatMessage]
    tools: list[dict[str, Any]] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tool_choice: Any = None
    response_format: Any = None


class CompletionBody(RequestBody):
    prompt: Any
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


def parse_body(body: Any, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        got = f", but got {preview(err['input'])}" if "input" in err and err["type"] != "missing" else ""
        raise bad_request(f"{where}: {err['msg'].lower()}{got}", param=where) from None


async def json_body(request: Request) -> Any:
    raw = await request.body()
    try:  # nesting bounded (``engine.files``): a deeply nested body is a 400, not a RecursionError's 500
        data = parse_json(raw.decode("utf-8"), "the request body")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not UTF-8 (byte at offset {exc.start})", code="invalid_json") from None
    except FileRefused as exc:
        raise bad_request(f"the request body {exc.rule}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, but got {type(data).__name__}")
    return data


def text_content(content: Any, where: str) -> str:
    """A message's content: a string, null, or a list of {"type": "text", "text": ...} parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"{where}[{i}]: only text parts ({{'type': 'text', 'text': ...}}) are "
                                  f"supported, but got {preview(part)}", param=where)
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{where}: must be a string, null or a list of text parts, but got {preview(content)}",
                      param=where)


def stop_strings(stop: Any) -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request(f"stop: must be a non-empty string or a list of them, but got {preview(stop)}", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop: at most {MAX_STOP_STRINGS} strings, but got {len(stops)}", param="stop")
    return stops


# --- request -> job -------------------------------------------------------------------------------


@dataclass
class Job:
    ids: list[int]
    cfg: EngineConfig
    max_tokens: int
    stops: list[str]


def context_length(pair: Any) -> int | None:
    return getattr(getattr(pair.target, "cfg", None), "max_position_embeddings", None)


def make_job(pair: Any, base: EngineConfig, body: RequestBody, ids: list[int]) -> Job:
    if body.n not in (None, 1):
        raise bad_request(f"n: only n=1 is supported, but got {body.n}", param="n")
    if not ids:
        raise bad_request("the prompt encodes to no tokens", param="prompt")
    ctx = context_length(pair)
    if ctx is not None and len(ids) >= ctx:
        raise bad_request(f"the prompt has {len(ids)} tokens, but the model's context holds {ctx}: shorten it",
                          code="context_length_exceeded")
    room = ctx - len(ids) if ctx is not None else None
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS if room is None else min(DEFAULT_MAX_TOKENS, room)
    elif max_tokens < 1:
        raise bad_request(f"{name}: must be >= 1, but got {max_tokens}", param=name)
    elif room is not None and max_tokens > room:
        raise bad_request(f"{name}: the prompt ({len(ids)} tokens) plus {name} ({max_tokens}) exceeds the model's "
                          f"context ({ctx} tokens); at most {room} new tokens fit", param=name,
                          code="context_length_exceeded")
    changes: dict[str, Any] = {}
    if body.temperature is not None:
        t = body.temperature
        if not (math.isfinite(t) and 0.0 <= t <= 2.0):
            raise bad_request(f"temperature: must be between 0 and 2, but got {t}", param="temperature")
        changes["temperature"] = float(t)
    if body.seed is not None:
        if not 0 <= body.seed <= MAX_SEED:
            raise bad_request(f"seed: must be between 0 and {MAX_SEED}, but got {body.seed}", param="seed")
        changes["seed"] = body.seed
    return Job(ids, base.replace(**changes) if changes else base, max_tokens, stop_strings(body.stop))


def _refuse_unsupported_chat(body: ChatBody) -> None:
    """Refused, not ignored: a client that asks for log-probs, a forced tool call or JSON mode must
    not get an answer that looks like one (``logprobs: null``, free text) and take it as such
    (docs/serving.md)."""
    for name in ("logprobs", "top_logprobs"):
        if getattr(body, name) not in (None, False):
            raise bad_request(f"{name}: not supported by this server, but got {preview(getattr(body, name))}",
                              param=name)
    if body.tool_choice not in (None, "auto"):
        raise bad_request(f"tool_choice: only 'auto' is supported, but got {preview(body.tool_choice)}",
                          param="tool_choice")
    if body.response_format not in (None, {"type": "text"}):
        raise bad_request(f"response_format: only {{'type': 'text'}} is supported, but got "
                          f"{preview(body.response_format)}", param="response_format")


def _checked(check: Any, value: Any, where: str) -> None:
    try:
        check(value, where)
    except EngineInputError as exc:
        raise bad_request(str(exc), param=where) from None


def chat_ids(pair: Any, body: ChatBody) -> list[int]:
    _refuse_unsupported_chat(body)
    if not body.messages:
        raise bad_request("messages: must hold at least one message", param="messages")
    if body.tools is not None:
        _checked(check_tools, body.tools, "tools")
    messages = []
    for i, m in enumerate(body.messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": text_content(m.content, f"messages.{i}.content")}
        if m.tool_calls is not None:
            _checked(check_tool_calls, m.tool_calls, f"messages.{i}.tool_calls")
            msg["tool_calls"] = m.tool_calls
        if m.role == "tool" and not m.tool_call_id:
            raise bad_request(f"messages.{i}.tool_call_id: a tool message must name the call it answers",
                              param=f"messages.{i}.tool_call_id")
        messages.append(msg)
    try:
        return pair.encode(Prompt(messages=tuple(messages), tools=tuple(body.tools) if body.tools else None))
    except EngineInputError as exc:
        raise bad_request(str(exc), param="messages") from None


def completion_ids(pair: Any, body: CompletionBody) -> list[int]:
    for name in ("echo", "logprobs", "suffix"):
        if getattr(body, name):
            raise bad_request(f"{name}: not supported by this server, but got {preview(getattr(body, name))}",
                              param=name)
    if body.best_of not in (None, 1):
        raise bad_request(f"best_of: only 1 is supported, but got {body.best_of}", param="best_of")
    p = body.prompt
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if isinstance(p, str):
        try:
            return pair.encode(p)
        except EngineInputError as exc:
            raise bad_request(str(exc), param="prompt") from None
    vocab = pair.target.cfg.vocab_size
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"prompt: token id {bad[0]} is outside the vocabulary (size {vocab})", param="prompt")
        return list(p)
    raise bad_request(f"prompt: must be a string, a one-string list or a list of token ids, but got {preview(p)}",
                      param="prompt")
