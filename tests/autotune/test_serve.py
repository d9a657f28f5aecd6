"""`autotune serve`: the real server in a subprocess on a free loopback port, driven by the official
`openai` client (and raw HTTP for bodies the client would never send); export round trips."""

from __future__ import annotations

import http.client
import json
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import yaml
from autotune_helpers import env

import engine
from autotune import export
from autotune.cli import main
from engine import EngineConfig
from engine.data.prompts import Prompt

pytestmark = pytest.mark.xdist_group("test_serve")  # its module fixtures load models and start servers: once

KEY = "test-key-123"
ENGINE = {"verify": "ddtree", "budget": 8, "top_k": 2, "proposal_temp": 1.0, "chain_seed": None,
          "target_feat_ctx": 0, "rollback": "fast", "draft_path": "auto", "block_size": None,
          "temperature": 0.0, "seed": 0}
MODEL = {"target": "tiny-dense", "draft": "oracle:0.3", "device": "cpu", "dtype": "float32"}
MESSAGES = [{"role": "user", "content": "Write a haiku about tests."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def _doc(**engine_fields) -> dict:
    return {"engine": {**ENGINE, **engine_fields}, "model": dict(MODEL),
            "provenance": {"study": "tiny", "trial": 7, "decode_tps": 1.0}}


class Server:
    """`python -m autotune serve` in a subprocess; its output is read on a thread."""

    def __init__(self, config: Path, *flags: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "autotune", "serve", str(config), "--port", "0", *flags],
                                     env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 120
        while True:
            try:
                m = re.match(r"serving: (http://127\.0\.0\.1:(\d+))/v1", self.lines.get(timeout=0.5))
            except queue.Empty:
                m = None
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    raise AssertionError("the server did not start:\n" + "".join(self.output)) from None
            if m:
                self.url, self.port = m.group(1), int(m.group(2))
                break
        self.key = flags[flags.index("--api-key") + 1] if "--api-key" in flags else None

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def client(self, **kw) -> openai.OpenAI:
        kw.setdefault("api_key", self.key or "unused")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=60, **kw)

    def raw(self, method: str, path: str, body: bytes | str | None = None, key: str | None = "default"):
        """(status, headers, parsed JSON or text) for any request, 4xx and 5xx included."""
        key = self.key if key == "default" else key
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
        data = body.encode() if isinstance(body, str) else body
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status, hdrs, text = r.status, dict(r.headers), r.read().decode()
        except urllib.error.HTTPError as e:
            status, hdrs, text = e.code, dict(e.headers), e.read().decode()
        try:
            return status, hdrs, json.loads(text)
        except ValueError:
            return status, hdrs, text

    def interrupt(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGINT)
        rc = self.proc.wait(timeout=60)
        time.sleep(0.1)
        return rc, "".join(self.output)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """The engine export of a ddtree config, as `autotune export --format engine` writes it."""
    path = tmp_path_factory.mktemp("serve") / "best.yaml"
    path.write_text(export.render(_doc(), "engine"))
    return path


@pytest.fixture(scope="module")
def server(exported):
    s = Server(exported, "--api-key", KEY)
    yield s
    rc, out = s.interrupt()
    assert rc == 0, out  # Ctrl-C finishes cleanly, with a summary
    assert "stopped: served" in out and "Traceback" not in out


@pytest.fixture(scope="module")
def pair():
    return engine.load("tiny-dense", "oracle:0.3", device="cpu", dtype="float32")


def _chat(client, stream: bool, **kw):
    args = {"model": M, "messages": MESSAGES, "max_tokens": 40, "temperature": 0} | kw
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    text, finish, usage = [], None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return "".join(text), finish, usage


def test_models_and_plain_equals_stream_at_temperature_0(server, pair):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tiny-dense"]
    plain = _chat(client, stream=False)
    streamed = _chat(client, stream=True)
    assert plain[0] and plain[:2] == streamed[:2]
    # the same usage, but the second request found the first's prompt in the prefix cache (on by default)
    assert plain[2].model_dump(exclude={"prompt_tokens_details"}) == streamed[2].model_dump(
        exclude={"prompt_tokens_details"})
    assert streamed[2].prompt_tokens_details.cached_tokens == streamed[2].prompt_tokens - 1
    assert plain[2].completion_tokens == 40 and plain[1] == "length"
    # and it is exactly what AR decoding of the same chat gives
    ids = pair.encode(Prompt(messages=tuple(MESSAGES)))
    ar = engine.generate(pair, ids, EngineConfig(verify="ar"), 40)
    assert plain[0] == pair.tokenizer.decode(ar.tokens) and plain[2].prompt_tokens == len(ids)


def test_tools_go_through_the_chat_template_and_sampling_is_seeded(server):
    client = server.client()
    with_tools = _chat(client, stream=False, tools=TOOLS)
    without = _chat(client, stream=False)
    assert with_tools[2].prompt_tokens > without[2].prompt_tokens + 40  # the tool schema is in the prompt
    assert with_tools[:2] == _chat(client, stream=True, tools=TOOLS)[:2]
    # temperature > 0 samples, keyed by seed and position: plain and streamed still agree
    hot = _chat(client, stream=False, temperature=0.9, seed=5)
    assert hot[:2] == _chat(client, stream=True, temperature=0.9, seed=5)[:2]
    assert hot[0] != without[0]


def test_completions_and_stop_strings(server):
    client = server.client()
    plain = client.completions.create(model=M, prompt="def add(a, b):", max_tokens=30, temperature=0)
    text = plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=M, prompt="def add(a, b):", max_tokens=30, temperature=0, stream=True) if c.choices)
    assert text and text == streamed and plain.usage.completion_tokens == 30
    ids = client.completions.create(model=M, prompt=[100, 101, 102], max_tokens=3)  # token ids work too
    assert ids.usage.prompt_tokens == 3
    stop = text[5:8]
    assert stop not in text[:5] + stop[:-1]
    cut = client.completions.create(model=M, prompt="def add(a, b):", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    cut_stream = "".join(c.choices[0].text for c in client.completions.create(
        model=M, prompt="def add(a, b):", max_tokens=30, temperature=0, stop=[stop], stream=True) if c.choices)
    assert cut_stream == cut.choices[0].text


M = "tiny-dense"  # the served model's id (its target preset)
NESTED_HEAD = '{"model": "tiny-dense", "x": '
GOOD = {"model": M, "messages": MESSAGES, "max_tokens": 2}
BAD = {
    "malformed JSON": ("/v1/chat/completions", '{"model": M, "messages": [', "not valid JSON"),
    "body not an object": ("/v1/chat/completions", "[1, 2]", "must be a JSON object"),
    "messages not a list": ("/v1/chat/completions", {**GOOD, "messages": "hi"}, "messages: input should be"),
    "no messages": ("/v1/chat/completions", {"model": M}, "messages: field required"),
    "unknown role": ("/v1/chat/completions", {**GOOD, "messages": [{"role": "robot", "content": "x"}]},
                     "messages.0.role"),
    "content wrong type": ("/v1/chat/completions", {**GOOD, "messages": [{"role": "user", "content": 5}]},
                           "messages.0.content"),
    "max_tokens a string": ("/v1/chat/completions", {**GOOD, "max_tokens": "5"}, "max_tokens: input should be"),
    "max_tokens a float": ("/v1/chat/completions", {**GOOD, "max_tokens": 2.5}, "max_tokens"),
    "max_tokens negative": ("/v1/chat/completions", {**GOOD, "max_tokens": -3}, "max_tokens: must be >= 1"),
    "max_tokens zero": ("/v1/completions", {"model": M, "prompt": "x", "max_tokens": 0}, "must be >= 1"),
    "max_tokens huge": ("/v1/chat/completions", {**GOOD, "max_tokens": 10**12}, "exceeds the model's context"),
    "prompt longer than the context": ("/v1/completions", {"model": M, "prompt": "x" * 5000, "max_tokens": 1},
                                       "the prompt has 5000 tokens, but the model's context holds 4096"),
    "temperature a string": ("/v1/chat/completions", {**GOOD, "temperature": "hot"}, "temperature"),
    "temperature negative": ("/v1/chat/completions", {**GOOD, "temperature": -1}, "between 0 and 2"),
    "seed negative": ("/v1/chat/completions", {**GOOD, "seed": -1}, "seed: must be between"),
    "stream not a bool": ("/v1/chat/completions", {**GOOD, "stream": "yes"}, "stream"),
    "stop wrong type": ("/v1/chat/completions", {**GOOD, "stop": [1]}, "stop: must be"),
    "n > 1": ("/v1/chat/completions", {**GOOD, "n": 2}, "only n=1"),
    "chat logprobs": ("/v1/chat/completions", {**GOOD, "logprobs": True}, "logprobs: not supported"),
    "chat top_logprobs": ("/v1/chat/completions", {**GOOD, "top_logprobs": 3}, "top_logprobs: not supported"),
    "completion logprobs": ("/v1/completions", {"model": M, "prompt": "hi", "logprobs": 2}, "logprobs: not supported"),
    "completion echo": ("/v1/completions", {"model": M, "prompt": "hi", "echo": True}, "echo: not supported"),
    "completion best_of": ("/v1/completions", {"model": M, "prompt": "hi", "best_of": 2}, "best_of: only 1"),
    "tool not a function": ("/v1/chat/completions", {**GOOD, "tools": [{"type": "retrieval"}]},
                            "tools.0: must be an object of type 'function'"),
    "tool without a name": ("/v1/chat/completions", {**GOOD, "tools": [{"type": "function", "function": {}}]},
                            "tools.0.function.name: must be a non-empty name"),
    "tool parameters not an object": ("/v1/chat/completions", {**GOOD, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "parameters: must be a JSON-schema"),
    "tool call without a function": ("/v1/chat/completions", {**GOOD, "messages": [
        *MESSAGES, {"role": "assistant", "tool_calls": [{"x": 1}]}]}, "messages.1.tool_calls.0: must be"),
    "tool message without its call id": ("/v1/chat/completions", {**GOOD, "messages": [
        *MESSAGES, {"role": "tool", "content": "42"}]}, "messages.1.tool_call_id: a tool message must name"),
    "tool_choice required": ("/v1/chat/completions", {**GOOD, "tool_choice": "required"},
                             "tool_choice: only 'auto'"),
    "response_format json": ("/v1/chat/completions", {**GOOD, "response_format": {"type": "json_object"}},
                             "response_format: only"),
    "prompt wrong type": ("/v1/completions", {"model": M, "prompt": {"a": 1}}, "prompt: must be"),
    "token id out of vocabulary": ("/v1/completions", {"model": M, "prompt": [99999]}, "outside the vocabulary"),
    "deeply nested body": ("/v1/chat/completions", NESTED_HEAD + "[" * 50_000 + "]" * 50_000 + "}",
                           "nested more than 64 deep"),
    "huge wrong-typed value": ("/v1/chat/completions", {**GOOD, "stop": [["s"] * 50_000]}, "characters)"),
}


def test_bad_requests_get_400_with_a_message_and_the_server_keeps_answering(server):
    for name, (path, body, message) in BAD.items():
        status, _, got = server.raw("POST", path, body if isinstance(body, str) else json.dumps(body))
        assert status == 400, (name, status, got)
        assert message in got["error"]["message"], (name, got)
        assert len(json.dumps(got)) < 2048, (name, len(json.dumps(got)))  # whatever the body, a small answer
        assert got["error"]["type"] == "invalid_request_error"
        status, _, ok = server.raw("POST", "/v1/chat/completions", json.dumps(GOOD))
        assert status == 200 and ok["usage"]["completion_tokens"] == 2, name
    assert server.raw("GET", "/v1/nothing-here")[0] == 404
    status, _, got = server.raw("POST", "/v1/chat/completions", json.dumps({**GOOD, "model": "gpt-4o"}))
    assert status == 404 and got["error"]["code"] == "model_not_found" and "'tiny-dense'" in got["error"]["message"]
    assert server.raw("POST", "/v1/chat/completions", json.dumps({k: v for k, v in GOOD.items() if k != "model"}))[0] \
        == 200  # (no model named: the served one)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # the client sees them as errors too
        server.client().chat.completions.create(model=M, messages=MESSAGES, max_tokens=-1)


def test_api_key_is_enforced(server):
    for key in (None, "wrong"):
        for method, path, body in (("GET", "/v1/models", None), ("GET", "/metrics", None),
                                   ("POST", "/v1/chat/completions", json.dumps(GOOD)),
                                   ("POST", "/v1/completions", "{not json")):  # 401 before the body is read
            status, headers, got = server.raw(method, path, body, key=key)
            assert status == 401 and got["error"]["code"] == "invalid_api_key", (key, path)
            assert headers.get("www-authenticate", headers.get("WWW-Authenticate")) == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    assert server.client().models.list().data


@pytest.mark.slow
def test_200_sequential_then_20_concurrent_requests(server):
    client = server.client()
    for i in range(200):
        if i % 2:
            r = client.chat.completions.create(model=M, messages=[{"role": "user", "content": f"n{i}"}],
                                               max_tokens=3)
            assert r.choices[0].message.content is not None
        else:
            r = client.completions.create(model=M, prompt=f"n{i}", max_tokens=3)
        # the random tiny model may say its stop token early
        assert 1 <= r.usage.completion_tokens <= 3 and r.choices[0].finish_reason in ("stop", "length")

    def one(i):
        return _chat(client, stream=bool(i % 2), max_tokens=6, messages=[{"role": "user", "content": f"c{i}"}])

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    assert len(results) == 20 and all(1 <= r[2].completion_tokens <= 6 for r in results)


def test_metrics_in_prometheus_text(server):
    # one request of each outcome counted below, whatever ran on this server before
    assert server.raw("POST", "/v1/chat/completions", json.dumps({**GOOD, "max_tokens": 20}))[0] == 200
    assert server.raw("POST", "/v1/chat/completions", "{")[0] == 400
    assert server.raw("POST", "/v1/chat/completions", json.dumps({**GOOD, "model": "gpt-4o"}))[0] == 404
    status, headers, text = server.raw("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values['autotune_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    assert values['autotune_requests_total{endpoint="/v1/chat/completions",status="400"}'] >= 1
    assert values['autotune_requests_total{endpoint="/v1/chat/completions",status="404"}'] >= 1
    assert values["autotune_completion_tokens_total"] > 0 and values["autotune_prompt_tokens_total"] > 0
    assert values["autotune_acceptance_length"] > 1.0  # the oracle draft is mostly right
    assert values["autotune_decode_tokens_per_second"] > 0
    assert values["autotune_queue_depth"] == 0 and values["autotune_queue_capacity"] == 32
    assert "# TYPE autotune_requests_total counter" in text


def test_full_queue_gets_503_with_retry_after_and_a_dropped_stream_frees_the_engine(exported):
    s = Server(exported, "--max-queue", "0")  # one running, none waiting
    try:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        # the tiny model's greedy continuation of "aaaa" runs 4000 tokens without a stop token (~40 s)
        body = {"model": M, "prompt": "aaaa", "max_tokens": 4000, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")  # generating now
        status, headers, got = s.raw("POST", "/v1/chat/completions", json.dumps(GOOD))
        assert status == 503 and headers["retry-after"] == "1" and got["error"]["code"] == "queue_full"
        with pytest.raises(openai.APIStatusError) as err:
            s.client().chat.completions.create(model=M, messages=MESSAGES, max_tokens=2)
        assert err.value.status_code == 503
        conn.close()  # the client goes away mid-stream: the engine stops at its next step
        deadline = time.monotonic() + 10
        while (status := s.raw("POST", "/v1/chat/completions", json.dumps(GOOD))[0]) == 503:
            assert time.monotonic() < deadline, "the dropped stream kept the engine busy"
            time.sleep(0.05)
        assert status == 200
        # Ctrl-C while a stream runs: it ends at the next step with a proper end, and the server exits
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.readline().startswith(b"data: ")
        t0 = time.monotonic()
        rc, out = s.interrupt()
        rest = resp.read().decode()
        assert rest.rstrip().endswith("data: [DONE]") and time.monotonic() - t0 < 5
    finally:
        rc, out = s.interrupt()
    assert rc == 0 and "stopped: served" in out and "Traceback" not in out, out


@pytest.mark.parametrize("args, message", [
    (["serve", "missing.yaml"], "config file not found"),
    (["serve", "{cfg}", "--port", "70000"], "--port: must be between 0 and 65535"),
    (["serve", "{cfg}", "--max-queue", "-1"], "--max-queue: must be >= 0"),
    (["serve", "{cfg}", "--prefix-cache-mb", "-1"], "--prefix-cache-mb: must be a finite number >= 0"),
    (["serve", "{cfg}", "--prefix-cache-mb", "nan"], "--prefix-cache-mb: must be a finite number >= 0"),
    (["serve", "{flat}"], "needs a 'model' section"),
    (["serve", "{bad}"], "EngineConfig.budget must be >= 1"),
    # the oracle draft proposes on the host: refused before serving, not at each request
    (["serve", "{runtime}"], "cannot serve draft_path='runtime' with verify='ddtree' on this pair: it proposes"),
])
def test_serve_bad_input_exits_2(tmp_path, capsys, exported, args, message):
    flat = tmp_path / "flat.yaml"
    flat.write_text(yaml.safe_dump(ENGINE))
    bad = tmp_path / "bad.yaml"
    bad.write_text(export.render(_doc(budget=0), "engine"))
    runtime = tmp_path / "runtime.yaml"
    runtime.write_text(export.render(_doc(draft_path="runtime"), "engine"))
    argv = [a.format(cfg=exported, flat=flat, bad=bad, runtime=runtime) for a in args]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


# --- export round trips ---------------------------------------------------------------------------


def test_engine_export_round_trip_through_the_engine_cli(exported):
    doc = yaml.safe_load(exported.read_text())
    proc = subprocess.run([sys.executable, "-m", "engine", "generate", "--config", str(exported), "--prompt", "Hi",
                           "--max-new-tokens", "12", "--json"], env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert doc["engine"] == _doc()["engine"]
    # the engine reports every field, defaults included, of the config it ran
    assert json.loads(proc.stdout)["config"] == EngineConfig.from_dict(doc["engine"]).to_dict()


def test_json_export_round_trip():
    doc = _doc(proposal_temp=0.7, chain_seed=2, target_feat_ctx=256, policy="adaptive", probe_every=4)
    back = json.loads(export.render(doc, "json"))
    assert EngineConfig.from_dict(back["engine"]) == EngineConfig.from_dict(doc["engine"])
    assert back["model"] == doc["model"] and back["provenance"] == doc["provenance"]


MAPPED = ("verify", "budget", "rollback", "proposal_temp", "chain_seed", "target_feat_ctx")


@pytest.mark.parametrize("fields, unmapped", [
    (dict(budget=22, proposal_temp=0.8, chain_seed=0, target_feat_ctx=4096), ["top_k=2", "draft_path=auto"]),
    (dict(budget=40, proposal_temp=1.0, chain_seed=None, target_feat_ctx=2048), ["top_k=2"]),
    (dict(budget=12, chain_seed=3, target_feat_ctx=128, rollback="replay", block_size=8),
     ["chain_seed=3", "target_feat_ctx=128", "rollback=replay", "block_size=8"]),
    (dict(verify="chain", rollback="fast", target_feat_ctx=8192), ["draft_path=auto"]),
    (dict(verify="ar", draft_path="runtime"), ["draft_path=runtime"]),
    (dict(budget=48, policy="adaptive", policy_levels=3), ["policy=adaptive"]),
])
def test_llama_server_export_parses_back_to_the_mapped_values(fields, unmapped):
    doc = _doc(**fields)
    doc["model"].update(target="/models/my target.gguf", draft="/models/draft.gguf")
    text = export.render(doc, "llama-server")
    back = export.parse_llama_server(text)
    cfg = doc["engine"]
    expect = {"verify": cfg["verify"]}
    if cfg["verify"] == "ddtree":
        expect.update(budget=cfg["budget"], rollback="fast", proposal_temp=cfg["proposal_temp"],
                      chain_seed=cfg["chain_seed"] if cfg["chain_seed"] == 0 else None)
    if cfg["verify"] == "chain":
        expect.update(rollback="fast")
    if cfg["verify"] != "ar" and cfg["target_feat_ctx"] >= 2048:
        expect.update(target_feat_ctx=cfg["target_feat_ctx"])
    assert back == expect
    assert set(back) <= set(MAPPED)
    note = next(ln for ln in text.splitlines() if ln.startswith("# no equivalent in the port:"))
    assert all(u in note for u in unmapped), note
    # the port has no adaptive policy: said where the command is, not only in the unmapped list
    assert ("# WARNING: the winner uses the adaptive step policy" in text) == (cfg.get("policy") == "adaptive")
    argv = shlex.split(text.splitlines()[-1])  # valid sh; quoting survives paths with spaces
    assert argv[:2] == ["dflash_server", "/models/my target.gguf"] and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert ("--draft" in argv) == (cfg["verify"] != "ar")


def _asgi(app, method: str, path: str, body: bytes = b"") -> tuple[int, dict]:
    """One request straight through the ASGI app (no socket): its status and JSON body."""
    import asyncio

    sent: list[dict] = []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "scheme": "http", "root_path": ""}
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(text) if text.startswith(b"{") else {"text": text.decode()}


def test_a_server_bug_is_a_500_in_json_and_counted(pair, monkeypatch):
    """An exception the server did not expect (here: planted in the job builder) answers 500 with an
    OpenAI-style body and shows in /metrics; the next request is served."""
    from engine.serving import server as srv

    app = srv.create_app(pair, EngineConfig(verify="ar"), "tiny-dense")
    real = srv.make_job
    monkeypatch.setattr(srv, "make_job", lambda *a: (_ for _ in ()).throw(RuntimeError("planted")))
    status, got = _asgi(app, "POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2}).encode())
    assert status == 500 and got["error"]["type"] == "server_error" and "RuntimeError" in got["error"]["message"]
    monkeypatch.setattr(srv, "make_job", real)
    status, _ = _asgi(app, "POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2}).encode())
    assert status == 200
    _, metrics = _asgi(app, "GET", "/metrics")
    assert 'autotune_requests_total{endpoint="/v1/completions",status="500"} 1' in metrics["text"]
    app.state.runner.close()


def test_the_adaptive_policy_is_warmed_up_before_the_first_request(pair):
    """`autotune serve` measures the policy's step costs at start (printed as step_costs_ms), kept on
    the pair: a request then finds them and does not measure them itself."""
    from engine.decoding.policy import policy_budgets
    from engine.serving import server as srv

    assert srv.warm_up(pair, EngineConfig.from_dict(ENGINE)) is None  # the fixed policy needs no table
    cfg = EngineConfig.from_dict({**ENGINE, "budget": 8, "policy": "adaptive", "policy_levels": 2})
    costs = srv.warm_up(pair, cfg)
    assert sorted(costs) == list(policy_budgets(8, 2)) == [0, 4, 8] and all(ms > 0 for ms in costs.values())
    kept = pair.step_costs(cfg)  # no prompt: it must be the kept table, or this raises
    assert dict(kept.ms) == costs
