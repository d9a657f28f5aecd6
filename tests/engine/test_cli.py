"""`python -m engine generate`: JSON output, config files, and bad inputs (exit 2, clear message).

Most cases call the CLI's ``main`` in this process (a subprocess spends two seconds importing torch
before it does anything); ``run_process`` goes through `python -m engine` itself, for the entry
point's own exit codes and output."""

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import yaml

from engine.data.tokenizer import ByteTokenizer
from engine.loading import save_draft_folder
from engine.registry import random_draft_for


def run_process(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """`python -m engine ARGS` as ``engine.cli.main`` runs it here: its exit code (argparse's
    SystemExit included), stdout and stderr."""
    from engine.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), contextlib.chdir(cwd or os.getcwd()):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(["engine", *args], code, out.getvalue(), err.getvalue())


def test_generate_json_matches_ar_and_reports_stats():
    base = ["generate", "--target", "tiny-dense", "--draft", "oracle:0.3", "--prompt", "Hello", "--max-new-tokens",
            "24", "--json", "--device", "cpu"]
    ar = json.loads(run_process(*base, "--verify", "ar").stdout)  # the real entry point, once
    tree = run(*base, "--verify", "ddtree", "--budget", "16", "--top-k", "4", "--draft-path", "generic")
    assert tree.returncode == 0, tree.stderr
    out = json.loads(tree.stdout)
    assert out["tokens"] == ar["tokens"]
    assert isinstance(out["text"], str)
    stats = out["stats"]
    for key in ("acceptance_length", "decode_tps", "steps", "phase_ms_per_step", "al_histogram"):
        assert key in stats
    assert set(stats["phase_ms_per_step"]) == {"draft", "topk", "tree", "verify", "walk", "commit"}


def test_config_file_flat_and_nested(tmp_path):
    flat = tmp_path / "flat.yaml"
    flat.write_text(yaml.safe_dump({"verify": "chain", "block_size": 4}))
    nested = tmp_path / "nested.yaml"
    nested.write_text(yaml.safe_dump({"engine": {"verify": "ddtree", "budget": 6, "top_k": 2},
                                      "model": {"target": "tiny-dense", "draft": "oracle:0.3", "device": "cpu"},
                                      "provenance": {"study": "x"}}))
    r1 = run("generate", "--target", "tiny-dense", "--draft", "oracle:0.3", "--config", str(flat), "--prompt",
             "Hi", "--json", "--max-new-tokens", "8")
    r2 = run("generate", "--config", str(nested), "--prompt", "Hi", "--json", "--max-new-tokens", "8")
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr + r2.stderr
    assert json.loads(r1.stdout)["config"]["block_size"] == 4
    assert json.loads(r2.stdout)["config"]["budget"] == 6
    assert json.loads(r1.stdout)["tokens"] == json.loads(r2.stdout)["tokens"]


@pytest.fixture(scope="module")
def mismatched_drafts(tmp_path_factory):
    """Two DFlash checkpoints made for a different target than tiny-dense."""
    import engine

    root = tmp_path_factory.mktemp("drafts")
    pair = engine.load("tiny-dense", "none", device="cpu")
    draft = random_draft_for(pair.target, ByteTokenizer())
    # Another hidden size: shape it for a wider twin of the target.
    from dataclasses import replace

    from engine.models.draft import DFlashDraft

    wide = DFlashDraft(replace(draft.cfg, hidden_size=96, intermediate_size=128))
    save_draft_folder(wide, root / "wide")
    small_vocab = DFlashDraft(replace(draft.cfg, vocab_size=300))
    save_draft_folder(small_vocab, root / "vocab")
    return root


def _bad_cases(tmp):
    return [
        (["--target", "no-such-preset", "--draft", "random"], "no-such-preset"),
        (["--target", str(tmp / "missing_folder/x"), "--draft", "random"], "missing_folder"),
        (["--target", "tiny-dense", "--draft", "oracle:1.5"], "0 <= P <= 1"),
        (["--target", "tiny-dense", "--draft", "random", "--budget", "0"], "budget must be >= 1"),
        (["--target", "tiny-dense", "--draft", "random", "--top-k", "0"], "top_k must be >= 1"),
        (["--target", "tiny-dense", "--draft", "random", "--verify", "beam"], "--verify: invalid choice: 'beam'"),
        (["--target", "tiny-dense", "--draft", "random", "--rollback", "undo"], "--rollback: invalid choice: 'undo'"),
        (["--target", "tiny-dense", "--draft", "random", "--draft-path", "fast"],
         "--draft-path: invalid choice: 'fast'"),
        (["--target", "tiny-dense", "--draft", "random", "--device", "tpu"], "device must be"),
        (["--target", "tiny-dense", "--draft", "random", "--prompt-ids", "1,x"], "--prompt-ids"),
        (["--target", "tiny-dense", "--draft", "random", "--prompt-ids", "99999"], "outside the vocabulary"),
        (["--target", "tiny-dense", "--draft", "random", "--max-new-tokens", "0"], "max-new-tokens"),
        (["--target", "tiny-dense", "--draft", "random", "--proposal-temp", "0"], "proposal_temp must be > 0"),
    ]


@pytest.mark.parametrize("case", range(13))
def test_bad_inputs_exit_2_with_a_clear_message(case, tmp_path):
    args, needle = _bad_cases(tmp_path)[case]
    if "--prompt-ids" not in args:
        args = [*args, "--prompt", "hi"]
    r = run("generate", *args, "--max-new-tokens", "4") if "--max-new-tokens" not in args else run("generate", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr


def test_unsupported_architecture_and_missing_config(tmp_path):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHead"]}))
    (tmp_path / "empty").mkdir()
    r = run("generate", "--target", str(tmp_path / "gpt2"), "--draft", "none", "--verify", "ar", "--prompt-ids", "1")
    assert r.returncode == 2 and "gpt2" in r.stderr
    r = run("generate", "--target", str(tmp_path / "empty"), "--draft", "none", "--verify", "ar", "--prompt-ids", "1")
    assert r.returncode == 2 and "config.json" in r.stderr


def test_draft_shaped_for_another_target_is_refused(mismatched_drafts):
    r = run("generate", "--target", "tiny-dense", "--draft", str(mismatched_drafts / "wide"), "--prompt", "hi")
    assert r.returncode == 2 and "96" in r.stderr and "64" in r.stderr
    r = run("generate", "--target", "tiny-dense", "--draft", str(mismatched_drafts / "vocab"), "--prompt", "hi")
    assert r.returncode == 2 and "300" in r.stderr and "272" in r.stderr


class _Writes:
    """A stdout that keeps each write apart (what `--stream` hands out, piece by piece)."""

    def __init__(self) -> None:
        self.pieces: list[str] = []

    def write(self, text: str) -> int:
        self.pieces.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_stream_prints_each_step_as_it_commits_and_the_same_text(monkeypatch):
    from engine import cli

    args = ["generate", "--target", "tiny-dense", "--draft", "oracle:0.3", "--prompt", "Hello", "--max-new-tokens",
            "32", "--device", "cpu", "--verify", "ddtree", "--budget", "4", "--top-k", "2", "--draft-path", "generic"]
    plain, streamed = _Writes(), _Writes()
    monkeypatch.setattr(sys, "stdout", plain)
    assert cli.main(args) == 0
    monkeypatch.setattr(sys, "stdout", streamed)
    assert cli.main([*args, "--stream"]) == 0
    text = "".join(plain.pieces).split("\n---\n")[0]
    pieces = "".join(streamed.pieces).split("\n---\n")[0]
    assert pieces == text  # one code path: the streamed answer is the whole one
    before_stats = streamed.pieces[:next(i for i, p in enumerate(streamed.pieces) if "---" in p)]
    assert len([p for p in before_stats if p]) >= 3  # several steps' pieces, not one print at the end
    assert "acceptance_length:" in "".join(streamed.pieces)


def test_stream_and_json_exclude_each_other_and_choices_are_listed():
    r = run_process("generate", "--target", "tiny-dense", "--draft", "none", "--prompt", "hi", "--stream", "--json")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr
    r = run("generate", "--target", "tiny-dense", "--draft", "none", "--prompt", "hi", "--verify", "tree")
    assert r.returncode == 2 and "'ar', 'chain', 'ddtree'" in r.stderr and len(r.stderr) < 2000


def test_generate_takes_the_adaptive_policy_and_reports_its_budgets():
    """``--policy adaptive``: the step costs measured on this device first, the output AR's, the
    budgets it ran in the stats; ``--help`` lists the policies."""
    base = ["generate", "--target", "tiny-dense", "--draft", "random", "--prompt", "Hello", "--max-new-tokens", "16",
            "--json", "--device", "cpu"]
    ar = json.loads(run(*base, "--verify", "ar").stdout)
    r = run(*base, "--verify", "ddtree", "--budget", "4", "--top-k", "2", "--policy", "adaptive",
            "--policy-levels", "1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tokens"] == ar["tokens"] and out["config"]["policy"] == "adaptive"
    hist = out["stats"]["budget_histogram"]
    assert set(hist) <= {"0", "4"} and sum(hist.values()) == out["stats"]["steps"]
    assert set(out["step_costs_ms"]) == {"0", "4"} and all(ms > 0 for ms in out["step_costs_ms"].values())
    assert "{fixed,adaptive}" in run("generate", "--help").stdout


def test_weights_native_on_a_float_target_is_refused_and_a_bad_mode_is_a_usage_error():
    """--weights native needs a GGUF target (its quantized blocks are what it keeps): a float preset is
    refused with a message naming the mode; an unknown mode is argparse's exit 2."""
    res = run("generate", "--target", "tiny-dense", "--draft", "none", "--verify", "ar", "--prompt", "hi",
              "--weights", "native", "--max-new-tokens", "2")
    assert res.returncode == 2 and "native" in res.stderr and "Traceback" not in res.stderr
    res = run("generate", "--target", "tiny-dense", "--draft", "none", "--prompt", "hi", "--weights", "packed")
    assert res.returncode == 2 and "--weights" in res.stderr and "invalid choice" in res.stderr
