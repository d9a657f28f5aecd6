"""The adaptive step policy (engine/decoding/policy.py): its estimate, calibration and choice as pure
functions on scripted draft probabilities and cost tables, and end to end on the tiny targets, where
every policy's output must equal AR token for token."""

import math

import pytest
import torch

from engine import EngineConfig, EngineInputError
from engine.decoding.decode import generate_ar, generate_speculative
from engine.decoding.policy import (
    FIXED_POINT,
    AdaptivePolicy,
    Calibration,
    StepCosts,
    accepted_within,
    choose_budget,
    expected_accepts,
    path_probabilities,
    policy_budgets,
    prefix,
    root_row,
)
from engine.decoding.tree import ancestor_mask, build_tree_device, build_tree_host
from tests.engine.engine_pairs import pair_for

BUDGETS = (0, 2, 4, 8)
# Verify is expensive: a tree step must accept more than one drafted token in two to beat AR.
EXPENSIVE = StepCosts({0: 1.0, 2: 1.5, 4: 1.8, 8: 2.5})
CHEAP = StepCosts({0: 1.0, 2: 1.05, 4: 1.1, 8: 1.2})
AS_IS = [1.0] * len(BUDGETS)  # calibration ratios: the draft's probabilities as they are


def test_the_budgets_halve_from_the_configured_one_and_always_include_ar():
    assert policy_budgets(64, 4) == (0, 8, 16, 32, 64)
    assert policy_budgets(22, 4) == (0, 3, 6, 11, 22)
    assert policy_budgets(3, 5) == (0, 1, 2, 3)  # halvings that repeat are dropped
    assert policy_budgets(9, 1) == (0, 9)


def _scripted(depth: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-depth top-k log-probs (descending) and token ids, as a draft's top-k gives them."""
    gen = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(3 * torch.randn(depth, 32, generator=gen), -1).topk(k).values
    return lp, torch.arange(depth * k).view(depth, k) + 1


def _path_probability(lp: torch.Tensor, tree, node: int) -> float:
    """Product of the draft's probabilities along the path from the root to ``node``, walked on the host."""
    p = 1.0
    while node > 0:
        p *= math.exp(float(lp[int(tree.depths[node]) - 1, int(tree.ranks[node])]))
        node = int(tree.parents[node])
    return p


@pytest.mark.parametrize("chain_seed", [None, 0, 2])
def test_the_estimate_sums_path_probabilities_and_a_prefix_is_the_smaller_budgets_tree(chain_seed):
    """E[accepted](b) is the sum over the budget-b tree's nodes of its path's probability; the
    builders' node list is best-first, so the first b nodes of the largest tree are the tree the
    builders make at budget b, and prefix sums of the path probabilities give every budget's estimate."""
    lp, ids = _scripted(depth=5, k=3, seed=1)
    big = build_tree_host(lp, ids, 7, 12, chain_seed)
    probs = path_probabilities(lp, big, ancestor_mask(big.parents, 5), root_row(3, lp.device))
    assert probs.dtype == torch.long and probs.shape == (big.size,)
    for i in range(1, big.size):  # each node's path probability, in fixed point (truncated)
        assert int(probs[i]) == pytest.approx(_path_probability(lp, big, i) * FIXED_POINT, abs=2)
    budgets = list(range(13))
    estimate = expected_accepts(probs[1:].tolist(), budgets)
    assert estimate[0] == 0
    for b in range(1, 13):
        small = build_tree_host(lp, ids, 7, b, chain_seed)
        cut, _ = prefix(big, ancestor_mask(big.parents, 5), b)
        assert torch.equal(cut.tokens, small.tokens) and torch.equal(cut.parents, small.parents)
        want = sum(_path_probability(lp, small, i) for i in range(1, small.size))
        assert estimate[b] == pytest.approx(want, rel=1e-4)
    # the device builder orders its nodes the same way (the runtime's proposals)
    dev = build_tree_device(lp, ids, torch.tensor(7), 12, chain_seed)
    assert torch.equal(dev.tokens, big.tokens)
    # a budget past the tree reads the whole tree
    assert expected_accepts(probs[1:].tolist(), (0, 4, 12, 30)) == [0, estimate[4], estimate[12], estimate[12]]


def test_a_weak_draft_with_an_expensive_verify_chooses_ar_and_a_strong_one_the_largest_tree():
    weak = [0.0, 0.3, 0.4, 0.45]  # E[accepted] at budgets 0, 2, 4, 8
    strong = [0.0, 1.9, 3.5, 6.0]
    assert choose_budget(BUDGETS, weak, AS_IS, EXPENSIVE, depth=7) == (0, 1.0)
    b, al = choose_budget(BUDGETS, strong, AS_IS, CHEAP, depth=7)
    assert (b, al) == (8, 7.0)
    # a verify as cheap as an AR step: even a weak draft's tree pays, at a budget that adds enough
    assert choose_budget(BUDGETS, weak, AS_IS, StepCosts({0: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}), depth=7)[0] == 8
    # the calibration scales the draft's estimate: a strong-looking draft that is not accepted loses
    assert choose_budget(BUDGETS, strong, AS_IS, EXPENSIVE, depth=7)[0] == 8
    assert choose_budget(BUDGETS, strong, [0.05] * 4, EXPENSIVE, depth=7)[0] == 0
    # a tree accepts at most one node per depth and its b nodes, whatever the estimate: budget 4
    # reaches depth 3 (E[AL] 4) at a lower cost than 8
    assert choose_budget(BUDGETS, [0.0, 9.0, 9.0, 9.0], AS_IS, CHEAP, depth=3) == (4, 4.0)
    # an infinite cost excludes a budget
    assert choose_budget(BUDGETS, strong, AS_IS, StepCosts({0: 1.0, 2: 1.05, 4: 1.1, 8: math.inf}), depth=7)[0] == 4


def test_the_calibration_moves_toward_the_observed_acceptance_and_forgets_old_steps():
    cal = Calibration(window=4)
    assert cal.ratio == 1.0  # the prior: the draft's probabilities as they are
    ratios = []
    for _ in range(30):
        cal.update(predicted=5.0, observed=1.0)  # the draft is five times too confident
        ratios.append(cal.ratio)
    assert all(a > b for a, b in zip(ratios, ratios[1:], strict=False))
    # decayed sums of 4 steps (20 predicted, 4 observed) and the prior's half pseudo-node: 4.5 / 20.5
    assert ratios[-1] == pytest.approx(4.5 / 20.5, abs=1e-3)
    for _ in range(30):  # the text became easy: the draft is right now
        cal.update(predicted=5.0, observed=5.0)
    assert cal.ratio == pytest.approx(1.0, abs=0.02)


def test_one_tree_step_observes_every_budget_up_to_its_own():
    """The accepted path's nodes inside each budget's prefix: parents come first in the builder's order."""
    assert accepted_within([1, 3, 6], BUDGETS) == [0, 1, 2, 3]  # root, then nodes 1, 3, 6 accepted
    assert accepted_within([], BUDGETS) == [0, 0, 0, 0]  # the root alone


def test_the_policy_probes_again_after_ar_steps_and_learns_from_each_tree_step():
    policy = AdaptivePolicy(BUDGETS, EXPENSIVE, depth=7, probe_every=3,
                            calibrations=[Calibration(4) for _ in BUDGETS])
    # no estimate yet: every node assumed accepted, the best rate under the costs (8 nodes: 8 / 2.5)
    assert policy.choose() == (8, 8.0)
    estimate = [0.0, 1.9, 3.5, 6.0]
    for _ in range(2):  # the draft expected 6 nodes at budget 8 (1.9 at budget 2); none was accepted
        policy.record(8, estimate, [0, 0, 0, 0])
    # each budget's shell (the nodes it adds to the smaller tree): 1.9, 1.6 and 2.5 expected nodes
    w = 0.5  # the prior's pseudo-node: half a node (policy._PRIOR)
    assert [c.ratio for c in policy.calibrations] == pytest.approx(
        [1.0, w / (1.75 * 1.9 + w), w / (1.75 * 1.6 + w), w / (1.75 * 2.5 + w)], rel=1e-5)
    shells = [1.0, w / (1.75 * 1.9 + w)]  # an outer shell's prior is the ratio of the shell inside it
    shells += [w * shells[-1] / (1.75 * 1.6 + w)]
    shells += [w * shells[-1] / (1.75 * 2.5 + w)]
    assert policy.calibrated(estimate) == pytest.approx(
        [0.0, 1.9 * shells[1], 1.9 * shells[1] + 1.6 * shells[2], 1.9 * shells[1] + 1.6 * shells[2] + 2.5 * shells[3]])
    choices = [policy.choose()[0] for _ in range(6)]
    assert choices == [0, 0, 2, 0, 0, 2]  # every third step a probe, at the best tree budget
    before = (policy.calibrations[2].predicted, policy.calibrations[3].predicted)
    for _ in range(2):  # the probes' two nodes accepted: the draft is right again, at budget 2
        policy.record(2, estimate, [0, 2, 2, 2])
    assert policy.choose()[0] == 2
    # a budget-2 step says nothing about the larger trees
    assert (policy.calibrations[2].predicted, policy.calibrations[3].predicted) == before
    policy.record(0, [], [])  # an AR step teaches nothing
    assert policy.calibrations[1].observed == pytest.approx(2 + 0.75 * 2)


def test_each_budget_is_calibrated_on_its_own_acceptance():
    """A draft right on its first nodes and over-confident deeper: one budget-8 step that accepted
    its two best nodes, and nothing past them, makes the budget-4 tree the best rate (AL 3 for 1.1 ms
    against 3 for 1.2), where one ratio for every budget would keep verifying 8."""
    policy = AdaptivePolicy(BUDGETS, CHEAP, depth=7, probe_every=3, calibrations=[Calibration(4) for _ in BUDGETS])
    policy.record(8, [0.0, 1.9, 3.5, 6.0], [0, 2, 2, 2])
    assert policy.choose()[0] == 4
    one_ratio = [(2 + 1) / (6.0 + 1)] * 4
    assert choose_budget(BUDGETS, [0.0, 1.9, 3.5, 6.0], one_ratio, CHEAP, depth=7)[0] == 8


def test_step_costs_and_the_policys_fields_are_validated_with_the_rule_and_the_value():
    with pytest.raises(EngineInputError, match=r"cost of budget 4 must be a number > 0 \(ms\), but got -1"):
        StepCosts({0: 1.0, 4: -1})
    with pytest.raises(EngineInputError, match="a budget must be an integer >= 0, but got 'x'"):
        StepCosts({"x": 1.0})
    with pytest.raises(EngineInputError, match="at least one budget must have a finite cost"):
        StepCosts({0: math.inf})
    with pytest.raises(EngineInputError, match=r"no cost for budget\(s\) \[8\]"):
        AdaptivePolicy.for_config(EngineConfig(budget=8, policy="adaptive", policy_levels=2), 7,
                                  StepCosts({0: 1.0, 4: 2.0}))
    with pytest.raises(EngineInputError, match=r"EngineConfig.policy must be one of \['fixed', 'adaptive'\], "
                                               "but got 'auto'"):
        EngineConfig(policy="auto")
    with pytest.raises(EngineInputError, match="EngineConfig.probe_every must be >= 2, but got 1"):
        EngineConfig(probe_every=1)
    with pytest.raises(EngineInputError, match="EngineConfig.policy_levels must be <= 10, but got 11"):
        EngineConfig(policy_levels=11)
    with pytest.raises(EngineInputError, match="EngineConfig.calibration_window must be an integer"):
        EngineConfig(calibration_window=1.5)
    # the policy is DDTree's, its knobs the adaptive policy's: exports and reports show them only there
    # the cap is the larger of the two: a config from before probe_max (probe_every above 64) still loads
    costs = StepCosts({0: 1.0, 4: 2.0, 8: 3.0})
    cfg = EngineConfig(budget=8, policy="adaptive", policy_levels=2, probe_every=100)
    assert AdaptivePolicy.for_config(cfg, 7, costs).max_ar_run == 99
    assert AdaptivePolicy.for_config(cfg.replace(probe_every=8, probe_max=4), 7, costs).max_ar_run == 7
    with pytest.raises(EngineInputError, match="EngineConfig.probe_max must be <= 1,024, but got 2e"):
        EngineConfig(probe_max=2000)
    with pytest.raises(EngineInputError, match="EngineConfig.probe_max must be an integer, but got '16.0'"):
        EngineConfig(probe_max=16.0)
    assert EngineConfig(probe_every=5, probe_max=5).probe_max == 5  # equal: no back-off
    assert EngineConfig.from_dict({"probe_max": 32}, source="x.yaml").probe_max == 32
    with pytest.raises(EngineInputError, match=r"x.yaml: EngineConfig.probe_max must be >= 2, but got 1"):
        EngineConfig.from_dict({"probe_every": 40, "probe_max": 1}, source="x.yaml")
    knobs = {"policy_levels", "probe_every", "probe_max", "calibration_window"}
    adaptive = EngineConfig(policy="adaptive").applicable()
    assert knobs <= set(adaptive) and adaptive["policy"] == "adaptive"
    fixed = EngineConfig().applicable()
    assert fixed["policy"] == "fixed" and not knobs & set(fixed)
    assert not (knobs | {"policy"}) & set(EngineConfig(verify="chain", policy="adaptive").applicable())
    assert EngineConfig.from_dict(adaptive) == EngineConfig(policy="adaptive")


def _prompt(pair):
    return pair.encode("The policy changes what is proposed, never what is committed.")


@pytest.mark.parametrize("target,rollback", [("tiny-dense", "fast"), ("tiny-hybrid", "fast"),
                                             ("tiny-hybrid", "replay")])
def test_adaptive_equals_ar_and_runs_ar_steps_for_a_weak_draft_and_trees_for_a_strong_one(target, rollback):
    """The generic loop with the oracle draft (its proposals read on the host): at P = 0.1 the
    draft is right and the policy verifies trees; at P = 0.9 a tree step accepts too little to pay
    for its verify, and the policy runs plain AR steps, probing now and then. Every output is AR's."""
    cfg = EngineConfig(verify="ddtree", budget=8, top_k=3, block_size=8, rollback=rollback, policy="adaptive",
                       policy_levels=3, probe_every=4)
    seen = {}
    for p in ("0.1", "0.9"):
        pair = pair_for(target, f"oracle:{p}")
        ids = _prompt(pair)
        ar = generate_ar(pair, ids, EngineConfig(verify="ar"), 32).tokens
        gen = generate_speculative(pair, ids, cfg, 32, step_costs=EXPENSIVE)
        assert gen.tokens == ar, p
        stats = gen.stats.to_dict()
        assert len(gen.stats.step_budgets) == gen.stats.steps and sum(gen.stats.accept_lengths) >= 31
        seen[p] = stats
    strong, weak = seen["0.1"], seen["0.9"]
    assert 0 not in strong["budget_histogram"]  # every step a tree: the draft is right
    assert weak["budget_histogram"][0] > 0.6 * sum(weak["budget_histogram"].values())  # mostly AR
    assert set(weak["budget_histogram"]) - {0}  # ... with probes
    assert strong["policy_observed_al"] > 4 > weak["policy_observed_al"]
    # the fixed policy records no budgets, and decodes as before
    pair = pair_for(target, "oracle:0.9")
    fixed = generate_speculative(pair, _prompt(pair), cfg.replace(policy="fixed"), 32)
    assert fixed.stats.step_budgets == [] and fixed.stats.to_dict()["budget_histogram"] == {}


def test_adaptive_sampling_commits_the_ar_samples():
    """At temperature > 0 every committed token is the target's sample at its position, whatever
    budget proposed it: the adaptive policy's output is AR's with the same seed."""
    pair = pair_for("tiny-dense", "oracle:0.3")
    ids = _prompt(pair)
    temp = dict(temperature=0.8, seed=3)
    ar = generate_ar(pair, ids, EngineConfig(verify="ar", **temp), 32).tokens
    cfg = EngineConfig(verify="ddtree", budget=8, top_k=3, block_size=8, policy="adaptive", policy_levels=3, **temp)
    gen = generate_speculative(pair, ids, cfg, 32, step_costs=StepCosts({0: 1.0, 2: 1.2, 4: 1.4, 8: 1.9}))
    assert gen.tokens == ar and len(set(gen.stats.step_budgets)) > 1


def test_the_step_costs_are_measured_once_per_pair_and_a_given_table_is_kept():
    pair = pair_for("tiny-dense", "random")
    cfg = EngineConfig(verify="ddtree", budget=4, top_k=2, policy="adaptive", policy_levels=2, draft_path="generic")
    ids = _prompt(pair)
    costs = pair.step_costs(cfg, ids)
    assert set(costs.ms) == {0, 2, 4} and all(0 < ms < math.inf for ms in costs.ms.values())
    assert pair.step_costs(cfg.replace(probe_every=5), ids) is costs  # knobs that cost nothing share it
    gen = generate_speculative(pair, ids, cfg, 8)  # the measured table, by default
    assert gen.tokens == generate_ar(pair, ids, EngineConfig(verify="ar"), 8).tokens
    given = StepCosts({0: 1.0, 2: 9.0, 4: 9.0})
    assert pair.step_costs(cfg, costs=given) is given and pair.step_costs(cfg, ids) is given
    assert set(generate_speculative(pair, ids, cfg, 8).stats.step_budgets[2:]) == {0}


def test_each_decode_loop_has_its_own_step_costs():
    """A grammar the runtime refuses sends a generation to the generic loop, whose steps cost
    otherwise: the table is kept per loop, and a generation reads the one of the loop it runs."""
    pair = pair_for("tiny-dense", "random")
    cfg = EngineConfig(verify="ddtree", budget=4, top_k=2, policy="adaptive", policy_levels=2, draft_path="runtime")
    ids = _prompt(pair)
    trees, ar_steps = StepCosts({0: 9.0, 2: 9.0, 4: 1.0}), StepCosts({0: 1.0, 2: 9.0, 4: 9.0})
    assert pair.step_costs(cfg, costs=trees) is trees  # the loop cfg takes: the runtime
    assert pair.step_costs(cfg, costs=ar_steps, use_runtime=False) is ar_steps
    assert pair.step_costs(cfg, ids) is trees and pair.step_costs(cfg, ids, use_runtime=False) is ar_steps
    want = generate_ar(pair, ids, EngineConfig(verify="ar"), 12).tokens
    on_runtime = generate_speculative(pair, ids, cfg, 12, use_runtime=True)
    generic = generate_speculative(pair, ids, cfg, 12, use_runtime=False)
    assert on_runtime.tokens == want and generic.tokens == want
    assert on_runtime.stats.loop != "generic" and generic.stats.loop == "generic"
    assert set(on_runtime.stats.step_budgets[2:]) == {4} and set(generic.stats.step_budgets[2:]) <= {0, 4}
    assert generic.stats.step_budgets[2:].count(0) > generic.stats.step_budgets[2:].count(4)


def test_a_tree_step_is_observed_from_its_path_probabilities_and_accepted_nodes():
    """What an adaptive tree step reads back (``AdaptivePolicy.observe``): its proposal's path
    probabilities of nodes 1..N in fixed point and the accepted node indices after the root; the host
    makes every budget's estimate (prefix sums) and acceptance (nodes inside the prefix) from them."""
    policy = AdaptivePolicy(BUDGETS, CHEAP, depth=7, probe_every=3, calibrations=[Calibration(4) for _ in BUDGETS])
    probs = [0.9, 0.5, 0.4, 0.3, 0.2, 0.2, 0.1, 0.1, 0.05, 0.05]  # nodes 1..10: a tree of 10 nodes
    policy.observe(4, [int(p * FIXED_POINT) for p in probs], [1, 3, 6])
    assert policy.accepts == pytest.approx([0.0, 1.4, 2.1, 2.7], abs=1e-4)  # budget b: the first b nodes
    # budgets up to 4 observed, by shell: node 1 in budget 2's tree, node 3 in what budget 4 adds to
    # it; 8 is larger than the step's tree
    assert [c.observed for c in policy.calibrations] == [0.0, 1.0, 1.0, 0.0]
    assert [c.predicted for c in policy.calibrations] == pytest.approx([0.0, 1.4, 0.7, 0.0], abs=1e-4)


def test_at_most_max_ar_run_ar_steps_come_between_two_proposals():
    """The runtime's first proposal after AR steps recomputes the draft's context of a fixed window,
    ``catch_up_rows``: the last tree step's commits (at most ``block``) and the AR steps' since, of
    which there are at most ``max_ar_run`` while a tree budget has a finite cost."""
    for probe_every in (2, 3, 8):
        policy = AdaptivePolicy(BUDGETS, EXPENSIVE, depth=7, probe_every=probe_every,
                                calibrations=[Calibration(4) for _ in BUDGETS])
        policy.record(8, [0.0, 0.1, 0.1, 0.1], [0, 0, 0, 0])  # a weak draft: AR steps from now on, and probes
        choices = [policy.choose()[0] for _ in range(40)]
        runs = "".join("0" if b == 0 else "t" for b in choices).split("t")
        assert max(len(r) for r in runs) == policy.max_ar_run == probe_every - 1
        assert policy.catch_up_rows(16) == 16 + probe_every - 1


def _probes(choices: list[int]) -> list[int]:
    """The steps (1-based) ``choices`` verify a tree at."""
    return [i + 1 for i, b in enumerate(choices) if b > 0]


def test_failed_probes_back_off_to_the_cap_and_a_tree_chosen_again_resets_them():
    """While probes keep failing (the choice after them stays 0), each comes twice as many steps after
    the last, from ``probe_every`` up to ``probe_max``; a tree the policy chooses on its own (the draft
    right again) brings them back to ``probe_every``. AR runs never exceed ``max_ar_run``."""
    policy = AdaptivePolicy(BUDGETS, EXPENSIVE, depth=7, probe_every=3, probe_max=12,
                            calibrations=[Calibration(2) for _ in BUDGETS])
    assert (policy.max_ar_run, policy.catch_up_rows(16)) == (11, 16 + 11)
    weak, strong = [0.0, 0.1, 0.1, 0.1], [0.0, 2.0, 4.0, 7.0]
    policy.record(8, weak, [0, 0, 0, 0])  # a weak draft: AR steps, and probes
    choices = [policy.choose()[0] for _ in range(60)]
    assert _probes(choices) == [3, 9, 21, 33, 45, 57]  # after 3, 6, 12 steps, then 12 (the cap) on
    assert set(choices) == {0, 2}  # the probes verify the best tree budget
    for _ in range(3):  # a probe accepted whole: the draft is right again, and trees come on their own
        policy.record(8, strong, [0, 2, 4, 7])
    assert policy.choose()[0] == 8
    for _ in range(4):  # wrong again: AR steps, and probes from ``probe_every`` again
        policy.record(8, weak, [0, 0, 0, 0])
    again = [policy.choose()[0] for _ in range(24)]
    assert _probes(again) == [3, 9, 21]
    runs = "".join("0" if b == 0 else "t" for b in choices + again).split("t")
    assert max(len(r) for r in runs) == policy.max_ar_run


def test_without_a_cap_above_probe_every_probes_do_not_back_off():
    for probe_max in (None, 4):
        policy = AdaptivePolicy(BUDGETS, EXPENSIVE, depth=7, probe_every=4, probe_max=probe_max,
                                calibrations=[Calibration(2) for _ in BUDGETS])
        policy.record(8, [0.0, 0.1, 0.1, 0.1], [0, 0, 0, 0])
        assert _probes([policy.choose()[0] for _ in range(20)]) == [4, 8, 12, 16, 20]
        assert policy.max_ar_run == 3


def test_the_policy_takes_the_cap_from_the_config():
    cfg = EngineConfig(policy="adaptive", budget=8, policy_levels=3, probe_every=4, probe_max=32)
    policy = AdaptivePolicy.for_config(cfg, depth=7, costs=EXPENSIVE)
    assert (policy.probe_every, policy.probe_max, policy.max_ar_run) == (4, 32, 31)


def test_a_larger_trees_calibrated_estimate_never_falls_below_a_smaller_ones():
    """A larger tree contains the smaller one: calibrated shell by shell, its E[accepted] is at least
    the smaller tree's whatever the ratios (one ratio per whole tree let budget 24 pass budget 48 on the
    SmolLM2 pair, ``benchmarks/policy_sim.py``), and a shell never verified takes the ratio of the one
    inside it: a draft wrong on its first nodes is not trusted behind them."""
    policy = AdaptivePolicy(BUDGETS, CHEAP, depth=7, probe_every=3, calibrations=[Calibration(4) for _ in BUDGETS])
    for _ in range(3):  # only budget 2 verified: right on all it expected
        policy.record(2, [0.0, 1.0, 1.5, 1.6], [0, 1, 1, 1])
    for _ in range(3):  # then budget 8: the budget-4 shell over-confident, the budget-2 tree right
        policy.record(8, [0.0, 1.0, 3.0, 3.2], [0, 1, 1, 2])
    est = policy.calibrated([0.0, 1.0, 3.0, 3.2])
    assert est == sorted(est) and est[2] < 3.0 and est[3] > est[2]
    weak = AdaptivePolicy(BUDGETS, CHEAP, depth=7, probe_every=3, calibrations=[Calibration(4) for _ in BUDGETS])
    for _ in range(3):  # budget 2 verified, never accepted: the shells behind it (never verified) follow it
        weak.record(2, [0.0, 1.0, 2.0, 3.0], [0, 0, 0, 0])
    ratios = [c.ratio for c in weak.calibrations]  # (toward 1: as the draft says)
    assert ratios[2] == ratios[3] == 1.0 and ratios[1] < 0.35
    assert weak.calibrated([0.0, 1.0, 2.0, 3.0]) == pytest.approx([0.0, ratios[1], 2 * ratios[1], 3 * ratios[1]])


def test_another_budget_replaces_the_configured_tree_only_when_it_beats_it_by_the_margin():
    """switch_margin: the largest finite budget (the configured tree) stays unless another budget's
    expected rate is more than that fraction above its own; a draft that fails is still left for AR."""
    near = [0.0, 1.9, 2.5, 2.9]  # budget 4: 3.5 / 1.1 = 3.18 a ms; budget 8: 3.9 / 1.2 = 3.25, the best anyway
    assert choose_budget(BUDGETS, [0.0, 1.9, 3.0, 3.0], AS_IS, CHEAP, depth=7)[0] == 4  # 4.0/1.1 > 4.0/1.2
    assert choose_budget(BUDGETS, [0.0, 1.9, 3.0, 3.0], AS_IS, CHEAP, depth=7, margin=0.1)[0] == 8  # 9% < 10%
    assert choose_budget(BUDGETS, [0.0, 1.9, 3.0, 3.0], AS_IS, CHEAP, depth=7, margin=0.05)[0] == 4
    assert choose_budget(BUDGETS, near, AS_IS, CHEAP, depth=7, margin=0.1) == (8, 3.9)
    weak = [0.0, 0.05, 0.05, 0.05]  # AR: 1 a ms against the tree's 1.05 / 1.2: AR wins by 14%
    assert choose_budget(BUDGETS, weak, AS_IS, CHEAP, depth=7, margin=0.1)[0] == 0
    assert choose_budget(BUDGETS, weak, AS_IS, CHEAP, depth=7, margin=0.2)[0] == 8
    # the largest budget of finite cost is the one kept
    no8 = StepCosts({0: 1.0, 2: 1.05, 4: 1.1, 8: math.inf})
    assert choose_budget(BUDGETS, [0.0, 1.9, 1.95, 3.0], AS_IS, no8, depth=7, margin=0.1)[0] == 4


def test_a_generation_opens_with_the_configured_tree_and_the_margin_comes_from_the_config():
    """No estimate before the first tree step is read back (two steps on the runtime): the largest
    tree runs, as a fixed policy would, not the cheapest of the trees that tie at full acceptance."""
    cfg = EngineConfig(verify="ddtree", budget=8, policy="adaptive", policy_levels=3, switch_margin=0.25)
    policy = AdaptivePolicy.for_config(cfg, depth=3, costs=CHEAP)
    assert policy.margin == 0.25
    assert policy.choose() == (8, 4.0) and policy.choose() == (8, 4.0)
    with pytest.raises(EngineInputError, match="switch_margin must be >= 0.0"):
        EngineConfig(switch_margin=-0.1)
    with pytest.raises(EngineInputError, match="switch_margin must be <= 10.0"):
        EngineConfig(switch_margin=11.0)
    with pytest.raises(EngineInputError, match="policy_preview must be true or false, but got 'yes'"):
        EngineConfig(policy_preview="yes")
    assert "policy_preview" not in EngineConfig(verify="ddtree").applicable()  # a fixed policy's: not shown
    assert policy.previews and not AdaptivePolicy.for_config(cfg.replace(policy_preview=False), 3, CHEAP).previews


@pytest.mark.parametrize("on_runtime", [True, False])
def test_the_first_proposal_chooses_its_own_budget_unless_told_not_to(on_runtime, monkeypatch):
    """``policy_preview``: the generation's first proposal is read before its budget is chosen, so a
    draft the costs say is not worth a tree gets AR steps from the first step; without it the
    configured tree runs blind until a tree step is read back (two steps on the runtime, one on the
    generic loop). Every output equals AR's either way."""
    pair = pair_for("tiny-dense", "random")
    ids = _prompt(pair)
    cfg = EngineConfig(verify="ddtree", budget=4, top_k=2, policy="adaptive", policy_levels=2, probe_every=50)
    costs = StepCosts({0: 1.0, 2: 9.0, 4: 9.0})
    want = generate_ar(pair, ids, EngineConfig(verify="ar"), 12).tokens
    read = generate_speculative(pair, ids, cfg, 12, step_costs=costs, use_runtime=on_runtime)
    blind = generate_speculative(pair, ids, cfg.replace(policy_preview=False), 12, step_costs=costs,
                                 use_runtime=on_runtime)
    assert read.tokens == blind.tokens == want
    assert set(read.stats.step_budgets) == {0}
    # where only AR steps can be chosen, no proposal is read (it would be wasted)
    calls = []
    for name in ("propose", "propose_static"):
        real = getattr(pair.drafter, name)
        monkeypatch.setattr(pair.drafter, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    only_ar = StepCosts({0: 1.0, 2: math.inf, 4: math.inf})
    assert generate_speculative(pair, ids, cfg, 12, step_costs=only_ar, use_runtime=on_runtime).tokens == want
    assert calls == []
    blind_steps = 2 if on_runtime else 1
    assert blind.stats.step_budgets[:blind_steps] == [4] * blind_steps
    assert set(blind.stats.step_budgets[blind_steps:]) == {0}


def test_measuring_the_step_costs_stays_inside_the_reserved_buffers():
    """A sweep reserves the workspace at the workload's length; a generation shorter than the step
    costs' measurement must not grow it (growing doubles it, and the peak with it)."""
    from engine import reserve_memory

    pair = pair_for("tiny-dense", "random")
    cfg = EngineConfig(verify="ddtree", budget=4, top_k=2, policy="adaptive", policy_levels=2, draft_path="generic")
    ids = _prompt(pair) * 4  # long enough that its head can give way to the measurement's 32 tokens
    reserve_memory(pair, cfg, len(ids), 8)
    held = pair._workspace.max_len
    pair._step_costs.clear()
    gen = generate_speculative(pair, ids, cfg, 8)  # measures the table first
    assert pair._workspace.max_len == held
    assert gen.tokens == generate_ar(pair, ids, EngineConfig(verify="ar"), 8).tokens
