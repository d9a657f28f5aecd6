"""A worker holds one loaded model pair and measures configs on it: a job in, a plain record out.

The worker never touches the Optuna storage or MLflow (the driver owns both). It runs the
measurement protocol of docs/measurement.md for one config:

1. ``warmup`` passes that are not counted;
2. ``repeats`` measured passes over every workload set (``engine.bench`` resets every cache
   between generations);
3. if the relative MAD is above ``max_rel_mad``, ``repeats`` more passes, scored together with
   the first ones (the median and MAD are robust to the disturbed passes); still noisy → flagged;
4. every output compared token by token with the AR output of the same prompt; a prompt that
   differs is decoded again up to its first divergence, by AR and by the config, recording the
   target's top-2 logit margins there (``engine.diagnose``: a numeric tie or a mismatch), after the
   measured passes.

A session workload (``engine.load_sessions``: the experiment's ``objective: session_tps``) is
replayed turn by turn: AR first (``engine.replay_sessions``, its own replies fed back), which fixes
every turn's request; then each pass decodes those requests in order through one fresh prefix cache
per set (``Job.prefix_cache_mb``), as a server meets them, and records each turn's time to first
token, cached tokens and time. Session tok/s = completion tokens / the turns' time, prefill and the
cache's commit included (its memory: part ``prefix_cache`` of the plan and of the measured peak);
decode tok/s is measured on the same turns. Exactness is per turn, against AR's.

Each record also carries the worker's utilisation during the job (NVML GPU utilisation on a GPU,
process CPU time over wall time on a CPU) and whether the engine error it hit leaves the device
unusable (then the Ray executor restarts the worker process).
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import statistics
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from autotune import measure, record, vram
from autotune import sessions as sess
from autotune.record import Job, Record, pass_step_ms, pass_tps, per_prompt_tps, policy_record
from autotune.utilisation import Utilisation

# Told where a job is, e.g. "pass 2/3: humaneval 4/12" (a progress display; called between generations).
ProgressCallback = Callable[[str], None]
# Called after the first measured pass with the per-prompt decode TPS; returns True to prune.
PassCallback = Callable[[list[float]], bool]
MAX_DIAGNOSED = 20  # inexact prompts given divergence forensics per trial (two short generations each)
# Messages of errors after which a CUDA context cannot be trusted (the process must go).
_DEVICE_FATAL = ("illegal memory access", "device-side assert", "unspecified launch failure",
                 "misaligned address", "an illegal instruction", "CUBLAS_STATUS_EXECUTION_FAILED",
                 "uncorrectable ECC error", "CUDA error: unknown error")


class Worker:
    """Owns a loaded ``engine.Pair`` and the encoded prompts; measures one config per call."""

    def __init__(self, pair: Any, workloads: Sequence[Any], fixed: dict[str, Any]) -> None:
        import engine

        self.pair = pair
        self._engine_s = 0.0  # seconds inside the engine during the current job
        self._on_progress: ProgressCallback | None = None  # the current job's (Worker.measure)
        self.id = f"{socket.gethostname()}:{os.getpid()}"
        self.fixed = dict(fixed)
        names = [w.name for w in workloads]
        # two JSONL files may share a stem; the set name keys per-set results, so keep it unique
        names = [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]
        self.sets = [(n, [pair.encode(p) for p in w.prompts]) for n, w in zip(names, workloads, strict=True)]
        # session workloads: the sessions themselves (self.sets holds each one's whole script encoded:
        # its last request but for the replies, for limits()); a job measures their turns (_turn_sets)
        self.session_mode = any(getattr(w, "sessions", False) for w in workloads)
        if self.session_mode and not all(getattr(w, "sessions", False) for w in workloads):
            raise ValueError("a worker measures prompt workloads or session workloads, not both")
        self.sessions = [(n, list(w.prompts)) for n, w in zip(names, workloads, strict=True)] if self.session_mode \
            else []
        # each session's first request, encoded once: what must fit the context (limits(), sweep._check_fits)
        self._first_request = max((len(pair.encode(engine.session_request(p))) for _, ps in self.sessions
                                   for p in ps), default=0)
        # (length, slice, weights, cache) -> the baseline AR's replay per set (_replay)
        self._replays: dict[tuple[Any, ...], list[Any]] = {}
        self._session_of: list[list[int]] = []  # the current job's turns: each one's session, per set
        self._cut: dict[str, str] = {}  # the current job's sessions AR's replay ended early, and why
        self._cache_mb = 0.0  # the current session job's prefix cache budget (Job.prefix_cache_mb)
        # the pair per weights form (EngineConfig.weights, a search dimension): the loaded one, and the
        # other loaded on the first job that names it (same target, draft, device and dtype)
        self._pairs: dict[str, Any] = {getattr(pair, "weights", "dequantized"): pair} if pair is not None else {}
        self._last_pair = pair  # the pair the last job ran on (a switch releases its buffers)
        self._has_tools = any(getattr(p, "tools", None) for _, ps in self.sets for p in ps)
        # (max_new_tokens, prompts per set, decode loop, kernels as they run) -> per set outputs
        self._reference: dict[tuple[Any, ...], list[list[list[int]]]] = {}
        self._reserved: tuple[Any, ...] | None = None  # (config, memory_at) the pair's buffers were reserved for

    def cache_load(self, max_new_tokens: int, context: int | None = None, replayed: bool = False
                   ) -> tuple[int | None, int]:
        """What one prefix cache keeps of a session workload replayed through it (``plan_memory``'s
        ``prefix_cache_tokens`` and ``prefix_cache_generations``), at most: per session its last request
        and answer, and each earlier answer once more (a reply the next turn re-encodes other than it was
        generated leaves the generated tokens as a branch of their own in the cache's radix tree), summed
        over the sessions (a prefix two sessions share counted twice); one generation per model turn.
        The last requests are the current job's replay's (``replayed``: after ``_turn_sets``), else as
        ``vram.memory_at`` plans the longest (each earlier answer up to ``max_new_tokens``, within
        ``context``). (None, 1) for prompt workloads: the plan's own generation."""
        if not self.session_mode:
            return None, 1
        if replayed:
            last: dict[tuple[int, int], int] = {}
            turns: Counter = Counter()
            for k, ((_, prompts), session_of) in enumerate(zip(self.sets, self._session_of, strict=True)):
                for prompt, sid in zip(prompts, session_of, strict=True):
                    last[k, sid], turns[k, sid] = len(prompt), turns[k, sid] + 1
            sessions = [(last[key], turns[key]) for key in last]
        else:  # the sessions as the job has them (a fidelity rung's first few), before their replay
            sessions = [(vram.memory_at(n, max_new_tokens, t, context)[0], t) for n, t in self._scripts() if n]
        positions = sum(n + max_new_tokens - 1 + max(t - 1, 0) * max_new_tokens for n, t in sessions)
        return positions, max(sum(t for _, t in sessions), 1)

    def _scripts(self) -> list[tuple[int, int]]:
        """Each session's whole script in tokens (``self.sets`` outside a job's replay) and its model turns."""
        import engine

        return [(len(script), engine.session_turns(p)) for (_, scripts), (_, ps) in
                zip(self.sets, self.sessions, strict=True) for script, p in zip(scripts, ps, strict=True)]

    def _context(self) -> int | None:
        """The target's context in tokens (None when unknown)."""
        return getattr(getattr(self.pair.target, "cfg", None), "max_position_embeddings", None)

    def limits(self) -> dict[str, Any]:
        """What a sweep checks before it creates anything: the target's context (tokens; None when
        unknown) and the longest prompt of the workloads, in tokens; and what decides which search
        dimensions matter (``autotune.dimensions``): whether the target carries recurrent state and
        whether a prompt has tools; and how the target holds its weights (:meth:`weights`: the
        report's model line, and whether a native load would keep any projection in blocks)."""
        import engine

        return {"context": self._context(),
                "longest_prompt": max((len(p) for _, ps in self.sets for p in ps), default=0),
                "recurrent_state": bool(getattr(self.pair.target, "has_recurrent", False)),
                "tools": self._has_tools, "weights": self.weights(),
                # a session workload's most model turns (0: prompts): where vram.memory_at plans its last request
                "session_turns": max((engine.session_turns(p) for _, ps in self.sessions for p in ps), default=0),
                # ... and its longest first request, what must fit the context (sweep._check_fits)
                **({"longest_first_request": self._first_request} if self.session_mode else {})}

    def environment(self) -> dict[str, Any]:
        """What an AR measurement here depends on beyond the job and the experiment: the host, the
        accelerator (the GPU's name and UUID, or the device type), the device and dtype the pair
        really got, torch's threads and version, the measuring code (:func:`code_hash`), and the
        loop and kernels AR takes on this machine (``ENGINE_KERNELS``, Triton, graphs). Part of a
        baseline's identity (``autotune.sweep``)."""
        import torch

        import engine

        device = str(self.pair.device)
        accelerator, gpu = device.split(":")[0], None
        if device.startswith("cuda"):
            props = torch.cuda.get_device_properties(device)
            accelerator, gpu = props.name, str(getattr(props, "uuid", "")) or None  # one physical GPU of several
        cfg = engine.EngineConfig.from_dict(self.ar_config(), source="AR baseline")
        try:
            loop, kernels = self.pair.decode_paths(cfg, cfg.grammar != "off" and self._has_tools)
        except engine.EngineInputError:  # AR refused as fixed here: its baseline fails, none is reused
            loop = kernels = None
        return {"host": socket.gethostname(), "accelerator": accelerator, "gpu_uuid": gpu, "device": device,
                "dtype": str(self.pair.dtype), "threads": torch.get_num_threads(), "torch": torch.__version__,
                "code": code_hash(), "loop": loop, "kernels": kernels}

    def weights(self) -> dict[str, Any]:
        """How the pair holds its target's weights, in brief (``Pair.weight_summary`` without the
        per-tensor lists): ``mode`` (``engine.WEIGHTS``), ``formats`` (block format -> projections
        kept in it), ``fallback`` (file type -> projections ``native`` could not keep),
        ``native_projections`` (how many weights, projections and an untied embedding, a native load holds
        in blocks, whichever form is loaded: 0
        makes the ``weights`` dimension moot, ``autotune.dimensions``), ``operand_projections`` (of those,
        the ones held as the planes of the decode into the matrix unit's registers: an sm_90 GPU in bf16),
        ``native_bytes`` and ``weight_bytes``. Reported to the driver in :meth:`limits` (``Executor.describe``)."""
        summary = self.pair.weight_summary()
        fallback = Counter(summary["fallback"].values())
        return {"mode": summary["mode"], "formats": dict(summary["formats"]),
                "fallback": dict(sorted(fallback.items())), "native_projections": int(summary["native_projections"]),
                "operand_projections": len(summary.get("operand", {})),
                "native_bytes": int(summary["native_bytes"]), "weight_bytes": int(summary["weight_bytes"])}

    @classmethod
    def load(cls, target: str, draft: str, device: str, dtype: str, workloads: Sequence[Any],
             fixed: dict[str, Any], *, weights: str = "dequantized", **kw: Any) -> Worker:
        """The pair loaded once (``engine.load``; ``weights``: ``ModelSpec.weights``), wrapped."""
        import engine

        return cls(engine.load(target, draft, device=device, dtype=dtype, weights=weights), workloads, fixed, **kw)

    def ar_config(self, config: dict[str, Any] | None = None) -> dict[str, Any]:
        """AR under the fixed fields and the implementation paths ``config`` decodes with here
        (``Pair.ar_twin``: the loop it takes, which under ``draft_path="auto"`` may be the generic
        one, and the kernels): in bf16 two loops or two kernel sets round differently, so a
        speculative config is exact when it equals AR decoded the same way."""
        import engine

        paths = {k: config[k] for k in ("draft_path", "kernels", "weights") if config and k in config}
        ar = {**self.fixed, **paths, "verify": "ar"}
        if config and "draft_path" in config:
            cfg = engine.EngineConfig.from_dict({**self.fixed, **config}, source="AR reference")
            ar["draft_path"] = self.pair.ar_twin(cfg, cfg.grammar != "off" and self._has_tools).draft_path
        return ar

    def reference(self, max_new_tokens: int, config: dict[str, Any] | None = None,
                  prefix_cache_mb: float = 0.0) -> list[list[list[int]]]:
        """The AR outputs (the ground truth for exactness), computed once per length and per way
        of decoding that actually differs on this machine (on a CPU every AR config runs the same
        loop and kernels: one reference). For sessions: each turn's, session after session, on the
        requests of the baseline AR's replay (``_replay``; ``prefix_cache_mb``: through a prefix
        cache of that budget), decoded by this config's AR twin."""
        import engine

        cfg = engine.EngineConfig.from_dict(self.ar_config(config), source="AR reference")
        key = self._reference_key(max_new_tokens, cfg, prefix_cache_mb)
        if key not in self._reference:
            if self.session_mode:
                replays, own = self._replay(max_new_tokens, prefix_cache_mb), cfg == self._replay_config()
                self._reference[key] = [
                    r.outputs if own else engine.bench(
                        self.pair, cfg, r.prompts, max_new_tokens, prefix_cache=sess.prefix_cache(prefix_cache_mb),
                        on_prompt=self._ticker("AR outputs", name)).outputs
                    for (name, _), r in zip(self.sessions, replays, strict=True)]
            else:
                self._reference[key] = [engine.bench(self.pair, cfg, prompts, max_new_tokens,
                                                     on_prompt=self._ticker("AR outputs", name)).outputs
                                        for name, prompts in self.sets]
        return self._reference[key]

    def _pair_for(self, config: dict[str, Any]) -> Any:
        """The pair holding the target's weights as ``config`` names them (``EngineConfig.weights``;
        None: the loaded pair). The other form is loaded on first use and kept: a study searching
        ``weights`` holds both pairs' weights (docs/measurement.md). A switch releases the buffers
        and graph pools of the pair the last job ran on, so that only its weights stay on the device,
        and a measured peak leaves them out (``_idle_pair_bytes``)."""
        import engine

        want = config.get("weights")
        chosen = self.pair if want is None else self._pairs.get(want)
        if chosen is None:
            p = self.pair
            chosen = self._pairs[want] = engine.load(p.target_name, p.draft_name, device=p.device, dtype=p.dtype,
                                                     weights=want)
        if self._last_pair is not None and chosen is not self._last_pair:
            engine.release_memory(self._last_pair)
            self._reserved = None
        self._last_pair = chosen
        return chosen

    def pair_for(self, weights: str) -> Any:
        """The pair holding the target's weights as ``weights`` (``engine.WEIGHTS``) says, loaded once as
        a job naming that form loads it (``autotune plan`` plans each searched form on its own pair)."""
        return self._pair_for({"weights": weights})

    def _idle_pair_bytes(self) -> int:
        """Bytes the pairs of the other weight forms hold (``engine.held_memory``: their weights, since a
        switch released their buffers), which a device's peak counts beside the job's pair."""
        import engine

        return sum(sum(engine.held_memory(p).values()) for p in self._pairs.values() if p is not self.pair)

    def _reference_key(self, max_new_tokens: int, cfg: Any, prefix_cache_mb: float) -> tuple[Any, ...]:
        """What AR's outputs depend on here: the length, a rung's slice, the loop and kernels, and for
        sessions whether a prefix cache prefills them (in the decode steps' form)."""
        sliced = tuple(len(ps) for _, ps in (self.sessions if self.session_mode else self.sets))
        return (max_new_tokens, sliced, getattr(self.pair, "weights", None),
                *self.pair.decode_paths(cfg, cfg.grammar != "off" and self._has_tools),
                *((prefix_cache_mb > 0,) if self.session_mode else ()))

    def _session_turns(self, job: Job, cfg: Any, rec: Record, at: tuple[int, int] | None,
                       constrained: bool) -> tuple[int, int] | None:
        """A session job's turns as its prompt sets (``_turn_sets``), and where its memory is planned:
        ``at``, or the longest request AR's replay sent where a reply re-encoded longer than the plan
        allowed (``vram.memory_at``), planned again (``rec.over_vram`` set when that is over the limit)."""
        import engine

        self._turn_sets(job.max_new_tokens, self._cache_mb)
        longest = max((len(p) for _, ps in self.sets for p in ps), default=0)
        if at is None or longest <= at[0]:
            return at
        at = (longest, at[1])
        rec.memory = engine.plan_memory(self.pair, cfg, *at, constrained=constrained,
                                        **self._cache_plan(self._cache_mb, job.max_new_tokens, True)).to_dict()
        rec.over_vram = vram.over_reason(rec.memory, job.vram_limit)
        return at

    def _cache_plan(self, cache_mb: float, max_new_tokens: int, replayed: bool = False) -> dict[str, Any]:
        """``plan_memory``'s prefix cache keywords for a job: its budget and, for sessions, what the cache
        keeps of them all (``cache_load``; ``replayed``: from the job's replay)."""
        positions, generations = self.cache_load(max_new_tokens, self._context(), replayed) if cache_mb else (None, 1)
        return {"prefix_cache_bytes": sess.cache_bytes(cache_mb), "prefix_cache_tokens": positions,
                "prefix_cache_generations": generations}

    def _replay_config(self) -> Any:
        """The AR config whose replay fixes a session workload's requests: the baseline's."""
        import engine

        return engine.EngineConfig.from_dict(self.ar_config(), source="AR baseline")

    def _replay(self, max_new_tokens: int, prefix_cache_mb: float) -> list[Any]:
        """The sessions replayed once by the baseline's AR (its own replies fed back), per set: every
        turn's request, the same for every config of this length, slice and weights (a config on
        another loop or kernels is exact against its AR twin on these requests, not on a replay of
        its own, whose bf16 replies could differ)."""
        import engine

        key = (max_new_tokens, tuple(len(ps) for _, ps in self.sessions), getattr(self.pair, "weights", None),
               prefix_cache_mb > 0)
        if key not in self._replays:
            self._replays[key] = [engine.replay_sessions(self.pair, self._replay_config(), sessions, max_new_tokens,
                                                         sess.prefix_cache(prefix_cache_mb),
                                                         on_turn=self._ticker("AR sessions", name))
                                  for name, sessions in self.sessions]
        return self._replays[key]

    def _turn_sets(self, max_new_tokens: int, prefix_cache_mb: float) -> None:
        """A session job measures the turns of the baseline AR's replay: they become the job's prompt
        sets (``measure`` restores the sessions' after the job)."""
        replays = self._replay(max_new_tokens, prefix_cache_mb)
        self.sets = [(name, list(r.prompts)) for (name, _), r in zip(self.sessions, replays, strict=True)]
        self._session_of = [list(r.session_of) for r in replays]
        self._cut = {f"{name}[{i}]": why for (name, _), r in zip(self.sessions, replays, strict=True)
                     for i, why in r.cut.items()}

    def _ticker(self, stage: str, set_name: str) -> Callable[[int, int], None] | None:
        """``engine.bench``'s ``on_prompt`` for the current job's progress callback (None: none)."""
        tell = self._on_progress
        if tell is None:
            return None
        return lambda done, total: tell(f"{stage}: {set_name} {done}/{total}")

    def measure(self, job: Job, on_first_pass: PassCallback | None = None,
                on_progress: ProgressCallback | None = None) -> Record:
        """Run the protocol; any failure of the engine becomes a failed record, never a crash.
        ``on_progress`` is told each pass and prompt as it ends (:data:`ProgressCallback`)."""
        self._on_progress = on_progress
        rec = Record(trial=job.trial, role=job.role, worker=self.id, config=dict(job.config), rung=job.rung,
                     device=self.pair.device, dtype=self.pair.dtype)
        self._engine_s = 0.0
        t0 = time.perf_counter()
        with Utilisation(self.pair.device) as util:
            every_prompt, every_session, loaded = self.sets, self.sessions, self.pair
            try:
                self.pair = self._pair_for(job.config)  # (the weights it names: another pair, loaded once)
                if job.prompts is not None:  # a fidelity rung: the first prompts of every set, for this job
                    self.sets = [(name, prompts[:job.prompts]) for name, prompts in every_prompt]
                    self.sessions = [(name, sessions[:job.prompts]) for name, sessions in every_session]
                self._measure(job, rec, on_first_pass)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # one broken config must not end an overnight sweep
                rec.ok = False
                where = traceback.extract_tb(exc.__traceback__)[-1]
                rec.fail_reason = (f"{type(exc).__name__}: {exc} "
                                   f"(at {os.path.basename(where.filename)}:{where.lineno})")
                rec.device_unusable = device_unusable(exc)
                _free_device_memory(self.pair.device)
            finally:
                self.sets, self.sessions, self.pair = every_prompt, every_session, loaded
                self._on_progress = None  # this job's: nothing may tell it once the job is over
        rec.elapsed_s = time.perf_counter() - t0
        rec.engine_s = self._engine_s
        rec.utilisation = util.result
        return rec

    def _measure(self, job: Job, rec: Record, on_first_pass: PassCallback | None) -> None:
        import engine

        cfg = engine.EngineConfig.from_dict(job.config, source=f"trial {job.trial}")
        constrained = cfg.grammar != "off" and self._has_tools
        rec.refused = self.pair.refusal(cfg, constrained)
        if rec.refused is not None:
            return
        at = job.memory_at
        cache_mb = self._cache_mb = job.prefix_cache_mb if self.session_mode else 0.0
        if at is not None:  # the plan first: a config over the limit is refused before anything runs
            rec.memory = engine.plan_memory(self.pair, cfg, *at, constrained=constrained,
                                            **self._cache_plan(cache_mb, job.max_new_tokens)).to_dict()
            rec.over_vram = vram.over_reason(rec.memory, job.vram_limit)
            if rec.over_vram is not None:
                return
        known = len(self._reference)
        reference = self.reference(job.max_new_tokens, cfg.to_dict(), cache_mb)
        if self.session_mode:
            at = self._session_turns(job, cfg, rec, at, constrained)
            if rec.over_vram is not None:
                return
        if at is None:
            self._reserved = None
        elif (cfg, at) != self._reserved or len(self._reference) != known:
            # this config's buffers alone, at the planned length: no other config's graphs or workspace
            # (nor the AR reference's just decoded) in its peak; kept for its next job (a rung, the full)
            engine.reserve_memory(self.pair, cfg, *at, constrained, prefix_cache=cache_mb > 0)
            self._reserved = (cfg, at)
        for w in range(job.warmup):
            self._pass(cfg, job.max_new_tokens, f"warm-up {w + 1}/{job.warmup}")
        passes = []
        for i in range(job.repeats):
            passes.append(self._pass(cfg, job.max_new_tokens, f"pass {i + 1}/{job.repeats}"))
            if i == 0 and on_first_pass is not None and on_first_pass(self._per_unit_tps(passes[0])):
                rec.pruned = True
                break
        if not rec.pruned and job.remeasure_if_noisy:
            first = measure.score([self._objective_tps(p) for p in passes], job.max_rel_mad)
            if first.noisy:
                rec.remeasured = True
                passes += [self._pass(cfg, job.max_new_tokens, f"noisy, pass {job.repeats + i + 1}/{2 * job.repeats}")
                           for i in range(job.repeats)]
        diverged = self._fill(rec, passes, reference)
        if at is not None and _peak_is_allocated(self.pair.device):  # before forensics add graphs
            # the other weight form's pair, held for its own configs, is in the device's peak but not in
            # this config's: left out of the breakdown and the verdict, and said (idle_pair_bytes)
            idle = self._idle_pair_bytes()
            measured = engine.measure_memory(self.pair, cfg, *at, rec.peak_memory_bytes - idle, constrained,
                                             prefix_cache_held=max(r.prefix_cache_bytes for p in passes for r in p))
            rec.memory = {**measured.to_dict(), "planned_total": rec.memory["total"],  # the plan, to compare
                          "idle_pair_bytes": idle}
        if not rec.pruned and job.rung is None:  # a pruned trial records no exactness (sweep.tell); a rung
            # is cheap on purpose: the full measurement diagnoses its divergences
            self._diagnose(rec, cfg, reference, diverged)

    def _pass(self, cfg: Any, max_new_tokens: int, stage: str) -> list[Any]:
        """One pass over every set (a session set's turns in order, through one fresh prefix cache of
        the job's budget)."""
        import engine

        t0 = time.perf_counter()
        try:
            return [engine.bench(self.pair, cfg, prompts, max_new_tokens, on_prompt=self._ticker(stage, name),
                                 prefix_cache=sess.prefix_cache(self._cache_mb) if self.session_mode else None)
                    for name, prompts in self.sets]
        finally:
            self._engine_s += time.perf_counter() - t0

    def _objective_tps(self, results: Sequence[Any]) -> float:
        """The rate one pass is scored by: session tok/s for sessions, else decode tok/s."""
        return sess.pass_session_tps(results) if self.session_mode else pass_tps(results)

    def _per_unit_tps(self, results: Sequence[Any]) -> list[float]:
        """What the pruner compares after the first pass: each session's rate, else each prompt's."""
        return [v for r, of in zip(results, self._session_of, strict=True) for v in sess.per_session_tps(r, of)] \
            if self.session_mode else per_prompt_tps(results)

    def _diagnose(self, rec: Record, cfg: Any, reference: list[list[list[int]]],
                  diverged: dict[tuple[int, int], list[int]]) -> None:
        """Forensics of each inexact prompt (its first differing output), outside the measured passes."""
        import engine
        from engine import VERDICTS

        ar_cfg = engine.EngineConfig.from_dict(self.ar_config(cfg.to_dict()), source="AR reference")
        t0 = time.perf_counter()
        todo = list(diverged.items())[:MAX_DIAGNOSED]
        try:
            for k, ((j, i), out) in enumerate(todo):
                name, prompts = self.sets[j]
                if self._on_progress is not None:
                    self._on_progress(f"first divergences: {k + 1}/{len(todo)}")
                div = engine.diagnose(self.pair, cfg, prompts[i], out, reference[j][i],
                                      grammar=self.pair.grammar_of(prompts[i], cfg), ar_config=ar_cfg)
                rec.divergences.append({"prompt": f"{name}[{i}]", **div.to_dict()})
        finally:
            self._engine_s += time.perf_counter() - t0
        if rec.exact_match is not None:
            counts = Counter(d["verdict"] for d in rec.divergences)
            rec.divergence_verdicts = {v: counts[v] for v in VERDICTS}

    def _fill(self, rec: Record, passes: list[list[Any]],
              reference: list[list[list[int]]]) -> dict[tuple[int, int], list[int]]:
        """The record's numbers from the passes; returns the first differing output of each inexact
        prompt, keyed by (set, prompt)."""
        from engine import first_divergence

        rec.decode_tps_runs = [pass_tps(p) for p in passes]
        rec.e2e_tps_runs = [sum(r.new_tokens for r in p) / max(sum(r.total_s for r in p), 1e-12) for p in passes]
        # Greedy decoding makes every pass commit the same steps, so the first pass's step record
        # stands for all of them; times are medians over passes.
        first = passes[0]
        rec.accept_lengths = [a for r in first for a in r.accept_lengths]
        rec.steps = sum(r.steps for r in first)
        rec.acceptance_length = sum(rec.accept_lengths) / len(rec.accept_lengths) if rec.accept_lengths else 1.0
        rec.al_histogram = {str(k): v for k, v in sorted(Counter(rec.accept_lengths).items())}
        policy = policy_record(first)
        rec.budget_histogram = policy["budget_histogram"]
        rec.policy_predicted_al, rec.policy_observed_al = policy["policy_predicted_al"], policy["policy_observed_al"]
        rec.step_ms = statistics.median(pass_step_ms(p) for p in passes)
        phases = first[0].phase_ms.keys()
        rec.phase_ms_per_step = {
            k: statistics.median(sum(r.phase_ms[k] for r in p) / max(sum(r.steps for r in p), 1) for p in passes)
            for k in phases
        }
        rec.per_prompt_tps = [statistics.median(vals) for vals in zip(*(per_prompt_tps(p) for p in passes),
                                                                      strict=True)]
        if self.session_mode:
            self._fill_sessions(rec, passes)
        rec.peak_memory_bytes = max(r.peak_memory_bytes for p in passes for r in p)
        rec.loops = dict(sum((Counter(r.loops) for r in first), Counter()))
        exact, checked, divergences = 0, 0, []
        diverged: dict[tuple[int, int], list[int]] = {}
        for p in passes:
            for j, ((name, _), r, ref) in enumerate(zip(self.sets, p, reference, strict=True)):
                for i, (out, want) in enumerate(zip(r.outputs, ref, strict=True)):
                    checked += 1
                    div = first_divergence(out, want)
                    if div is None:
                        exact += 1
                    else:
                        divergences.append(div)
                        diverged.setdefault((j, i), list(out))
                        tag = f"{name}[{i}]@{div}"
                        if tag not in rec.inexact_prompts:
                            rec.inexact_prompts.append(tag)
        rec.exact_match = exact / checked if checked else None
        rec.first_divergence = min(divergences) if divergences else None
        rec.inexact_count = len(diverged)
        for j, (name, _) in enumerate(self.sets):
            results = [p[j] for p in passes]
            als = list(results[0].accept_lengths)
            rec.per_set[name] = {
                "decode_tps_median": statistics.median(r.decode_tps for r in results),
                "acceptance_length": sum(als) / len(als) if als else 1.0,
                "step_ms": statistics.median(r.step_ms for r in results),
                "accept_lengths": als,
                "n_prompts": len(results[0].prompts),
                **policy_record(results[:1]),
                **(sess.set_figures(results, self._session_of[j]) if self.session_mode else {}),
            }
        return diverged

    def _fill_sessions(self, rec: Record, passes: list[list[Any]]) -> None:
        """A session job's own figures (``Record.session_tps_runs`` and the rest)."""
        rec.session_tps_runs = [sess.pass_session_tps(p) for p in passes]
        rec.per_session_tps = [statistics.median(vals) for vals in zip(*(self._per_unit_tps(p) for p in passes),
                                                                       strict=True)]
        rec.ttft_first_ms, rec.ttft_later_ms = sess.ttft_ms([r for p in passes for r in p],
                                                            [of for _ in passes for of in self._session_of])
        rec.cached_share_later = sess.cached_share(passes[0], self._session_of)
        rec.turns = sum(len(of) for of in self._session_of)
        rec.sessions_cut = dict(self._cut)


@functools.cache
def code_hash() -> str:
    """The code that measures, hashed: every source file of the ``engine`` package, this module,
    ``autotune.measure`` (the protocol) and ``autotune.record`` (how a pass is scored). Unlike the git
    commit it is blind to commits that touch nothing here and sees uncommitted edits; a baseline is
    reused only by the same code."""
    import engine

    root = Path(engine.__file__).resolve().parent
    files = [(f"engine/{f.relative_to(root).as_posix()}", f) for f in sorted(root.rglob("*.py"))]
    files += [(f"autotune/{Path(m).name}", Path(m)) for m in (__file__, measure.__file__, record.__file__)]
    h = hashlib.sha256()
    for name, path in files:
        h.update(f"{name}\0{path.stat().st_size}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def device_unusable(exc: BaseException) -> bool:
    """Whether an engine error leaves the accelerator in a state no later trial can trust."""
    text = f"{type(exc).__name__}: {exc}"
    return type(exc).__name__ == "AcceleratorError" or any(m.lower() in text.lower() for m in _DEVICE_FATAL)


def _peak_is_allocated(device: str) -> bool:
    """Whether a pass's peak (``BenchResult.peak_memory_bytes``) is the device allocator's
    (``torch.cuda.max_memory_allocated``), the measured breakdown's source; elsewhere it is the
    process's resident set, and the plan stands."""
    return str(device).startswith("cuda")


def _free_device_memory(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        try:
            torch.cuda.empty_cache()
        except RuntimeError:
            pass  # a poisoned context refuses this too; the record already says why
