"""The one error type users see from autotune: bad input at the edge."""

from __future__ import annotations

from typing import Any

_MISSING = object()
PREVIEW_CHARS = 200  # of a value quoted in a message: whatever a file holds, messages stay small


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= PREVIEW_CHARS else f"{text[:PREVIEW_CHARS]}... ({len(text):,} characters)"


class InputError(ValueError):
    """A user input (YAML file, CLI flag, storage URL) is wrong.

    The message names where (file and key, or flag), the rule that was broken and the value that
    broke it, so a person can fix it without reading code. The CLI turns it into exit status 2.
    """

    def __init__(self, where: str, key: str | None, rule: str, value: Any = _MISSING) -> None:
        self.where = where
        self.key = key
        self.rule = rule
        self.value = value
        location = f"{where}: {key}" if key else where
        got = "" if value is _MISSING else f", but got {_preview(value)}"
        super().__init__(f"{location}: {rule}{got}")

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles with its fields (one raised in a Ray actor reaches the driver as itself)."""
        args = (self.where, self.key, self.rule) if self.value is _MISSING else (self.where, self.key, self.rule,
                                                                                  self.value)
        return (type(self), args)
