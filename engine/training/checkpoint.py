"""Resumable draft training: everything a run needs to continue bit for bit, written atomically.

A checkpoint folder holds ``checkpoint.json`` (the manifest: config, step, held-out history, the
calls so far, and the parts with their SHA-256) and the parts ``state-<step>-<tag>.NNN``: one
``torch.save`` payload (draft weights, AdamW moments, RNG states, loss history, best draft) cut
into pieces of at most ``part_mb`` MiB, so each travels as its own file. Parts are written first
under new names, the manifest last by rename: a process killed mid-write leaves the previous
checkpoint whole, and the stale parts go only once a new manifest names their successors.

The data order is the sampler generator's state: batches and anchors are drawn from it, so
restoring it (with the same data, checked by fingerprint) continues the same draw.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from engine.config import EngineInputError
from engine.models.dense import DenseModel
from engine.training.quantized_state import decode_moments, encode_moments

FORMAT = 1
MANIFEST = "checkpoint.json"
# TrainConfig fields a resumed run may change: none of them alters what a step computes given
# the data (which a fingerprint pins). ``steps`` moves the end (the cosine is recomputed over
# the new total, so the learning rate follows the new curve from the step reached);
# ``time_budget_s`` only ends a call; ``val_every`` only says when held-out blocks (drawn once,
# from their own seed) are scored; ``feature_store`` only says where the same features live;
# the generation fields only shape data that the fingerprint checks anyway.
RESUMABLE_CHANGES = frozenset({"steps", "time_budget_s", "val_every", "feature_store", "gen_batch_size",
                               "gen_max_new_tokens"})
HISTORY_KEYS = ("loss", "acc1", "chain_al")
# --state-dtype: the weights' dtype in the checkpoint; int8 stores the AdamW moments as 8-bit codes
# (quantized_state.py) beside bfloat16 weights.
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.bfloat16}


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often a run writes its resumable state."""

    dir: Path
    every: int = 500  # steps between checkpoints (one is also written when a call ends)
    part_mb: float = 15.0  # largest part file, MiB (a device call brings files of at most 16 MiB back)
    # float32: a resume is exact. bfloat16 halves the checkpoint (weights, best weights and AdamW
    # moments rounded once per checkpoint, float32 again on resume): for a state that must travel
    # through size-capped transfers, where a GPU run is not bitwise reproducible anyway. int8: a
    # third of float32's bytes (bfloat16 weights, 8-bit blockwise moments), a resume as close.
    state_dtype: str = "float32"

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise EngineInputError(f"--checkpoint-every must be a positive integer, got {self.every!r}")
        if not self.part_mb >= 0.001:
            raise EngineInputError(f"--part-mb must be at least 0.001 (MiB), got {self.part_mb!r}")
        if self.state_dtype not in STATE_DTYPES:
            raise EngineInputError(f"--state-dtype must be one of {list(STATE_DTYPES)}, got {self.state_dtype!r}")


@dataclass
class RunState:
    """The mutable progress of one training run, across all its calls."""

    step: int = 0  # optimizer steps done
    train_seconds: float = 0.0  # training time of the calls before this one
    history: list[dict[str, float]] = field(default_factory=list)  # per step: HISTORY_KEYS
    val_history: list[dict[str, Any]] = field(default_factory=list)
    best: tuple[float, int, dict[str, Tensor]] | None = None  # (held-out loss, step, weights)
    calls: list[dict[str, Any]] = field(default_factory=list)  # one record per call: the resume history
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])


def rng_states(sampler: torch.Generator) -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "sampler": sampler.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_states(states: Mapping[str, Any], sampler: torch.Generator) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    sampler.set_state(states["sampler"])
    if states["cuda"] and torch.cuda.is_available():
        saved = states["cuda"]  # a machine with fewer (or more) GPUs: the ones both have
        for i in range(min(len(saved), torch.cuda.device_count())):
            torch.cuda.set_rng_state(saved[i], i)


def data_fingerprint(tokens: Tensor, lens: Tensor, prompt_lens: Tensor, sampled: Sequence[bool] = ()) -> str:
    """SHA-256 of the training sequences as trained on (after the --max-seq-len cut) and, where any answer
    was sampled, which ones (they are held out and scored apart: a run resumes on the same split); all
    greedy, the fingerprint of the sequences alone, as before the flags were kept."""
    h = hashlib.sha256()
    for t in (tokens, lens, prompt_lens):
        h.update(t.detach().to("cpu", torch.int64).numpy().tobytes())
    if any(sampled):
        h.update(bytes(bool(f) for f in sampled))
    return h.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def save_checkpoint(ck: CheckpointConfig, state: RunState, draft: torch.nn.Module, opt: torch.optim.Optimizer,
                    sampler: torch.Generator, meta: Mapping[str, Any]) -> Path:
    """Write ``state`` and the model/optimizer/RNG state into ``ck.dir``; ``meta`` (the config,
    mask token, target and data fingerprints) goes into the manifest as it is. Returns the manifest."""
    ck.dir.mkdir(parents=True, exist_ok=True)
    best_is_current = state.best is not None and state.best[1] == state.step
    dtype = STATE_DTYPES[ck.state_dtype]
    moments = encode_moments(opt.state_dict()) if ck.state_dtype == "int8" else _cast(opt.state_dict(), dtype)
    payload = {
        "draft": _cast(draft.state_dict(), dtype),
        "optimizer": moments,
        "rng": rng_states(sampler),
        # float64 keeps every logged float exactly (they are float32 values read back)
        "history": torch.tensor([[h[k] for k in HISTORY_KEYS] for h in state.history], dtype=torch.float64),
        # The best draft is often the current one late in a run: no second copy then.
        "best": None if state.best is None or best_is_current else _cast(state.best[2], dtype),
    }
    buf = io.BytesIO()
    torch.save(payload, buf)
    blob = buf.getvalue()
    size = max(1, int(ck.part_mb * 2**20))
    parts = []
    tag = uuid.uuid4().hex[:8]  # each write's own names: one at the same step never overwrites the live parts
    for i, lo in enumerate(range(0, len(blob), size)):
        name = f"state-{state.step:09d}-{tag}.{i:03d}"
        chunk = blob[lo : lo + size]
        _atomic_write(ck.dir / name, chunk)
        parts.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    manifest = dict(meta) | {
        "format": FORMAT, "state_dtype": ck.state_dtype, "run_id": state.run_id, "step": state.step,
        "train_seconds": state.train_seconds,
        "val_history": state.val_history, "calls": state.calls,
        "best": None if state.best is None else {"loss": state.best[0], "step": state.best[1],
                                                 "is_current": best_is_current},
        "parts": parts, "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
    }
    path = ck.dir / MANIFEST
    _atomic_write(path, (json.dumps(manifest, indent=1) + "\n").encode())
    keep = {p["name"] for p in parts}
    for old in [*ck.dir.glob("state-*.*"), *ck.dir.glob(".state-*.tmp-*")]:  # superseded, or a killed write's
        if old.name not in keep:
            old.unlink(missing_ok=True)
    return path


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with its float32 tensors in ``dtype`` (step counters and the like stay as they are)."""
    if dtype == torch.float32:
        return tree
    if isinstance(tree, Tensor):
        return tree.to(dtype) if tree.dtype == torch.float32 and tree.ndim > 0 else tree
    if isinstance(tree, dict):
        return {k: _cast(v, dtype) for k, v in tree.items()}
    return tree


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of the checkpoint in ``folder``; an error naming the file when it is not one."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise EngineInputError(f"--resume {str(folder)!r}: no {MANIFEST} there; a checkpoint folder is what "
                               f"train-draft --checkpoint-dir writes")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EngineInputError(f"{path}: not JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise EngineInputError(f"{path}: 'format' must be {FORMAT}, got {got!r}")
    for key in ("config", "step", "parts", "sha256", "run_id", "data", "target", "mask_token_id"):
        if key not in manifest:
            raise EngineInputError(f"{path}: key {key!r} is missing")
    return manifest


def check_resumable(manifest: Mapping[str, Any], folder: Path, cfg: Any, mask_token_id: int | None = None,
                    target: Mapping[str, Any] | None = None, data: str | None = None) -> None:
    """Refuse to continue ``manifest``'s run with a different config, mask token, target or data,
    naming the field and both values. Only ``RESUMABLE_CHANGES`` may differ."""
    where = Path(folder) / MANIFEST
    saved = manifest["config"]
    for f in fields(cfg):
        if f.name in RESUMABLE_CHANGES:
            continue
        new = getattr(cfg, f.name)
        if f.name not in saved or saved[f.name] != new:
            flag = "--" + f.name.replace("_", "-")
            raise EngineInputError(
                f"--resume: {where} was trained with {f.name}={saved.get(f.name, '<absent>')!r}, this run asks "
                f"for {f.name}={new!r} ({flag}); a resumed run must match it (only "
                f"{', '.join(sorted(RESUMABLE_CHANGES))} may change)")
    checks = (("mask_token_id", mask_token_id), ("target", target), ("data", data))
    for key, new in checks:
        if new is not None and manifest[key] != new:
            hint = " (give the sequences it trained on: --data FILE, as --save-data wrote it)" if key == "data" else ""
            raise EngineInputError(f"--resume: {where} has {key} {manifest[key]!r}, this run has {new!r}{hint}")
    if cfg.steps < manifest["step"]:
        raise EngineInputError(f"--resume: {where} is at step {manifest['step']}, past --steps {cfg.steps}; "
                               f"give --steps of at least {manifest['step']}")


def load_checkpoint(folder: Path, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """Join the parts the manifest names, check each one's SHA-256 and the whole's, and load the payload."""
    folder = Path(folder)
    chunks = []
    for p in manifest["parts"]:
        path = folder / p["name"]
        if not path.is_file():
            raise EngineInputError(f"--resume: part {p['name']} of {folder / MANIFEST} is missing "
                                   f"(step {manifest['step']}, {len(manifest['parts'])} parts); copy every "
                                   f"state-{manifest['step']:09d}-* file next to the manifest")
        chunk = path.read_bytes()
        if len(chunk) != p["bytes"] or hashlib.sha256(chunk).hexdigest() != p["sha256"]:
            raise EngineInputError(f"--resume: part {path} is corrupt: {len(chunk)} bytes with SHA-256 "
                                   f"{hashlib.sha256(chunk).hexdigest()[:16]}..., the manifest says {p['bytes']} "
                                   f"bytes, {p['sha256'][:16]}...")
        chunks.append(chunk)
    blob = b"".join(chunks)
    if hashlib.sha256(blob).hexdigest() != manifest["sha256"]:
        raise EngineInputError(f"--resume: the joined parts of {folder / MANIFEST} do not match its sha256")
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)


def restore(payload: Mapping[str, Any], manifest: Mapping[str, Any], draft: torch.nn.Module,
            opt: torch.optim.Optimizer, sampler: torch.Generator) -> RunState:
    """Put the checkpoint back into ``draft``, ``opt`` and the RNGs; the run's state to continue from."""
    draft.load_state_dict(payload["draft"])
    opt.load_state_dict(decode_moments(payload["optimizer"]))  # int8 moments back to float32
    set_rng_states(payload["rng"], sampler)
    history = [dict(zip(HISTORY_KEYS, row, strict=True)) for row in payload["history"].tolist()]
    best = None
    if manifest["best"] is not None:
        b = manifest["best"]
        weights = payload["best"]
        if b["is_current"]:
            weights = {k: v.detach().clone() for k, v in draft.state_dict().items()}
        best = (b["loss"], b["step"], weights)
    return RunState(step=manifest["step"], train_seconds=manifest["train_seconds"], history=history,
                    val_history=list(manifest["val_history"]), best=best, calls=list(manifest["calls"]),
                    run_id=manifest["run_id"])


def target_record(target: DenseModel) -> dict[str, Any]:
    """What identifies the target for a resumed run: its config, and a hash of a strided sample of
    its embedding (rounded to bfloat16, so the same weights loaded in float32 or bfloat16 agree)."""
    embed = target.embed_tokens
    if isinstance(embed, nn.Embedding):
        w = embed.weight.detach().flatten()
        sample = w[:: max(1, w.numel() // 65536)]
    else:  # kept in blocks (``QuantEmbedding``): the same sample of its values, without the whole float table
        numel = embed.num_embeddings * embed.embedding_dim
        at = torch.arange(0, numel, max(1, numel // 65536), device=embed.device)
        sample = torch.cat([embed(part // embed.embedding_dim).gather(1, (part % embed.embedding_dim)[:, None])[:, 0]
                            for part in at.split(4096)])  # (4,096 rows at a time)
    sample = sample.to(torch.bfloat16).float().cpu()
    return {"config": json.loads(json.dumps(asdict(target.cfg))),
            "embedding_sample_sha256": hashlib.sha256(sample.numpy().tobytes()).hexdigest()[:16]}


def export_draft(folder: Path, out: Path, training: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write the draft a checkpoint holds (its best held-out weights, else its latest) to ``out`` in
    the public DFlash layout, in bfloat16, with ``training`` (a training.json) in its config; no
    target needed. Returns the manifest. For a checkpoint that came back without its draft folder."""
    from engine.loading import save_draft_folder
    from engine.models.draft import DFlashConfig, DFlashDraft

    folder = Path(folder)
    manifest = read_manifest(folder)
    saved = manifest.get("draft_config")
    if saved is None:
        raise EngineInputError(f"{folder / MANIFEST}: no 'draft_config' (written before drafts were recorded); "
                               f"its draft is train-draft --out's folder")
    payload = load_checkpoint(folder, manifest)
    best = manifest.get("best")
    if best is not None and (not isinstance(best, dict) or not isinstance(best.get("is_current"), bool)):
        raise EngineInputError(f"{folder / MANIFEST}: 'best' must be null or an object with a boolean "
                               f"'is_current', got {best!r}")
    weights = payload["draft"] if best is None or best["is_current"] else payload["best"]
    draft = DFlashDraft(DFlashConfig(**{**saved, "target_layer_ids": tuple(saved["target_layer_ids"])}))
    draft.load_state_dict({k: v.float() for k, v in weights.items()})
    save_draft_folder(draft.to(torch.bfloat16), Path(out), extra={"training": dict(training)} if training else None)
    return manifest
