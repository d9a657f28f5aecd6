"""MLflow logging, driver side only: a parent run per sweep, a nested run per trial.

The Optuna storage is the source of truth; MLflow is the morning dashboard. A resumed sweep
reuses its parent run (its id is kept in the study's user attributes) and logs every finished
trial that has no run yet, so a crash never leaves a gap. ``--tracking-uri none`` disables it.
"""

from __future__ import annotations

import json
import logging
import tempfile
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.errors import InputError
from autotune.study import role_of

_STATUS = {TrialState.COMPLETE: "FINISHED", TrialState.PRUNED: "FINISHED", TrialState.FAIL: "FAILED"}
_METRICS = ("decode_tps_median", "spread", "rel_mad", "acceptance_length", "speedup_vs_ar", "break_even_al",
            "exact_match", "step_ms", "e2e_tps_median", "ar_decode_tps", "oracle_gate_fraction",
            "oracle_gate_tps", "peak_memory_bytes", "util_percent", "trial_wall_s", "engine_s", "inexact_count")


def check_tracking_uri(uri: str) -> str | None:
    """Validate without creating anything; ``none`` disables tracking."""
    if uri.lower() == "none":
        return None
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):]).resolve()
        if not path.parent.is_dir():
            raise InputError("--tracking-uri", None, "the folder of the MLflow database must exist", uri)
        return uri
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

    from autotune.study import REACH_TIMEOUT_S, answer_within

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
        self.parent = self._parent_run(study)
        self._logged = self._already_logged()

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
        self._log_params(run.info.run_id, params)
        study.set_user_attr("mlflow_parent_run", {"uri": self.uri, "run_id": run.info.run_id})
        return run.info.run_id

    def _already_logged(self) -> set[int]:
        runs = self.client.search_runs([self.experiment_id], f"tags.mlflow.parentRunId = '{self.parent}'",
                                       max_results=50_000)
        return {int(r.data.tags["autotune.trial"]) for r in runs if "autotune.trial" in r.data.tags}

    def sync(self) -> None:
        """Log every finished trial that has no nested run yet (after a crash, or one by one)."""
        for t in self.study.get_trials(deepcopy=False):
            if t.state.is_finished() and t.number not in self._logged:
                self.log_trial(t)

    def log_trial(self, t: FrozenTrial) -> None:
        a = t.user_attrs
        config = a.get("config", {})
        tags = {"mlflow.parentRunId": self.parent, "autotune.trial": str(t.number), "autotune.role": role_of(t),
                "autotune.state": t.state.name, "verify": str(config.get("verify")),
                "draft_path": str(config.get("draft_path")), "rollback": str(config.get("rollback")),
                "worker": str(a.get("worker", "")), "feasible": str(_feasible(t))}
        if a.get("fail_reason"):
            tags["fail_reason"] = str(a["fail_reason"])[:4000]
        if a.get("refused"):
            tags["refused"] = str(a["refused"])[:4000]
        if a.get("noisy"):
            tags["noisy"] = "true"
        if a.get("baseline_trial") is not None:  # the AR trial its speedup divides by
            tags["baseline_trial"] = str(a["baseline_trial"])
        if a.get("baseline_reused"):
            tags["baseline_reused"] = "true"
        run = self.client.create_run(self.experiment_id, run_name=f"trial-{t.number:04d}-{role_of(t)}", tags=tags,
                                     start_time=_ms(t.datetime_start))
        rid = run.info.run_id
        self._log_params(rid, {**config, **{f"param.{k}": v for k, v in t.params.items()}})
        metrics = {k: a[k] for k in _METRICS if isinstance(a.get(k), (int, float)) and not isinstance(a.get(k), bool)}
        if t.value is not None:
            metrics["value"] = t.value
        for phase, ms in a.get("phase_ms_per_step", {}).items():
            metrics[f"phase_ms.{phase}"] = ms
        for verdict, n in a.get("divergence_verdicts", {}).items():  # "numeric tie" -> verdict.numeric_tie
            metrics[f"verdict.{verdict.replace(' ', '_')}"] = n
        self._log_metrics(rid, metrics)
        for i, tps in enumerate(a.get("decode_tps_runs", [])):
            self.client.log_metric(rid, "decode_tps_run", tps, step=i)
        if a.get("al_histogram"):
            self.client.log_dict(rid, a["al_histogram"], "al_histogram.json")
        if a.get("phase_ms_per_step"):
            self.client.log_dict(rid, {"phase_ms_per_step": a["phase_ms_per_step"], "step_ms": a.get("step_ms"),
                                       "phase_coverage": a.get("phase_coverage")}, "phases.json")
        if a.get("per_set"):
            self.client.log_dict(rid, a["per_set"], "per_workload.json")
        if a.get("divergences"):  # at most worker.MAX_DIAGNOSED small records
            self.client.log_dict(rid, a["divergences"], "divergences.json")
        self.client.set_terminated(rid, _STATUS.get(t.state, "FAILED"), end_time=_ms(t.datetime_complete))
        self._logged.add(t.number)

    def log_confirmation(self, confirmation: dict[str, Any]) -> None:
        self.client.log_dict(self.parent, confirmation, "confirmation.json")
        metrics = {k: confirmation[k] for k in ("winner_median_tps", "winner_spread", "winner_speedup_vs_ar",
                                                "ar_median_tps") if isinstance(confirmation.get(k), (int, float))}
        self._log_metrics(self.parent, metrics)
        self.client.set_tag(self.parent, "autotune.winner_trial", str(confirmation.get("winner")))
        self.client.set_tag(self.parent, "autotune.positive_vs_ar", str(confirmation.get("positive_vs_ar")))

    def finish(self, status: str) -> None:
        """Optuna's plots on the parent run, then close it (FINISHED, KILLED or FAILED)."""
        self._log_plots()
        self.client.set_terminated(self.parent, status)

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
