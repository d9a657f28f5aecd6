"""CLI conventions (issue #24): every flag of `autotune` and `python -m engine` says what it does,
`autotune --version` exists, and `autotune dashboard` prints its URL only once the UI answers."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from autotune import __version__, cli


def _flags(parser: argparse.ArgumentParser, where: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _flags(sub, f"{where} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield where, action


@pytest.mark.parametrize("prog", ["autotune", "engine"])
def test_every_flag_says_what_it_does(prog):
    from engine.cli import _parser

    parser = cli.build_parser() if prog == "autotune" else _parser()
    silent = [f"{where} {'/'.join(a.option_strings) or a.dest}" for where, a in _flags(parser, prog) if not a.help]
    assert silent == []


def test_version():
    r = subprocess.run([sys.executable, "-m", "autotune", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"autotune {__version__}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake_ui(tmp_path: Path, delay_s: float, serve: bool) -> list[str]:
    """A stand-in for `mlflow ui`: after ``delay_s`` it listens and answers one request, then exits
    (``serve``), or exits without ever listening. It writes when it started listening."""
    script = tmp_path / "ui.py"
    script.write_text(textwrap.dedent(f"""
        import http.server, sys, time
        time.sleep({delay_s})
        if not {serve}:
            sys.exit(3)
        server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), http.server.SimpleHTTPRequestHandler)
        open(sys.argv[2], "w").write(repr(time.time()))
        server.handle_request()
    """))
    return [sys.executable, str(script)]


def _dashboard(tmp_path, monkeypatch, capsys, delay_s: float, serve: bool) -> tuple[int, str, str, float]:
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"")
    port, listening = _free_port(), tmp_path / "listening"
    fake = _fake_ui(tmp_path, delay_s, serve)
    printed_at: list[float] = []
    real_print = print

    def stamped_print(*args, **kwargs):
        if kwargs.get("file") is None and "http://" in " ".join(map(str, args)):
            printed_at.append(time.time())
        real_print(*args, **kwargs)

    monkeypatch.setattr(cli, "dashboard_command", lambda uri, p: [*fake, str(p), str(listening)])
    monkeypatch.setattr("builtins.print", stamped_print)
    code = cli.main(["dashboard", "--tracking-uri", f"sqlite:///{db}", "--port", str(port)])
    out, err = capsys.readouterr()
    since = float(listening.read_text()) if listening.exists() else float("nan")
    return code, out, err, (printed_at[0] - since) if printed_at else float("nan")


def test_dashboard_prints_its_url_once_the_ui_answers(tmp_path, monkeypatch, capsys):
    code, out, err, after = _dashboard(tmp_path, monkeypatch, capsys, delay_s=1.5, serve=True)
    assert code == 0 and "starting the MLflow UI" in err
    assert out.count("http://127.0.0.1:") == 1
    assert after >= 0  # printed after the UI listened, not before


def test_dashboard_that_never_answers_prints_no_url_and_says_why(tmp_path, monkeypatch, capsys):
    code, out, err, _ = _dashboard(tmp_path, monkeypatch, capsys, delay_s=0.5, serve=False)
    assert code == 3 and "http://" not in out and "exited with status 3" in err


def test_dashboard_on_a_busy_port_is_refused_at_once(tmp_path, capsys):
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["dashboard", "--tracking-uri", f"sqlite:///{db}", "--port", str(port)]) == 2
    assert "is in use" in capsys.readouterr().err
