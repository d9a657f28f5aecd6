"""The training tests' target (tiny-dense, float32 on the CPU) and its self-distilled sequences."""

from __future__ import annotations

import pytest

import engine
from engine.training.sequences import generate_responses


@pytest.fixture(scope="module")
def pair():
    return engine.load("tiny-dense", "none", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def answered(pair):
    """``answered(n)``: ``n`` prompts ("Item i: say i then i + 1.") each with the target's greedy answer (16 tokens
    at most): the sequences and their prompt lengths."""
    return lambda n: _answered(pair, n)


def _answered(pair, n: int) -> tuple[list[list[int]], list[int]]:
    prompts = [pair.encode(f"Item {i}: say {i} then {i + 1}.") for i in range(n)]
    answers = generate_responses(pair.target, prompts, 16, batch_size=n, stop_ids=pair.stop_ids)
    return [p + a for p, a in zip(prompts, answers, strict=True)], [len(p) for p in prompts]


@pytest.fixture(scope="module")
def sequences(answered):
    return answered(24)
