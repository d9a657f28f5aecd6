"""The worker's test-only fault hook and its error classification, without Ray."""

from __future__ import annotations

import pytest
import torch
from autotune_helpers import tiny_experiment

import engine
from autotune import experiment
from autotune.worker import Job, Worker, device_unusable


def _worker(tmp_path, faults):
    exp = experiment.load(tiny_experiment(tmp_path))
    return Worker.load(exp.model.target, exp.model.draft, exp.model.device, exp.model.dtype,
                       experiment.load_workloads(exp), exp.fixed_engine, faults=faults)


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
        Worker(pair=None, workloads=[], fixed={}, faults={1: "explode"})


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
    w = _worker(tmp_path, {})
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
    assert [k[1:] for k in w._reference] == [("generic", "eager")]
    assert w.pair.decode_paths(engine.EngineConfig(verify="ar", draft_path="auto")) == ("generic", "eager")
    # an explicit runtime runs the runtime's steps eagerly on a CPU: a reference of its own
    assert w.pair.decode_paths(engine.EngineConfig(verify="ar", draft_path="runtime")) == ("runtime", "eager")


def test_a_config_the_engine_cannot_run_is_refused_unmeasured(tmp_path):
    """``draft_path: runtime`` with a draft that proposes on the host: the record carries the engine's
    reason and no measurement (the driver makes the trial infeasible); AR on the runtime is measured."""
    w = _worker(tmp_path, {})
    rec = w.measure(Job(trial=3, role="search", config={"verify": "chain", "draft_path": "runtime"}, max_new_tokens=8,
                        warmup=0, repeats=1, max_rel_mad=0.9, remeasure_if_noisy=False))
    assert rec.ok and "proposes on the host" in rec.refused
    assert rec.decode_tps_runs == [] and rec.exact_match is None and not w._reference
    rec = w.measure(Job(trial=4, role="search", config={"verify": "ar", "draft_path": "runtime"}, max_new_tokens=8,
                        warmup=0, repeats=1, max_rel_mad=0.9, remeasure_if_noisy=False))
    assert rec.ok and rec.refused is None and rec.exact_match == 1.0 and set(rec.loops) == {"runtime"}
