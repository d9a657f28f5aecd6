"""What a generation and a bench pass measure: plain records, JSON-friendly."""

from __future__ import annotations

import statistics
from collections import Counter
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
    # Which loop decoded: "generic" (engine.decode), "static" (the runtime's steps, eager) or "graphs"
    # (the runtime's steps as CUDA graphs). A config asks for a draft path; this is what ran.
    loop: str = "generic"
    prefill_s: float = 0.0
    decode_s: float = 0.0  # first emitted token -> last emitted token
    total_s: float = 0.0

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
        )
        return d


@dataclass
class Generation:
    tokens: list[int]
    stats: GenerationStats
    text: str | None = None


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
            "exact_match": self.exact_match,
            "new_tokens": self.new_tokens,
            "peak_memory_bytes": self.peak_memory_bytes,
            "device": self.device,
        }

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(self.summary())
        return d
