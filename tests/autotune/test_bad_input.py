"""Bad input: exit 2, a message naming the file or flag, key, rule and value, and nothing created."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from autotune_helpers import TINY_SPACE, run_autotune, tiny_experiment

import engine  # noqa: F401  (imported before any refusal is timed: its time is the refusal's own)
from autotune.cli import main
from autotune.storage import REACH_TIMEOUT_S

# name -> (build argv inside the folder, fragments the message must contain)
Case = Callable[[Path], list[str]]


def _exp(**kw) -> Case:
    return lambda d: ["sweep", str(tiny_experiment(d / "exp", **kw))]


def _space(**params) -> Case:
    return lambda d: ["sweep", str(tiny_experiment(d / "exp", space={**TINY_SPACE, **params}))]


def _raw_yaml(text: str) -> Case:
    def build(d: Path) -> list[str]:
        p = tiny_experiment(d / "exp")
        p.write_text(text)
        return ["sweep", str(p)]
    return build


def _edit(mutate: Callable[[dict], None]) -> Case:
    def build(d: Path) -> list[str]:
        p = tiny_experiment(d / "exp")
        data = yaml.safe_load(p.read_text())
        mutate(data)
        p.write_text(yaml.safe_dump(data))
        return ["sweep", str(p)]
    return build


def _bad_jsonl(d: Path) -> list[str]:
    p = tiny_experiment(d / "exp")
    (d / "exp" / "prompts.jsonl").write_text('{"prompt": "ok"}\n{"prompt": "unterminated\n')
    return ["sweep", str(p)]


def _file_bytes(name: str, make: Callable[[bytes], bytes]) -> Case:
    """The tiny experiment with one of its files (``tiny.yaml``, ``space.yaml``, ``prompts.jsonl``)
    rewritten from its bytes."""
    def build(d: Path) -> list[str]:
        p = tiny_experiment(d / "exp")
        f = d / "exp" / name
        f.write_bytes(make(f.read_bytes()))
        return ["sweep", str(p)]
    return build


# 2 KB of nested aliases: 9**9 values once expanded
ALIAS_BOMB = 'a: &a ["x","x","x","x","x","x","x","x","x"]\n' + "".join(
    f"{c}: &{c} [" + ",".join([f"*{b}"] * 9) + "]\n" for b, c in zip("abcdefgh", "bcdefghi", strict=True))


def _with_exp(*extra: str) -> Case:
    return lambda d: ["sweep", str(tiny_experiment(d / "exp")), *extra]


CASES: dict[str, tuple[Case, list[str]]] = {
    "missing experiment file": (lambda d: ["sweep", str(d / "nope.yaml")], ["nope.yaml", "must exist"]),
    "not yaml": (_raw_yaml("name: [unclosed\n"), ["tiny.yaml", "valid YAML"]),
    "unknown top-level key": (_edit(lambda e: e.update(budgett=3)), ["budgett", "unknown key"]),
    "missing name": (_edit(lambda e: e.pop("name")), ["name", "is required"]),
    "wrong type": (_edit(lambda e: e["workload"].update(n_prompts="four")),
                   ["workload.n_prompts", "must be of type int", "'four'"]),
    "repeats below 1": (_edit(lambda e: e["measure"].update(repeats=0)), ["measure.repeats", ">= 1", "0"]),
    "no warm-up on CUDA": (_edit(lambda e: (e["model"].update(device="cuda"), e["measure"].update(warmup=0))),
                           ["measure.warmup", ">= 1 on CUDA", "0"]),
    "no rung warm-up on CUDA": (_edit(lambda e: (e["model"].update(device="cuda"), e["measure"].update(warmup=1),
                                                 e.update(fidelity={"rung_warmup": 0}))),
                                ["fidelity.rung_warmup", ">= 1 on CUDA"]),
    "engine weights against the model's": (_edit(lambda e: e.update(engine={"weights": "native"})),
                                           ["engine.weights", "must be model.weights (dequantized)"]),
    "a session key without sessions": (_edit(lambda e: e["workload"].update(min_turns=3)),
                                       ["workload.min_turns", "only applies with objective: session_tps"]),
    "a prompt set as sessions": (_edit(lambda e: e.update(objective="session_tps")),
                                 ["prompts.jsonl:1", "needs messages, not a prompt string"]),
    "negative baseline age": (_edit(lambda e: e["measure"].update(baseline_max_age=-1)),
                              ["measure.baseline_max_age", "seconds from 0", "-1"]),
    "baseline age past a year": (_edit(lambda e: e["measure"].update(baseline_max_age=10**400)),
                                 ["measure.baseline_max_age", "to 31,536,000 (a year)"]),
    "baseline age not a number": (_edit(lambda e: e["measure"].update(baseline_max_age="6h")),
                                  ["measure.baseline_max_age", "must be of type int or float", "'6h'"]),
    "unknown sampler": (_edit(lambda e: e["study"].update(sampler="cmaes")),
                        ["study.sampler", "one of", "'cmaes'"]),
    "unknown exactness": (_edit(lambda e: e["measure"].update(exactness="maybe")),
                          ["measure.exactness", "strict", "'maybe'"]),
    "unknown model name": (_exp(model={"target": "no-such-model", "draft": "oracle:0.3"}),
                           ["tiny.yaml", "model", "no-such-model"]),
    "bad oracle probability": (_exp(model={"target": "tiny-dense", "draft": "oracle:1.5"}),
                               ["model", "oracle:1.5", "0 <= P <= 1"]),
    "unknown draft recipe": (_exp(model={"target": "tiny-dense", "draft": "random@q2_k"}),
                             ["tiny.yaml", "model", "random@q2_k", "'q2_k' after '@' is no quantization recipe"]),
    "unknown weights mode": (_edit(lambda e: e["model"].update(weights="q4")),
                             ["tiny.yaml", "model.weights", "must be one of ['dequantized', 'native']", "'q4'"]),
    # checked before anything loads: the engine's registry knows tiny-dense is no GGUF
    "native weights on a float target": (_edit(lambda e: e["model"].update(weights="native")),
                                         ["tiny.yaml", "model.weights", "must suit model.target",
                                          "target 'tiny-dense' is not read from one", "but got 'native'"]),
    "missing search space": (_exp(search_space="nowhere.yaml"), ["search_space", "nowhere.yaml"]),
    "missing workload file": (_exp(workload={"sets": ["missing.jsonl"], "n_prompts": 2}),
                              ["workload.sets[0]", "missing.jsonl", "must exist"]),
    "unknown workload name": (_exp(workload={"sets": ["gsm9k"], "n_prompts": 2}),
                              ["workload.sets[0]", "gsm9k"]),
    "broken jsonl line": (_bad_jsonl, ["prompts.jsonl:2", "JSON object"]),
    "inverted range": (_space(budget={"type": "int", "low": 8, "high": 2}), ["space.yaml", "budget", "low <= high",
                                                                             "low=8, high=2"]),
    "empty choices": (_space(verify={"type": "categorical", "choices": []}), ["verify.choices", "non-empty"]),
    "unknown choice": (_space(verify={"type": "categorical", "choices": ["chain", "tree"]}),
                       ["verify.choices", "engine refuses", "'tree'"]),
    "unknown parameter": (_space(budgett={"type": "int", "low": 1, "high": 2}), ["budgett", "EngineConfig field"]),
    "when on unknown param": (_space(top_k={"type": "int", "low": 1, "high": 3, "when": {"mode": "ddtree"}}),
                              ["top_k.when.mode", "defined earlier"]),
    "when value not a choice": (_space(top_k={"type": "int", "low": 1, "high": 3, "when": {"verify": "tree"}}),
                                ["top_k.when.verify", "choices", "'tree'"]),
    "log with low 0": (_space(budget={"type": "int", "low": 0, "high": 8, "log": True}), ["budget", "log"]),
    "tuning the sampling seed": (_space(seed={"type": "int", "low": 0, "high": 3}), ["seed", "sampling settings"]),
    "grid over a continuous space": (_exp(space={**TINY_SPACE, "proposal_temp": {"type": "float", "low": 0.5,
                                                                                 "high": 1.0}},
                                          study={"sampler": "grid"}), ["proposal_temp", "grid", "step"]),
    "trial timeout without ray": (_with_exp("--trial-timeout", "10m"), ["--trial-timeout", "--executor ray"]),
    "bad trial timeout": (_with_exp("--executor", "ray", "--trial-timeout", "soon"), ["--trial-timeout", "'soon'"]),
    "bad ray address": (_with_exp("--executor", "ray", "--ray-address", "my cluster"),
                        ["--ray-address", "HOST:PORT", "'my cluster'"]),
    "zero ray workers": (_with_exp("--executor", "ray", "--workers", "0"), ["--workers", ">= 1"]),
    "several local workers": (_with_exp("--workers", "3"), ["--workers", "exactly one", "3"]),
    "ray address without ray": (_with_exp("--ray-address", "ray://h:10001"), ["--ray-address", "--executor ray"]),
    "zero trials": (_with_exp("--n-trials", "0"), ["--n-trials", ">= 1", "0"]),
    "bad timeout": (_with_exp("--timeout", "8 hours"), ["--timeout", "duration", "'8 hours'"]),
    "bad storage url": (_with_exp("--storage", "autotune.db"), ["--storage", "SQLAlchemy URL", "'autotune.db'"]),
    "storage folder missing": (_with_exp("--storage", "sqlite:///no/such/dir/a.db"), ["--storage", "folder"]),
    "bad tracking uri": (_with_exp("--tracking-uri", "mlflow.db"), ["--tracking-uri", "'mlflow.db'"]),
    "status of nothing": (lambda d: ["status"], ["--storage", "no study storage", "autotune.db"]),
    "best of nothing": (lambda d: ["best", "tiny", "--storage", "journal:none.log"], ["--storage", "no study"]),
    "export unknown format": (lambda d: ["export", "tiny", "--format", "xml"], ["invalid choice", "'xml'"]),
    "serve missing config": (lambda d: ["serve", "x.yaml"], ["x.yaml", "config file not found"]),
    "dashboard without db": (lambda d: ["dashboard"], ["--tracking-uri", "no MLflow database"]),
    "unknown command": (lambda d: ["tune"], ["invalid choice", "'tune'"]),
    # hostile or broken files (issue #23): bounded, strict, unambiguous
    "yaml alias bomb": (_file_bytes("tiny.yaml", lambda b: b + ALIAS_BOMB.encode().replace(b"a:", b"z:", 1)),
                        ["tiny.yaml", "aliases expand to more than 100,000 values"]),
    "yaml alias cycle": (_file_bytes("space.yaml", lambda b: b + b"loop: &l [1, *l]\n"),
                         ["space.yaml", "aliases expand"]),
    "duplicate experiment key": (_file_bytes("tiny.yaml", lambda b: b + b"name: other\n"),
                                 ["tiny.yaml", "the key 'name' is given twice (first on line 1)"]),
    "duplicate space key": (_file_bytes("space.yaml", lambda b: b + b"verify: {type: categorical, choices: [ar]}\n"),
                            ["space.yaml", "the key 'verify' is given twice"]),
    "experiment in latin-1": (_file_bytes("tiny.yaml", lambda b: b"# caf\xe9\n" + b),
                              ["tiny.yaml", "is not UTF-8 (byte 0xe9 at offset 5)", "save it as UTF-8"]),
    "experiment in utf-16": (_file_bytes("tiny.yaml", lambda b: b.decode().encode("utf-16")),
                             ["tiny.yaml", "is UTF-16"]),
    "space in utf-16 without a mark": (_file_bytes("space.yaml", lambda b: b.decode().encode("utf-16-le")),
                                       ["space.yaml", "NUL character"]),
    "oversized experiment": (_file_bytes("tiny.yaml", lambda b: b + b"#" * (1 << 20) + b"\n"),
                             ["tiny.yaml", "bytes; files of at most 1,048,576 bytes are read"]),
    "workload in latin-1": (_file_bytes("prompts.jsonl", lambda b: b'{"prompt": "na\xefve"}\n' + b),
                            ["prompts.jsonl", "not UTF-8"]),
    "deeply nested workload line": (_file_bytes("prompts.jsonl", lambda b: b'{"prompt": "x", "n": '
                                                + b"[" * 100_000 + b"]" * 100_000 + b"}\n" + b),
                                    ["prompts.jsonl:1", "nested more than 64 deep"]),
    "tools not a list": (_file_bytes("prompts.jsonl", lambda b: b'{"prompt": "x", "tools": "notalist"}\n' + b),
                         ["prompts.jsonl:1", "tools", "list of tool objects", "'notalist'"]),
    "grid over a tiny float step": (_exp(space={**TINY_SPACE, "proposal_temp": {"type": "float", "low": 0.5,
                                                                                "high": 1.0, "step": 1e-12}},
                                         study={"sampler": "grid"}), ["sampler `grid`", "at most", "use tpe"]),
    "step past the range": (_space(budget={"type": "int", "low": 2, "high": 8, "step": 16}),
                            ["budget.step", "at most high - low = 6", "16"]),
    "a range past the engine's bound": (_space(budget={"type": "int", "low": 4, "high": 10**30, "log": True}),
                                        ["budget.high", "engine refuses", "<= 1,023"]),
    "max_new_tokens past the context": (_exp(workload={"sets": ["prompts.jsonl"], "n_prompts": 2,
                                                       "max_new_tokens": 10**9}),
                                        ["workload.max_new_tokens", "must fit the target's context of 4,096 tokens"]),
    "postgres not answering": (_with_exp("--storage", "postgresql+psycopg://postgres@127.0.0.1:1/postgres"),
                               ["--storage", "the storage does not answer", "OperationalError"]),
    "mlflow server down": (_with_exp("--tracking-uri", "http://127.0.0.1:1"),
                           ["--tracking-uri", "the MLflow server does not answer"]),
    "a huge value is previewed": (_edit(lambda e: e["workload"].update(n_prompts="x" * 100_000)),
                                  ["workload.n_prompts", "... (100,002 characters)"]),
}


def _created(folder: Path) -> list[str]:
    names = {"autotune.db", "mlflow.db", "mlruns", "mlartifacts", "none.log", "reports"}
    return sorted(p.name for p in folder.rglob("*") if p.name in names)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_exits_2_names_the_problem_and_creates_nothing(name, in_tmp, capsys):
    build, fragments = CASES[name]
    argv = build(in_tmp)
    started = time.monotonic()
    code = main(argv)
    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("autotune: error: ")
    assert len(err) < 4096, f"{len(err)} characters"  # whatever the input, the message stays small
    assert took < 10, f"{took:.1f} s"  # a refusal never hangs (an alias bomb, a huge grid, a silent server)
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"
    assert _created(in_tmp) == []


def test_bad_input_through_the_real_entry_point(tmp_path):
    proc = run_autotune(["sweep", str(tiny_experiment(tmp_path / "exp")), "--trial-timeout", "5m"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "--trial-timeout" in proc.stderr and "only applies with --executor ray" in proc.stderr
    assert _created(tmp_path) == []


def test_a_silent_mlflow_server_is_refused_in_seconds_before_the_model_loads(in_tmp, capsys):
    """A tracking server that accepts the connection and never answers: refused after the timeout,
    with nothing created (it used to hang for minutes with the study already made)."""
    import socket
    import time


    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        started = time.monotonic()
        code = main(["sweep", str(tiny_experiment(in_tmp / "exp")), "--tracking-uri", url])
        took = time.monotonic() - started
    finally:
        listener.close()
    err = capsys.readouterr().err
    assert code == 2 and "the MLflow server does not answer" in err and "timed out" in err
    assert took < REACH_TIMEOUT_S + 5
    assert _created(in_tmp) == []
