"""Token selection shared by AR and speculative decoding.

Sampling uses Gumbel-max with noise keyed by (seed, absolute position, vocabulary index). The
draw for a position then depends only on the logits there, so speculative decoding at
temperature > 0 commits exactly the tokens AR sampling with the same seed would: every committed
token is a target sample, and equality is testable token for token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.models.topk import argmax_rows

_MASK31 = 0x7FFFFFFF
_MIX = (0x2C1B3C6D, 0x297A2D39, 0x5BD1E995)


def _hash31(x: Tensor) -> Tensor:
    """A small integer mixer kept inside 31 bits so int64 products never overflow."""
    for c in _MIX:
        x = (x ^ (x >> 15)) & _MASK31
        x = (x * c) & _MASK31
    return x ^ (x >> 13)


def uniform_noise(seed: int, positions: Tensor, vocab: int) -> Tensor:
    """[T, V] uniforms in (0, 1), a pure function of (seed, position, index)."""
    idx = torch.arange(vocab, device=positions.device, dtype=torch.int64)
    key = _hash31((positions.to(torch.int64)[:, None] * 0x3A8F05C5 + seed * 0x1B873593) & _MASK31)
    x = _hash31((key * 31 + idx[None, :]) & _MASK31)
    return (x.double() + 0.5) / float(_MASK31 + 1)


def select_tokens(logits: Tensor, positions: Tensor, temperature: float, seed: int) -> Tensor:
    """logits [T, V] -> tokens [T]; ``positions[i]`` is the absolute position of the token chosen."""
    if temperature <= 0.0:  # the first index of the maximum, as torch.argmax (two launches on CUDA)
        return argmax_rows(logits)
    u = uniform_noise(seed, positions, logits.shape[-1])
    gumbel = -torch.log(-torch.log(u))
    return torch.argmax(logits.double() / temperature + gumbel, dim=-1)


def top_margins(logits: Tensor) -> Tensor:
    """logits [T, V] -> [T, 2] float32: each row's top logit and its margin over the second (top1 -
    top2), taken from the logits a token was picked from, as computed (divergence forensics:
    ``Generation.margins``). At temperature 0 the margin is how far the pick was from a tie."""
    top = logits.float().topk(2, dim=-1).values
    return torch.stack([top[:, 0], top[:, 0] - top[:, 1]], dim=-1)
