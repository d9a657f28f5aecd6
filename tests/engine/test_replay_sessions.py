"""Sessions replayed turn by turn (engine.replay_sessions) and measured through one prefix cache
(engine.bench(..., prefix_cache=...)), on the tiny dense target: what a session study measures."""

from __future__ import annotations

import json

import pytest

import engine
from engine.data.prompts import Prompt

SESSIONS = [
    Prompt(messages=({"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi there"},
                     {"role": "assistant", "content": "scripted"}, {"role": "user", "content": "and then?"},
                     {"role": "assistant", "content": "scripted"}, {"role": "user", "content": "more"})),
    Prompt(messages=({"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "scripted"},
                     {"role": "user", "content": "now subtract"})),
]
NEW = 8


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-hybrid"])
def pair(request) -> engine.Pair:
    return engine.load(request.param, "oracle:0.3", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def replay(pair):
    ar = engine.EngineConfig(verify="ar")
    return engine.replay_sessions(pair, ar, SESSIONS, NEW, engine.PrefixCache(64 << 20))


def test_each_turn_sends_the_conversation_with_the_earlier_replies(pair, replay):
    assert replay.session_of == [0, 0, 0, 1, 1] and replay.cut == {}
    assert len(replay.prompts) == len(replay.outputs) == len(replay.replies) == 5
    for i in (1, 2, 4):  # a later turn's request holds the reply before it, not the script's message
        assert replay.replies[i - 1] in pair.tokenizer.decode(replay.prompts[i])
        assert len(replay.prompts[i]) > len(replay.prompts[i - 1])
    assert "scripted" not in pair.tokenizer.decode(replay.prompts[2])


@pytest.mark.parametrize("config", [engine.EngineConfig(verify="ar"),
                                    engine.EngineConfig(verify="ddtree", budget=6, top_k=2),
                                    engine.EngineConfig(verify="ddtree", budget=6, top_k=2, rollback="replay"),
                                    engine.EngineConfig(verify="chain", draft_path="generic")])
def test_measured_through_one_cache_the_turns_equal_the_replay_and_reuse_the_earlier_turns(pair, replay, config):
    res = engine.bench(pair, config, replay.prompts, NEW, reference=replay.outputs,
                       prefix_cache=engine.PrefixCache(64 << 20))
    assert [p.exact for p in res.prompts] == [True] * 5
    # A dense target reuses the longest prefix a turn shares with an earlier turn's prompt and answer: a
    # later turn its whole previous request (and more), a session's first turn what it shares with the
    # other session (the chat template's opening). A hybrid's recurrent state resumes only from a
    # checkpoint (an earlier prompt's end, its last token fed again): never more than is shared, and a
    # later turn at least its previous request's.
    hybrid = pair.target.has_recurrent
    seen: list[list[int]] = []
    for p, prompt, out in zip(res.prompts, replay.prompts, replay.outputs, strict=True):
        shared = min(max((_common(prompt, s) for s in seen), default=0), len(prompt) - 1)
        assert p.cached_tokens <= shared if hybrid else p.cached_tokens == shared
        seen.append([*prompt, *out])
    assert all(res.prompts[i].cached_tokens >= len(replay.prompts[i - 1]) - hybrid for i in (1, 2, 4))
    assert all(0 < p.ttft_s <= p.total_s for p in res.prompts)
    cold = engine.bench(pair, config, replay.prompts, NEW)  # no cache: every turn prefilled whole
    assert cold.outputs == res.outputs and all(p.cached_tokens == 0 for p in cold.prompts)


def test_a_turn_past_the_context_ends_its_session(pair):
    too_long = pair.target.cfg.max_position_embeddings  # any request plus this many new tokens overflows
    got = engine.replay_sessions(pair, engine.EngineConfig(verify="ar"), SESSIONS[1:], too_long)
    assert got.prompts == [] and list(got.cut) == [0]
    assert "turn 1" in got.cut[0] and "exceed the target's context of" in got.cut[0]


def test_a_session_file_is_read_whole_and_refused_by_line(tmp_path):
    good = tmp_path / "s.jsonl"
    good.write_text("".join(json.dumps(p.to_json()) + "\n" for p in SESSIONS))
    w = engine.load_sessions(str(good), tmp_path, n=5)
    assert w.sessions and w.name == "s" and list(w.prompts) == SESSIONS
    assert len(engine.load_sessions("s.jsonl", tmp_path, n=1, seed=3).prompts) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(SESSIONS[0].to_json()) + "\n" + json.dumps({"messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) + "\n")
    with pytest.raises(engine.EngineInputError, match=r"bad.jsonl:2: a session's messages must end"):
        engine.load_sessions(str(bad), tmp_path, n=2)
    with pytest.raises(engine.EngineInputError, match="humaneval' not found"):  # no session set of that name
        engine.load_sessions("humaneval", tmp_path, n=2)


def test_a_session_file_keeps_the_sessions_of_at_least_min_turns_when_it_is_set(tmp_path):
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(p.to_json()) + "\n" for p in SESSIONS))  # 3 and 2 turns
    assert list(engine.load_sessions("s.jsonl", tmp_path, n=5).prompts) == SESSIONS  # unset: every session
    assert list(engine.load_sessions("s.jsonl", tmp_path, n=5, min_turns=3).prompts) == SESSIONS[:1]
    assert engine.load_sessions("s.jsonl", tmp_path, n=5, min_turns=4).prompts == ()
    with pytest.raises(engine.EngineInputError, match="min_turns must be >= 1"):
        engine.load_sessions("s.jsonl", tmp_path, n=5, min_turns=0)


def test_a_session_s_first_request_is_its_script_up_to_the_first_model_turn():
    first = engine.session_request(SESSIONS[0])
    assert first.messages == SESSIONS[0].messages[:2] and first.tools == SESSIONS[0].tools
    second = engine.session_request(SESSIONS[0], ["hello"])
    assert second.messages[2] == {"role": "assistant", "content": "hello"} and len(second.messages) == 4


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_cache_s_commit_is_inside_each_turn_s_time(pair, replay, monkeypatch):
    """A server pays the commit of a turn's prompt and answer before it serves the next request, so a
    commit made slow shows in the turn's total time (what session tok/s divides by), not its TTFT."""
    import time

    delay, commit = 0.05, engine.PrefixCache.commit

    def slow_commit(self, tokens):
        time.sleep(delay)
        commit(self, tokens)

    monkeypatch.setattr(engine.PrefixCache, "commit", slow_commit)
    res = engine.bench(pair, engine.EngineConfig(verify="ar"), replay.prompts, NEW, reference=replay.outputs,
                       prefix_cache=engine.PrefixCache(64 << 20))
    assert [p.exact for p in res.prompts] == [True] * 5 and res.prompts[1].cached_tokens > 0  # (still committed)
    for p in res.prompts:
        assert p.commit_s >= delay and p.total_s >= p.commit_s + p.decode_s
        assert p.total_s == pytest.approx(p.ttft_s + p.decode_s + p.commit_s)
    assert res.total_s == pytest.approx(sum(p.total_s for p in res.prompts)) and res.total_s >= 5 * delay
    cold = engine.bench(pair, engine.EngineConfig(verify="ar"), replay.prompts[:1], NEW)
    assert cold.prompts[0].commit_s == 0.0  # no cache, nothing committed
