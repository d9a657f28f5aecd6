"""The protocol's arithmetic (docs/measurement.md), on hand-made numbers."""

import math

import pytest

from autotune import measure
from autotune.measure import Candidate, Score


def test_score_is_median_minus_scaled_mad():
    s = measure.score([10.0, 12.0, 11.0, 30.0, 11.5], max_rel_mad=0.10)
    assert s.median == 11.5
    assert s.mad == pytest.approx(0.5)  # |x - 11.5| = 1.5, 0.5, 0.5, 18.5, 0 -> median 0.5
    assert s.spread == pytest.approx(1.4826 * 0.5)
    assert s.value == pytest.approx(11.5 - 1.4826 * 0.5)
    assert not s.noisy  # one outlier does not move a robust estimate


def test_noisy_flag_uses_relative_mad():
    s = measure.score([10.0, 20.0, 30.0], max_rel_mad=0.10)
    assert s.rel_mad == pytest.approx(10 / 20)
    assert s.noisy


@pytest.mark.parametrize("runs", [[], [1.0, math.nan], [1.0, math.inf], [-1.0, 2.0]])
def test_score_fails_fast_on_bad_runs(runs):
    with pytest.raises(ValueError):
        measure.score(runs, 0.1)


def test_break_even_and_speedup():
    # AR at 100 tok/s = 10 ms/token; a 45 ms step needs AL > 4.5 to win
    assert measure.break_even_al(45.0, 100.0) == pytest.approx(4.5)
    assert measure.break_even_al(45.0, None) is None
    assert measure.speedup(250.0, 100.0) == pytest.approx(2.5)
    assert measure.speedup(250.0, None) is None


def test_oracle_gate_picks_the_cheaper_mode_per_step():
    # break-even 4.5: steps with AL 2 are cheaper as AR (20 ms), AL 8 cheaper as speculation (45 ms)
    g = measure.oracle_gate([2, 8], step_ms=45.0, ar_tps=100.0)
    assert g.fraction_beating == 0.5
    assert g.speculative_tps == pytest.approx(1000 * 10 / 90)
    assert g.ideal_tps == pytest.approx(1000 * 10 / (20 + 45))
    assert g.ideal_tps >= max(g.speculative_tps, g.ar_tps)


def test_exactness_violation_is_zero_only_when_exact():
    assert measure.exactness_violation(1.0) == 0.0
    assert measure.exactness_violation(0.75) == pytest.approx(0.25)
    assert measure.exactness_violation(None) == 0.0


def _cand(trial, median, spread, **cfg):
    return Candidate(trial, cfg, Score((median,), median, spread / 1.4826, spread, median - spread, 0.0, False))


def test_ties_within_spread_go_to_the_simpler_config():
    big = _cand(1, 100.0, 3.0, verify="ddtree", budget=40, target_feat_ctx=0)
    small = _cand(2, 98.0, 3.0, verify="ddtree", budget=12, target_feat_ctx=128)
    slow = _cand(3, 80.0, 1.0, verify="chain")
    assert {c.trial for c in measure.ties([big, small, slow])} == {1, 2}
    assert measure.choose_winner([big, small, slow]).trial == 2


def test_clear_winner_is_kept_even_if_complex():
    big = _cand(1, 100.0, 1.0, verify="ddtree", budget=40)
    small = _cand(2, 90.0, 1.0, verify="ddtree", budget=12)
    assert measure.choose_winner([big, small]).trial == 1


def test_positive_conclusion_needs_twice_the_spread():
    inc = _cand(0, 100.0, 2.0).score
    assert not measure.is_positive(_cand(1, 103.9, 2.0).score, inc)
    assert measure.is_positive(_cand(1, 104.1, 2.0).score, inc)


def test_complexity_orders_nodes_then_window():
    assert measure.complexity({"verify": "ar"}) < measure.complexity({"verify": "ddtree", "budget": 4})
    assert measure.complexity({"verify": "ddtree", "budget": 8, "target_feat_ctx": 64}) < \
        measure.complexity({"verify": "ddtree", "budget": 8, "target_feat_ctx": 0})
