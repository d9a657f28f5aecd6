"""EngineConfig: every tunable of one decoding setup, validated once at the edge."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

VERIFY_MODES = ("ar", "chain", "ddtree")
ROLLBACK_MODES = ("replay", "fast")
DRAFT_PATHS = ("auto", "generic", "runtime")
GRAMMAR_MODES = ("off", "walk", "commit")
KERNEL_MODES = ("fused", "eager")
POLICIES = ("fixed", "adaptive")
# How a target's GGUF weights are held (engine.load(..., weights=), EngineConfig.weights): every tensor
# dequantized into the model's dtype, or the quantized projections kept in their blocks
WEIGHTS = ("dequantized", "native")
# Upper bounds: what one step can run. A verify's budget + 1 rows stay within the few-row linear
# kernel's reach (engine.models.linear.MAX_ROWS = 1024); the rest bound what no draft or search
# space needs, so that a typo (1e30) is refused here rather than failing every trial allocating.
MAX_BUDGET = 1023
MAX_TOP_K = 256
MAX_BLOCK_SIZE = 256
MAX_CHAIN_SEED = 1024
MAX_TARGET_FEAT_CTX = 1 << 20
MAX_SEED = 2**63 - 1
MAX_POLICY_LEVELS = 10  # budget / 2**9: below 2 nodes for every budget MAX_BUDGET allows
MAX_PROBE_EVERY = 1024  # also probe_max's bound: the catch-up proposal's block + probe_max - 1 context rows
MAX_CALIBRATION_WINDOW = 1 << 16
MAX_SWITCH_MARGIN = 10.0  # 10x: the configured tree always (a fixed policy with AR's fallback off)


class EngineInputError(ValueError):
    """A user-facing input (config value, model spec, prompt) is wrong; the message says which and why."""


@dataclass(frozen=True)
class EngineConfig:
    """One decoding setup.

    verify: ``ar`` (plain decoding), ``chain`` (DFlash block verified as a chain) or ``ddtree``.
    budget: non-root tree nodes verified per step (ddtree).
    top_k: tokens kept per draft depth (ddtree).
    proposal_temp: temperature applied to the draft's log-probs before top-k / tree scoring.
    chain_seed: depths of the top-1 chain inserted before best-first fills the rest;
        ``None`` means the whole chain (block_size - 1), 0 pure best-first.
    target_feat_ctx: the draft attends to this many most recent committed positions; 0 = all.
    rollback: how recurrent (Gated DeltaNet / conv) state is rebuilt after a step: ``replay``
        re-runs the committed tokens, ``fast`` keeps per-node states; dense targets ignore it.
    draft_path: the decode loop. ``runtime``: device buffers, device top-k / tree / walk, one host
        read per step, each step captured as CUDA graphs on CUDA and run eagerly elsewhere; a
        config it cannot run is refused with the reason (``engine.decoding.runtime.refusal``: a draft that
        proposes on the host, ``grammar="walk"`` on a prompt with a grammar, ``rollback="replay"``
        on a hybrid target). ``generic``: logits to the host, host top-k and tree. ``auto`` (the
        default): ``runtime`` where it can run with CUDA graphs, else ``generic``; the loop that
        ran is in ``GenerationStats.loop``.
    block_size: draft block length; ``None`` uses the draft checkpoint's own.
    temperature: 0 = greedy; > 0 samples (every committed token is a target sample).
    seed: sampling seed (position-keyed, so AR and speculative sampling agree token for token).
    grammar: where a prompt's grammar (its tool-call grammar, engine/decoding/grammar.py) constrains the output:
        ``off`` decodes unconstrained (a grammar given to ``generate`` is ignored); ``walk`` masks the
        target's logits at every tree node during the posterior walk; ``commit`` walks unconstrained
        and advances the grammar on committed tokens only, cutting the step at the first token the
        grammar refuses and committing the masked target token there. Both equal grammar-constrained
        AR (``verify="ar"`` with grammar ``walk`` or ``commit``: the logits masked at every step).
        A prompt without a grammar (no tools) is decoded unconstrained under any setting.
    kernels: ``fused`` runs the Triton kernels on CUDA (the tree delta rule, RMSNorm, RoPE, SiLU-mul,
        small-query attention, Gated DeltaNet inputs: one launch where eager PyTorch takes several);
        ``eager`` the PyTorch forms. On a CPU both are eager. Either is exact against AR.
    policy (ddtree): the step policy. ``fixed`` verifies a tree of ``budget`` nodes every step;
        ``adaptive`` (``engine.decoding.policy``) chooses each step's budget among
        ``policy_budgets(budget, policy_levels)`` and 0 (a plain AR step: the root alone, no draft),
        maximising expected committed tokens per millisecond from the draft's own path
        probabilities, calibrated online against the acceptance observed, and the measured step
        cost at each budget. Either is exact: the policy changes only what is proposed.
    policy_levels (adaptive): tree budgets to choose from, halving from ``budget``
        (4 at budget 64: 64, 32, 16, 8), besides 0.
    probe_every (adaptive): while the policy holds at AR steps (which run no draft), every
        ``probe_every``-th step proposes and verifies a tree anyway, so the estimate can move again.
    probe_max (adaptive): while probes keep failing (the choice after one is 0 again), the interval
        between them doubles from ``probe_every`` up to ``probe_max``; a tree the policy chooses on
        its own resets it. The cap is ``max(probe_every, probe_max)`` (at or below ``probe_every``:
        no back-off). The first proposal after AR steps recomputes ``block_size + cap - 1`` positions
        of the draft's context (a fixed window: one captured graph), once per probe.
    calibration_window (adaptive): steps the calibration of the draft's probabilities remembers
        (an exponential decay of 1 - 1/window on the observed and predicted sums).
    weights: the target's weights this config decodes with (``WEIGHTS``): a pair holds one form
        (``engine.load(..., weights=)``), and ``Pair.refusal`` refuses a config that names the other;
        ``None`` (the default): as the pair holds them. A sweep searching it measures each config on a
        pair loaded that way, exact against AR with the same weights; an export puts it in ``model``.
    switch_margin (adaptive): another budget (a smaller tree, or 0: an AR step) replaces the
        configured tree only when its expected rate beats the tree's by this fraction (0.1: 10%). The
        estimates are noisy and the argmax of noisy rates leaves the tree too often where its cost
        barely depends on the budget (``benchmarks/policy_sim.py``: 0.95-0.99 of fixed DDTree-48 at
        0, 1.00 at 0.1 on the SmolLM2 pair); a draft that fails is still left for AR, which then
        wins by ~35% there.
    policy_preview (adaptive): read a generation's first proposal before choosing its budget
        (``AdaptivePolicy.preview``: one host synchronisation a generation) instead of running the
        configured tree until a tree step is read back (two blind steps on the runtime). Short
        generations of a draft the target accepts far into the tree gain most (the 27B shape, AL 13:
        0.92x -> 0.996x of fixed budget 32); the synchronisation's cost, where the choice is the
        configured tree anyway, is what ``false`` saves.
    """

    verify: str = "ddtree"
    budget: int = 22
    top_k: int = 8
    proposal_temp: float = 1.0
    chain_seed: int | None = None
    target_feat_ctx: int = 0
    rollback: str = "fast"
    draft_path: str = "auto"
    block_size: int | None = None
    temperature: float = 0.0
    seed: int = 0
    grammar: str = "off"
    kernels: str = "fused"
    policy: str = "fixed"
    policy_levels: int = 4
    probe_every: int = 8
    # 64: a failed probe costs ~0.3 ms more than an AR step on the H200's SmolLM2 pair (a tree step
    # 1.22-1.29 ms, AR 0.945), 1/64 of that per token is 0.5% of AR's speed (every 8th step: 4%); the
    # catch-up window's 79 rows (block 16) are a few small GEMMs more, once per probe; a draft that
    # turns good again waits at most 63 AR steps to be noticed.
    probe_max: int = 64
    calibration_window: int = 16
    switch_margin: float = 0.1
    policy_preview: bool = True
    weights: str | None = None

    def __post_init__(self) -> None:
        if self.weights is not None:
            _choice("weights", self.weights, WEIGHTS)
        _choice("verify", self.verify, VERIFY_MODES)
        _choice("rollback", self.rollback, ROLLBACK_MODES)
        _choice("draft_path", self.draft_path, DRAFT_PATHS)
        _choice("grammar", self.grammar, GRAMMAR_MODES)
        _choice("kernels", self.kernels, KERNEL_MODES)
        _choice("policy", self.policy, POLICIES)
        _int_at_least("policy_levels", self.policy_levels, 1, MAX_POLICY_LEVELS)
        _int_at_least("probe_every", self.probe_every, 2, MAX_PROBE_EVERY)
        # (no rule against probe_every: the cap is the larger of the two, so a config written before
        # probe_max existed, with probe_every above its default, keeps meaning what it meant)
        _int_at_least("probe_max", self.probe_max, 2, MAX_PROBE_EVERY)
        _int_at_least("calibration_window", self.calibration_window, 1, MAX_CALIBRATION_WINDOW)
        _float_in("switch_margin", self.switch_margin, low=0.0, low_open=False)
        if not isinstance(self.policy_preview, bool):
            raise EngineInputError(f"EngineConfig.policy_preview must be true or false, "
                                   f"but got {self.policy_preview!r}")
        if self.switch_margin > MAX_SWITCH_MARGIN:
            raise EngineInputError(f"EngineConfig.switch_margin must be <= {MAX_SWITCH_MARGIN} (a fraction of the "
                                   f"tree's rate), but got {self.switch_margin}")
        _int_at_least("budget", self.budget, 1, MAX_BUDGET)
        _int_at_least("top_k", self.top_k, 1, MAX_TOP_K)
        _int_at_least("target_feat_ctx", self.target_feat_ctx, 0, MAX_TARGET_FEAT_CTX)
        _int_at_least("seed", self.seed, 0, MAX_SEED)
        if self.chain_seed is not None:
            _int_at_least("chain_seed", self.chain_seed, 0, MAX_CHAIN_SEED)
        if self.block_size is not None:
            _int_at_least("block_size", self.block_size, 2, MAX_BLOCK_SIZE)
        _float_in("proposal_temp", self.proposal_temp, low=0.0, low_open=True)
        _float_in("temperature", self.temperature, low=0.0, low_open=False)

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, source: str = "config") -> EngineConfig:
        """Build from a mapping (YAML, JSON, CLI), refusing unknown keys with their names."""
        if not isinstance(values, dict):
            raise EngineInputError(f"{source}: expected a mapping of EngineConfig fields, got {values!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise EngineInputError(
                f"{source}: unknown EngineConfig field(s) {unknown}; known fields are {sorted(known)}"
            )
        try:
            return cls(**values)
        except EngineInputError as exc:
            raise EngineInputError(f"{source}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def applicable(self) -> dict[str, Any]:
        """The fields that change what this config decodes, by ``verify``: AR has no draft (no
        tree, block or rollback of rejected tokens), a chain takes the draft's top-1 (no top-k,
        budget, proposal temperature or chain seed), and the step policy applies to DDTree only, its
        knobs to the adaptive policy only. What exports, reports and tracking show, so an AR winner
        is not read as tuned at a budget; ``from_dict`` of it builds the same config."""
        skip = _NOT_APPLICABLE[self.verify]
        if self.verify == "ddtree" and self.policy == "fixed":
            skip = skip | _ADAPTIVE_ONLY
        if self.weights is None:  # as the pair holds them: nothing to say
            skip = skip | {"weights"}
        return {k: v for k, v in self.to_dict().items() if k not in skip}

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


_ADAPTIVE_ONLY = frozenset({"policy_levels", "probe_every", "probe_max", "calibration_window", "switch_margin",
                            "policy_preview"})
_TREE_ONLY = frozenset({"budget", "top_k", "proposal_temp", "chain_seed", "policy"}) | _ADAPTIVE_ONLY
_NOT_APPLICABLE = {"ddtree": frozenset(), "chain": _TREE_ONLY,
                   "ar": _TREE_ONLY | {"target_feat_ctx", "rollback", "block_size"}}


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise EngineInputError(f"EngineConfig.{name} must be one of {list(choices)}, but got {value!r}")


def _int_at_least(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise EngineInputError(f"EngineConfig.{name} must be an integer, but got {str(value)[:100]!r}")
    if value < low:
        raise EngineInputError(f"EngineConfig.{name} must be >= {low}, but got {value}")
    if value > high:
        raise EngineInputError(f"EngineConfig.{name} must be <= {high:,}, but got {value:.3g}")


def _float_in(name: str, value: object, *, low: float, low_open: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EngineInputError(f"EngineConfig.{name} must be a number, but got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise EngineInputError(f"EngineConfig.{name} must be finite, but got {value}")
    if (value <= low) if low_open else (value < low):
        op = ">" if low_open else ">="
        raise EngineInputError(f"EngineConfig.{name} must be {op} {low}, but got {value}")
