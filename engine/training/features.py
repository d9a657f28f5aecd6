"""The frozen target's features of every training position, computed once, and where they live."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.models.dense import DenseModel, forward_padded

FEATURE_STORES = ("auto", "device", "partial", "host", "recompute")
# "auto" keeps the features on the GPU when they take at most this share of its free memory (the
# draft's activations and the optimiser need the rest); else, when that share holds at least
# PARTIAL_MIN_SHARE of them, "partial": the features of a random subset of the sequences that fits are
# kept, the other sequences' recomputed each batch (a batch's target forward then runs on its rows of
# the rest only); else recomputes each batch's: a frozen target's forward over the batch costs less
# than gathering its rows in host memory and copying them. On an H100 (2026-12-06) a 5-layer draft
# trained 5.3 steps/s with every feature recomputed, where a 3-layer one with them kept had run 20.8
# on an H200: the target's forward is most of a step.
DEVICE_FEATURE_SHARE = 0.7
PARTIAL_MIN_SHARE = 0.25


def feature_placement(choice: str, n_bytes: int, device: torch.device, free_bytes: int | None) -> str:
    """Where ``n_bytes`` of target features live for a ``choice`` of ``FEATURE_STORES``: "device",
    "host" or "recompute" (none kept: each batch's computed by the target). ``free_bytes``: the
    device's free memory; None off CUDA, where host and device are the same memory."""
    if device.type != "cuda":
        return "recompute" if choice == "recompute" else "device"
    if choice != "auto":
        return choice
    room = DEVICE_FEATURE_SHARE * free_bytes if free_bytes is not None else 0
    if n_bytes <= room:
        return "device"
    return "partial" if room >= PARTIAL_MIN_SHARE * n_bytes else "recompute"


def kept_sequences(lens: Tensor, bytes_per_token: int, budget_bytes: float, seed: int = 0) -> Tensor:
    """Which sequences a "partial" store keeps the features of: those of a seeded random order (so each
    dataset's sequences are kept in proportion, not the first file's, and no length is favoured) up to
    the first whose features no longer fit ``budget_bytes``. A bool per sequence."""
    order = torch.randperm(lens.numel(), generator=torch.Generator().manual_seed(seed))
    fits = torch.cumsum(lens.cpu()[order] * bytes_per_token, 0) <= budget_bytes
    kept = torch.zeros(lens.numel(), dtype=torch.bool)
    kept[order[fits]] = True
    return kept.to(lens.device)


def features_bytes(target: DenseModel, n_tokens: int, layer_ids: Sequence[int]) -> int:
    """Bytes of the features of ``n_tokens`` positions: one hidden state per layer read, target dtype."""
    return n_tokens * len(layer_ids) * target.cfg.hidden_size * torch.finfo(target.dtype).bits // 8


@dataclass
class TokenStore:
    """Every training sequence back to back on the device, with its target features alongside."""

    tokens: Tensor  # [N] long
    feats: Tensor | None  # [N, n_ids * H] frozen target features of every position; None: recomputed
    starts: Tensor  # [S] offset of each sequence
    lens: Tensor  # [S]
    prompt_lens: Tensor  # [S]
    target: DenseModel | None = None  # with feats None (or kept): computes a batch's features
    layer_ids: tuple[int, ...] = ()
    # "partial": feats holds only the kept sequences' rows, back to back in sequence order; a kept
    # sequence's first row is at feat_starts (the others' features are recomputed)
    kept: Tensor | None = None  # [S] bool
    feat_starts: Tensor | None = None  # [S]

    @property
    def placement(self) -> str:
        if self.feats is None:
            return "recompute"
        if self.kept is not None:
            return "partial"
        return "device" if self.feats.device == self.tokens.device else "host"

    def batch(self, pick: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Sequences ``pick`` right-padded to the longest: tokens [b, L], feats [b, L, F], lens, prompt lens."""
        tokens, idx, inside, lens = self._padded(pick)
        if self.feats is None:
            feats = self._forward(tokens, inside)
        elif self.kept is not None:
            feats = self._partial(pick, tokens, inside)
        elif self.feats.device == idx.device:
            feats = self.feats[idx]
        else:  # features in host memory: gathered there, one copy of the batch's rows
            feats = self.feats[idx.cpu()].to(idx.device, non_blocking=True)
        return tokens, feats, lens, self.prompt_lens[pick]

    def _forward(self, tokens: Tensor, inside: Tensor) -> Tensor:
        """The target's forward over padded rows, as target_features does (its padding differs from that
        pass's buckets: the same numbers up to rounding)."""
        with torch.no_grad():
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
            _, feats = forward_padded(self.target, tokens, positions, inside, feature_layers=self.layer_ids,
                                      logits=False)
        return feats

    def _partial(self, pick: Tensor, tokens: Tensor, inside: Tensor) -> Tensor:
        """A batch's features from a "partial" store: the kept sequences' rows gathered, the target's
        forward over the other rows only (one host read: which rows are which)."""
        kept = self.kept[pick]
        rows_kept, rows_new = kept.nonzero().squeeze(1), (~kept).nonzero().squeeze(1)
        feats = torch.empty(*tokens.shape, self.feats.shape[-1], dtype=self.feats.dtype, device=tokens.device)
        if rows_kept.numel():
            j = torch.arange(tokens.shape[1], device=tokens.device)
            at = torch.where(inside[rows_kept], self.feat_starts[pick[rows_kept]][:, None] + j[None, :], 0)
            feats[rows_kept] = self.feats[at]
        if rows_new.numel():
            feats[rows_new] = self._forward(tokens[rows_new], inside[rows_new]).to(feats.dtype)
        return feats

    def tokens_of(self, pick: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``batch`` without the features (no target forward when they are recomputed): tokens, lens,
        prompt lens."""
        tokens, _, _, lens = self._padded(pick)
        return tokens, lens, self.prompt_lens[pick]

    def _padded(self, pick: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Sequences ``pick`` right-padded: tokens [b, L], their flat indices, which are real, lens."""
        lens = self.lens[pick]
        # The step's one host read before the forward; widths in steps of 128 keep the number of
        # distinct shapes (and kernel plans) small.
        width = -(-int(lens.max()) // 128) * 128
        j = torch.arange(width, device=lens.device)
        inside = j[None, :] < lens[:, None]
        idx = torch.where(inside, self.starts[pick][:, None] + j[None, :], 0)
        return self.tokens[idx] * inside, idx, inside, lens


@torch.no_grad()
def target_features(target: DenseModel, seqs: Sequence[Tensor], layer_ids: Sequence[int],
                    tokens_per_batch: int = 32768, store: str = "device") -> Tensor:
    """Target features of every sequence, back to back ([sum of lengths, n_ids * H]), computed once
    (the target is frozen): length-bucketed batches keep padding low. In the target's dtype, on its
    device or (``store`` "host") in host memory."""
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
            where = torch.device("cpu") if store == "host" else device
            # Pageable, not pinned: PyTorch's pinned allocator rounds a request up to a power of two
            # (70 GiB would ask for 128), and a batch's rows are gathered into a new tensor anyway.
            out = torch.empty(starts[-1], f.shape[-1], device=where, dtype=f.dtype)
        for r, q in enumerate(idx):
            out[starts[q] : starts[q + 1]] = f[r, : seqs[q].numel()]
        i = j
    return out


def token_store(target: DenseModel, data: list[Tensor], tokens_all: Tensor, lens: Tensor, plens: Tensor,
                ids: Sequence[int], choice: str, log: Callable[[str], None]) -> TokenStore:
    """The training sequences (``data``, back to back in ``tokens_all``), with the target features
    where ``choice`` puts them."""
    t0, device = time.perf_counter(), target.device
    n_bytes = features_bytes(target, tokens_all.numel(), ids)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # blocks cached by an earlier phase (self-distillation) are free too
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    placement = feature_placement(choice, n_bytes, device, free)
    where = {"device": "on the device", "host": "on the host", "recompute": "recomputed each batch (not kept)"}
    kept = feat_starts = None
    if placement == "partial":
        room = DEVICE_FEATURE_SHARE * free if free is not None else n_bytes
        kept = kept_sequences(lens, n_bytes // max(tokens_all.numel(), 1), room)
        if not kept.any():  # (asked for with no room for one sequence's)
            placement, kept = "recompute", None
            log("target features: partial store has room for no sequence's; recomputing every batch's")
    if placement == "partial":
        feats = target_features(target, [d for d, k in zip(data, kept.tolist(), strict=True) if k], ids)
        kept_lens = lens * kept
        feat_starts = torch.cumsum(kept_lens, 0) - kept_lens
        where["partial"] = (f"of which {feats.numel() * feats.element_size() / 2**30:.1f} GiB on the device "
                            f"({int(kept.sum())} of {kept.numel()} sequences; the rest recomputed each batch)")
    else:
        feats = None if placement == "recompute" else target_features(target, data, ids, store=placement)
    log(f"target features: {n_bytes / 2**30:.1f} GiB {where[placement]} in {time.perf_counter() - t0:.0f}s")
    return TokenStore(tokens=tokens_all, feats=feats, starts=torch.cumsum(lens, 0) - lens, lens=lens,
                      prompt_lens=plens, target=target, layer_ids=tuple(ids), kept=kept, feat_starts=feat_starts)
