"""What the MLflow experiment page shows after a sweep, in a real browser (issue #24).

Starts `autotune dashboard` on the sweep's MLflow store, loads the experiment's page in headless
Chromium (Debian's `chromium` package; nothing else), saves a screenshot and checks the rendered
page for the parent run's headline (its name: the winner's config, speedup over AR, decode tok/s,
AL, exactness and conclusion) without any click. Exit 0 when the headline is on the page, 1 when it
is not, 2 for a usage error.

    python benchmarks/mlflow_screenshot.py quickstart --out docs/img/mlflow-quickstart.png
"""

from __future__ import annotations

import argparse
import html
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _browser(name: str | None) -> str:
    for candidate in (name,) if name else BROWSERS:
        found = shutil.which(candidate) if candidate else None
        if found:
            return found
    sys.exit(f"mlflow_screenshot: no browser found (tried {', '.join((name,) if name else BROWSERS)}); "
             "on Debian: apt-get install -y chromium")


def _headline(uri: str, experiment: str) -> tuple[str, str]:
    """(experiment id, the latest parent run's name) from the store the sweep wrote."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = [e.name for e in client.search_experiments()]
        sys.exit(f"mlflow_screenshot: no MLflow experiment {experiment!r} in {uri} (there: {names})")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`autotune.role` = 'sweep'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        sys.exit(f"mlflow_screenshot: experiment {experiment!r} has no sweep run yet")
    return exp.experiment_id, runs[0].info.run_name


def _chromium(browser: str, url: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                               f"--user-data-dir={profile}", "--window-size=1600,1000",
                               "--virtual-time-budget=20000", *args, url],
                              capture_output=True, text=True, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", help="the MLflow experiment: the sweep's experiment name (e.g. quickstart)")
    ap.add_argument("--tracking-uri", default="sqlite:///mlflow.db", help="the MLflow store (default sqlite:///mlflow.db)")
    ap.add_argument("--out", default="mlflow-experiment.png", help="the screenshot (PNG)")
    ap.add_argument("--page", choices=["overview", "runs"], default="overview",
                    help="overview: the page MLflow opens on (the description on top); runs: its runs table")
    ap.add_argument("--browser", help=f"the browser binary (default: the first of {', '.join(BROWSERS)} found)")
    args = ap.parse_args(argv)
    browser = _browser(args.browser)
    exp_id, headline = _headline(args.tracking_uri, args.experiment)
    port = _free_port()
    dash = subprocess.Popen([sys.executable, "-m", "autotune", "dashboard", "--tracking-uri", args.tracking_uri,
                             "--port", str(port)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        seen = []  # the MLflow server's own lines come first; the dashboard prints its URL once the UI answers
        for line in dash.stdout or ():
            seen.append(line.strip())
            if line.startswith("dashboard: http"):
                break
        else:
            print(f"mlflow_screenshot: the dashboard did not come up: {seen[-5:] or 'no output'}", file=sys.stderr)
            return 1
        url = f"http://127.0.0.1:{port}/#/experiments/{exp_id}"
        if args.page == "runs":  # the runs table, in MLflow 3's "model training" view
            url += "/runs?workflowType=machine_learning"
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        shot = _chromium(browser, url, f"--screenshot={Path(args.out).resolve()}")
        if shot.returncode != 0 or not Path(args.out).is_file():
            print(f"mlflow_screenshot: {browser} failed ({shot.returncode}): {shot.stderr[-2000:]}", file=sys.stderr)
            return 1
        dom = html.unescape(_chromium(browser, url, "--dump-dom").stdout)
    finally:
        os.killpg(dash.pid, signal.SIGTERM)
        dash.wait(timeout=30)
    found = headline in dom
    print(f"page: {url}\nscreenshot: {args.out}\nparent run: {headline}\n"
          f"its name on the page without a click: {'yes' if found else 'NO'}")
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
