"""Chat formats: a model's own chat template (a GGUF's ``tokenizer.chat_template``, an HF folder's
``tokenizer_config.json`` or ``chat_template.jinja``) rendered as transformers renders it, and our
documented tool format (ChatML, Hermes/Qwen-style tool calls) where a template has none."""

from __future__ import annotations

import json
from typing import Any

from engine.config import EngineInputError

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object within <tool_call></tool_call> tags."
)


def _tool_call_json(call: dict[str, Any]) -> str:
    """An OpenAI-style tool call as the Hermes/Qwen ``{"name": ..., "arguments": {...}}`` object."""
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)


def flatten_tool_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """Our documented tool format as plain (role, content) turns any ChatML template can render.

    Tool definitions go into the system turn (one JSON object per line inside ``<tools>``), an
    assistant's tool calls become ``<tool_call>`` blocks after its text, and a tool response becomes a
    user turn holding a ``<tool_response>`` block (Hermes / Qwen2.5 style).
    """
    msgs = [dict(m) for m in messages]
    out: list[dict[str, str]] = []
    if tools:
        system = ""
        if msgs and msgs[0].get("role") == "system":
            system = msgs.pop(0).get("content") or ""
        tool_text = "\n".join(json.dumps(t, sort_keys=True, ensure_ascii=False) for t in tools)
        out.append({"role": "system", "content": (system + "\n\n" if system else "")
                    + TOOLS_PREAMBLE.format(tools=tool_text)})
    for m in msgs:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "".join("<tool_call>\n" + _tool_call_json(c) + "\n</tool_call>" for c in m["tool_calls"])
            content = (content + "\n" if content else "") + calls
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    return out


def render_chatml(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  add_generation_prompt: bool) -> str:
    """ChatML with tool definitions in the system turn and <tool_call> blocks (Hermes/Qwen style)."""
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in flatten_tool_messages(messages, tools)]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


class ChatTemplate:
    """A jinja2 chat template, compiled on first use in a sandbox, with transformers' helpers
    (``raise_exception``, ``tojson``). ``where`` names its source in errors; ``chatml`` says whether the
    vocabulary has ChatML's tokens, the fallback when there is no template."""

    def __init__(self, source: str | None, where: str, chatml: bool) -> None:
        self.source, self.where, self.chatml = source or None, where, chatml
        self._compiled: tuple[Any, bool] | None = None

    def _template(self) -> tuple[Any, bool]:
        if self._compiled is None:
            from jinja2 import meta as jinja_meta
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            def tojson(x: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
                return json.dumps(x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            try:
                handles_tools = "tools" in jinja_meta.find_undeclared_variables(env.parse(self.source))
                self._compiled = (env.from_string(self.source), handles_tools)
            except TemplateError as exc:
                raise EngineInputError(f"{self.where} does not compile: {exc}") from None
        return self._compiled

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, bos_token: str = "", eos_token: str = "") -> str:
        """The template rendered (sandboxed jinja2, as transformers' ``apply_chat_template``).

        A template that does not handle tools (SmolLM2's does not) gets our documented tool format
        instead (``flatten_tool_messages``: tool definitions in the system turn, ``<tool_call>``
        blocks, tool responses as ``<tool_response>`` user turns), still rendered by its own template.
        Without a template, ChatML is used if the vocabulary has its tokens.
        """
        msgs, tools = list(messages), list(tools) if tools else None
        if self.source is None:
            if not self.chatml:
                raise EngineInputError(f"no chat template ({self.where} is missing) and the vocabulary has no "
                                       "ChatML tokens; give plain-text prompts")
            return render_chatml(msgs, tools, add_generation_prompt)
        from jinja2.exceptions import TemplateError

        template, handles_tools = self._template()
        uses_tools = tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in msgs)
        if uses_tools and not handles_tools:
            msgs, tools = flatten_tool_messages(msgs, tools), None
        try:
            return template.render(messages=msgs, tools=tools, add_generation_prompt=add_generation_prompt,
                                   bos_token=bos_token, eos_token=eos_token)
        except TemplateError as exc:
            raise EngineInputError(f"{self.where} failed: {exc}") from None
