"""Loaded pairs shared by the engine tests: loading once per process keeps the suite fast."""

from functools import cache

import torch

import engine
from engine.decoding.sampling import top_margins


@cache
def pair_for(target: str, draft: str) -> engine.Pair:
    return engine.load(target, draft, device="cpu", dtype="float32")


def direct_margins(pair: engine.Pair, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), 2]: (top logit, top1 - top2) of the rows that predict ``tokens`` after ``prompt``,
    from one plain forward of the whole sequence (no decode loop, no grammar), in float32."""
    seq = torch.tensor(prompt + tokens[:-1])
    with torch.inference_mode():
        logits, _ = pair.target(seq, pair.target.new_cache(len(seq) + 1), 0)
    return top_margins(logits[len(prompt) - 1 :])


def assert_margins_equal(gen: engine.Generation, want: torch.Tensor, atol: float = 1e-4) -> None:
    """``gen``'s recorded (top logit, margin) per token against ``want`` [n, 2] (float32 rounding
    of other shapes apart: a verify's rows, a step's one row, the prefill's last)."""
    got = torch.tensor([gen.top_logits, gen.margins]).T
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
