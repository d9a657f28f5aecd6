"""The tuner's strategies run live: real sweeps on the device, scored against a measured grid.

    python benchmarks/tuner_live.py experiments/smollm2-h200-bench-short.yaml \\
        --space search_spaces/bench_grid_short.yaml --cache benchmarks/data/tuner-grid-short-h200.jsonl \\
        --strategies ours,before --seeds 1 --n-trials 12 --timeout 300 --out reports/tuner_live

``tuner_bench.py replay`` answers each job from the cache with simulated time; this runs the same
driver (``tuner_bench.sweep_run``: each strategy's sampler, pruner, ladder and dimension fixing) with
the experiment's real worker, the engine measuring on the device, and the wall clock as the time
axis: driver overhead, the AR reference outputs, compiles and graph captures included. The truth of a
config is still the cache's (the median of its full-fidelity passes measured by ``tuner_bench.py
measure``), so the search space must be the cached grid's. One model load serves every run; its
compiled kernels, captured graphs and AR reference outputs carry over, so the first run pays for them
(``--warm-up`` runs one throwaway sweep first). The table, runs.json and regret.png are
``tuner_bench``'s, with seconds of wall time instead of simulated ones.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tuner_bench as tb  # noqa: E402

from autotune import experiment  # noqa: E402
from autotune.errors import InputError  # noqa: E402
from autotune.record import Job, Record  # noqa: E402
from autotune.worker import Worker  # noqa: E402
from engine import EngineInputError  # noqa: E402


class TimedWorker:
    """A real worker whose jobs' end times are recorded on the wall clock since ``start()`` (the
    interface ``tuner_bench.sweep_run`` reads); ``hide_facts`` keeps the target's facts from the
    driver (``before``: the tuner that fixed no dimension)."""

    def __init__(self, inner: Worker) -> None:
        self.inner = inner
        self.finished: dict[tuple[int, str], float] = {}
        self.hide_facts = False
        self._t0 = time.perf_counter()

    def __getattr__(self, name: str) -> Any:  # everything else is the real worker's
        return getattr(self.inner, name)

    def start(self, hide_facts: bool) -> None:
        self.finished, self.hide_facts, self._t0 = {}, hide_facts, time.perf_counter()

    @property
    def clock(self) -> float:
        return time.perf_counter() - self._t0

    def limits(self) -> dict[str, Any]:
        got = dict(self.inner.limits())
        if self.hide_facts:
            got.update(recurrent_state=None, tools=None)
        return got

    def measure(self, job: Job, on_first_pass: Any = None, on_progress: Any = None) -> Record:
        rec = self.inner.measure(job, on_first_pass, on_progress)
        self.finished[(job.trial, job.role)] = self.clock
        return rec


def live(exp: experiment.Experiment, cache: tb.Cache, worker: TimedWorker, workloads: list[Any],
         strategy: tb.Strategy, seed: int, n_trials: int, target: float, timeout_s: float | None) -> tb.Run:
    """One real sweep of ``strategy``, its regret over wall seconds against the cache's truth."""
    worker.start(hide_facts=not strategy.fix_dimensions)
    return tb.sweep_run(exp, cache, strategy, seed, n_trials, target, worker, workloads, timeout_s)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tuner_live.py", description=__doc__.split("\n\n")[0])
    p.add_argument("experiment", help="experiment YAML (model, workload, measure, fidelity)")
    p.add_argument("--space", help="the grid's search space (default: the experiment's); the cache's grid")
    p.add_argument("--cache", required=True, help="the JSONL cache `tuner_bench.py measure` wrote: the truth")
    p.add_argument("--strategies", default="ours,before", help=f"comma-separated, of {', '.join(tb.STRATEGIES)}")
    p.add_argument("--seeds", type=int, default=1, help="seeds per strategy (default 1)")
    p.add_argument("--n-trials", type=int, default=None, help="configs per sweep (default: the experiment's)")
    p.add_argument("--timeout", type=float, default=None, help="wall seconds per sweep at most (default: none)")
    p.add_argument("--warm-up", action="store_true", help="one throwaway sweep first (compiles, captures)")
    p.add_argument("--target", type=float, default=0.02, help="regret counted as reached (default 0.02: 2%%)")
    p.add_argument("--at", type=float, default=600.0, help="wall seconds at which the table reads the pick")
    p.add_argument("--out", default="reports/tuner_live", help="folder for table.md, regret.png, runs.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _main(args)
    except (InputError, EngineInputError) as exc:
        print(f"tuner_live.py: error: {exc}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    names = [s for s in args.strategies.split(",") if s]
    if not names or any(s not in tb.STRATEGIES for s in names):
        raise InputError("--strategies", None, f"must list some of {list(tb.STRATEGIES)}", args.strategies)
    for flag, value, ok in (("--seeds", args.seeds, args.seeds >= 1), ("--at", args.at, args.at > 0),
                            ("--target", args.target, 0 <= args.target < 1),
                            ("--timeout", args.timeout, args.timeout is None or args.timeout > 0)):
        if not ok:
            raise InputError(flag, None, "is out of range (seeds >= 1, at and timeout > 0, 0 <= target < 1)", value)
    exp = tb._experiment(args, check_models=True)
    n_trials = args.n_trials or exp.study.n_trials
    if n_trials < 1:
        raise InputError("--n-trials", None, "must be >= 1", n_trials)
    cache = tb.Cache.read(Path(args.cache))
    missing = [p for p in tb.space_points(exp.search_space, "--space")
               if tb.config_key(tb.full_config({**exp.fixed_engine, **p})) not in cache.entries]
    if missing:
        raise InputError(str(args.cache), None, f"the cache lacks {len(missing)} config(s) of the search space "
                         "(measure the same grid with tuner_bench.py measure first); the first", missing[0])
    workloads = experiment.load_workloads(exp)
    m = exp.model
    worker = TimedWorker(Worker.load(m.target, m.draft, m.device, m.dtype, workloads, exp.fixed_engine))
    if args.warm_up:
        live(exp, cache, worker, workloads, tb.STRATEGIES[names[0]], 10_000, n_trials, args.target, args.timeout)
    runs = []
    for name, seed in itertools.product(names, range(args.seeds)):
        runs.append(live(exp, cache, worker, workloads, tb.STRATEGIES[name], seed, n_trials, args.target,
                         args.timeout))
        print(f"{name} seed {seed}: {runs[-1].trials} trials in {runs[-1].end_s:.1f} s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = tb.table(runs, args.target, args.at).replace("(median, s)", "(median, wall s)")
    (out / "table.md").write_text(text, encoding="utf-8")
    (out / "runs.json").write_text(json.dumps([r.to_dict() for r in runs], indent=1), encoding="utf-8")
    png = tb.plot(runs, out / "regret.png", args.target, xlabel="wall-clock tuning time (s)")
    print(text)
    print(f"table: {out / 'table.md'}\nruns: {out / 'runs.json'}\nplot: {png or 'none (no matplotlib)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
