"""Tool-call grammars: what a constrained generation may emit, compiled once per tool set.

The grammar of a prompt with tools is one or more Hermes-style tool-call blocks, then a stop token::

    <tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>

where NAME is one of the tools' names and ``arguments`` follows that tool's JSON schema (its
declared properties only; compact JSON with ``", "`` / ``": "`` separators, as our chat template
renders tool calls). A prompt without tools has no grammar: it is decoded unconstrained.

The library is xgrammar (EBNF compiled against our vocabulary with its adaptive token-mask cache,
``GrammarMatcher`` with unlimited ``rollback``): benchmarks/grammar_libs.py measured it against
llguidance and outlines-core, and benchmarks/RESULTS.md says why it was picked.

A ``GrammarState`` is one matcher: ``fill(bits, row)`` writes the next-token bitmask (int32 words,
bit ``t % 32`` of word ``t // 32``), ``advance(t)`` consumes a token, ``rollback(n)`` undoes the last
``n``. ``mask_logits`` applies bitmask rows to logits rows (disallowed -> -inf) on any device, so
greedy argmax and position-keyed Gumbel sampling pick among allowed tokens exactly as AR decoding
under the same grammar does: if the unconstrained pick is allowed, the constrained pick is the same
token (the placements rely on this).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from engine.config import EngineInputError

CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"


# --- vocabulary ----------------------------------------------------------------------------------


def vocab_bytes(tokenizer: Any) -> list[bytes | None]:
    """Each token's bytes; ``None`` for special tokens (control tokens never match grammar text).

    GGUF byte-level BPE tokens are spelled in GPT-2's byte -> unicode map; the byte tokenizer of
    the tiny presets is bytes 0..255 plus specials.
    """
    from engine.data.tokenizer import ByteTokenizer, GGUFTokenizer, _byte_tables

    if isinstance(tokenizer, ByteTokenizer):
        return [bytes([i]) if i < 256 else None for i in range(tokenizer.vocab_size)]
    if isinstance(tokenizer, GGUFTokenizer):
        _, dec = _byte_tables()
        special = set(tokenizer.special_ids.values())
        return [None if i in special else bytes(dec[c] for c in t if c in dec)
                for i, t in enumerate(tokenizer.tokens)]
    raise EngineInputError(f"grammars need a ByteTokenizer or GGUFTokenizer vocabulary, got {type(tokenizer).__name__}")


# --- schemas -------------------------------------------------------------------------------------


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function", tool)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise EngineInputError(f"a tool needs a function name, got {json.dumps(tool)[:200]}")
    return fn


def arguments_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The tool's parameters schema, closed to its declared properties (as strict tool calling is)."""
    params = copy.deepcopy(_function(tool).get("parameters") or {"type": "object", "properties": {}})
    if params.get("type") == "object":
        params.setdefault("additionalProperties", False)
        params.setdefault("properties", {})
    return params


def call_schema(tools: Any) -> dict[str, Any]:
    """JSON schema of one call object: ``{"name": one tool's name, "arguments": that tool's args}``."""
    alts = []
    for t in tools:
        fn = _function(t)
        alts.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                     "properties": {"name": {"const": fn["name"]}, "arguments": arguments_schema(t)}})
    if not alts:
        raise EngineInputError("a tool-call grammar needs at least one tool")
    return alts[0] if len(alts) == 1 else {"anyOf": alts}


def example_call(tool: dict[str, Any]) -> dict[str, Any]:
    """A schema-valid call of ``tool`` (its required arguments with simple values), for tests and benches."""
    def value(s: dict[str, Any]) -> Any:
        if "enum" in s and s["enum"]:
            return s["enum"][0]
        if "const" in s:
            return s["const"]
        kind = s.get("type")
        kind = kind[0] if isinstance(kind, list) else kind
        if kind == "object":
            props = s.get("properties", {})
            return {k: value(props.get(k, {})) for k in s.get("required", []) if k in props}
        return {"string": "a", "integer": 1, "number": 1.5, "boolean": True, "array": [],
                "null": None}.get(kind, "a")

    fn = _function(tool)
    return {"name": fn["name"], "arguments": value(arguments_schema(tool))}


def parse_tool_calls(text: str) -> list[dict[str, Any]]:
    """The complete ``<tool_call>`` blocks of a generated text, JSON-decoded (ValueError if one is not JSON)."""
    calls, pos = [], 0
    while True:
        i = text.find(CALL_OPEN, pos)
        if i < 0:
            return calls
        j = text.find(CALL_CLOSE, i + len(CALL_OPEN))
        if j < 0:
            return calls
        calls.append(json.loads(text[i + len(CALL_OPEN) : j]))
        pos = j + len(CALL_CLOSE)


# --- compiled grammar and matcher state ---------------------------------------------------------


class GrammarVocab:
    """xgrammar's view of our vocabulary (token bytes, stop tokens) and a compiler; one per pair."""

    def __init__(self, tokenizer: Any, stop_ids: tuple[int, ...]) -> None:
        import xgrammar as xgr

        if not stop_ids:
            raise EngineInputError("a constrained generation needs a stop token, but the tokenizer has none")
        toks = vocab_bytes(tokenizer)
        self.size = len(toks)
        self.words = (self.size + 31) // 32
        self.stop_ids = tuple(stop_ids)
        # special tokens other than the stops: refused before xgrammar sees them (it logs each one)
        self.special = frozenset(i for i, b in enumerate(toks) if b is None and i not in stop_ids)
        # RAW bytes; an empty entry is a special token, which grammar text never matches
        info = xgr.TokenizerInfo([b if b is not None else b"" for b in toks], xgr.VocabType.RAW,
                                 vocab_size=self.size, stop_token_ids=list(stop_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)


@dataclass(frozen=True)
class CompiledGrammar:
    """A tool-call grammar compiled for one vocabulary; ``state()`` starts a fresh matcher (cheap)."""

    compiled: Any = field(repr=False)  # xgrammar.CompiledGrammar
    vocab: GrammarVocab = field(repr=False)
    tools: tuple[str, ...] = ()  # tool names, for messages and reports

    def state(self) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(self.compiled), self.vocab.words, self.vocab.special)


def tool_call_ebnf(tools: Any) -> str:
    """The EBNF (xgrammar dialect) of one or more tool-call blocks, each call following its schema."""
    import xgrammar as xgr

    call = str(xgr.Grammar.from_json_schema(json.dumps(call_schema(tools)), any_whitespace=False,
                                            separators=(", ", ": ")))
    if "root ::=" not in call:
        raise EngineInputError("xgrammar produced no root rule for the tool-call schema")
    # the schema's root becomes rule `call`; nothing else refers to `root` in a generated grammar
    # (a schema recursing to its root would, and is not a tool schema)
    call = call.replace("root ::=", "tool_call_json ::=", 1)
    block = f"{json.dumps(CALL_OPEN)} tool_call_json {json.dumps(CALL_CLOSE)}"
    return f'root ::= ({block} "\\n"?)+\n{call}\n'


def compile_tool_grammar(vocab: GrammarVocab, tools: Any) -> CompiledGrammar:
    """The tool-call grammar of ``tools`` (OpenAI tool objects), compiled and checked here."""
    tools = list(tools)
    names = tuple(_function(t)["name"] for t in tools)
    try:
        compiled = vocab.compiler.compile_grammar(tool_call_ebnf(tools))
    except (RuntimeError, ValueError) as exc:
        raise EngineInputError(f"the tool-call grammar for tools {list(names)} does not compile: {exc}") from None
    return CompiledGrammar(compiled, vocab, names)


class GrammarState:
    """One matcher: the grammar advanced along a token sequence."""

    def __init__(self, matcher: Any, words: int, special: frozenset[int] = frozenset()) -> None:
        self.m = matcher
        self.words = words
        self.special = special

    def fill(self, bits: Tensor, row: int = 0) -> None:
        """Write the next-token bitmask into ``bits[row]`` (host int32 [R, words])."""
        self.m.fill_next_token_bitmask(bits, row)

    def advance(self, token: int) -> bool:
        """Consume ``token``; False (state unchanged) if the grammar does not allow it here."""
        token = int(token)
        return token not in self.special and self.m.accept_token(token)

    def rollback(self, n: int) -> None:
        if n:
            self.m.rollback(n)

    @property
    def done(self) -> bool:
        """The grammar accepted its stop token: nothing more may follow, the generation ends."""
        return self.m.is_terminated()


def new_bitmask(rows: int, words: int) -> Tensor:
    """Host int32 [rows, words], every token allowed (-1 = all bits set)."""
    return torch.full((rows, words), -1, dtype=torch.int32)


_SHIFT: dict[torch.device, Tensor] = {}


def mask_logits(logits: Tensor, bits: Tensor) -> Tensor:
    """logits [T, V] with tokens not allowed by ``bits`` [T, words] set to -inf (a new tensor)."""
    dev = logits.device
    shift = _SHIFT.get(dev)
    if shift is None:
        shift = _SHIFT[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    b = bits.to(dev, non_blocking=True)
    allowed = ((b[:, :, None] >> shift) & 1).bool().flatten(1)[:, : logits.shape[-1]]
    return logits.masked_fill(~allowed, float("-inf"))
