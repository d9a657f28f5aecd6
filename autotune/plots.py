"""A study's PNG plots for its report (matplotlib, Agg backend: no display needed): the top trials with their
spread, speedup against AR per trial (inexact ones marked), the per-phase breakdown, the lead speculative trial's
AL histogram against break-even, and the best config per implementation path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import optuna  # noqa: E402
from optuna.trial import FrozenTrial  # noqa: E402

from autotune import results  # noqa: E402
from autotune.study import role_of  # noqa: E402


def write_plots(study: optuna.Study, ranked: list[FrozenTrial], w: results.Winner | None, top: int,
                out_dir: Path) -> list[Path]:
    """The plots that have data, written into ``out_dir``."""
    return [p for p in (_plot_top(study, ranked[:top], out_dir), _plot_speedup(study, out_dir),
                        _plot_phases(ranked[:5], out_dir), _plot_al(study, w, out_dir),
                        _plot_paths(study, w, out_dir)) if p is not None]


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def _plot_top(study: optuna.Study, trials: list[FrozenTrial], out: Path) -> Path | None:
    if not trials:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(trials) + 1.5))
    labels = [f"#{t.number} {results.path_of(t.user_attrs.get('config', {}))}" for t in trials][::-1]
    med = [t.user_attrs.get(results.median_key(study), 0.0) for t in trials][::-1]
    err = [t.user_attrs.get("spread", 0.0) for t in trials][::-1]
    ax.barh(labels, med, xerr=err, color=["tab:gray" if role_of(t) == "baseline" else "tab:blue"
                                          for t in trials][::-1], capsize=3)
    ax.set_xlabel(f"{results.unit(study, long=True)}: median ± 1.4826·MAD")
    ax.set_title("Top feasible trials")
    return _save(fig, out / "top_trials.png")


def _plot_speedup(study: optuna.Study, out: Path) -> Path | None:
    pts = [(t.number, t.user_attrs["speedup_vs_ar"], results.feasible(t)) for t in results.completed(study)
           if t.user_attrs.get("speedup_vs_ar") is not None and role_of(t) != "baseline"]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.scatter([p[0] for p in pts if p[2]], [p[1] for p in pts if p[2]], label="feasible")
    ax.scatter([p[0] for p in pts if not p[2]], [p[1] for p in pts if not p[2]], marker="x", color="red",
               label="inexact (infeasible)")
    ax.axhline(1.0, color="gray", linestyle="--", label="AR")
    ax.set_xlabel("trial")
    ax.set_ylabel("speedup vs AR (median ratio)")
    ax.legend()
    return _save(fig, out / "speedup_vs_ar.png")


def _plot_phases(trials: list[FrozenTrial], out: Path) -> Path | None:
    trials = [t for t in trials if t.user_attrs.get("phase_ms_per_step") and role_of(t) != "baseline"]
    if not trials:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = [0.0] * len(trials)
    names = [f"#{t.number}" for t in trials]
    for p in results.PHASES:
        vals = [t.user_attrs["phase_ms_per_step"].get(p, 0.0) for t in trials]
        ax.bar(names, vals, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.scatter(names, [t.user_attrs.get("step_ms", 0.0) for t in trials], color="black", marker="_", s=400,
               label="step time", zorder=3)
    ax.set_ylabel("ms per step")
    ax.legend(fontsize="small")
    return _save(fig, out / "phases.png")


def _plot_al(study: optuna.Study, w: results.Winner | None, out: Path) -> Path | None:
    spec = results.speculative_lead(study, w)
    if not spec or not spec[0].user_attrs.get("al_histogram"):
        return None
    t = spec[0]
    hist = {int(k): v for k, v in t.user_attrs["al_histogram"].items()}
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(list(hist), list(hist.values()))
    be = results.break_even_al(study, t)
    if be:
        ax.axvline(be, color="red", linestyle="--", label=f"break-even AL {be:.2f}")
        ax.legend()
    ax.set_xlabel("tokens committed per step (AL)")
    ax.set_ylabel("steps")
    who = "the winner" if w is not None and t.number == w.trial else "best speculative trial"
    ax.set_title(f"AL histogram, {who} #{t.number}")
    return _save(fig, out / "al_histogram.png")


def _plot_paths(study: optuna.Study, w: results.Winner | None, out: Path) -> Path | None:
    best = results.best_per_path(study, w)
    if not best:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(best) + 1.5))
    ax.barh([f"{p} (#{t.number})" for p, t in best][::-1], [t.value for _, t in best][::-1],
            color=["tab:green" if w is not None and t.number == w.trial else "tab:blue" for _, t in best][::-1])
    ax.set_xlabel("search value (median − spread), tok/s; green: the winner")
    ax.set_title("Best config per implementation path")
    return _save(fig, out / "paths.png")
