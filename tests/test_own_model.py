"""docs/own-model.md, run (issue #24): its `bash` blocks, in order, on a tiny model this test creates as
an HF folder and as a GGUF file, from train-draft on a small JSONL of traffic to a sweep, the report,
an export and a server that answers one chat request.

The guide's commands run as written but for the changes its last section lists: `train-draft` gets
`--smoke`, the experiment is shrunk (TINY_EXPERIMENT), the GGUF run writes `./my-model.gguf` for
`./my-model`, and the server gets `--port 0` (the `curl` goes to the port it bound). A block whose
first line is `# HF folder` or `# GGUF file` would run for that form only (the guide has none now:
every step is the same for both); a `yaml` block is written to the file its first line names.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml

from tests.engine.gguf_files import write_gguf

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "own-model.md"
BIN = Path(sys.executable).parent  # the virtualenv's python and autotune, as the guide's `python` and `autotune`
STUDY = "my-model"
FORMS = {"hf": "# HF folder", "gguf": "# GGUF file"}
# The experiment at test size: what the guide's last section says the test changes.
TINY_EXPERIMENT = {"workload": {"n_prompts": 2, "max_new_tokens": 12},
                   "measure": {"warmup": 0, "repeats": 1, "max_rel_mad": 0.5, "confirm_top": 1, "confirm_repeats": 1},
                   "study": {"n_trials": 2}}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_pad|>"]
BLOCK_TIMEOUT_S = 600


# ------------------------------------------------------------------------------------ the guide

@dataclass
class Block:
    lang: str
    text: str
    line: int  # where it starts in the guide, for messages

    @property
    def first(self) -> str:
        return self.text.splitlines()[0].strip() if self.text.strip() else ""

    @property
    def commands(self) -> list[str]:
        return [ln for ln in self.text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def blocks(text: str) -> list[Block]:
    return [Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1)
            for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S)]


def for_form(block: Block, form: str) -> bool:
    """A block marked for one form runs for that form only; the rest run for both."""
    marked = [f for f, mark in FORMS.items() if block.first.startswith(mark)]
    return not marked or marked == [form]


def as_form(text: str, form: str) -> str:
    """The guide's rule: with a GGUF file, `./my-model.gguf` wherever `./my-model` appears."""
    return re.sub(r"\./my-model(?=[\s,}'\"]|$)", "./my-model.gguf", text, flags=re.M) if form == "gguf" else text


def merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


# ----------------------------------------------------------------------------- the tiny model

def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = [json.dumps(p) for p in _traffic()] * 4
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok


def _traffic() -> list[dict]:
    """20 prompts: plain text, chats, and (line 20, which the guide's split sends to the sweep) one with tools."""
    topics = ["the sea", "a bicycle", "rain in April", "a quiet library", "coffee", "mountains", "a lost key",
              "trains", "winter light", "an old map"]
    out: list[dict] = []
    for i, topic in enumerate(topics):
        out.append({"messages": [{"role": "user", "content": f"Write two sentences about {topic}."}]})
        out.append({"prompt": f"def describe_{i}(thing):\n    \"\"\"Describe {topic}.\"\"\"\n"})
    out[-1] = {"messages": [{"role": "user", "content": "Weather in Oslo?"}],
               "tools": [{"type": "function", "function": {
                   "name": "get_weather", "description": "Weather for a city",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]}
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """my-model/ (config.json + model.safetensors + tokenizer.json), my-model.gguf and traffic.jsonl."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("models")
    tok = _tokenizer()
    cfg = transformers.Qwen3Config(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1,
        max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=None, pad_token_id=None,
        eos_token_id=tok.token_to_id("<|im_end|>"))
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    hf.save_pretrained(folder / "my-model")
    tok.save(str(folder / "my-model" / "tokenizer.json"))
    write_gguf(folder / "my-model.gguf", hf, "qwen3", tokenizer=tok, specials=tuple(SPECIALS), chat_template=(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    (folder / "traffic.jsonl").write_text("".join(json.dumps(p) + "\n" for p in _traffic()))
    return folder


# ------------------------------------------------------------------------------------- running

def _env(work: Path) -> dict[str, str]:
    e = dict(os.environ)
    e["PATH"] = f"{BIN}{os.pathsep}{e.get('PATH', '')}"
    e["PYTHONPATH"] = f"{REPO}{os.pathsep}{e.get('PYTHONPATH', '')}"
    e["OMP_NUM_THREADS"] = "1"  # tiny models run fastest on one thread
    e["AUTOTUNE_CACHE"] = str(work / ".cache")  # nothing is fetched; if it were, not into the home folder
    for name in ("MLFLOW_TRACKING_URI", "ENGINE_KERNELS", "ENGINE_LINEAR_PLANS"):  # the guide's defaults
        e.pop(name, None)
    return e


def _describe(block: Block, proc) -> str:
    return (f"docs/own-model.md line {block.line}:\n{block.text}\nexit {proc.returncode}\n"
            f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")


class Server:
    """The guide's `autotune serve` line, on a free port; its output read on a thread."""

    def __init__(self, line: str, work: Path) -> None:
        self.line = line
        self.proc = subprocess.Popen([*shlex.split(line), "--port", "0"], cwd=work, env=_env(work),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(lines,), daemon=True).start()
        deadline = time.monotonic() + 180
        while True:
            try:
                m = re.match(r"serving: http://127\.0\.0\.1:(\d+)/v1", lines.get(timeout=0.5))
            except queue.Empty:
                m = None
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    raise AssertionError(f"`{line}` did not start:\n" + "".join(self.output)) from None
            if m:
                self.port = int(m.group(1))
                return

    def _read(self, lines: queue.Queue) -> None:
        for ln in self.proc.stdout:
            self.output.append(ln)
            lines.put(ln)

    def stop(self) -> tuple[int, str]:
        """Ctrl-C, as the guide says."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            rc = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        time.sleep(0.1)  # the reader thread takes the last lines
        return rc, "".join(self.output)


@dataclass
class Run:
    """What running the guide left: each command's output, and the server's answer and exit."""

    outputs: list[tuple[Block, str]] = field(default_factory=list)
    answer: dict | None = None
    server_exit: tuple[int, str] | None = None

    def output_of(self, needle: str) -> str:
        found = [out for b, out in self.outputs if needle in b.text]
        assert found, f"no block of the guide runs {needle!r}"
        return "\n".join(found)


def run_guide(text: str, work: Path, form: str) -> Run:
    """Every block for ``form``, in order, in ``work``; AssertionError naming the block that failed."""
    run, server = Run(), None
    try:
        for block in blocks(text):
            if not for_form(block, form):
                continue
            body = as_form(block.text, form)
            if block.lang == "yaml":
                _write_yaml(block, body, work)
            elif block.lang == "bash" and any(c.lstrip().startswith("autotune serve") for c in block.commands):
                assert len(block.commands) == 1, f"line {block.line}: the serve block holds one command"
                server = Server(block.commands[0].strip(), work)
            elif block.lang == "bash":
                if server is not None:
                    body = body.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
                body = body.replace("python -m engine train-draft", "python -m engine train-draft --smoke")
                proc = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=work, env=_env(work),
                                      capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
                assert proc.returncode == 0, _describe(block, proc)
                run.outputs.append((block, proc.stdout))
                if server is not None and "/v1/chat/completions" in body:
                    run.answer = json.loads(proc.stdout)
                    run.server_exit, server = server.stop(), None
    finally:
        if server is not None:
            server.stop()
    return run


def _write_yaml(block: Block, body: str, work: Path) -> None:
    m = re.match(r"#\s*([\w.-]+\.yaml)\b", block.first)
    assert m, f"docs/own-model.md line {block.line}: a yaml block's first line names its file (# NAME.yaml)"
    doc = yaml.safe_load(body)
    if isinstance(doc, dict) and {"model", "workload", "study"} <= set(doc):
        doc = merged(doc, TINY_EXPERIMENT)
    (work / m.group(1)).write_text(yaml.safe_dump(doc, sort_keys=False))


# --------------------------------------------------------------------------------------- tests

def test_the_guide_holds_every_step_for_both_forms():
    text = GUIDE.read_text(encoding="utf-8")
    for form in FORMS:
        runnable = "\n".join(as_form(b.text, form) for b in blocks(text) if b.lang == "bash" and for_form(b, form))
        target = "./my-model.gguf" if form == "gguf" else "./my-model"
        for step in (f"python -m engine generate --target {target} --verify ar",
                     f"python -m engine train-draft --target {target} --prompts train.jsonl --out my-draft",
                     "autotune sweep my-model.yaml", f"autotune report {STUDY} --out reports/{STUDY}",
                     f"autotune export {STUDY} --format engine --out best.yaml", "autotune serve best.yaml",
                     "http://127.0.0.1:8000/v1/chat/completions"):
            assert step in runnable, (form, step)
    files = [re.match(r"#\s*([\w.-]+\.yaml)", b.first) for b in blocks(text) if b.lang == "yaml"]
    assert [f.group(1) for f in files if f] == ["my-space.yaml", "my-model.yaml"]
    exp = yaml.safe_load(next(b.text for b in blocks(text) if b.first.startswith("# my-model.yaml")))
    assert exp["model"]["target"] == "./my-model" and exp["model"]["draft"] == "./my-draft"
    assert exp["search_space"] == "my-space.yaml" and exp["name"] == STUDY


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_the_guide_runs_end_to_end(form, models, tmp_path):
    if shutil.which("curl") is None:
        pytest.skip("the guide's request is a curl command")
    assert (BIN / "autotune").is_file(), f"{BIN} has no autotune script (pip install -e . in this interpreter)"
    model = models / ("my-model.gguf" if form == "gguf" else "my-model")
    # Only this form's model is there: nothing may lean on the other one.
    (shutil.copy if model.is_file() else shutil.copytree)(model, tmp_path / model.name)
    shutil.copy(models / "traffic.jsonl", tmp_path / "traffic.jsonl")

    run = run_guide(GUIDE.read_text(encoding="utf-8"), tmp_path, form)

    # step 2: the split
    assert len((tmp_path / "eval.jsonl").read_text().splitlines()) == 2
    assert len((tmp_path / "train.jsonl").read_text().splitlines()) == 18
    # step 3: a draft in the public DFlash layout, and the pair decoding with it
    draft = tmp_path / "my-draft"
    assert {"config.json", "model.safetensors", "training.json"} <= {p.name for p in draft.iterdir()}
    assert json.loads((draft / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    assert re.search(r"^checkpoint: my-draft$", run.output_of("train-draft"), flags=re.M)
    assert re.search(r"^acceptance_length: [\d.]+$", run.output_of("--draft ./my-draft"), flags=re.M)
    # the resumable run of "Acceptance is below break-even": a checkpoint, two calls, the draft
    assert (tmp_path / "my-run" / "checkpoint.json").is_file() and (tmp_path / "my-run" / "curves.png").is_file()
    assert len(json.loads((tmp_path / "my-draft-2" / "training.json").read_text())["calls"]) == 2
    # step 5: a study with finished trials, in this folder
    summary = run.output_of("autotune sweep")
    assert re.search(r"^exit: done$", summary, flags=re.M), summary
    assert re.search(r"^trials_finished: [1-9]\d*$", summary, flags=re.M), summary
    import optuna

    study = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{tmp_path / 'autotune.db'}")
    done = [t.user_attrs.get("role", "search") for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert "baseline" in done and len(done) - done.count("baseline") >= 2, done  # AR, then the configs measured
    assert (tmp_path / "mlflow.db").is_file()
    # step 6: the report and the winner
    report = (tmp_path / "reports" / STUDY / "report.md").read_text()
    assert report.startswith(f"# autotune report: {STUDY}") and "## Winner" in report
    assert re.search(rf"^study: {STUDY}$", run.output_of("autotune best"), flags=re.M)
    # step 7: the export, naming this form's model and the trained draft by absolute path
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert set(best) == {"engine", "model", "provenance"} and best["provenance"]["study"] == STUDY
    assert best["model"]["target"] == str((tmp_path / model.name).resolve())
    assert best["model"]["draft"] == str(draft.resolve())
    assert re.search(r"^new_tokens: \d+$", run.output_of("--config best.yaml"), flags=re.M)
    # step 8: one chat answer (curl --fail-with-body: a non-2xx exits non-zero), then a clean Ctrl-C
    assert run.answer is not None, "the guide's curl block did not run against the server"
    assert run.answer["object"] == "chat.completion" and run.answer["choices"][0]["message"]["role"] == "assistant"
    assert run.answer["usage"]["completion_tokens"] >= 1
    rc, out = run.server_exit
    assert rc == 0 and "stopped: served 1 generations" in out and "Traceback" not in out, out


def test_a_failing_command_fails_the_run(tmp_path):
    """The runner is not a rubber stamp: a command that exits non-zero names its block and output."""
    guide = ("Intro.\n\n```bash\npython -m engine generate --target ./my-model --verify ar --prompt hi "
             "--max-new-tokens 2\n```\n")
    with pytest.raises(AssertionError, match=r"(?s)line 3:.*exit 2.*no such folder or \.gguf file"):
        run_guide(guide, tmp_path, "hf")
    assert as_form(guide, "gguf").count("./my-model.gguf ") == 1
