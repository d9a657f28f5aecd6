"""The two decode loops: plain AR, and speculative (draft -> tree -> verify -> walk -> commit).

Chain verify is the degenerate tree (one path), so both speculative modes share one loop.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Sequence

import torch
from torch import Tensor

from engine.config import EngineConfig, EngineInputError
from engine.decoding import runtime
from engine.decoding.drafters import CONTEXT_ROWS
from engine.decoding.grammar import CompiledGrammar, GrammarState, mask_logits, new_bitmask
from engine.decoding.loop import (
    OnTokens,
    PhaseTimer,
    advance_grammar,
    begin,
    constrain_logits,
    finish,
    grammar_commit,
    masked_pick,
    scored_tree,
    tree_bitmask,
    truncate,
)
from engine.decoding.policy import (
    AdaptivePolicy,
    StepCosts,
    catch_up_rows,
    policy_budgets,
    prefix,
    root_tree,
)
from engine.decoding.prefix_cache import PrefixCache
from engine.decoding.sampling import select_tokens, top_margins
from engine.decoding.stats import Generation, GenerationStats
from engine.decoding.tree import Tree, walk_device, walk_host
from engine.models import fused
from engine.models.common import VerifyTree

# A runtime generation's target features without a prefix cache: a ring of this many positions (``feature_rows``),
# the draft's context chunk (``drafters.CONTEXT_ROWS``), so that a chunk of a prompt is whole in it when it is
# projected; 1.57 GiB on the Qwen3.5-27B shape at 32k positions, 50 MiB as a ring
FEATURE_RING_ROWS = CONTEXT_ROWS


def _use_runtime(pair, cfg: EngineConfig, gs: GrammarState | None, use_runtime: bool | None) -> bool:
    """Whether ``engine.decoding.runtime`` decodes (``runtime.loop_for``: ``draft_path``, or ``use_runtime``
    in tests: True the runtime on any device, False this module's loop); a refused config raises."""
    return runtime.loop_for(pair, cfg, gs is not None, use_runtime) != "generic"


@torch.inference_mode()
def generate_ar(pair, prompt: Sequence[int], cfg: EngineConfig, max_new_tokens: int,
                stop_ids: Sequence[int] = (), on_tokens: OnTokens | None = None,
                gs: GrammarState | None = None, use_runtime: bool | None = None,
                record_margins: bool = False, prefix_cache: PrefixCache | None = None) -> Generation:
    """Plain decoding, one target forward per token; greedy or position-keyed sampling.

    With a grammar state ``gs`` the logits are masked at every step (inside ``verify``).
    ``use_runtime`` (default: as ``cfg.draft_path`` says) runs the runtime (``engine.decoding.runtime``).
    ``record_margins``: ``Generation.margins`` (``Workspace.margin_buffer``). ``prefix_cache``: the
    prompt's prefill reuses it (``loop.prefill``)."""
    target, stats = pair.target, GenerationStats()
    ws = pair.workspace(workspace_length(pair, cfg, len(prompt), max_new_tokens), feature_dim=0)
    timer = PhaseTimer(ws.seq.device)
    if _use_runtime(pair, cfg, gs, use_runtime):
        dec = runtime.decoder_for(pair, ws, graphs=ws.seq.device.type == "cuda")
        return dec.generate(prompt, cfg, max_new_tokens, stop_ids, on_tokens, timer, gs, record_margins,
                            prefix_cache=prefix_cache)
    margins = ws.margin_buffer() if record_margins else None  # before the prefill: allocation is not timed
    bits = new_bitmask(1, gs.words) if gs is not None else None
    out, t0, t_first, done = begin(pair, ws, prompt, cfg, (), stats, timer, gs, bits, on_tokens, stop_ids,
                                   max_new_tokens, record_margins, prefix_cache=prefix_cache)
    tok = ws.seq[len(prompt)]
    while not done:
        pos = ws.cache.length
        with timer.phase("verify"):
            logits, _ = target(tok.view(1), ws.cache, pos, last_only=True)
            if gs is not None:
                logits = constrain_logits(gs, bits, logits, stats)
            tok = select_tokens(logits, torch.tensor([pos + 1], device=logits.device), cfg.temperature, cfg.seed)
            if margins is not None:
                margins[pos + 1 : pos + 2] = top_margins(logits)
        out.append(int(tok))
        if gs is not None:
            advance_grammar(gs, out[-1], stats)
        if on_tokens is not None:
            on_tokens(out[-1:])
        stats.steps += 1
        done = out[-1] in stop_ids or len(out) >= max_new_tokens or (gs is not None and gs.done)
    gen = finish(out, stats, timer, t_first, t0)
    return ws.attach_margins(gen, len(prompt)) if record_margins else gen


@torch.inference_mode()
def generate_speculative(pair, prompt: Sequence[int], cfg: EngineConfig, max_new_tokens: int,
                         stop_ids: Sequence[int] = (), on_tokens: OnTokens | None = None,
                         gs: GrammarState | None = None, use_runtime: bool | None = None,
                         record_margins: bool = False, step_costs: StepCosts | None = None,
                         prefix_cache: PrefixCache | None = None) -> Generation:
    """draft -> tree -> verify -> walk -> commit. A grammar state ``gs`` masks the walk's target
    logits at every tree node (``cfg.grammar == "walk"``, grammar time inside ``walk``) or is
    advanced on the committed tokens only (``commit``, grammar time inside ``commit``).
    ``use_runtime`` (default: as ``cfg.draft_path`` says) runs the runtime (``engine.decoding.runtime``).
    ``record_margins``: ``Generation.margins``, from the verify rows along each accepted path (a
    grammar cut's token: from its masked row).
    ``cfg.policy == "adaptive"`` (DDTree): each step's budget is the policy's (``engine.decoding.policy``;
    0: the root alone, no draft), from ``step_costs``, by default the pair's measured table
    (``Pair.step_costs``, measured before this generation's first step on its first use).
    ``prefix_cache``: the prompt's prefill reuses it (``loop.prefill``)."""
    target, drafter, stats = pair.target, pair.drafter, GenerationStats()
    if drafter is None:
        raise EngineInputError(f"verify={cfg.verify!r} needs a draft, but the pair was loaded without one")
    block, n_verify = verify_shape(pair, cfg)
    depth = block - 1
    on_runtime = _use_runtime(pair, cfg, gs, use_runtime)
    # (before the workspace: measuring decodes; on the loop this generation runs, whose steps cost otherwise)
    policy = _policy(pair, cfg, prompt, depth, step_costs, on_runtime)
    n = len(prompt)
    feat_dim = len(drafter.feature_layers) * target.cfg.hidden_size
    ws = pair.workspace(workspace_length(pair, cfg, n, max_new_tokens), feature_dim=feat_dim,
                        feature_rows=feature_rows(pair, cfg, on_runtime, prefix_cache is not None))
    cache, seq, feats = ws.cache, ws.seq, ws.features
    device = seq.device
    drafter.reset()
    replay = cfg.rollback == "replay" and target.has_recurrent
    timer = PhaseTimer(device)
    if on_runtime:  # (never with replay rollback on a hybrid target)
        dec = runtime.decoder_for(pair, ws, graphs=device.type == "cuda")
        return dec.generate(prompt, cfg, max_new_tokens, stop_ids, on_tokens, timer, gs, record_margins, block,
                            n_verify, policy, prefix_cache)
    walk_grammar = gs is not None and cfg.grammar == "walk"
    bits = new_bitmask(n_verify, gs.words) if gs is not None else None
    margins = ws.margin_buffer() if record_margins else None
    out, t0, t_first, done = begin(pair, ws, prompt, cfg, drafter.feature_layers, stats, timer, gs, bits, on_tokens,
                                   stop_ids, max_new_tokens, record_margins, prefix_cache=prefix_cache)

    while not done:
        start = cache.length  # position of the root: the last committed token, not yet cached
        budget, expected, tree, mask, probs = _chosen_proposal(drafter, cfg, seq, start, block, feats, timer, policy)

        with timer.phase("verify"):
            snap = cache.snapshot() if replay else None
            logits, f = target(tree.tokens, cache, start, tree=VerifyTree(tree.parents, tree.depths, mask),
                               feature_layers=drafter.feature_layers)
            positions = start + tree.depths + 1
            picked_by = logits  # the rows that pick the tokens (masked by a walk grammar below)
            if not walk_grammar:
                posterior = select_tokens(logits, positions, cfg.temperature, cfg.seed)

        with timer.phase("walk"):
            if walk_grammar:
                tg = time.perf_counter()
                tree_bitmask(gs, tree.tokens.tolist(), tree.parents.tolist(), bits)
                stats.grammar_ms += 1000.0 * (time.perf_counter() - tg)
                picked_by = mask_logits(logits, bits[: tree.size])
                posterior = select_tokens(picked_by, positions, cfg.temperature, cfg.seed)
            if cfg.draft_path == "generic":
                tokens_h, parents_h = tree.tokens.tolist(), tree.parents.tolist()
                path_list = walk_host(tokens_h, parents_h, posterior.tolist())
                al = len(path_list)
                path = torch.tensor(path_list, device=device)
                leaf = path_list[-1] not in parents_h
                new = [tokens_h[i] for i in path_list[1:]] + [int(posterior[path_list[-1]])]
                side = any(r > 0 for r in tree.ranks[path].tolist())
                # (the adaptive policy's tree step: its path probabilities and accepted nodes, AdaptivePolicy.observe)
                seen = None if probs is None else (probs[1:].tolist(), path_list[1:])
            else:
                path, al_t = walk_device(tree, mask, posterior)
                last = path[al_t - 1]
                has_child = (tree.parents == last).any()
                side_t = (tree.ranks * mask[last]).gt(0).any()
                # The step's single host read: AL, leaf flag, side flag, the committed tokens (and the
                # adaptive policy's path probabilities and path: none under the fixed policy).
                extra = torch.cat([probs[1:], path]) if probs is not None else path[:0]
                packed = torch.cat([al_t.view(1), has_child.view(1).long(), side_t.view(1).long(),
                                    tree.tokens[path], posterior[last].view(1), extra]).tolist()
                packed, extra = packed[: len(packed) - extra.numel()], packed[len(packed) - extra.numel() :]
                al, leaf, side = packed[0], not packed[1], bool(packed[2])
                new = packed[4 : 3 + al] + [packed[-1]]
                nodes = extra[: probs.numel() - 1] if probs is not None else []
                seen = None if probs is None else (nodes, extra[len(nodes) + 1 : len(nodes) + al])
            if margins is not None:  # node path[j] picked the token at start + 1 + j
                margins[start + 1 : start + 1 + al] = top_margins(picked_by.index_select(0, path[:al]))

        with timer.phase("commit"):
            if gs is not None:
                tg = time.perf_counter()
                # a refused token's node: one host read, on a refused token only
                new, cut = grammar_commit(gs, new, lambda i, lg=logits, pa=path, st=start: masked_pick(
                    gs, bits, lg, int(pa[i]), st + i + 1, cfg, margins), cfg.grammar)
                if cut:
                    al, leaf = len(new), False
                    side = any(r > 0 for r in tree.ranks[path[:al]].tolist())
                stats.grammar_ms += 1000.0 * (time.perf_counter() - tg)
            if replay:
                cache.restore(snap)
                _, f_path = target(tree.tokens[path[:al]], cache, start, feature_layers=drafter.feature_layers)
            else:
                cache.commit_path(start, path, al)
                f_path = f[path[:al]] if f is not None else None
            if feats is not None:
                feats[start : start + al] = f_path
            seq[start + 1 : start + 1 + al] = torch.tensor(new, device=device)

        stats.record_step(al, leaf, side)
        if policy is not None:
            stats.record_budget(budget, expected)
            if seen is not None:  # a tree step (an AR step teaches nothing)
                policy.observe(budget, *seen)
        new, done = truncate(new, len(out), max_new_tokens, stop_ids)
        done = done or (gs is not None and gs.done)
        out.extend(new)
        if on_tokens is not None and new:
            on_tokens(list(new))

    gen = finish(out, stats, timer, t_first, t0)
    return ws.attach_margins(gen, n) if record_margins else gen


def _policy(pair, cfg: EngineConfig, prompt: Sequence[int], depth: int, step_costs: StepCosts | None,
            on_runtime: bool) -> AdaptivePolicy | None:
    """The adaptive policy of a DDTree ``cfg`` (None: the fixed one), on ``step_costs`` or the pair's
    table for the loop that runs (``on_runtime``)."""
    if cfg.verify != "ddtree" or cfg.policy != "adaptive":
        return None
    return AdaptivePolicy.for_config(cfg, depth, step_costs or pair.step_costs(cfg, prompt, use_runtime=on_runtime))


def _chosen_proposal(drafter, cfg: EngineConfig, seq: Tensor, start: int, block: int, feats: Tensor | None,
                     timer: PhaseTimer, policy: AdaptivePolicy | None) -> tuple:
    """(budget, the E[AL] it was chosen by, tree, mask, path probabilities): the policy's choice and
    ``_propose``'s proposal. The generation's first proposal (no estimate yet: the configured tree) is
    the estimate its own budget is chosen by (``policy.preview``), its tree cut to that budget (0: the
    root alone)."""
    budget, expected = policy.choose() if policy is not None else (None, 0.0)
    tree, mask, probs = _propose(drafter, cfg, seq, start, block, feats, timer, budget, policy)
    if policy is not None and policy.wants_preview and probs is not None:
        policy.preview(probs[1:].tolist())
        budget, expected = policy.choose()
        tree, mask = prefix(tree, mask, budget) if budget > 0 else root_tree(seq[start : start + 1])
        probs = probs if budget > 0 else None
    return budget, expected, tree, mask, probs


def _propose(drafter, cfg: EngineConfig, seq: Tensor, start: int, block: int, feats: Tensor | None,
             timer: PhaseTimer, budget: int | None, policy: AdaptivePolicy | None
             ) -> tuple[Tree, Tensor, Tensor | None]:
    """The draft, top-k and tree phases: the tree to verify and its ancestor mask, and with the
    adaptive ``policy`` the tree cut to ``budget`` and the proposal's ``policy.path_probabilities``
    (of the tree built at the largest budget: the host makes every budget's estimate from them); at
    budget 0 the root alone (no draft, no estimate)."""
    if budget == 0:  # a plain AR step: the root alone, verified and committed as a tree
        tree, mask = root_tree(seq[start : start + 1])
        return tree, mask, None
    with timer.phase("draft"):
        draft_logits = drafter.propose(seq, start, block, cfg.target_feat_ctx, feats)
    tree, mask, probs = scored_tree(cfg, draft_logits, seq[start], timer, block - 1,
                                    host=cfg.draft_path == "generic", path_probs=policy is not None)
    if policy is None:
        return tree, mask, None
    tree, mask = prefix(tree, mask, budget)
    return tree, mask, probs


def measure_step_costs(pair, cfg: EngineConfig, prompt: Sequence[int], new_tokens: int = 32,
                       repeats: int = 2, use_runtime: bool | None = None) -> StepCosts:
    """The adaptive policy's cost table for ``cfg`` on ``pair``, on its device: for each budget it
    chooses from, ``cfg`` decoded with every step forced to that budget (the adaptive step as it
    runs: the tree built at ``budget``, its prefix verified; 0: AR steps), decode milliseconds per
    step, the median of ``repeats`` generations of ``new_tokens`` after ``prompt`` (after one more
    that captures the steps' graphs and warms the kernels), on the loop ``use_runtime`` names (as
    ``generate_speculative`` takes it: a grammar can send a generation to the generic loop)."""
    budgets = policy_budgets(cfg.budget, cfg.policy_levels)
    # Inside the buffers already held (a sweep reserves them at its planned length, and a generation
    # shorter than new_tokens asks for fewer slots than this would): the workspace grows by doubling,
    # so a few slots more would double the peak. The prompt's head gives way, where that costs at most
    # half of it: the steps are then timed at a slightly shorter context.
    held = pair._workspace.max_len if pair._workspace is not None else 0
    over = workspace_length(pair, cfg, len(prompt), new_tokens) - held
    if held and 0 < over <= len(prompt) // 2:
        prompt = prompt[over:]
    ms = {}
    cfg = cfg.replace(policy_preview=False)  # (every step's budget is forced: a first proposal read early is waste)
    with fused.using_kernels(cfg.kernels == "fused"):
        for b in budgets:
            forced = StepCosts({c: 1.0 if c == b else math.inf for c in budgets})  # the only finite cost: b
            per_step = []
            for _ in range(repeats + 1):
                stats = generate_speculative(pair, prompt, cfg, new_tokens, use_runtime=use_runtime,
                                             step_costs=forced).stats
                per_step.append(1000.0 * stats.decode_s / max(stats.steps, 1))
            ms[b] = max(statistics.median(per_step[1:]), 1e-6)
    return StepCosts(ms)


def verify_shape(pair, cfg: EngineConfig) -> tuple[int, int]:
    """(the draft's block, the most rows a verify of ``cfg`` runs: its tree's nodes, the root
    included) on ``pair``; a chain verifies the block's depth."""
    block = cfg.block_size or pair.drafter.block_size
    depth = block - 1
    return block, (depth if cfg.verify == "chain" else min(cfg.budget, _max_nodes(cfg.top_k, depth))) + 1


def workspace_length(pair, cfg: EngineConfig, prompt_tokens: int, max_new_tokens: int) -> int:
    """Slots of the workspace (``Pair.workspace``) a generation of ``cfg`` decodes in: the prompt, the
    new tokens and one more; a speculative one also room past the last root for a step launched
    ahead (engine.decoding.runtime): its block and its tree. ``engine.memory`` plans from it."""
    if cfg.verify == "ar":
        return prompt_tokens + max_new_tokens + 2
    block, n_verify = verify_shape(pair, cfg)
    return prompt_tokens + max_new_tokens + n_verify + 2 * block + 1


def feature_rows(pair, cfg: EngineConfig, on_runtime: bool, prefix_cache: bool) -> int | None:
    """Rows of the workspace's target features a speculative generation of ``cfg`` needs (``Pair.workspace``):
    on the runtime without a prefix cache a ring of ``FEATURE_RING_ROWS`` (position p at row p mod the
    rows), since a proposal reads only the last ``block`` positions' features (after the policy's AR steps,
    ``AdaptivePolicy.catch_up_rows``) and a prompt's are projected into the draft's context a chunk at a
    time as its prefill makes them (``runtime.RuntimeDecoder``); None (a row a position) on the generic
    loop (its draft projects what it has not yet when it proposes: a prompt's whole), with a prefix cache
    (it keeps every position's features), or where one step's rows would not fit the ring (a verify's
    nodes, the context rows and the block)."""
    if not on_runtime or prefix_cache:
        return None
    block, n_verify = verify_shape(pair, cfg)
    adaptive = cfg.verify == "ddtree" and cfg.policy == "adaptive"
    rows = catch_up_rows(block, cfg.probe_every, cfg.probe_max) if adaptive else block
    return FEATURE_RING_ROWS if n_verify + rows + block <= FEATURE_RING_ROWS else None


def _max_nodes(top_k: int, depth: int) -> int:
    total, width = 0, 1
    for _ in range(depth):
        width *= top_k
        total += width
        if total > 1 << 20:
            break
    return total


def _commit(prefix_cache: PrefixCache, gen: Generation, device: torch.device) -> None:
    """The prefix cache's commit of a finished generation, timed into it: ``stats.commit_s`` (from the
    last token to the copies done on the device, with any step still running there), added to
    ``stats.total_s``, since a server pays it before it answers the next request."""
    t0 = time.perf_counter()
    try:
        prefix_cache.commit(gen.tokens)
    except torch.OutOfMemoryError:
        # the answer is whole: a cache that cannot grow on this device is emptied, not the request failed
        prefix_cache.clear()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    gen.stats.commit_s = time.perf_counter() - t0
    gen.stats.total_s += gen.stats.commit_s


def generate(pair, prompt: Sequence[int], cfg: EngineConfig, max_new_tokens: int,
             ignore_eos: bool = False, on_tokens: OnTokens | None = None,
             grammar: CompiledGrammar | None = None, record_margins: bool = False,
             step_costs: StepCosts | None = None, prefix_cache: PrefixCache | None = None) -> Generation:
    """Generate up to ``max_new_tokens`` after ``prompt``, stopping after the tokenizer's stop
    token unless ``ignore_eos`` (fixed-length runs for benchmarks and tests).

    ``on_tokens``, if given, is called with each step's committed tokens (after the cut at
    max_new_tokens and at a stop token), in order: their concatenation is ``Generation.tokens``.
    It runs inside the decode loop, so it should be cheap (a server's streaming queue); an exception
    it raises ends the generation and propagates to the caller (a server stopping at a stop string).

    ``grammar`` (``Pair.grammar_for(tools)``) constrains the output where ``cfg.grammar`` places it;
    ``None`` (a prompt without tools) or ``cfg.grammar == "off"`` decodes unconstrained. A
    constrained generation also ends when the grammar is complete (its stop token accepted), even
    with ``ignore_eos``: the grammar allows nothing after it.

    ``record_margins`` fills ``Generation.top_logits`` and ``.margins``: per new token, the top logit
    and the top1 - top2 margin (float32) of the target's logits row that picked it, for divergence
    forensics (``engine.api.diagnose``). Off, no step does any of that work; on, the runtime's
    captured steps are other graphs.

    ``step_costs``: the adaptive policy's cost table (``cfg.policy == "adaptive"``); by default the
    pair's (``Pair.step_costs``: measured on this prompt the first time a config needs one).

    ``prefix_cache`` (``engine.decoding.prefix_cache``): the prompt's longest cached prefix is reused
    and only the rest prefilled (``GenerationStats.cached_tokens``); the prompt and the output are kept
    in it after, in the generation's time (``GenerationStats.commit_s``, inside ``total_s``). A
    generation that ends in an exception keeps its prompt, and the tokens it delivered where the
    exception says which (a ``committed`` attribute: the ``on_tokens`` ids so far, as a server's stop
    string or cancelled request raises; their positions were committed before the hook saw them).
    """
    if not prompt:
        raise EngineInputError("prompt is empty: at least one token is needed")
    if max_new_tokens < 1:
        raise EngineInputError(f"max_new_tokens must be >= 1, but got {max_new_tokens}")
    stop_ids = () if ignore_eos else pair.stop_ids
    gs = None
    if grammar is not None and cfg.grammar != "off":
        vocab = getattr(getattr(pair.target, "cfg", None), "vocab_size", grammar.vocab.size)
        if grammar.vocab.size != vocab:
            raise EngineInputError(f"the grammar was compiled for a vocabulary of {grammar.vocab.size} tokens, "
                                   f"but target {pair.target_name!r} has {vocab}: compile it with this pair")
        gs = grammar.state()
    with fused.using_kernels(cfg.kernels == "fused"):
        try:
            if cfg.verify == "ar":
                gen = generate_ar(pair, prompt, cfg, max_new_tokens, stop_ids, on_tokens, gs,
                                  record_margins=record_margins, prefix_cache=prefix_cache)
            else:
                gen = generate_speculative(pair, prompt, cfg, max_new_tokens, stop_ids, on_tokens, gs,
                                           record_margins=record_margins, step_costs=step_costs,
                                           prefix_cache=prefix_cache)
        except BaseException as exc:
            if prefix_cache is not None:
                with contextlib.suppress(Exception):  # the generation's own error is the one to report
                    # the prompt's positions, if its prefill ran; and the tokens the hook saw, if known
                    prefix_cache.commit(getattr(exc, "committed", None))
            raise
        if prefix_cache is not None:
            gen.stats.cached_tokens = prefix_cache.last_hit
            _commit(prefix_cache, gen, pair.target.device)
        return gen
