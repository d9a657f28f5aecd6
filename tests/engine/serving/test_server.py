"""Serving pieces that need no HTTP: the decode loop's token hook and the streaming detokenizer.

(The real server, its HTTP API and the `autotune serve` command: tests/autotune/test_serve.py.)
"""

import pytest

import engine
from engine import EngineConfig
from engine.data.tokenizer import ByteTokenizer
from engine.serving.text import TextStream

CONFIGS = [
    EngineConfig(verify="ar"),
    EngineConfig(verify="chain", block_size=6, draft_path="generic"),
    EngineConfig(verify="ddtree", budget=8, top_k=2, draft_path="auto"),
    EngineConfig(verify="ddtree", budget=5, top_k=3, draft_path="generic", temperature=0.8, seed=3),
]


@pytest.fixture(scope="module")
def pair():
    return engine.load("tiny-dense", "oracle:0.3", device="cpu", dtype="float32")


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.verify}-{c.draft_path}-t{c.temperature}")
@pytest.mark.parametrize("max_new", [1, 7, 40])
def test_on_tokens_reports_every_committed_token_and_changes_nothing(pair, cfg, max_new):
    ids = pair.encode("def add(a, b):")
    plain = engine.generate(pair, ids, cfg, max_new)
    steps: list[list[int]] = []
    hooked = engine.generate(pair, ids, cfg, max_new, on_tokens=lambda t: steps.append(list(t)))
    assert hooked.tokens == plain.tokens  # the hook changes nothing
    assert [t for s in steps for t in s] == hooked.tokens  # in order, cut at max_new and at a stop token
    assert all(steps)
    if cfg.verify == "ddtree" and max_new > 1:
        assert len(steps) == hooked.stats.steps + 1  # the prefill's token, then one call per step
        assert any(len(s) > 1 for s in steps)  # speculative steps commit several tokens at once


def test_on_tokens_exception_ends_the_generation(pair):
    class Enough(Exception):
        pass

    def stop_after_three(seen=[]):  # noqa: B006 - a counter kept across calls on purpose
        def hook(t):
            seen.extend(t)
            if len(seen) >= 3:
                raise Enough
        return hook

    with pytest.raises(Enough):
        engine.generate(pair, pair.encode("Hello"), CONFIGS[2], 40, on_tokens=stop_after_three())
    # the pair is still usable and exact afterwards
    ids = pair.encode("Hello")
    assert engine.generate(pair, ids, CONFIGS[2], 20).tokens == engine.generate(pair, ids, CONFIGS[0], 20).tokens


def _stream(tok, text_ids, steps, stops=()):
    s = TextStream(tok.decode, tok.stop_ids, stops)
    deltas, i = [], 0
    for n in steps:
        deltas.append(s.push(text_ids[i:i + n]))
        i += n
        if s.stopped_by:
            break
    deltas.append(s.finish())
    return s, deltas


@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_text_stream_never_splits_a_character(step):
    tok = ByteTokenizer()
    text = "héllo € 😀 naïve — 漢字 done"
    ids = tok.encode(text)
    s, deltas = _stream(tok, ids, [step] * len(ids))
    assert "".join(deltas) == text == s.text
    assert not any("\ufffd" in d for d in deltas)  # no half character ever went out


def test_text_stream_keeps_a_real_invalid_byte_at_the_end():
    tok = ByteTokenizer()
    ids = tok.encode("ok") + [0xE2]  # a lone lead byte: invalid once generation is over
    s, deltas = _stream(tok, ids, [1] * len(ids))
    assert deltas[:-1] == ["o", "k", ""] and deltas[-1] == "\ufffd" and s.text == "ok\ufffd"


def test_text_stream_stop_string_across_tokens_and_held_back_prefix():
    tok = ByteTokenizer()
    ids = tok.encode("abc STOP def")
    s, deltas = _stream(tok, ids, [1] * len(ids), stops=["STOP", "xyz"])
    assert s.text == "abc " and s.stopped_by == "string" and "".join(deltas) == "abc "
    assert s.n_tokens == len(tok.encode("abc STOP"))  # consumed up to the step that completed the stop
    # a prefix of a stop string that turns out not to be one is released, in order
    s, deltas = _stream(tok, tok.encode("abc STAB"), [1] * 8, stops=["STOP"])
    assert "".join(deltas) == "abc STAB" and s.stopped_by is None
    assert deltas[4:7] == ["", "", "STA"]  # "S", "ST" held back while they could start "STOP"


def test_text_stream_stop_token_is_not_text():
    tok = ByteTokenizer()
    ids = tok.encode("hi") + [tok.special_ids["<|im_end|>"]]
    s, deltas = _stream(tok, ids, [len(ids)])
    assert s.text == "hi" and s.stopped_by == "token" and s.n_tokens == 3
