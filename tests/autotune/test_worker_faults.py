"""The fault-injecting test double (faulty_worker.py), the worker's error classification and the
worker seam of the Ray executor's WorkerSpec, without Ray."""

from __future__ import annotations

import pytest
import torch
from autotune_helpers import tiny_experiment
from faulty_worker import SPEC_NAME, FaultyWorker

import engine
from autotune import experiment
from autotune.errors import InputError
from autotune.executors.ray_executor import DEFAULT_WORKER, WorkerSpec, load_worker
from autotune.record import Job
from autotune.worker import Worker, device_unusable


def _worker(tmp_path, faults=None):
    """The production worker, or with ``faults`` the test double that injects them."""
    exp = experiment.load(tiny_experiment(tmp_path))
    cls, kw = (FaultyWorker, {"faults": faults}) if faults else (Worker, {})
    return cls.load(exp.model.target, exp.model.draft, exp.model.device, exp.model.dtype,
                    experiment.load_workloads(exp), exp.fixed_engine, **kw)


def _job(trial: int, role: str = "search") -> Job:
    return Job(trial=trial, role=role, config={"verify": "chain"}, max_new_tokens=8, warmup=0, repeats=1,
               max_rel_mad=0.9, remeasure_if_noisy=False)


def test_injected_oom_and_device_faults_fail_only_their_trial(tmp_path):
    w = _worker(tmp_path, {1: "oom", 2: "device"})
    oom, dev, fine = w.measure(_job(1)), w.measure(_job(2)), w.measure(_job(3))
    assert not oom.ok and oom.fail_reason.startswith("OutOfMemoryError: injected") and not oom.device_unusable
    assert not dev.ok and dev.device_unusable and "illegal memory access" in dev.fail_reason
    assert fine.ok and fine.engine_s > 0 and fine.utilisation["kind"] == "cpu"
    assert w.measure(_job(1, role="confirm")).ok  # faults hit trials, not the confirmation re-measurements


def test_fault_kinds_are_checked():
    with pytest.raises(ValueError, match="fault kinds must be one of"):
        FaultyWorker(pair=None, workloads=[], fixed={}, faults={1: "explode"})


def test_worker_spec_names_its_worker_by_an_importable_string():
    spec = WorkerSpec("tiny-dense", "oracle:0.3", "cpu", "float32", ())
    assert spec.worker == DEFAULT_WORKER and load_worker(spec.worker) is Worker and spec.worker_kwargs == {}
    faulty = WorkerSpec("tiny-dense", "oracle:0.3", "cpu", "float32", (), worker=SPEC_NAME,
                        worker_kwargs={"faults": {1: "hang"}})
    assert load_worker(faulty.worker) is FaultyWorker
    assert faulty != spec  # another worker is another spec: an actor re-wraps its pair


@pytest.mark.parametrize("ref,why", [
    ("autotune.worker.Worker", "must be 'module:callable'"),
    ("autotune.worker:", "must be 'module:callable'"),
    (Worker, "must be 'module:callable'"),
    ("no_such_module_xyz:Worker", "importing 'no_such_module_xyz' failed (ModuleNotFoundError"),
    ("autotune.worker:Nope", "'autotune.worker' has no 'Nope'"),
    ("autotune.worker:MAX_DIAGNOSED", "it names 20"),
    ("autotune.errors:InputError", "it names <class 'autotune.errors.InputError'>"),
])
def test_a_worker_that_is_not_an_importable_worker_factory_is_refused(ref, why):
    with pytest.raises(InputError) as err:
        WorkerSpec("tiny-dense", "oracle:0.3", "cpu", "float32", (), worker=ref)
    msg = str(err.value)
    assert msg.startswith("WorkerSpec: worker: must be 'module:callable' naming a Worker subclass")
    assert why in msg and msg.endswith(f"but got {ref!r}")


def test_worker_kwargs_the_worker_does_not_take_are_refused():
    with pytest.raises(InputError, match=r"worker_kwargs: must be keyword arguments that autotune.worker:Worker"
                                         r"\(pair, workloads, fixed, \*\*worker_kwargs\) accepts \(.*'faults'\), "
                                         r"but got \{'faults': \{1: 'hang'\}\}"):
        WorkerSpec("tiny-dense", "oracle:0.3", "cpu", "float32", (), worker_kwargs={"faults": {1: "hang"}})
    with pytest.raises(InputError, match=r"worker_kwargs: must be a dict of keyword arguments.*but got \{1: 2\}"):
        WorkerSpec("tiny-dense", "oracle:0.3", "cpu", "float32", (), worker=SPEC_NAME, worker_kwargs={1: 2})


@pytest.mark.parametrize("exc,fatal", [
    (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
    (RuntimeError("CUDA error: device-side assert triggered"), True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (ValueError("budget must be >= 1"), False),
])
def test_device_unusable_classification(exc, fatal):
    assert device_unusable(exc) is fatal


def test_exactness_reference_is_ar_decoded_on_the_trials_implementation_paths(tmp_path):
    """A config is exact when it equals AR decoded the same way (loop and kernels): in bf16 two
    loops or two kernel sets round differently, which is not the speculative algorithm's doing."""
    w = _worker(tmp_path)
    assert w.ar_config({"verify": "ddtree", "draft_path": "generic", "kernels": "eager", "budget": 9}) == {
        **w.fixed, "verify": "ar", "draft_path": "generic", "kernels": "eager"}
    # the loop the trial takes (Pair.ar_twin), not the one it names: `auto` gives this pair's host-side
    # draft the generic loop, and its AR that loop too (on a GPU `auto` would give AR the graphs)
    assert w.ar_config({"verify": "chain", "draft_path": "auto"})["draft_path"] == "generic"
    for paths in ({"draft_path": "generic", "kernels": "eager"}, {"draft_path": "auto", "kernels": "fused"}):
        rec = w.measure(Job(trial=7, role="search", config={"verify": "chain", **paths}, max_new_tokens=8,
                            warmup=0, repeats=1, max_rel_mad=0.9, remeasure_if_noisy=False))
        assert rec.ok and rec.exact_match == 1.0
    # on a CPU both AR configs decode in the same loop with the same kernels: one reference
    assert [k[-2:] for k in w._reference] == [("generic", "eager")]
    assert w.pair.decode_paths(engine.EngineConfig(verify="ar", draft_path="auto")) == ("generic", "eager")
    # an explicit runtime runs the runtime's steps eagerly on a CPU: a reference of its own
    assert w.pair.decode_paths(engine.EngineConfig(verify="ar", draft_path="runtime")) == ("runtime", "eager")


def test_a_config_the_engine_cannot_run_is_refused_unmeasured(tmp_path):
    """``draft_path: runtime`` with a draft that proposes on the host: the record carries the engine's
    reason and no measurement (the driver makes the trial infeasible); AR on the runtime is measured."""
    w = _worker(tmp_path)
    rec = w.measure(Job(trial=3, role="search", config={"verify": "chain", "draft_path": "runtime"}, max_new_tokens=8,
                        warmup=0, repeats=1, max_rel_mad=0.9, remeasure_if_noisy=False))
    assert rec.ok and "proposes on the host" in rec.refused
    assert rec.decode_tps_runs == [] and rec.exact_match is None and not w._reference
    rec = w.measure(Job(trial=4, role="search", config={"verify": "ar", "draft_path": "runtime"}, max_new_tokens=8,
                        warmup=0, repeats=1, max_rel_mad=0.9, remeasure_if_noisy=False))
    assert rec.ok and rec.refused is None and rec.exact_match == 1.0 and set(rec.loops) == {"runtime"}
