"""Train a DFlash draft for a dense target (SpecForge-style recipe, see docs/algorithms.md).

1. Self-distillation data: the frozen target answers train-split prompts itself (batched greedy
   generation), so the draft learns what the target will actually say.
2. Each step: target features for a batch of sequences (one batched forward), anchors sampled
   among response positions, every anchor a block ``[x_a, MASK x (B-1)]`` at positions a..a+B-1
   seeing the context strictly before a and its own block (block-diagonal mask, many blocks in
   one forward), cross-entropy through the target's frozen lm_head weighted by exp(-(k-1)/gamma).
3. The checkpoint is written in the public DFlash layout.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.config import EngineInputError
from engine.models.common import unfused_state_dict
from engine.models.dense import DenseModel
from engine.models.draft import DFlashConfig, DFlashDraft, default_target_layer_ids
from engine.training.checkpoint import (
    HISTORY_KEYS,
    CheckpointConfig,
    RunState,
    check_resumable,
    data_fingerprint,
    load_checkpoint,
    read_manifest,
    restore,
    save_checkpoint,
    target_record,
)
from engine.training.features import FEATURE_STORES, TokenStore, token_store
from engine.training.progress import ProgressBar, plot_curves

_TRAIN_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class TrainConfig:
    layers: int = 2
    intermediate_size: int | None = None  # None: the target's
    block_size: int = 16
    num_target_ids: int = 5
    num_anchors: int = 32  # per sequence per step
    gamma: float = 7.0
    lr: float = 6e-4
    warmup_steps: int = 30
    steps: int = 600
    batch_size: int = 8  # sequences per step
    max_seq_len: int = 640
    gen_max_new_tokens: int = 256
    gen_batch_size: int = 128
    seed: int = 0
    time_budget_s: float = 0.0  # 0: no limit besides `steps`
    # Held-out sequences (at most VAL_MAX and the rest of the last held-out prompt's answers, none under
    # VAL_MIN_DATA) scored every `val_every` steps; the draft returned is the one with the lowest held-out loss.
    val_fraction: float = 0.02
    val_every: int = 250
    # Where the frozen target features of every training position live: "device" (fastest),
    # "host" (CPU memory, each batch copied over: GPUs too small to hold them), or "auto".
    feature_store: str = "auto"
    # The cosine's horizon: whichever of steps and time_budget_s runs out first, or the steps only
    # (a run resumed over many calls: each call's budget ends the call, not the schedule).
    decay_over: str = "steps-or-time"

    def __post_init__(self) -> None:
        for name in ("layers", "block_size", "num_target_ids", "num_anchors", "steps", "batch_size",
                     "max_seq_len", "gen_max_new_tokens", "gen_batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (2 if name == "block_size" else 1):
                raise EngineInputError(f"TrainConfig.{name} must be a positive integer (block_size >= 2), got {v!r}")
        if not self.lr > 0 or not self.gamma > 0:
            raise EngineInputError(f"TrainConfig: lr and gamma must be > 0, got lr={self.lr}, gamma={self.gamma}")
        if not 0.0 <= self.val_fraction < 0.5:
            raise EngineInputError(f"TrainConfig.val_fraction must be in [0, 0.5), got {self.val_fraction!r}")
        if isinstance(self.val_every, bool) or not isinstance(self.val_every, int) or self.val_every < 1:
            raise EngineInputError(f"TrainConfig.val_every must be a positive integer, got {self.val_every!r}")
        if self.feature_store not in FEATURE_STORES:
            raise EngineInputError(f"TrainConfig.feature_store must be one of {list(FEATURE_STORES)}, "
                                   f"got {self.feature_store!r}")
        if self.decay_over not in DECAY_OVER:
            raise EngineInputError(f"TrainConfig.decay_over must be one of {list(DECAY_OVER)}, got {self.decay_over!r}")


DECAY_OVER = ("steps-or-time", "steps")
VAL_MAX = 256  # held-out sequences at most (scoring them costs a few forwards)
VAL_MIN_DATA = 50  # fewer sequences than this: no held-out set


def new_draft_for(target: DenseModel, cfg: TrainConfig, mask_token_id: int) -> DFlashDraft:
    tc = target.cfg
    draft = DFlashDraft(DFlashConfig(
        hidden_size=tc.hidden_size, num_hidden_layers=cfg.layers, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, intermediate_size=cfg.intermediate_size or tc.intermediate_size,
        vocab_size=tc.vocab_size, target_layer_ids=default_target_layer_ids(tc.num_hidden_layers, cfg.num_target_ids),
        num_target_layers=tc.num_hidden_layers, block_size=cfg.block_size, mask_token_id=mask_token_id,
        head_dim=tc.dim_per_head, rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta,
    ))
    return _init_weights_(draft, cfg.seed)


def _init_weights_(draft: DFlashDraft, seed: int) -> DFlashDraft:
    """A new draft's weights: N(0, 0.02) matrices in name order from ``seed``; norms keep their identity."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(draft.named_parameters(), key=lambda kv: kv[0]):
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return draft


def grow_draft(draft: DFlashDraft, layers: int, seed: int = 0, intermediate_size: int | None = None
               ) -> DFlashDraft:
    """``draft`` grown, computing the same function: ``layers - num_hidden_layers`` new blocks after its
    own, each one's attention output and MLP down projections at zero, so it adds nothing to the
    residual until training moves them (its other weights start as a new draft's); and with
    ``intermediate_size`` above its own every block's MLP widened, the new gate and up rows as a new
    draft's and the down projection's new columns at zero (silu(gate) * up of a new unit meets a zero
    column: nothing added). A warm start keeps what the smaller draft learned and gains the capacity
    of the bigger one (the shipped draft's MLP is 640 wide where its target's is 1,536)."""
    have, width = draft.cfg.num_hidden_layers, draft.cfg.intermediate_size
    wide = width if intermediate_size is None else intermediate_size
    if layers < have:
        raise EngineInputError(f"--layers {layers}: a warm start can add layers to the --init draft's {have}, "
                               f"not remove them")
    if wide < width:
        raise EngineInputError(f"--intermediate-size {wide}: a warm start can widen the --init draft's MLP "
                               f"({width}), not narrow it")
    if layers == have and wide == width:
        return draft
    grown = _init_weights_(DFlashDraft(replace(draft.cfg, num_hidden_layers=layers, intermediate_size=wide)), seed)
    old = unfused_state_dict(draft)
    with torch.no_grad():
        for block in grown.layers[have:]:  # (with their biases: attention_bias drafts have them)
            for out in (block.self_attn.o_proj, block.mlp.down_proj):
                out.weight.zero_()
                if out.bias is not None:
                    out.bias.zero_()
        for i, block in enumerate(grown.layers[:have]):  # the old blocks' MLPs, widened
            mlp, key = block.mlp, f"layers.{i}.mlp."
            mlp.gate_proj.weight[:width].copy_(old.pop(key + "gate_proj.weight"))
            mlp.up_proj.weight[:width].copy_(old.pop(key + "up_proj.weight"))
            mlp.down_proj.weight.zero_()
            mlp.down_proj.weight[:, :width].copy_(old.pop(key + "down_proj.weight"))
    missing, unexpected = grown.load_state_dict(old, strict=False)
    grown_keys = tuple(f"layers.{i}." for i in range(have, layers)) + tuple(
        f"layers.{i}.mlp." for i in range(have))
    if unexpected or not all(k.startswith(grown_keys) for k in missing):
        raise EngineInputError(f"growing the draft: its weights do not map onto the bigger one "
                               f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
    return grown.to(device=next(draft.parameters()).device, dtype=next(draft.parameters()).dtype)


def sample_anchors(prompt_lens: Tensor, lens: Tensor, width: int, n: int,
                   gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Up to ``n`` distinct anchors per sequence among its generated positions with a label after them.

    Returns anchors [b, n] (sorted, unused slots at the end, pointing at 0) and valid [b, n].
    """
    j = torch.arange(width, device=lens.device)
    eligible = (j[None, :] >= prompt_lens[:, None]) & (j[None, :] < lens[:, None] - 1)
    scores = torch.rand(lens.shape[0], width, generator=gen, device=gen.device).to(lens.device)
    scores = torch.where(eligible, scores, -1.0)
    top, idx = scores.topk(min(n, width), dim=1)
    valid = top >= 0
    order = torch.where(valid, idx, width + idx).sort(dim=1).indices
    anchors, valid = idx.gather(1, order), valid.gather(1, order)
    if n > width:  # fewer positions than anchors: pad with unused slots
        pad = n - width
        anchors = torch.cat([anchors, anchors.new_zeros(anchors.shape[0], pad)], 1)
        valid = torch.cat([valid, valid.new_zeros(valid.shape[0], pad)], 1)
    return torch.where(valid, anchors, 0), valid


def block_batch(tokens: Tensor, lens: Tensor, anchors: Tensor, valid: Tensor, block: int,
                mask_token_id: int) -> dict[str, Tensor]:
    """One draft forward for a batch: per sequence its whole context, then its n blocks.

    tokens [b, L] (right-padded), lens [b], anchors/valid [b, n]. Each block ``[x_a, MASK x (B-1)]``
    sits at positions a..a+B-1, sees the context strictly before a and its own block (bidirectional),
    nothing of the other blocks (block-diagonal). Unused anchor slots predict nothing.
    Returns ctx_pos [b, L], q_pos / tokens / labels [b, n*B], mask [b, n*B, L + n*B].
    """
    b, width = tokens.shape
    n = anchors.shape[1]
    k = torch.arange(block, device=tokens.device)
    pos = anchors[:, :, None] + k  # [b, n, B]
    tok = torch.full_like(pos, mask_token_id)
    tok[:, :, 0] = tokens.gather(1, anchors)
    labels = tokens.gather(1, pos.clamp(max=width - 1).view(b, -1)).view(b, n, block)
    labels = torch.where((pos < lens[:, None, None]) & valid[:, :, None], labels, -100)
    labels[:, :, 0] = -100  # slot 0 is the given root, nothing to predict
    ctx_pos = torch.arange(width, device=tokens.device).expand(b, width)
    anchor_of_query = anchors.repeat_interleave(block, dim=1)  # [b, n*B]
    sees_ctx = ctx_pos[:, None, :] < anchor_of_query[:, :, None]
    q_block = torch.arange(n * block, device=tokens.device) // block
    sees_block = (q_block[:, None] == q_block[None, :]).expand(b, -1, -1)
    return dict(ctx_pos=ctx_pos, q_pos=pos.view(b, -1), tokens=tok.view(b, -1), labels=labels.view(b, -1),
                mask=torch.cat([sees_ctx, sees_block], dim=2))


def draft_loss(draft: DFlashDraft, target: DenseModel, batch: dict[str, Tensor], feats: Tensor,
               gamma: float) -> tuple[Tensor, dict[str, float]]:
    """Decayed cross-entropy of every block slot after the root, through the frozen target lm_head."""
    block = draft.cfg.block_size
    h = draft(target.embed_tokens(batch["tokens"]), feats, batch["ctx_pos"], batch["q_pos"], batch["mask"])
    h, labels = h.reshape(-1, h.shape[-1]), batch["labels"].reshape(-1)
    slot = torch.arange(h.shape[0], device=h.device) % block
    keep = slot > 0
    logits = target.lm_head(h[keep]).float()
    labels = labels[keep]
    weights = torch.exp(-(slot[keep] - 1).float() / gamma) * (labels >= 0)
    ce = F.cross_entropy(logits, labels.clamp(min=0), reduction="none")
    loss = (ce * weights).sum() / weights.sum().clamp(min=1e-6)
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels).view(-1, block - 1)
        valid = (labels >= 0).view(-1, block - 1)
        used = valid[:, 0]  # blocks of an unused anchor slot predict nothing
        # Chain acceptance the draft would get on these blocks: accepted prefix + 1.
        reach = (hit | ~valid).long().cumprod(1)[used]
        accepted = reach * valid[used]
        # Per slot: the share of blocks (with a label there) whose accepted prefix reaches it.
        slot_acc = accepted.sum(0).float() / valid[used].sum(0).clamp(min=1)
        packed = torch.cat([torch.stack([loss.detach(), hit[:, 0][used].float().mean(),
                                         accepted.sum(1).float().mean() + 1]), slot_acc])
        loss_v, acc1, chain_al, *slots = packed.tolist()  # one host read for all
    return loss, {"loss": loss_v, "acc1": acc1, "chain_al": chain_al, "slot_acc": slots}


def _starting_draft(target: DenseModel, cfg: TrainConfig, mask_token_id: int, init: DFlashDraft | None
                    ) -> DFlashDraft:
    """A new draft shaped for ``target``, or the warm-start ``init`` in float32 with every weight
    trainable (its block size and mask token must be the ones asked for)."""
    if init is None:
        return new_draft_for(target, cfg, mask_token_id).to(target.device)
    if init.cfg.block_size != cfg.block_size or init.cfg.mask_token_id != mask_token_id:
        raise EngineInputError(
            f"the warm-start draft has block_size {init.cfg.block_size} and mask_token_id "
            f"{init.cfg.mask_token_id}; training asked for {cfg.block_size} and {mask_token_id}")
    draft = init.to(device=target.device, dtype=torch.float32).train()
    for p in draft.parameters():
        p.requires_grad_(True)
    return draft


def learning_rate(cfg: TrainConfig, step: int, elapsed_s: float) -> float:
    """Warm-up, then cosine decay over whichever runs out first: the steps or the time budget
    (``decay_over="steps"``: the steps only, as a run resumed over many calls needs)."""
    progress = step / cfg.steps
    if cfg.time_budget_s and cfg.decay_over == "steps-or-time":
        progress = max(progress, elapsed_s / cfg.time_budget_s)
    return cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def train_draft(
    target: DenseModel,
    sequences: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    cfg: TrainConfig,
    mask_token_id: int,
    log: Callable[[str], None] = print,
    init: DFlashDraft | None = None,
    deadline: float | None = None,
    checkpoint: CheckpointConfig | None = None,
    resume: Path | None = None,
    stop_after: int | None = None,
    progress: bool = False,
    lineage: dict[str, Any] | None = None,
    curves: Path | None = None,
    temperatures: Sequence[float] | None = None,
) -> tuple[DFlashDraft, dict]:
    """Train a draft on (prompt + self-distilled response) token sequences (``temperatures``: each answer's
    sampling temperature, 0 greedy; None: all greedy; the draft is kept by the held-out greedy answers'
    loss, the sampled ones' scored beside it): a new one, or ``init``
    (a trained draft, warm start: its architecture is kept, training continues in float32 with a
    fresh optimiser, warm-up and schedule). ``deadline`` (a ``time.perf_counter()`` value): the
    training time is at most what is left before it once the target features are computed.

    ``checkpoint``: write the resumable state there every ``checkpoint.every`` steps and when this
    call ends; ``resume``: a checkpoint folder to continue from (same config but for
    ``RESUMABLE_CHANGES``, same data, same target), bit for bit as if never stopped.
    ``stop_after``: end this call after that many steps (the schedule still runs over ``cfg.steps``).
    ``progress``: a progress bar on stderr. ``lineage``: what the run started from (kept in the
    checkpoint). ``curves``: where the loss curves (a PNG) go at every checkpoint and when the call ends
    (default: curves.png in the checkpoint folder)."""
    device = target.device
    kept, data, sampled = _device_sequences(sequences, prompt_lens, cfg, device, temperatures)
    lens = torch.tensor([s.numel() for s in data], device=device)
    plens = torch.tensor([p for _, p in kept], device=device)
    tokens_all = torch.cat(data)
    meta = {"config": None, "mask_token_id": mask_token_id, "target": target_record(target),
            "data": data_fingerprint(tokens_all, lens, plens, sampled), "lineage": lineage}
    manifest = _resumable(resume, init, cfg, meta)  # checked before the feature pass, which can take minutes
    # a resumed run continues the checkpoint's draft as built: a warm start's architecture (its
    # target layers, rope, head sizes) is not the one the target's config would give a new draft
    saved = (manifest or {}).get("draft_config")
    draft = _starting_draft(target, cfg, mask_token_id, init) if saved is None else (
        DFlashDraft(DFlashConfig(**{**saved, "target_layer_ids": tuple(saved["target_layer_ids"])})).to(device))
    meta["draft_config"] = asdict(draft.cfg)
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    store = token_store(target, data, tokens_all, lens, plens, draft.cfg.target_layer_ids, cfg.feature_store, log)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)  # the data order and the anchors
    train_idx, val_batches = _held_out(store, cfg, mask_token_id, device, [held_out_key(s[:p]) for s, p in kept],
                                       sampled)
    cfg = _fit_deadline(cfg, deadline, log)
    meta["config"] = asdict(cfg)
    state = RunState()
    if manifest is not None:
        state = restore(load_checkpoint(resume, manifest), manifest, draft, opt, gen)
        log(f"resumed {resume} at step {state.step} of {cfg.steps} (call {len(state.calls) + 1}, "
            f"{state.train_seconds:.0f}s trained so far)")
    bar = ProgressBar(cfg.steps, state.step, cfg.time_budget_s, enabled=progress)
    bar.held_out = state.val_history[-1]["loss"] if state.val_history else None

    def score(done_steps: int) -> None:
        bar.held_out = _score(state, draft, target, val_batches, store, cfg.gamma, done_steps, log)

    curves = _curves_path(curves, checkpoint)
    start, prior_seconds, prior_calls = state.step, state.train_seconds, list(state.calls)
    end = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
    call = {"start_step": start, "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": _device_name(device)}

    def save(stopped: str) -> None:
        """The run's state as of now; with ``checkpoint``, written there with curves.png beside it."""
        state.train_seconds = prior_seconds + time.perf_counter() - t0
        state.calls = prior_calls + [call | {"end_step": state.step, "seconds": round(time.perf_counter() - t0, 1),
                                            "stopped": stopped}]
        if checkpoint is not None:
            save_checkpoint(checkpoint, state, draft, opt, gen, meta)
        if curves is not None:
            plot_curves(curves, state.history, state.val_history)

    t0, tokens_seen = time.perf_counter(), 0
    if init is not None and val_batches:  # a continuation that only gets worse keeps the draft it started from
        score(0)
    if start == end:
        log(f"nothing to train: the run is at step {start} of {cfg.steps}")
        save("steps")
    for step in range(start, end):
        lr = learning_rate(cfg, step, time.perf_counter() - t0)
        stats, n_tokens = _train_step(draft, target, opt, store, train_idx, gen, cfg, mask_token_id, lr)
        if not math.isfinite(stats["loss"]):
            raise RuntimeError(f"loss is {stats['loss']} at step {step}: training diverged")
        state.history.append({k: stats[k] for k in HISTORY_KEYS})
        state.step, tokens_seen = step + 1, tokens_seen + n_tokens
        bar.update(step, stats["loss"], n_tokens)
        elapsed = time.perf_counter() - t0
        if step % 25 == 0 or step == cfg.steps - 1:
            log(f"step {step} loss {stats['loss']:.4f} acc1 {stats['acc1']:.3f} chain_al {stats['chain_al']:.2f} "
                f"lr {lr:.2e} elapsed {elapsed:.0f}s")
        stopped = _stop_reason(cfg, step, end, elapsed, log)
        # held-out scorings at the same steps however the run is cut into calls (so a resumed run
        # keeps the draft an uninterrupted one keeps); a call that ends for good without a
        # checkpoint to resume from is scored at its end too
        if val_batches and ((step + 1) % cfg.val_every == 0 or stopped == "steps"
                            or (stopped and checkpoint is None)):
            score(step + 1)
        if stopped or (checkpoint is not None and (step + 1) % checkpoint.every == 0):
            save(stopped or "running")  # "running": the call went on (if it was killed, it ended here)
        if stopped:
            break
    bar.close()
    if state.best is not None:
        draft.load_state_dict(state.best[2])  # the draft that predicted held-out answers best
    summary = _summary(state, cfg, store, train_idx.numel(), tokens_seen / max(time.perf_counter() - t0, 1e-9))
    summary["held_out_sampled_sequences"] = sum(b["pick"].numel() for b in val_batches if b["sampled"])
    return draft.eval(), summary


def _score(state: RunState, draft: DFlashDraft, target: DenseModel, val_batches: list[dict[str, Tensor]],
           store: TokenStore, gamma: float, done_steps: int, log: Callable[[str], None]) -> float:
    """Score the held-out blocks after ``done_steps`` steps, keep the weights if they are the best;
    the held-out loss. With greedy and sampled answers held out, ``loss`` (what the draft is kept by),
    ``acc1``, ``chain_al`` and ``slot_acc`` are the greedy answers' and ``*_sampled`` the sampled ones'."""
    cuda = target.device.type == "cuda"
    greedy = [b for b in val_batches if not b["sampled"]]
    sampled = [b for b in val_batches if b["sampled"]]
    val = dict(step=done_steps, **held_out_stats(draft, target, greedy or sampled, store, gamma, cuda))
    if greedy and sampled:
        other = held_out_stats(draft, target, sampled, store, gamma, cuda)
        val.update({f"{k}_sampled": other[k] for k in ("loss", "acc1", "chain_al")})
    state.val_history.append(val)
    if state.best is None or val["loss"] < state.best[0]:
        state.best = (val["loss"], done_steps, {k: v.detach().clone() for k, v in draft.state_dict().items()})
    also = f"; sampled answers: loss {val['loss_sampled']:.4f}" if "loss_sampled" in val else ""
    log(f"held-out at step {done_steps}: loss {val['loss']:.4f} acc1 {val['acc1']:.3f} "
        f"chain_al {val['chain_al']:.2f}{also} (best {state.best[0]:.4f} at step {state.best[1]})")
    return val["loss"]


def _curves_path(curves: Path | None, checkpoint: CheckpointConfig | None) -> Path | None:
    if curves is None and checkpoint is not None:
        return checkpoint.dir / "curves.png"
    return curves


def _resumable(resume: Path | None, init: DFlashDraft | None, cfg: TrainConfig, meta: dict[str, Any]
               ) -> dict[str, Any] | None:
    """The manifest of the checkpoint to resume, once it is known to continue this very run."""
    if resume is None:
        return None
    if init is not None:
        raise EngineInputError("--init and --resume: the checkpoint holds the draft to continue; leave --init out")
    manifest = read_manifest(resume)
    check_resumable(manifest, resume, cfg, meta["mask_token_id"], meta["target"], meta["data"])
    return manifest


def _device_sequences(sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], cfg: TrainConfig,
                      device: torch.device, temperatures: Sequence[float] | None = None
                      ) -> tuple[list[tuple[list[int], int]], list[Tensor], list[bool]]:
    """The sequences cut to ``max_seq_len`` that keep a response token to predict (with their
    prompt lengths), the same on the device, and whether each one's answer was sampled (a
    ``temperatures`` entry > 0; None: every answer greedy)."""
    if len(sequences) != len(prompt_lens) or not sequences:
        raise EngineInputError("train_draft needs a non-empty list of sequences with their prompt lengths")
    if temperatures is not None and len(temperatures) != len(sequences):
        raise EngineInputError(f"train_draft needs one temperature a sequence (0: greedy), but got "
                               f"{len(temperatures)} for {len(sequences)} sequences")
    temps = [0.0] * len(sequences) if temperatures is None else temperatures
    for i, t in enumerate(temps):  # (the rule of a data file's "temperature", sequences.load_sequence_records)
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise EngineInputError(f"train_draft: temperatures[{i}] must be a finite number >= 0 (the answer's "
                                   f"sampling temperature; 0: greedy), got {t!r}")
    kept = [(list(s)[: cfg.max_seq_len], p, t > 0) for s, p, t in zip(sequences, prompt_lens, temps, strict=True)]
    kept = [k for k in kept if len(k[0]) - 1 > k[1]]
    if not kept:
        raise EngineInputError("no training sequence has a response token after its prompt")
    return [(s, p) for s, p, _ in kept], [torch.tensor(s, device=device) for s, _, _ in kept], [t for *_, t in kept]


def _fit_deadline(cfg: TrainConfig, deadline: float | None, log: Callable[[str], None]) -> TrainConfig:
    """``cfg`` with the training budget shrunk to what is left before ``deadline``. Measured after
    the features (in host memory they can take minutes), not guessed before."""
    if deadline is None:
        return cfg
    left = deadline - time.perf_counter()
    if left <= 0:
        raise EngineInputError(f"the wall budget is spent before training starts ({-left:.0f}s over after the "
                               f"target features)")
    cfg = replace(cfg, time_budget_s=min(cfg.time_budget_s, left) if cfg.time_budget_s else left)
    log(f"training budget: {cfg.time_budget_s:.0f}s")
    return cfg


def _train_step(draft: DFlashDraft, target: DenseModel, opt: torch.optim.Optimizer, store: TokenStore,
                train_idx: Tensor, gen: torch.Generator, cfg: TrainConfig, mask_token_id: int, lr: float
                ) -> tuple[dict[str, Any], int]:
    """One optimizer step on a batch drawn from ``gen``: its stats and the sequence tokens it saw."""
    autocast = target.device.type == "cuda"
    for group in opt.param_groups:
        group["lr"] = lr
    pick = train_idx[torch.randint(0, train_idx.numel(), (cfg.batch_size,), generator=gen, device=gen.device)]
    tokens, feats, seq_lens, plens = store.batch(pick)
    n_tokens = int(seq_lens.sum())  # cheap: batch() has just read the host, the queue holds only the gather
    anchors, valid = sample_anchors(plens, seq_lens, tokens.shape[1], cfg.num_anchors, gen)
    batch = block_batch(tokens, seq_lens, anchors, valid, cfg.block_size, mask_token_id)
    # Not cuDNN attention: it builds a plan per shape on the host, which made the step CPU-bound.
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast), sdpa_kernel(_TRAIN_SDPA):
        loss, stats = draft_loss(draft, target, batch, feats if autocast else feats.float(), cfg.gamma)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
    opt.step()
    return stats, n_tokens


def _stop_reason(cfg: TrainConfig, step: int, end: int, elapsed: float, log: Callable[[str], None]) -> str | None:
    """Why this call ends after step index ``step``: "time", "steps" (all done), "stop-after", or None."""
    if cfg.time_budget_s and elapsed > cfg.time_budget_s:
        log(f"time budget {cfg.time_budget_s:.0f}s reached at step {step}")
        return "time"
    if step + 1 < end:
        return None
    if end < cfg.steps:
        log(f"--stop-after: this call ends at step {end} of {cfg.steps}")
        return "stop-after"
    return "steps"


def _summary(state: RunState, cfg: TrainConfig, store: TokenStore, n_train: int, tokens_per_s: float) -> dict:
    tail = state.history[-20:] or [{k: math.nan for k in HISTORY_KEYS}]
    device = store.tokens.device
    return {
        "steps": state.step,  # of the whole run, every call
        "steps_planned": cfg.steps,
        "complete": state.step >= cfg.steps,
        "train_seconds": round(state.train_seconds, 1),
        "final_loss": sum(h["loss"] for h in tail) / len(tail),
        "final_acc1": sum(h["acc1"] for h in tail) / len(tail),
        "final_chain_al_train": sum(h["chain_al"] for h in tail) / len(tail),
        "sequences": store.lens.numel(),
        "tokens": int(store.lens.sum()),
        "tokens_per_s": round(tokens_per_s),  # this call's
        "device": _device_name(device),
        "feature_store": store.placement,
        "held_out_sequences": store.lens.numel() - n_train,
        "held_out": state.val_history,
        "held_out_loss": state.best[0] if state.best is not None else None,
        "kept_step": state.best[1] if state.best is not None else state.step,  # 0: the warm-start draft was best
        "run_id": state.run_id,
        "calls": state.calls,  # the resume history: one record per call
        "config": asdict(cfg),
    }


def _device_name(device: torch.device) -> str:
    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)


def held_out_key(prompt: Sequence[int]) -> bytes:
    """A sequence's place in the held-out order: a hash of its prompt, so the held-out set does not
    depend on which other sequences the data holds (a warm start on grown data is scored on
    sequences its earlier training held out too, once the set is capped at VAL_MAX)."""
    return hashlib.sha256(json.dumps(list(prompt)).encode()).digest()


def _held_out(store: TokenStore, cfg: TrainConfig, mask_token_id: int, device: torch.device,
              keys: Sequence[bytes], sampled: Sequence[bool] | None = None) -> tuple[Tensor, list[dict[str, Tensor]]]:
    """The training sequences' indices, and fixed blocks (anchors drawn once, seeded) of the
    held-out ones (the lowest ``keys``): every scoring sees the same blocks, so two scorings compare.
    Sequences of one key (a prompt's answers, greedy and sampled) stay together: the last prompt held out
    takes all of its answers, so none of them trains. The greedy answers' blocks come first, then the
    sampled ones' (``sampled``: a flag a sequence; each block batch says which it holds, ``sampled``):
    a greedy decode proposes against greedy answers, so those are the ones the draft is kept by."""
    n = store.lens.numel()
    n_val = 0 if n < VAL_MIN_DATA else min(VAL_MAX, round(cfg.val_fraction * n))
    ranked = sorted(range(n), key=lambda i: keys[i])
    while 0 < n_val < n and keys[ranked[n_val]] == keys[ranked[n_val - 1]]:
        n_val += 1
    if n_val == n:  # (every answer one prompt's: that prompt trains, nothing is held out)
        n_val = 0
    flags = [False] * n if sampled is None else list(sampled)
    held = ranked[:n_val]
    kinds = [(False, [i for i in held if not flags[i]]), (True, [i for i in held if flags[i]])]
    train_idx = torch.tensor(ranked[n_val:], device=device, dtype=torch.long).sort().values
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 2)
    batches = []
    for kind, idx in kinds:  # (all greedy: the blocks a split without the flags gives)
        val_idx = torch.tensor(idx, device=device, dtype=torch.long)
        for lo in range(0, val_idx.numel(), cfg.batch_size):
            pick = val_idx[lo : lo + cfg.batch_size]
            tokens, seq_lens, plens = store.tokens_of(pick)
            anchors, valid = sample_anchors(plens, seq_lens, tokens.shape[1], cfg.num_anchors, gen)
            batch = block_batch(tokens, seq_lens, anchors, valid, cfg.block_size, mask_token_id)
            batches.append(dict(batch, pick=pick, sampled=kind))
    return train_idx, batches


@torch.no_grad()
def held_out_stats(draft: DFlashDraft, target: DenseModel, batches: list[dict[str, Tensor]], store: TokenStore,
                   gamma: float, autocast: bool) -> dict[str, Any]:
    """Loss, first-slot accuracy and chain AL on the held-out blocks (means over the batches)."""
    totals: dict = {"loss": 0.0, "acc1": 0.0, "chain_al": 0.0, "slot_acc": None}
    for batch in batches:
        feats = store.batch(batch["pick"])[1]
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast), sdpa_kernel(_TRAIN_SDPA):
            _, stats = draft_loss(draft, target, {k: v for k, v in batch.items() if k not in ("pick", "sampled")},
                                  feats if autocast else feats.float(), gamma)
        for k in ("loss", "acc1", "chain_al"):
            totals[k] += stats[k] / len(batches)
        slots = [a / len(batches) for a in stats["slot_acc"]]
        totals["slot_acc"] = slots if totals["slot_acc"] is None else [a + b for a, b in zip(totals["slot_acc"],
                                                                                               slots, strict=True)]
    return totals
