"""Committed token ids in, text out, piece by piece: what the server streams and what
`python -m engine generate --stream` prints, one code path for both (so a streamed answer and a
whole one are the same text)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextStream:
    """Committed token ids in, text deltas out.

    A delta never ends inside a multi-byte character (the decoder's U+FFFD for an incomplete
    sequence is held back until the next token completes or replaces it) nor inside what could be
    the start of a stop string. Stop tokens are not part of the text; a stop string ends the text
    where it begins. The deltas concatenate to ``text``.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop_ids: Sequence[int], stops: Sequence[str]) -> None:
        self._decode, self._stop_ids, self._stops = decode, set(stop_ids), list(stops)
        self._ids: list[int] = []
        self.n_tokens = 0  # every committed token, a stop token included
        self.text = ""  # what has been handed out
        self.stopped_by: str | None = None  # "token" or "string"

    def push(self, ids: Sequence[int]) -> str:
        if self.stopped_by:
            return ""
        for t in ids:
            self.n_tokens += 1
            if t in self._stop_ids:
                self.stopped_by = "token"
                break
            self._ids.append(t)
        full = self._decode(self._ids)
        cut = min((i for i in (full.find(s, len(self.text)) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped_by = "string"
            return self._emit(full[:cut])
        if self.stopped_by:
            return self._emit(full)
        end = len(full.rstrip("\ufffd"))
        end -= self._partial_stop(full[:end])
        return self._emit(full[:end])

    def finish(self) -> str:
        """The rest, once generation is over (a trailing U+FFFD is then really an invalid byte)."""
        if self.stopped_by == "string":
            return ""
        return self._emit(self._decode(self._ids))

    def _partial_stop(self, text: str) -> int:
        """Length of the longest tail of ``text`` (not yet handed out) that begins a stop string."""
        start = len(self.text)
        for n in range(min(len(text) - start, max((len(s) for s in self._stops), default=1) - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0

    def _emit(self, upto: str) -> str:
        if len(upto) <= len(self.text) or not upto.startswith(self.text):
            return ""
        delta = upto[len(self.text):]
        self.text = upto
        return delta
