"""Only dimensions that matter: a search dimension whose value cannot change what this target, this
workload or this device decode, or how fast, is fixed instead of searched.

Searching it would cost trials (TPE learns nothing from it) and, worse, confirmations: two configs
that differ only there tie, and the tie is measured again. Each rule names the engine's reason:

- ``rollback`` on a dense target: rollback rebuilds recurrent (Gated DeltaNet, conv) state after a
  step; a dense target has none (``EngineConfig.rollback``: dense targets ignore it);
- ``grammar`` when no prompt of the workload has tools: a prompt without a grammar decodes
  unconstrained under any placement (``EngineConfig.grammar``);
- ``kernels`` off CUDA: the Triton kernels run on CUDA only; elsewhere ``fused`` and ``eager`` run
  the same PyTorch forms (``engine.Pair.decode_paths``);
- ``weights`` where a native load would keep no weight in its quantized blocks (no projection, no untied
  embedding: a GGUF whose tensors are floats, or of types with no native form, ``Pair.weight_summary``'s
  ``native_projections``, which counts both): both forms hold the same float weights and decode the same program. It is
  fixed at the form the workers loaded (``model.weights``), so no second pair is loaded.

The decision needs the loaded pair (the target's kind), the prompts (their tools) and the device,
so the driver makes it after the workers load (:func:`facts_from`) and before the study is opened;
the fixed dimensions and why are the study's ``fixed_dimensions`` attribute, the summary's line and
the report's "Search space" section.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from autotune.space import SearchSpace


@dataclass(frozen=True)
class Facts:
    """What the loaded workers say about the target, the workload and the device (None: unknown,
    and then no rule fires on it)."""

    recurrent_state: bool | None = None  # the target carries recurrent state (a hybrid)
    tools: bool | None = None  # a prompt of the workload has tools (so a tool-call grammar)
    device: str | None = None  # "cpu", "cuda:0", ...
    # how many projections a native load of the target holds in their blocks (0: none, the two forms
    # are one), and the form the workers loaded (engine.WEIGHTS): what a fixed `weights` takes
    native_projections: int | None = None
    weights_loaded: str | None = None


@dataclass(frozen=True)
class FixedDimension:
    name: str
    value: Any
    why: str

    def describe(self) -> str:
        return f"{self.name}={self.value} ({self.why})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# (dimension, does its value not matter here?, why), in the order the summary lists them
RULES: tuple[tuple[str, Callable[[Facts], bool], str], ...] = (
    ("rollback", lambda f: f.recurrent_state is False, "dense target: no recurrent state to roll back"),
    ("grammar", lambda f: f.tools is False,
     "no prompt of the workload has tools: every prompt decodes unconstrained under any placement"),
    ("kernels", lambda f: f.device is not None and not f.device.startswith("cuda"),
     "no CUDA: the Triton kernels do not run here, fused and eager are the same PyTorch code"),
    ("weights", lambda f: f.native_projections == 0,
     "no projection of the target would stay in its quantized blocks (its tensors are floats or of types with "
     "no native form): native and dequantized hold the same float weights and decode the same program"),
)


def facts_from(described: dict[str, Any]) -> Facts:
    """The facts in an executor's ``describe()`` (``Worker.limits`` and the device)."""
    device = described.get("device")
    weights = described.get("weights") or {}  # Worker.weights
    return Facts(recurrent_state=described.get("recurrent_state"), tools=described.get("tools"),
                 device=None if device is None else str(device), native_projections=weights.get("native_projections"),
                 weights_loaded=weights.get("mode"))


def irrelevant(space: SearchSpace, facts: Facts, fixed_engine: dict[str, Any]) -> tuple[FixedDimension, ...]:
    """The dimensions of ``space`` whose value cannot matter under ``facts``, each with the value it
    is fixed at: the experiment's fixed value (what the baseline decodes with) when the space lists
    it, else (``weights``) the form the workers loaded, else the engine's default when listed, else
    the space's first value."""
    from engine import EngineConfig

    defaults = EngineConfig().to_dict()
    by_name = {p.name: p for p in space.params}
    out = []
    for name, applies, why in RULES:
        param = by_name.get(name)
        if param is None or not applies(facts):
            continue
        values = list(param.choices) if param.type == "categorical" else [param.low]
        loaded = facts.weights_loaded if name == "weights" else None
        preferred = [v for v in (fixed_engine.get(name), loaded, defaults.get(name)) if v in values]
        out.append(FixedDimension(name, (preferred or values)[0], why))
    return tuple(out)


def describe(fixed: list[dict[str, Any]] | tuple[FixedDimension, ...]) -> str:
    """One line for the summary: ``rollback=fast (dense target: ...); kernels=fused (...)``."""
    items = [f if isinstance(f, FixedDimension) else FixedDimension(**f) for f in fixed]
    return "; ".join(f.describe() for f in items)
