"""8-bit AdamW moments (--state-dtype int8): the error bounds the docstring claims, exact zeros,
and an AdamW step from decoded moments that stays close to the exact one where linear codes of
exp_avg_sq would blow weights up."""

import copy
import math

import pytest
import torch

from engine.training.quantized_state import (
    BLOCK,
    decode,
    decode_moments,
    encode_absmax8,
    encode_log8,
    encode_moments,
)


def _spread(n: int, lo: float, hi: float, seed: int = 0) -> torch.Tensor:
    """n values spread log-uniformly over [10^lo, 10^hi], shuffled across blocks."""
    g = torch.Generator().manual_seed(seed)
    return torch.logspace(lo, hi, n)[torch.randperm(n, generator=g)]


def test_absmax8_keeps_each_value_within_its_blocks_max_over_254():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 1000, generator=g) * _spread(3000, -7, -1).view(3, 1000)  # not a multiple of BLOCK
    enc = encode_absmax8(x)
    assert enc["q"].dtype == torch.int8 and enc["q"].numel() == math.ceil(3000 / BLOCK) * BLOCK
    back = decode(enc)
    assert back.shape == x.shape and back.dtype == torch.float32
    flat = torch.nn.functional.pad(x.flatten(), (0, (-3000) % BLOCK)).view(-1, BLOCK)
    bound = flat.abs().amax(1, keepdim=True) / 254 * (1 + 1e-5)
    err = torch.nn.functional.pad((back - x).flatten(), (0, (-3000) % BLOCK)).view(-1, BLOCK).abs()
    assert bool((err <= bound).all())
    assert torch.equal(decode(encode_absmax8(torch.zeros(5))), torch.zeros(5))  # a zero block: no 0/0


@pytest.mark.parametrize("decades", [4, 12, 16])
def test_log8_keeps_a_bounded_relative_error_and_exact_zeros(decades):
    v = _spread(5000, -4 - decades, -4)
    v[::37] = 0.0  # coordinates never given a gradient
    enc = encode_log8(v)
    assert enc["q"].dtype == torch.uint8
    back = decode(enc)
    assert torch.equal(back == 0, v == 0)  # zeros stay zero, nothing positive becomes zero
    rel = (back[v > 0] / v[v > 0] - 1).abs().max().item()
    # the bound: |log v' - log v| <= span / 508, span <= decades * ln(10) within any block
    assert rel <= math.expm1(decades * math.log(10) / 508) + 1e-5
    assert rel > 0  # a lossy code (the test would see a codec that stored nothing)
    with pytest.raises(ValueError, match="non-negative"):
        encode_log8(torch.tensor([1.0, -1e-9]))


def test_an_adamw_step_from_decoded_moments_stays_close_where_linear_codes_go_wrong():
    """One AdamW step after a resume, with gradients over six decades within each block: from the
    decoded moments every weight moves within 3% of lr of the exact step (the divisor's 2.8%). Linear absmax codes of
    exp_avg_sq (small entries rounded to 0: AdamW then divides by eps) blow some weights up by
    orders of magnitude; absmax codes of exp_avg itself (not of the step it makes) miss small
    coordinates' steps by more than lr / 4."""
    torch.manual_seed(0)
    lr, n = 1e-3, 4096
    w = torch.nn.Parameter(torch.zeros(n))
    opt = torch.optim.AdamW([w], lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    scales = _spread(n, -6, 0, seed=2)
    for _ in range(20):
        w.grad = torch.randn(n) * scales
        opt.step()
    grad = torch.randn(n) * scales

    def step_from(state: dict) -> torch.Tensor:
        p = torch.nn.Parameter(w.detach().clone())
        o = torch.optim.AdamW([p], lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        o.load_state_dict(copy.deepcopy(state))  # AdamW would share (and step) the tensors given
        p.grad = grad.clone()
        o.step()
        return p.detach() - w.detach()

    exact = step_from(opt.state_dict())
    sd = encode_moments(opt.state_dict())
    st = sd["state"][0]
    assert st["exp_avg"]["codec"] == "ratio8" and st["exp_avg_sq"]["codec"] == "log8"
    assert st["exp_avg"]["q"].dtype == torch.int8 and st["exp_avg_sq"]["q"].dtype == torch.uint8
    assert torch.equal(st["step"], opt.state_dict()["state"][0]["step"])  # the counter as it is
    moments = opt.state_dict()["state"][0]
    linear_v = decode_moments(sd)
    linear_v["state"][0]["exp_avg_sq"] = decode(encode_absmax8(moments["exp_avg_sq"]))
    linear_m = decode_moments(sd)
    linear_m["state"][0]["exp_avg"] = decode(encode_absmax8(moments["exp_avg"]))
    assert (step_from(decode_moments(sd)) - exact).abs().max() <= 0.03 * lr  # 2.8%: sqrt(v) over 12 decades
    assert (step_from(linear_v) - exact).abs().max() > 100 * lr
    assert (step_from(linear_m) - exact).abs().max() > 0.25 * lr
