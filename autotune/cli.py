"""`autotune sweep|plan|status|best|report|export|serve|dashboard` (docs/architecture.md: a stable contract).

Exit status: 0 done; 2 bad input (the message names the file or flag, the key, the rule and the
value, and nothing was created); 130 after Ctrl-C (the running trial is failed cleanly first).
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from autotune import __version__
from autotune.errors import InputError

EXIT_OK, EXIT_INPUT, EXIT_INTERRUPTED = 0, 2, 130
DEFAULT_STORAGE = "sqlite:///autotune.db"
DEFAULT_TRACKING = "sqlite:///mlflow.db"
STORAGE_HELP = f"Optuna storage: sqlite:///FILE or a PostgreSQL/MySQL URL (default {DEFAULT_STORAGE})"
STUDY_HELP = "study name (the experiment's name unless the sweep had --study-name; `autotune status` lists them)"
DASHBOARD_WAIT_S = 300.0  # the MLflow UI's start, at most, before the dashboard says it is not answering
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so `main()` owns the exit status and message."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise InputError(self.prog, None, message)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="autotune", description="Find the fastest exact speculative-decoding setup for a local LLM.")
    ap.add_argument("--version", action="version", version=f"autotune {__version__}",
                    help="print the version and exit")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser("sweep", help="run or resume a sweep")
    s.add_argument("experiment", help="experiment YAML (experiments/*.yaml)")
    s.add_argument("--n-trials", type=int, help="finished trials to reach (default: the experiment's study.n_trials)")
    s.add_argument("--timeout", help="stop starting new trials after this long: 8h, 30m, 90s, 1h30m")
    s.add_argument("--storage", default=DEFAULT_STORAGE, help=STORAGE_HELP)
    s.add_argument("--study-name", help="default: the experiment's name")
    s.add_argument("--tracking-uri", default=DEFAULT_TRACKING, help=f"MLflow URI or none (default {DEFAULT_TRACKING})")
    s.add_argument("--executor", choices=("local", "ray"), help="default: the experiment's executor.kind")
    s.add_argument("--workers", type=int, help="Ray: CPU actors, or a cap on one actor per GPU (default: the "
                   "experiment's executor.workers)")
    s.add_argument("--ray-address", help="Ray cluster to join: auto or HOST:PORT (default: start a local one)")
    s.add_argument("--trial-timeout", help="Ray: kill and restart a worker whose trial runs longer: 10m, 600s")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")

    s = sub.add_parser("plan", help="the device memory the experiment's configs need, per part, and what fits "
                       "model.vram_limit (planned: no GPU needed)")
    s.add_argument("experiment", help="experiment YAML (experiments/*.yaml)")
    s.add_argument("--context", help="tokens to plan for, a prompt and max_new_tokens (default: the workload's "
                   "longest prompt plus max_new_tokens)")
    s.add_argument("--vram-limit", help="plan against this limit instead of model.vram_limit: 24GiB, 22.5GB, "
                   "8000MiB or bytes")

    s = sub.add_parser("status", help="list the studies in a storage")
    s.add_argument("--storage", default=DEFAULT_STORAGE, help=STORAGE_HELP)

    s = sub.add_parser("best", help="the winner of a study")
    s.add_argument("study", help=STUDY_HELP)
    s.add_argument("--storage", default=DEFAULT_STORAGE, help=STORAGE_HELP)
    s.add_argument("--json", action="store_true", help="print one JSON object")

    s = sub.add_parser("report", help="markdown report with PNG plots")
    s.add_argument("study", help=STUDY_HELP)
    s.add_argument("--storage", default=DEFAULT_STORAGE, help=STORAGE_HELP)
    s.add_argument("--out", help="folder (default reports/STUDY)")

    s = sub.add_parser("export", help="the winner as an engine config, llama-server command or JSON")
    s.add_argument("study", help=STUDY_HELP)
    s.add_argument("--storage", default=DEFAULT_STORAGE, help=STORAGE_HELP)
    s.add_argument("--format", default="engine", choices=("engine", "llama-server", "json"),
                   help="engine: a YAML `autotune serve` and `python -m engine generate --config` read (default); "
                        "llama-server: its command line; json: the winner's record")
    s.add_argument("--out", help="file (default: standard output); an existing one only with --force, never a database")
    s.add_argument("--force", action="store_true", help="replace an existing --out file")

    s = sub.add_parser("serve", help="serve an exported config behind an OpenAI-compatible API (docs/serving.md)")
    s.add_argument("config", help="engine config YAML (`autotune export --format engine`)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every request")
    s.add_argument("--max-queue", type=int, default=32, help="waiting requests before 503 (default 32)")
    # engine.DEFAULT_PREFIX_CACHE_MB, written out: the CLI parses its flags without importing torch
    s.add_argument("--prefix-cache-mb", type=float, default=1024,
                   help="device memory (MiB) for the prefix cache of earlier prompts and answers (default 1024; "
                        "0: off)")

    s = sub.add_parser("dashboard", help="start the MLflow UI on 127.0.0.1")
    s.add_argument("--tracking-uri", default=DEFAULT_TRACKING,
                   help=f"the MLflow store the sweep wrote (default {DEFAULT_TRACKING})")
    s.add_argument("--port", type=int, default=5000, help="port (default 5000)")
    return ap


def parse_duration(raw: str, flag: str = "--timeout") -> float:
    """`8h`, `30m`, `90s`, `1h30m`, `1.5h` or plain seconds → seconds."""
    text = raw.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        seconds = float(text)
    elif re.fullmatch(r"(\d+(\.\d+)?[hms])+", text):
        unit = {"h": 3600.0, "m": 60.0, "s": 1.0}
        seconds = sum(float(n) * unit[u] for n, _, u in re.findall(r"(\d+(\.\d+)?)([hms])", text))
    else:
        raise InputError(flag, None, "must be a duration like 8h, 30m, 90s or 1h30m", raw)
    if seconds <= 0:
        raise InputError(flag, None, "must be > 0", raw)
    return seconds


def _check_engine_environment() -> None:
    """The engine's environment variables, before a trial or a server starts."""
    from engine import environment_errors

    for name, (rule, value) in environment_errors().items():
        raise InputError("environment", name, rule, value)


def cmd_sweep(args: argparse.Namespace) -> int:
    from autotune import experiment, tracking
    from autotune.storage import parse_storage, reach_storage

    # Every input is checked before anything is created or loaded.
    _check_engine_environment()
    if args.n_trials is not None and args.n_trials < 1:
        raise InputError("--n-trials", None, "must be >= 1", args.n_trials)
    timeout = parse_duration(args.timeout) if args.timeout is not None else None
    storage = parse_storage(args.storage)
    tracking_uri = tracking.check_tracking_uri(args.tracking_uri)
    if args.study_name is not None and not _NAME_RE.match(args.study_name):
        raise InputError("--study-name", None, "must match [A-Za-z0-9][A-Za-z0-9_.-]*", args.study_name)
    exp = experiment.load(args.experiment)
    reach_storage(storage)  # servers answer before the model loads (a few seconds at most)
    tracking.reach_tracking_uri(tracking_uri)
    kind = args.executor or exp.executor.kind
    workers = args.workers if args.workers is not None else exp.executor.workers
    if workers is not None and workers < 1:
        raise InputError("--workers", None, "must be >= 1", workers)
    if args.ray_address is not None and kind != "ray":
        raise InputError("--ray-address", None, "only applies with --executor ray", args.ray_address)
    if args.trial_timeout is not None and kind != "ray":
        raise InputError("--trial-timeout", None, "only applies with --executor ray (the local worker runs in the "
                         "driver's process and cannot be killed)", args.trial_timeout)
    from_yaml = exp.executor.kind == "ray"  # the YAML's Ray settings apply only when it chose Ray itself
    address = args.ray_address if args.ray_address is not None else (exp.executor.address if from_yaml else None)
    trial_timeout = (parse_duration(args.trial_timeout, "--trial-timeout") if args.trial_timeout is not None
                     else exp.executor.trial_timeout if from_yaml else None)
    experiment.check_executor("command line", ("--executor", "--workers", "--ray-address", "--trial-timeout"), kind,
                              workers, address, trial_timeout)
    workloads = experiment.load_workloads(exp)

    from autotune.sweep import SweepOptions, make_executor, run_sweep
    from engine import EngineInputError

    opts = SweepOptions(n_trials=args.n_trials or exp.study.n_trials, storage=storage,
                        study_name=args.study_name or exp.name, tracking_uri=tracking_uri, timeout_s=timeout,
                        progress=not args.no_progress)
    executor = make_executor(exp, workloads, kind, workers, address, trial_timeout)
    try:
        return run_sweep(exp, opts, workloads, executor=executor).exit_code
    except EngineInputError as exc:  # e.g. a draft made for another target, found when the pair loads
        raise InputError(str(exp.path), "model", f"the engine refused to load the pair ({exc})") from None


def cmd_plan(args: argparse.Namespace) -> int:
    from autotune import experiment, plan, vram

    # Every input is checked before the model loads.
    limit = vram.parse_size(args.vram_limit, "--vram-limit", None) if args.vram_limit is not None else None
    context = None
    if args.context is not None:
        if not re.fullmatch(r"\d+", args.context.strip()) or int(args.context) < 2:
            raise InputError("--context", None, "must be a whole number of tokens, at least 2", args.context)
        context = int(args.context)
    exp = experiment.load(args.experiment)
    plan.run(exp, experiment.load_workloads(exp), context, limit)
    return EXIT_OK


def _open(args: argparse.Namespace) -> Any:
    import optuna


    optuna.logging.set_verbosity(optuna.logging.WARNING)
    from autotune.storage import open_storage, parse_storage

    return open_storage(parse_storage(args.storage), create=False)


def cmd_status(args: argparse.Namespace) -> int:
    import optuna

    from autotune import results

    storage = _open(args)
    names = sorted(s.study_name for s in optuna.get_all_study_summaries(storage))
    print(f"storage: {args.storage}\nstudies: {len(names)}")
    for name in names:
        facts = results.summary(optuna.load_study(study_name=name, storage=storage))
        print()
        print(results.format_summary(facts))
    return EXIT_OK


def cmd_best(args: argparse.Namespace) -> int:
    import yaml

    from autotune import export
    from autotune.dimensions import describe as describe_fixed
    from autotune.storage import load_existing

    s = load_existing(_open(args), args.study)
    doc = export.build(s)
    if args.json:
        print(json.dumps(doc, indent=2))
        return EXIT_OK
    p = doc["provenance"]
    obj = p.get("objective") or "decode_tps"  # (an export made before the key: decode)
    beside = ("decode_tps",) if obj != "decode_tps" else ()
    for key in ("study", "trial", "role", "confirmed", "reliable", "unreliable_because", obj, f"{obj}_spread",
                "speedup_vs_ar", f"ar_{obj}", *beside, "positive_vs_ar", "acceptance_length", "break_even_al",
                "exact_match", "device", "workload_hash"):
        if key == "unreliable_because" and key not in p:
            continue
        print(f"{key}: {'none' if p.get(key) is None else p.get(key)}")
    if p.get("fixed_dimensions"):
        print(f"fixed_dimensions: {describe_fixed(p['fixed_dimensions'])}")
    print("config:")
    print("  " + yaml.safe_dump(doc["engine"], sort_keys=False).replace("\n", "\n  ").rstrip())
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from autotune.report import write_report
    from autotune.storage import load_existing

    s = load_existing(_open(args), args.study)
    out = Path(args.out) if args.out else Path("reports") / args.study
    if out.exists() and not out.is_dir():
        raise InputError("--out", None, "must be a folder", str(out))
    files = write_report(s, out)
    print(f"report: {files[0]}")
    for f in files[1:]:
        print(f"plot: {f}")
    return EXIT_OK


# The first bytes of files autotune never writes over, whatever --force says: a study or an MLflow
# store (SQLite).
_PRECIOUS = ((b"SQLite format 3\x00", "an SQLite database (a study or an MLflow store)"),)


def _check_new_file(out: Path, force: bool) -> None:
    """``--out`` names a file this command may write: its folder exists, it is not a folder, an
    existing file only with ``--force``, and never a database."""
    if out.is_dir():
        raise InputError("--out", None, "must name a file, not a folder", str(out))
    if not out.resolve().parent.is_dir():
        raise InputError("--out", None, "the folder of the output file must exist", str(out))
    if not out.exists():
        return
    with out.open("rb") as fh:
        head = fh.read(16)
    for magic, what in _PRECIOUS:
        if head.startswith(magic):
            raise InputError("--out", None, f"names {what}; it is never overwritten (choose another file)", str(out))
    if not force:
        raise InputError("--out", None, "names an existing file: add --force to replace it", str(out))


def cmd_export(args: argparse.Namespace) -> int:
    from autotune import export
    from autotune.storage import load_existing

    if args.out:
        _check_new_file(Path(args.out), args.force)
    s = load_existing(_open(args), args.study)
    doc = export.build(s)
    text = export.render(doc, args.format)
    for warning in export.llama_server_warnings(doc) if args.format == "llama-server" else []:
        print(f"autotune: warning: {warning}", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(text)
        print(f"exported: {args.out}\nformat: {args.format}")
    else:
        sys.stdout.write(text)
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise InputError("--port", None, "must be between 0 and 65535", args.port)
    if args.max_queue < 0:
        raise InputError("--max-queue", None, "must be >= 0", args.max_queue)
    if not 0 <= args.prefix_cache_mb < float("inf"):  # (NaN too)
        raise InputError("--prefix-cache-mb", None, "must be a finite number >= 0 (0: no prefix cache)",
                         args.prefix_cache_mb)
    if args.api_key is not None and not args.api_key.strip():
        raise InputError("--api-key", None, "must not be empty", args.api_key)
    if not Path(args.config).is_file():
        raise InputError(args.config, None, "config file not found")
    _check_engine_environment()
    from engine import EngineInputError, serve

    try:
        return serve(args.config, host=args.host, port=args.port, api_key=args.api_key, max_queue=args.max_queue,
                     prefix_cache_mb=args.prefix_cache_mb)
    except EngineInputError as exc:
        raise InputError(args.config, None, str(exc)) from None


def cmd_dashboard(args: argparse.Namespace) -> int:
    from autotune import tracking

    uri = tracking.check_tracking_uri(args.tracking_uri)
    if uri is None:
        raise InputError("--tracking-uri", None, "the dashboard needs a tracking URI, not none", args.tracking_uri)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        raise InputError("--tracking-uri", None, "no MLflow database there (run `autotune sweep` first)", uri)
    if not 1 <= args.port <= 65535:
        raise InputError("--port", None, "must be between 1 and 65535", args.port)
    with socket.socket() as probe:  # a busy port would have the UI fail after its slow start
        try:
            probe.bind(("127.0.0.1", args.port))
        except OSError:
            raise InputError("--port", None, "is in use on 127.0.0.1 (pick another)", args.port) from None
    print(f"dashboard: starting the MLflow UI on 127.0.0.1:{args.port} ...", file=sys.stderr, flush=True)
    proc = subprocess.Popen(dashboard_command(uri, args.port))
    try:
        url = f"http://127.0.0.1:{args.port}"
        if _answers_within(proc, url, DASHBOARD_WAIT_S):
            print(f"dashboard: {url}  (Ctrl-C stops it)", flush=True)  # only once the UI answers
        elif proc.poll() is None:
            print(f"dashboard: the UI has not answered at {url} after {DASHBOARD_WAIT_S:.0f} s; still waiting "
                  "(Ctrl-C stops it)", file=sys.stderr, flush=True)
        code = proc.wait()
        if code:
            print(f"dashboard: the MLflow UI exited with status {code}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait(timeout=10)
        return EXIT_OK


def dashboard_command(uri: str, port: int) -> list[str]:
    return [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", "127.0.0.1",
            "--port", str(port)]


def _answers_within(proc: subprocess.Popen, url: str, seconds: float) -> bool:
    """Whether ``url`` answers HTTP (any status) before ``seconds`` pass or ``proc`` exits."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return True
        except urllib.error.HTTPError:
            return True  # an error page is an answer: the UI is up
        except OSError:
            time.sleep(0.25)
    return False


COMMANDS = {"sweep": cmd_sweep, "plan": cmd_plan, "status": cmd_status, "best": cmd_best, "report": cmd_report,
            "export": cmd_export, "serve": cmd_serve, "dashboard": cmd_dashboard}


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except InputError as exc:
        print(f"autotune: error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        print("autotune: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
