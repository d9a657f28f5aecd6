"""Drafters: who proposes the block. A DFlash draft model, or the oracle test draft (on the host, or
taught for the GPU's captured runtime).

Every drafter answers ``propose(seq, start, block_size, window, features)`` with logits [B-1, V]
for the block slots after the root ``seq[start]``; what happens to the logits (host or device
top-k, chain or tree) is the decode loop's business, so every drafter works with every path (the
runtime's captured steps take a DFlash draft's ``propose_static``: ``engine.decoding.runtime``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor, nn

from engine.config import EngineInputError
from engine.models.common import free_rows_, fuse_projections_
from engine.models.draft import DFlashDraft
from engine.models.quant import embed_rows
from engine.models.quant_gluon import hold_operands_

# The oracle's logit for its first rank (the next ranks one less each): far above any other.
_TOP = 20.0
# Context positions projected into the draft's keys/values at once (``DFlashDrafter.project_context``): a long
# prompt's in chunks of this many, each starting at a multiple of it, so that the transient is a chunk's (the
# projected hidden rows, their float32 norm, every layer's K/V: at 32k positions on the Qwen3.5-27B shape's
# draft ~2 GiB whole, ~0.05 GiB in chunks) and a position's chunk is the same whichever call projects it. The
# most rows the few-row kernel takes (``quant_kernel.MAX_ROWS``), so a draft held in blocks (``@q8_0``) reads
# them in place on CUDA rather than dequantizing each weight whole for each chunk.
CONTEXT_ROWS = 1024


def feature_slice(features: Tensor, lo: int, hi: int) -> slice:
    """The rows of positions lo..hi-1 in a workspace's target features: a row a position, or a ring
    (``decode.feature_rows``: position p at row p mod its rows). One run either way: what reads or writes a
    run (a prefill's span, a context chunk) stays within a window of a size that divides the ring's."""
    rows = features.shape[0]
    a = lo % rows
    if a + hi - lo > rows:
        raise RuntimeError(f"positions {lo}..{hi - 1} wrap around a ring of {rows} feature rows")
    return slice(a, a + hi - lo)


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
        # inference: one GEMM per input (checkpoints keep the parts), cuBLAS's rounding (free_rows_); a draft in
        # Q4_K, Q6_K or Q4_1 blocks on an sm_90 GPU in bf16 held as the planes of the operand-register decode
        dtype = next((p.dtype for p in draft.parameters() if p.is_floating_point()), torch.float32)
        self.draft = hold_operands_(free_rows_(fuse_projections_(draft)), dtype)
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

    def _context_kv(self, start: int, features: Tensor, slots: int) -> None:
        """Project the context K/V of the positions committed since the last call (< start), into buffers of
        at least ``slots`` slots (a row a feature row: the workspace's length on the generic loop)."""
        cfg = self.draft.cfg
        slots = max(slots, features.shape[0])
        held = self._ctx_k
        if held is None or held.device != features.device or held.shape[1] < slots:
            if held is not None and held.device == features.device:
                # grown by doubling: a caller with fewer feature rows than the block's last slot would otherwise
                # grow them, and reproject the context, every call (the generic loop's features are the
                # workspace's length: at least start + 2 blocks, made once)
                slots = max(slots, 2 * held.shape[1])
            shape = (cfg.num_hidden_layers, slots, cfg.num_key_value_heads, cfg.dim_per_head)
            self._ctx_k = torch.empty(shape, device=features.device, dtype=self.draft.norm.weight.dtype)
            self._ctx_v = torch.empty_like(self._ctx_k)
            self._cached = 0
        if start < self._cached:  # the position went back without a reset: recompute
            self._cached = 0
        if start > self._cached:
            self.project_context((self._ctx_k, self._ctx_v), features, self._cached, start)
            self._cached = start

    @torch.inference_mode()  # (into buffers a decode made: inference tensors)
    def project_context(self, context: tuple[Tensor, Tensor], features: Tensor, lo: int, hi: int) -> None:
        """The context keys/values of positions lo..hi-1 from their ``features`` (a row a position, or a ring:
        ``feature_slice``) into ``context`` ([layers, max_len, kv_heads, head_dim] each), ``CONTEXT_ROWS``
        positions at a time."""
        a = lo
        while a < hi:
            b = min(hi, (a // CONTEXT_ROWS + 1) * CONTEXT_ROWS)  # (chunks end at multiples of CONTEXT_ROWS)
            positions = torch.arange(a, b, device=features.device)
            for i, (k, v) in enumerate(self.draft.context_kv(features[feature_slice(features, a, b)], positions)):
                context[0][i, a:b] = k
                context[1][i, a:b] = v
            a = b

    @torch.inference_mode()  # its buffers are updated in place, and are inference tensors once made in a decode
    def propose(self, seq: Tensor, start: int, block_size: int, window: int, features: Tensor) -> Tensor:
        device = seq.device
        if self._block_ids is None or self._block_ids.numel() != block_size or self._block_ids.device != device:
            self._block_ids = torch.full((block_size,), self.mask_token_id, dtype=torch.long, device=device)
        self._block_ids[:1].copy_(seq[start : start + 1])  # no host read of the root token
        self._context_kv(start, features, start + block_size)  # (the block's K/V go past the context's)
        lo = 0 if window <= 0 else max(0, start - window)
        h = self.draft.forward_cached(self.target.embed_tokens(self._block_ids), (self._ctx_k, self._ctx_v), lo,
                                      start)
        return self._logits(h)

    def new_context(self, max_len: int) -> tuple[Tensor, Tensor]:
        """Context key/value buffers for ``propose_static``: [layers, max_len, kv_heads, head_dim] each."""
        cfg, w = self.draft.cfg, self.draft.norm.weight  # (the norms stay float in a quantized draft)
        shape = (cfg.num_hidden_layers, max_len, cfg.num_key_value_heads, cfg.dim_per_head)
        k = torch.zeros(shape, device=w.device, dtype=w.dtype)
        return k, torch.zeros_like(k)

    @torch.inference_mode()
    def fill_context(self, context: tuple[Tensor, Tensor], features: Tensor, end: int) -> None:
        """The context keys/values of positions 0..end-1 (a prompt's, after its prefill) into
        ``context``; ``propose_static`` keeps them up to date from there."""
        self.project_context(context, features, 0, end)

    def propose_static(self, seq: Tensor, start: Tensor, block_size: int, window: int, features: Tensor,
                       context: tuple[Tensor, Tensor], key_len: int, context_rows: int | None = None) -> Tensor:
        """``propose`` with the root's position ``start`` ([1] long) held on the device: the
        shape-static form a CUDA graph replays at every step (``features``: a row a position, or a ring of
        at least the rows a step reads, ``decode.feature_rows``).

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
        if features.shape[0] < seq.shape[0]:  # a ring (``decode.feature_rows``): the rows mod its rows
            fresh = fresh % features.shape[0]
        h = self.draft.forward_static(embed_rows(self.target.embed_tokens, ids), features[fresh], slots, context[0],
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
    """Test draft: the target's true greedy continuation, each slot corrupted with probability P.

    A corrupted slot ranks a wrong token first and keeps the true token at rank 1..3, so chains
    break there while trees recover through side branches. Deterministic in (seed, position).

    ``p`` may list one P per prompt (``oracle:0.1,0.5,0.9``): the k-th distinct prompt this draft
    meets (k from 0) takes ``p[k % len(p)]``, and keeps it in every later generation (timing passes,
    warm-ups, the adaptive policy's cost measurement alike). A generation's prompt is read as the
    tokens before its first proposal's root (the first new token): every generation's first step
    proposes (the adaptive policy runs the configured tree until its first estimate).
    """

    def __init__(self, target: nn.Module, p: float | Sequence[float], seed: int = 0, block_size: int = 16) -> None:
        self.target = target
        self.ps = (float(p),) if isinstance(p, (int, float)) else tuple(float(x) for x in p)
        if not self.ps:
            raise EngineInputError("OracleDrafter needs at least one probability")
        self.seed = seed
        self.block_size = block_size
        self.feature_layers: tuple[int, ...] = ()
        self._cache = None
        self._cache_len = 0
        self._by_prompt: dict[tuple[int, ...], float] = {}
        self._p = self.ps[0]  # this generation's
        self._fresh = True  # the next proposal is a generation's first

    def reset(self) -> None:
        self._fresh = True
        if self._cache is not None:
            self._cache.reset()

    def _ensure_cache(self, need: int) -> None:
        if self._cache is None or self._cache_len < need:
            self._cache_len = max(need, 2 * self._cache_len)
            self._cache = self.target.new_cache(self._cache_len)

    def p_for(self, prompt: Sequence[int]) -> float:
        """The P of a generation whose first proposal comes after ``prompt`` (assigned on first sight)."""
        if len(self.ps) == 1:
            return self.ps[0]
        key = tuple(int(t) for t in prompt)
        if key not in self._by_prompt:
            self._by_prompt[key] = self.ps[len(self._by_prompt) % len(self.ps)]
        return self._by_prompt[key]

    def propose(self, seq: Tensor, start: int, block_size: int, window: int, features: Tensor) -> Tensor:
        depth = block_size - 1
        self._ensure_cache(start + block_size + 2)
        cache = self._cache
        if cache.length > start + 1:  # a new generation with a shorter prefix: start over
            cache.reset()
            self._fresh = True
        if self._fresh:  # (not on a cache grown mid-generation, which starts over from position 0 too)
            self._p = self.p_for(seq[:start].tolist())
            self._fresh = False
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
        corrupt = torch.rand(n, generator=gen) < self._p
        decoys = torch.randint(0, vocab, (n, 3), generator=gen)
        true_rank = torch.randint(1, 4, (n,), generator=gen)
        truth_cpu = truth.cpu()
        for j in range(n):
            t = int(truth_cpu[j])
            if not corrupt[j]:
                logits[j, t] = _TOP
                continue
            ranked = [int(d) for d in decoys[j] if int(d) != t][: int(true_rank[j])]
            for r, d in enumerate(ranked):
                logits[j, d] = _TOP - r
            logits[j, t] = _TOP - len(ranked)
        return logits.to(truth.device)


class TaughtOracleDrafter(DFlashDrafter):
    """The ``oracle:P`` draft where drafts run on the GPU: on the captured runtime, at a DFlash draft's cost.

    ``OracleDrafter`` finds the truth by running the target ``block - 1`` times per proposal on the
    host: more than the verify it feeds costs, and never captured, so it cannot time a policy against
    AR. This one is taught the truth instead: ``texts``, each a prompt followed by the target's own
    greedy continuation (AR's output, a block past the generation's end). Each proposal runs the
    DFlash ``draft`` as ``DFlashDrafter`` does (its cost, its context buffers, the runtime's shapes),
    then replaces its logits on the device: the generation's text is the taught one that agrees with
    the committed tokens at most positions, and each slot gets ``OracleDrafter``'s ranks (the true
    token first, or, corrupted with the text's probability P, one to three wrong tokens first and the
    true one after them) above the draft's own logits, shifted to at most 0, which rank the rest. The
    draws are tables made once from ``seed`` and read at the root's position, so a captured proposal
    needs no host; ``assign`` sets each text's P in place (captured graphs stay valid). A generation
    whose text was not taught, or that left it (an inexact one), proposes wrong tokens: slower,
    never inexact: every committed token is the target's.
    """

    def __init__(self, draft: DFlashDraft, target: nn.Module, texts: Sequence[Sequence[int]], seed: int = 0) -> None:
        super().__init__(draft, target)
        if not texts or not all(texts):
            raise EngineInputError("TaughtOracleDrafter needs at least one text, none of them empty")
        device = draft.norm.weight.device
        width = max(len(t) for t in texts)
        table = torch.full((len(texts), width), -1, dtype=torch.long)
        for i, text in enumerate(texts):
            table[i, : len(text)] = torch.tensor(list(text), dtype=torch.long)
        depth = self.block_size - 1
        vocab = target.lm_head.out_features
        gen = torch.Generator().manual_seed(seed)
        self._texts = table.to(device)
        self._columns = torch.arange(max(width, depth), device=device)
        self._draw = torch.rand(width, depth, generator=gen).to(device)  # a slot is corrupted where < P
        self._decoys = torch.randint(0, vocab, (width, depth, 3), generator=gen).to(device)
        self._true_rank = torch.randint(1, 4, (width, depth), generator=gen).to(device)
        self._p = torch.zeros(len(texts), device=device)
        self.ps_by_text: list[float] = [0.0] * len(texts)

    def assign(self, ps: Sequence[float]) -> list[float]:
        """Text i's P becomes ``ps[i % len(ps)]`` (``oracle:P1,P2,...``'s rule: the texts in the order
        taught); returns them."""
        if not ps or not all(0.0 <= p <= 1.0 for p in ps):
            raise EngineInputError(f"assign needs probabilities in [0, 1], but got {list(ps)}")
        self.ps_by_text = [float(ps[i % len(ps)]) for i in range(len(self.ps_by_text))]
        self._p.copy_(torch.tensor(self.ps_by_text))
        return self.ps_by_text

    @torch.inference_mode()
    def propose(self, seq: Tensor, start: int, block_size: int, window: int, features: Tensor) -> Tensor:
        logits = super().propose(seq, start, block_size, window, features)
        return self._oracle(logits, seq, torch.tensor([start], device=seq.device))

    def propose_static(self, seq: Tensor, start: Tensor, block_size: int, window: int, features: Tensor,
                       context: tuple[Tensor, Tensor], key_len: int, context_rows: int | None = None) -> Tensor:
        logits = super().propose_static(seq, start, block_size, window, features, context, key_len, context_rows)
        return self._oracle(logits, seq, start)

    def _oracle(self, logits: Tensor, seq: Tensor, start: Tensor) -> Tensor:
        """The draft's ``logits`` [n, V] for the slots after the root at ``start`` ([1] long) with the
        oracle's ranks on top; no host read."""
        n = logits.shape[0]
        if n > self._draw.shape[1]:
            raise EngineInputError(f"the taught oracle draws {self._draw.shape[1]} slots a proposal (the "
                                   f"draft's block {self.block_size}), but a block of {n + 1} was asked for")
        width = self._texts.shape[1]
        span = min(width, seq.numel())
        agree = (self._texts[:, :span] == seq[:span]) & (self._columns[:span] <= start)
        row = agree.sum(1).argmax().view(1)  # the taught text this generation follows
        slots = self._columns[:n]
        truth = self._texts.index_select(0, row)[0].index_select(0, (start + 1 + slots).clamp(max=width - 1))
        truth = truth.clamp(min=0)  # past the text: some token (a step past the generation's end)
        at = start.clamp(max=width - 1)
        corrupt = self._draw.index_select(0, at)[0, :n] < self._p.index_select(0, row)
        decoys = self._decoys.index_select(0, at)[0, :n]
        rank = self._true_rank.index_select(0, at)[0, :n]
        out = logits - logits.amax(-1, keepdim=True)
        first = self._columns[:3]
        used = corrupt[:, None] & (first[None, :] < rank[:, None])  # the wrong tokens ranked above the truth
        out = out.scatter(1, decoys, torch.where(used, (_TOP - first).to(out.dtype), out.gather(1, decoys)))
        top = torch.where(corrupt, _TOP - rank, _TOP).to(out.dtype)
        return out.scatter(1, truth[:, None], top[:, None])
