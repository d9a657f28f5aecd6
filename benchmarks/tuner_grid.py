"""The bench grid's ground truth (``tuner_bench.py measure``): every config of a search space measured
once at every fidelity, cached as JSONL, and read back (``Cache``) by the replay and the live runs.

A config far slower than the reference at the ladder's rung (the generic decode path, eager kernels:
30x and 4x on the H200) costs minutes a full pass at an overnight experiment's fidelity, and the
grid's slow half alone would need hours of GPU. ``--extrapolate-slow RATIO`` measures such a config
at its rungs only and writes its full fidelity as an estimate (``"extrapolated"`` in the line): the
rung's passes for its value and per-prompt rates, its seconds a pass scaled by the tokens a full pass
decodes. Its value cannot be the optimum (it is RATIO times behind a config the grid holds); what
the estimate feeds is the time a strategy without the ladder spends on it. ``--validate N`` also
measures the first N such configs in full and keeps the estimate beside, so the scaling is checked
on the same run.

Configs that differ only in a dimension the target cannot see (``autotune.dimensions``: ``rollback`` on
a dense target, ``kernels`` off CUDA, ``grammar`` without tools) run the same decode program: the
first is measured, the others get its fidelities and name it (``"same_program_as"``), so the grid
costs what its distinct programs cost. A strategy that searches such a dimension (``before``) still
pays a measurement for each twin it picks; the replay draws its noise from the one measured spread.
``--measure-twins`` measures every twin instead.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from autotune import dimensions, experiment, fidelity
from autotune import study as st
from autotune.errors import InputError
from autotune.fidelity import FidelitySpec
from autotune.record import Job
from autotune.space import SearchSpace
from autotune.tracking import config_label
from engine import EngineInputError

MAX_GRID = 2000  # configs measured once each: a bench grid is small by design
FULL = "full"


def fidelity_key(prompts: int | None, max_new_tokens: int, full_tokens: int) -> str:
    return FULL if prompts is None and max_new_tokens == full_tokens else f"p{prompts}t{max_new_tokens}"


def config_key(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True)


def full_config(fields: dict[str, Any]) -> dict[str, Any]:
    """Every EngineConfig field, as the driver records a trial's config."""
    from engine import EngineConfig

    return EngineConfig.from_dict(dict(fields), source="grid").to_dict()


def space_points(space: SearchSpace, where: str) -> list[dict[str, Any]]:
    """The distinct configs (as suggestions) a search space can produce."""
    points: list[dict[str, Any]] = [{}]
    for p in space.params:
        values = p.grid_values()
        if values is None:
            raise InputError(where, p.name, "a bench grid needs categorical, int or stepped float parameters",
                             {"type": p.type, "low": p.low, "high": p.high})
        nxt = []
        for pt in points:
            nxt += [{**pt, p.name: v} for v in values] if space.is_active(p, pt) else [pt]
        points = nxt
        if len(points) > MAX_GRID:
            raise InputError(where, None, f"a bench grid has at most {MAX_GRID} configs (each is measured once); "
                             f"{p.name!r} and the parameters before it already make more", len(points))
    return points


# ------------------------------------------------------------------------------------------ the cache


@dataclasses.dataclass
class Cache:
    header: dict[str, Any]
    entries: dict[str, dict[str, Any]]  # config key -> {"config", "roles", "fidelities"}
    path: Path

    @classmethod
    def read(cls, path: Path) -> Cache:
        if not path.is_file():
            raise InputError("--cache", None, "no such cache file (run `tuner_bench.py measure` first)", str(path))
        header, entries = None, {}
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{n}", None, f"every line must be JSON ({exc.msg})", line[:80]) from None
            if not isinstance(obj, dict):
                raise InputError(f"{path}:{n}", None, "every line must be a JSON object", type(obj).__name__)
            if obj.get("kind") == "header":
                header = obj
            elif obj.get("kind") == "config":
                for key, kind in (("config", dict), ("fidelities", dict)):
                    if not isinstance(obj.get(key), kind):
                        raise InputError(f"{path}:{n}", key, "a config line needs it as a JSON object", obj.get(key))
                # keyed by the config as today's engine completes it: a field added since the cache was
                # measured takes its default (probe_max's 64 for an adaptive entry measured before
                # the probes backed off: the committed caches hold no adaptive entry)
                try:
                    entries[config_key(full_config(obj["config"]))] = obj
                except EngineInputError as exc:
                    raise InputError(f"{path}:{n}", "config", f"the engine refuses it ({exc})") from None
            else:
                raise InputError(f"{path}:{n}", "kind", "must be header or config", obj.get("kind"))
        if header is None:
            raise InputError(str(path), None, "the cache has no header line (kind: header)")
        return cls(header, entries, path)

    def entry(self, config: dict[str, Any]) -> dict[str, Any]:
        found = self.entries.get(config_key(full_config(config)))
        if found is None:
            raise InputError(str(self.path), None, "a strategy asked for a config the cache does not hold: measure "
                             "the same --space and experiment first", config)
        return found

    def truth(self, config: dict[str, Any], strict: bool) -> float | None:
        """A config's ground truth: the median of its full-fidelity passes; None when it failed, was
        refused, or (strict exactness) its output differed from AR's."""
        f = self.entry(config)["fidelities"].get(FULL) or {}
        if not f.get("ok") or f.get("refused") or not f.get("decode_tps_runs"):
            return None
        if strict and f.get("exact_match") is not None and f["exact_match"] < 1.0:
            return None
        return statistics.median(f["decode_tps_runs"])

    def optimum(self, strict: bool) -> tuple[float, dict[str, Any]]:
        scored = [(v, e["config"]) for e in self.entries.values() if (v := self.truth(e["config"], strict)) is not None]
        if not scored:
            raise InputError(str(self.path), None, "no config of the cache has an exact, measured full fidelity")
        return max(scored, key=lambda vc: vc[0])


# ------------------------------------------------------------------------------------------ measure


def matches(config: dict[str, Any], only: dict[str, Any]) -> bool:
    """``--only`` (KEY=VALUE,... of search-space fields): every given field has that value."""
    return all(config.get(k) == v for k, v in only.items())


def parse_only(text: str | None, space: SearchSpace) -> dict[str, Any]:
    """``--only verify=ddtree,draft_path=runtime`` -> fields of the space, values read as in YAML."""
    import yaml

    if not text:
        return {}
    names = {p.name for p in space.params}
    out: dict[str, Any] = {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in names:
            raise InputError("--only", key.strip() or None, f"expected KEY=VALUE[,KEY=VALUE...] with KEY one of "
                             f"the grid's parameters {sorted(names)}", text)
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise InputError("--only", key.strip(), f"the value is not YAML ({str(exc).splitlines()[0]})",
                             value) from None
    return out


def extrapolated(rung: dict[str, Any], rung_prompts: int, rung_tokens: int, set_sizes: list[int],
                 full_tokens: int) -> dict[str, Any]:
    """A full-fidelity entry estimated from a rung's: its passes' tok/s as measured (a slow path's rate
    barely depends on the length: no tree to accept more), each set's per-prompt rates cycled over
    that set's prompts, and its seconds a pass times the tokens a full pass decodes over the rung's."""
    per_set = [min(rung_prompts, n) for n in set_sizes]
    rates, start, per_prompt = rung["per_prompt_tps"], 0, []
    for k, n in zip(per_set, set_sizes, strict=True):
        mine = rates[start:start + k] or [statistics.median(rung["decode_tps_runs"])]
        per_prompt += [mine[i % len(mine)] for i in range(n)]
        start += k
    factor = (sum(set_sizes) * full_tokens) / (sum(per_set) * rung_tokens)
    return {**rung, "per_prompt_tps": per_prompt, "seconds_per_pass": rung["seconds_per_pass"] * factor,
            "extrapolated": {"factor": round(factor, 3)}}


def measure_grid(exp: experiment.Experiment, space: SearchSpace, cache_path: Path, repeats: int,
                 out: Any = None, only: dict[str, Any] | None = None, extrapolate_slow: float | None = None,
                 validate: int = 0, measure_twins: bool = False) -> int:
    """Measure every config of ``space`` (and AR, the reference) at every fidelity; returns how many
    configs were measured now (the others were in the cache). ``only``: grid configs with those
    fields; ``extrapolate_slow``: a config that far behind the reference at the last rung gets its
    full fidelity estimated (module docstring), the first ``validate`` of them measured as well;
    ``measure_twins``: measure configs that run another's program too (module docstring)."""
    from autotune.worker import Worker

    out = out or sys.stdout  # read when called (a test's captured stdout), not at import
    points = space_points(space, str(space.path))
    fixed = exp.fixed_engine
    wanted = [("baseline", full_config({**fixed, "verify": "ar"})),
              ("reference", full_config({**st.REFERENCE, **fixed}))]
    wanted += [("grid", full_config({**fixed, **pt})) for pt in points if matches(pt, only or {})]
    workloads = experiment.load_workloads(exp)
    # an empty file (made ready for a run that had not started) is a new cache
    fresh = not cache_path.is_file() or not cache_path.read_text(encoding="utf-8").strip()
    cache = None if fresh else Cache.read(cache_path)
    done = {} if fresh else cache.entries
    if cache is not None and cache.header.get("weights", "dequantized") != exp.model.weights:
        raise InputError(str(cache_path), "weights", "the cache was measured with model.weights "
                         f"{cache.header.get('weights', 'dequantized')!r}; the experiment asks for",
                         exp.model.weights)
    worker = Worker.load(exp.model.target, exp.model.draft, exp.model.device, exp.model.dtype, workloads, fixed,
                         weights=exp.model.weights)
    m, ladder = exp.measure, exp.ladder
    full_tokens = exp.workload.max_new_tokens
    if fresh:
        header = {"kind": "header", "experiment": exp.name, "device": str(worker.pair.device),
                  "weights": exp.model.weights, "dtype": str(worker.pair.dtype), "max_new_tokens": full_tokens,
                  "workloads": [{"name": w.name, "hash": w.hash} for w in workloads],
                  "facts": {k: worker.limits()[k] for k in ("recurrent_state", "tools")},
                  "ladder": [[r.prompts, r.max_new_tokens] for r in ladder], "warmup": m.warmup, "repeats": repeats,
                  "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
        cache_path.write_text(json.dumps(header) + "\n", encoding="utf-8")
    set_sizes = [len(w.prompts) for w in workloads]  # (load_workload selected n_prompts already)
    last_rung = fidelity_key(ladder[-1].prompts, ladder[-1].max_new_tokens, full_tokens) if ladder else None
    reference_rung = next((e["fidelities"].get(last_rung) for e in done.values() if e.get("role") == "reference"),
                          None) if last_rung else None
    ignored = () if measure_twins else dimensions.irrelevant(
        space, dimensions.facts_from({**worker.limits(), "device": worker.pair.device}), fixed)
    programs = {program_key(e["config"], ignored): e["config"] for e in done.values()
                if e.get("role") == "grid" and "same_program_as" not in e}
    measured, validated, measured_now = 0, 0, {}
    for i, (role, config) in enumerate(wanted):
        if config_key(config) in done:
            continue
        twin = programs.get(program_key(config, ignored)) if role == "grid" else None
        if twin is not None:
            fids = (done.get(config_key(twin)) or {}).get("fidelities") or measured_now[config_key(twin)]
            line = {"kind": "config", "role": role, "config": config, "fidelities": fids,
                    "same_program_as": {"config": twin, "fixed": [d.to_dict() for d in ignored]}}
            with cache_path.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(line) + "\n")
            print(f"[{i + 1}/{len(wanted)}] {role} {config_label(config)}: the program of {config_label(twin)} "
                  f"({dimensions.describe(ignored)})", file=out, flush=True)
            continue
        fids = {}
        full_job = Job(trial=i, role=role, config=config, max_new_tokens=full_tokens,
                       warmup=m.warmup, repeats=repeats, max_rel_mad=m.max_rel_mad, remeasure_if_noisy=False)
        # each rung, then the full measurement, as a trial runs them; every fidelity at the full passes
        # (the replay draws the fewer passes a rung runs from them)
        for job in fidelity.jobs(full_job, ladder, FidelitySpec(rung_warmup=m.warmup, rung_repeats=repeats)):
            key = fidelity_key(job.prompts, job.max_new_tokens, full_tokens)
            estimate = None
            if job.rung is None and role == "grid" and extrapolate_slow and _slow(fids.get(last_rung),
                                                                                   reference_rung, extrapolate_slow):
                estimate = extrapolated(fids[last_rung], ladder[-1].prompts, ladder[-1].max_new_tokens, set_sizes,
                                        full_tokens)
                if validated >= validate:
                    fids[key] = estimate
                    continue
                validated += 1
            rec = worker.measure(job)
            passes = m.warmup + len(rec.decode_tps_runs)
            fids[key] = {
                "ok": rec.ok, "fail_reason": rec.fail_reason, "refused": rec.refused,
                "decode_tps_runs": rec.decode_tps_runs, "per_prompt_tps": rec.per_prompt_tps,
                "acceptance_length": rec.acceptance_length, "steps": rec.steps, "step_ms": rec.step_ms,
                "exact_match": rec.exact_match, "elapsed_s": rec.elapsed_s,
                "seconds_per_pass": rec.engine_s / passes if passes else rec.elapsed_s}
            if estimate is not None:  # --validate: the estimate kept beside what was measured
                fids[key]["estimate"] = {k: estimate[k]
                                         for k in ("decode_tps_runs", "seconds_per_pass", "extrapolated")}
        if role == "reference" and last_rung:
            reference_rung = fids.get(last_rung)
        with cache_path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps({"kind": "config", "role": role, "config": config, "fidelities": fids}) + "\n")
        if role == "grid":
            programs[program_key(config, ignored)] = config
            measured_now[config_key(config)] = fids
        measured += 1
        print(f"[{i + 1}/{len(wanted)}] {role} {config_label(config)}: {_outcome(fids[FULL])}", file=out, flush=True)
    return measured


def program_key(config: dict[str, Any], ignored: tuple[dimensions.FixedDimension, ...]) -> str:
    """The decode program a config runs: its key with the dimensions the target cannot see set to
    their fixed values (``autotune.dimensions``)."""
    return config_key(full_config({**config, **{d.name: d.value for d in ignored}}))


def _slow(rung: dict[str, Any] | None, reference: dict[str, Any] | None, ratio: float) -> bool:
    """The config's rung rate is ``ratio`` times or more behind the reference's at that rung (both measured)."""
    if not rung or not reference or not rung.get("ok") or not reference.get("ok"):
        return False
    mine, ref = rung.get("decode_tps_runs") or [], reference.get("decode_tps_runs") or []
    return bool(mine and ref) and statistics.median(mine) * ratio <= statistics.median(ref)


def _outcome(full: dict[str, Any]) -> str:
    if full["refused"]:
        return f"refused: {full['refused']}"
    if not full["ok"]:
        return f"failed: {full['fail_reason']}"
    what = f"{statistics.median(full['decode_tps_runs']):.1f} tok/s"
    if "extrapolated" in full:
        what += f" (full fidelity extrapolated from the rung, x{full['extrapolated']['factor']} its seconds)"
    if "estimate" in full:
        est = full["estimate"]
        what += (f" (extrapolated: {statistics.median(est['decode_tps_runs']):.1f} tok/s, "
                 f"{est['seconds_per_pass']:.2f} s a pass against {full['seconds_per_pass']:.2f} measured)")
    return what
