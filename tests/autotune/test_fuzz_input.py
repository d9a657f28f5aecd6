"""Randomly mutated experiment, search-space and workload files (issue #23): the validation pass
either accepts a file or refuses it with an ``InputError`` (exit 2 at the CLI) whose message stays
small; never another exception (a traceback at the CLI), whatever the bytes."""

from __future__ import annotations

import random

import pytest
from autotune_helpers import tiny_experiment

from autotune import experiment
from autotune.errors import InputError

# Fragments that stress a YAML or JSON reader: anchors and aliases, flow and block structure,
# tabs, tags, huge and odd numbers, deep nesting, bytes that are not UTF-8, a UTF-16 mark, NULs.
TOKENS = [b"&a ", b"*a", b"<<: *a\n", b"{", b"}", b"[", b"]", b"- ", b": ", b"\t", b"!!python/object:os.system ",
          b"!!binary ", b"1e999", b"-0x1F", b".nan", b"~", b"? ", b"'", b'"', b"\\u0000", b"\xff\xfe", b"\x00",
          b"\xe9", b"\xc3", b"[" * 200, b"{a: " * 80, b"\n", b"#", b"---\n", b"...\n", b"%YAML 1.1\n",
          b'{"prompt": "x", "tools": ', b'"messages": [', b"null", b"true", b"9" * 40]


def _mutate(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        at = rng.randint(0, len(out))
        if op == 0 and out:  # flip a byte
            out[min(at, len(out) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:  # insert a stressing fragment
            out[at:at] = rng.choice(TOKENS)
        elif op == 2:  # truncate
            del out[at:]
        elif op == 3 and out:  # duplicate a line
            lines = bytes(out).split(b"\n")
            i = rng.randrange(len(lines))
            lines.insert(rng.randrange(len(lines) + 1), lines[i])
            out = bytearray(b"\n".join(lines))
        else:  # delete a span
            del out[at : at + rng.randint(1, 20)]
    return bytes(out)


@pytest.mark.parametrize("target", ["tiny.yaml", "space.yaml", "prompts.jsonl"])
def test_mutated_files_are_accepted_or_refused_with_a_small_message(target, tmp_path):
    path = tiny_experiment(tmp_path / "exp")
    victim = tmp_path / "exp" / target
    original = victim.read_bytes()
    rng = random.Random(f"fuzz-{target}")  # fixed: the same files every run
    refused = accepted = 0
    for _ in range(700):
        victim.write_bytes(_mutate(original, rng))
        try:
            experiment.load(path)
            accepted += 1
        except InputError as exc:
            assert len(str(exc)) < 4096, str(exc)[:300]
            refused += 1
    # (both outcomes occur: the mutations reach the reader's refusals and its acceptances)
    assert refused > 100 and accepted > 10, (refused, accepted)
