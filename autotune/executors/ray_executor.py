"""The Ray executor: warm worker actors (one per GPU, or N one-core CPU actors) fed by the driver.

How it behaves (the driver keeps the study and MLflow; actors only measure):

- **Warm actors.** Each actor loads the model pair once (:meth:`_Measurer.prepare`) and keeps it.
  Every job carries the :class:`WorkerSpec`; an actor reloads only when the model (target, draft,
  device, dtype, weights) differs from the one it holds. New prompts or fixed fields just re-wrap the pair.
- **Dispatch.** :meth:`RayExecutor.idle_workers` lists ready actors; the driver submits one job per
  idle actor and :meth:`RayExecutor.wait` returns records as actors finish, so no actor waits on
  another. With ``on_progress`` set, ``wait`` asks each busy actor every second where its job is
  (an actor answers one call beside a running job).
- **Per-trial timeout.** A job without a result after ``trial_timeout_s`` comes back as a failed
  record (``timeout: ...``); the actor is killed and Ray restarts it (``max_restarts=-1``), which
  reloads the model. The restarted actor takes jobs again once its model is loaded.
- **Crash.** An actor process that dies mid-job (segfault, kernel OOM killer, ``os._exit``) makes
  the job come back failed with ``interrupted`` set: the driver fails the trial with the reason and
  retries its params once. Ray restarts the actor.
- **Unusable device.** An engine error that poisons the CUDA context comes back as a failed record
  with ``device_unusable``; the executor makes that actor exit and Ray restarts it.
- **Cluster.** Without an address a private local cluster starts (no dashboard, its temp dir under
  ``~/.cache/autotune/ray``) and stops on :meth:`close`; ``address="auto"`` or ``HOST:PORT`` joins a
  cluster made with ``ray start --head`` / ``ray start --address`` (docs/multi-host.md).
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.errors import InputError
from autotune.executors.base import Executor
from autotune.record import Job, Record
from autotune.worker import PassCallback, Worker

DEFAULT_WORKER = "autotune.worker:Worker"
_WORKER_REF = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
RESTART_ATTEMPTS = 40  # calls to a restarting actor that may bounce before the slot is given up
_RETRY_PAUSE_S = 0.25


def default_temp_dir() -> Path:
    """Ray's session folder. Unix socket paths are limited to ~107 bytes and Ray nests about 70
    characters below this folder, so a long home folder falls back to a short path in /tmp."""
    cache = Path(os.path.expanduser("~")) / ".cache" / "autotune" / "ray"
    return cache if len(str(cache)) <= 36 else Path("/tmp") / f"autotune-ray-{os.getuid()}"


@dataclass(frozen=True)
class WorkerSpec:
    """What an actor needs to measure: the model pair, the prompts and the fixed engine fields.

    ``worker`` names what wraps the loaded pair in each actor, as ``"module:callable"`` (a string,
    so the spec pickles to actors on any host): a :class:`~autotune.worker.Worker` subclass or a
    function returning a Worker, called as ``worker(pair, workloads, fixed, **worker_kwargs)``.
    The driver checks it on construction and every actor imports it, so its module must be
    importable on every host (as ``autotune`` is). ``worker_kwargs`` are plain data."""

    target: str
    draft: str
    device: str
    dtype: str
    workloads: tuple[Any, ...]
    fixed: dict[str, Any] = field(default_factory=dict)
    worker: str = DEFAULT_WORKER
    worker_kwargs: dict[str, Any] = field(default_factory=dict)
    weights: str = "dequantized"  # how the target holds its weights (engine.load; ModelSpec.weights)

    def __post_init__(self) -> None:
        factory = load_worker(self.worker)
        kwargs = self.worker_kwargs
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise InputError("WorkerSpec", "worker_kwargs", "must be a dict of keyword arguments (str keys) for "
                             f"{self.worker}", kwargs)
        try:
            signature = inspect.signature(factory)
        except (TypeError, ValueError):  # no signature to check (a builtin): the actor's call says
            return
        try:
            signature.bind(None, (), {}, **kwargs)
        except TypeError as exc:
            raise InputError("WorkerSpec", "worker_kwargs", f"must be keyword arguments that {self.worker}(pair, "
                             f"workloads, fixed, **worker_kwargs) accepts ({exc})", kwargs) from None

    def model_key(self) -> tuple[str, str, str, str, str]:
        return (self.target, self.draft, self.device, self.dtype, self.weights)


def load_worker(ref: str) -> Callable[..., Worker]:
    """The callable ``ref`` (``"module:name"``, ``name`` may be dotted) names; an :class:`InputError`
    naming the value and the rule when it is malformed, does not import, or is not a Worker factory."""
    rule = ("must be 'module:callable' naming a Worker subclass or a function returning a Worker, "
            "importable where the actors run")
    if not isinstance(ref, str) or not _WORKER_REF.fullmatch(ref):
        raise InputError("WorkerSpec", "worker", rule, ref)
    module_name, _, attr = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module itself failing: either way the value is unusable
        raise InputError("WorkerSpec", "worker", f"{rule}; importing {module_name!r} failed "
                         f"({type(exc).__name__}: {exc})", ref) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise InputError("WorkerSpec", "worker", f"{rule}; {module_name!r} has no {attr!r}", ref)
        obj = getattr(obj, part)
    if (isinstance(obj, type) and not issubclass(obj, Worker)) or not callable(obj):
        raise InputError("WorkerSpec", "worker", f"{rule}; it names {obj!r}", ref)
    return obj


class _Measurer:
    """The actor body: keeps one :class:`Worker` (a loaded pair) across jobs."""

    def __init__(self, threads: int | None) -> None:
        if threads:
            import torch

            torch.set_num_threads(threads)
        self.worker: Worker | None = None
        self.spec: WorkerSpec | None = None
        self.loads = 0
        self.where = ""  # where the running job is (Worker.measure's progress), read by progress()

    def prepare(self, spec: WorkerSpec) -> str:
        """Load the pair if the model changed (heavy), re-wrap it if only prompts changed; return the id."""
        if spec == self.spec and self.worker is not None:
            return self.worker.id
        if self.worker is None or self.spec is None or spec.model_key() != self.spec.model_key():
            import engine

            self.worker = None  # drop the old pair before the new one takes memory
            pair = engine.load(spec.target, spec.draft, device=spec.device, dtype=spec.dtype, weights=spec.weights)
            self.loads += 1
        else:
            pair = self.worker.pair
        self.worker = load_worker(spec.worker)(pair, spec.workloads, spec.fixed, **spec.worker_kwargs)
        self.spec = spec
        return self.worker.id

    def measure(self, spec: WorkerSpec, job: Job) -> Record:
        self.prepare(spec)
        assert self.worker is not None
        self.where = ""
        rec = self.worker.measure(job, on_progress=self._told)
        rec.model_loads = self.loads
        return rec

    def _told(self, where: str) -> None:
        self.where = where

    def progress(self) -> str:
        """Answered while :meth:`measure` runs (the actor runs two calls at once)."""
        return self.where

    def environment(self) -> dict[str, Any]:
        return self.worker.environment() if self.worker is not None else {}

    def facts(self) -> dict[str, Any]:
        pair = self.worker.pair if self.worker is not None else None
        return {"worker": self.worker.id if self.worker else None, "loads": self.loads,
                "device": getattr(pair, "device", None), "dtype": getattr(pair, "dtype", None),
                **(self.worker.limits() if self.worker is not None else {})}


@dataclass
class _Slot:
    index: int
    actor: Any
    state: str = "starting"  # starting | idle | busy | restarting | dead
    worker_id: str = ""
    ref: Any = None  # the pending prepare (starting/restarting) or measure (busy) call
    job: Job | None = None
    submitted: float = 0.0
    bounces: int = 0  # consecutive prepare calls that hit the actor while it restarted
    restarts: int = 0
    last_error: str = ""
    gone: str = ""  # id of the process being replaced: a prepare it answers (kill is async) does not count


class RayExecutor(Executor):
    """Warm Ray actors; see the module docstring for dispatch, timeouts, crashes and restarts.

    ``workers``: CPU actors to start (one core each) when the cluster has no GPU or ``device`` is
    ``cpu``; on GPUs one actor per GPU, capped at ``workers`` when given.
    """

    def __init__(self, spec: WorkerSpec, workers: int | None = None, address: str | None = None,
                 trial_timeout_s: float | None = None, temp_dir: Path | None = None) -> None:
        self.spec = spec
        self.workers = workers
        self.address = address
        self.trial_timeout_s = trial_timeout_s
        self.temp_dir = temp_dir or default_temp_dir()
        self._slots: list[_Slot] = []
        self._own_cluster = False
        self._gpu = False
        self._started = False
        self._facts: dict[str, Any] = {}
        self._environments: dict[str, dict[str, Any]] = {}  # worker id -> its Worker.environment(), fixed per process

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> list[str]:
        if self._started:
            return [s.worker_id for s in self._slots]
        import ray

        self._own_cluster = _connect(ray, self.address, self.temp_dir)
        self._started = True
        resources = ray.cluster_resources()
        gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
        self._gpu = self.spec.device != "cpu" and gpus > 0
        if self.spec.device.startswith("cuda") and gpus == 0:
            raise InputError("--executor", None, f"model.device {self.spec.device!r} needs a GPU, but the Ray "
                             f"cluster has none (resources: {resources})", "ray")
        if self._gpu:
            n = gpus if self.workers is None else min(self.workers, gpus)
            options = {"num_gpus": 1, "num_cpus": 1}
        else:
            n = self.workers or 1
            if n > cpus:
                raise InputError("--workers", None, f"each CPU worker needs a CPU of its own, and the Ray cluster "
                                 f"has {cpus}; use --workers {max(cpus, 1)} or fewer", n)
            options = {"num_cpus": 1}
        # two calls at once: progress() is answered while measure() runs (the driver never sends two jobs)
        actor_cls = ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=2, **options)(_Measurer)
        threads = None if self._gpu else 1
        self._slots = [_Slot(i, actor_cls.remote(threads)) for i in range(n)]
        for slot in self._slots:
            slot.ref = slot.actor.prepare.remote(self.spec)
        while any(s.state == "starting" for s in self._slots):
            self._poll(timeout=None, records=[])
        ready = [s for s in self._slots if s.state == "idle"]
        if not ready:
            raise RuntimeError(f"no Ray worker could start: {self._slots[0].last_error}")
        self._facts = ray.get(ready[0].actor.facts.remote())  # the device and dtype the pair really got
        return [s.worker_id for s in ready]

    def close(self) -> None:
        if not self._started:
            return
        import ray

        for slot in self._slots:
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception:  # already gone; closing must not fail
                pass
        self._slots = []
        self._started = False
        if self._own_cluster:
            ray.shutdown()
            self._own_cluster = False

    def use_model(self, spec: WorkerSpec) -> None:
        """Later jobs measure on this spec; an actor reloads only if the model itself changed."""
        self.spec = spec

    # ---------------------------------------------------------------- dispatch
    def free_slots(self) -> int:
        return len(self.idle_workers())

    def idle_workers(self) -> list[str]:
        return [s.worker_id for s in self._slots if s.state == "idle"]

    def submit(self, job: Job, on_first_pass: PassCallback | None = None, worker: str | None = None) -> None:
        # on_first_pass is ignored: an actor cannot call back into the driver mid-job (no pruning)
        idle = [s for s in self._slots if s.state == "idle" and (worker is None or s.worker_id == worker)]
        if not idle:
            raise RuntimeError(f"no idle Ray worker {worker or ''} to take trial {job.trial}; call wait() first")
        slot = idle[0]
        slot.state, slot.job, slot.submitted = "busy", job, time.monotonic()
        slot.ref = slot.actor.measure.remote(self.spec, job)

    def wait(self) -> list[Record]:
        records: list[Record] = []
        while any(s.state in ("busy", "starting", "restarting") for s in self._slots):
            deadline = self._next_deadline()
            if self.on_progress is not None:  # look in on the busy workers every second
                deadline = 1.0 if deadline is None else min(deadline, 1.0)
            became_idle = self._poll(timeout=deadline, records=records)
            records += self._expire()
            if records or became_idle:
                return records
            self._tell_progress()
        if not any(s.state != "dead" for s in self._slots):
            raise RuntimeError(f"every Ray worker is gone; last error: {self._slots[-1].last_error}")
        return records

    def _tell_progress(self) -> None:
        """``on_progress`` with where each busy worker's job is (one line: trial and pass/prompt)."""
        import ray

        busy = [s for s in self._slots if s.state == "busy" and s.job is not None]
        if self.on_progress is None or not busy:
            return
        try:
            wheres = ray.get([s.actor.progress.remote() for s in busy], timeout=2.0)
        except Exception:  # a worker restarting or gone: its job's fate comes through wait()
            return
        parts = [w if len(busy) == 1 else f"trial {s.job.trial}: {w}" for s, w in zip(busy, wheres, strict=True) if w]
        if parts:
            self.on_progress(" | ".join(parts))

    def _next_deadline(self) -> float | None:
        if self.trial_timeout_s is None:
            return None
        busy = [s.submitted + self.trial_timeout_s for s in self._slots if s.state == "busy"]
        return max(0.0, min(busy) - time.monotonic()) if busy else None

    def _poll(self, timeout: float | None, records: list[Record]) -> bool:
        """Wait for one pending call (or ``timeout``), then collect every call that is done.
        Returns whether some worker became idle without a record (a start or restart finished)."""
        import ray

        pending = {s.ref: s for s in self._slots if s.ref is not None}
        if not pending:
            return False
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
        became_idle = False
        for ref in ready:
            slot = pending[ref]
            slot.ref = None
            if slot.state == "busy":
                records.append(self._collect(slot, ref))
            else:
                became_idle |= self._ready(slot, ref)
        return became_idle

    def _collect(self, slot: _Slot, ref: Any) -> Record:
        import ray

        job = slot.job
        assert job is not None
        slot.job = None
        try:
            rec: Record = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            reason = (f"worker crashed: the actor process of {slot.worker_id} died while measuring "
                      f"({_first_line(exc)}); Ray restarts it and the params are retried once")
            self._restart(slot, kill=False, reason=reason)
            return _failed(job, slot.worker_id, reason, interrupted=True)
        except ray.exceptions.RayTaskError as exc:  # e.g. loading a changed model failed inside the actor
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            slot.state = "idle"
            return _failed(job, slot.worker_id, f"{type(cause).__name__}: {cause}")
        slot.worker_id, slot.state = rec.worker, "idle"
        if rec.device_unusable:
            rec.fail_reason = f"{rec.fail_reason}; the device is unusable, so the worker was restarted"
            self._restart(slot, kill=True, reason=rec.fail_reason)
        return rec

    def _ready(self, slot: _Slot, ref: Any) -> bool:
        import ray

        try:
            worker_id = ray.get(ref)
            if worker_id == slot.gone:  # the old process answered before the kill reached it
                raise _Bounce(f"{worker_id} still answered after it was killed")
        except (ray.exceptions.RayActorError, _Bounce) as exc:  # the call reached the actor while it restarted
            slot.bounces += 1
            slot.last_error = _first_line(exc)
            if slot.bounces > RESTART_ATTEMPTS:
                slot.state = "dead"
                return False
            time.sleep(_RETRY_PAUSE_S)
            slot.ref = slot.actor.prepare.remote(self.spec)
            return False
        except ray.exceptions.RayTaskError as exc:  # the model does not load: nothing to retry
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            if slot.restarts == 0:  # the first load fails: the sweep cannot start
                raise cause from None
            slot.state, slot.last_error = "dead", f"{type(cause).__name__}: {cause}"
            return False
        slot.worker_id, slot.state, slot.bounces, slot.gone = worker_id, "idle", 0, ""
        return True

    def _expire(self) -> list[Record]:
        if self.trial_timeout_s is None:
            return []
        out = []
        now = time.monotonic()
        for slot in self._slots:
            if slot.state == "busy" and slot.job is not None and now - slot.submitted >= self.trial_timeout_s:
                job, slot.job = slot.job, None
                reason = (f"timeout: no result after {self.trial_timeout_s:g} s on {slot.worker_id}; the worker was "
                          "killed and restarted")
                self._restart(slot, kill=True, reason=reason)
                out.append(_failed(job, slot.worker_id, reason))
        return out

    def _restart(self, slot: _Slot, kill: bool, reason: str) -> None:
        import ray

        if kill:
            ray.kill(slot.actor, no_restart=False)
        slot.state, slot.ref, slot.job, slot.gone = "restarting", None, None, slot.worker_id
        slot.restarts += 1
        slot.last_error = reason
        slot.ref = slot.actor.prepare.remote(self.spec)

    # ---------------------------------------------------------------- facts
    def describe(self) -> dict[str, Any]:
        if not self._slots:
            return {}
        device = self._facts.get("device") or ("cuda" if self._gpu else "cpu")
        return {"device": device, "dtype": self._facts.get("dtype") or self.spec.dtype,
                "workers": [s.worker_id for s in self._slots],
                "executor": "ray", "restarts": sum(s.restarts for s in self._slots),
                **{k: self._facts.get(k) for k in ("weights", "context", "longest_prompt", "recurrent_state", "tools",
                                                      "session_turns", "longest_first_request")}}

    def environment(self, worker: str) -> dict[str, Any]:
        if worker not in self._environments:
            import ray

            slot = next((s for s in self._slots if s.worker_id == worker and s.state == "idle"), None)
            if slot is None:
                return {}
            try:
                self._environments[worker] = ray.get(slot.actor.environment.remote(), timeout=60)
            except Exception:  # the actor died meanwhile: unknown, so nothing is reused for it
                return {}
        return self._environments[worker]

    def facts(self) -> list[dict[str, Any]]:
        """Per actor: worker id and model loads (tests and benchmarks read this)."""
        import ray

        return [ray.get(s.actor.facts.remote()) for s in self._slots if s.state == "idle"]


class _Bounce(Exception):
    """A prepare call that did not reach the restarted process."""


def _connect(ray: Any, address: str | None, temp_dir: Path) -> bool:
    """Join ``address`` or start a private local cluster; returns whether this process started one."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        return False
    temp_dir.mkdir(parents=True, exist_ok=True)
    ray.init(include_dashboard=False, _temp_dir=str(temp_dir), log_to_driver=False, logging_level="ERROR",
             object_store_memory=256 * 1024**2)
    return True


def _failed(job: Job, worker: str, reason: str, interrupted: bool = False) -> Record:
    return Record(trial=job.trial, role=job.role, worker=worker, config=dict(job.config), ok=False,
                  fail_reason=reason, interrupted=interrupted)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
