"""The adaptive step policy (``EngineConfig.policy = "adaptive"``): each step's tree budget, 0 (a plain
AR step) included, chosen to maximise expected committed tokens per millisecond.

Stages, each a pure function or a small record:

1. **Estimate** (``path_probabilities`` on the device, inside the draft's step; ``expected_accepts``
   on the host): the tree builder scores a node by the summed log-probs of its path, so exp(score) is
   the probability, under the draft's own distributions, that the target accepts the whole path to
   it. The expected number of accepted drafted nodes of a tree is the sum of those over its nodes,
   and the builder's node list is best-first (the forced top-1 chain first), so the tree of budget b
   is the list's first b nodes: prefix sums over the tree built at the largest budget give
   E[accepted](b) for every b. The device computes only each node's path probability, in fixed
   point (on CUDA one launch, each node summing its path's log-probs; elsewhere a matrix-vector
   product with the ancestor mask and an exp); they ride in the step's one readback and the host
   sums them.
2. **Calibrate** (``Calibration``, one per budget, of its shell: the nodes its tree adds to the next
   smaller budget's): drafts are over- or under-confident (an early checkpoint, a workload it never
   saw), and by how much depends on the node's place in the tree. A tree step observes every budget up
   to its own (``accepted_within``, on the host from the accepted path's node indices, which ride in
   the readback too: the path's nodes inside each budget's prefix), so each shell's observed and
   predicted accepted nodes, as exponentially decayed sums over this generation's tree steps, give its
   ratio; E[accepted](b) is the sum of the shells' predictions up to b, each scaled by its ratio
   (``AdaptivePolicy.calibrated``): never below a smaller budget's, whose tree it contains. A shell's
   prior (half a pseudo-node) is the ratio of the shell inside it (the first shell's: 1, the draft as it
   is), so a shell seldom verified follows what the draft showed nearer the root.
3. **Choose** (``choose_budget``): E[AL](b) = 1 + min(calibrated E[accepted](b), b, depth), and the
   budget maximising E[AL](b) / ms(b) over ``StepCosts``, the step's cost at each budget (measured for
   this pair on this device, ``decode.measure_step_costs``, or given), provided it beats the
   configured tree (the largest budget) by ``switch_margin``: the estimates are noisy, and where a
   tree's cost barely depends on its budget the argmax of noisy rates gave up the largest tree on
   steps it would have won. Until a generation's first tree step is read back there is no estimate:
   its first proposal is read before its budget is chosen (``AdaptivePolicy.preview``), else the
   configured tree runs.
4. **Probe** (``AdaptivePolicy``): an AR step runs no draft, so no new estimate comes from it.
   While the choice stays 0, every ``probe_every``-th step proposes and verifies a tree at the best
   non-zero budget: its proposal refreshes the estimate and its acceptance the calibration. A probe
   that fails costs a tree step for one token, so while they keep failing the interval doubles, up to
   ``probe_max``; a tree the policy chooses on its own resets it to ``probe_every``. So at most
   ``max_ar_run`` (``probe_max - 1``) AR steps run between two proposals.

**The draft's context across AR steps.** On the runtime an AR step the policy chooses is plain AR's
step (the root alone: no walk, no K/V move) plus one copy, the committed position's target features
into the features buffer; it writes nothing of the draft's. A proposal recomputes the draft's context
keys and values of the ``block`` positions before its root (a tree step commits at most that many),
so after tree steps the context is current; the first proposal after AR steps recomputes a fixed
window of ``catch_up_rows`` positions instead (``block + max_ar_run``: the last tree step's commits
and the AR steps' since, the window's shape fixed for its captured graph). The host knows which one a
proposal needs when it launches it (the previous step's budget is a choice it made), so that is two
captured proposals, and no graph reads the host. Every position a proposal reads is one a proposal
wrote (or the prefill's context): proposals are those of a context written after every step. The
generic loop's draft projects every position committed since its last proposal anyway.

A choice is made when a step is launched, from what the host has read by then: the last tree step's
estimate (on the runtime, whose next step is launched before the current one is read, the one
before). Exactness does not depend on it: every budget, 0 included, commits the target's own tokens.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from engine.config import EngineConfig, EngineInputError
from engine.decoding import tree_kernel
from engine.decoding.tree import Tree
from engine.models import fused

# The path probabilities travel in the step's packed integer readback as fixed point (2**-16 resolution).
FIXED_POINT = 1 << 16
# Pseudo-counts of the calibration's prior (ratio 1: the draft's probabilities as they are). Half a node:
# a draft the target rejects (the random draft: E[AL] 5.8 predicted at budget 48, 1.0 observed) is found
# out in fewer tree steps (``benchmarks/policy_sim.py``, 2026-12-05: 27 -> 16 budget-48 steps on 4
# HumanEval prompts, 0.968x -> 0.976x AR) while the shipped draft's choices stay the same on HumanEval,
# chat and agent traffic (6 prompts each); a quarter of a node let single misses send it to AR steps.
_PRIOR = 0.5


def policy_budgets(budget: int, levels: int) -> tuple[int, ...]:
    """The budgets an adaptive step chooses from, ascending: 0 (a plain AR step), then ``budget``
    halved ``levels - 1`` times (rounded up; duplicates dropped)."""
    tree = {max(1, -(-budget // (1 << i))) for i in range(levels)}
    return (0, *sorted(tree))


@dataclass(frozen=True)
class StepCosts:
    """Milliseconds of one decode step at each budget (0: a plain AR step, the root alone and no
    draft; b > 0: the draft's proposal and the verify of b nodes). ``math.inf`` excludes a budget.
    Measured by ``decode.measure_step_costs``; tests and callers may give their own."""

    ms: Mapping[int, float]

    def __post_init__(self) -> None:
        for b, ms in self.ms.items():
            if isinstance(b, bool) or not isinstance(b, int) or b < 0:
                raise EngineInputError(f"StepCosts: a budget must be an integer >= 0, but got {b!r}")
            if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not ms > 0:
                raise EngineInputError(f"StepCosts: the cost of budget {b} must be a number > 0 (ms), but got {ms!r}")
        if all(math.isinf(ms) for ms in self.ms.values()):
            raise EngineInputError("StepCosts: at least one budget must have a finite cost")

    def check(self, budgets: Sequence[int]) -> None:
        """Every candidate budget has a cost (a table measured for other budgets is refused)."""
        missing = [b for b in budgets if b not in self.ms]
        if missing:
            raise EngineInputError(f"StepCosts: no cost for budget(s) {missing}; the policy chooses from "
                                   f"{list(budgets)}, the table has {sorted(self.ms)}")


@functools.lru_cache(maxsize=64)
def root_row(k: int, device: torch.device) -> Tensor:
    """[1, k] float32 of ln(FIXED_POINT): the root's row in ``path_probabilities``' log-prob table (made
    once per shape and device, never written: a captured step reads it, never builds it)."""
    return torch.full((1, k), math.log(FIXED_POINT), device=device)


def path_probabilities(top_logprobs: Tensor, tree: Tree, anc: Tensor, root: Tensor) -> Tensor:
    """[N+1] int64: entry i (i >= 1) the probability, under the draft's distributions, that the target
    accepts the whole path to node i, in fixed point (``FIXED_POINT``, truncated); entry 0 (the root)
    is not read.

    ``top_logprobs`` [L, k]: the builder's per-depth log-probs; ``tree`` and ``anc`` (its ancestor
    mask) in the builder's order; ``root`` (``root_row``) stands for the root's log-prob: every node's
    ancestors include the root, so it adds ln(FIXED_POINT) to every path's summed log-probs and the exp
    is the probability already scaled. No host read (it runs inside the captured draft step): on CUDA
    with the kernels on one launch (``tree_kernel.path_probabilities_kernel``, summing in another order:
    an entry may differ by one), else six: the table, the per-node gather, the mask's cast, a
    matrix-vector product, the exp, the cast."""
    if fused.use_kernels(top_logprobs):
        return tree_kernel.path_probabilities_kernel(top_logprobs, tree, math.log(FIXED_POINT))
    node_lp = torch.cat([root, top_logprobs.float()])[tree.depths, tree.ranks]  # depth d: row d, the root's row 0
    return torch.exp(anc.float() @ node_lp).long()


def expected_accepts(probs: Sequence[int], budgets: Sequence[int]) -> list[float]:
    """Host: E[accepted](b) for each budget, from ``path_probabilities``' entries of nodes 1..N (fixed
    point): the sum over the tree of the first min(b, N) nodes (a prefix is the smaller budget's tree)."""
    sums = [0, *accumulate(probs)]
    return [sums[min(b, len(probs))] / FIXED_POINT for b in budgets]


def accepted_within(path: Sequence[int], budgets: Sequence[int]) -> list[int]:
    """Host: per budget, the accepted drafted nodes (``path``: the walk's accepted node indices after the
    root) that lie in that budget's tree, index <= b. A node's parent comes before it in the builder's
    order, so they are the path's first nodes: what the step would have accepted at that budget. One
    tree step observes every budget up to its own."""
    return [sum(1 for node in path if node <= b) for b in budgets]


def prefix(tree: Tree, anc: Tensor, budget: int) -> tuple[Tree, Tensor]:
    """The tree of ``budget`` nodes (views: the builder's first ``budget`` + 1 entries, root included)."""
    n = min(budget, tree.tokens.numel() - 1) + 1
    return Tree(tree.tokens[:n], tree.parents[:n], tree.depths[:n], tree.ranks[:n]), anc[:n, :n]


def root_tree(root: Tensor) -> tuple[Tree, Tensor]:
    """A budget-0 step's tree on the generic loop: the root alone (``root`` [1] long). Verified, it
    commits the target's token after the root. (The runtime runs plain AR's step instead.)"""
    zero = torch.zeros(1, dtype=torch.long, device=root.device)
    return Tree(root, zero - 1, zero, zero), torch.ones(1, 1, dtype=torch.bool, device=root.device)


def choose_budget(budgets: Sequence[int], accepts: Sequence[float], ratios: Sequence[float], costs: StepCosts,
                  depth: int, margin: float = 0.0) -> tuple[int, float]:
    """(the budget maximising E[AL](b) / ms(b), its E[AL]): E[AL](b) = 1 + min(ratio(b) * accepts(b),
    b, depth), a tree accepting at most one node per depth. Ties go to the smaller budget, except that
    the largest budget of finite cost (the configured tree) stays unless the best rate beats its own
    by more than ``margin`` (``EngineConfig.switch_margin``; at 0, a tie with it keeps it)."""
    best, best_al, best_rate = budgets[0], 1.0, -1.0
    top = None  # (budget, E[AL], rate) of the largest finite budget
    for b, a, ratio in zip(budgets, accepts, ratios, strict=True):
        al = 1.0 + min(ratio * a, b, depth)
        rate = al / costs.ms[b]
        if rate > best_rate:
            best, best_al, best_rate = b, al, rate
        if math.isfinite(costs.ms[b]) and (top is None or b > top[0]):
            top = (b, al, rate)
    if top is not None and best != top[0] and best_rate <= (1.0 + margin) * top[2]:
        return top[0], top[1]
    return best, best_al


@dataclass
class Calibration:
    """Observed over predicted accepted nodes, as sums decayed by 1 - 1/``window`` a tree step and
    started from half a pseudo-node (``_PRIOR``) at ratio 1."""

    window: int
    predicted: float = 0.0
    observed: float = 0.0

    def update(self, predicted: float, observed: float) -> None:
        keep = 1.0 - 1.0 / self.window
        self.predicted = keep * self.predicted + predicted
        self.observed = keep * self.observed + observed

    @property
    def ratio(self) -> float:
        return self.ratio_toward(1.0)

    def ratio_toward(self, prior: float) -> float:
        """Observed over predicted, the pseudo-node (``_PRIOR`` of a node) at ratio ``prior``."""
        return (self.observed + _PRIOR * prior) / (self.predicted + _PRIOR)


def probe_cap(probe_every: int, probe_max: int | None) -> int:
    """The longest interval between two probes: ``probe_max`` (at least ``probe_every``; ``AdaptivePolicy.cap``)."""
    return max(probe_every, probe_max or 0)


def catch_up_rows(block: int, probe_every: int, probe_max: int | None) -> int:
    """The draft context positions a proposal after AR steps recomputes at most (``AdaptivePolicy.catch_up_rows``):
    the last tree step's commits (at most ``block``) and the AR steps' since (at most the cap less one)."""
    return block + probe_cap(probe_every, probe_max) - 1


@dataclass
class AdaptivePolicy:
    """One generation's choices: ``choose`` when a step is launched, ``observe`` (or ``record``) when it
    is read."""

    budgets: tuple[int, ...]
    costs: StepCosts
    depth: int
    probe_every: int
    # one per budget, of its shell (the nodes it adds to the next smaller budget's tree): a draft's
    # over-confidence depends on the node's place in the tree
    calibrations: list[Calibration]
    probe_max: int | None = None  # the probes' interval's cap (None: ``probe_every``, no back-off)
    margin: float = 0.0  # ``EngineConfig.switch_margin``
    previews: bool = False  # ``EngineConfig.policy_preview``: the loops read the first proposal (``preview``)
    accepts: list[float] | None = None  # the last tree step's estimate per budget (None: none yet)
    ar_streak: int = 0
    interval: int = 0  # the steps from one probe to the next now (0: ``probe_every``; ``choose``)

    @classmethod
    def for_config(cls, cfg: EngineConfig, depth: int, costs: StepCosts) -> AdaptivePolicy:
        budgets = policy_budgets(cfg.budget, cfg.policy_levels)
        costs.check(budgets)
        return cls(budgets, costs, depth, cfg.probe_every, [Calibration(cfg.calibration_window) for _ in budgets],
                   cfg.probe_max, cfg.switch_margin, previews=cfg.policy_preview)

    @property
    def cap(self) -> int:
        """The longest interval between two probes: ``probe_max`` (at least ``probe_every``)."""
        return probe_cap(self.probe_every, self.probe_max)

    @property
    def max_ar_run(self) -> int:
        """The most AR steps ``choose`` returns in a row while a tree budget has a finite cost (with
        none, it never proposes): the interval between probes reaches ``cap`` at most."""
        return self.cap - 1

    def catch_up_rows(self, block: int) -> int:
        """The draft context positions the first proposal after AR steps recomputes: the last tree
        step's commits (at most ``block``) and the AR steps' since (at most ``max_ar_run``)."""
        return catch_up_rows(block, self.probe_every, self.probe_max)

    def choose(self) -> tuple[int, float]:
        """The next step's budget and the E[AL] it was chosen by (1 for an AR step)."""
        # Before any tree step read back (a generation's first steps: two on the runtime, which reads a
        # step after launching the next) and without a ``preview`` there is no estimate: the configured
        # tree, the largest finite budget, as a fixed policy would run it. (Every node assumed accepted
        # instead ties every budget of at least the depth, and the tie went to the cheapest: budget 24 on
        # the steps where the draft accepts most, the opening of a generation, AL 6.0 observed against
        # the largest tree's.)
        if self.accepts is None:
            tree = [c for c in self.budgets if c > 0 and math.isfinite(self.costs.ms[c])]
            if tree:
                self.ar_streak, self.interval = 0, self.probe_every
                return tree[-1], 1.0 + min(tree[-1], self.depth)
        accepts = self.calibrated(self.accepts) if self.accepts is not None else [0.0] * len(self.budgets)
        ratios = [1.0] * len(self.budgets)  # (calibrated already)
        b, al = choose_budget(self.budgets, accepts, ratios, self.costs, self.depth, self.margin)
        if b > 0:  # a tree chosen on its own merit: the draft is worth its cost, probes start over
            self.interval = self.probe_every
        else:
            self.interval = self.interval or self.probe_every
            self.ar_streak += 1
            tree = [i for i, c in enumerate(self.budgets) if c > 0 and math.isfinite(self.costs.ms[c])]
            if self.ar_streak >= self.interval and tree:  # a probe: the best tree, to estimate again
                b, al = choose_budget([self.budgets[i] for i in tree], [accepts[i] for i in tree],
                                      [ratios[i] for i in tree], self.costs, self.depth)
                # A probe that fails costs a tree step for AL 1: while they keep failing (the choice
                # stays 0 after it) they come half as often, up to ``cap``; a tree chosen again resets it.
                self.interval = min(2 * self.interval, self.cap)
        if b > 0:
            self.ar_streak = 0
        return b, al

    @property
    def wants_preview(self) -> bool:
        """Whether a loop should read this generation's next proposal before choosing its budget
        (``preview``): the policy previews, has no estimate yet, and some tree budget has a finite cost
        (where only AR steps can be chosen the proposal would be wasted)."""
        return (self.previews and self.accepts is None
                and any(b > 0 and math.isfinite(self.costs.ms[b]) for b in self.budgets))

    def preview(self, probs: Sequence[int]) -> None:
        """The generation's first proposal, read before its step is chosen: its ``path_probabilities`` of
        nodes 1..N become the estimate (the calibrations at their priors: nothing observed yet), where
        ``choose`` would otherwise run the configured tree blind until a tree step is read back (two
        steps on the runtime). At the 27B shape with a draft the target accepts 13 tokens a step, a
        64-token generation is ~5 steps: its two blind steps at budget 64, where 32 was 1.2x faster a
        step, held the policy at 0.92x the best fixed budget (H100, 2026-12-05). Once per generation:
        the loops read a proposal early only while ``accepts`` is None."""
        if self.accepts is None:
            self.accepts = expected_accepts(probs, self.budgets)

    def calibrated(self, accepts: Sequence[float]) -> list[float]:
        """E[accepted](b) per budget, each shell's estimate (E[accepted] of its budget less the next
        smaller one's) scaled by its own ratio. A larger tree contains the smaller one, so it never
        comes out below it (one ratio per whole tree let the smaller tree's estimate pass the larger's:
        a budget-24 step chosen at E[AL] 4.5 accepted 3.3, ``benchmarks/policy_sim.py``). A shell
        seldom verified (the outer ones, a node's worth of mass in a few steps) takes its prior from
        the shell inside it, not from the draft as it is: a draft found wrong on its first nodes is
        not trusted on the nodes behind them."""
        out, total, below, inner = [], 0.0, 0.0, 1.0
        for i, (a, cal) in enumerate(zip(accepts, self.calibrations, strict=True)):
            ratio = cal.ratio_toward(inner)
            if i > 0:  # (budget 0's shell is empty: it passes the prior 1 on to the first tree's)
                inner = ratio
            total += ratio * max(a - below, 0.0)
            below = a
            out.append(total)
        return out

    def observe(self, budget: int, probs: Sequence[int], path: Sequence[int]) -> None:
        """A tree step read back: its budget, its proposal's ``path_probabilities`` of nodes 1..N and
        the accepted node indices after the root (``record`` of their estimate and acceptance)."""
        self.record(budget, expected_accepts(probs, self.budgets), accepted_within(path, self.budgets))

    def record(self, budget: int, accepts: Sequence[float], observed: Sequence[int]) -> None:
        """A tree step's estimate (E[accepted] per budget) and the accepted nodes within each budget's
        tree. Every budget up to the step's own is calibrated: their trees were inside the one
        verified. An AR step (budget 0) teaches nothing and is not recorded."""
        if budget == 0:
            return
        self.accepts = list(accepts)
        below = (0.0, 0)
        for cal, b, predicted, seen in zip(self.calibrations, self.budgets, self.accepts, observed, strict=True):
            if 0 < b <= budget:  # the shell's nodes: those of b's tree less those of the smaller one's
                cal.update(predicted - below[0], seen - below[1])
            below = (predicted, seen)
