"""8-bit AdamW moments for a checkpoint that must travel (``--state-dtype int8``): about a third of
the bytes of a float32 state, with a resume that is close rather than exact.

Each moment tensor is flattened and cut into blocks of ``BLOCK`` values, each block with its own
scale, so one large value costs precision only in its own block.

- ``exp_avg_sq`` (non-negative, often spanning 10 or more decades within a tensor): codes of its
  logarithm. Linear codes (of the value or of its square root) round every value below the block's
  largest / 255 (or / 255^2) to 0, and AdamW divides by ``sqrt(exp_avg_sq) + eps``: an entry
  rounded to 0 turns its step ``lr * exp_avg / sqrt(v)`` into ``lr * exp_avg / 1e-8``, a weight
  blown up on the first step after a resume. In log space every positive value keeps a bounded
  *relative* error: codes 1..255 span ``[min log v, max log v]`` of the block's positive values,
  so ``|log v' - log v| <= (max - min) / 508``; a block spanning 12 decades keeps v within 5.6%
  (``sqrt(v)``, the divisor, within 2.8%). Code 0 is an exact 0 (a coordinate never given a
  gradient, whose ``exp_avg`` is 0 too).
- ``exp_avg`` (signed): absmax int8 codes, ``round(127 * r / max|r|)`` per block, of
  ``r = exp_avg / sqrt(v')`` (v' the decoded ``exp_avg_sq``) rather than of ``exp_avg`` itself.
  ``r`` is the step AdamW takes, before its bias corrections and ``lr``, and it is bounded:
  by Cauchy-Schwarz ``|exp_avg| <= (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2)) * sqrt(exp_avg_sq)``,
  1.17 for betas (0.9, 0.95). So every coordinate's step keeps an error of at most its block's
  largest step / 254, whatever its own size; absmax codes of ``exp_avg`` itself would give a
  coordinate whose gradients are 1000x smaller than its block's largest a step error of
  several times its own step.

The error is paid once per resume, not per step, and fades: the moments are running averages
(betas 0.9 / 0.95), so a rounded value's weight falls below 1% within ~45 (``exp_avg``) and ~90
(``exp_avg_sq``) steps.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

BLOCK = 256  # values per scale: 4 (absmax) or 8 (log range) bytes of scale per 256 bytes of codes
CODEC = "codec"  # the key that marks an encoded tensor in the payload


def _blocks(x: Tensor) -> Tensor:
    flat = x.detach().flatten().float()
    pad = (-flat.numel()) % BLOCK
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK)  # [n_blocks, BLOCK]


def encode_absmax8(x: Tensor) -> dict[str, Any]:
    """Blockwise absmax int8 codes of a signed tensor."""
    b = _blocks(x)
    scale = b.abs().amax(dim=1) / 127  # [n_blocks]
    q = torch.round(b / torch.where(scale > 0, scale, 1.0)[:, None]).clamp_(-127, 127).to(torch.int8)
    return {CODEC: "absmax8", "q": q, "scale": scale, "shape": list(x.shape)}


def encode_log8(x: Tensor) -> dict[str, Any]:
    """Blockwise 8-bit codes of log(x) for a non-negative tensor (0 kept exactly, as code 0)."""
    b = _blocks(x)
    if bool((b < 0).any()):
        raise ValueError("encode_log8 takes a non-negative tensor (AdamW's exp_avg_sq)")
    pos = b > 0
    # subnormal values are read as the smallest normal: far below AdamW's eps either way
    logs = torch.log(b.clamp_min(torch.finfo(torch.float32).tiny))
    lo = torch.where(pos, logs, math.inf).amin(dim=1)
    hi = torch.where(pos, logs, -math.inf).amax(dim=1)
    empty = ~pos.any(dim=1)
    lo, hi = torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi)
    step = (hi - lo) / 254  # codes 1..255 over [lo, hi]
    code = 1 + torch.round((logs - lo[:, None]) / torch.where(step > 0, step, 1.0)[:, None]).clamp_(0, 254)
    q = torch.where(pos, code, 0).to(torch.uint8)
    return {CODEC: "log8", "q": q, "lo": lo, "hi": hi, "shape": list(x.shape)}


def decode(enc: dict[str, Any]) -> Tensor:
    """The float32 tensor an ``encode_*`` dict stands for."""
    shape = enc["shape"]
    n = math.prod(shape)
    if enc[CODEC] == "absmax8":
        flat = enc["q"].float() * enc["scale"][:, None]
    elif enc[CODEC] == "log8":
        lo, hi, q = enc["lo"][:, None], enc["hi"][:, None], enc["q"]
        flat = torch.where(q > 0, torch.exp(lo + (q.float() - 1) * (hi - lo) / 254), 0.0)
    else:
        raise ValueError(f"unknown codec {enc[CODEC]!r}: a checkpoint written by a newer version?")
    return flat.flatten()[:n].view(shape)


def encode_moments(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """An AdamW ``state_dict()`` with each parameter's ``exp_avg_sq`` in log8 codes and its
    ``exp_avg`` in absmax8 codes of ``exp_avg / sqrt(decoded exp_avg_sq)``; the rest as it is."""
    state = {}
    for key, st in optimizer_state["state"].items():
        st = dict(st)
        if "exp_avg_sq" in st and st["exp_avg_sq"].ndim > 0:
            enc_v = encode_log8(st["exp_avg_sq"])
            root = decode(enc_v).to(st["exp_avg"].device).sqrt()
            ratio = torch.where(root > 0, st["exp_avg"].float() / torch.where(root > 0, root, 1.0), 0.0)
            st["exp_avg"] = {**encode_absmax8(ratio), CODEC: "ratio8"}
            st["exp_avg_sq"] = enc_v
        state[key] = st
    return {**optimizer_state, "state": state}


def decode_moments(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """``encode_moments`` undone (float32 moments); a state without codes is returned as it is."""
    state = {}
    for key, st in optimizer_state["state"].items():
        st = dict(st)
        enc_m = st.get("exp_avg")
        if isinstance(enc_m, dict):
            if enc_m[CODEC] != "ratio8" or not isinstance(st.get("exp_avg_sq"), dict):
                raise ValueError(f"optimizer state {key}: exp_avg coded {enc_m[CODEC]!r} without log8 exp_avg_sq")
            st["exp_avg_sq"] = decode(st["exp_avg_sq"])
            st["exp_avg"] = decode({**enc_m, CODEC: "absmax8"}) * st["exp_avg_sq"].sqrt()
        state[key] = st
    return {**optimizer_state, "state": state}
