"""Divergence forensics' arithmetic (engine/decoding/stats.py) on constructed numbers: units in the last
place, the tie bound, the verdict, the first divergence."""

import numpy as np
import pytest
import torch

from engine.decoding.stats import TIE_ULPS, Divergence, first_divergence, tie_bound, ulp


def _next_up(x: float, dtype: torch.dtype) -> float:
    """The next representable value above ``x`` > 0 in ``dtype``, from its bits."""
    t = torch.tensor([x], dtype=dtype)
    return float((t.view(torch.int16) + 1).view(dtype)[0])


@pytest.mark.parametrize("m", [1.0, 1.5, 3.0, 10.0, 0.75, 37.2, 1e-3, 2.0**120])
def test_ulp_is_the_gap_to_the_next_value_of_the_dtype(m):
    for dtype in (torch.bfloat16, torch.float16):
        if dtype == torch.float16 and m > 6e4:
            continue
        x = float(torch.tensor(m, dtype=dtype))  # a value of the dtype at that magnitude
        assert ulp(dtype, x) == _next_up(x, dtype) - x, (dtype, m)
    assert ulp("float32", m) == float(np.spacing(np.float32(m)))
    assert ulp("float16", -m) == ulp("float16", m)  # a magnitude: the sign does not matter


def test_ulp_by_formula_and_at_the_edges():
    assert ulp("bfloat16", 1.0) == 2.0**-7 and ulp("bfloat16", 3.0) == 2.0**-6 and ulp("bfloat16", 0.75) == 2.0**-8
    assert ulp("float16", 1024.0) == 1.0 and ulp(torch.float32, 1.0) == 2.0**-23
    # below the smallest normal: the subnormal spacing, constant down to zero
    assert ulp("float16", 0.0) == ulp("float16", 1e-6) == 2.0**-24 == float(np.spacing(np.float16(0)))
    assert ulp("float32", 0.0) == 2.0**-149
    assert np.isnan(ulp("bfloat16", float("inf")))
    with pytest.raises(ValueError, match=r"dtype must be one of .* but got 'int8'"):
        ulp(torch.int8, 1.0)


def test_the_tie_bound_is_four_ulps_at_the_top_logit():
    assert TIE_ULPS == 4
    assert tie_bound("bfloat16", 10.0) == 0.25  # ulp 2**(3 - 7)
    assert tie_bound("bfloat16", -10.0) == 0.25
    assert tie_bound("float16", 10.0) == 4 * 2.0**-7
    assert tie_bound("float32", 10.0) == 4 * 2.0**-20


def test_the_verdict_is_a_tie_only_when_the_smaller_margin_is_within_the_bound():
    # (top logit, margin) per run; bf16 at |top| in [8, 16): bound 0.25
    tie = Divergence.judge(70, (10.0, 0.0), (10.0625, 0.125), "bfloat16")
    assert tie == Divergence(70, 0.0, 0.125, 0.25, "numeric tie", True)
    assert Divergence.judge(3, (10.0, 0.25), (10.0, 1.0), "bfloat16").verdict == "numeric tie"  # on the bound
    assert Divergence.judge(3, (10.0, 0.3), (10.0, 1.0), "bfloat16").verdict == "mismatch"
    mismatch = Divergence.judge(17, (12.0, 1.5), (12.0, 1.375), "bfloat16")
    assert (mismatch.verdict, mismatch.tie_bound) == ("mismatch", 0.25)
    # the bound is taken at the larger top logit of the two rows
    assert Divergence.judge(5, (10.0, 0.4), (20.0, 0.45), "bfloat16").tie_bound == 0.5
    assert Divergence.judge(5, (10.0, 0.4), (20.0, 0.45), "bfloat16").verdict == "numeric tie"
    # the same margins in float32 are far from a tie
    assert Divergence.judge(70, (10.0, 0.0001), (10.0, 0.125), "float32").verdict == "mismatch"
    assert Divergence.judge(70, (10.0, 0.0), (10.0, 0.125), "float32").verdict == "numeric tie"
    # one run has no token there (a length difference): not a tie
    short = Divergence.judge(9, (10.0, 0.0), None, "bfloat16", reproduced=False)
    assert (short.run_margin, short.verdict, short.tie_bound) == (None, "mismatch", 0.25)


def test_a_divergence_reads_in_one_line_and_as_a_dict():
    d = Divergence.judge(70, (10.0, 0.0), (10.0, 0.125), "bfloat16")
    assert d.describe() == "div 70: numeric tie 0/0.125"
    assert Divergence(17, 1.5, None, 0.25, "mismatch", False).describe() == "div 17: mismatch 1.5/- (not reproduced)"
    assert d.to_dict() == {"position": 70, "ar_margin": 0.0, "run_margin": 0.125, "tie_bound": 0.25,
                           "verdict": "numeric tie", "reproduced": True}


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2 and first_divergence([1, 2, 3], [1, 2]) == 2
