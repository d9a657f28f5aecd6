"""Ctrl-C at safe points: at once while a worker measures, held while the driver writes the
storage or MLflow (an interrupt inside a SQLite transaction would leave the database locked for the
clean-up that fails the running trial). Ctrl-C ends a sweep cleanly with exit 130."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class CtrlC:
    """Ctrl-C arrives at a safe point.

    While a worker measures, Ctrl-C interrupts at once (stopping torch mid-generation is harmless).
    While the driver talks to the storage or MLflow, it is held until the next checkpoint: an
    interrupt inside a SQLite transaction would leave the database locked for the clean-up that
    fails the running trial.
    """

    def __init__(self) -> None:
        self.pending = False
        self.immediate = False
        self._previous: Any = None

    def _handler(self, signum: int, frame: Any) -> None:
        self.pending = True
        if self.immediate:
            # also pending: raised inside a finalizer (a garbage-collection callback, which the engine's
            # memory release runs between configs) Python prints and drops it; the next checkpoint
            # then still ends the sweep
            raise KeyboardInterrupt

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def checkpoint(self) -> None:
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Storage work in the middle of a measurement (the pruning report): hold Ctrl-C, then deliver it."""
        was = self.immediate
        self.immediate = False
        try:
            yield
        finally:
            self.immediate = was
            if was:
                self.checkpoint()

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        self.checkpoint()
        self.immediate = True
        try:
            yield
        finally:
            self.immediate = False
