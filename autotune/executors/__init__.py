"""Executors move measurement jobs to warm workers: ``local`` (in-process, the default) and,
in a later version, ``ray`` (one warm actor per GPU)."""

from autotune.executors.base import Executor
from autotune.executors.local import LocalExecutor

__all__ = ["Executor", "LocalExecutor"]
