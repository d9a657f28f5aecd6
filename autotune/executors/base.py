"""The seam between search and execution: jobs go out, records come back.

The driver asks the study for a trial, turns it into a :class:`~autotune.worker.Job`, submits it,
and tells the study what came back. An executor only moves jobs to warm workers and records back;
it never touches the Optuna storage or MLflow. The local executor runs one in-process worker;
a Ray executor (one warm actor per GPU) will implement the same four methods.
"""

from __future__ import annotations

import abc
from typing import Any

from autotune.worker import Job, PassCallback, Record


class Executor(abc.ABC):
    """Contract:

    - :meth:`start` loads the model pair on every worker (heavy, once) and returns worker ids;
    - :meth:`free_slots` says how many more jobs can be submitted before :meth:`wait` must be called;
    - :meth:`submit` hands over a job; ``on_first_pass`` (pruning) may be ignored by executors that
      cannot call back into the driver mid-job, which then simply never prune;
    - :meth:`wait` blocks until at least one submitted job finished and returns its records, in any
      order. A ``KeyboardInterrupt`` propagates to the driver, which fails the running trials;
    - :meth:`close` releases workers (idempotent).
    """

    @abc.abstractmethod
    def start(self) -> list[str]: ...

    @abc.abstractmethod
    def free_slots(self) -> int: ...

    @abc.abstractmethod
    def submit(self, job: Job, on_first_pass: PassCallback | None = None) -> None: ...

    @abc.abstractmethod
    def wait(self) -> list[Record]: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def describe(self) -> dict[str, Any]:
        """Device facts for provenance (device, dtype, worker ids)."""
        return {}

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
