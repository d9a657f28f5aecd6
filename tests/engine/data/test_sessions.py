"""Multi-turn sessions (engine.data.sessions): the script's turns, what each turn sends, and the
sessions built from BFCL multi-turn entries and ShareGPT conversations (small copies of the assets)."""

import json

import pytest

from engine import EngineInputError
from engine.data.prompts import Prompt
from engine.data.sessions import agent_sessions, chat_sessions, check_session, request, turns

SCRIPT = Prompt(messages=(
    {"role": "system", "content": "Be terse."}, {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "scripted a1", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {}}}]},
    {"role": "tool", "content": "42", "tool_call_id": "c1"}, {"role": "assistant", "content": "scripted a2"},
    {"role": "user", "content": "q3"}))


def test_each_turn_sends_the_script_with_the_model_replies_in_place():
    assert turns(SCRIPT) == 3
    assert request(SCRIPT, []) == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "q1"}]
    second = request(SCRIPT, ["mine 1"])
    assert second[-2:] == [{"role": "assistant", "content": "mine 1"},  # the scripted tool calls are not the model's
                           {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    third = request(SCRIPT, ["mine 1", "mine 2"])
    assert [m["content"] for m in third] == ["Be terse.", "q1", "mine 1", "42", "mine 2", "q3"]
    with pytest.raises(ValueError, match="3 turns; 3 replies"):
        request(SCRIPT, ["a", "b", "c"])


def test_a_session_must_end_with_a_request():
    check_session(SCRIPT, "x.jsonl:1")
    with pytest.raises(EngineInputError, match="x.jsonl:2: a session's messages must end"):
        check_session(Prompt(messages=SCRIPT.messages[:3]), "x.jsonl:2")
    with pytest.raises(EngineInputError, match="has no turns"):
        check_session(Prompt(text="hello"), "x.jsonl:3")


def _lines(recs):
    return "".join(json.dumps(r) + "\n" for r in recs)


def test_agent_sessions_from_bfcl_multi_turn(tmp_path):
    data = tmp_path / "data"
    (data / "multi_turn_func_doc").mkdir(parents=True)
    (data / "possible_answer").mkdir()
    fn = {"name": "add", "description": "Add", "parameters": {"type": "dict", "properties": {
        "a": {"type": "float"}, "b": {"type": "float"}}, "required": ["a", "b"]}}
    (data / "multi_turn_func_doc" / "math_api.json").write_text(_lines([fn, {**fn, "name": "divide"}]))
    questions = [[{"role": "user", "content": "Add 1 and 2"}], [], [{"role": "user", "content": "Now 3"}],
                 [{"role": "user", "content": "And 4"}]]
    (data / "BFCL_v4_multi_turn_base.json").write_text(_lines([
        {"id": "multi_turn_base_0", "involved_classes": ["MathAPI"], "excluded_function": ["divide"],
         "question": questions}]))
    (data / "possible_answer" / "BFCL_v4_multi_turn_base.json").write_text(_lines([
        {"id": "multi_turn_base_0", "ground_truth": [["add(a=1, b=2)"], [], ["add(a=3, b=3)"], []]}]))
    (session,) = agent_sessions(tmp_path)
    assert turns(session) == 3  # the empty turn says nothing: no model turn for it
    assert [t["function"]["name"] for t in session.tools] == ["add"]
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant", "user"]
    assert session.messages[1]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 1, "b": 2}}


def test_chat_sessions_follow_the_conversation_until_it_breaks(tmp_path):
    def conv(cid, *turns_):
        return {"id": cid, "conversations": [{"from": w, "value": v} for w, v in turns_]}

    (tmp_path / "sharegpt.jsonl").write_text(_lines([
        conv("a_0", ("system", "S"), ("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("gpt", "a2")),
        conv("a_1", ("human", "later part"), ("gpt", "x")),  # a continuation: not a start
        conv("b_0", ("human", "q1"), ("gpt", "a1"), ("gpt", "again"), ("human", "q2")),  # alternation breaks
        conv("c_0", ("gpt", "hi")),
    ]))
    a, b = chat_sessions(tmp_path)
    assert [m["content"] for m in a.messages] == ["S", "q1", "a1", "q2"] and turns(a) == 2  # ends on a request
    assert [m["content"] for m in b.messages] == ["q1"] and turns(b) == 1
