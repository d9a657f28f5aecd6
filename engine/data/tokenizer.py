"""Tokenizers: the byte-level one of the tiny presets, and the common interface the engine uses."""

from __future__ import annotations

import functools
import re
import unicodedata
from pathlib import Path
from typing import Any, Protocol

from engine.config import EngineInputError
from engine.data.chat_template import ChatTemplate, render_chatml


class Tokenizer(Protocol):
    vocab_size: int
    stop_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> str: ...


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


FALLBACK_STOPS = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>")  # end-of-turn tokens of common vocabularies
MAX_TOKENIZER_CONFIG_BYTES = 16 << 20  # a tokenizer_config.json listing a large vocabulary's added tokens


class JsonTokenizer:
    """An HF folder's tokenizer: ``tokenizer.json`` read with the `tokenizers` package, and the chat
    template and end-of-turn tokens the folder declares, as transformers reads them:
    ``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template`` (its ``default`` entry when
    it lists named templates), ``tokenizer_config.json``'s ``eos_token`` / ``bos_token``, and the
    ``eos_token_id`` (one or a list) of ``generation_config.json`` and ``config.json``. Generation stops
    at every one of those and at the common end-of-turn tokens the vocabulary has (``FALLBACK_STOPS``).
    Without a chat template, chats render as ChatML when the vocabulary has its tokens."""

    def __init__(self, path, eos_tokens: tuple[str, ...] = FALLBACK_STOPS) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        path = Path(path)
        self._tok = _HFTokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        folder = path.parent
        config = _json_file(folder / "tokenizer_config.json")
        self.bos_token, self.eos_token = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        stop_ids = [i for name in ("generation_config.json", "config.json")
                    for i in _ids(_json_file(folder / name).get("eos_token_id"), folder / name)]
        stop_ids += [self._tok.token_to_id(t) for t in (self.eos_token, *eos_tokens) if t]
        self.stop_ids = tuple(dict.fromkeys(i for i in stop_ids if i is not None and 0 <= i < self.vocab_size))
        # the draft's mask token, as a GGUF vocabulary offers it (GGUFTokenizer): the first candidate
        # the vocabulary holds, else None (then train-draft asks for --mask-token-id)
        self.mask_id = next((i for i in map(self._tok.token_to_id, MASK_CANDIDATES) if i is not None), None)
        source, where = _hf_chat_template(folder, config)
        self.chat_template = source
        self._template = ChatTemplate(source, where, self._tok.token_to_id("<|im_start|>") is not None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def render_chat(self, messages, tools=None, add_generation_prompt=True) -> str:
        return self._template.render(messages, tools, add_generation_prompt, bos_token=self.bos_token or "",
                                     eos_token=self.eos_token or "")


def _json_file(path: Path) -> dict[str, Any]:
    """A folder's JSON side file as a mapping ({} when the folder has none); a bad one is refused by name."""
    if not path.is_file():
        return {}
    from engine.files import FileRefused, parse_json, read_text

    data = parse_json(read_text(path, str(path), max_bytes=MAX_TOKENIZER_CONFIG_BYTES), str(path))
    if not isinstance(data, dict):
        raise FileRefused(str(path), f"expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    """``eos_token`` / ``bos_token`` as tokenizer_config.json writes them: a string, or an AddedToken
    object whose ``content`` is the string."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _ids(value: Any, path: Path) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise EngineInputError(f"{path}: eos_token_id must be a token id or a list of them, but got {value!r}"[:300])
    return values


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> tuple[str | None, str]:
    """(template source or None, where it came from): ``chat_template.jinja`` first, as transformers
    reads it, else tokenizer_config.json's ``chat_template`` (a string, or named templates: the
    ``default`` one)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        from engine.files import read_text

        return read_text(jinja, str(jinja), max_bytes=MAX_TOKENIZER_CONFIG_BYTES), str(jinja)
    where = f"{folder / 'tokenizer_config.json'} chat_template"
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named:
            raise EngineInputError(f"{where}: lists templates {sorted(map(str, named))} but none named 'default'")
        value, where = named["default"], where + "['default']"
    if value is not None and not isinstance(value, str):
        raise EngineInputError(f"{where} must be a string or a list of named templates, but got "
                               f"{type(value).__name__}")
    return value, where


def tokenizer_from_folder(folder) -> JsonTokenizer | None:
    """The folder's tokenizer.json, or None (then prompts must be given as token ids)."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return JsonTokenizer(path)
    except ImportError:
        return None


# --- GGUF byte-level BPE tokenizer ---------------------------------------------------------------

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types matched as whole strings before BPE
_WHITE_SPACE = "\\t\\n\\x0b\\x0c\\r \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000"


@functools.cache
def _unicode_class(major: str) -> str:
    """The body of a regex class for a Unicode major category (L = letters, N = numbers), as ranges."""
    out, start, prev = [], None, None
    for cp in range(0x110000):
        if unicodedata.category(chr(cp))[0] == major:
            if start is None:
                start = cp
            elif cp != prev + 1:
                out.append((start, prev))
                start = cp
            prev = cp
    out.append((start, prev))
    esc = lambda c: f"\\U{c:08x}"  # noqa: E731
    return "".join(esc(a) if a == b else f"{esc(a)}-{esc(b)}" for a, b in out)


@functools.cache
def _pre_regexes(pre: str) -> tuple[re.Pattern, ...]:
    """llama.cpp's pre-tokenizer regexes (llama-vocab.cpp) in Python `re` syntax, exact \\p{L} / \\p{N}.

    The regexes of a sequence apply one after another, each splitting the pieces of the one before.
    """
    L, N, S = _unicode_class("L"), _unicode_class("N"), _WHITE_SPACE
    gpt2 = (rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^{S}{L}{N}]+|[{S}]+(?![^{S}])|[{S}]+")
    llama3 = (rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n{L}{N}]?[{L}]+|[{N}]{{1,3}}| ?[^{S}{L}{N}]+[\r\n]*"
              rf"|[{S}]*[\r\n]+|[{S}]+(?![^{S}])|[{S}]+")
    for names, exprs in PRE_TOKENIZERS:
        if pre in names:
            qwen2 = llama3.replace(f"[{N}]{{1,3}}", f"[{N}]")
            table = {"gpt2": gpt2, "digits": rf"[{N}]", "llama3": llama3, "qwen2": qwen2}
            if "qwen35" in exprs:  # Qwen3.5's: qwen2's with combining marks (M) kept in words, not punctuation
                M = _unicode_class("M")
                table["qwen35"] = qwen2.replace(f"?[{L}]+", f"?[{L}{M}]+").replace(f"[^{S}{L}{N}]", f"[^{S}{L}{M}{N}]")
            return tuple(re.compile(table[e]) for e in exprs)
    known = sorted(n for names, _ in PRE_TOKENIZERS for n in names)
    raise EngineInputError(f"GGUF tokenizer.ggml.pre = {pre!r} is not supported; supported: {known}")


# tokenizer.ggml.pre names -> regex sequence, as llama.cpp's llm_tokenizer_bpe assigns them.
PRE_TOKENIZERS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("gpt2", "gpt-2", "mpt", "olmo", "jais"), ("gpt2",)),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), ("digits", "gpt2")),
    (("llama3", "llama-bpe", "llama-v3", "dbrx", "smaug-bpe"), ("llama3",)),
    (("qwen2", "stablelm2", "deepseek-r1-qwen"), ("qwen2",)),
    (("qwen35",), ("qwen35",)),
)


@functools.cache
def _byte_tables() -> tuple[dict[int, str], dict[str, int]]:
    """GPT-2's reversible byte <-> printable-unicode map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    enc = {b: chr(c) for b, c in zip(bs, cs, strict=True)}
    return enc, {c: b for b, c in enc.items()}


# Spare tokens a DFlash draft may use as its mask token, best first. SmolLM2 has no reserved or
# unused token; its StarCoder-heritage Jupyter control token <empty_output> never occurs in chat,
# agent or code traffic rendered with ChatML, and is neither a stop nor a chat-template token.
MASK_CANDIDATES = ("<|mask|>", "<mask>", "<|MASK|>", "<|fim_pad|>", "<empty_output>")


class GGUFTokenizer:
    """Byte-level BPE (``tokenizer.ggml.model == "gpt2"``) and the chat template of a GGUF file."""

    def __init__(self, tokens: list[str], token_types: list[int], merges: list[str], pre: str,
                 eos_id: int | None, bos_id: int | None = None, pad_id: int | None = None,
                 chat_template: str | None = None, where: str = "GGUF") -> None:
        self.tokens = list(tokens)
        self.vocab_size = len(self.tokens)
        self.vocab = {t: i for i, t in reversed(list(enumerate(self.tokens)))}
        self.ranks: dict[tuple[str, str], int] = {}
        for rank, m in enumerate(merges):
            a, sep, b = m.partition(" ")
            if not sep:
                raise EngineInputError(f"{where}: tokenizer.ggml.merges[{rank}] = {m!r} is not 'left right'")
            self.ranks.setdefault((a, b), rank)
        types = list(token_types) if token_types else [1] * self.vocab_size
        self.special_ids = {t: i for i, (t, ty) in enumerate(zip(self.tokens, types, strict=False))
                            if ty in (_CONTROL, _USER_DEFINED)}
        self._special_names = {i: t for t, i in self.special_ids.items()}
        specials = sorted(self.special_ids, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None
        self.pre = pre
        self._regexes = _pre_regexes(pre)
        self._enc, self._dec = _byte_tables()
        if sum(c in self.vocab for c in self._enc.values()) < 128:
            raise EngineInputError(f"{where}: the vocabulary lacks most of the 256 byte symbols; "
                                   f"not a byte-level BPE vocabulary")
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        stops = [eos_id] + [self.special_ids.get(t) for t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")]
        self.stop_ids = tuple(dict.fromkeys(i for i in stops if i is not None))
        self.mask_id = next((self.special_ids[t] for t in MASK_CANDIDATES if t in self.special_ids), None)
        self.chat_template = chat_template
        self._template = ChatTemplate(chat_template, "GGUF tokenizer.chat_template", "<|im_start|>" in self.special_ids)
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def from_metadata(cls, meta: dict) -> GGUFTokenizer:
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise EngineInputError(f"GGUF tokenizer.ggml.model = {model!r} is not supported (only 'gpt2' BPE)")
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            if not isinstance(meta.get(key), (list, tuple)):
                raise EngineInputError(f"GGUF metadata key {key!r} is missing or not a list")
        return cls(meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or [],
                   meta["tokenizer.ggml.merges"], str(meta.get("tokenizer.ggml.pre", "gpt2")),
                   eos_id=meta.get("tokenizer.ggml.eos_token_id"), bos_id=meta.get("tokenizer.ggml.bos_token_id"),
                   pad_id=meta.get("tokenizer.ggml.padding_token_id"),
                   chat_template=meta.get("tokenizer.chat_template"),
                   where=f"GGUF {meta.get('general.name') or ''}".rstrip())

    # --- text <-> ids ---

    def pretokenize(self, text: str) -> list[str]:
        pieces = [text]
        for rx in self._regexes:
            nxt = []
            for p in pieces:
                pos = 0
                for m in rx.finditer(p):  # text between matches stays a piece (llama.cpp's unicode_regex_split)
                    if m.start() > pos:
                        nxt.append(p[pos:m.start()])
                    if m.end() > m.start():
                        nxt.append(m.group())
                    pos = m.end()
                if pos < len(p):
                    nxt.append(p[pos:])
            pieces = nxt
        return pieces

    def _bpe(self, word: str) -> list[int]:
        ids = self._cache.get(word)
        if ids is not None:
            return ids
        syms = [self._enc[b] for b in word.encode("utf-8")]
        ranks = self.ranks
        while len(syms) > 1:
            best, best_rank = -1, None
            for i in range(len(syms) - 1):
                r = ranks.get((syms[i], syms[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best < 0:
                break
            a, b = syms[best], syms[best + 1]
            merged, i = syms[:best], best
            while i < len(syms):
                if i + 1 < len(syms) and syms[i] == a and syms[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(syms[i])
                    i += 1
            syms = merged
        vocab = self.vocab  # a byte missing from the vocabulary is dropped, as transformers and llama.cpp do
        ids = [vocab[s] for s in syms if s in vocab]
        if len(self._cache) >= 200_000:
            self._cache.clear()
        self._cache[word] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        """Special tokens (control / user-defined) match as whole strings; the rest is BPE'd. No BOS."""
        ids: list[int] = []
        chunks = self._special_re.split(text) if self._special_re else [text]
        for k, chunk in enumerate(chunks):
            if k % 2:
                ids.append(self.special_ids[chunk])
            elif chunk:
                for piece in self.pretokenize(chunk):
                    ids.extend(self._bpe(piece))
        return ids

    def decode(self, ids: list[int]) -> str:
        out, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            name = self._special_names.get(i)
            if name is not None:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                out.append(name)
            else:
                buf.extend(self._dec[c] for c in self.tokens[i] if c in self._dec)
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    # --- chat template ---

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> str:
        """The GGUF's own chat template (``tokenizer.chat_template``), rendered as transformers renders
        it; without one, ChatML if the vocabulary has its tokens (``ChatTemplate.render``)."""
        names = self._special_names
        return self._template.render(messages, tools, add_generation_prompt, bos_token=names.get(self.bos_id, ""),
                                     eos_token=names.get(self.eos_id, ""))


def read_gguf_metadata(path: Path, prefixes: tuple[str, ...] = ("tokenizer.", "general.")) -> dict[str, Any]:
    """The GGUF's metadata keys starting with ``prefixes`` (no tensors read), as plain data."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return {f.name: f.contents() for f in reader.fields.values() if f.name.startswith(prefixes)}


def tokenizer_from_gguf_metadata(meta: dict) -> GGUFTokenizer | None:
    """The GGUF's own tokenizer and chat template, or None if it carries no tokenizer."""
    if "tokenizer.ggml.tokens" not in meta:
        return None
    return GGUFTokenizer.from_metadata(meta)
