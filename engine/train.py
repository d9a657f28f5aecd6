"""Train a DFlash draft for a dense target (SpecForge-style recipe, see ALGORITHMS.md).

1. Self-distillation data: the frozen target answers train-split prompts itself (batched greedy
   generation), so the draft learns what the target will actually say.
2. Each step: target features for a batch of sequences (one batched forward), anchors sampled
   among response positions, every anchor a block ``[x_a, MASK x (B-1)]`` at positions a..a+B-1
   seeing the context strictly before a and its own block (block-diagonal mask, many blocks in
   one forward), cross-entropy through the target's frozen lm_head weighted by exp(-(k-1)/gamma).
3. The checkpoint is written in the public DFlash layout.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.config import EngineInputError
from engine.models.dense import BatchKV, DenseModel, forward_padded
from engine.models.draft import DFlashConfig, DFlashDraft, default_target_layer_ids


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

    def __post_init__(self) -> None:
        for name in ("layers", "block_size", "num_target_ids", "num_anchors", "steps", "batch_size",
                     "max_seq_len", "gen_max_new_tokens", "gen_batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (2 if name == "block_size" else 1):
                raise EngineInputError(f"TrainConfig.{name} must be a positive integer (block_size >= 2), got {v!r}")
        if not self.lr > 0 or not self.gamma > 0:
            raise EngineInputError(f"TrainConfig: lr and gamma must be > 0, got lr={self.lr}, gamma={self.gamma}")


@torch.inference_mode()
def generate_responses(target: DenseModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       batch_size: int, stop_ids: Sequence[int]) -> list[list[int]]:
    """Greedy answers of the target to every prompt, batched with left padding."""
    if not isinstance(target, DenseModel):
        raise EngineInputError("draft training supports dense targets (Llama/Qwen3 family) only")
    device, cfg = target.device, target.cfg
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
    out: list[list[int]] = [[] for _ in prompts]
    stop = torch.tensor(list(stop_ids) or [-1], device=device)
    for lo in range(0, len(order), batch_size):
        idx = order[lo : lo + batch_size]
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
        logits, _ = forward_padded(target, tokens, positions, valid, kv, 0)
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


def sample_anchors(prompt_len: int, seq_len: int, n: int, gen: torch.Generator) -> Tensor:
    """Anchors among generated positions with at least one label after them."""
    lo, hi = prompt_len, seq_len - 1  # anchor a: the root is a generated token, labels x[a+1..]
    if hi <= lo:
        return torch.empty(0, dtype=torch.long)
    cand = torch.arange(lo, hi)
    return cand[torch.randperm(cand.numel(), generator=gen)[:n]].sort().values


def block_batch(seqs: Sequence[Tensor], anchors: Sequence[Tensor], block: int, mask_token_id: int,
                device: torch.device) -> dict[str, Tensor]:
    """Flatten a batch into one draft forward: all contexts, then all blocks, block-diagonal mask.

    seqs: token tensors (on ``device``); anchors: sorted anchor positions per sequence.
    """
    k = torch.arange(block, device=device)
    ctx_seq, ctx_pos, q_seq, q_pos, q_tok, labels = [], [], [], [], [], []
    for i, (seq, anc) in enumerate(zip(seqs, anchors, strict=True)):
        t, anc = seq.numel(), anc.to(device)
        ctx_seq.append(torch.full((t,), i, device=device))
        ctx_pos.append(torch.arange(t, device=device))
        pos = anc[:, None] + k[None, :]  # [n, B]
        tok = torch.full_like(pos, mask_token_id)
        tok[:, 0] = seq[anc]
        lab = torch.where(pos < t, seq[pos.clamp(max=t - 1)], -100)
        lab[:, 0] = -100  # slot 0 is the given root, nothing to predict
        q_seq.append(torch.full((pos.numel(),), i, device=device))
        q_pos.append(pos.flatten())
        q_tok.append(tok.flatten())
        labels.append(lab.flatten())
    ctx_seq_t, ctx_pos_t, q_seq_t, q_pos_t = (torch.cat(x) for x in (ctx_seq, ctx_pos, q_seq, q_pos))
    q_block = torch.arange(q_pos_t.numel(), device=device) // block
    anchor_pos = q_pos_t - (torch.arange(q_pos_t.numel(), device=device) % block)
    sees_ctx = (q_seq_t[:, None] == ctx_seq_t[None, :]) & (ctx_pos_t[None, :] < anchor_pos[:, None])
    sees_block = q_block[:, None] == q_block[None, :]
    return dict(ctx_pos=ctx_pos_t, q_pos=q_pos_t, tokens=torch.cat(q_tok), labels=torch.cat(labels),
                mask=torch.cat([sees_ctx, sees_block], dim=1))


@torch.no_grad()
def target_features(target: DenseModel, seqs: Sequence[Tensor], layer_ids: Sequence[int],
                    tokens_per_batch: int = 32768) -> list[Tensor]:
    """Target features of every sequence, computed once (the target is frozen): length-bucketed
    batches keep padding low. Returned on the target's device in its dtype."""
    device, out = target.device, [None] * len(seqs)
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
        for r, q in enumerate(idx):
            out[q] = f[r, : seqs[q].numel()].clone()
        i = j
    return out


def draft_loss(draft: DFlashDraft, target: DenseModel, batch: dict[str, Tensor], feats: Tensor,
               gamma: float) -> tuple[Tensor, dict[str, float]]:
    block = draft.cfg.block_size
    h = draft(target.embed_tokens(batch["tokens"]), feats, batch["ctx_pos"], batch["q_pos"], batch["mask"])
    slot = torch.arange(h.shape[0], device=h.device) % block
    keep = slot > 0
    logits = target.lm_head(h[keep]).float()
    labels = batch["labels"][keep]
    weights = torch.exp(-(slot[keep] - 1).float() / gamma) * (labels >= 0)
    ce = F.cross_entropy(logits, labels.clamp(min=0), reduction="none")
    loss = (ce * weights).sum() / weights.sum().clamp(min=1e-6)
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels).view(-1, block - 1)
        valid = (labels >= 0).view(-1, block - 1)
        # Chain acceptance the draft would get on these blocks: accepted prefix + 1.
        accepted = (hit | ~valid).long().cumprod(1) * valid
        stats = {"loss": float(loss), "acc1": float(hit[:, 0][valid[:, 0]].float().mean()),
                 "chain_al": float(accepted.sum(1).float().mean() + 1)}
    return loss, stats


def train_draft(
    target: DenseModel,
    sequences: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    cfg: TrainConfig,
    mask_token_id: int,
    log: Callable[[str], None] = print,
) -> tuple[DFlashDraft, dict]:
    """Train a new draft on (prompt + self-distilled response) token sequences."""
    device = target.device
    if len(sequences) != len(prompt_lens) or not sequences:
        raise EngineInputError("train_draft needs a non-empty list of sequences with their prompt lengths")
    gen = torch.Generator().manual_seed(cfg.seed)
    draft = new_draft_for(target, cfg, mask_token_id).to(device)
    ids = draft.cfg.target_layer_ids
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    data = [(torch.tensor(list(s)[: cfg.max_seq_len], device=device), p)
            for s, p in zip(sequences, prompt_lens, strict=True)]
    data = [(s, p) for s, p in data if s.numel() - 1 > p]
    if not data:
        raise EngineInputError("no training sequence has a response token after its prompt")
    autocast = device.type == "cuda"
    t0 = time.perf_counter()
    feats_all = target_features(target, [s for s, _ in data], ids)
    log(f"target features: {sum(f.numel() for f in feats_all) * feats_all[0].element_size() / 2**30:.1f} GiB "
        f"in {time.perf_counter() - t0:.0f}s")
    t0, history, step = time.perf_counter(), [], 0
    lr = cfg.lr
    for step in range(cfg.steps):
        # Warm-up, then cosine decay over whichever runs out first: steps or the time budget.
        progress = step / cfg.steps
        if cfg.time_budget_s:
            progress = max(progress, (time.perf_counter() - t0) / cfg.time_budget_s)
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        for group in opt.param_groups:
            group["lr"] = lr
        pick = torch.randint(0, len(data), (cfg.batch_size,), generator=gen).tolist()
        seqs, plens = [data[i][0] for i in pick], [data[i][1] for i in pick]
        anchors = [sample_anchors(p, s.numel(), cfg.num_anchors, gen) for s, p in zip(seqs, plens, strict=True)]
        feats = torch.cat([feats_all[i] for i in pick]).float()
        batch = block_batch(seqs, anchors, cfg.block_size, mask_token_id, device)
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            loss, stats = draft_loss(draft, target, batch, feats, cfg.gamma)
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
        if cfg.time_budget_s and elapsed > cfg.time_budget_s:
            log(f"time budget {cfg.time_budget_s:.0f}s reached at step {step}")
            break
    tail = history[-20:]
    summary = {
        "steps": step + 1,
        "train_seconds": round(time.perf_counter() - t0, 1),
        "final_loss": sum(h["loss"] for h in tail) / len(tail),
        "final_acc1": sum(h["acc1"] for h in tail) / len(tail),
        "final_chain_al_train": sum(h["chain_al"] for h in tail) / len(tail),
        "sequences": len(data),
        "tokens": int(sum(s.numel() for s, _ in data)),
        "config": asdict(cfg),
    }
    return draft.eval(), summary


def save_sequences(path: Path, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> None:
    with path.open("w") as fh:
        for s, p in zip(sequences, prompt_lens, strict=True):
            fh.write(json.dumps({"tokens": list(s), "prompt_len": p}) + "\n")


def load_sequences(path: Path) -> tuple[list[list[int]], list[int]]:
    seqs, plens = [], []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        seqs.append(rec["tokens"])
        plens.append(rec["prompt_len"])
    return seqs, plens
