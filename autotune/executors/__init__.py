"""Executors move measurement jobs to warm workers: ``local`` (in-process, the default) and
``ray`` (one warm actor per GPU, or N CPU actors; :mod:`autotune.executors.ray_executor`, which
imports Ray only when used)."""

from autotune.executors.base import Executor
from autotune.executors.local import LocalExecutor

__all__ = ["Executor", "LocalExecutor"]
