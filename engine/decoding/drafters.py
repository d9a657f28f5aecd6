"""Drafters: who proposes the block. A DFlash draft model, or the oracle test draft.

Both answer ``propose(seq, start, block_size, window, features)`` with logits [B-1, V] for the
block slots after the root ``seq[start]``; what happens to the logits (host or device top-k,
chain or tree) is the decode loop's business, so every drafter works with every path.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from engine.models.common import free_rows_, fuse_projections_
from engine.models.draft import DFlashDraft


class Drafter(Protocol):
    block_size: int
    feature_layers: tuple[int, ...]

    def reset(self) -> None: ...

    def propose(self, seq: Tensor, start: int, block_size: int, window: int, features: Tensor) -> Tensor: ...


class DFlashDrafter:
    """The DFlash draft. Both forms keep each committed position's context keys/values (they
    depend on the target features only) and run the draft layers over the block alone:
    ``propose`` on the host's position, ``propose_static`` on a device-held one (the shape-static
    step CUDA graphs replay, over buffers its caller owns: ``new_context``, ``fill_context``)."""

    def __init__(self, draft: DFlashDraft, target: nn.Module) -> None:
        # inference: one GEMM per input (checkpoints keep the parts), cuBLAS's rounding (free_rows_)
        self.draft = free_rows_(fuse_projections_(draft))
        self.target = target
        self.block_size = draft.cfg.block_size
        self.feature_layers = tuple(draft.cfg.target_layer_ids)
        self.mask_token_id = draft.cfg.mask_token_id
        self._block_ids: Tensor | None = None
        self._ctx_k: Tensor | None = None  # [layers, max_len, kv_heads, head_dim]
        self._ctx_v: Tensor | None = None
        self._cached = 0  # positions 0.._cached-1 have their context K/V in the buffers
        self._constants: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}

    def reset(self) -> None:
        """A new generation: nothing cached is valid any more."""
        self._cached = 0

    def _context_kv(self, start: int, features: Tensor) -> None:
        """Project the context K/V of the positions committed since the last call (< start)."""
        cfg = self.draft.cfg
        if self._ctx_k is None or self._ctx_k.shape[1] < features.shape[0] or self._ctx_k.device != features.device:
            shape = (cfg.num_hidden_layers, features.shape[0], cfg.num_key_value_heads, cfg.dim_per_head)
            self._ctx_k = torch.empty(shape, device=features.device, dtype=self.draft.fc.weight.dtype)
            self._ctx_v = torch.empty_like(self._ctx_k)
            self._cached = 0
        if start < self._cached:  # the position went back without a reset: recompute
            self._cached = 0
        if start > self._cached:
            positions = torch.arange(self._cached, start, device=features.device)
            for i, (k, v) in enumerate(self.draft.context_kv(features[self._cached : start], positions)):
                self._ctx_k[i, self._cached : start] = k
                self._ctx_v[i, self._cached : start] = v
            self._cached = start

    @torch.inference_mode()  # its buffers are updated in place, and are inference tensors once made in a decode
    def propose(self, seq: Tensor, start: int, block_size: int, window: int, features: Tensor) -> Tensor:
        device = seq.device
        if self._block_ids is None or self._block_ids.numel() != block_size or self._block_ids.device != device:
            self._block_ids = torch.full((block_size,), self.mask_token_id, dtype=torch.long, device=device)
        self._block_ids[:1].copy_(seq[start : start + 1])  # no host read of the root token
        self._context_kv(start, features)
        lo = 0 if window <= 0 else max(0, start - window)
        ctx_kv = [(self._ctx_k[i, lo:start], self._ctx_v[i, lo:start]) for i in range(self._ctx_k.shape[0])]
        block_pos = torch.arange(start, start + block_size, device=device)
        h = self.draft.forward_cached(self.target.embed_tokens(self._block_ids), ctx_kv, block_pos)
        return self._logits(h)

    def new_context(self, max_len: int) -> tuple[Tensor, Tensor]:
        """Context key/value buffers for ``propose_static``: [layers, max_len, kv_heads, head_dim] each."""
        cfg, w = self.draft.cfg, self.draft.fc.weight
        shape = (cfg.num_hidden_layers, max_len, cfg.num_key_value_heads, cfg.dim_per_head)
        k = torch.zeros(shape, device=w.device, dtype=w.dtype)
        return k, torch.zeros_like(k)

    @torch.inference_mode()
    def fill_context(self, context: tuple[Tensor, Tensor], features: Tensor, end: int) -> None:
        """The context keys/values of positions 0..end-1 (a prompt's, after its prefill) into
        ``context``; ``propose_static`` keeps them up to date from there."""
        positions = torch.arange(end, device=features.device)
        for i, (k, v) in enumerate(self.draft.context_kv(features[:end], positions)):
            context[0][i, :end] = k
            context[1][i, :end] = v

    def propose_static(self, seq: Tensor, start: Tensor, block_size: int, window: int, features: Tensor,
                       context: tuple[Tensor, Tensor], key_len: int, context_rows: int | None = None) -> Tensor:
        """``propose`` with the root's position ``start`` ([1] long) held on the device: the
        shape-static form a CUDA graph replays at every step.

        The context keys/values of positions ``start - context_rows .. start - 1`` (default
        ``block_size``) are (re)computed from ``features`` and stored in ``context``, and the block
        attends over slots ``max(0, start - window) .. start + block_size - 1`` of the first
        ``key_len`` (``window`` 0: the whole context). A step commits at most ``block_size`` tokens, so
        after a step that proposed, every position committed since the last call is among the last
        ``block_size``; older ones are already there, from ``fill_context`` or earlier calls. A caller
        whose steps commit without proposing (the adaptive policy's AR steps) asks for more rows once
        (``AdaptivePolicy.catch_up_rows``). ``key_len`` must cover ``start + block_size``."""
        rows = block_size if context_rows is None else context_rows
        offsets, keys, ids = self._static_constants(block_size, rows, key_len, seq.device)
        # the last ``rows`` context positions, then the block's; before position 0: position 0 again
        # (the same values written twice)
        slots = (start + offsets).clamp(min=0)
        fresh = slots[:rows]
        torch.index_select(seq, 0, start, out=ids[:1])  # the root, then mask tokens (this shape's own buffer)
        seen = keys < start + block_size
        if window > 0:
            seen = seen & (keys >= start - window)
        # Row gathers by indexing, not index_select: for 16 rows the latter's small-index kernel loops
        # over the indices (8-9 us on an H200 against ~3).
        h = self.draft.forward_static(self.target.embed_tokens.weight[ids], features[fresh], slots, context[0],
                                      context[1], key_len, seen[None, :].expand(block_size, -1))
        return self._logits(h)

    def _static_constants(self, block: int, rows: int, key_len: int, device: torch.device
                          ) -> tuple[Tensor, Tensor, Tensor]:
        """Per step shape, made once (a CUDA graph replays reads of them, not their construction):
        -rows..block-1, 0..key_len-1, and the block's token buffer (mask tokens after the root)."""
        key = (block, rows, key_len, device)
        if key not in self._constants:
            self._constants[key] = (torch.arange(-rows, block, device=device), torch.arange(key_len, device=device),
                                    torch.full((block,), self.mask_token_id, dtype=torch.long, device=device))
        return self._constants[key]

    def _logits(self, h: Tensor) -> Tensor:
        logits = self.target.lm_head(h[1:])
        if self.draft.cfg.output_multiplier != 1.0:
            logits = logits * self.draft.cfg.output_multiplier
        return logits


class OracleDrafter:
    """Test draft: the target's true greedy continuation, each slot corrupted with probability p.

    A corrupted slot ranks a wrong token first and keeps the true token at rank 1..3, so chains
    break there while trees recover through side branches. Deterministic in (seed, position).
    """

    def __init__(self, target: nn.Module, p: float, seed: int = 0, block_size: int = 16) -> None:
        self.target = target
        self.p = p
        self.seed = seed
        self.block_size = block_size
        self.feature_layers: tuple[int, ...] = ()
        self._cache = None
        self._cache_len = 0

    def reset(self) -> None:
        if self._cache is not None:
            self._cache.reset()

    def _ensure_cache(self, need: int) -> None:
        if self._cache is None or self._cache_len < need:
            self._cache_len = max(need, 2 * self._cache_len)
            self._cache = self.target.new_cache(self._cache_len)

    def propose(self, seq: Tensor, start: int, block_size: int, window: int, features: Tensor) -> Tensor:
        depth = block_size - 1
        self._ensure_cache(start + block_size + 2)
        cache = self._cache
        if cache.length > start + 1:  # a new generation with a shorter prefix: start over
            cache.reset()
        if cache.length < start + 1:
            logits, _ = self.target(seq[cache.length : start + 1], cache, cache.length, last_only=True)
        else:  # nothing new committed since the last proposal cannot happen: every step commits >= 1
            raise RuntimeError("oracle draft called twice at the same position")
        snap = cache.snapshot()
        truth = []
        tok = torch.argmax(logits[-1])
        for j in range(depth):
            truth.append(tok)
            if j + 1 < depth:
                logits, _ = self.target(tok.view(1), cache, cache.length, last_only=True)
                tok = torch.argmax(logits[-1])
        cache.restore(snap)
        return self._corrupt(torch.stack(truth), start)

    def _corrupt(self, truth: Tensor, start: int) -> Tensor:
        vocab = self.target.lm_head.out_features
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + start)
        n = truth.numel()
        logits = torch.randn(n, vocab, generator=gen)  # background well below the top ranks
        corrupt = torch.rand(n, generator=gen) < self.p
        decoys = torch.randint(0, vocab, (n, 3), generator=gen)
        true_rank = torch.randint(1, 4, (n,), generator=gen)
        truth_cpu = truth.cpu()
        for j in range(n):
            t = int(truth_cpu[j])
            if not corrupt[j]:
                logits[j, t] = 20.0
                continue
            ranked = [int(d) for d in decoys[j] if int(d) != t][: int(true_rank[j])]
            for r, d in enumerate(ranked):
                logits[j, d] = 20.0 - r
            logits[j, t] = 20.0 - len(ranked)
        return logits.to(truth.device)
