"""Executor overhead and throughput: local vs Ray (warm actors) vs a process per trial, 1 vs 2 workers.

    python benchmarks/executor_bench.py --target tiny-dense --draft oracle:0.3 --trials 24 --rounds 3
    python benchmarks/executor_bench.py --target smollm2-135m-instruct --draft random --trials 6 --rounds 1

Every variant measures the same list of configs (the protocol of one trial: warm-up, repeats,
exactness against AR) on a CPU, one torch thread per worker:

- ``local``: the in-process worker (``LocalExecutor``), jobs submitted one after another;
- ``ray-1`` / ``ray-2``: warm Ray actors (``RayExecutor``), one job per idle actor;
- ``process``: a fresh Python process per trial that imports, loads the pair, warms up, measures and
  exits (how tuners that restart a server per config work);
- ``sweep-local`` / ``sweep-ray-1`` / ``sweep-ray-2``: a whole ``run_sweep`` (TPE, SQLite, the search
  space search_spaces/quick.yaml), so the driver's ask/tell/storage time counts too: idle% = the
  workers' time outside the engine between the first trial's start and the last one's end.

Per-trial overhead = wall time the driver waited for the trial − seconds inside ``engine.bench``
(for the sweep variants: the workers' time outside the engine, per trial, over the whole sweep).
Throughput = trials / wall time of the whole batch (start-up excluded for warm executors, reported
apart). Each variant runs ``--rounds`` times; the summary gives the median and the min..max.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from autotune.executors import Executor, LocalExecutor  # noqa: E402
from autotune.executors.ray_executor import RayExecutor, WorkerSpec, default_temp_dir  # noqa: E402
from autotune.record import Job, Record  # noqa: E402

CONFIGS = [
    {"verify": "chain"},
    {"verify": "ddtree", "budget": 4, "top_k": 2},
    {"verify": "ddtree", "budget": 8, "top_k": 4},
    {"verify": "chain", "draft_path": "auto"},
    {"verify": "ddtree", "budget": 16, "top_k": 4, "rollback": "replay"},
    {"verify": "ddtree", "budget": 6, "top_k": 3, "proposal_temp": 0.75},
]

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(1)
from autotune.record import Job
from autotune.worker import Worker
from engine.data.workloads import load_workload
a = json.loads(sys.argv[1])
wl = [load_workload(a["prompts"], a["base"], a["n_prompts"], 0)]
w = Worker.load(a["target"], a["draft"], a["device"], a["dtype"], wl, {})
rec = w.measure(Job(**a["job"]))
print(json.dumps({"ok": rec.ok, "engine_s": rec.engine_s, "reason": rec.fail_reason,
                  "startup_s": time.perf_counter() - t0 - rec.elapsed_s}))
"""


def jobs(n: int, args: argparse.Namespace, offset: int = 0) -> list[Job]:
    return [Job(trial=offset + i, role="search", config=dict(CONFIGS[i % len(CONFIGS)]),
                max_new_tokens=args.max_new_tokens, warmup=args.warmup, repeats=args.repeats, max_rel_mad=1.0,
                remeasure_if_noisy=False) for i in range(n)]


def run_executor(ex: Executor, batch: list[Job]) -> dict[str, Any]:
    """Feed ``batch`` to every idle worker as it frees up; per trial, wall waited and engine seconds."""
    t_start = time.perf_counter()
    ex.start()
    start_s = time.perf_counter() - t_start
    # one untimed job per worker: the AR reference each worker computes once for exactness
    idle = ex.idle_workers()
    warm = jobs(len(idle), ARGS, offset=10_000)
    for w, job in zip(idle, warm, strict=True):
        ex.submit(job, worker=w)
    done = 0
    while done < len(warm):
        done += len(ex.wait())
    queue, submitted, recs = list(batch), {}, []
    t0 = time.perf_counter()
    while queue or submitted:
        for w in ex.idle_workers():
            if queue:
                job = queue.pop(0)
                submitted[job.trial] = time.perf_counter()
                ex.submit(job, worker=w)
        for rec in ex.wait():
            recs.append((rec, time.perf_counter() - submitted.pop(rec.trial)))
    wall = time.perf_counter() - t0
    ex.close()
    return summarise(recs, wall, start_s, workers=len(warm))


def run_process_per_trial(batch: list[Job], args: argparse.Namespace) -> dict[str, Any]:
    # The repository first, then whatever the parent had on its path (packages installed aside).
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    recs, t0, startups = [], time.perf_counter(), []
    for job in batch:
        payload = {"target": args.target, "draft": args.draft, "device": args.device, "dtype": args.dtype,
                   "prompts": args.prompts,
                   "base": str(REPO), "n_prompts": args.n_prompts, "job": dataclasses.asdict(job)}
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(payload)], env=env, capture_output=True,
                             text=True)
        waited = time.perf_counter() - t
        if out.returncode != 0:
            raise RuntimeError(f"process-per-trial child for trial {job.trial} exited {out.returncode}:\n"
                               f"{out.stderr[-3000:]}")
        doc = json.loads(out.stdout.strip().splitlines()[-1])
        assert doc["ok"], doc["reason"]
        startups.append(doc["startup_s"])
        recs.append((Record(trial=job.trial, role=job.role, worker="process", config=job.config,
                            engine_s=doc["engine_s"]), waited))
    out = summarise(recs, time.perf_counter() - t0, 0.0, workers=1)
    out["child_startup_s_median"] = statistics.median(startups)  # import + load, per trial
    return out


def run_sweep_variant(variant: str, args: argparse.Namespace, n_trials: int) -> dict[str, Any]:
    """A real sweep; overhead read from the trials the driver recorded."""
    import tempfile

    import yaml

    from autotune import experiment
    from autotune.storage import parse_storage
    from autotune.sweep import SweepOptions, make_executor, run_sweep

    with tempfile.TemporaryDirectory() as tmp:
        doc = {"name": "bench", "model": {"target": args.target, "draft": args.draft, "device": "cpu",
                                          "dtype": args.dtype},
               "workload": {"sets": [str(REPO / args.prompts)], "n_prompts": args.n_prompts,
                            "max_new_tokens": args.max_new_tokens, "seed": 0},
               "search_space": str(REPO / "search_spaces" / "quick.yaml"), "objective": "decode_tps",
               "measure": {"warmup": args.warmup, "repeats": args.repeats, "max_rel_mad": 0.99,
                           "baseline_every": 1000, "confirm_top": 0},
               "study": {"n_trials": n_trials, "sampler": "tpe", "seed": 0}}
        path = Path(tmp) / "bench.yaml"
        path.write_text(yaml.safe_dump(doc))
        exp = experiment.load(path)
        workloads = experiment.load_workloads(exp)
        kind, workers = ("local", None) if variant == "sweep-local" else ("ray", int(variant.rsplit("-", 1)[1]))
        ex = make_executor(exp, workloads, kind, workers)
        opts = SweepOptions(n_trials=n_trials, storage=parse_storage(f"sqlite:///{tmp}/bench.db"),
                            study_name="bench", tracking_uri=None, progress=False)
        t0 = time.perf_counter()
        outcome = run_sweep(exp, opts, workloads, executor=ex, out=open(os.devnull, "w"))  # noqa: SIM115
        total = time.perf_counter() - t0
        trials = outcome.study.get_trials()
    span = (max(t.datetime_complete for t in trials) - min(t.datetime_start for t in trials)).total_seconds()
    n_workers = len({t.user_attrs["worker"] for t in trials})
    engine_total = sum(t.user_attrs["engine_s"] for t in trials)
    walls = [t.user_attrs["trial_wall_s"] for t in trials]
    return {
        "trials": len(trials), "workers": n_workers, "wall_s": span, "start_s": total - span,
        "trials_per_hour": 3600.0 * len(trials) / span,
        "trial_wall_s_median": statistics.median(walls),
        "engine_s_median": statistics.median(t.user_attrs["engine_s"] for t in trials),
        "overhead_s_median": (span * n_workers - engine_total) / len(trials),
        "overhead_fraction": sum(w - t.user_attrs["engine_s"] for w, t in zip(walls, trials, strict=True)) / sum(walls),
        "idle_fraction": 1.0 - engine_total / (span * n_workers),
        "all_ok": all(t.state.name == "COMPLETE" for t in trials),
    }


def summarise(recs: list[tuple[Record, float]], wall: float, start_s: float, workers: int) -> dict[str, Any]:
    overhead = [w - r.engine_s for r, w in recs]
    engine_total = sum(r.engine_s for r, _ in recs)
    return {
        "trials": len(recs), "workers": workers, "wall_s": wall, "start_s": start_s,
        "trials_per_hour": 3600.0 * len(recs) / wall,
        "trial_wall_s_median": statistics.median(w for _, w in recs),
        "engine_s_median": statistics.median(r.engine_s for r, _ in recs),
        "overhead_s_median": statistics.median(overhead),
        "overhead_fraction": sum(overhead) / sum(w for _, w in recs),
        # the workers' time not spent in the engine, over the whole batch (dispatch gaps included)
        "idle_fraction": 1.0 - engine_total / (wall * workers),
        "all_ok": all(r.ok for r, _ in recs),
    }


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.4g} ({min(values):.4g}..{max(values):.4g})"


ARGS: argparse.Namespace


def _ratios(results: dict[str, list[dict[str, Any]]]) -> dict[str, list[float]]:
    """Trials per hour of one variant over another's, round by round, for the pairs both ran: the
    warm worker (ray-1, else local) over a process per trial, two actors over one, one over local."""
    def tph(v: str) -> list[float]:
        return [x["trials_per_hour"] for x in results[v]]

    warm = "ray-1" if "ray-1" in results else "local"
    pairs = {"warm_vs_process": (warm, "process"), "ray2_vs_ray1": ("ray-2", "ray-1"),
             "ray1_vs_local": ("ray-1", "local")}
    return {name: [a / b for a, b in zip(tph(x), tph(y), strict=True)] for name, (x, y) in pairs.items()
            if x in results and y in results}


def main(argv: list[str] | None = None) -> int:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny-dense")
    ap.add_argument("--draft", default="oracle:0.3")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for the local and process variants (GPU)")
    ap.add_argument("--prompts", default="experiments/prompts/quickstart.jsonl")
    ap.add_argument("--n-prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trials", type=int, default=24, help="trials per variant and round")
    ap.add_argument("--process-trials", type=int, help="trials for the process-per-trial variant (default --trials)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=["local", "ray-1", "ray-2", "process"])
    ap.add_argument("--out", help="write every number as JSON")
    args = ARGS = ap.parse_args(argv)

    import torch

    from engine.data.workloads import load_workload

    torch.set_num_threads(1)  # the local worker gets one thread, like each actor and each child process
    workloads = (load_workload(args.prompts, REPO, args.n_prompts, 0),)
    spec = WorkerSpec(args.target, args.draft, args.device, args.dtype, workloads, {})
    if any(v.startswith(("ray-", "sweep-ray")) for v in args.variants):  # a GPU host may lack Ray
        import ray

        default_temp_dir().mkdir(parents=True, exist_ok=True)
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, _temp_dir=str(default_temp_dir()),
                 log_to_driver=False, logging_level="ERROR", object_store_memory=256 * 1024**2)
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
    for r in range(args.rounds):
        for variant in args.variants:  # interleaved, so drift of the machine hits every variant alike
            batch = jobs(args.process_trials or args.trials if variant == "process" else args.trials, args)
            if variant == "local":
                local = LocalExecutor.for_model(args.target, args.draft, args.device, args.dtype, workloads, {})
                res = run_executor(local, batch)
            elif variant.startswith("sweep-"):
                res = run_sweep_variant(variant, args, args.trials)
            elif variant.startswith("ray-"):
                res = run_executor(RayExecutor(spec, workers=int(variant.split("-")[1])), batch)
            else:
                res = run_process_per_trial(batch, args)
            results[variant].append(res)
            print(f"round {r} {variant}: {res['trials_per_hour']:.0f} trials/h, overhead "
                  f"{res['overhead_s_median'] * 1000:.1f} ms/trial ({100 * res['overhead_fraction']:.2f}%)",
                  file=sys.stderr, flush=True)
    ray_version = "-"
    if "ray" in sys.modules:
        ray_version = sys.modules["ray"].__version__
        sys.modules["ray"].shutdown()

    def col(v: str, k: str) -> list[float]:
        return [x[k] for x in results[v]]

    print(f"command: python benchmarks/executor_bench.py {' '.join(argv or sys.argv[1:])}")
    print(f"machine: {platform.node()} {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, ray {ray_version}")
    print(f"date: {dt.datetime.now(dt.UTC).isoformat(timespec='minutes')}")
    for v in args.variants:
        print(f"{v}.trials_per_hour: {spread(col(v, 'trials_per_hour'))}")
        print(f"{v}.trial_wall_s: {spread(col(v, 'trial_wall_s_median'))}")
        print(f"{v}.engine_s: {spread(col(v, 'engine_s_median'))}")
        print(f"{v}.overhead_ms: {spread([1000 * x for x in col(v, 'overhead_s_median')])}")
        print(f"{v}.overhead_pct: {spread([100 * x for x in col(v, 'overhead_fraction')])}")
        print(f"{v}.idle_pct: {spread([100 * x for x in col(v, 'idle_fraction')])}")
        print(f"{v}.start_s: {spread(col(v, 'start_s'))}")
        if v == "process":
            print(f"{v}.child_startup_s: {spread(col(v, 'child_startup_s_median'))}")
    ratios = _ratios(results)
    for k, vals in ratios.items():
        print(f"ratio.{k}: {spread(vals)}")
    print(f"all_ok: {all(x['all_ok'] for v in results.values() for x in v)}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results, "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
