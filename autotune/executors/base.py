"""The seam between search and execution: jobs go out, records come back.

The driver asks the study for a trial, turns it into a :class:`~autotune.record.Job`, submits it,
and tells the study what came back. An executor only moves jobs to warm workers and records back;
it never touches the Optuna storage or MLflow. The local executor runs one in-process worker;
the Ray executor (one warm actor per GPU, or N CPU actors) implements the same methods.
"""

from __future__ import annotations

import abc
from typing import Any

from autotune.record import Job, Record
from autotune.worker import PassCallback, ProgressCallback


class Executor(abc.ABC):
    """Contract:

    - :meth:`start` loads the model pair on every worker (heavy, once) and returns worker ids;
    - :meth:`free_slots` says how many more jobs can be submitted before :meth:`wait` must be called;
    - :meth:`idle_workers` names the workers that can take a job now (the driver plans per worker:
      each worker measures its own AR baseline, or reuses one measured under the same identity,
      :meth:`environment` included);
    - :meth:`submit` hands over a job, to ``worker`` when given (one of :meth:`idle_workers`), else to
      any idle worker; ``on_first_pass`` (pruning) may be ignored by executors that cannot call back
      into the driver mid-job, which then simply never prune;
    - :meth:`wait` blocks until at least one submitted job finished and returns its records, in any
      order. It may return an empty list when a worker became idle without a record (a restarted
      worker is ready again). A job whose worker died or timed out comes back as a failed record
      (``interrupted`` set when the params deserve one retry). A ``KeyboardInterrupt`` propagates to
      the driver, which fails the running trials;
    - :meth:`close` releases workers (idempotent);
    - :attr:`on_progress`, when the driver sets it, is told where a running job is (the pass and the
      prompt); executors whose workers cannot call back mid-job leave it untold.
    """

    on_progress: ProgressCallback | None = None

    @abc.abstractmethod
    def start(self) -> list[str]: ...

    @abc.abstractmethod
    def free_slots(self) -> int: ...

    def idle_workers(self) -> list[str]:
        """Workers free for a job now; executors with several workers override this."""
        return list(self.describe().get("workers", []))[:1] if self.free_slots() else []

    @abc.abstractmethod
    def submit(self, job: Job, on_first_pass: PassCallback | None = None, worker: str | None = None) -> None: ...

    @abc.abstractmethod
    def wait(self) -> list[Record]: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def describe(self) -> dict[str, Any]:
        """Device facts for provenance (device, dtype, worker ids) and the loaded worker's
        :meth:`~autotune.worker.Worker.limits` (context, longest prompt, recurrent state, tools, weights)."""
        return {}

    def environment(self, worker: str) -> dict[str, Any]:
        """:meth:`autotune.worker.Worker.environment` of ``worker``: part of an AR baseline's identity.
        Empty when unknown; then no baseline is reused for that worker (it measures its own)."""
        return {}

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
