"""Grammar-constrained decoding: both placements equal grammar-constrained AR, and tool calls validate."""

import dataclasses
import json

import pytest
import torch

import engine
from engine import EngineConfig, EngineInputError
from engine.data.assets import is_cached
from engine.data.prompts import Prompt
from engine.decoding.grammar import call_schema, example_call, parse_tool_calls, tool_call_ebnf
from tests.engine.engine_pairs import pair_for

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")


def _tool(name: str, props: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name} tool",
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": required}}}


# Closed vocabularies (enums, booleans) keep a random tiny model's calls short enough to complete.
# Short names: a whole call is ~85 bytes, i.e. ~85 tokens of the tiny presets' byte vocabulary.
TOOLS = (
    _tool("weather", {"unit": {"type": "string", "enum": ["c", "f"]}, "warn": {"type": "boolean"}}, ["unit"]),
    _tool("light", {"room": {"type": "string", "enum": ["hall", "den"]}, "on": {"type": "boolean"}}, ["room"]),
)
CHAT = Prompt(messages=({"role": "user", "content": "Weather in Paris, and turn on the hall light."},), tools=TOOLS)
TINY_NEW = 96

_ar: dict = {}



def constrained_ar(pair, ids, grammar, temperature, max_new) -> list[int]:
    key = (pair.target_name, tuple(ids), id(grammar), temperature, max_new)
    if key not in _ar:
        cfg = EngineConfig(verify="ar", grammar="commit", temperature=temperature, seed=3)
        _ar[key] = engine.generate(pair, ids, cfg, max_new, ignore_eos=True, grammar=grammar).tokens
    return _ar[key]


def assert_calls_valid(text: str, tools=TOOLS) -> int:
    """Every complete <tool_call> block parses, names a tool, and its arguments follow that tool's schema."""
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    calls = parse_tool_calls(text)
    for call in calls:
        assert set(call) == {"name", "arguments"}, call
        assert call["name"] in by_name, call
        jsonschema.validate(call["arguments"], by_name[call["name"]])
    return len(calls)


def test_config_validates_grammar():
    assert EngineConfig().grammar == "off"
    with pytest.raises(EngineInputError, match=r"grammar must be one of \['off', 'walk', 'commit'\]"):
        EngineConfig(grammar="on")


def test_tool_grammar_pieces():
    schema = call_schema(TOOLS)
    for t in TOOLS:
        jsonschema.validate(example_call(t), schema)
    assert tool_call_ebnf(TOOLS).startswith('root ::= ("<tool_call>\\n" tool_call_json "\\n</tool_call>"')
    text = "".join(f"<tool_call>\n{json.dumps(example_call(t))}\n</tool_call>" for t in TOOLS) + "<tool_call>\n{"
    assert [c["name"] for c in parse_tool_calls(text)] == ["weather", "light"]  # the open block is left
    with pytest.raises(EngineInputError, match="at least one tool"):
        call_schema([])


def test_grammar_refuses_what_it_must():
    pair = pair_for("tiny-dense", "none")
    g = pair.grammar_for(TOOLS)
    assert pair.grammar_for(list(TOOLS)) is g  # compiled once per tool set
    assert pair.grammar_for(None) is None
    st = g.state()
    ok = "".join(f"<tool_call>\n{json.dumps(example_call(t))}\n</tool_call>" for t in TOOLS)
    assert all(st.advance(t) for t in pair.tokenizer.encode(ok))
    assert not st.done and st.advance(pair.stop_ids[0]) and st.done
    st = g.state()
    assert all(st.advance(t) for t in pair.tokenizer.encode('<tool_call>\n{"name": "'))
    assert not st.advance(pair.tokenizer.encode("x")[0])  # not a tool name
    assert not g.state().advance(pair.stop_ids[0])  # at least one call


def test_off_ignores_the_grammar_and_ar_output_is_a_valid_call():
    pair = pair_for("tiny-dense", "none")
    ids, g = pair.encode(CHAT), pair.grammar_for(TOOLS)
    free = engine.generate(pair, ids, EngineConfig(verify="ar"), 24, ignore_eos=True)
    off = engine.generate(pair, ids, EngineConfig(verify="ar", grammar="off"), 24, ignore_eos=True, grammar=g)
    assert off.tokens == free.tokens
    walk = engine.generate(pair, ids, EngineConfig(verify="ar", grammar="walk"), TINY_NEW, ignore_eos=True, grammar=g)
    assert walk.tokens == constrained_ar(pair, ids, g, 0.0, TINY_NEW)  # AR: both placements mask every step
    text = pair.tokenizer.decode(walk.tokens)
    assert text.startswith("<tool_call>\n{") and assert_calls_valid(text) >= 1
    assert walk.stats.grammar_ms > 0


def _tiny_cases():
    paths = [("chain", "generic"), ("ddtree", "runtime"), ("ddtree", "generic"), ("chain", "runtime")]
    i = 0
    for target in ("tiny-dense", "tiny-hybrid"):
        for draft in ("oracle:0.3", "random"):
            for placement in ("walk", "commit"):
                verify, path = paths[i % len(paths)]
                if path == "runtime" and (draft != "random" or placement == "walk"):
                    path = "auto"  # the runtime refuses a host-side draft and the walk placement
                temperature = 0.0 if i % 3 else 0.8
                i += 1
                yield pytest.param(target, draft, placement, verify, path, temperature,
                                   id=f"{target}-{draft}-{placement}-{verify}-{path}-t{temperature}")


@pytest.mark.parametrize("target,draft,placement,verify,path,temperature", list(_tiny_cases()))
def test_tiny_constrained_speculative_equals_constrained_ar(target, draft, placement, verify, path, temperature):
    pair = pair_for(target, draft)
    ids, g = pair.encode(CHAT), pair.grammar_for(TOOLS)
    cfg = EngineConfig(verify=verify, draft_path=path, grammar=placement, temperature=temperature, seed=3,
                       budget=12, top_k=3, rollback="replay" if path == "generic" else "fast")
    gen = engine.generate(pair, ids, cfg, TINY_NEW, ignore_eos=True, grammar=g)
    assert gen.tokens == constrained_ar(pair, ids, g, temperature, TINY_NEW)
    assert sum(gen.stats.accept_lengths) >= len(gen.tokens) - 1
    assert_calls_valid(pair.tokenizer.decode(gen.tokens))
    assert gen.stats.grammar_ms > 0


def test_commit_placement_cuts_steps_on_refused_tokens():
    # oracle:0 proposes the unconstrained continuation, which the grammar refuses at once: every
    # step is cut and re-picked from masked logits, and the output is still constrained AR's.
    pair = pair_for("tiny-dense", "oracle:0")
    ids, g = pair.encode(CHAT), pair.grammar_for(TOOLS)
    gen = engine.generate(pair, ids, EngineConfig(verify="ddtree", grammar="commit"), 48, ignore_eos=True, grammar=g)
    assert gen.tokens == constrained_ar(pair, ids, g, 0.0, 48)
    assert gen.stats.correction_tokens > 0


def test_walk_margins_are_those_of_the_masked_rows_as_constrained_ar(monkeypatch):
    """Under `walk` every tree row is masked before the walk picks from it: each token's margin is
    its masked row's, as in constrained AR (infinite where the grammar allows a single token). The
    draft proposes constrained AR's own tokens, so steps accept several (the oracle proposes the
    unconstrained continuation, which the grammar refuses)."""
    pair = pair_for("tiny-dense", "oracle:0.3")
    ids, g = pair.encode(CHAT), pair.grammar_for(TOOLS)
    ar = engine.generate(pair, ids, EngineConfig(verify="ar", grammar="walk"), 64, ignore_eos=True, grammar=g,
                         record_margins=True)
    truth, vocab = torch.tensor(ar.tokens), pair.target.cfg.vocab_size

    def constrained_oracle(seq, start, block_size, window, features):
        tok = truth[(start - len(ids) + torch.arange(1, block_size)).clamp(max=len(truth) - 1)]
        return torch.zeros(block_size - 1, vocab).scatter_(1, tok[:, None], 10.0)

    monkeypatch.setattr(pair.drafter, "propose", constrained_oracle)
    walk = engine.generate(pair, ids, EngineConfig(verify="ddtree", draft_path="generic", grammar="walk", budget=12,
                                                   top_k=3), 64, ignore_eos=True, grammar=g, record_margins=True)
    assert walk.tokens == ar.tokens and max(walk.stats.accept_lengths) > 4
    assert walk.margins == pytest.approx(ar.margins, abs=1e-4)
    assert walk.top_logits == pytest.approx(ar.top_logits, abs=1e-4)
    assert any(m == float("inf") for m in ar.margins) and not all(m == float("inf") for m in ar.margins)


def test_bench_serves_each_prompt_with_its_tools():
    pair = pair_for("tiny-dense", "oracle:0.3")
    plain = Prompt(text="no tools here")
    prompts = [pair.encode(CHAT), pair.encode(plain)]
    assert prompts[0].tools == TOOLS and not hasattr(prompts[1], "tools")
    ar = engine.bench(pair, EngineConfig(verify="ar", grammar="commit"), prompts, 40, ignore_eos=True)
    assert ar.constrained == 1 and ar.grammar_ms > 0
    assert ar.outputs[1] == engine.generate(pair, prompts[1], EngineConfig(verify="ar"), 40, ignore_eos=True).tokens
    for placement in ("walk", "commit"):
        res = engine.bench(pair, EngineConfig(grammar=placement), prompts, 40, reference=ar.outputs, ignore_eos=True)
        assert res.exact_match == 1.0 and res.summary()["grammar_ms_per_step"] > 0
    off = engine.bench(pair, EngineConfig(grammar="off"), prompts, 40, ignore_eos=True)
    assert off.constrained == 0 and off.grammar_ms == 0
    with pytest.raises(EngineInputError, match="grammars has 1 entries for 2 prompts"):
        engine.bench(pair, EngineConfig(grammar="walk"), prompts, 8, grammars=[None])


def test_grammar_from_another_vocabulary_is_refused():
    tiny = pair_for("tiny-dense", "none")
    other = engine.load("tiny-dense", "none", device="cpu", dtype="float32")
    other.target.cfg = dataclasses.replace(other.target.cfg, vocab_size=999)  # as if another target
    with pytest.raises(EngineInputError, match="compiled for a vocabulary of"):
        engine.generate(other, tiny.encode(CHAT), EngineConfig(verify="ar", grammar="walk"), 4,
                        grammar=tiny.grammar_for(TOOLS))


# --- the SmolLM2 pair (real vocabulary, real BFCL tools) ------------------------------------------

real = pytest.mark.skipif(not is_cached("smollm2"),
                          reason="SmolLM2 asset not cached (python -m engine assets fetch smollm2)")
SMOL_NEW = 48


@real
@pytest.mark.parametrize("placement,verify,path,temperature", [
    ("walk", "ddtree", "auto", 0.0), ("commit", "ddtree", "generic", 0.0),
    ("walk", "chain", "generic", 0.7), ("commit", "ddtree", "runtime", 0.7),
])
def test_smollm2_constrained_speculative_equals_constrained_ar(placement, verify, path, temperature):
    pair = pair_for("smollm2-135m-instruct", "smollm2-135m-dflash")
    prompt = Prompt(messages=({"role": "user", "content": "What's the weather in Paris? Use celsius, alert me."},),
                    tools=TOOLS)
    ids, g = pair.encode(prompt), pair.grammar_for(TOOLS)
    want = constrained_ar(pair, ids, g, temperature, SMOL_NEW)
    cfg = EngineConfig(verify=verify, draft_path=path, grammar=placement, temperature=temperature, seed=3,
                       budget=16, top_k=4)
    gen = engine.generate(pair, ids, cfg, SMOL_NEW, ignore_eos=True, grammar=g)
    assert gen.tokens == want
    text = pair.tokenizer.decode(gen.tokens)
    assert text.startswith("<tool_call>\n{")
    assert assert_calls_valid(text) >= 1  # SmolLM2 finishes a closed-vocabulary call well within 48 tokens
