"""The prefix cache: committed positions of earlier generations kept across requests, so that a
prompt that starts like an earlier prompt (or an earlier prompt and its answer: an agent's next
turn) prefills only what is new.

What is kept, per position: the target's K/V (attention layers) and, where the generation was
speculative, the draft's context features (the target hidden states ``DFlashDrafter`` projects into
its context K/V). A hybrid target's Gated DeltaNet state cannot be cut at an arbitrary position, so
it is kept as checkpoints (the recurrent and conv state after a position) at two boundaries per
generation: the prompt's last token but one (taken during the prefill: the prompt's last token is
always prefilled, its logits give the first new token) and the end of the committed output (where
the state is exactly there after the decode loop: not after a step launched ahead or a step cut
at ``max_new_tokens`` or a stop token). A hybrid's hit ends at the deepest checkpoint it matches.

The index is a radix tree over token ids (SGLang's RadixAttention has the same shape): each node
an edge of tokens with its positions' tensors, split where two sequences part. Token-granular
matching reuses everything up to the first differing token, wherever it falls: a chat template's
re-tokenised assistant reply can leave the generated ids at any token, and a fixed-block trie would
drop up to a block at every such boundary. Memory is bounded by ``budget_bytes`` (tensors on the
target's device); least recently used leaves (and checkpoints on inner nodes) are evicted first.

Exactness (docs/exactness.md, "The prefix cache"): with a cache every prompt is prefilled in the
decode steps' form (``TargetModel.forward(..., as_steps=True)``, chunks of ``prefill_rows`` rows, at
most ``chunk``, ending at multiples of their rows; a prompt of more than ``PREFILL_CHUNK`` tokens is
prefilled so without a cache too), so every cached position carries the bits an AR step at that
position computes, as the decode loops' committed positions do. Where the steps are row-invariant
(CUDA with the Triton kernels) a position's K/V, features and state depend on the tokens before it
only, not on how they were split into chunks, steps and verifies: a hit equals a cold run (the same
cache, empty) token for token. Elsewhere (the CPU, ``kernels: eager``) they may differ in the last
bits, as a speculative step's rows may from an AR step's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.decoding.drafters import feature_slice
from engine.models import fused
from engine.models.attention import step_split

# the server's budget unless told (--prefix-cache-mb), and a session workload's (autotune's
# workload.prefix_cache_mb): llama-server's cache_prompt is on by default too
DEFAULT_PREFIX_CACHE_MB = 1024
PREFILL_CHUNK = 512  # rows per prefill forward at most; <= linear.MAX_ROWS, where the row-invariant kernel stops
# A chunk's attention transient at most (``prefill_rows``): the step kernel reduces every key span
# apart (float32 partials per span, row and head), so a chunk's transient grows with its rows times
# the keys before it; at 32k tokens on the Qwen3.5-27B shape 512 rows would hold 3 GiB
PREFILL_TRANSIENT_BYTES = 512 << 20
MIN_PREFILL_ROWS = 16


def _row_bytes(target, keys: int, fp32: bool) -> float:
    """A prefill chunk's attention transient per row over ``keys`` keys: the step kernel's float32
    partials (``(head_dim + 2)`` per span of ``step_split`` keys, per head), or the PyTorch form's
    bool mask and float32 scores per key and head, whichever is larger."""
    cfg = target.cfg
    head_dim = getattr(cfg, "dim_per_head", None) or cfg.head_dim
    per_key = 1 + cfg.num_attention_heads * 4 * max(1.0, (head_dim + 2) / step_split(head_dim, fp32))
    return max(int(keys), 1) * per_key


def prefill_rows(target, keys: int, most: int = PREFILL_CHUNK, fp32: bool | None = None) -> int:
    """Rows per prefill chunk whose forward reaches ``keys`` keys: at most ``most``, fewer where a
    chunk's attention transient (``_row_bytes``) would pass ``PREFILL_TRANSIENT_BYTES``; a power of
    two, so that the chunks of a shorter prompt nest in a longer one's. ``fp32``: the activations'
    dtype is float32 (None: the target's). SmolLM2's 8k context keeps 512; the 27B shape in bf16
    takes 256 rows at 8k, 64 at 32k."""
    fp32 = target.dtype == torch.float32 if fp32 is None else fp32
    rows = int(PREFILL_TRANSIENT_BYTES // _row_bytes(target, keys, fp32))
    rows = 1 << max(rows, 1).bit_length() - 1  # a power of two at most that
    return max(min(rows, most), min(MIN_PREFILL_ROWS, most))


def widest_chunks(target, n: int, most: int = PREFILL_CHUNK, fp32: bool | None = None) -> list[tuple[int, int]]:
    """(rows, keys) of the widest chunk a chunked prefill of at most ``n`` tokens forwards, one per
    row count it can take: the rows halve as the keys pass a threshold, so a prompt just short of it
    forwards twice the rows over nearly as many keys. What a plan at ``n`` prices (the largest), so
    that the plan never shrinks as the prompt grows."""
    out, lo_keys = [], n
    while lo_keys >= 1:
        rows = prefill_rows(target, lo_keys, most, fp32)
        out.append((min(rows, lo_keys), lo_keys))
        if rows >= most or rows >= lo_keys:
            break
        # the longest prompt that takes more rows than ``rows``: the step below this threshold
        lo, hi = 1, lo_keys - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if prefill_rows(target, mid, most, fp32) > rows:
                lo = mid
            else:
                hi = mid - 1
        if prefill_rows(target, lo, most, fp32) <= rows:
            break
        lo_keys = lo
    return out


def prefill_spans(start: int, n: int, chunk: int = PREFILL_CHUNK, also: Sequence[int] = ()) -> list[tuple[int, int]]:
    """The forwards of a prefill in the decode steps' form from ``start`` to ``n``: chunks ending at
    multiples of ``chunk`` (so a position's chunk is the same wherever a prefill of it started), and
    at each boundary in ``also`` that falls inside."""
    ends = set(range((start // chunk + 1) * chunk, n, chunk)) | {n} | {e for e in also if start < e < n}
    spans, s = [], start
    for e in sorted(ends):
        spans.append((s, e))
        s = e
    return spans


def prefill_as_steps(target, ws, start: int, n: int, feature_layers: Sequence[int], chunk: int = PREFILL_CHUNK,
                     at_end: Callable[[int], None] | None = None) -> Tensor:
    """Forward ``ws.seq[start:n]`` in the decode steps' form, span by span (``prefill_spans`` of
    ``chunk`` rows; on a recurrent target one more boundary at ``n - 1``, where a prefix cache keeps
    the prompt's state, so that a prefill takes the same forwards with a cache or without),
    ``at_end(e)`` after each span, the draft's features written to ``ws.features`` (a row a position, or
    a ring: ``drafters.feature_slice``) where ``feature_layers`` asks for them. Each forward holds a
    chunk's transients, not the prompt's: a long prompt's prefill needs a chunk's rows over its keys, not
    the prompt's square. Returns the last position's logits [1, V]."""
    also = (n - 1,) if getattr(target, "has_recurrent", False) else ()
    logits = None
    for s, e in prefill_spans(start, n, chunk, also):
        logits, f = target(ws.seq[s:e], ws.cache, s, feature_layers=feature_layers, last_only=True, as_steps=True)
        if feature_layers:  # (a ring's rows: a span ends at a multiple of ``chunk``, which divides the ring's rows)
            ws.features[feature_slice(ws.features, s, e)] = f
        if at_end is not None:
            at_end(e)
    return logits


@dataclass(eq=False)
class _Node:
    """An edge of the tree: ``tokens`` at positions ``start..start+len-1``, their K/V [layers, len,
    kv_heads, head_dim] and features [len, F] (None: a generation that kept none), and ``state``
    (hybrid targets): the recurrent and conv state after the edge's last token."""

    tokens: list[int]
    start: int
    k: Tensor | None = None
    v: Tensor | None = None
    features: Tensor | None = None
    state: tuple[Tensor, Tensor] | None = None
    # The parent, held weakly: a tree of strong links both ways is a reference cycle, which only Python's
    # cyclic collector frees, at a time of its choosing; a dropped or cleared cache (a session sweep's, one
    # a pass) then held its K/V on the GPU past its end (three stale caches in a session trial's peak)
    up: weakref.ref | None = None
    children: dict[int, _Node] = field(default_factory=dict)
    used: int = 0  # the LRU clock when a lookup or an insert last went through this node
    state_used: int = 0  # ... when its state was last restored or stored

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def parent(self) -> _Node | None:
        return None if self.up is None else self.up()

    @parent.setter
    def parent(self, node: _Node | None) -> None:
        self.up = None if node is None else weakref.ref(node)

    def nbytes(self, with_state: bool = True) -> int:
        parts = [self.k, self.v, self.features] + (list(self.state) if with_state and self.state else [])
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


@dataclass
class _Prefilled:
    """The generation in flight: its prompt, its workspace and what its prefill kept aside."""

    prompt: tuple[int, ...]
    ws: object
    features: bool  # the generation computes the draft's features (a speculative one)
    state: tuple[int, tuple[Tensor, Tensor]] | None  # hybrid: (position, state) of the prompt's checkpoint


class PrefixCache:
    """Committed prefixes of one pair's earlier generations (module docstring). ``generate(...,
    prefix_cache=cache)`` calls ``prefill`` (restore the longest cached prefix, prefill the rest)
    and ``commit`` (keep the generation's prompt and output). One generation at a time.

    Counters (``stats``): lookups that reused something (``hits``) or nothing (``misses``), prompt
    and reused tokens, evicted nodes and checkpoints, bytes held."""

    def __init__(self, budget_bytes: int, chunk: int = PREFILL_CHUNK) -> None:
        from engine.models.linear import MAX_ROWS

        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, but got {budget_bytes}")
        if not 1 <= chunk <= MAX_ROWS:
            raise ValueError(f"chunk must be between 1 and {MAX_ROWS} (the row-invariant kernel's rows), "
                             f"but got {chunk}")
        self.budget_bytes, self.chunk = budget_bytes, chunk
        self._root = _Node([], 0)
        self._clock = 0
        self._numerics: tuple | None = None  # how the cached positions were computed (``_check_numerics``)
        self._recurrent = False  # the target keeps a recurrent state: hits end at checkpoints
        self._current: _Prefilled | None = None
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0
        self.prompt_tokens = self.cached_tokens = 0
        self.last_hit = 0  # prompt tokens the latest generation reused

    # -- the two calls a generation makes --------------------------------------------------------------
    def prefill(self, target, ws, prompt: Sequence[int], feature_layers: Sequence[int]) -> Tensor:
        """The prompt's prefill with the cache: the longest cached prefix (at most all tokens but the
        last) copied into the workspace ``ws``, the rest forwarded in the decode steps' form in
        chunks; ``ws.seq`` already holds the prompt. Returns the last position's logits [1, V]."""
        self._check_numerics(target)
        n, cache = len(prompt), ws.cache
        features = bool(feature_layers) and ws.features is not None
        recurrent = self._recurrent
        self._current = None
        self._clock += 1
        hit, path = self._match(prompt, n - 1, ws.features if features else None, recurrent)
        cache.reset()
        if hit:
            self._restore(ws, path, hit, features, recurrent)
        self.last_hit = hit
        self.hits += hit > 0
        self.misses += hit == 0
        self.prompt_tokens += n
        self.cached_tokens += hit
        state = None

        def checkpoint(e: int) -> None:
            nonlocal state
            if recurrent and e == n - 1:  # the prompt's checkpoint (its last token is forwarded next)
                state = (e, (cache.rec.clone(), cache.conv.clone()))

        logits = prefill_as_steps(target, ws, hit, n, feature_layers if features else (),
                                  prefill_rows(target, n, self.chunk), checkpoint)
        self._current = _Prefilled(tuple(prompt), ws, features, state)
        return logits

    def commit(self, tokens: Sequence[int] | None) -> None:
        """Keep the generation in flight (prefilled by ``prefill``): its prompt and ``tokens`` (the
        committed output), or its prompt alone where ``tokens`` is None (a generation that ended in
        an exception: the prompt's positions are all that is sure). Nothing when no prefill ran."""
        cur, self._current = self._current, None
        if cur is None:
            return
        n, cache = len(cur.prompt), cur.ws.cache
        seq = list(cur.prompt) + list(tokens or ())
        # positions with K/V: the prompt's, then each committed token's but the last (the next root)
        length = n if tokens is None else min(cache.length, n + len(tokens) - 1)
        checkpoints: dict[int, tuple[Tensor, Tensor]] = {}
        if getattr(cache, "rec", None) is not None:
            if cur.state is not None:
                checkpoints[cur.state[0]] = cur.state[1]
            if tokens is not None and cache.length == length and not cache.ahead and length >= n:
                checkpoints[length] = (cache.rec.clone(), cache.conv.clone())
            if not checkpoints:  # a hybrid's positions past its last checkpoint cannot be resumed
                return
            length = max(checkpoints)
        self._insert(seq[:length], cur.ws, cur.features, checkpoints)

    # -- counters ---------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Plain counters for reports and ``/metrics`` (read from another thread: no walk of the tree)."""
        lookups = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses, "hit_rate": self.hits / lookups if lookups else 0.0,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "token_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                "evictions": self.evictions, "bytes": self.bytes, "capacity_bytes": self.budget_bytes}

    def clear(self) -> None:
        """Drop every cached position (the counters stay)."""
        self._root = _Node([], 0)
        self.bytes = 0
        self._current = None

    # -- lookup ---------------------------------------------------------------------------------------
    def _check_numerics(self, target) -> None:
        """Positions computed one way only: a generation of another target, or on another device,
        dtype or kernel set (``kernels: fused`` / ``eager`` round differently) empties the cache first."""
        numerics = (id(target), str(target.device), target.dtype,
                    target.device.type == "cuda" and fused.kernels_enabled(), bool(target.has_recurrent))
        if numerics != self._numerics:
            self.clear()
            self._numerics, self._recurrent = numerics, numerics[-1]

    def _match(self, prompt: Sequence[int], limit: int, features: Tensor | None, recurrent: bool
               ) -> tuple[int, list[tuple[_Node, int]]]:
        """(tokens reusable, the path to them: (node, tokens of it used)), at most ``limit`` tokens;
        with ``features`` (the workspace's) only nodes that kept features of that width; on a
        recurrent target up to the deepest node whose state is kept."""
        node, pos, path = self._root, 0, []
        while pos < limit:
            child = node.children.get(prompt[pos])
            if child is None or (features is not None and (child.features is None
                                                           or child.features.shape[1] != features.shape[1])):
                break
            m = _common(child.tokens, prompt, pos, limit)
            path.append((child, m))
            pos += m
            if m < len(child.tokens):
                break
            node = child
        if recurrent:
            while path and (path[-1][1] < len(path[-1][0].tokens) or path[-1][0].state is None):
                path.pop()
            pos = path[-1][0].end if path else 0
        for n, _ in path:
            n.used = self._clock
        if recurrent and path:
            path[-1][0].state_used = self._clock
        return pos, path

    def _restore(self, ws, path: list[tuple[_Node, int]], hit: int, features: bool, recurrent: bool) -> None:
        cache = ws.cache
        for node, m in path:
            a, b = node.start, node.start + m
            cache.k[:, a:b] = node.k[:, :m]
            cache.v[:, a:b] = node.v[:, :m]
            if features:
                ws.features[a:b] = node.features[:m]
        if recurrent:
            rec, conv = path[-1][0].state
            cache.restore((hit, rec, conv))
        else:
            cache.restore(hit)

    # -- insert and evict -----------------------------------------------------------------------------
    def _insert(self, seq: list[int], ws, features: bool, checkpoints: dict[int, tuple[Tensor, Tensor]]) -> None:
        """Keep ``seq`` (its positions' K/V in ``ws``) and the states at the ``checkpoints`` positions."""
        self._clock += 1
        cache = ws.cache
        # what the tree holds already: the path, protected from this insert's evictions
        node, pos, path = self._root, 0, [self._root]
        while pos < len(seq) and (child := node.children.get(seq[pos])) is not None:
            m = _common(child.tokens, seq, pos, len(seq))
            path.append(child)
            pos += m
            if m < len(child.tokens):
                break
            node = child
        per_token = _token_bytes(cache, ws.features if features else None)
        length, checkpoints = self._fit(seq, pos, per_token, checkpoints,
                                        self.budget_bytes - sum(n.nbytes() for n in path))
        if length == 0:
            return  # nothing fits beside what the path holds (what is cached stays)
        seq = seq[:length]
        new_states = [c for c in checkpoints if not self._has_state(c, seq)]
        need = max(0, length - pos) * per_token + sum(_state_bytes(checkpoints[c]) for c in new_states)
        self._evict(self.budget_bytes - need, set(path))
        # now the insert proper: split where the sequence leaves an edge, then one new leaf
        node, pos = self._root, 0
        while pos < len(seq) and (child := node.children.get(seq[pos])) is not None:
            m = _common(child.tokens, seq, pos, len(seq))
            if m < len(child.tokens):
                child = self._split(child, m)
            if features and child.features is None:  # an AR generation's positions: the features added
                child.features = ws.features[child.start : child.end].clone()
                self.bytes += child.features.numel() * child.features.element_size()
            child.used = self._clock
            node, pos = child, pos + m
        if pos < len(seq):
            leaf = _Node(seq[pos:], pos, cache.k[:, pos : len(seq)].clone(), cache.v[:, pos : len(seq)].clone(),
                         ws.features[pos : len(seq)].clone() if features else None, up=weakref.ref(node),
                         used=self._clock)
            node.children[seq[pos]] = leaf
            self.bytes += leaf.nbytes()
        for c, state in checkpoints.items():
            at = self._node_ending_at(c, seq)
            if at is not None and at.state is None:
                at.state = state
                self.bytes += _state_bytes(state)
            if at is not None:
                at.state_used = self._clock
        self._evict(self.budget_bytes, set())

    def _fit(self, seq: list[int], pos: int, per_token: int, checkpoints: dict[int, tuple[Tensor, Tensor]],
             room: int) -> tuple[int, dict[int, tuple[Tensor, Tensor]]]:
        """The longest part of ``seq`` (the tree holds its first ``pos`` tokens) whose new positions
        and states fit in ``room`` bytes, and the checkpoints kept with it: on a dense target the
        first tokens that fit; on a recurrent one up to the deepest checkpoint that fits with the
        states before it. (0, {}): nothing fits."""
        if not checkpoints:
            return min(len(seq), pos + max(room, 0) // per_token), {}
        for end in sorted(checkpoints, reverse=True):
            kept = {c: st for c, st in checkpoints.items() if c <= end}
            new = [c for c in kept if not self._has_state(c, seq)]
            if max(0, end - pos) * per_token + sum(_state_bytes(kept[c]) for c in new) <= room:
                return end, kept
        return 0, {}

    def _has_state(self, position: int, seq: list[int]) -> bool:
        node, pos = self._root, 0
        while pos < position and (child := node.children.get(seq[pos])) is not None:
            if child.end > position or child.tokens != seq[pos : child.end]:
                return False
            node, pos = child, child.end
        return pos == position and node.state is not None

    def _node_ending_at(self, position: int, seq: list[int]) -> _Node | None:
        """The node of ``seq``'s path that ends at ``position`` (split there if one spans it)."""
        node, pos = self._root, 0
        while pos < position:
            child = node.children.get(seq[pos])
            if child is None:
                return None
            if child.end > position:
                child = self._split(child, position - pos)
            node, pos = child, child.end
        return node if node is not self._root else None

    def _split(self, node: _Node, m: int) -> _Node:
        """Cut ``node``'s edge after ``m`` tokens; returns the new upper node (the lower keeps the
        children and the state). Both halves are copies: an evicted half frees its memory."""
        upper = _Node(node.tokens[:m], node.start, node.k[:, :m].clone(), node.v[:, :m].clone(),
                      None if node.features is None else node.features[:m].clone(), up=node.up, used=node.used)
        node.tokens, node.start = node.tokens[m:], node.start + m
        node.k, node.v = node.k[:, m:].clone(), node.v[:, m:].clone()
        node.features = None if node.features is None else node.features[m:].clone()
        node.parent.children[upper.tokens[0]] = upper
        upper.children[node.tokens[0]] = node
        node.parent = upper
        return upper

    def _evict(self, target_bytes: int, protected: set) -> None:
        """Evict until at most ``target_bytes`` are held: the least recently used of the leaves and of
        the states on inner nodes, never a ``protected`` node. On a recurrent target a leaf without
        a state goes first (no hit can end in it)."""
        while self.bytes > target_bytes:
            best, best_key, whole = None, None, False
            for n in self._nodes():
                if n in protected:
                    continue
                if not n.children:
                    key = -1 if self._recurrent and n.state is None else n.used
                    if best_key is None or key < best_key:
                        best, best_key, whole = n, key, True
                elif n.state is not None and (best_key is None or n.state_used < best_key):
                    best, best_key, whole = n, n.state_used, False
            if best is None:
                return
            self.evictions += 1
            if whole:
                self.bytes -= best.nbytes()
                del best.parent.children[best.tokens[0]]
            else:
                self.bytes -= best.nbytes() - best.nbytes(with_state=False)
                best.state = None

    def _nodes(self):
        stack = list(self._root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())


def _common(edge: list[int], seq: Sequence[int], pos: int, limit: int) -> int:
    """How many of ``edge``'s tokens equal ``seq[pos:limit]``'s, from the first."""
    m, top = 0, min(len(edge), limit - pos)
    while m < top and edge[m] == seq[pos + m]:
        m += 1
    return m


def _state_bytes(state: tuple[Tensor, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state)


def _token_bytes(cache, features: Tensor | None) -> int:
    kv = 2 * cache.k[:, :1].numel() * cache.k.element_size()
    return kv + (0 if features is None else features.shape[1] * features.element_size())
