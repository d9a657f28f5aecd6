"""How fast does the tuner reach the right answer? A ground-truth benchmark of the search itself.

    # 1. measure every config of a small grid once (on the device the experiment names), cached:
    python benchmarks/tuner_bench.py measure experiments/smollm2-h200.yaml \\
        --space search_spaces/bench_grid.yaml --cache bench/smollm2-grid.jsonl --repeats 7
    # 2. replay the tuner's strategies against the cache, several seeds each:
    python benchmarks/tuner_bench.py replay experiments/smollm2-h200.yaml --space search_spaces/bench_grid.yaml \\
        --cache bench/smollm2-grid.jsonl --seeds 5 --n-trials 40 --out reports/tuner_bench

**measure** runs the experiment's measurement protocol (``autotune.worker.Worker``: warm-up, the
passes, exactness against AR) on every config the search space ``--space`` can produce (its grid;
``when:`` conditions respected), plus the AR baseline and the reference config, at full fidelity and
at every rung of the experiment's fidelity ladder. One JSONL line per config holds each fidelity's
tok/s of **every pass**, the per-prompt rates, exactness, and the seconds a pass took. A line
already in the cache is not measured again (an interrupted run resumes).
``--only KEY=VALUE,...`` measures a part of the grid (the cache grows call by call);
``--extrapolate-slow RATIO`` estimates the full fidelity of a config that far behind the reference
at the rung instead of measuring it (``tuner_grid``: an overnight experiment's slow paths would
take hours), ``--validate N`` checks the estimate on N of them. Configs that differ only in a
dimension the target cannot see (``rollback`` on a dense target) are measured once and the twins
carry that measurement (``--measure-twins`` measures each).

**replay** runs the real driver (``autotune.sweep.run_sweep``: sampler, pruner, fidelity ladder,
dimension fixing, confirmation) with a :class:`ReplayWorker` in place of the engine: it implements
the worker's ``measure(job, on_first_pass, on_progress) -> Record`` and answers each job from the
cache, each pass drawn at random (seeded) from that config's measured passes at that fidelity (noise
as measured, outliers included), and charges simulated time: the measured seconds per pass times the
passes the job runs (warm-up included; a pruned job stops early and costs less). Driver overhead and
the AR reference outputs are not charged (the same for every strategy). Strategies:

- ``ours``: the project's tuner: TPE, the Wilcoxon pruner, the experiment's fidelity ladder,
  dimensions that cannot matter fixed (``autotune.dimensions``);
- ``before``: the tuner before issue #25: TPE and the Wilcoxon pruner, no ladder, nothing fixed (but
  ``kernels`` on a cache measured off CUDA: the worker reports the cache's device);
- ``tpe``, ``random``, ``gp``: that sampler (Optuna's GPSampler for ``gp``), no pruner, no ladder; the
  dimensions that cannot matter are fixed as for ``ours`` (the comparison is the sampler's).

``benchmarks/tuner_live.py`` runs the same strategies live (the real worker, wall-clock time) and
scores them against this cache.

The ground truth of a config is the median of its cached full-fidelity passes; the optimum is the
best exact (``exactness: strict``) config of the grid, AR and the reference included. Per run:
the **found** regret curve, (optimum − the best true value among the configs measured in full so
far) / optimum over simulated time (non-increasing by construction); the time it first comes within
``--target`` (2%) of the optimum; the regret of the study's **pick** at ``--at`` seconds (its best
conservative value then, unconfirmed: what stopping the sweep there gives); the confirmed winner's
regret and the sweep's end time. The table
gives medians over seeds; the PNG the median curve and the min–max band per strategy.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
import json
import random
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))  # tuner_grid, when this file is loaded as a module

# the grid and its cache live in tuner_grid; re-exported here for tuner_live and the tests
from tuner_grid import (  # noqa: E402, F401
    FULL,
    Cache,
    config_key,
    fidelity_key,
    full_config,
    measure_grid,
    parse_only,
    space_points,
)

from autotune import experiment, results  # noqa: E402
from autotune import study as st  # noqa: E402
from autotune.errors import InputError  # noqa: E402
from autotune.executors import LocalExecutor  # noqa: E402
from autotune.record import Job, Record  # noqa: E402
from autotune.space import load_space  # noqa: E402
from autotune.storage import parse_storage  # noqa: E402
from autotune.sweep import SweepOptions, run_sweep  # noqa: E402
from autotune.tracking import config_label  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    sampler: str
    pruner: str
    ladder: bool  # the experiment's fidelity ladder (False: every trial measured in full at once)
    fix_dimensions: bool  # autotune.dimensions (False: the workers do not say what the target is)


STRATEGIES = {s.name: s for s in (
    Strategy("ours", "tpe", "wilcoxon", ladder=True, fix_dimensions=True),
    Strategy("before", "tpe", "wilcoxon", ladder=False, fix_dimensions=False),
    Strategy("tpe", "tpe", "none", ladder=False, fix_dimensions=True),
    Strategy("random", "random", "none", ladder=False, fix_dimensions=True),
    Strategy("gp", "gp", "none", ladder=False, fix_dimensions=True),
)}



class ReplayWorker:
    """The worker's measurement interface, answered from the cache with simulated time."""

    def __init__(self, cache: Cache, seed: int, fix_dimensions: bool = True,
                 extrapolated_scale: float = 1.0) -> None:
        self.cache, self.rng = cache, random.Random(seed)
        # an extrapolated full fidelity's seconds are an estimate (tuner_grid.extrapolated); the
        # replay can charge them scaled, to show how much a result leans on that estimate
        self.extrapolated_scale = extrapolated_scale
        h = cache.header
        self.id = "replay:0"
        self.pair = SimpleNamespace(device=h.get("device", "cpu"), dtype=h.get("dtype", "float32"))
        self.facts = dict(h.get("facts", {})) if fix_dimensions else {}
        self.clock = 0.0  # simulated seconds charged so far
        self.finished: dict[tuple[int, str], float] = {}  # (trial, role) -> the clock when its last job ended

    def limits(self) -> dict[str, Any]:
        return {"context": None, "longest_prompt": None, "recurrent_state": self.facts.get("recurrent_state"),
                "tools": self.facts.get("tools")}

    def environment(self) -> dict[str, Any]:
        return {}  # no identity: a replayed baseline is never reused

    def measure(self, job: Job, on_first_pass: Any = None, on_progress: Any = None) -> Record:
        rec = Record(trial=job.trial, role=job.role, worker=self.id, config=dict(job.config), rung=job.rung,
                     device=self.pair.device, dtype=self.pair.dtype)
        key = fidelity_key(job.prompts, job.max_new_tokens, self.cache.header["max_new_tokens"])
        f = self.cache.entry(job.config)["fidelities"].get(key)
        if f is None:
            raise InputError(str(self.cache.path), None, f"the cache holds no {key} measurement of this config "
                             "(measure with the same experiment and fidelity ladder)", job.config)
        if f.get("refused"):
            rec.refused = f["refused"]  # the engine refuses before measuring: no time
        elif not f.get("ok"):
            rec.ok, rec.fail_reason = False, f.get("fail_reason", "failed when measured")
            self._charge(rec, self._seconds_per_pass(f) * max(job.warmup, 1))
        else:
            self._replay(job, f, rec, on_first_pass)
        self.finished[(job.trial, job.role)] = self.clock
        return rec

    def _replay(self, job: Job, f: dict[str, Any], rec: Record, on_first_pass: Any) -> None:
        measured = f["decode_tps_runs"]
        median = statistics.median(measured)
        for i in range(job.repeats):
            rec.decode_tps_runs.append(self.rng.choice(measured))
            if i == 0 and on_first_pass is not None:
                scale = rec.decode_tps_runs[0] / median if median > 0 else 1.0
                if on_first_pass([p * scale for p in f["per_prompt_tps"]]):
                    rec.pruned = True
                    break
        rec.e2e_tps_runs = list(rec.decode_tps_runs)
        rec.per_prompt_tps = list(f["per_prompt_tps"])
        rec.acceptance_length, rec.steps, rec.step_ms = f["acceptance_length"], f["steps"], f["step_ms"]
        rec.exact_match = None if rec.pruned else f["exact_match"]
        self._charge(rec, self._seconds_per_pass(f) * (job.warmup + len(rec.decode_tps_runs)))

    def _seconds_per_pass(self, f: dict[str, Any]) -> float:
        return f["seconds_per_pass"] * (self.extrapolated_scale if "extrapolated" in f else 1.0)

    def _charge(self, rec: Record, seconds: float) -> None:
        self.clock += seconds
        rec.elapsed_s = rec.engine_s = seconds



# ------------------------------------------------------------------------------------------ replay


@dataclasses.dataclass
class Run:
    strategy: str
    seed: int
    curve: list[tuple[float, float]]  # (simulated seconds, found regret), a point per trial measured in full
    # (simulated seconds, regret of the study's pick then: its best conservative value, unconfirmed),
    # what a user stopping the sweep at that moment would get
    pick_curve: list[tuple[float, float]]
    time_to_target: float | None
    winner_regret: float | None
    end_s: float
    trials: int
    pruned: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def replay(exp: experiment.Experiment, cache: Cache, strategy: Strategy, seed: int, n_trials: int,
           target: float, timeout_s: float | None = None, extrapolated_scale: float = 1.0) -> Run:
    """One sweep of ``strategy`` against the cache; its regret over simulated time. ``timeout_s``: the
    sweep's ``--timeout`` on the simulated clock (no trial starts after it; the running ones and the
    confirmation finish, as in a real sweep). ``extrapolated_scale``: extrapolated full fidelities'
    seconds charged times this."""
    worker = ReplayWorker(cache, seed, strategy.fix_dimensions, extrapolated_scale)
    workloads = [SimpleNamespace(**w) for w in cache.header["workloads"]]
    return sweep_run(exp, cache, strategy, seed, n_trials, target, worker, workloads, timeout_s,
                     clock=lambda: worker.clock)


def strategy_experiment(exp: experiment.Experiment, strategy: Strategy, seed: int,
                        n_trials: int) -> experiment.Experiment:
    """The experiment as ``strategy`` runs it: its sampler and pruner, the ladder or none."""
    ladder = exp.fidelity if strategy.ladder else dataclasses.replace(exp.fidelity, rungs=())
    return dataclasses.replace(exp, fidelity=ladder, study=dataclasses.replace(
        exp.study, sampler=strategy.sampler, pruner=strategy.pruner, seed=seed, n_trials=n_trials))


def sweep_run(exp: experiment.Experiment, cache: Cache, strategy: Strategy, seed: int, n_trials: int,
              target: float, worker: Any, workloads: list[Any], timeout_s: float | None = None,
              clock: Any = None) -> Run:
    """One sweep of ``strategy`` with ``worker`` (a ``ReplayWorker``, or a live one: the worker's
    ``measure`` interface, ``finished[(trial, role)]`` the seconds at which each trial's last job
    ended and ``clock`` the seconds so far), its regret over that time against the cache's truth.
    ``clock``: what ``timeout_s`` is measured on (default the wall clock)."""
    opts = SweepOptions(n_trials=n_trials, storage=parse_storage("memory"), study_name=f"{strategy.name}-{seed}",
                        tracking_uri=None, progress=False, timeout_s=timeout_s,
                        **({} if clock is None else {"clock": clock}))
    with contextlib.redirect_stderr(io.StringIO()):  # the sweep's per-trial lines: the table says it all
        outcome = run_sweep(strategy_experiment(exp, strategy, seed, n_trials), opts, workloads,
                            executor=LocalExecutor(lambda: worker), out=io.StringIO())
    strict = exp.measure.exactness == "strict"
    best, _ = cache.optimum(strict)
    found, pick, curve, pick_curve = None, None, [], []
    trials = sorted(outcome.study.trials, key=lambda t: worker.finished.get((t.number, st.role_of(t)), float("inf")))
    for t in trials:
        if t.state.name != "COMPLETE" or not results.feasible(t):
            continue
        when = worker.finished[(t.number, st.role_of(t))]
        truth = cache.truth(t.user_attrs.get("config", {}), strict)
        if truth is not None:
            found = truth if found is None else max(found, truth)
            curve.append((when, (best - found) / best))
        if pick is None or (t.value or 0.0) > (pick.value or 0.0):
            pick = t
        picked = cache.truth(pick.user_attrs.get("config", {}), strict)
        if picked is not None:
            pick_curve.append((when, (best - picked) / best))
    reached = next((s for s, r in curve if r <= target), None)
    w = results.winner(outcome.study)
    won = cache.truth(w.config, strict) if w is not None else None
    return Run(strategy.name, seed, curve, pick_curve, reached, None if won is None else (best - won) / best,
               worker.clock, len(outcome.study.trials), sum(t.state.name == "PRUNED" for t in outcome.study.trials))


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def table(runs: list[Run], target: float, at_s: float) -> str:
    lines = [f"| strategy | seeds | reached {target:.0%} | time to {target:.0%} (median, s) | pick's regret at "
             f"{at_s:g} s (median) | confirmed winner's regret (median) | sweep time (median, s) | trials | pruned |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r.strategy for r in runs):
        rs = [r for r in runs if r.strategy == name]
        reached = [r for r in rs if r.time_to_target is not None]
        regrets = [r.winner_regret for r in rs if r.winner_regret is not None]

        def fmt(v: float | None, spec: str) -> str:
            return "–" if v is None else format(v, spec)

        # a run that never came within the target counts as infinitely late: the median says "never"
        # when half the seeds or more never did
        late = _median([r.time_to_target if r.time_to_target is not None else float("inf") for r in rs])
        lines.append(f"| {name} | {len(rs)} | {len(reached)}/{len(rs)} | "
                     f"{'never' if late == float('inf') else fmt(late, '.1f')} | "
                     f"{fmt(_median([regret_at(r.pick_curve, at_s) for r in rs]), '.2%')} | "
                     f"{fmt(_median(regrets), '.2%')} | {fmt(_median([r.end_s for r in rs]), '.1f')} | "
                     f"{fmt(_median([r.trials for r in rs]), '.0f')} | {fmt(_median([r.pruned for r in rs]), '.0f')} |")
    return "\n".join(lines) + "\n"


def regret_at(curve: list[tuple[float, float]], t: float) -> float:
    """A curve's regret at simulated time ``t`` (1.0 before its first point)."""
    value = 1.0
    for s, r in curve:
        if s > t:
            break
        value = r
    return value


def plot(runs: list[Run], path: Path, target: float, xlabel: str = "simulated tuning time (s)") -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return None
    horizon = max((r.end_s for r in runs), default=0.0) or 1.0
    # time on a log axis: the first trials (seconds) and a slow strategy's hours in one picture
    first = min((t for r in runs for t, _ in r.curve if t > 0), default=horizon / 100)
    start = min(first, horizon) / 2
    grid_t = [start * (horizon / start) ** (i / 400) for i in range(401)]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in dict.fromkeys(r.strategy for r in runs):
        rs = [r for r in runs if r.strategy == name]
        at = [[regret_at(r.curve, t) for r in rs] for t in grid_t]
        line, = ax.step(grid_t, [statistics.median(v) for v in at], where="post", label=name)
        ax.fill_between(grid_t, [min(v) for v in at], [max(v) for v in at], step="post", alpha=0.15,
                        color=line.get_color())
    ax.axhline(target, color="gray", linestyle="--", linewidth=0.8, label=f"{target:.0%} of the optimum")
    ax.set_xscale("log")
    ax.set_xlabel(xlabel + ", log scale")
    # the interesting part is near the target: regrets above 5x it are drawn at the top
    top = max(5 * target, 0.01)
    ax.set_ylabel(f"regret of the best config found (above {top:.0%}: at the top)")
    ax.set_ylim(0, top)
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_title("Regret over time (median over seeds, min–max band)")
    ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------ CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tuner_bench.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="measure every config of the grid once (cached as JSONL)")
    r = sub.add_parser("replay", help="run the tuner's strategies against the cache")
    for s in (m, r):
        s.add_argument("experiment", help="experiment YAML (model, workload, measure, fidelity)")
        s.add_argument("--space", help="the grid's search space (default: the experiment's)")
        s.add_argument("--cache", required=True, help="the JSONL cache of measured configs")
    m.add_argument("--repeats", type=int, default=None, help="passes per config and fidelity (default: "
                   "the experiment's measure.repeats): the replay draws its passes from these")
    m.add_argument("--only", default=None, metavar="KEY=VALUE,...",
                   help="measure only the grid configs with these values (AR and the reference always), e.g. "
                        "draft_path=runtime,kernels=fused: the half that can hold the optimum first")
    m.add_argument("--extrapolate-slow", type=float, default=None, metavar="RATIO",
                   help="a config RATIO times or more behind the reference at the last rung is not measured "
                        "in full: its full fidelity is estimated from the rung (tuner_grid's docstring)")
    m.add_argument("--measure-twins", action="store_true",
                   help="measure configs that differ only in a dimension the target cannot see (rollback on a "
                        "dense target, kernels off CUDA) too, instead of giving them their twin's measurement")
    m.add_argument("--validate", type=int, default=0, metavar="N",
                   help="with --extrapolate-slow: measure the first N slow configs in full anyway, the "
                        "estimate kept beside (default 0)")
    r.add_argument("--strategies", default="ours,before,tpe,random,gp",
                   help=f"comma-separated, of {', '.join(STRATEGIES)}")
    r.add_argument("--seeds", type=int, default=3, help="seeds per strategy (default 3)")
    r.add_argument("--n-trials", type=int, default=None, help="configs per sweep (default: the experiment's)")
    r.add_argument("--target", type=float, default=0.02, help="regret counted as reached (default 0.02: 2%%)")
    r.add_argument("--at", type=float, default=600.0, help="simulated seconds at which the table reads the "
                   "study's pick (default 600: what a 10-minute sweep would give)")
    r.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="each sweep's --timeout in simulated seconds: no trial starts after it, the confirmation "
                        "still runs (the sweep time column says when it ended)")
    r.add_argument("--extrapolated-scale", type=float, default=1.0, metavar="F",
                   help="charge the extrapolated full fidelities' seconds times F (default 1): how much a result "
                        "leans on the estimate (a config measured both ways shows its error: `--validate`)")
    r.add_argument("--out", default="reports/tuner_bench", help="folder for table.md, regret.png, runs.json")
    return p


def _experiment(args: argparse.Namespace, check_models: bool) -> experiment.Experiment:
    exp = experiment.load(args.experiment, check_models=check_models)
    if args.space:
        space_path = Path(args.space).resolve()
        exp = dataclasses.replace(exp, search_space=load_space(space_path))
    return exp


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "measure":
            exp = _experiment(args, check_models=True)
            repeats = args.repeats if args.repeats is not None else exp.measure.repeats
            if repeats < 1:
                raise InputError("--repeats", None, "must be >= 1", repeats)
            if args.extrapolate_slow is not None and not args.extrapolate_slow > 1:
                raise InputError("--extrapolate-slow", None, "must be a ratio > 1", args.extrapolate_slow)
            if args.extrapolate_slow is not None and not exp.ladder:
                raise InputError("--extrapolate-slow", None, "needs the experiment's fidelity ladder (a rung to "
                                 "extrapolate from)", args.extrapolate_slow)
            if args.validate < 0 or (args.validate and args.extrapolate_slow is None):
                raise InputError("--validate", None, "must be >= 0, and given only with --extrapolate-slow",
                                 args.validate)
            n = measure_grid(exp, exp.search_space, Path(args.cache), repeats,
                             only=parse_only(args.only, exp.search_space), extrapolate_slow=args.extrapolate_slow,
                             validate=args.validate, measure_twins=args.measure_twins)
            print(f"measured: {n}\ncache: {args.cache}")
            return 0
        return _replay_main(args)
    except InputError as exc:
        print(f"tuner_bench.py: error: {exc}", file=sys.stderr)
        return 2


def _replay_main(args: argparse.Namespace) -> int:
    exp = _experiment(args, check_models=False)
    names = [s for s in args.strategies.split(",") if s]
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown or not names:
        raise InputError("--strategies", None, f"must list some of {list(STRATEGIES)}", args.strategies)
    if args.seeds < 1:
        raise InputError("--seeds", None, "must be >= 1", args.seeds)
    if not args.at > 0:
        raise InputError("--at", None, "must be simulated seconds > 0", args.at)
    if args.timeout is not None and not args.timeout > 0:
        raise InputError("--timeout", None, "must be simulated seconds > 0", args.timeout)
    if not args.extrapolated_scale > 0:
        raise InputError("--extrapolated-scale", None, "must be a factor > 0", args.extrapolated_scale)
    if not 0 <= args.target < 1:
        raise InputError("--target", None, "must be a regret fraction >= 0 and < 1", args.target)
    n_trials = args.n_trials or exp.study.n_trials
    if n_trials < 1:
        raise InputError("--n-trials", None, "must be >= 1", n_trials)
    cache = Cache.read(Path(args.cache))
    runs = [replay(exp, cache, STRATEGIES[name], seed, n_trials, args.target, args.timeout, args.extrapolated_scale)
            for name, seed in itertools.product(names, range(args.seeds))]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = table(runs, args.target, args.at)
    (out / "table.md").write_text(text, encoding="utf-8")
    (out / "runs.json").write_text(json.dumps([r.to_dict() for r in runs], indent=1), encoding="utf-8")
    png = plot(runs, out / "regret.png", args.target)
    best, config = cache.optimum(exp.measure.exactness == "strict")
    print(text)
    print(f"optimum: {best:.2f} tok/s {config_label(config)}")
    guessed = sum("extrapolated" in (e["fidelities"].get(FULL) or {}) for e in cache.entries.values())
    if guessed:
        scaled = f", their seconds charged x{args.extrapolated_scale:g}" if args.extrapolated_scale != 1 else ""
        print(f"extrapolated: {guessed} config(s)' full fidelity estimated from the rung (tuner_grid){scaled}")
    checks = [(e["fidelities"][FULL]["seconds_per_pass"] / e["fidelities"][FULL]["estimate"]["seconds_per_pass"],
               config_label(e["config"])) for e in cache.entries.values()
              if "estimate" in (e["fidelities"].get(FULL) or {}) and "same_program_as" not in e]
    if checks:
        print("validated: measured / estimated seconds a pass " + ", ".join(f"{r:.2f} ({lab})" for r, lab in checks))
    twins = sum("same_program_as" in e for e in cache.entries.values())
    if twins:
        print(f"twins: {twins} config(s) run another's program (a dimension the target cannot see) and carry "
              "its measurement (tuner_grid)")
    print(f"table: {out / 'table.md'}\nruns: {out / 'runs.json'}\nplot: {png or 'none (no matplotlib)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
