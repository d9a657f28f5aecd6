"""The server with its prefix cache, live on 127.0.0.1 (uvicorn on a thread of this process), driven
by the official `openai` client: multi-turn chats report `usage.prompt_tokens_details.cached_tokens`
(streamed and not), answer what a cold run answers, and `/metrics` shows the cache."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

import engine
from engine import EngineConfig
from engine.data.prompts import Prompt
from engine.serving import server as srv
from engine.serving.text import TextStream
from tests.engine.serving import live_server

CFG = EngineConfig(verify="ddtree", budget=8, top_k=2, draft_path="runtime")  # the runtime's steps, eagerly
MAX = 12
SYSTEM = {"role": "system", "content": "You are a terse agent with tools. Answer in one short line."}
USERS = ["Weather in Paris?", "Tool said: 21C. And Rome?", "Thanks. Summarise both."]


@pytest.fixture(scope="module")
def pair():
    return engine.load("tiny-dense", "random", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def reference():
    """Cold answers: the same pair, AR without any cache (a separate copy: the server's runs alone)."""
    ref = engine.load("tiny-dense", "random", device="cpu", dtype="float32")

    def answer(messages: list[dict]) -> str:
        ids = ref.encode(Prompt(messages=tuple(messages)))
        stream = TextStream(ref.tokenizer.decode, ref.stop_ids, [])
        stream.push(engine.generate(ref, ids, EngineConfig(verify="ar"), MAX).tokens)
        return stream.text + stream.finish()

    return answer


def live(pair, **kw):
    return live_server.live(pair, CFG, **kw)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _turn(client: openai.OpenAI, messages: list[dict], stream: bool) -> tuple[str, object]:
    """(the answer's text, its usage)."""
    args = {"model": "tiny", "messages": messages, "max_tokens": MAX, "temperature": 0}
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, r.usage
    text, usage = [], None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        usage = chunk.usage or usage
        text += [c.delta.content or "" for c in chunk.choices]
    return "".join(text), usage


def _session(client: openai.OpenAI, first: str, streams: tuple[bool, ...]) -> list[tuple[str, int, int, list]]:
    """A chat whose every turn sends the whole conversation with the model's own replies:
    (answer, prompt tokens, cached tokens, the messages sent) per turn."""
    messages, turns = [SYSTEM, {"role": "user", "content": first}], []
    for i, stream in enumerate(streams):
        text, usage = _turn(client, messages, stream)
        turns.append((text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, list(messages)))
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": USERS[(i + 1) % 3]}]
    return turns


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {name: float(v) for name, _, v in (ln.rpartition(" ") for ln in text.splitlines())
            if name and not name.startswith("#")}


def test_a_session_reports_cached_tokens_answers_as_cold_and_shows_in_metrics(pair, reference):
    with live(pair) as url:  # the default budget
        turns = _session(_client(url), USERS[0], (False, True, False, True))
        m = _metrics(url)
    assert turns[0][2] == 0
    for (_, prompt_tokens, cached, _), before in zip(turns[1:], turns, strict=False):
        # the previous turn's prompt and answer, up to where the template's rendering of the reply
        # leaves the generated ids (at most the whole previous prompt and answer)
        assert before[1] <= cached < prompt_tokens
    for text, _, _, messages in turns:
        assert text == reference(messages)
    assert m["autotune_prefix_cache_hits_total"] == 3 and m["autotune_prefix_cache_misses_total"] == 1
    assert m["autotune_prefix_cache_hit_rate"] == 0.75
    assert m["autotune_prompt_tokens_cached_total"] == sum(t[2] for t in turns)
    assert m["autotune_prefix_cache_token_hit_rate"] == pytest.approx(
        sum(t[2] for t in turns) / sum(t[1] for t in turns))
    assert 0 < m["autotune_prefix_cache_bytes"] <= m["autotune_prefix_cache_capacity_bytes"] == \
        srv.DEFAULT_PREFIX_CACHE_MB * 2**20
    assert m["autotune_prefix_cache_evictions_total"] == 0 and m["autotune_prefill_seconds_total"] > 0


def test_concurrent_sessions_queue_and_each_answers_as_cold(pair, reference):
    firsts = ["Weather in Oslo?", "Add 2 and 3.", "Weather in Lima?", "Add 7 and 8."]
    with live(pair, max_queue=8) as url, ThreadPoolExecutor(len(firsts)) as pool:
        sessions = list(pool.map(lambda f: _session(_client(url), f, (True, False, True)), firsts))
        m = _metrics(url)
    for turns in sessions:  # (a first turn may find the system prompt another session left)
        assert all(t[2] >= before[1] for t, before in zip(turns[1:], turns, strict=False))
        for text, _, _, messages in turns:
            assert text == reference(messages)
    assert m["autotune_prefix_cache_hits_total"] + m["autotune_prefix_cache_misses_total"] == 12
    assert m["autotune_queue_depth"] == 0


def test_a_small_budget_evicts_and_an_evicted_session_is_answered_alike(pair, reference):
    with live(pair, prefix_cache_mb=0.2) as url:  # ~210 KB: one two-turn conversation (1.3 KB a token), not two
        client = _client(url)
        first = _session(client, "Weather in Paris?", (False, False))
        _session(client, "Add 2 and 3, then 4, then 5, and tell me why.", (False, False))
        again = _turn(client, first[1][3], stream=True)  # the first session's last turn, evicted meanwhile
        m = _metrics(url)
    assert m["autotune_prefix_cache_evictions_total"] > 0
    assert m["autotune_prefix_cache_bytes"] <= m["autotune_prefix_cache_capacity_bytes"] == int(0.2 * 2**20)
    assert again[1].prompt_tokens_details.cached_tokens < first[1][2]  # less than before the eviction
    assert again[0] == first[1][0] == reference(first[1][3])


def test_no_cache_and_a_stop_string(pair):
    with live(pair, prefix_cache_mb=0) as url:
        turns = _session(_client(url), USERS[0], (False, True))
        m = _metrics(url)
    assert [t[2] for t in turns] == [0, 0] and m["autotune_prefix_cache_capacity_bytes"] == 0
    ids = pair.encode("def add(a, b):")
    stop = pair.tokenizer.decode(engine.generate(pair, ids, EngineConfig(verify="ar"), MAX).tokens)[4:6]
    with live(pair) as url:
        client = _client(url)
        cut = [list(client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=MAX, temperature=0,
                                              stop=[stop], stream=True, stream_options={"include_usage": True}))
               for _ in range(2)]
    usages = [next(c.usage for c in reversed(s) if c.usage) for s in cut]
    assert all(c.choices[0].finish_reason == "stop" for c in (s[-2] for s in cut))
    # the stop string ended the first generation (its stats never came back): its prompt was kept all
    # the same, and the usage of both says what was reused
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    assert usages[1].prompt_tokens_details.cached_tokens == usages[1].prompt_tokens - 1 == len(ids) - 1


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf")])
def test_a_bad_budget_is_refused(pair, value):
    with pytest.raises(engine.EngineInputError, match="prefix_cache_mb must be a finite number >= 0"):
        srv.create_app(pair, CFG, "tiny", prefix_cache_mb=value)
