"""What a generation and a bench pass measure: plain records, JSON-friendly."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PHASES = ("draft", "topk", "tree", "verify", "walk", "commit")


@dataclass
class GenerationStats:
    """One generation. Times in seconds unless the name says ms."""

    new_tokens: int = 0
    steps: int = 0  # speculative steps (AR: decode steps)
    accept_lengths: list[int] = field(default_factory=list)
    phase_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    bonus_tokens: int = 0  # steps whose whole drafted path was accepted (target token after it)
    correction_tokens: int = 0  # steps that ended on a mismatch
    side_branch_steps: int = 0  # steps whose accepted path used a draft token below rank 0
    grammar_ms: float = 0.0  # host time in grammar calls (masks, advances, rollbacks), also inside phase_ms
    # Which loop decoded: "generic" (engine.decoding.decode), "runtime" (the runtime's steps, eager) or "graphs"
    # (the runtime's steps as CUDA graphs). A config asks for a draft path; this is what ran.
    loop: str = "generic"
    prefill_s: float = 0.0
    cached_tokens: int = 0  # prompt tokens reused from a prefix cache (engine.decoding.prefix_cache), not prefilled
    decode_s: float = 0.0  # first emitted token -> last emitted token
    # start -> last emitted token, and with a prefix cache its commit (``commit_s``: a server pays it
    # before the next request)
    total_s: float = 0.0
    commit_s: float = 0.0  # the prefix cache's commit of the prompt and output (0: no cache)
    # The adaptive step policy (engine.decoding.policy; empty under the fixed one): per step, the budget
    # it ran (0: a plain AR step), and per tree step the calibrated E[AL] it was chosen by.
    step_budgets: list[int] = field(default_factory=list)
    predicted_al: list[float] = field(default_factory=list)

    def record_budget(self, budget: int, predicted_al: float) -> None:
        """The adaptive policy's step: its budget and (a tree step) the E[AL] it expected."""
        self.step_budgets.append(budget)
        if budget > 0:
            self.predicted_al.append(predicted_al)

    def record_step(self, al: int, leaf: bool, side: bool) -> None:
        """One speculative step: AL committed tokens; ``leaf``: the whole drafted path was accepted
        (the last token is a bonus); ``side``: the accepted path used a draft token below rank 0."""
        self.steps += 1
        self.accept_lengths.append(al)
        self.side_branch_steps += side
        if leaf:
            self.bonus_tokens += 1
        else:
            self.correction_tokens += 1

    @property
    def acceptance_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 1.0

    @property
    def decode_tps(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 and self.new_tokens > 1 else 0.0

    @property
    def e2e_tps(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def step_ms(self) -> float:
        return 1000.0 * self.decode_s / self.steps if self.steps else 0.0

    def phase_ms_per_step(self) -> dict[str, float]:
        return {k: (v / self.steps if self.steps else 0.0) for k, v in self.phase_ms.items()}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            acceptance_length=self.acceptance_length,
            decode_tps=self.decode_tps,
            e2e_tps=self.e2e_tps,
            step_ms=self.step_ms,
            phase_ms_per_step=self.phase_ms_per_step(),
            al_histogram=dict(sorted(Counter(self.accept_lengths).items())),
            **policy_summary(self.step_budgets, self.predicted_al, self.accept_lengths),
        )
        return d


def policy_summary(step_budgets: Sequence[int], predicted_al: Sequence[float],
                   accept_lengths: Sequence[int]) -> dict[str, Any]:
    """The adaptive policy's record in brief: steps per budget (0: AR steps), and over its tree steps
    the mean E[AL] it chose by against the mean AL observed (None without tree steps)."""
    # (under the fixed policy no step has a budget recorded: nothing to pair)
    paired = len(step_budgets) == len(accept_lengths)
    observed = [al for b, al in zip(step_budgets, accept_lengths, strict=True) if b > 0] if paired else []
    return {
        "budget_histogram": dict(sorted(Counter(step_budgets).items())),
        "policy_predicted_al": sum(predicted_al) / len(predicted_al) if predicted_al else None,
        "policy_observed_al": sum(observed) / len(observed) if observed else None,
    }


@dataclass
class Generation:
    tokens: list[int]
    stats: GenerationStats
    text: str | None = None
    # With ``record_margins``: per new token i, the target's logits row that picked it (the prefill's
    # last row for token 0), in float32: its top logit and its margin top1 - top2. A grammar's masked
    # row where it picked the token: every row under AR and ``walk``; under ``commit`` the prefill's
    # and a cut token's (a token the grammar accepted was picked by the unmasked verify row). At
    # temperature > 0 the pick is a Gumbel-max draw: these are the logits' margins, not the draw's.
    top_logits: list[float] | None = None
    margins: list[float] | None = None


# Divergence forensics: why a speculative output left AR's tokens (engine.api.diagnose).
TIE_ULPS = 4
VERDICTS = ("numeric tie", "mismatch")
# (explicit mantissa bits, smallest normal exponent) of the dtypes a target runs in
_FLOAT_FORMATS = {"float32": (23, -126), "bfloat16": (7, -126), "float16": (10, -14)}


def first_divergence(out: Sequence[int], want: Sequence[int]) -> int | None:
    """First position where two token lists differ (a length difference counts), or None."""
    for i, (a, b) in enumerate(zip(out, want, strict=False)):
        if a != b:
            return i
    return None if len(out) == len(want) else min(len(out), len(want))


def ulp(dtype: object, magnitude: float) -> float:
    """One unit in the last place of ``dtype`` (a torch dtype or its name) at ``magnitude``:
    2**(floor(log2 |m|) - mantissa bits), the subnormal spacing below the smallest normal; NaN for
    a non-finite magnitude."""
    name = str(dtype).removeprefix("torch.")
    if name not in _FLOAT_FORMATS:
        raise ValueError(f"ulp: dtype must be one of {sorted(_FLOAT_FORMATS)}, but got {name!r}")
    bits, emin = _FLOAT_FORMATS[name]
    m = abs(magnitude)
    if not math.isfinite(m):
        return math.nan
    exponent = math.frexp(m)[1] - 1 if m > 0 else emin  # m = f * 2**e with 0.5 <= f < 1: floor(log2 m) = e - 1
    return math.ldexp(1.0, max(exponent, emin) - bits)


def tie_bound(dtype: object, top_logit: float) -> float:
    """The widest top-2 margin still called a numeric tie: ``TIE_ULPS`` (4) units in the last place
    of the model's dtype at the top logit's magnitude.

    Two exact-in-math runs that compute a logits row in another order (a verify's rows against an
    AR step's, another loop or kernel) differ by rounding: a logit is stored to the dtype's
    precision, and the final norm and projection add a few roundings more, so a pair of logits
    closer than a few units in the last place can swap places between the runs. A wider margin
    at the first divergence is not explained by rounding: a "mismatch" (a bug until shown otherwise)."""
    return TIE_ULPS * ulp(dtype, top_logit)


@dataclass(frozen=True)
class Divergence:
    """The first position where a run's output left the AR output, and why.

    ``ar_margin`` / ``run_margin``: top1 - top2 (float32) of the logits row that picked the token at
    ``position`` in the AR run and in the run (``None``: that run has no token there, a length
    difference). ``verdict``: "numeric tie" when the smaller margin is within ``tie_bound``
    (``tie_bound()`` at the larger top logit of the two rows), else "mismatch". ``reproduced``:
    the re-runs the margins come from gave the compared tokens again up to ``position`` (False: the
    outputs compared were not what the engine decodes now, e.g. a rewritten reference)."""

    position: int
    ar_margin: float | None
    run_margin: float | None
    tie_bound: float
    verdict: str
    reproduced: bool = True

    @classmethod
    def judge(cls, position: int, ar: tuple[float, float] | None, run: tuple[float, float] | None,
              dtype: object, reproduced: bool = True) -> Divergence:
        """``ar`` / ``run``: (top logit, margin) of each run's row at ``position``, or None."""
        rows = [r for r in (ar, run) if r is not None]
        bound = tie_bound(dtype, max((abs(top) for top, _ in rows), default=0.0))
        tie = ar is not None and run is not None and min(ar[1], run[1]) <= bound
        return cls(position, ar[1] if ar else None, run[1] if run else None, bound,
                   VERDICTS[0] if tie else VERDICTS[1], reproduced)

    def describe(self) -> str:
        """One line: ``div 70: numeric tie 0/0.125`` (AR's margin / the run's, 3 significant digits)."""
        note = "" if self.reproduced else " (not reproduced)"
        return (f"div {self.position}: {self.verdict} {_margin_text(self.ar_margin)}/"
                f"{_margin_text(self.run_margin)}{note}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _margin_text(margin: float | None) -> str:
    return "-" if margin is None else f"{margin:.3g}"


@dataclass
class PromptResult:
    index: int
    prompt_tokens: int
    new_tokens: int
    decode_s: float
    total_s: float
    decode_tps: float
    acceptance_length: float
    steps: int
    exact: bool | None  # equal to the AR output token for token (None: not checked)
    first_divergence: int | None  # first differing position among new tokens
    divergence: Divergence | None = None  # why it differs (re-run with margins, outside the measured time)
    cached_tokens: int = 0  # prompt tokens a prefix cache gave (``bench(..., prefix_cache=...)``), not prefilled
    ttft_s: float = 0.0  # time to first token: the prefill (of what was not cached) and the first token
    commit_s: float = 0.0  # the prefix cache's commit after the last token (inside total_s; 0: no cache)


@dataclass
class SessionReplay:
    """Sessions replayed turn by turn (``engine.api.replay_sessions``): each turn's request, encoded
    (the conversation so far, earlier replies included), in order, and what the config answered."""

    prompts: list[list[int]] = field(default_factory=list)  # session after session, turn after turn
    outputs: list[list[int]] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)  # each output as a server returns it (no stop token)
    session_of: list[int] = field(default_factory=list)  # each turn's session (an index into those given)
    cut: dict[int, str] = field(default_factory=dict)  # sessions that ended before their last turn, and why


@dataclass
class BenchResult:
    """One pass of one config over a prompt set (caches reset between generations)."""

    config: dict[str, Any]
    prompts: list[PromptResult]
    outputs: list[list[int]]
    new_tokens: int
    decode_s: float
    total_s: float
    steps: int
    accept_lengths: list[int]
    phase_ms: dict[str, float]
    bonus_tokens: int
    correction_tokens: int
    side_branch_steps: int
    peak_memory_bytes: int
    device: str
    grammar_ms: float = 0.0  # grammar host time (inside phase_ms: walk / commit / AR verify)
    constrained: int = 0  # prompts decoded under a grammar
    loops: dict[str, int] = field(default_factory=dict)  # prompts per decode loop that ran (GenerationStats.loop)
    step_budgets: list[int] = field(default_factory=list)  # the adaptive policy's, as GenerationStats'
    predicted_al: list[float] = field(default_factory=list)
    # the most bytes the prefix cache (``bench(..., prefix_cache=...)``) held after a generation of the
    # pass (0: none): its share of peak_memory_bytes (``engine.measure_memory``'s ``prefix_cache_held``)
    prefix_cache_bytes: int = 0

    @property
    def decode_tps(self) -> float:
        """Sum over prompts of (tokens - 1) over the sum of decode-only seconds."""
        n = sum(max(p.new_tokens - 1, 0) for p in self.prompts)
        return n / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def e2e_tps(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def acceptance_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 1.0

    @property
    def al_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.accept_lengths).items()))

    @property
    def step_ms(self) -> float:
        return 1000.0 * self.decode_s / self.steps if self.steps else 0.0

    @property
    def phase_ms_per_step(self) -> dict[str, float]:
        return {k: (v / self.steps if self.steps else 0.0) for k, v in self.phase_ms.items()}

    @property
    def grammar_ms_per_step(self) -> float:
        return self.grammar_ms / self.steps if self.steps else 0.0

    @property
    def exact_match(self) -> float | None:
        checked = [p.exact for p in self.prompts if p.exact is not None]
        return sum(checked) / len(checked) if checked else None

    @property
    def median_prompt_tps(self) -> float:
        return statistics.median(p.decode_tps for p in self.prompts) if self.prompts else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "decode_tps": self.decode_tps,
            "e2e_tps": self.e2e_tps,
            "acceptance_length": self.acceptance_length,
            "al_histogram": self.al_histogram,
            "steps": self.steps,
            "step_ms": self.step_ms,
            "phase_ms_per_step": self.phase_ms_per_step,
            "bonus_tokens": self.bonus_tokens,
            "correction_tokens": self.correction_tokens,
            "side_branch_steps": self.side_branch_steps,
            "grammar_ms_per_step": self.grammar_ms_per_step,
            "constrained": self.constrained,
            "loops": self.loops,
            **policy_summary(self.step_budgets, self.predicted_al, self.accept_lengths),
            "exact_match": self.exact_match,
            "new_tokens": self.new_tokens,
            "peak_memory_bytes": self.peak_memory_bytes,
            "device": self.device,
        }

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(self.summary())
        return d
