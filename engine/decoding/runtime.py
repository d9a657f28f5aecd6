"""The dedicated runtime: whole decode steps replayed as CUDA graphs (dense and hybrid targets).

A generic decode loop launches hundreds of small kernels per step and reads values back to the
host between them; for a small target that launch and sync time is most of the step. Here each
step is a fixed sequence of kernels over buffers allocated once, so it is captured once and
replayed:

- ``propose`` (the DFlash draft over its own context K/V cache, top-k, device tree build) and ``verify`` (tree
  forward writing K/V at device-held slots, posterior, walk, KV/feature/token compaction, the
  position advanced on the device) are two graphs per key-span bucket;
- an AR step is the same step over the root alone (no draft): one graph per bucket
  (``RuntimeDecoder._step``; one loop, ``RuntimeDecoder.generate``, runs AR and speculation);
- the host reads one small packed tensor per step: accept length, flags and the new tokens; the
  next step is launched before that read (its position and inputs are on the device already), so
  the host's reading and reporting overlaps the GPU's next step (the adaptive policy also reads a
  generation's first proposal before choosing its budget: ``policy_preview``);

Shapes never depend on where the sequence is: the root's position lives in a [1] device tensor,
attention spans a power-of-two bucket of key slots with a mask, and the draft sees a fixed
window of context (``target_feat_ctx`` slots, or the whole bucket when it is 0) through its own
context K/V cache: each propose recomputes the last ``block`` positions' keys and values (a step
commits at most that many) and ``_begin`` fills the prompt's after the prefill. The adaptive
policy's AR steps (``engine.decoding.policy``) keep their target features and write no draft
context: the first proposal after them recomputes a wider window (``AdaptivePolicy.catch_up_rows``),
another captured proposal. The math is the generic path's; only the attention's padding and
kernels differ, so float32 output stays equal to AR.

Hybrid targets (Gated DeltaNet layers) run the same two graphs: the verify forward records every
node's delta-rule and conv inputs (one kernel launch per layer for the recurrence), and the commit
recomputes the accepted path's recurrent state for every layer in one launch and gathers the conv
window along the path on the device (``fast`` rollback; ``replay`` re-runs a variable number of
tokens: this runtime refuses it, ``refusal``).

Grammar-constrained decoding (a prompt with tools): AR masks the logits inside its captured step
with a bitmask the host fills before each replay; speculative decoding with ``grammar: commit``
replays the unconstrained step and advances the grammar on the committed tokens read back anyway,
cutting the step at a refused token (the device position and, on a hybrid, the recurrent state
are moved back to the cut). ``grammar: walk`` needs the grammar's masks inside the walk, between
the verify forward and the commit, on the host: refused, as is a draft that proposes on the host
(the oracle). ``draft_path="auto"`` takes the generic loop for what is refused here (``loop_for``).

``record_margins`` (divergence forensics, ``Generation.margins``): the AR step and the verify also
write the top-2 margins of their logits rows into the workspace's margin buffer, by position, read
once after the generation; those steps are other graphs (keyed by it), so without it nothing changes.

``graphs=False`` runs the same step functions eagerly (the CPU tests check the logic that way).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import Tensor

from engine.config import EngineConfig, EngineInputError
from engine.decoding import loop, tree_kernel
from engine.decoding.drafters import CONTEXT_ROWS, DFlashDrafter
from engine.decoding.grammar import GrammarState, mask_logits, new_bitmask
from engine.decoding.graphs import Graphs, Readback
from engine.decoding.policy import AdaptivePolicy, prefix
from engine.decoding.sampling import select_tokens, top_margins
from engine.decoding.stats import Generation, GenerationStats
from engine.decoding.tree import Tree
from engine.models.attention import StepKeys, ancestor_table, chain_keys, chain_table
from engine.models.dense import DenseModel
from engine.models.hybrid import HybridModel

MIN_BUCKET = 128


def refusal(pair, cfg: EngineConfig, constrained: bool) -> str | None:
    """Why this runtime cannot run ``cfg`` on ``pair`` (None: it can, on any device). ``constrained``:
    the prompt has a grammar that ``cfg`` places (AR masks inside its step, ``commit`` advances on
    committed tokens; ``walk`` masks every tree node on the host)."""
    target = pair.target
    if not isinstance(target, (DenseModel, HybridModel)):
        return f"its steps are the static forwards of dense and hybrid targets, not of {type(target).__name__}"
    if cfg.verify == "ar":
        return None
    if not isinstance(pair.drafter, DFlashDrafter):
        return (f"it proposes on the device with a DFlash draft; this pair's draft "
                f"({type(pair.drafter).__name__}) proposes on the host")
    if constrained and cfg.grammar == "walk":
        return ("it advances a grammar on the committed tokens (grammar='commit'); grammar='walk' masks "
                "every tree node on the host")
    if cfg.rollback == "replay" and target.has_recurrent:
        return ("its steps have fixed shapes; rollback='replay' re-runs a variable number of tokens on a "
                "hybrid target (rollback='fast' keeps every node's state)")
    return None


def loop_for(pair, cfg: EngineConfig, constrained: bool, use_runtime: bool | None = None) -> str:
    """The decode loop ``cfg`` runs on ``pair`` (``GenerationStats.loop``): ``graphs`` (this runtime,
    captured: CUDA), ``runtime`` (this runtime, eager: off CUDA) or ``generic`` (``engine.decoding.decode``).
    ``draft_path="auto"`` takes ``graphs`` where ``refusal`` finds nothing, else ``generic``;
    ``runtime`` takes this runtime on any device and refuses (``EngineInputError``, with the reason)
    what it cannot run. ``use_runtime`` overrides ``draft_path`` (tests): True as ``runtime``, False
    ``generic``."""
    path = cfg.draft_path if use_runtime is None else ("runtime" if use_runtime else "generic")
    if path == "generic":
        return "generic"
    reason = refusal(pair, cfg, constrained)
    on_cuda = pair.target.device.type == "cuda"
    if path == "auto":
        return "graphs" if reason is None and on_cuda else "generic"
    if reason is not None:
        raise EngineInputError(f"draft_path='runtime' cannot run verify={cfg.verify!r} here: {reason}; "
                               "draft_path='generic' or 'auto' can")
    return "graphs" if on_cuda else "runtime"


def bucket_for(need: int, limit: int) -> int:
    """Smallest power of two >= need (at least MIN_BUCKET), capped at the buffers' size."""
    b = MIN_BUCKET
    while b < need:
        b *= 2
    return min(b, limit)


class RuntimeDecoder:
    """Buffers and graphs of one workspace; rebuilt when the pair's workspace is reallocated."""

    def __init__(self, pair, ws, graphs: bool) -> None:
        self.pair, self.ws = pair, ws
        self.device = ws.seq.device
        self.start = torch.zeros(1, dtype=torch.long, device=self.device)
        self.recurrent = pair.target.has_recurrent
        # A warm-up run advances the recurrent state in place (K/V and features past the root are
        # rewritten by every replay): restore it before capturing.
        state = [self.start, ws.cache.rec, ws.cache.conv] if self.recurrent else [self.start]
        self.graphs = Graphs(graphs, state)
        self._tree_buffers = self._tree_buffer_ids()
        self._bits: tuple[Tensor, Tensor] | None = None  # grammar bitmask: host [1, words], device copy
        self._readbacks: dict[int, Readback] = {}
        self._draft_kv: tuple[Tensor, Tensor] | None = None
        self._constants: dict[object, Tensor] = {}
        self._chain_tables: dict[int, tuple[Tensor, Tensor]] = {}
        self._ar_run = 0  # the adaptive policy's AR steps launched since its last proposal (``_launch_adaptive``)

    def _arange(self, n: int) -> Tensor:
        """0..n-1 on the device, made once (a captured step reads it instead of making it)."""
        return self._constant(n, lambda: torch.arange(n, device=self.device))

    def _chain_keys(self, t: int, key_len: int) -> StepKeys:
        """The step layout of ``t`` tokens in a row from the root (an AR step, a chain verify): its
        depth and ancestor tables made once (a captured step reads them)."""
        if t not in self._chain_tables:
            self._chain_tables[t] = chain_table(t, self.device)
        return chain_keys(self.start, t, key_len, self._chain_tables[t])

    def _feature_rows(self, slots: Tensor) -> Tensor:
        """The features' rows of positions ``slots``: themselves, or in a ring (``decode.feature_rows``) mod
        its rows (one launch more a step, only there)."""
        rows = self.ws.features.shape[0]
        return slots % rows if rows < self.ws.max_len else slots

    def _draft_context(self) -> tuple[Tensor, Tensor]:
        """The DFlash draft's context K/V buffers for this workspace (graphs read them: allocated once)."""
        if self._draft_kv is None:
            self._draft_kv = self.pair.drafter.new_context(self.ws.max_len)
        return self._draft_kv

    def _ran_ahead(self) -> None:
        """A step past the generation's end ran: its K/V lie past the committed length (ignored),
        but a recurrent state cannot be taken back, so it is marked (``HybridCache.ahead``)."""
        if self.recurrent:
            self.ws.cache.ahead = True

    def _readback(self, size: int) -> Readback:
        """The pinned result buffers of steps of ``size`` values (allocated once: not in the timed decode)."""
        if size not in self._readbacks:
            self._readbacks[size] = Readback(self.device, size)
        return self._readbacks[size]

    def _bitmask(self, gs: GrammarState) -> tuple[Tensor, Tensor]:
        """The grammar bitmask buffers (the device one is read by captured AR steps: allocated once)."""
        if self._bits is None or self._bits[0].shape[1] != gs.words:
            host = new_bitmask(1, gs.words)
            self._bits = (host.pin_memory() if self.device.type == "cuda" else host,
                          host.to(self.device))
            self.graphs.clear()
        return self._bits

    def _tree_buffer_ids(self) -> tuple[int, ...]:
        if not self.recurrent:
            return ()
        cache = self.ws.cache
        return (cache.tree_conv.data_ptr(), *(x.data_ptr() for x in cache.tree_inputs))

    def reserve_tree(self, nodes: int) -> None:
        """Per-node recurrent buffers for trees of ``nodes``; growing them invalidates the captures."""
        if not self.recurrent:
            return
        self.ws.cache.reserve_tree(nodes)
        if self._tree_buffer_ids() != self._tree_buffers:
            self.graphs.clear()
            self._tree_buffers = self._tree_buffer_ids()

    # -- the draft: a speculative step's first graph -----------------------------------------------
    def _propose(self, key_len: int, cfg: EngineConfig, block: int, context_rows: int | None = None,
                 adaptive: bool = False) -> tuple[Tree, Tensor] | tuple[Tree, Tensor, Tensor]:
        """The draft's proposal: its tree and ancestor mask (``adaptive``: and the tree's
        ``path_probabilities``, for the readback). ``context_rows``: the draft context positions it
        recomputes (``DFlashDrafter.propose_static``; default ``block``)."""
        drafter, ws = self.pair.drafter, self.ws
        logits = drafter.propose_static(ws.seq, self.start, block, cfg.target_feat_ctx, ws.features,
                                        self._draft_context(), key_len, context_rows)
        # Top-k and tree stay on the device (a captured graph cannot read the host), whatever
        # draft_path says (tests run this runtime with use_runtime=True on any config). A DDTree and its
        # mask come from one kernel launch on CUDA (engine.decoding.tree_kernel).
        # The adaptive policy's estimate comes from the same launch (``tree_kernel.build_scored_tree_kernel``).
        tree, anc, probs = loop.scored_tree(cfg, logits, ws.seq.index_select(0, self.start), loop.UNTIMED,
                                            block - 1, host=False, path_probs=adaptive)
        return (tree, anc, probs) if adaptive else (tree, anc)

    def _constant(self, key: object, make: Callable[[], Tensor]) -> Tensor:
        """A device constant made once (a captured step reads it instead of making it)."""
        if key not in self._constants:
            self._constants[key] = make()
        return self._constants[key]

    def _policy_step(self, key_len: int, cfg: EngineConfig, block: int, proposal: tuple | None, budget: int,
                     record: bool) -> tuple[Tensor, Tensor, Tensor | None, Tree | None]:
        """An adaptive step (``engine.decoding.policy``). Budget 0: plain AR's step (``_step`` without a
        tree: the root alone, no walk, no K/V move) that also keeps the root's target features, which
        a later proposal turns into the draft's context (``AdaptivePolicy.catch_up_rows``); its packed
        result is the new token alone. Budget b > 0: ``_step`` over the first b nodes of the proposed
        tree, its packed result followed by the proposal's ``path_probabilities`` of nodes 1..N and the
        walk's first ``min(block, b + 1)`` path entries (the accepted nodes, root first; the host reads
        the first AL), all written by the walk's launch (``tail``): the fixed policy's launches, and the
        host makes the policy's estimate and observations from them (``AdaptivePolicy.observe``)."""
        if budget == 0:
            packed, logits, path = self._step(key_len, cfg, block, None, None, record, False, features=True)
            return packed, logits, path, None
        tree, anc = prefix(proposal[0], proposal[1], budget)
        # the walk accepts at most the block's depth (and the root): as many path entries
        packed, logits, path = self._step(key_len, cfg, block, tree, anc, record, False, tail=proposal[2],
                                          entries=min(block, tree.size))
        return packed, logits, path, tree

    # -- the step: AR, chain and DDTree alike ------------------------------------------------------
    def _step(self, key_len: int, cfg: EngineConfig, block: int, tree: Tree | None, anc: Tensor | None,
              record: bool, constrained: bool, features: bool = False, tail: Tensor | None = None,
              entries: int = 0) -> tuple[Tensor, Tensor, Tensor | None]:
        """The target over the root (the last committed token, at ``start``) and the drafted nodes
        after it, the target's pick at each, the walk and the commit; the root's position advances
        on the device by the committed count. AR is the degenerate case, ``tree=None``: the root
        alone, no draft, whose pick is committed as is (its walk accepts the root and nothing after
        it, so the walk's launch, the K/V move and the features are left out; ``features``: the root's
        target features kept all the same, the adaptive policy's AR step). ``constrained`` (AR with a
        grammar): the logits masked by the bitmask the host filled for this step.

        Returns the step's packed result for the host (AR: the new token; a tree: AL, flags and
        tokens, ``tree_kernel.walk_and_advance``, with ``tail`` and ``entries`` the adaptive policy's
        after them), the logits and the accepted path (AR: None)."""
        s, ws, target = self.start, self.ws, self.pair.target
        if tree is None:
            tokens, t, positions, slots = ws.seq.index_select(0, s), 1, s, s
        else:
            tokens, t = tree.tokens, tree.tokens.numel()
            positions, slots = s + tree.depths, s + self._arange(t)
        if tree is not None and cfg.verify != "chain":  # each node's ancestors by depth (depth < block)
            depths = tree.depths.to(torch.int32)
            keys = StepKeys(s, depths, ancestor_table(anc, depths, block), key_len)
        else:  # t tokens in a row from the root: an AR step, a chain
            keys = self._chain_keys(t, key_len)
        logits, f = target.forward_static(tokens, positions, slots, keys, ws.cache,
                                          self.pair.drafter.feature_layers if tree is not None or features else (),
                                          parents=tree.parents if self.recurrent and tree is not None else None)
        if constrained:
            logits = mask_logits(logits, self._bits[1])
        posterior = select_tokens(logits, positions + 1, cfg.temperature, cfg.seed)
        if tree is None:
            ws.seq.index_copy_(0, s + 1, posterior)
            if features:  # the root's row, committed: a later proposal writes the draft's context from it
                ws.features.index_copy_(0, self._feature_rows(s), f)
            if record:  # (record_margins) the row that picked the token at s + 1
                ws.margins.index_copy_(0, s + 1, top_margins(logits))
            s.add_(1)
            return posterior, logits, None
        # The walk, then the commit on the device: the committed tokens land after the root and the
        # root's position advances by AL (one launch with the kernels on), the accepted nodes' K/V
        # and features move to slots start..start+AL-1 (slots past AL may receive other nodes: they
        # lie beyond the committed length).
        max_depth = min(block - 1, t - 1)  # the draft's block bounds the tree's depth
        path, al, packed = tree_kernel.walk_and_advance(tree, anc, posterior, s, ws.seq, max_depth, tail, entries)
        tree_kernel.move_accepted_rows(ws.cache.k, ws.cache.v, slots, path, al, max_depth + 1)
        if self.recurrent:  # the accepted path's recurrent state recomputed, the conv window along it
            ws.cache.commit_recurrent(path, al)
        ws.features.index_copy_(0, self._feature_rows(slots), f.index_select(0, path))
        if record:  # (record_margins) node path[j] picked the token at start + 1 + j, as the K/V move
            ws.margins.index_copy_(0, slots + 1, top_margins(logits).index_select(0, path))
        # logits and path stay readable until the next replay: a grammar cut re-picks from them
        return packed, logits, path

    def _launch_adaptive(self, policy: AdaptivePolicy, key_len: int, key: tuple, step_key: tuple, cfg: EngineConfig,
                         block: int, record: bool, timer, readback: Readback) -> tuple:
        """One adaptive step launched: the policy's budget, the proposal unless it is 0, the step of
        that budget (``_policy_step``); as ``generate``'s ``launch`` returns, with (budget, the E[AL] it
        was chosen by, the readback's layout) last. While the policy has no estimate (a generation's
        first step, ``AdaptivePolicy.wants_preview``) the proposal comes first and is read back before
        the budget is chosen (``preview``); a budget of 0 then leaves it unverified.

        The first proposal after AR steps recomputes the draft's context of ``catch_up_rows`` positions
        (those steps wrote none): another captured proposal, picked here, where the steps launched
        before it are known (a step launched ahead of the one being read is launched after it). A
        captured step reads the buffers its proposal's graph returned when it was captured, so a tree
        step is keyed by the proposal it verifies too (its context rows)."""
        proposal, layout, rows = None, None, None
        if policy.wants_preview and self._ar_run == 0:
            # The generation's first proposal, read back before its budget is chosen (``policy.preview``):
            # one host synchronisation a generation instead of two steps at the configured tree, blind.
            with timer.phase("draft"):
                proposal = self.graphs.run(("propose", key_len, *key, block, cfg.kernels), self._propose, key_len,
                                           cfg, block, block, True)
            policy.preview(proposal[2][1:].tolist())
        budget, expected = policy.choose()
        if budget > 0:
            if self._ar_run > policy.max_ar_run:  # the window would miss committed positions
                raise RuntimeError(f"{self._ar_run} AR steps since the last proposal, but its context window "
                                   f"covers {policy.max_ar_run}")
            rows = block if self._ar_run == 0 else policy.catch_up_rows(block)
            self._ar_run = 0
            if proposal is None:
                with timer.phase("draft"):
                    proposal = self.graphs.run(("propose", key_len, *key, rows, cfg.kernels), self._propose,
                                               key_len, cfg, block, rows, True)
            nodes = proposal[0].size - 1
            layout = (nodes, min(block, min(budget, nodes) + 1))  # path probabilities, then path entries
        else:  # (a previewed proposal the policy turned down: its draft context is written all the same)
            proposal = None
            self._ar_run += 1
        with timer.phase("verify"):
            packed, logits, path, tree = self.graphs.run(("verify", key_len, budget, rows, *step_key),
                                                         self._policy_step, key_len, cfg, block, proposal, budget,
                                                         record)
            return readback.push(packed), tree, logits, path, (budget, expected, layout)

    @staticmethod
    def _read(values: list[int], tree: Tree | None, chosen: tuple | None, policy: AdaptivePolicy | None
              ) -> tuple[int, bool, bool, list[int]]:
        """A step's packed result read back: (AL, leaf, side branch, the new tokens). AR, and the
        adaptive policy's AR step: the token alone (the root: no child, no side branch). An adaptive
        tree step's values end in what its policy learns (``_policy_step``): handed to it here."""
        if tree is None:
            return 1, True, False, values[:1]
        al = values[0]
        if chosen is not None and chosen[2] is not None:
            nodes, entries = chosen[2]
            tail = values[len(values) - nodes - entries :]
            policy.observe(chosen[0], tail[:nodes], tail[nodes + 1 : nodes + al])  # the path after the root
        return al, not values[1], bool(values[2]), values[3 : 3 + al]

    def _cut(self, start: int, kept: int, token: int, path: Tensor | None) -> None:
        """A grammar cut after the device committed more: ``kept`` tokens from the root's position
        ``start`` stand, the last one ``token``. The accepted nodes' K/V and features before the cut
        are already in place; the position, the new root's token and (on a hybrid) the recurrent
        state of the shorter path are set again. ``path`` None: an AR step (the adaptive policy's),
        whose one token is replaced; its state, the root's, stands."""
        self.start.fill_(start + kept)
        self.ws.seq[start + kept] = token
        if self.recurrent and path is not None:
            self.ws.cache.recommit_recurrent(path, torch.tensor([kept], device=self.device))

    def _begin(self, prompt: Sequence[int], cfg: EngineConfig, feature_layers: Sequence[int], on_tokens,
               timer, gs: GrammarState | None, bits: Tensor | None, record: bool, stop_ids: Sequence[int],
               max_new_tokens: int, prefix_cache) -> tuple[GenerationStats, list[int], float, float, bool]:
        """The eager prefill (``loop.begin``, with ``prefix_cache`` if any; with ``feature_layers``, the
        draft's context K/V of the prompt too, timed as prefill like the target's K/V), then the root's
        position handed to the device."""
        stats = GenerationStats(loop="graphs" if self.graphs.enabled else "runtime")
        draft_context = on_span = None
        if feature_layers and prefix_cache is not None:  # (a row a position: projected after the prefill)
            draft_context = partial(self.pair.drafter.fill_context, self._draft_context(), self.ws.features,
                                    len(prompt))
        elif feature_layers:  # each chunk as the prefill makes its features, before a ring's rows are written over
            on_span = _context_chunks(self.pair.drafter, self._draft_context(), self.ws.features, len(prompt))
        out, t0, t_first, done = loop.begin(self.pair, self.ws, prompt, cfg, feature_layers, stats, timer, gs, bits,
                                            on_tokens, stop_ids, max_new_tokens, record, draft_context, prefix_cache,
                                            on_span)
        self.start.fill_(len(prompt))
        return stats, out, t0, t_first, done

    def _bucket(self, need: int) -> int:
        # A span past the buffers would gather cos/sin and write K/V out of bounds on the device:
        # the workspace is sized for every step, the step launched ahead included (decode.py).
        if need > self.ws.max_len:
            raise RuntimeError(f"a step needs {need} key slots, but the workspace has {self.ws.max_len}")
        return bucket_for(need, self.ws.max_len)

    def _next(self, done: bool, ahead, mark, timer, launch: Callable[[int], object], position: int):
        """The step to read next: the one launched ahead, or one launched now at ``position``; none
        when the generation is done, and then a step launched ahead is not part of it (neither
        counted nor timed)."""
        if done and ahead is not None:
            timer.rollback(mark)
            self._ran_ahead()
        return ahead if ahead is not None or done else launch(position)

    def _finish(self, out: list[int], stats: GenerationStats, timer, t_first: float, t0: float,
                t_last: float | None, length: int, n_prompt: int, record_margins: bool) -> Generation:
        """``loop.finish`` with the cache's committed length on the host, and the margins if asked."""
        self.ws.cache.length = length
        gen = loop.finish(out, stats, timer, t_first, t0, t_last)
        return self.ws.attach_margins(gen, n_prompt) if record_margins else gen

    def generate(self, prompt: Sequence[int], cfg: EngineConfig, max_new_tokens: int, stop_ids: Sequence[int],
                 on_tokens, timer, gs: GrammarState | None = None, record_margins: bool = False, block: int = 1,
                 n_verify: int = 1, policy: AdaptivePolicy | None = None, prefix_cache=None) -> Generation:
        """One loop for AR (``cfg.verify == "ar"``: each step the root alone) and speculative
        decoding (each step a ``propose`` graph, the draft's ``block`` and a tree of ``n_verify``
        nodes at most, then the step over it). A grammar state ``gs``: AR masks each step's logits
        (the host fills the step's bitmask before its replay); speculation replays the unconstrained
        step and commits under the grammar (``grammar: commit``), cutting the step at a refused token."""
        speculative = cfg.verify != "ar"
        ar_mask = gs is not None and not speculative
        if speculative:  # before the prefill: allocation is not timed
            self.reserve_tree(n_verify)
            self._draft_context()
        # (an adaptive tree step's values go on with its N path probabilities and at most ``block`` path entries)
        readback = self._readback((3 + n_verify + (n_verify + block if policy else 0)) if speculative else 1)
        margins = self.ws.margin_buffer() if record_margins else None  # captured steps write into it
        bits = self._bitmask(gs) if ar_mask else None
        host_bits = bits[0] if ar_mask else new_bitmask(1, gs.words) if gs is not None else None
        feature_layers = self.pair.drafter.feature_layers if speculative else ()
        stats, out, t0, t_first, done = self._begin(prompt, cfg, feature_layers, on_tokens, timer, gs, host_bits,
                                                    record_margins, stop_ids, max_new_tokens, prefix_cache)
        # A grammar may cut a speculative step after its commit: the replaced recurrent state is kept,
        # set after the prefill (its reset clears it); a step that keeps it is another graph.
        keep = self.recurrent and gs is not None and speculative
        if self.recurrent:
            self.ws.cache.keep_previous = keep
        start = len(prompt)
        reach = max(n_verify, block) if speculative else 1  # key slots past the root a step may touch
        # after (kind, key span): see Graphs.run; an AR step depends on none of the draft's fields
        key = (cfg.verify, cfg.budget, cfg.top_k, cfg.proposal_temp, cfg.chain_seed, cfg.target_feat_ctx,
               cfg.temperature, cfg.seed, block) if speculative else (cfg.temperature, cfg.seed)
        if policy is not None:  # its proposals carry the estimates, its steps a budget
            key = (*key, "adaptive", policy.budgets)
            self._ar_run = 0  # AR steps launched since the last proposal (the prefill wrote the prompt's context)
        step_key = (*key, keep, ar_mask, record_margins, cfg.kernels)  # (the kernel switch last: gpu_bench graphs)

        def launch(root: int) -> tuple:
            # ``root``: the root's position, or an upper bound of it (the key span covers it)
            key_len = self._bucket(root + reach)
            tree = anc = None
            if policy is not None:
                return self._launch_adaptive(policy, key_len, key, step_key, cfg, block, record_margins, timer,
                                             readback)
            if speculative:
                with timer.phase("draft"):
                    tree, anc = self.graphs.run(("propose", key_len, *key, cfg.kernels), self._propose, key_len, cfg,
                                                block)
            with timer.phase("verify"):
                if ar_mask:  # this step's mask, copied in before the replay reads it
                    tg = time.perf_counter()
                    gs.fill(bits[0], 0)
                    stats.grammar_ms += 1000.0 * (time.perf_counter() - tg)
                    bits[1].copy_(bits[0], non_blocking=True)
                packed, logits, path = self.graphs.run(("verify" if speculative else "ar", key_len, *step_key),
                                                       self._step, key_len, cfg, block, tree, anc, record_margins,
                                                       ar_mask)
                return readback.push(packed), tree, logits, path, None  # the step's one host read, when read

        pending = None if done else launch(start)
        t_last = None
        while not done:
            # The next step starts from the device's position: launched before this one is read (its
            # key span covering the furthest root), it runs while the host reads and reports this
            # one. Not with a grammar (its next mask, or a cut, needs this step's tokens), nor where
            # this step surely ends the generation; where it may (a stop token, max_new_tokens), the
            # step launched ahead is discarded, neither counted nor timed.
            mark = timer.checkpoint()
            ahead = launch(start + (block if speculative else 1)) if gs is None and len(out) + 1 < max_new_tokens \
                else None
            item, tree, logits, path, chosen = pending
            al, leaf, side, new = self._read(readback.read(item), tree, chosen, policy)
            if gs is not None:  # (AR: the grammar's advance is host work outside the step's phases)
                with timer.phase("commit") if speculative else contextlib.nullcontext():
                    tg = time.perf_counter()
                    root = start
                    # AR: a token picked from masked logits, never refused
                    new, cut = loop.grammar_commit(gs, new, lambda i, r=root, lg=logits, pa=path: loop.masked_pick(
                        gs, host_bits, lg, 0 if pa is None else int(pa[i]), r + i + 1, cfg, margins), cfg.grammar)
                    if cut and speculative:
                        al, leaf = len(new), False
                        side = tree is not None and bool((tree.ranks.index_select(0, path[:al]) > 0).any())
                        self._cut(start, al, new[-1], path)  # the device committed more: back to the cut
                    stats.grammar_ms += 1000.0 * (time.perf_counter() - tg)
                done = gs.done
            start += al
            if speculative:
                stats.record_step(al, leaf, side)
                if chosen is not None:  # the adaptive policy's step
                    stats.record_budget(chosen[0], chosen[1])
            else:
                stats.steps += 1
            new, stop = loop.truncate(new, len(out), max_new_tokens, stop_ids)
            done = done or stop
            out.extend(new)
            if on_tokens is not None and new:
                on_tokens(list(new))
            t_last = time.perf_counter()
            pending = self._next(done, ahead, mark, timer, launch, start)
        return self._finish(out, stats, timer, t_first, t0, t_last, start, len(prompt), record_margins)


def _context_chunks(drafter, context: tuple[Tensor, Tensor], features: Tensor, n: int):
    """``loop.prefill``'s ``on_span`` for a prompt of ``n`` positions: the draft's context K/V projected a
    ``CONTEXT_ROWS`` chunk at a time as the prefill completes each (the last, shorter, at ``n``): the chunks
    ``fill_context`` projects after a prefill, each while its features are the ring's last rows."""
    done = 0

    def at(e: int) -> None:
        nonlocal done
        hi = n if e >= n else e - e % CONTEXT_ROWS
        if hi > done:
            drafter.project_context(context, features, done, hi)
            done = hi

    return at


def decoder_for(pair, ws, graphs: bool) -> RuntimeDecoder:
    """The pair's decoder for this workspace (graphs are tied to its buffers)."""
    dec = getattr(pair, "_runtime_decoder", None)
    if dec is None or dec.ws is not ws or dec.graphs.enabled != graphs:
        dec = RuntimeDecoder(pair, ws, graphs)
        pair._runtime_decoder = dec
    return dec
