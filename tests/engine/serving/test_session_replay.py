"""`benchmarks/session_replay.py` against a live server on 127.0.0.1: sessions replayed turn by turn
through the official `openai` client, the model's replies fed back; with the prefix cache the later
turns reuse the conversation, and every reply equals the same replay on a server without it."""

import json

import pytest

import engine
from engine import EngineConfig
from engine.data.prompts import Prompt
from engine.data.sessions import request
from engine.serving.text import TextStream
from tests.engine.bench_modules import load_benchmark
from tests.engine.serving.live_server import live

CFG = EngineConfig(verify="ddtree", budget=8, top_k=2, draft_path="generic")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
SESSIONS = [
    {"id": "agent", "tools": TOOLS, "messages": [
        {"role": "system", "content": "You are an agent. Call tools when needed."},
        {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": ""},
        {"role": "user", "content": "And in Rome?"}, {"role": "assistant", "content": ""},
        {"role": "user", "content": "Which is warmer?"}]},
    {"id": "chat", "messages": [
        {"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once..."},
        {"role": "user", "content": "Shorter."}, {"role": "assistant", "content": "Ok."},
        {"role": "user", "content": "Thanks!"}]},
]


@pytest.fixture(scope="module")
def pair():
    return engine.load("tiny-dense", "random", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def replay():
    return load_benchmark("session_replay")


def test_a_replay_reports_turns_reuses_the_cache_and_answers_as_without_it(pair, replay, tmp_path, capsys):
    sessions = tmp_path / "sessions.jsonl"
    sessions.write_text("".join(json.dumps(s) + "\n" for s in SESSIONS))
    outs = {}
    for name, mb in (("cached", 64), ("cold", 0)):
        with live(pair, CFG, prefix_cache_mb=mb) as url:
            outs[name] = tmp_path / f"{name}.json"
            assert replay.main(["replay", str(sessions), "--url", url + "/v1", "--max-tokens", "10",
                                "--concurrency", "2", "--out", str(outs[name])]) == 0
        summary = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
        assert summary["sessions"] == "2" and summary["turns"] == "6" and summary["sessions_cut"] == "0"
        assert float(summary["session_tps_mean"]) > 0 and float(summary["ttft_later_turns_ms"]) > 0
        # the later turns' prompts are mostly the conversation so far: cached where the cache is on
        assert (float(summary["cached_share_later_turns"]) > 0.5) == (name == "cached")
    cached = json.loads(outs["cached"].read_text())["sessions"]
    for s in cached:
        first, *later = s["turns"]
        assert first["cached_tokens"] < 8  # at most the chat template's opening the other session left
        assert all(t["cached_tokens"] >= before["prompt_tokens"] for t, before in zip(later, s["turns"], strict=False))
        for t in s["turns"]:
            assert 0 < t["ttft_s"] <= t["turn_s"] and 1 <= t["completion_tokens"] <= 10
        assert s["session_tps"] == pytest.approx(s["completion_tokens"] / s["wall_s"])
    assert replay.main(["compare", str(outs["cached"]), str(outs["cold"])]) == 0
    assert "turns_equal: 6" in capsys.readouterr().out
    # the chat session's replies are the model's own, fed back: each equals AR on what the turn sent
    chat = Prompt(messages=tuple(SESSIONS[1]["messages"]))
    replies = [t["text"] for t in cached[1]["turns"]]
    for k, text in enumerate(replies):
        ids = pair.encode(Prompt(messages=tuple(request(chat, replies[:k]))))
        stream = TextStream(pair.tokenizer.decode, pair.stop_ids, [])
        stream.push(engine.generate(pair, ids, EngineConfig(verify="ar"), 10).tokens)
        assert text == stream.text + stream.finish()


def test_bad_input_exits_2(replay, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant",
                                                                            "content": "a"}]}) + "\n")
    assert replay.main(["replay", str(bad)]) == 2
    assert "bad.jsonl:1: a session's messages must end" in capsys.readouterr().err
    assert replay.main(["replay", str(tmp_path / "missing.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err
    assert replay.main(["replay", str(bad), "--concurrency", "0"]) == 2
    assert "--concurrency must be >= 1" in capsys.readouterr().err
