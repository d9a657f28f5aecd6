"""What both decode loops share, and neither owns: the workspace a generation decodes in, the phase
timer, the prompt's prefill and a generation's finish, the draft's tree proposal (host or device) and
the grammar's glue (masking, advancing, the commit placement's cut). ``engine.decoding.decode`` (the generic
loop) and ``engine.decoding.runtime`` (the device-resident one) import it; it imports neither.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.config import EngineConfig
from engine.decoding import policy, tree_kernel
from engine.decoding import prefix_cache as prefix_cache_mod
from engine.decoding.grammar import GrammarState, mask_logits
from engine.decoding.prefix_cache import PrefixCache
from engine.decoding.sampling import select_tokens, top_margins
from engine.decoding.stats import PHASES, Generation, GenerationStats
from engine.decoding.tree import Tree, ancestor_mask, build_tree_host, chain_tree
from engine.models import topk


class PhaseTimer:
    """Per-phase wall time. On CUDA, events (no host sync inside a step); on CPU, perf_counter."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.ms = dict.fromkeys(PHASES, 0.0)
        self._events: list[tuple[str, object, object]] = []

    @contextmanager
    def phase(self, name: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.ms[name] += 1000.0 * (time.perf_counter() - t0)

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def checkpoint(self) -> tuple[int, dict[str, float]]:
        """What has been timed so far, for ``rollback``."""
        return len(self._events), dict(self.ms)

    def rollback(self, mark: tuple[int, dict[str, float]]) -> None:
        """Forget the phases timed since ``mark`` (a step launched ahead and not needed)."""
        del self._events[mark[0]:]
        self.ms = dict(mark[1])

    def collect(self) -> dict[str, float]:
        if self._events:
            # the last kept phase's end (earlier ones complete before it, one stream), not the device:
            # a step launched ahead and rolled back may still run, and the caller need not wait for it
            self._events[-1][2].synchronize()
            for name, start, end in self._events:
                self.ms[name] += start.elapsed_time(end)
            self._events.clear()
        return dict(self.ms)


OnTokens = Callable[[list[int]], None]  # receives one step's committed tokens


@dataclass
class Workspace:
    """Buffers one generation needs, reused across generations while large enough."""

    cache: object
    seq: Tensor  # [max_len] every token: prompt, then committed output
    features: Tensor | None  # [max_len or a ring's rows, n_ids * H] target features (drafters.feature_slice)
    max_len: int
    margins: Tensor | None = None  # [max_len + 1, 2] see margin_buffer (allocated on first use)

    def margin_buffer(self) -> Tensor:
        """[max_len + 1, 2] float32, by position like ``seq``: ``top_margins`` of the logits row that
        picked the token there (``record_margins``). A verify writes all its rows after the root (one
        slot past ``max_len`` at most); rows past the accepted path lie beyond the committed length,
        as their K/V do. Allocated once per workspace: captured steps write into it."""
        if self.margins is None:
            self.margins = torch.zeros(self.max_len + 1, 2, dtype=torch.float32, device=self.seq.device)
        return self.margins

    def attach_margins(self, gen: Generation, first: int) -> Generation:
        """``gen`` with the margins of its tokens (the first at position ``first``): one read, after
        the generation (outside its timing)."""
        rows = self.margin_buffer()[first : first + len(gen.tokens)].tolist()
        gen.top_logits, gen.margins = [r[0] for r in rows], [r[1] for r in rows]
        return gen


def constrain_logits(gs: GrammarState, bits: Tensor, logits: Tensor, stats: GenerationStats) -> Tensor:
    """logits [1, V] masked by the grammar's next-token mask (grammar time counted)."""
    t0 = time.perf_counter()
    gs.fill(bits, 0)
    stats.grammar_ms += 1000.0 * (time.perf_counter() - t0)
    return mask_logits(logits.view(1, -1), bits[:1])


def advance_grammar(gs: GrammarState, token: int, stats: GenerationStats) -> None:
    t0 = time.perf_counter()
    ok = gs.advance(token)
    stats.grammar_ms += 1000.0 * (time.perf_counter() - t0)
    assert ok, f"token {token} was picked from grammar-masked logits, yet the grammar refuses it"


def tree_bitmask(gs: GrammarState, tokens: list[int], parents: list[int], bits: Tensor) -> None:
    """Row i of ``bits`` := the grammar's mask after the committed prefix and node i's path.

    Depth-first over the tree, advancing on the way down and rolling back on the way up, so each
    node costs one advance, one mask and one rollback. A node the grammar refuses (and its subtree)
    keeps an all-allowed row: the walk never reaches it, since its parent's posterior is masked.
    """
    children: list[list[int]] = [[] for _ in tokens]
    for i in range(1, len(tokens)):
        children[parents[i]].append(i)
    bits[: len(tokens)].fill_(-1)
    gs.fill(bits, 0)
    stack = [(c, False) for c in reversed(children[0])]
    while stack:
        node, leaving = stack.pop()
        if leaving:
            gs.rollback(1)
            continue
        if not gs.advance(tokens[node]):
            continue
        stack.append((node, True))
        if not gs.done:  # after the stop token nothing is committed (the step is cut there): no mask, no descent
            gs.fill(bits, node)
            stack.extend((c, False) for c in reversed(children[node]))


def grammar_commit(gs: GrammarState, new: list[int], repick: Callable[[int], int],
                   placement: str) -> tuple[list[int], bool]:
    """Advance the grammar over a step's committed tokens; returns (tokens kept, step cut short).

    ``new[i]`` is the target's token at the step's i-th accepted node. Under ``commit`` the walk was
    unconstrained: at the first token the grammar refuses, the step is cut and ``repick(i)`` gives
    the target's token at that node from its grammar-masked logits (the AR choice: where the
    unconstrained pick was allowed, the masked pick is the same token). Under both placements the
    step ends at the token that completes the grammar.
    """
    for i, t in enumerate(new):
        if not gs.advance(t):
            assert placement == "commit", "the walk placement committed a token its grammar refuses"
            t = repick(i)
            ok = gs.advance(t)
            assert ok, f"token {t} was picked from grammar-masked logits, yet the grammar refuses it"
            return new[:i] + [t], True
        if gs.done:
            return new[: i + 1], i + 1 < len(new)
    return new, False


def masked_pick(gs: GrammarState, bits: Tensor, logits: Tensor, node: int, position: int,
                cfg: EngineConfig, margins: Tensor | None = None) -> int:
    """The target's token at ``node`` (its logits row) under the grammar's current mask; with
    ``margins`` (``Workspace.margin_buffer``) the masked row's margin replaces the unmasked one at
    ``position``: the masked row picked the token committed there."""
    gs.fill(bits, 0)
    row = mask_logits(logits[node : node + 1], bits[:1])
    if margins is not None:
        margins[position : position + 1] = top_margins(row)
    return int(select_tokens(row, torch.tensor([position], device=logits.device), cfg.temperature, cfg.seed))


def truncate(new: list[int], emitted: int, max_new: int, stop_ids: Sequence[int]) -> tuple[list[int], bool]:
    """Cut a step's tokens at max_new and at the first stop token (kept, as AR keeps it)."""
    new = new[: max_new - emitted]
    for i, t in enumerate(new):
        if t in stop_ids:
            return new[: i + 1], True
    return new, emitted + len(new) >= max_new


def prefill(pair, ws: Workspace, prompt: Sequence[int], cfg: EngineConfig, feature_layers: Sequence[int],
            constrain: Callable[[Tensor], Tensor] | None = None, record_margins: bool = False,
            prefix_cache: PrefixCache | None = None, on_span: Callable[[int], None] | None = None) -> int:
    """The prompt's forward: its K/V (and draft features) cached, ``seq`` holding the prompt and
    the first new token, which is returned. ``constrain`` masks the last logits (a grammar).
    ``prefix_cache``: the longest cached prefix reused, the rest forwarded in the decode steps' form
    (``PrefixCache.prefill``). Without one, a prompt of more than ``PREFILL_CHUNK`` tokens is forwarded
    the same way, ``prefill_rows`` at a time: a whole-prompt forward's mask and attention scores grow
    with the prompt's square (the plan's prefill transient at 32k tokens on the Qwen3.5-27B shape:
    8.8 GiB), a chunk's stay within ``PREFILL_TRANSIENT_BYTES``; and a long prompt's K/V, features and
    state carry the bits a cold prefix cache's prefill gives them. ``on_span(e)`` (without a prefix cache):
    after each forward, the prompt's positions before ``e`` done (their features in ``ws.features``)."""
    n, seq = len(prompt), ws.seq
    seq[:n] = torch.tensor(prompt, device=seq.device)
    if prefix_cache is not None:
        logits = prefix_cache.prefill(pair.target, ws, prompt, feature_layers)
    elif n > prefix_cache_mod.PREFILL_CHUNK:
        logits = prefix_cache_mod.prefill_as_steps(pair.target, ws, 0, n,
                                                   feature_layers if ws.features is not None else (),
                                                   prefix_cache_mod.prefill_rows(pair.target, n,
                                                                                 prefix_cache_mod.PREFILL_CHUNK),
                                                   on_span)
    else:
        logits, f = pair.target(seq[:n], ws.cache, 0, feature_layers=feature_layers, last_only=True)
        if ws.features is not None and f is not None:
            ws.features[:n] = f  # (n <= PREFILL_CHUNK: within a ring's rows)
        if on_span is not None:
            on_span(n)
    if constrain is not None:
        logits = constrain(logits)
    if record_margins:
        ws.margin_buffer()[n : n + 1] = top_margins(logits)
    seq[n : n + 1] = select_tokens(logits, torch.tensor([n], device=seq.device), cfg.temperature, cfg.seed)
    return int(seq[n])


def begin(pair, ws: Workspace, prompt: Sequence[int], cfg: EngineConfig, feature_layers: Sequence[int],
          stats: GenerationStats, timer: PhaseTimer, gs: GrammarState | None, bits: Tensor | None,
          on_tokens: OnTokens | None, stop_ids: Sequence[int], max_new_tokens: int, record_margins: bool,
          after_prefill: Callable[[], None] | None = None, prefix_cache: PrefixCache | None = None,
          on_span: Callable[[int], None] | None = None) -> tuple[list[int], float, float, bool]:
    """A generation's start, as every loop takes it: the prompt's prefill (its token masked by the
    grammar ``gs`` through ``bits``; with ``prefix_cache``, of what is not cached; ``on_span``: ``prefill``'s),
    ``after_prefill`` (more of the prompt's processing, timed as prefill), the grammar advanced on the first token,
    which goes to ``on_tokens``.
    Returns (the tokens so far, t0, the first token's time, whether the generation is done)."""
    t0 = timer.now()
    constrain = (lambda lg: constrain_logits(gs, bits, lg, stats)) if gs is not None else None
    out = [prefill(pair, ws, prompt, cfg, feature_layers, constrain, record_margins, prefix_cache, on_span)]
    if after_prefill is not None:
        after_prefill()
    if gs is not None:
        advance_grammar(gs, out[0], stats)
    t_first = timer.now()
    stats.prefill_s = t_first - t0
    if on_tokens is not None:
        on_tokens(out[:])
    done = out[0] in stop_ids or max_new_tokens <= 1 or (gs is not None and gs.done)
    return out, t0, t_first, done


def finish(out: list[int], stats: GenerationStats, timer: PhaseTimer, t_first: float, t0: float,
           t_last: float | None = None) -> Generation:
    """Close a generation: phase times collected, decode time from the first to the last token
    (``t_last``: when the last token was read, if work launched ahead may still be running)."""
    t_last = timer.now() if t_last is None else t_last
    stats.phase_ms = timer.collect()
    stats.new_tokens, stats.decode_s, stats.total_s = len(out), t_last - t_first, t_last - t0
    return Generation(tokens=out, stats=stats)


class _Untimed:
    """A PhaseTimer stand-in that times nothing (inside a CUDA graph capture events cannot be timed)."""

    @staticmethod
    def phase(name: str):
        return nullcontext()


UNTIMED = _Untimed()


def scored_tree(cfg: EngineConfig, draft_logits: Tensor, root: Tensor, timer: PhaseTimer | _Untimed,
                max_depth: int, host: bool, path_probs: bool = False) -> tuple[Tree, Tensor, Tensor | None]:
    """topk + tree phases: the tree, its ancestor mask (``ancestor_mask(tree.parents, max_depth)``)
    and the per-depth top-k log-probs that scored it (None: a chain), or with ``path_probs`` (the
    adaptive policy's estimate, a DDTree) the tree's ``policy.path_probabilities`` instead: from the
    tree kernel's own launch where it builds the tree, else from those log-probs.
    ``host`` (the generic loop with ``draft_path="generic"``): logits go to the host, host top-k,
    heap-built tree, back to the device. Otherwise (the runtime, whose captured graphs cannot read
    the host, whatever ``cfg.draft_path`` says; the generic loop under ``auto``) everything stays on
    the device, and a DDTree on CUDA with the kernels on comes with its mask
    from one launch (``tree_kernel.build_tree_and_mask``; ~250 tiny launches otherwise)."""
    device = draft_logits.device
    with timer.phase("topk"):
        logits = draft_logits.float().cpu() if host else draft_logits
        if cfg.verify == "chain":
            top_ids = topk.argmax_rows(logits)
        else:  # top-k of the log-softmax (two launches on CUDA with the kernels on)
            top_lp, top_ids = topk.topk_rows(logits, min(cfg.top_k, logits.shape[-1]), cfg.proposal_temp)
    with timer.phase("tree"):
        mask = None
        if cfg.verify == "chain":
            tree = chain_tree(root.cpu() if host else root, top_ids)
            # a chain's ancestors are the (at most max_depth) nodes before it: ancestor_mask's form in
            # three launches, not ~5 per depth
            t = tree.tokens.numel()
            mask = torch.ones(t, t, dtype=torch.bool, device=device).tril().triu(-max_depth)
        elif host:
            tree = build_tree_host(top_lp, top_ids, int(root), cfg.budget, cfg.chain_seed)
        elif path_probs and tree_kernel.use_tree_kernel(top_lp, cfg.budget, max_depth):
            return tree_kernel.build_scored_tree_kernel(top_lp, top_ids, root, cfg.budget, cfg.chain_seed,
                                                        math.log(policy.FIXED_POINT))
        else:
            tree, mask = tree_kernel.build_tree_and_mask(top_lp, top_ids, root, cfg.budget, cfg.chain_seed,
                                                         max_depth)
        if host:
            tree = tree.to(device)
        if mask is None:
            mask = ancestor_mask(tree.parents, max_depth)
    if cfg.verify == "chain":
        return tree, mask, None
    if path_probs:
        lp = top_lp.to(device)
        return tree, mask, policy.path_probabilities(lp, tree, mask, policy.root_row(lp.shape[1], device))
    # the per-depth log-probs the tree was scored by (on the host where ``host``)
    return tree, mask, top_lp
