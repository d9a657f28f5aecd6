"""Experiment YAML → validated, frozen objects.

Everything a sweep needs is checked here, before any database, MLflow run or model load exists:
unknown keys, wrong types, bad choices, the search space, workload files and model names.
Every refusal is an :class:`InputError` naming the file, the key, the rule and the value.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.dimensions import FixedDimension
from autotune.errors import _MISSING, InputError
from autotune.fidelity import MAX_STOP_RATIO, FidelitySpec, Rung
from autotune.files import read_jsonl_lines, read_yaml_file
from autotune.space import SearchSpace, load_space
from autotune.vram import parse_size

NAMED_WORKLOADS = ("humaneval", "chat", "agent")
SAMPLERS = ("tpe", "gp", "random", "grid")
PRUNERS = ("none", "wilcoxon")
EXACTNESS = ("strict", "report")
# docs/measurement.md: decode tok/s chooses a decoding path (end-to-end tok/s is logged, never the
# objective); session tok/s (completion tokens / the session's time, prefill and prefix cache
# included) scores multi-turn sessions replayed as a client drives the server
OBJECTIVES = ("decode_tps", "session_tps")
SESSION_KEYS = ("min_turns", "prefix_cache_mb")  # workload keys of session_tps only
EXECUTORS = ("local", "ray")
DTYPES = ("auto", "float32", "bfloat16", "float16")
MAX_AR_DRIFT = 100.0  # measure.max_ar_drift at most (baselines 101x apart)
MAX_BASELINE_AGE_S = 365 * 24 * 3600  # measure.baseline_max_age at most: a year, in seconds
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


@dataclass(frozen=True)
class ModelSpec:
    target: str
    draft: str
    device: str = "auto"
    dtype: str = "auto"
    # how the target holds its weights (engine.WEIGHTS): "native" keeps a GGUF's quantized projections
    # in their blocks. A fixed model setting, never searched: it changes the model that is measured.
    weights: str = "dequantized"
    # bytes of device memory a config may take at the workload's longest context (autotune.vram): one
    # over it is infeasible; None: no limit
    vram_limit: int | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    sets: tuple[str, ...]  # named sets, or JSONL paths resolved against the experiment's folder
    n_prompts: int = 4  # prompts per set; sessions per set under objective session_tps
    max_new_tokens: int = 64  # per prompt; per turn for sessions
    seed: int = 0
    sessions: bool = False  # objective session_tps: every set is multi-turn sessions (engine.load_sessions)
    # sessions of fewer model turns are left out; None: 4 for a named set (engine.SESSION_SETS), every
    # session of a JSONL file (the user wrote them to be replayed)
    min_turns: int | None = None
    prefix_cache_mb: float = 1024.0  # the replay's prefix cache (engine.DEFAULT_PREFIX_CACHE_MB; 0: none)


@dataclass(frozen=True)
class MeasureSpec:
    warmup: int = 1
    repeats: int = 3
    max_rel_mad: float = 0.10
    exactness: str = "strict"
    baseline_every: int = 10  # re-measure the AR baseline after this many other trials measured in full
    # seconds: a worker that starts without a baseline (a restarted driver, a restarted Ray actor)
    # reuses one of the study's measured under the same identity at most this long ago; 0: never
    baseline_max_age: float = 6 * 3600.0
    # AR baselines of one machine further apart than this (relative), and beyond twice their spread,
    # make the study unreliable: no confirmed winner, no positive conclusion (results.ar_drift)
    max_ar_drift: float = 0.25
    confirm_top: int = 3  # configs re-measured in the confirmation phase
    confirm_repeats: int = 5


@dataclass(frozen=True)
class StudySpec:
    n_trials: int = 20
    sampler: str = "tpe"
    pruner: str = "none"
    seed: int | None = 0


@dataclass(frozen=True)
class ExecutorSpec:
    kind: str = "local"
    workers: int | None = None  # local: 1; ray: CPU actors, or a cap on the one-actor-per-GPU count
    address: str | None = None  # ray: "auto" or HOST:PORT of a cluster; None starts a local one
    trial_timeout: float | None = None  # ray: seconds before a trial's actor is killed and restarted


@dataclass(frozen=True)
class Experiment:
    name: str
    path: Path
    model: ModelSpec
    workload: WorkloadSpec
    search_space: SearchSpace
    objective: str = "decode_tps"
    measure: MeasureSpec = field(default_factory=MeasureSpec)
    study: StudySpec = field(default_factory=StudySpec)
    executor: ExecutorSpec = field(default_factory=ExecutorSpec)
    engine: tuple[tuple[str, Any], ...] = ()  # fixed EngineConfig fields under every trial
    # cheap rungs before a trial's full measurement (autotune.fidelity); not in the fingerprint: how
    # a config is reached, not what its full measurement is
    fidelity: FidelitySpec = field(default_factory=FidelitySpec)
    # search dimensions whose value cannot matter for this target, workload and device, decided once
    # the workers loaded (autotune.dimensions); not part of the fingerprint: the same file, resumed
    fixed_dimensions: tuple[FixedDimension, ...] = ()

    @property
    def base_dir(self) -> Path:
        return self.path.parent

    @property
    def space(self) -> SearchSpace:
        """The space the sampler searches: the file's, less the fixed dimensions."""
        return self.search_space.fix(self.fixed_dimension_values) if self.fixed_dimensions else self.search_space

    @property
    def ladder(self) -> tuple[Rung, ...]:
        """The fidelity rungs every trial runs before its full measurement (empty: none)."""
        return self.fidelity.ladder(self.workload.n_prompts, self.workload.max_new_tokens)

    @property
    def fixed_dimension_values(self) -> dict[str, Any]:
        return {f.name: f.value for f in self.fixed_dimensions}

    @property
    def fixed_engine(self) -> dict[str, Any]:
        fixed = dict(self.engine)
        # A space that tunes the grammar placement serves its traffic under the prompts' tool-call
        # grammars: the AR baseline and reference (built from these fields) must decode under them
        # too, or every constrained trial is compared with unconstrained output. AR masks every step
        # whatever the placement; a trial's own suggestion still overrides this value.
        placements = next((p.choices for p in self.search_space.params if p.name == "grammar"), None) or ()
        on = [c for c in placements if c != "off"]
        if on and "grammar" not in fixed:
            fixed["grammar"] = on[0]
        return fixed

    def fingerprint(self) -> str:
        """What makes two runs comparable: a resumed study must have been made from the same thing."""
        m = self.model
        # weights only when not the default, so a study made before the key existed still resumes
        data = {
            "model": [m.target, m.draft, m.device, m.dtype, *([m.weights] if m.weights != "dequantized" else [])],
            "workload": [[_content_id(s) for s in self.workload.sets], self.workload.n_prompts,
                         self.workload.max_new_tokens, self.workload.seed,
                         # (min_turns unset: 4, as before the key could be unset, so such a study still resumes: a named
                         # set selects as with 4, and a file's every session as before)
                         *([4 if self.workload.min_turns is None else self.workload.min_turns,
                            self.workload.prefix_cache_mb] if self.workload.sessions else [])],
            "space": self.search_space.fingerprint(),
            "objective": self.objective,
            "measure": [self.measure.warmup, self.measure.repeats, self.measure.max_rel_mad,
                        self.measure.exactness],
            "engine": sorted(self.engine),
        }
        if m.vram_limit is not None:  # it decides which trials are feasible; absent, older studies resume
            data["vram_limit"] = m.vram_limit
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _content_id(spec: str) -> str:
    """A JSONL set is identified by its content, so moving the experiment folder keeps the study."""
    path = Path(spec)
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else spec


class _Section:
    """Reads one mapping of the YAML, remembering its key path for error messages."""

    def __init__(self, where: str, prefix: str, raw: Any, allowed: set[str]) -> None:
        self.where, self.prefix = where, prefix
        if not isinstance(raw, dict):
            raise InputError(where, prefix or None, "must be a mapping", raw)
        unknown = sorted(set(raw) - allowed)
        if unknown:
            raise InputError(where, self.key(unknown[0]), f"unknown key; allowed keys are {sorted(allowed)}",
                             unknown[0])
        self.raw = raw

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def get(self, name: str, kind: type | tuple, default: Any = _MISSING) -> Any:
        if name not in self.raw:
            if default is _MISSING:
                raise InputError(self.where, self.key(name), "is required")
            return default
        value = self.raw[name]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            names = " or ".join(k.__name__ if k is not type(None) else "null" for k in kinds)
            raise InputError(self.where, self.key(name), f"must be of type {names}", value)
        return value

    def integer(self, name: str, default: Any = _MISSING, low: int = 0) -> int:
        value = self.get(name, int, default)
        if value < low:
            raise InputError(self.where, self.key(name), f"must be >= {low}", value)
        return value

    def choice(self, name: str, choices: tuple[str, ...], default: Any = _MISSING) -> str:
        value = self.get(name, str, default)
        if value not in choices:
            raise InputError(self.where, self.key(name), f"must be one of {list(choices)}", value)
        return value


def load(path: str | Path, *, check_models: bool = True) -> Experiment:
    """Parse and validate an experiment file (and its search space, workloads and model names).

    ``check_models=False`` skips only the model-existence check (used to validate templates
    for models that are not on this machine).
    """
    path = Path(path).resolve()
    where = str(path)
    if not path.is_file():
        raise InputError(where, None, "experiment file must exist", str(path))
    raw = read_yaml_file(path)
    top = _Section(where, "", raw, {"name", "model", "workload", "search_space", "objective", "measure",
                                    "study", "executor", "engine", "fidelity"})
    name = top.get("name", str)
    if not _NAME_RE.match(name):
        raise InputError(where, "name", "must match [A-Za-z0-9][A-Za-z0-9_.-]*", name)

    model = _model(where, top.get("model", dict), path.parent)
    objective = top.choice("objective", OBJECTIVES, "decode_tps")
    workload = _workload(where, top.get("workload", dict), path.parent, objective == "session_tps")
    space_ref = top.get("search_space", str)
    space_path = (path.parent / space_ref).resolve()
    if not space_path.is_file():
        raise InputError(where, "search_space", "must name an existing file (relative to the experiment)",
                         space_ref)
    space = load_space(space_path)
    measure = _measure(where, top.get("measure", dict, {}))
    study = _study(where, top.get("study", dict, {}))
    executor = _executor(where, top.get("executor", dict, {}))
    fidelity = _fidelity(where, top.get("fidelity", dict, {}), workload)
    engine_fixed = _engine_fixed(where, top.get("engine", dict, {}), space)
    if model.device.startswith("cuda"):
        # the first generation of a config on CUDA captures its decode step's graphs and tunes its
        # kernels: counted, it would be measured as if it were decoding (device "auto" decides later)
        for key, value in (("measure.warmup", measure.warmup), ("fidelity.rung_warmup", fidelity.rung_warmup)):
            if value < 1:
                raise InputError(where, key, "must be >= 1 on CUDA: the first pass captures the CUDA graphs and must "
                                 "not be timed", value)
    if engine_fixed.get("weights") not in (None, model.weights):
        raise InputError(where, "engine.weights", f"must be model.weights ({model.weights}): the pair is loaded as "
                         "model.weights says; set that instead", engine_fixed["weights"])
    if study.sampler == "grid":
        space.grid()  # refuses continuous or oversized spaces now, not mid-sweep
    if check_models:
        _check_models(where, model)
    _check_weights_dimension(where, model, space, check_models)
    return Experiment(name=name, path=path, model=model, workload=workload, search_space=space,
                      objective=objective, measure=measure, study=study, executor=executor,
                      engine=tuple(sorted(engine_fixed.items())), fidelity=fidelity)


def _model(where: str, raw: dict, base: Path) -> ModelSpec:
    from engine import WEIGHTS

    s = _Section(where, "model", raw, {"target", "draft", "device", "dtype", "weights", "vram_limit"})
    target, draft = s.get("target", str), s.get("draft", str)
    device = s.get("device", str, "auto")
    if not _DEVICE_RE.match(device):
        raise InputError(where, "model.device", "must be auto, cpu, mps, cuda or cuda:N", device)
    limit = raw.get("vram_limit")
    return ModelSpec(target=_resolve_model_path(target, base), draft=_resolve_model_path(draft, base),
                     device=device, dtype=s.choice("dtype", DTYPES, "auto"),
                     weights=s.choice("weights", WEIGHTS, "dequantized"),
                     vram_limit=None if limit is None else parse_size(limit, where, "model.vram_limit"))


def _resolve_model_path(spec: str, base: Path) -> str:
    """Relative model folders and .gguf files are relative to the experiment, like every other path."""
    looks_like_path = spec.startswith((".", "~")) or spec.endswith(".gguf") or ("/" in spec and ":" not in spec)
    if not looks_like_path or Path(spec).expanduser().is_absolute():
        return str(Path(spec).expanduser()) if spec.startswith("~") else spec
    return str((base / spec).resolve())


def _workload(where: str, raw: dict, base: Path, sessions: bool = False) -> WorkloadSpec:
    """``workload``; with ``sessions`` (objective session_tps) its sets are session sets
    (``engine.SESSION_SETS``, or JSONL files of sessions) and ``min_turns`` / ``prefix_cache_mb`` apply."""
    from engine import DEFAULT_PREFIX_CACHE_MB, SESSION_SETS

    s = _Section(where, "workload", raw, {"sets", "n_prompts", "max_new_tokens", "seed", *SESSION_KEYS})
    if not sessions and (given := [k for k in SESSION_KEYS if k in raw]):
        raise InputError(where, f"workload.{given[0]}", "only applies with objective: session_tps (multi-turn "
                         "sessions)", raw[given[0]])
    names = SESSION_SETS if sessions else NAMED_WORKLOADS
    sets = s.get("sets", list)
    if not sets:
        raise InputError(where, "workload.sets", "must list at least one workload", sets)
    resolved = []
    for i, spec in enumerate(sets):
        key = f"workload.sets[{i}]"
        if not isinstance(spec, str) or not spec:
            raise InputError(where, key, "must be a workload name or a JSONL path", spec)
        if spec in names:
            resolved.append(spec)
            continue
        if sessions and spec in NAMED_WORKLOADS:
            raise InputError(where, key, f"has no multi-turn sessions; objective session_tps replays one of "
                             f"{list(SESSION_SETS)} or a .jsonl file of sessions", spec)
        if not spec.endswith(".jsonl"):
            raise InputError(where, key, f"must be one of {list(names)} or a path to a .jsonl file", spec)
        file = (base / spec).resolve()
        if not file.is_file():
            raise InputError(where, key, "JSONL file must exist (paths are relative to the experiment)", spec)
        _check_jsonl(file, sessions)
        resolved.append(str(file))
    if len(set(resolved)) != len(resolved):
        raise InputError(where, "workload.sets", "must not list a workload twice", sets)
    cache_mb = s.get("prefix_cache_mb", (int, float), DEFAULT_PREFIX_CACHE_MB)
    if not 0 <= cache_mb < float("inf"):  # NaN fails this too
        raise InputError(where, "workload.prefix_cache_mb", "must be a finite number of MiB >= 0 (0: every turn "
                         "prefilled whole)", cache_mb)
    return WorkloadSpec(sets=tuple(resolved), n_prompts=s.integer("n_prompts", 4, low=1),
                        max_new_tokens=s.integer("max_new_tokens", 64, low=2), seed=s.integer("seed", 0),
                        sessions=sessions, prefix_cache_mb=float(cache_mb),
                        min_turns=s.integer("min_turns", None, low=1) if "min_turns" in raw else None)


def _check_jsonl(file: Path, sessions: bool = False) -> None:
    """Catch a broken line with its number here; the engine's loader does the full parse. A session
    (``sessions``) is a line of messages that ends with a request, not an assistant message."""
    lines = read_jsonl_lines(file)
    if not lines:
        raise InputError(str(file), None, "JSONL workload must hold at least one prompt line")
    for n, obj, start in lines:
        if not isinstance(obj, dict) or not (isinstance(obj.get("prompt"), str)
                                             or isinstance(obj.get("messages"), list)):
            raise InputError(f"{file}:{n}", None, 'each line needs {"prompt": str} or {"messages": [...]}', start)
        tools = obj.get("tools")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise InputError(f"{file}:{n}", "tools", "must be a list of tool objects", tools)
        if sessions:
            msgs = obj.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise InputError(f"{file}:{n}", "messages", "a session (objective session_tps) needs messages, "
                                 "not a prompt string", start)
            if isinstance(msgs[-1], dict) and msgs[-1].get("role") == "assistant":
                raise InputError(f"{file}:{n}", "messages", "a session must end with its last turn's request (a "
                                 "user or tool message), not an assistant message", start)


def _measure(where: str, raw: dict) -> MeasureSpec:
    s = _Section(where, "measure", raw, {"warmup", "repeats", "max_rel_mad", "exactness", "baseline_every",
                                         "baseline_max_age", "max_ar_drift", "confirm_top", "confirm_repeats"})
    rel = s.get("max_rel_mad", (int, float), 0.10)
    if not 0 < rel < 1:
        raise InputError(where, "measure.max_rel_mad", "must be > 0 and < 1", rel)
    max_age = s.get("baseline_max_age", (int, float), MeasureSpec.baseline_max_age)
    if not 0 <= max_age <= MAX_BASELINE_AGE_S:  # NaN fails this too
        raise InputError(where, "measure.baseline_max_age", f"must be seconds from 0 (a restart never reuses a "
                         f"baseline) to {MAX_BASELINE_AGE_S:,} (a year)", max_age)
    drift = s.get("max_ar_drift", (int, float), MeasureSpec.max_ar_drift)
    if not 0 < drift <= MAX_AR_DRIFT:  # NaN fails this too
        raise InputError(where, "measure.max_ar_drift", f"must be a fraction > 0 and <= {MAX_AR_DRIFT:g} (0.25: AR "
                         "baselines 25% apart make the study unreliable)", drift)
    return MeasureSpec(warmup=s.integer("warmup", 1), repeats=s.integer("repeats", 3, low=1),
                       max_rel_mad=float(rel), exactness=s.choice("exactness", EXACTNESS, "strict"),
                       baseline_every=s.integer("baseline_every", 10, low=1), baseline_max_age=float(max_age),
                       max_ar_drift=float(drift), confirm_top=s.integer("confirm_top", 3),
                       confirm_repeats=s.integer("confirm_repeats", 5, low=1))


def _fidelity(where: str, raw: dict, workload: WorkloadSpec) -> FidelitySpec:
    """``fidelity: {rungs: [{prompts, max_new_tokens}, ...], stop_ratio, rung_warmup, rung_repeats}``
    (autotune.fidelity)."""
    s = _Section(where, "fidelity", raw, {"rungs", "stop_ratio", "rung_warmup", "rung_repeats"})
    passes = dict(rung_warmup=s.integer("rung_warmup", FidelitySpec.rung_warmup),
                  rung_repeats=s.integer("rung_repeats", FidelitySpec.rung_repeats, low=1))
    ratio = s.get("stop_ratio", (int, float), FidelitySpec.stop_ratio)
    if not 1 < ratio <= MAX_STOP_RATIO:  # NaN fails this too
        raise InputError(where, "fidelity.stop_ratio", f"must be > 1 and <= {MAX_STOP_RATIO:g} (2: a config at least "
                         "twice as slow as the incumbent, after the spread, stops at the cheap rung)", ratio)
    raw_rungs = s.get("rungs", (list, type(None)), None)
    if raw_rungs is None:
        return FidelitySpec(rungs=None, stop_ratio=float(ratio), **passes)
    rungs: list[Rung] = []
    full = (workload.n_prompts, workload.max_new_tokens)
    for i, item in enumerate(raw_rungs):
        r = _Section(where, f"fidelity.rungs[{i}]", item, {"prompts", "max_new_tokens"})
        rung = Rung(prompts=r.integer("prompts", low=1), max_new_tokens=r.integer("max_new_tokens", low=2))
        if rung.prompts > full[0] or rung.max_new_tokens > full[1]:
            raise InputError(where, f"fidelity.rungs[{i}]", f"a rung is a slice of the workload: at most "
                             f"workload.n_prompts={full[0]} prompts and workload.max_new_tokens={full[1]} tokens",
                             {"prompts": rung.prompts, "max_new_tokens": rung.max_new_tokens})
        if (rung.prompts, rung.max_new_tokens) == full:
            raise InputError(where, f"fidelity.rungs[{i}]", "must be cheaper than the full measurement (fewer "
                             "prompts or fewer tokens); the full measurement follows the rungs anyway",
                             {"prompts": rung.prompts, "max_new_tokens": rung.max_new_tokens})
        prev = rungs[-1] if rungs else None
        if prev is not None and not (rung.prompts >= prev.prompts and rung.max_new_tokens >= prev.max_new_tokens
                                     and rung != prev):
            raise InputError(where, f"fidelity.rungs[{i}]", "rungs go from the cheapest up: each at least as many "
                             "prompts and tokens as the one before, and more of one",
                             {"prompts": rung.prompts, "max_new_tokens": rung.max_new_tokens})
        rungs.append(rung)
    return FidelitySpec(rungs=tuple(rungs), stop_ratio=float(ratio), **passes)


def _study(where: str, raw: dict) -> StudySpec:
    s = _Section(where, "study", raw, {"n_trials", "sampler", "pruner", "seed"})
    seed = s.get("seed", (int, type(None)), 0)
    if seed is not None and seed < 0:
        raise InputError(where, "study.seed", "must be >= 0 or null", seed)
    return StudySpec(n_trials=s.integer("n_trials", 20, low=1), sampler=s.choice("sampler", SAMPLERS, "tpe"),
                     pruner=s.choice("pruner", PRUNERS, "none"), seed=seed)


def _executor(where: str, raw: dict) -> ExecutorSpec:
    s = _Section(where, "executor", raw, {"kind", "workers", "address", "trial_timeout"})
    workers = s.get("workers", (int, type(None)), None)
    if workers is not None and workers < 1:
        raise InputError(where, "executor.workers", "must be >= 1", workers)
    timeout = s.get("trial_timeout", (int, float, type(None)), None)
    if timeout is not None and not timeout > 0:
        raise InputError(where, "executor.trial_timeout", "must be > 0 seconds", timeout)
    spec = ExecutorSpec(kind=s.choice("kind", EXECUTORS, "local"), workers=workers,
                        address=s.get("address", (str, type(None)), None),
                        trial_timeout=None if timeout is None else float(timeout))
    check_executor(where, ("executor.kind", "executor.workers", "executor.address", "executor.trial_timeout"),
                   spec.kind, spec.workers, spec.address, spec.trial_timeout)
    return spec


_ADDRESS_RE = re.compile(r"^(auto|(ray://)?[A-Za-z0-9_.-]+:\d{1,5})$")


def check_executor(where: str, keys: tuple[str, str, str, str], kind: str, workers: int | None,
                   address: str | None = None, trial_timeout: float | None = None) -> None:
    """One rule for the YAML and the CLI: what each executor can run."""
    if kind == "local":
        if workers not in (None, 1):
            raise InputError(where, keys[1], "the local executor runs exactly one in-process worker; use the Ray "
                             "executor for several", workers)
        if address is not None:
            raise InputError(where, keys[2], "only applies with the Ray executor", address)
        if trial_timeout is not None:
            raise InputError(where, keys[3], "only applies with the Ray executor (the local worker runs in the "
                             "driver's process and cannot be killed)", trial_timeout)
    if address is not None and not _ADDRESS_RE.match(address):
        raise InputError(where, keys[2], "must be `auto` or HOST:PORT of a Ray cluster", address)


def _engine_fixed(where: str, raw: dict, space: SearchSpace) -> dict[str, Any]:
    from engine import EngineConfig, EngineInputError

    clash = sorted(set(raw) & set(space.names))
    if clash:
        raise InputError(where, f"engine.{clash[0]}", "is both fixed here and tuned by the search space", clash[0])
    if "verify" in raw:
        raise InputError(where, "engine.verify", "is chosen per trial (baseline, reference, search space)",
                         raw["verify"])
    try:
        EngineConfig.from_dict(dict(raw), source=f"{where}: engine")
    except EngineInputError as exc:
        raise InputError(where, "engine", f"the engine refuses these fixed fields ({exc})") from None
    return dict(raw)


def _check_models(where: str, model: ModelSpec) -> None:
    import engine
    from engine import EngineInputError

    try:
        engine.check_model_spec(model.target, model.draft)
    except EngineInputError as exc:
        raise InputError(where, "model", f"the engine refuses the model pair ({exc})",
                         {"target": model.target, "draft": model.draft}) from None
    try:  # the specs are fine by now: what is left is whether this target can be held so
        engine.check_model_spec(model.target, model.draft, model.weights)
    except EngineInputError as exc:
        raise InputError(where, "model.weights", f"must suit model.target ({exc})", model.weights) from None


def _check_weights_dimension(where: str, model: ModelSpec, space: SearchSpace, check_models: bool) -> None:
    """A search space that tunes ``weights`` (each config on a pair loaded that way): not with a
    ``model.weights`` fixed to another form, and ``native`` only for a target that can be held so."""
    param = next((p for p in space.params if p.name == "weights"), None)
    if param is None:
        return
    if model.weights != "dequantized":
        raise InputError(where, "model.weights", "is both fixed here and searched by the search space's `weights`; "
                         "give one", model.weights)
    if check_models and "native" in param.choices:
        import engine

        try:
            engine.check_model_spec(model.target, model.draft, "native")
        except engine.EngineInputError as exc:
            raise InputError(str(space.path), "weights.choices", f"native must suit model.target ({exc})",
                             list(param.choices)) from None


def load_workloads(exp: Experiment) -> list[Any]:
    """Select the prompts of every workload set (deterministic by seed); refusals are input errors."""
    from engine import EngineInputError, load_sessions, load_workload

    w = exp.workload
    out = []
    for i, spec in enumerate(w.sets):
        try:
            out.append(load_sessions(spec, exp.base_dir, w.n_prompts, w.seed, w.min_turns) if w.sessions
                       else load_workload(spec, exp.base_dir, w.n_prompts, w.seed))
        except EngineInputError as exc:
            raise InputError(str(exp.path), f"workload.sets[{i}]", f"the engine refuses this workload ({exc})",
                             spec) from None
        if not out[-1].prompts:
            raise InputError(str(exp.path), "workload.min_turns", f"no session of {spec} has that many model turns",
                             w.min_turns if w.min_turns is not None else "unset (4 for a named set)")
    return out


def workload_hash(workloads: list[Any]) -> str:
    return hashlib.sha256("|".join(w.hash for w in workloads).encode()).hexdigest()[:16]
