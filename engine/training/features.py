"""The frozen target's features of every training position, computed once, and where they live."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.models.dense import DenseModel, forward_padded

FEATURE_STORES = ("auto", "device", "host", "recompute")
# "auto" keeps the features on the GPU when they take at most this share of its free memory (the
# draft's activations and the optimiser need the rest), else recomputes each batch's: a frozen
# target's forward over the batch costs less than gathering its rows in host memory and copying them.
DEVICE_FEATURE_SHARE = 0.7


def feature_placement(choice: str, n_bytes: int, device: torch.device, free_bytes: int | None) -> str:
    """Where ``n_bytes`` of target features live for a ``choice`` of ``FEATURE_STORES``: "device",
    "host" or "recompute" (none kept: each batch's computed by the target). ``free_bytes``: the
    device's free memory; None off CUDA, where host and device are the same memory."""
    if device.type != "cuda":
        return "recompute" if choice == "recompute" else "device"
    if choice != "auto":
        return choice
    return "device" if free_bytes is not None and n_bytes <= DEVICE_FEATURE_SHARE * free_bytes else "recompute"


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
    target: DenseModel | None = None  # with feats None: computes a batch's features
    layer_ids: tuple[int, ...] = ()

    @property
    def placement(self) -> str:
        if self.feats is None:
            return "recompute"
        return "device" if self.feats.device == self.tokens.device else "host"

    def batch(self, pick: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Sequences ``pick`` right-padded to the longest: tokens [b, L], feats [b, L, F], lens, prompt lens."""
        tokens, idx, inside, lens = self._padded(pick)
        if self.feats is None:  # the target's forward over the batch, as target_features does (its padding
            # differs from that pass's buckets: the same numbers up to rounding)
            with torch.no_grad():
                positions = torch.arange(tokens.shape[1], device=tokens.device).expand(len(pick), -1)
                _, feats = forward_padded(self.target, tokens, positions, inside, feature_layers=self.layer_ids,
                                          logits=False)
        elif self.feats.device == idx.device:
            feats = self.feats[idx]
        else:  # features in host memory: gathered there, one copy of the batch's rows
            feats = self.feats[idx.cpu()].to(idx.device, non_blocking=True)
        return tokens, feats, lens, self.prompt_lens[pick]

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
