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

import gzip
import hashlib
import json
import lzma
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.config import EngineInputError
from engine.models.dense import BatchKV, DenseModel, forward_padded
from engine.models.draft import DFlashConfig, DFlashDraft, default_target_layer_ids

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
    # Held-out sequences (at most VAL_MAX, none under VAL_MIN_DATA) scored every `val_every` steps;
    # the draft returned is the one with the lowest held-out loss.
    val_fraction: float = 0.02
    val_every: int = 250
    # Where the frozen target features of every training position live: "device" (fastest),
    # "host" (CPU memory, each batch copied over: GPUs too small to hold them), or "auto".
    feature_store: str = "auto"

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


FEATURE_STORES = ("auto", "device", "host")
# "auto" keeps the features on the GPU when they take at most this share of its free memory (the
# draft's activations and the optimiser need the rest), in host memory otherwise.
DEVICE_FEATURE_SHARE = 0.7


def feature_store_device(choice: str, n_bytes: int, device: torch.device, free_bytes: int | None) -> torch.device:
    """Where ``n_bytes`` of target features go for a ``choice`` of ``FEATURE_STORES`` (``free_bytes``:
    the device's free memory; None off CUDA, where both are the same memory)."""
    if device.type != "cuda" or choice == "device":
        return device
    if choice == "host" or free_bytes is None or n_bytes > DEVICE_FEATURE_SHARE * free_bytes:
        return torch.device("cpu")
    return device


VAL_MAX = 256  # held-out sequences at most (scoring them costs a few forwards)
VAL_MIN_DATA = 50  # fewer sequences than this: no held-out set


@torch.inference_mode()
def generate_responses(target: DenseModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       batch_size: int, stop_ids: Sequence[int], time_budget_s: float = 0.0,
                       seed: int = 0) -> list[list[int] | None]:
    """Greedy answers of the target to every prompt, batched with left padding.

    Prompts of similar length share a batch; the batches run in a seeded random order, so that
    with ``time_budget_s`` (no new batch starts after it) the answered prompts are a fair sample of
    every length, and the prompts of the batches not run get ``None``."""
    if not isinstance(target, DenseModel):
        raise EngineInputError("draft training supports dense targets (Llama/Qwen3 family) only")
    device, cfg = target.device, target.cfg
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
    batches = [order[lo : lo + batch_size] for lo in range(0, len(order), batch_size)]
    perm = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seed)).tolist()
    out: list[list[int] | None] = [None for _ in prompts]
    stop = torch.tensor(list(stop_ids) or [-1], device=device)
    t0 = time.perf_counter()
    for k in perm:
        if time_budget_s and time.perf_counter() - t0 > time_budget_s:
            break
        idx = batches[k]
        b, p = len(idx), max(len(prompts[i]) for i in idx)
        tokens = torch.zeros(b, p, dtype=torch.long, device=device)
        valid = torch.zeros(b, p, dtype=torch.bool, device=device)
        for r, i in enumerate(idx):
            n = len(prompts[i])
            tokens[r, p - n :] = torch.tensor(prompts[i], device=device)
            valid[r, p - n :] = True
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        size = p + max_new_tokens
        kv = BatchKV(
            k=torch.zeros(cfg.num_hidden_layers, b, size, cfg.num_key_value_heads, cfg.dim_per_head,
                          device=device, dtype=target.dtype),
            v=torch.zeros(cfg.num_hidden_layers, b, size, cfg.num_key_value_heads, cfg.dim_per_head,
                          device=device, dtype=target.dtype),
            valid=torch.zeros(b, size, dtype=torch.bool, device=device),
        )
        logits, _ = forward_padded(target, tokens, positions, valid, kv, 0, last_only=True)
        nxt = logits[:, -1].argmax(-1)
        pos = positions[:, -1] + 1
        gen = torch.zeros(b, max_new_tokens, dtype=torch.long, device=device)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        for step in range(max_new_tokens):
            gen[:, step] = nxt
            done |= torch.isin(nxt, stop)
            if step + 1 == max_new_tokens or bool(done.all()):
                break
            logits, _ = forward_padded(target, nxt[:, None], pos[:, None], torch.ones(b, 1, dtype=torch.bool,
                                       device=device), kv, p + step)
            nxt, pos = logits[:, -1].argmax(-1), pos + 1
        for r, i in enumerate(idx):
            row = gen[r].tolist()[: step + 1]
            cut = next((j + 1 for j, t in enumerate(row) if t in stop_ids), len(row))
            out[i] = row[:cut]
    return out


def new_draft_for(target: DenseModel, cfg: TrainConfig, mask_token_id: int) -> DFlashDraft:
    tc = target.cfg
    draft = DFlashDraft(DFlashConfig(
        hidden_size=tc.hidden_size, num_hidden_layers=cfg.layers, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, intermediate_size=cfg.intermediate_size or tc.intermediate_size,
        vocab_size=tc.vocab_size, target_layer_ids=default_target_layer_ids(tc.num_hidden_layers, cfg.num_target_ids),
        num_target_layers=tc.num_hidden_layers, block_size=cfg.block_size, mask_token_id=mask_token_id,
        head_dim=tc.dim_per_head, rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta,
    ))
    gen = torch.Generator().manual_seed(cfg.seed)
    with torch.no_grad():
        for _, p in sorted(draft.named_parameters(), key=lambda kv: kv[0]):
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            # norms keep their identity initialisation
    return draft


@dataclass
class TokenStore:
    """Every training sequence back to back on the device, with its target features alongside."""

    tokens: Tensor  # [N] long
    feats: Tensor  # [N, n_ids * H] frozen target features of every position
    starts: Tensor  # [S] offset of each sequence
    lens: Tensor  # [S]
    prompt_lens: Tensor  # [S]

    def batch(self, pick: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Sequences ``pick`` right-padded to the longest: tokens [b, L], feats [b, L, F], lens, prompt lens."""
        lens = self.lens[pick]
        # The step's one host read before the forward; widths in steps of 128 keep the number of
        # distinct shapes (and kernel plans) small.
        width = -(-int(lens.max()) // 128) * 128
        j = torch.arange(width, device=lens.device)
        inside = j[None, :] < lens[:, None]
        idx = torch.where(inside, self.starts[pick][:, None] + j[None, :], 0)
        if self.feats.device == idx.device:
            feats = self.feats[idx]
        else:  # features in host memory: gathered there, one copy of the batch's rows
            feats = self.feats[idx.cpu()].to(idx.device, non_blocking=True)
        return self.tokens[idx] * inside, feats, lens, self.prompt_lens[pick]


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


@torch.no_grad()
def target_features(target: DenseModel, seqs: Sequence[Tensor], layer_ids: Sequence[int],
                    tokens_per_batch: int = 32768, store: str = "device") -> Tensor:
    """Target features of every sequence, back to back ([sum of lengths, n_ids * H]), computed once
    (the target is frozen): length-bucketed batches keep padding low. In the target's dtype, on its
    device or (``store``, one of ``FEATURE_STORES``) in host memory."""
    device = target.device
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + s.numel())
    out = None
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].numel())
    i = 0
    while i < len(order):
        width = seqs[order[i]].numel()
        j = i
        while j < len(order) and (j - i + 1) * seqs[order[j]].numel() <= max(tokens_per_batch, width):
            j += 1
        idx = order[i:j]
        width = seqs[idx[-1]].numel()
        tokens = torch.zeros(len(idx), width, dtype=torch.long, device=device)
        valid = torch.zeros(len(idx), width, dtype=torch.bool, device=device)
        for r, q in enumerate(idx):
            tokens[r, : seqs[q].numel()] = seqs[q]
            valid[r, : seqs[q].numel()] = True
        positions = torch.arange(width, device=device).expand(len(idx), -1)
        _, f = forward_padded(target, tokens, positions, valid, feature_layers=layer_ids, logits=False)
        if out is None:
            n_bytes = starts[-1] * f.shape[-1] * f.element_size()
            if device.type == "cuda":
                torch.cuda.empty_cache()  # blocks cached by an earlier phase (self-distillation) are free too
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
            where = feature_store_device(store, n_bytes, device, free)
            # Pageable, not pinned: PyTorch's pinned allocator rounds a request up to a power of two
            # (70 GiB would ask for 128), and a batch's rows are gathered into a new tensor anyway.
            out = torch.empty(starts[-1], f.shape[-1], device=where, dtype=f.dtype)
        for r, q in enumerate(idx):
            out[starts[q] : starts[q + 1]] = f[r, : seqs[q].numel()]
        i = j
    return out


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
        accepted = ((hit | ~valid).long().cumprod(1) * valid)[used]
        packed = torch.stack([loss.detach(), hit[:, 0][used].float().mean(), accepted.sum(1).float().mean() + 1])
        loss_v, acc1, chain_al = packed.tolist()  # one host read for the three
    return loss, {"loss": loss_v, "acc1": acc1, "chain_al": chain_al}


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
    """Warm-up, then cosine decay over whichever runs out first: the steps or the time budget."""
    progress = step / cfg.steps
    if cfg.time_budget_s:
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
) -> tuple[DFlashDraft, dict]:
    """Train a draft on (prompt + self-distilled response) token sequences: a new one, or ``init``
    (a trained draft, warm start: its architecture is kept, training continues in float32 with a
    fresh optimiser, warm-up and schedule). ``deadline`` (a ``time.perf_counter()`` value): the
    training time is at most what is left before it once the target features are computed."""
    device = target.device
    if len(sequences) != len(prompt_lens) or not sequences:
        raise EngineInputError("train_draft needs a non-empty list of sequences with their prompt lengths")
    draft = _starting_draft(target, cfg, mask_token_id, init)
    ids = draft.cfg.target_layer_ids
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    kept = [(list(s)[: cfg.max_seq_len], p) for s, p in zip(sequences, prompt_lens, strict=True)]
    kept = [(s, p) for s, p in kept if len(s) - 1 > p]
    data = [(torch.tensor(s, device=device), p) for s, p in kept]
    if not data:
        raise EngineInputError("no training sequence has a response token after its prompt")
    autocast = device.type == "cuda"
    t0 = time.perf_counter()
    lens = torch.tensor([s.numel() for s, _ in data], device=device)
    store = TokenStore(
        tokens=torch.cat([s for s, _ in data]),
        feats=target_features(target, [s for s, _ in data], ids, store=cfg.feature_store),
        starts=torch.cumsum(lens, 0) - lens, lens=lens,
        prompt_lens=torch.tensor([p for _, p in data], device=device),
    )
    log(f"target features: {store.feats.numel() * store.feats.element_size() / 2**30:.1f} GiB on "
        f"{'the device' if store.feats.device == device else 'the host'} "
        f"in {time.perf_counter() - t0:.0f}s")
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    train_idx, val_batches = _held_out(store, cfg, mask_token_id, device, [held_out_key(s[:p]) for s, p in kept])
    if deadline is not None:
        # Measured after the features (in host memory they can take minutes), not guessed before.
        left = deadline - time.perf_counter()
        if left <= 0:
            raise EngineInputError(f"the wall budget is spent before training starts ({-left:.0f}s over after the "
                                   f"target features)")
        cfg = replace(cfg, time_budget_s=min(cfg.time_budget_s, left) if cfg.time_budget_s else left)
        log(f"training budget: {cfg.time_budget_s:.0f}s")
    t0, history, step = time.perf_counter(), [], 0
    val_history: list[dict[str, float]] = []
    best: tuple[float, int, dict[str, Tensor]] | None = None  # (held-out loss, step, weights)

    def score(done_steps: int) -> None:
        """Score the held-out blocks after ``done_steps`` steps; keep the weights if they are the best."""
        nonlocal best
        val = dict(step=done_steps, **held_out_stats(draft, target, val_batches, store, cfg.gamma, autocast))
        val_history.append(val)
        if best is None or val["loss"] < best[0]:
            best = (val["loss"], done_steps, {k: v.detach().clone() for k, v in draft.state_dict().items()})
        log(f"held-out at step {done_steps}: loss {val['loss']:.4f} acc1 {val['acc1']:.3f} "
            f"chain_al {val['chain_al']:.2f} (best {best[0]:.4f} at step {best[1]})")

    if init is not None and val_batches:  # a continuation that only gets worse keeps the draft it started from
        score(0)
    lr = cfg.lr
    for step in range(cfg.steps):
        lr = learning_rate(cfg, step, time.perf_counter() - t0)
        for group in opt.param_groups:
            group["lr"] = lr
        pick = train_idx[torch.randint(0, train_idx.numel(), (cfg.batch_size,), generator=gen, device=device)]
        tokens, feats, seq_lens, plens = store.batch(pick)
        anchors, valid = sample_anchors(plens, seq_lens, tokens.shape[1], cfg.num_anchors, gen)
        batch = block_batch(tokens, seq_lens, anchors, valid, cfg.block_size, mask_token_id)
        # Not cuDNN attention: it builds a plan per shape on the host, which made the step CPU-bound.
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast), sdpa_kernel(_TRAIN_SDPA):
            loss, stats = draft_loss(draft, target, batch, feats if autocast else feats.float(), cfg.gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        if not math.isfinite(stats["loss"]):
            raise RuntimeError(f"loss is {stats['loss']} at step {step}: training diverged")
        history.append(stats)
        elapsed = time.perf_counter() - t0
        if step % 25 == 0 or step == cfg.steps - 1:
            log(f"step {step} loss {stats['loss']:.4f} acc1 {stats['acc1']:.3f} chain_al {stats['chain_al']:.2f} "
                f"lr {lr:.2e} elapsed {elapsed:.0f}s")
        out_of_time = bool(cfg.time_budget_s and elapsed > cfg.time_budget_s)
        if val_batches and ((step + 1) % cfg.val_every == 0 or step == cfg.steps - 1 or out_of_time):
            score(step + 1)
        if out_of_time:
            log(f"time budget {cfg.time_budget_s:.0f}s reached at step {step}")
            break
    if best is not None:
        draft.load_state_dict(best[2])  # the draft that predicted held-out answers best
    tail = history[-20:]
    summary = {
        "steps": step + 1,
        "train_seconds": round(time.perf_counter() - t0, 1),
        "final_loss": sum(h["loss"] for h in tail) / len(tail),
        "final_acc1": sum(h["acc1"] for h in tail) / len(tail),
        "final_chain_al_train": sum(h["chain_al"] for h in tail) / len(tail),
        "sequences": len(data),
        "tokens": int(sum(s.numel() for s, _ in data)),
        "feature_store": "device" if store.feats.device == device else "host",
        "held_out_sequences": len(data) - train_idx.numel(),
        "held_out": val_history,
        "kept_step": best[1] if best is not None else step + 1,  # 0: the warm-start draft was best
        "config": asdict(cfg),
    }
    return draft.eval(), summary


def held_out_key(prompt: Sequence[int]) -> bytes:
    """A sequence's place in the held-out order: a hash of its prompt, so the held-out set does not
    depend on which other sequences the data holds (a warm start on grown data is scored on
    sequences its earlier training held out too, once the set is capped at VAL_MAX)."""
    return hashlib.sha256(json.dumps(list(prompt)).encode()).digest()


def _held_out(store: TokenStore, cfg: TrainConfig, mask_token_id: int, device: torch.device,
              keys: Sequence[bytes]) -> tuple[Tensor, list[dict[str, Tensor]]]:
    """The training sequences' indices, and fixed blocks (anchors drawn once, seeded) of the
    held-out ones (the lowest ``keys``): every scoring sees the same blocks, so two scorings compare."""
    n = store.lens.numel()
    n_val = 0 if n < VAL_MIN_DATA else min(VAL_MAX, round(cfg.val_fraction * n))
    order = torch.tensor(sorted(range(n), key=lambda i: keys[i]), device=device)
    val_idx, train_idx = order[:n_val], order[n_val:].sort().values
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 2)
    batches = []
    for lo in range(0, n_val, cfg.batch_size):
        pick = val_idx[lo : lo + cfg.batch_size]
        tokens, _, seq_lens, plens = store.batch(pick)
        anchors, valid = sample_anchors(plens, seq_lens, tokens.shape[1], cfg.num_anchors, gen)
        batch = block_batch(tokens, seq_lens, anchors, valid, cfg.block_size, mask_token_id)
        batches.append(dict(batch, pick=pick))
    return train_idx, batches


@torch.no_grad()
def held_out_stats(draft: DFlashDraft, target: DenseModel, batches: list[dict[str, Tensor]], store: TokenStore,
                   gamma: float, autocast: bool) -> dict[str, float]:
    """Loss, first-slot accuracy and chain AL on the held-out blocks (means over the batches)."""
    totals = {"loss": 0.0, "acc1": 0.0, "chain_al": 0.0}
    for batch in batches:
        feats = store.batch(batch["pick"])[1]
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast), sdpa_kernel(_TRAIN_SDPA):
            _, stats = draft_loss(draft, target, {k: v for k, v in batch.items() if k != "pick"},
                                  feats if autocast else feats.float(), gamma)
        for k in totals:
            totals[k] += stats[k] / len(batches)
    return totals


def _open_text(path: Path, mode: str) -> IO[str]:
    # Self-distilled data is kept in the repository between GPU sessions: ``.xz`` makes it 1/12 of
    # the JSON (``.gz`` 1/6), and every byte of it travels to the GPU machine in each call.
    if path.suffix == ".xz":
        return lzma.open(path, mode + "t", preset=9 if mode == "w" else None)
    return gzip.open(path, mode + "t") if path.suffix == ".gz" else path.open(mode)


def save_sequences(path: Path, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> None:
    """One JSON object per line, ``{"tokens": [...], "prompt_len": n}``; compressed when the name ends
    in .xz or .gz."""
    with _open_text(path, "w") as fh:
        for s, p in zip(sequences, prompt_lens, strict=True):
            fh.write(json.dumps({"tokens": list(s), "prompt_len": p}) + "\n")


def load_sequences(path: Path) -> tuple[list[list[int]], list[int]]:
    """What ``save_sequences`` wrote; a malformed line is an error naming the file and the line."""
    if not path.is_file():
        raise EngineInputError(f"--data {str(path)!r}: no such file")
    seqs, plens = [], []
    with _open_text(path, "r") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                tokens, plen = rec["tokens"], rec["prompt_len"]
                ok = (isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)
                      and isinstance(plen, int) and 0 < plen < len(tokens))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise EngineInputError(f"{path}:{n}: not a sequence record ({e})") from None
            if not ok:
                raise EngineInputError(f"{path}:{n}: 'tokens' must be a list of token ids longer than "
                                       f"'prompt_len' (a positive integer)")
            seqs.append(tokens)
            plens.append(plen)
    if not seqs:
        raise EngineInputError(f"{path}: no sequences")
    return seqs, plens
