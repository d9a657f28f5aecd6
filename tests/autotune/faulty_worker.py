"""A test double of :class:`autotune.worker.Worker` that misbehaves on purpose.

``FaultyWorker(..., faults={trial_number: kind})`` makes the job of that trial misbehave the way
bad configs do, before anything is measured (confirmation re-measurements are left alone):

- ``crash``: the worker process dies at once (``os._exit``), like a segfault or the kernel OOM killer;
- ``hang``: the job never returns (only a per-trial timeout gets the worker back);
- ``oom``: the engine raises ``torch.OutOfMemoryError``: the trial fails, the worker goes on;
- ``device``: a CUDA-style error that leaves the device unusable: the trial fails with the reason
  and the record says ``device_unusable`` so the executor restarts the worker.

``slow=(fields, seconds)`` makes every measured pass of a config whose fields include ``fields``
really slower: each target forward sleeps ``seconds`` first, so the engine's own clock measures it
(a slow implementation path without waiting for one on a CPU).

``output_hook(config, outputs) -> outputs`` rewrites a config's outputs of every measured pass
before the exactness check (an inexact config without a broken engine).

In process, pass it to ``LocalExecutor`` through a factory. On Ray actors, name it in the spec:
``WorkerSpec(..., worker=SPEC_NAME, worker_kwargs={"faults": {...}})``; the actors import this
module as ``faulty_worker``, so their ``PYTHONPATH`` must hold this folder
(``tests/autotune/test_ray_executor.py`` starts its cluster that way). An ``output_hook`` is a
function, not plain data: in-process only.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from autotune.record import Job, Record
from autotune.worker import PassCallback, Worker

FAULTS = ("crash", "hang", "oom", "device")
SPEC_NAME = "faulty_worker:FaultyWorker"  # the WorkerSpec.worker that names this class
OutputHook = Callable[[dict[str, Any], list[list[int]]], list[list[int]]]


class FaultyWorker(Worker):
    def __init__(self, pair: Any, workloads: Sequence[Any], fixed: dict[str, Any], *,
                 faults: dict[int, str] | None = None, output_hook: OutputHook | None = None,
                 slow: tuple[dict[str, Any], float] | None = None) -> None:
        bad = {k: v for k, v in (faults or {}).items() if v not in FAULTS}
        if bad:
            raise ValueError(f"fault kinds must be one of {FAULTS}, but got {bad}")
        super().__init__(pair, workloads, fixed)
        self.faults = dict(faults or {})
        self.output_hook = output_hook
        self.slow = slow

    def _measure(self, job: Job, rec: Record, on_first_pass: PassCallback | None) -> None:
        # inside Worker.measure's error handling, as an engine error of the config would be
        if job.role != "confirm" and job.trial in self.faults:
            _inject(self.faults[job.trial], job.trial)
        super()._measure(job, rec, on_first_pass)

    def _pass(self, cfg: Any, max_new_tokens: int, stage: str) -> list[Any]:
        config = cfg.to_dict()
        hook = None
        if self.slow is not None and all(config.get(k) == v for k, v in self.slow[0].items()):
            seconds = self.slow[1]
            hook = self.pair.target.register_forward_pre_hook(lambda *_: time.sleep(seconds))
        try:
            results = super()._pass(cfg, max_new_tokens, stage)
        finally:
            if hook is not None:
                hook.remove()
        if self.output_hook is None:
            return results
        return [dataclasses.replace(r, outputs=self.output_hook(cfg.to_dict(), r.outputs)) for r in results]


def _inject(kind: str, trial: int) -> None:
    if kind == "crash":
        os._exit(77)
    if kind == "hang":
        while True:
            time.sleep(3600)
    if kind == "oom":
        import torch

        raise torch.OutOfMemoryError(f"injected out-of-memory fault on trial {trial}")
    raise RuntimeError(f"CUDA error: an illegal memory access was encountered (injected fault on trial {trial})")
