"""Search-space YAML → validated, frozen parameters → define-by-run Optuna suggestions.

One entry per EngineConfig field to tune, in the order they are suggested:

    verify:  {type: categorical, choices: [chain, ddtree]}
    budget:  {type: int, low: 4, high: 64, log: true, when: {verify: ddtree}}

``when:`` makes a parameter conditional on earlier categorical parameters; an inactive parameter
is not suggested at all (so the sampler never learns from a value that had no effect) and the
engine's default applies.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from autotune.errors import InputError
from autotune.files import read_yaml_file

TYPES = ("categorical", "int", "float")
_KEYS = {
    "categorical": {"type", "choices", "when"},
    "int": {"type", "low", "high", "step", "log", "when"},
    "float": {"type", "low", "high", "step", "log", "when"},
}
# Sampling settings decide *what* is generated, not how fast: tuning them would make every
# trial's output differ from the AR reference, so they belong in the experiment's `engine:` block.
NOT_TUNABLE = ("temperature", "seed")
GRID_LIMIT = 10_000


@dataclass(frozen=True)
class Param:
    """One tunable EngineConfig field."""

    name: str
    type: str
    choices: tuple[Any, ...] = ()
    low: float | int | None = None
    high: float | int | None = None
    step: float | int | None = None
    log: bool = False
    when: tuple[tuple[str, tuple[Any, ...]], ...] = ()  # (earlier param, allowed values)

    def distribution(self) -> BaseDistribution:
        if self.type == "categorical":
            return CategoricalDistribution(list(self.choices))
        if self.type == "int":
            return IntDistribution(int(self.low), int(self.high), log=self.log, step=int(self.step or 1))
        return FloatDistribution(float(self.low), float(self.high), log=self.log, step=self.step)

    def grid_count(self) -> int | None:
        """How many values ``grid_values`` lists, counted without listing them (None: continuous)."""
        if self.type == "categorical":
            return len(self.choices)
        if self.type == "int":
            return (int(self.high) - int(self.low)) // int(self.step or 1) + 1
        if self.step is None:
            return None
        return int(round((self.high - self.low) / self.step)) + 1

    def grid_values(self) -> list[Any] | None:
        """Every value of this parameter, or None when it is continuous."""
        if self.type == "categorical":
            return list(self.choices)
        if self.type == "int":
            return list(range(int(self.low), int(self.high) + 1, int(self.step or 1)))
        if self.step is None:
            return None
        n = int(round((self.high - self.low) / self.step))
        return [round(self.low + i * self.step, 12) for i in range(n + 1)]


@dataclass(frozen=True)
class SearchSpace:
    path: Path
    params: tuple[Param, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def is_active(self, param: Param, values: dict[str, Any]) -> bool:
        return all(name in values and values[name] in allowed for name, allowed in param.when)

    def suggest(self, trial: optuna.trial.BaseTrial) -> dict[str, Any]:
        """Suggest the active parameters in file order; conditions see earlier suggestions."""
        values: dict[str, Any] = {}
        for p in self.params:
            if not self.is_active(p, values):
                continue
            if p.type == "categorical":
                values[p.name] = trial.suggest_categorical(p.name, list(p.choices))
            elif p.type == "int":
                values[p.name] = trial.suggest_int(
                    p.name, int(p.low), int(p.high), step=int(p.step or 1), log=p.log
                )
            else:
                values[p.name] = trial.suggest_float(
                    p.name, float(p.low), float(p.high), step=p.step, log=p.log
                )
        return values

    def fix(self, values: dict[str, Any]) -> SearchSpace:
        """This space with ``values`` fixed (``autotune.dimensions``): those parameters are no longer
        suggested; a parameter conditional on one of them is kept, without that condition, when the
        fixed value satisfies it, and dropped when it does not (it could never be active)."""
        params = []
        for p in self.params:
            if p.name in values:
                continue
            if any(ref in values and values[ref] not in allowed for ref, allowed in p.when):
                continue
            params.append(dataclasses.replace(p, when=tuple((r, a) for r, a in p.when if r not in values)))
        return SearchSpace(path=self.path, params=tuple(params))

    def grid(self) -> dict[str, list[Any]]:
        """The full grid for GridSampler; refuses continuous or oversized spaces."""
        size = 1
        for p in self.params:  # the size first, by arithmetic: a tiny step must not build a huge list
            count = p.grid_count()
            if count is None:
                raise InputError(
                    str(self.path), p.name,
                    "sampler `grid` needs every parameter to be categorical, int, or float with `step`",
                    {"type": p.type, "low": p.low, "high": p.high},
                )
            size *= count
            if size > GRID_LIMIT:
                raise InputError(
                    str(self.path), None,
                    f"sampler `grid` is for small spaces (at most {GRID_LIMIT} points; {p.name!r} alone or "
                    f"with the parameters before it already makes more); use tpe", size,
                )
        return {p.name: p.grid_values() for p in self.params}

    def grid_key(self, point: dict[str, Any]) -> tuple:
        """The config a grid point names: its active parameters only, in file order (a condition sees the
        parameters before it). Two points that differ only where a condition leaves a parameter inactive
        (``budget`` where ``verify`` is ``ar``) are one config."""
        active: dict[str, Any] = {}
        for p in self.params:
            if self.is_active(p, active):
                active[p.name] = point[p.name]
        return tuple(active.items())

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for p in self.params:
            d = {k: v for k, v in dataclasses.asdict(p).items() if k != "name" and v not in (None, (), False)}
            if p.when:
                d["when"] = {k: list(v) for k, v in p.when}
            if p.choices:
                d["choices"] = list(p.choices)
            out[p.name] = d
        return out

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True, default=str).encode()).hexdigest()


def load_space(path: Path) -> SearchSpace:
    """Read and validate a search-space file; every error names the file, key, rule and value."""
    where = str(path)
    if not path.is_file():
        raise InputError(where, None, "search-space file must exist", str(path))
    raw = read_yaml_file(path)
    if not isinstance(raw, dict) or not raw:
        raise InputError(where, None, "must be a non-empty mapping of parameter name -> spec", raw)
    params: list[Param] = []
    for name, spec in raw.items():
        params.append(_parse_param(where, str(name), spec, params))
    return SearchSpace(path=path, params=tuple(params))


def _parse_param(where: str, name: str, spec: Any, earlier: list[Param]) -> Param:
    fields = _engine_fields()
    if name not in fields:
        raise InputError(where, name, f"parameter must be an EngineConfig field, one of {sorted(fields)}", name)
    if name in NOT_TUNABLE:
        raise InputError(
            where, name,
            "sampling settings change the output, not the speed; set them under the experiment's `engine:`",
            name,
        )
    if not isinstance(spec, dict):
        raise InputError(where, name, "must be a mapping like {type: int, low: 1, high: 8}", spec)
    kind = spec.get("type")
    if kind not in TYPES:
        raise InputError(where, f"{name}.type", f"must be one of {list(TYPES)}", kind)
    unknown = sorted(set(spec) - _KEYS[kind])
    if unknown:
        raise InputError(where, f"{name}.{unknown[0]}", f"unknown key for a {kind} parameter; "
                         f"allowed keys are {sorted(_KEYS[kind])}", unknown[0])
    when = _parse_when(where, name, spec.get("when"), earlier)
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise InputError(where, f"{name}.choices", "must be a non-empty list", choices)
        if len({json.dumps(c, default=str) for c in choices}) != len(choices):
            raise InputError(where, f"{name}.choices", "must not repeat a value", choices)
        for c in choices:
            if not (c is None or isinstance(c, (str, int, float, bool))):
                raise InputError(where, f"{name}.choices", "values must be strings, numbers, booleans or null", c)
            _check_engine_value(where, f"{name}.choices", name, c)
        return Param(name=name, type=kind, choices=tuple(choices), when=when)
    return _parse_range(where, name, kind, spec, when)


def _parse_range(where: str, name: str, kind: str, spec: dict, when: tuple) -> Param:
    number = int if kind == "int" else (int, float)
    values = {}
    for key in ("low", "high", "step"):
        v = spec.get(key)
        if v is None and key != "step":
            raise InputError(where, f"{name}.{key}", f"is required for a {kind} parameter")
        if v is not None and (isinstance(v, bool) or not isinstance(v, number)):
            raise InputError(where, f"{name}.{key}", f"must be {'an integer' if kind == 'int' else 'a number'}", v)
        if v is not None and isinstance(v, float) and not math.isfinite(v):
            raise InputError(where, f"{name}.{key}", "must be finite", v)
        values[key] = v
    low, high, step = values["low"], values["high"], values["step"]
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise InputError(where, f"{name}.log", "must be true or false", log)
    if low > high:
        raise InputError(where, name, f"`low <= high` must hold, but got low={low}, high={high}")
    if step is not None and step <= 0:
        raise InputError(where, f"{name}.step", "must be > 0", step)
    if step is not None and low < high and step > high - low:
        raise InputError(where, f"{name}.step", f"must be at most high - low = {high - low} (a larger step leaves "
                         f"the single value {low}: give `low` and `high` equal to mean that)", step)
    if log and step not in (None, 1):
        raise InputError(where, f"{name}.log", "`log: true` cannot be combined with `step`", step)
    if log and low <= 0:
        raise InputError(where, f"{name}.low", "must be > 0 when `log: true`", low)
    for key, v in (("low", low), ("high", high)):
        _check_engine_value(where, f"{name}.{key}", name, v)
    return Param(name=name, type=kind, low=low, high=high, step=step, log=log, when=when)


def _parse_when(where: str, name: str, raw: Any, earlier: list[Param]) -> tuple:
    if raw is None:
        return ()
    if not isinstance(raw, dict) or not raw:
        raise InputError(where, f"{name}.when", "must be a mapping {earlier_param: value or [values]}", raw)
    by_name = {p.name: p for p in earlier}
    out = []
    for ref, allowed in raw.items():
        key = f"{name}.when.{ref}"
        if ref not in by_name:
            raise InputError(where, key, "must refer to a parameter defined earlier in the file; "
                             f"earlier parameters are {sorted(by_name)}", ref)
        target = by_name[ref]
        if target.type != "categorical":
            raise InputError(where, key, "may only refer to a categorical parameter", f"{ref} is {target.type}")
        values = allowed if isinstance(allowed, list) else [allowed]
        if not values:
            raise InputError(where, key, "must list at least one value", allowed)
        for v in values:
            if v not in target.choices:
                raise InputError(where, key, f"value must be one of {ref}'s choices {list(target.choices)}", v)
        out.append((ref, tuple(values)))
    return tuple(out)


def _engine_fields() -> set[str]:
    from engine import EngineConfig

    return {f.name for f in dataclasses.fields(EngineConfig)}


def _check_engine_value(where: str, key: str, field: str, value: Any) -> None:
    """Let EngineConfig judge a single value, so the space can never hold what the engine refuses."""
    from engine import EngineConfig, EngineInputError

    try:
        EngineConfig.from_dict({field: value}, source=where)
    except EngineInputError as exc:
        raise InputError(where, key, f"the engine refuses this value ({_strip(exc, where)})", value) from None


def _strip(exc: Exception, prefix: str) -> str:
    msg = str(exc)
    return msg[len(prefix) + 2:] if msg.startswith(prefix + ": ") else msg
