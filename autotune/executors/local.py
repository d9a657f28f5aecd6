"""The embedded default: one in-process worker that keeps its loaded model pair across trials."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from autotune.executors.base import Executor
from autotune.record import Job, Record
from autotune.worker import PassCallback, Worker


class LocalExecutor(Executor):
    """Runs each job synchronously inside :meth:`wait`, one at a time.

    ``worker_factory`` builds the worker on :meth:`start` (so a bad model fails there, not at
    construction); tests pass one that builds a test double of the worker.
    """

    def __init__(self, worker_factory: Callable[[], Worker]) -> None:
        self._factory = worker_factory
        self._worker: Worker | None = None
        self._pending: list[tuple[Job, PassCallback | None]] = []

    @classmethod
    def for_model(cls, target: str, draft: str, device: str, dtype: str, workloads: Sequence[Any],
                  fixed: dict[str, Any], *, weights: str = "dequantized") -> LocalExecutor:
        return cls(lambda: Worker.load(target, draft, device, dtype, workloads, fixed, weights=weights))

    @property
    def worker(self) -> Worker:
        if self._worker is None:
            raise RuntimeError("LocalExecutor.start() must run before jobs are submitted")
        return self._worker

    def start(self) -> list[str]:
        if self._worker is None:
            self._worker = self._factory()
        return [self._worker.id]

    def free_slots(self) -> int:
        return 0 if self._pending else 1

    def idle_workers(self) -> list[str]:
        return [] if self._pending or self._worker is None else [self._worker.id]

    def submit(self, job: Job, on_first_pass: PassCallback | None = None, worker: str | None = None) -> None:
        if self._pending:
            raise RuntimeError("the local executor runs one job at a time; call wait() first")
        self._pending.append((job, on_first_pass))

    def wait(self) -> list[Record]:
        if not self._pending:
            return []
        job, callback = self._pending[0]
        record = self.worker.measure(job, callback, self.on_progress)
        self._pending.clear()  # only once measured: an interrupt leaves the job visible as running
        return [record]

    def close(self) -> None:
        self._pending.clear()
        self._worker = None

    def environment(self, worker: str) -> dict[str, Any]:
        return self._worker.environment() if self._worker is not None and self._worker.id == worker else {}

    def describe(self) -> dict[str, Any]:
        if self._worker is None:
            return {}
        return {"device": self._worker.pair.device, "dtype": self._worker.pair.dtype, "workers": [self._worker.id],
                **self._worker.limits()}
