"""MLflow logging, driver side only: a parent run per sweep, a nested run per trial.

The Optuna storage is the source of truth; MLflow is the morning dashboard. A resumed sweep
reuses its parent run (its id is kept in the study's user attributes) and logs every finished
trial that has no run yet, so a crash never leaves a gap. ``--tracking-uri none`` disables it.

The parent run answers the morning's question on its own row: the winner's figures as metrics
(``winner.*``, ``ar.decode_tps_median``), its config as params (``winner.*``: only the fields that
apply to its verify mode), tags (``winner_trial``, ``winner_config``, ``exact``, ``conclusion``,
``reliable``), a name and a description (``mlflow.note.content``) that say the same in words;
updated after every trial and when the sweep ends, when the report (markdown and PNGs, the
``autotune report`` output) becomes its artifacts under ``report/``. Child runs are named by
their path and key parameters (``ddtree/runtime b48 k4 t0.7 (#12)``, ``AR baseline (worker W, #0)``)
and tagged with their ``role`` (baseline, reference, search).
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune import results
from autotune.errors import InputError
from autotune.results import applicable_config
from autotune.study import role_of

_STATUS = {TrialState.COMPLETE: "FINISHED", TrialState.PRUNED: "FINISHED", TrialState.FAIL: "FAILED"}
_METRICS = ("decode_tps_median", "spread", "rel_mad", "acceptance_length", "speedup_vs_ar", "break_even_al",
            "exact_match", "step_ms", "e2e_tps_median", "ar_decode_tps", "oracle_gate_fraction",
            "oracle_gate_tps", "peak_memory_bytes", "vram_limit_bytes", "util_percent", "trial_wall_s", "engine_s",
            "inexact_count",
            "partial_decode_tps",  # a pruned trial's partial figure (it has no value)
            "policy_ar_step_fraction", "policy_predicted_al", "policy_observed_al",  # the adaptive policy's
            # a session study's (objective session_tps): beside decode's, never instead
            "session_tps_median", "ar_session_tps", "decode_speedup_vs_ar", "ttft_first_ms", "ttft_later_ms",
            "cached_share_later")
# a trial's records logged as JSON artifacts (per_workload.json holds each workload's budget histogram too;
# divergences: at most worker.MAX_DIAGNOSED small records)
_ARTIFACTS = (("al_histogram", "al_histogram.json"), ("per_set", "per_workload.json"),
              ("budget_histogram", "budget_histogram.json"), ("divergences", "divergences.json"))
# how a run's name writes a parameter (the rest: name=value, or the value alone for rollback and kernels)
_SHORT = {"budget": "b", "top_k": "k", "proposal_temp": "t", "chain_seed": "cs", "target_feat_ctx": "ctx",
          "block_size": "blk"}
_ALWAYS_SHOWN = ("budget", "top_k")  # a tree's size, even at the engine's defaults
REPORT_DIR = "report"  # the parent run's artifact folder for `autotune report`'s output


def config_label(config: dict[str, Any]) -> str:
    """A config in a few words: ``verify/draft_path``, then the budget and top-k of a tree and every
    other applicable field that differs from the engine's default (``ddtree/runtime b48 k4 t0.7``)."""
    from engine import EngineConfig

    cfg = applicable_config(config)
    defaults = EngineConfig().to_dict()
    parts = [f"{cfg.get('verify', '?')}/{cfg.get('draft_path', '?')}"]
    for key, value in cfg.items():
        if key in ("verify", "draft_path") or (key not in _ALWAYS_SHOWN and value == defaults.get(key, value)):
            continue
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        if key in _SHORT:
            parts.append(f"{_SHORT[key]}{shown}")
        else:
            parts.append(shown if key in ("rollback", "kernels") else f"{key}={shown}")
    return " ".join(parts)


def run_name(t: FrozenTrial) -> str:
    """A trial's run name: its role, path and key parameters, and its number (the report's)."""
    a = t.user_attrs
    role = role_of(t)
    if role == "baseline":
        return f"AR baseline (worker {a.get('worker', '?')}, #{t.number})"
    label = config_label(a.get("config", {}))
    return f"{'reference ' if role == 'reference' else ''}{label} (#{t.number})"


def trial_tags(t: FrozenTrial, config: dict[str, Any]) -> dict[str, str]:
    """A trial run's tags: its number, role, state, worker and feasibility, its path, and why it failed,
    was refused, went over the memory limit, or reused a baseline."""
    a = t.user_attrs
    tags = {"autotune.trial": str(t.number), "autotune.role": role_of(t), "role": role_of(t),
            "autotune.state": t.state.name, "worker": str(a.get("worker", "")), "feasible": str(_feasible(t))}
    tags.update({k: str(config[k]) for k in ("verify", "draft_path", "rollback") if k in config})
    # why it failed, was refused by the engine, or is over model.vram_limit (by how much, which part dominates)
    tags.update({k: str(a[k])[:4000] for k in ("fail_reason", "refused", "over_vram") if a.get(k)})
    if a.get("peak_memory_kind"):  # peak_memory_bytes measured on CUDA, or planned (autotune.vram)
        tags["peak_memory_kind"] = str(a["peak_memory_kind"])
    if a.get("noisy"):
        tags["noisy"] = "true"
    if a.get("baseline_trial") is not None:  # the AR trial its speedup divides by
        tags["baseline_trial"] = str(a["baseline_trial"])
    if a.get("baseline_reused"):
        tags["baseline_reused"] = "true"
    return tags


def trial_metrics(t: FrozenTrial) -> dict[str, float]:
    """A trial run's metrics: ``_METRICS``, its value, the phases per step, the divergence verdicts,
    the adaptive policy's steps per budget and the peak memory per part."""
    a = t.user_attrs
    metrics = {k: a[k] for k in _METRICS if isinstance(a.get(k), (int, float)) and not isinstance(a.get(k), bool)}
    if t.value is not None:
        metrics["value"] = t.value
    for phase, ms in a.get("phase_ms_per_step", {}).items():
        metrics[f"phase_ms.{phase}"] = ms
    for verdict, n in a.get("divergence_verdicts", {}).items():  # "numeric tie" -> verdict.numeric_tie
        metrics[f"verdict.{verdict.replace(' ', '_')}"] = n
    for budget, n in (a.get("budget_histogram") or {}).items():  # the adaptive policy's steps per budget
        metrics[f"budget_steps.{budget}"] = n
    memory = a.get("memory") or {}
    for part, n in (memory.get("parts") or {}).items():  # the peak per part (engine.memory)
        metrics[f"memory.{part}"] = n
    if memory.get("idle_pair_bytes"):  # a weights search: the other form's pair, left out of that peak
        metrics["memory.idle_pair_bytes"] = memory["idle_pair_bytes"]
    return metrics


def conclusion(w: results.Winner | None) -> tuple[str, str]:
    """(tag value, sentence): what the sweep concluded about its winner against plain AR decoding:
    ``positive``, ``tie``, ``ar won`` or ``no conclusion`` (and why)."""
    if w is None:
        return "no conclusion", "No feasible trial finished yet."
    if w.drift is not None:
        return "no conclusion", f"No conclusion: the study is unreliable ({w.drift.describe()})."
    if not w.confirmed:
        return "no conclusion", "No conclusion: the winner was not confirmed by re-measurement."
    if w.role == "baseline":
        return "ar won", "Plain AR decoding won: no speculative config beat it on this machine and workload."
    if w.positive_vs_ar is None:
        return "no conclusion", "No conclusion vs AR: the AR baseline was not re-measured in the confirmation."
    if w.positive_vs_ar:
        return "positive", "Positive: confirmed, and its margin over AR is more than twice the measured spread."
    return "tie", "A tie with AR: confirmed, but its margin over AR is within twice the spread."


def exactness(w: results.Winner | None) -> str:
    """``true`` (every output equal to AR's), ``false`` or ``unknown`` (not measured)."""
    if w is None or w.exact_match is None:
        return "unknown"
    return "true" if w.exact_match >= 1.0 else "false"


def winner_metrics(w: results.Winner | None, counts: dict[str, int]) -> dict[str, float]:
    """The parent run's metrics: the winner's figures (those measured) and how much was measured."""
    out: dict[str, float] = {"configs_measured": counts["finished"], "baselines_measured": counts["baselines"]}
    if w is None:
        return out
    obj = w.objective  # the objective's figures under its name; decode tok/s always
    figures = {f"winner.{obj}_median": w.median_tps, f"winner.{obj}_spread": w.spread,
               "winner.conservative_tps": w.value, "winner.speedup_vs_ar": w.speedup_vs_ar,
               "winner.acceptance_length": w.acceptance_length, "winner.exact_match": w.exact_match,
               "winner.break_even_al": w.break_even_al, f"ar.{obj}_median": w.ar_median_tps,
               **({"winner.decode_tps_median": w.decode_tps} if obj != "decode_tps" else {})}
    out.update({k: float(v) for k, v in figures.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out


def headline(study_name: str, w: results.Winner | None) -> str:
    """The parent run's name: the study and, once there is a winner, its figures (a name is the one
    thing the MLflow runs table shows before any column is picked)."""
    if w is None:
        return study_name
    speedup = "n/a" if w.speedup_vs_ar is None else f"{w.speedup_vs_ar:.2f}x"
    al = "" if w.acceptance_length is None else f", AL {w.acceptance_length:.2f}"
    exact = {"true": "exact", "false": "INEXACT", "unknown": "exactness unknown"}[exactness(w)]
    unit = "session tok/s" if w.objective == "session_tps" else "tok/s"
    return (f"{study_name}: {config_label(w.config)} {speedup} AR, {w.median_tps:.1f} {unit}{al}, {exact}, "
            f"{conclusion(w)[0]}")


def description(study_name: str, w: results.Winner | None, counts: dict[str, int], status: str,
                stale_params: str | None = None, report_error: str | None = None) -> str:
    """The parent run's description (markdown): the winner, its speedup with the spread, whether it
    is exact, the conclusion, and what was measured."""
    running = status == "RUNNING"
    L = [f"### {study_name}: {'best so far (the sweep is running)' if running else 'winner'}", ""]
    if w is None:
        L += ["No feasible trial finished yet.", ""]
    else:
        speedup = "no speedup measured (no AR baseline)" if w.speedup_vs_ar is None else \
            f"**{w.speedup_vs_ar:.2f}x AR**"
        ar = "" if w.ar_median_tps is None else f" against AR's {w.ar_median_tps:.2f} tok/s"
        al = "" if w.acceptance_length is None else f", AL {w.acceptance_length:.2f}"
        exact = {"true": "**exact** (every output equal to AR's, token for token)",
                 "false": f"**INEXACT** (exact match {w.exact_match or 0.0:.2f})",
                 "unknown": "exactness not measured"}[exactness(w)]
        confirmed = "confirmed by re-measurement" if w.confirmed else "not confirmed"
        unit = "session tok/s" if w.objective == "session_tps" else "tok/s decode-only"
        L += [f"Trial {w.trial} ({w.role}), `{config_label(w.config)}`: {speedup}: "
              f"{w.median_tps:.2f} ± {w.spread:.2f} {unit}{ar} (conservative score "
              f"{w.value:.2f} = median − spread{al}); {exact}; {confirmed}.", ""]
    L += [f"**Conclusion: {conclusion(w)[0]}.** {conclusion(w)[1]}", ""]
    L += [f"Measured {counts['finished']} configs and {counts['baselines']} AR baselines "
          f"({counts['baselines_reused']} reused); {counts['fail']} failed, {counts['infeasible']} infeasible, "
          f"{counts['refused']} refused by the engine.", ""]
    if stale_params:
        L += [f"⚠ {stale_params}", ""]
    if not running:
        report = (f"The report could not be written ({report_error})." if report_error else
                  f"The report (markdown and plots) is in this run's artifacts, `{REPORT_DIR}/report.md`.")
        L += [f"The sweep ended: {status}. {report}", ""]
    return "\n".join(L)


def check_tracking_uri(uri: str) -> str | None:
    """Validate without creating anything; ``none`` disables tracking. A SQLite file comes back as
    an absolute URI: MLflow keeps one store per URI string in a process, so a relative one would
    keep pointing at the folder it was first opened from."""
    if uri.lower() == "none":
        return None
    if uri.startswith("sqlite:///"):
        if uri[len("sqlite:///"):] in ("", ":memory:"):
            raise InputError("--tracking-uri", None, "an MLflow SQLite store needs a file (sqlite:///FILE)", uri)
        path = Path(uri[len("sqlite:///"):]).resolve()
        if not path.parent.is_dir():
            raise InputError("--tracking-uri", None, "the folder of the MLflow database must exist", uri)
        return f"sqlite:///{path}"
    if "://" not in uri and not uri.startswith("file:"):
        raise InputError("--tracking-uri", None, "must be an MLflow tracking URI (sqlite:///mlflow.db, "
                         "http://host:5000, file:///dir) or none", uri)
    return uri


def reach_tracking_uri(uri: str | None, timeout_s: float | None = None) -> None:
    """An ``http(s)://`` tracking server answers within the timeout (any HTTP status counts as an
    answer): checked before the model loads, so a server that is down or silent is a message in
    seconds, not a hang with the study already created."""
    if uri is None or not uri.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    from autotune.storage import REACH_TIMEOUT_S, answer_within

    limit = REACH_TIMEOUT_S if timeout_s is None else timeout_s

    def ask() -> None:
        try:
            urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=limit).close()  # noqa: S310 (the user's URI)
        except urllib.error.HTTPError:
            pass  # it answered

    error = answer_within(ask, limit + 1.0)
    if error is not None:
        raise InputError("--tracking-uri", None, f"the MLflow server does not answer ({error})", uri)


class Tracker:
    """Logs to MLflow. All methods are cheap no-ops on :class:`NullTracker`."""

    def __init__(self, uri: str, study: optuna.Study, experiment_name: str) -> None:
        for name in ("mlflow", "alembic", "alembic.runtime.migration"):
            logging.getLogger(name).setLevel(logging.WARNING)
        from mlflow import MlflowClient

        self.uri = uri
        self.client = MlflowClient(uri)
        exp = self.client.get_experiment_by_name(experiment_name)
        if exp is None:
            location = None
            if uri.startswith("sqlite:///"):  # artifacts beside the database, wherever the command ran
                location = (Path(uri[len("sqlite:///"):]).resolve().parent / "mlruns").as_uri()
            exp_id = self.client.create_experiment(experiment_name, artifact_location=location)
        else:
            exp_id = exp.experiment_id
        self.experiment_id = exp_id
        self.study = study
        self._stale_params: str | None = None  # why the parent's winner.* params are not the winner's
        self._name: str | None = None  # the parent run's name as last set
        self._report_error: str | None = None  # why the report was not logged at the sweep's end
        self.parent = self._parent_run(study)
        self._logged = self._already_logged()
        self._refresh()  # a resumed sweep's row says at once that it runs again, and what it has so far

    def _parent_run(self, study: optuna.Study) -> str:
        from mlflow.exceptions import MlflowException

        known = study.user_attrs.get("mlflow_parent_run")
        if known and known.get("uri") == self.uri:
            try:
                run = self.client.get_run(known["run_id"])
                self.client.update_run(run.info.run_id, status="RUNNING")
                return run.info.run_id
            except MlflowException:
                pass  # the MLflow database was replaced: start a new parent run
        tags = {"autotune.study": study.study_name, "autotune.role": "sweep"}
        for key in ("experiment", "git_sha", "workload_hash", "fingerprint"):
            if key in study.user_attrs:
                tags[f"autotune.{key}"] = str(study.user_attrs[key])
        run = self.client.create_run(self.experiment_id, run_name=study.study_name, tags=tags)
        model = study.user_attrs.get("model", {})
        params = {f"model.{k}": v for k, v in model.items()}
        params.update({f"engine.{k}": v for k, v in study.user_attrs.get("fixed_engine", {}).items()})
        # dimensions not searched because their value cannot matter here (autotune.dimensions)
        params.update({f"fixed.{d['name']}": d["value"] for d in study.user_attrs.get("fixed_dimensions", [])})
        self._log_params(run.info.run_id, params)
        study.set_user_attr("mlflow_parent_run", {"uri": self.uri, "run_id": run.info.run_id})
        return run.info.run_id

    def _already_logged(self) -> set[int]:
        runs = self.client.search_runs([self.experiment_id], f"tags.mlflow.parentRunId = '{self.parent}'",
                                       max_results=50_000)
        return {int(r.data.tags["autotune.trial"]) for r in runs if "autotune.trial" in r.data.tags}

    def sync(self) -> None:
        """Log every finished trial that has no nested run yet (after a crash, or one by one)."""
        missing = [t for t in self.study.get_trials(deepcopy=False)
                   if t.state.is_finished() and t.number not in self._logged]
        for t in missing:
            self.log_trial(t, refresh=False)
        if missing:
            self._refresh()

    def log_trial(self, t: FrozenTrial, refresh: bool = True) -> None:
        """The trial's nested run; then (``refresh``) the parent run's winner, which it may change."""
        a = t.user_attrs
        config = applicable_config(a.get("config", {}))
        tags = {"mlflow.parentRunId": self.parent, **trial_tags(t, config)}
        run = self.client.create_run(self.experiment_id, run_name=run_name(t), tags=tags,
                                     start_time=_ms(t.datetime_start))
        rid = run.info.run_id
        self._log_params(rid, {**config, **{f"param.{k}": v for k, v in t.params.items()}})
        metrics = trial_metrics(t)
        self._log_metrics(rid, metrics)
        for i, tps in enumerate(a.get("decode_tps_runs", [])):
            self.client.log_metric(rid, "decode_tps_run", tps, step=i)
        if a.get("phase_ms_per_step"):
            self.client.log_dict(rid, {"phase_ms_per_step": a["phase_ms_per_step"], "step_ms": a.get("step_ms"),
                                       "phase_coverage": a.get("phase_coverage")}, "phases.json")
        for key, name in _ARTIFACTS:
            if a.get(key):
                self.client.log_dict(rid, a[key], name)
        self.client.set_terminated(rid, _STATUS.get(t.state, "FAILED"), end_time=_ms(t.datetime_complete))
        self._logged.add(t.number)
        if refresh:
            self._refresh()

    def log_confirmation(self, confirmation: dict[str, Any]) -> None:
        """The confirmation's record as an artifact; the confirmed winner on the parent run."""
        self.client.log_dict(self.parent, confirmation, "confirmation.json")
        self._refresh()

    def finish(self, status: str) -> None:
        """The report and Optuna's plots on the parent run, its winner and description as the sweep
        ended (the winner's config as params once it FINISHED), then close it (FINISHED, KILLED or
        FAILED)."""
        self._log_report()
        self._refresh(status)
        self._log_plots()
        self.client.set_terminated(self.parent, status)

    def _refresh(self, status: str = "RUNNING") -> None:
        """The parent run's winner metrics, tags, name and description, from the study as it is now
        (``results.winner``: the confirmed winner, else the best conservative score so far)."""
        from mlflow.entities import Metric, RunTag

        w = results.winner(self.study)
        counts = results.state_counts(self.study)
        stale = self._log_winner_params(w) if status == "FINISHED" else self._stale_params
        now, step = int(time.time() * 1000), len(self._logged)
        metrics = [Metric(k, v, now, step) for k, v in winner_metrics(w, counts).items()]
        tags = {"winner_trial": "none" if w is None else str(w.trial),
                "winner_config": "none" if w is None else config_label(w.config),
                "exact": exactness(w), "conclusion": conclusion(w)[0],
                "confirmed": str(w is not None and w.confirmed).lower(),
                "reliable": str((w.drift if w is not None else results.ar_drift(self.study)) is None).lower(),
                "mlflow.note.content": description(self.study.study_name, w, counts, status, stale,
                                                   self._report_error)}
        self.client.log_batch(self.parent, metrics=metrics, tags=[RunTag(k, v) for k, v in tags.items()])
        name = headline(self.study.study_name, w)
        if name != self._name:
            self.client.update_run(self.parent, name=name)
            self._name = name
        if status != "RUNNING":
            self._describe_experiment(w, status)

    def _log_winner_params(self, w: results.Winner | None) -> str | None:
        """The winner's applicable config as ``winner.*`` params (and ``winner.trial``). MLflow never
        changes a param: when a resumed sweep's winner differs from the one logged, the params stay
        and the returned sentence says so (the tags and the description are the current winner)."""
        if w is None:
            return None
        want = {f"winner.{k}": v for k, v in {"trial": w.trial, **applicable_config(w.config)}.items()}
        want = {k: v if isinstance(v, str) else json.dumps(v) for k, v in want.items()}
        have = {k: v for k, v in self.client.get_run(self.parent).data.params.items() if k.startswith("winner.")}
        if any(have.get(k, v) != v for k, v in want.items()) or set(have) - set(want):
            self._stale_params = (f"The `winner.*` params are trial {have.get('winner.trial', '?')}'s config, the "
                                  f"winner when they were logged; the winner is now trial {w.trial} "
                                  f"(`{config_label(w.config)}`, tags `winner_trial`, `winner_config`): MLflow "
                                  "params cannot change.")
            return self._stale_params
        self._log_params(self.parent, {k: v for k, v in want.items() if k not in have})
        self._stale_params = None
        return None

    def _describe_experiment(self, w: results.Winner | None, status: str) -> None:
        """The experiment's description (the MLflow experiments list shows it) names the latest sweep
        that ended, unless someone else wrote a description there."""
        exp = self.client.get_experiment(self.experiment_id)
        if "mlflow.note.content" in exp.tags and exp.tags.get("autotune.note") != "true":
            return
        self.client.set_experiment_tag(self.experiment_id, "autotune.note", "true")
        self.client.set_experiment_tag(self.experiment_id, "mlflow.note.content",
                                       f"Latest sweep ({status.lower()}): {headline(self.study.study_name, w)}")

    def _log_report(self) -> None:
        """`autotune report`'s markdown and PNGs as the parent run's artifacts (``report/``)."""
        from autotune.report import write_report

        with tempfile.TemporaryDirectory() as tmp:
            try:
                write_report(self.study, Path(tmp))
            except Exception as exc:  # a report that cannot be written must not lose the sweep's end
                self._report_error = f"{type(exc).__name__}: {exc}"[:500]
                print(f"warning: the report was not logged to MLflow: {self._report_error}", file=sys.stderr)
                self.client.set_tag(self.parent, "report", f"failed: {self._report_error}")
                return
            self.client.log_artifacts(self.parent, tmp, REPORT_DIR)

    def _log_plots(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from optuna.visualization import matplotlib as ovm

        plots = {"optimization_history.png": ovm.plot_optimization_history,
                 "param_importances.png": ovm.plot_param_importances,
                 "parallel_coordinate.png": ovm.plot_parallel_coordinate}
        with tempfile.TemporaryDirectory() as tmp:
            for name, plot in plots.items():
                try:
                    with warnings.catch_warnings():  # "experimental" and few-trials notices, not errors
                        warnings.simplefilter("ignore")
                        ax = plot(self.study)
                except (ValueError, RuntimeError, ZeroDivisionError) as exc:
                    # e.g. importances need two completed trials with params; say so, don't fail
                    self.client.set_tag(self.parent, f"plot.{name}", f"skipped: {exc}"[:500])
                    continue
                fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
                fig.savefig(Path(tmp) / name, dpi=100, bbox_inches="tight")
                plt.close(fig)
                self.client.log_artifact(self.parent, str(Path(tmp) / name), "optuna")

    def _log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i:i + 100])

    def _log_metrics(self, run_id: str, metrics: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, 0) for k, v in metrics.items()]
        if items:
            self.client.log_batch(run_id, metrics=items)


class NullTracker:
    """``--tracking-uri none``."""

    parent = None

    def sync(self) -> None: ...

    def log_trial(self, t: FrozenTrial) -> None: ...

    def log_confirmation(self, confirmation: dict[str, Any]) -> None: ...

    def finish(self, status: str) -> None: ...


def open_tracker(uri: str | None, study: optuna.Study, experiment_name: str) -> Tracker | NullTracker:
    return NullTracker() if uri is None else Tracker(uri, study, experiment_name)


def _feasible(t: FrozenTrial) -> bool:
    return all(v <= 0 for v in t.constraints.values())


def _ms(when: Any) -> int | None:
    return int(when.timestamp() * 1000) if when is not None else None
