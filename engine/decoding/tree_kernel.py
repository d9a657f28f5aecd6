"""DDTree's tree and ancestor mask in one Triton launch (the CUDA-graph ``runtime`` path).

``engine.decoding.tree.build_tree_device`` runs a Python loop over the draft depths with about a dozen tensor
ops per depth, and ``ancestor_mask`` another five per depth: about 250 tiny launches per DDTree step,
which inside a CUDA graph still cost a few microseconds each (the step's draft phase took 1.21 ms on
an H200 against 0.49 ms for a chain step). ``build_tree_kernel`` computes the same tree and mask in
a single launch of one program; ``build_tree_and_mask`` picks it on CUDA with the kernels enabled and
falls back to the tensor-op forms (the reference the kernel is tested against) otherwise.

Selection inside one program, in registers: per depth the candidates (kept parent, rank) that can
be among the best ``budget`` (``candidate_count``) are one vector of float64 keys packed into sortable
int64 with their index in the low bits, sorted (Triton's bitonic ``tl.sort``); the best ``budget`` are
kept, their scores recomputed by the same float64 add, and merged into a running sorted list of the
best entries over all depths (one bitonic merge, log2 of the list's size in stages). No global memory
round trip per depth (the ranking kernel this replaced ranked candidates pairwise through global
memory: 103 against 68 us at budget 48 on an H200). Exact key ties go to the lower candidate (or entry)
index, as do keys within 2**-39 of each other (the packed index takes the key's low 13 bits);
``torch.topk`` leaves tie order unspecified: only there can a tree differ from ``build_tree_device``'s.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from engine.decoding.tree import (
    _DEPTH_TIE,
    _FORCED_KEY,
    Tree,
    ancestor_mask,
    build_tree_device,
    effective_chain_seed,
    walk_device,
)
from engine.models import fused

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - installs without Triton use the tensor-op forms
    triton = None

# What the kernel supports (block sizes up to 32, the search spaces' top_k and budgets with room);
# beyond these the dispatcher takes the tensor-op forms.
MAX_DEPTH = 31
MAX_TOP_K = 16
MAX_BUDGET = 256
# Candidate (< MAX_BUDGET * MAX_TOP_K) and entry (<= 1 + MAX_DEPTH * MAX_BUDGET) indices ride in the
# low bits of the packed sort keys: keys closer than 2**-39 relative order by index, as exact ties.
INDEX_BITS = 13
MASK_BLOCK = 1024  # mask bytes zeroed per step
# Warps per program: 4 up to budget 64, 8 up to 128, 16 beyond (H200, k 8, 2026-12-04: budget 22 20.0 us
# with 4, 21.5 with 8; 48: 28.9 against 31.7; 64: 29.0 against 31.8; 16 warps 27-41 us: slower).
# A depth's candidates are C_PAD packed int64 values sorted across the program
# (benchmarks/kernel_check.py: registers and spills on sm_90; 8 warps use a stack frame at budget 256,
# k 16). The tree does not depend on the warp count.
NUM_WARPS = 8
NUM_WARPS_SMALL = 4  # budgets <= SMALL_BUDGET
SMALL_BUDGET = 64
NUM_WARPS_LARGE = 16  # budgets > LARGE_BUDGET
LARGE_BUDGET = 128


def kernel_warps(budget: int) -> int:
    if budget <= SMALL_BUDGET:
        return NUM_WARPS_SMALL
    return NUM_WARPS if budget <= LARGE_BUDGET else NUM_WARPS_LARGE


def tree_sizes(depth: int, k: int, budget: int) -> tuple[list[int], int]:
    """Entries kept per depth (m_d = min(budget, m_{d-1} * k), m_0 = 1) and the tree's size N, as
    ``build_tree_device`` computes them: host values, known before the launch."""
    kept, prev = [], 1
    for _ in range(depth):
        prev = min(budget, prev * k)
        kept.append(prev)
    return kept, min(budget, sum(kept))


def kernel_supports(depth: int, k: int, budget: int) -> bool:
    return 1 <= depth <= MAX_DEPTH and 1 <= k <= MAX_TOP_K and 1 <= budget <= MAX_BUDGET


def candidate_count(k: int, budget: int) -> int:
    """How many candidates (parent slot p, rank r) a depth sorts: those that can end up in the tree,
    rank r's parents 0..min(budget - 1, budget // (r + 2)).

    Why no other can: the parents sit in key order (slot 0 first) and each one's top-k log-probs
    descend, so for p >= 1 every (p', r') with 1 <= p' <= p and r' <= r scores at least (p, r)'s
    (float64 addition is monotone; an exact tie goes to the lower index p' * k + r', as in the sort;
    parents whose keys lie within 2**-39 of each other sit in index order, the sort's own tolerance):
    p * (r + 1) - 1 candidates besides (p, r) itself. Their parents, slots 1..p one depth up, rank
    ahead of them all (a child's key is its parent's plus a log-prob <= 0, less one more depth
    tie-break). Slot 0 (the chain seed's forced entry at the depths it covers, whose score is any) is
    left out of both counts. So p * (r + 2) - 1 entries of the tree rank ahead of (p, r), and with
    p * (r + 2) > budget it is not among the tree's at most ``budget`` nodes; nor is any descendant
    (each ranks behind its parent). A depth may then keep fewer than its m entries: the rest are not
    in the tree, and their slots are left out as parents. Budget 48 at k 8: 94 candidates sorted
    instead of the 384 of the full grid (512 padded)."""
    return sum(min(budget - 1, budget // (r + 2)) + 1 for r in range(k))


def kernel_launch(depth: int, k: int, budget: int) -> dict[str, int]:
    """The constexprs of one launch (powers of two covering the sizes)."""
    p_pad = max(16, triton.next_power_of_2(budget))
    return dict(LOW=(1 << INDEX_BITS) - 1, P_PAD=p_pad, LOG_P=p_pad.bit_length() - 1,
                K_PAD=max(2, triton.next_power_of_2(k)),
                C_PAD=max(p_pad, triton.next_power_of_2(candidate_count(k, budget))), BLOCK_M=MASK_BLOCK)


def build_tree_kernel(top_logprobs: Tensor, top_ids: Tensor, root_token: Tensor, budget: int,
                      chain_seed: int | None) -> tuple[Tree, Tensor]:
    """``build_tree_device`` and ``ancestor_mask(tree.parents, L)`` in one launch (grid (1,)).

    top_logprobs, top_ids: [L, k] on one device, sorted descending along k (log-probs, <= 0);
    root_token: a 0-d or [1] long tensor. No host synchronisation: safe inside CUDA graph capture.
    """
    tree, mask, _ = _tree_launch(top_logprobs, top_ids, root_token, budget, chain_seed, None)
    return tree, mask


def build_scored_tree_kernel(top_logprobs: Tensor, top_ids: Tensor, root_token: Tensor, budget: int,
                             chain_seed: int | None, log_scale: float) -> tuple[Tree, Tensor, Tensor]:
    """``build_tree_kernel`` and, from the same launch, ``policy.path_probabilities`` of the tree: node
    i's exp(its path's summed log-probs + ``log_scale``) truncated to int64, entry 0 (the root)
    exp(log_scale) exactly. The builder keeps each entry's path score (the float64 sum it ranks by),
    so the estimate costs the adaptive policy a store per kept entry and one per node, not a launch
    (the separate ``path_probabilities_kernel`` took ~3 us of a 1.3 ms step on an H100, 2026-12-05).
    The exp is float32's, as the other forms'; the sum is float64's, so an entry may differ by one."""
    return _tree_launch(top_logprobs, top_ids, root_token, budget, chain_seed, log_scale)


def _tree_launch(top_logprobs: Tensor, top_ids: Tensor, root_token: Tensor, budget: int, chain_seed: int | None,
                 log_scale: float | None) -> tuple[Tree, Tensor, Tensor | None]:
    depth, k = top_logprobs.shape
    if not kernel_supports(depth, k, budget):
        raise ValueError(f"tree kernel supports L <= {MAX_DEPTH}, k <= {MAX_TOP_K}, budget <= {MAX_BUDGET}; "
                         f"got L={depth}, k={k}, budget={budget}")
    device = top_logprobs.device
    c = effective_chain_seed(chain_seed, depth, budget)
    kept, n = tree_sizes(depth, k, budget)
    entries = 1 + sum(kept)  # entry 0 is the root
    lp, ids = top_logprobs.contiguous(), top_ids.contiguous()
    probs = log_scale is not None
    # Scratch (global memory; from the graph's pool under capture): per entry its parent entry,
    # rank, depth and final index (and with the probabilities its path score).
    i32 = torch.empty(4 * entries, dtype=torch.int32, device=device)
    out = torch.empty(4 + probs, n + 1, dtype=torch.long, device=device)
    mask = torch.empty(n + 1, n + 1, dtype=torch.bool, device=device)
    scores = torch.empty(entries if probs else 1, dtype=torch.float64, device=device)
    _tree_kernel[(1,)](
        lp, ids, root_token.reshape(1), out[0], out[1], out[2], out[3], mask,
        i32[:entries], i32[entries:2 * entries], i32[2 * entries:3 * entries], i32[3 * entries:],
        scores, out[-1], 0.0 if log_scale is None else log_scale, round(math.exp(log_scale)) if probs else 0,
        depth, k, budget, n, c, _FORCED_KEY, _DEPTH_TIE, PROBS=probs, **kernel_launch(depth, k, budget),
        num_warps=kernel_warps(budget),
    )
    tree = Tree(tokens=out[0], parents=out[1], depths=out[2], ranks=out[3])
    return tree, mask, out[4] if probs else None


def use_tree_kernel(top_logprobs: Tensor, budget: int, max_depth: int) -> bool:
    """The kernel for CUDA tensors with the kernels enabled, at sizes it supports, when the mask
    asked for covers the whole tree (``max_depth >= L``); the tensor-op forms otherwise."""
    depth, k = top_logprobs.shape
    return (triton is not None and top_logprobs.is_cuda and fused.kernels_enabled()
            and kernel_supports(depth, k, budget) and max_depth >= depth)


def build_tree_and_mask(top_logprobs: Tensor, top_ids: Tensor, root_token: Tensor, budget: int,
                        chain_seed: int | None, max_depth: int | None = None) -> tuple[Tree, Tensor]:
    """The device tree and its ancestor mask (``ancestor_mask(tree.parents, max_depth)``, max_depth
    defaulting to L): one launch where ``use_tree_kernel`` says so, else the tensor-op forms."""
    max_depth = top_logprobs.shape[0] if max_depth is None else max_depth
    if use_tree_kernel(top_logprobs, budget, max_depth):
        return build_tree_kernel(top_logprobs, top_ids, root_token, budget, chain_seed)
    tree = build_tree_device(top_logprobs, top_ids, root_token, budget, chain_seed)
    return tree, ancestor_mask(tree.parents, max_depth)


def walk_and_advance(tree: Tree, anc: Tensor, posterior: Tensor, start: Tensor, seq: Tensor, max_depth: int,
                     tail: Tensor | None = None, entries: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """The verify's walk and its bookkeeping on the device: the accepted path, its length, and the
    step's packed result ``[AL, has_child, side, new tokens...]`` (``new[j]``: the token after the
    root at offset j + 1; past the path, the bonus token ``posterior[last]``). Writes the committed
    tokens after the root into ``seq`` and advances ``start`` [1] by AL.

    ``path[:AL]`` are the accepted nodes root first (its other entries are nodes too, not meant to
    be read). One launch on CUDA with the kernels on (``max_depth``: the tree's depth bound); about
    forty tensor ops otherwise (``walk_device`` and the commit's), the reference the kernel is
    tested against.

    ``tail`` (the adaptive policy's step, ``engine.decoding.policy``): the proposal's path probabilities
    [N + 1], root first. The packed result then goes on with entries 1..N of it and the path's first
    ``entries`` nodes (those past AL not meant to be read), as ``torch.cat`` of the three would, written
    by the same launch: the policy's readback costs no launch of its own."""
    t = tree.tokens.numel()
    if tail is not None and not 1 <= entries <= t:
        raise ValueError(f"entries must be 1..{t} (the tree's nodes), got {entries}")
    if triton is None or not posterior.is_cuda or not fused.kernels_enabled():
        path, al = walk_device(tree, anc, posterior)
        last = path.index_select(0, al.view(1) - 1)  # [1]: a 0-d index would be a host read
        has_child = (tree.parents == last).any()
        side = (tree.ranks * anc.index_select(0, last)[0]).gt(0).any()
        j = torch.arange(t, device=posterior.device)
        new = torch.where(j < al - 1, tree.tokens[path[(j + 1).clamp(max=t - 1)]], posterior.index_select(0, last))
        seq.index_copy_(0, start + 1 + j, new)
        start.add_(al)
        packed = [al.view(1), has_child.view(1).long(), side.view(1).long(), new]
        if tail is not None:
            packed += [tail[1:], path[:entries]]
        return path, al.view(1), torch.cat(packed)
    return walk_and_advance_kernel(tree, posterior, start, seq, max_depth, tail, entries)


def walk_and_advance_kernel(tree: Tree, posterior: Tensor, start: Tensor, seq: Tensor, max_depth: int,
                            tail: Tensor | None = None, entries: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """``walk_and_advance`` in one launch (grid (1,)); no host synchronisation."""
    t = tree.tokens.numel()
    n_tail = 0 if tail is None else tail.numel() - 1
    path = torch.empty(t, dtype=torch.long, device=posterior.device)
    packed = torch.empty(3 + t + (n_tail + entries if tail is not None else 0), dtype=torch.long,
                         device=posterior.device)
    _walk_kernel[(1,)](tree.tokens, tree.parents, tree.ranks, posterior, start, seq, path, packed,
                       tail if tail is not None else packed, t, min(max_depth, t - 1), n_tail, entries,
                       T_PAD=max(16, triton.next_power_of_2(t)), N_PAD=max(16, triton.next_power_of_2(n_tail)),
                       HAS_TAIL=tail is not None, num_warps=4)
    return path, packed[:1], packed


def move_accepted_rows(k: Tensor, v: Tensor, slots: Tensor, path: Tensor, al: Tensor, max_accept: int) -> None:
    """KV compaction after a verify that wrote its T nodes at ``slots`` (start, start + 1, ...): in
    every layer of ``k`` and ``v`` [layers, slots, heads, D] the row of node ``path[j]`` moves to
    ``slots[j]`` for j < AL (``al`` [1]; every row is read before any is written). One launch on
    CUDA (a program per layer, head and tensor, moving at most ``max_accept`` rows);
    index_select + index_copy per tensor, moving every row, otherwise."""
    if triton is None or not k.is_cuda or not fused.kernels_enabled() or k.stride(-1) != 1:
        src = slots[:1] + path
        k.index_copy_(1, slots, k.index_select(1, src))
        v.index_copy_(1, slots, v.index_select(1, src))
        return
    move_accepted_rows_kernel(k, v, slots, path, al, max_accept)


def move_accepted_rows_kernel(k: Tensor, v: Tensor, slots: Tensor, path: Tensor, al: Tensor, max_accept: int
                              ) -> None:
    """``move_accepted_rows`` in one launch: moves the first min(AL, max_accept) rows."""
    layers, _, heads, d = k.shape
    _move_rows_kernel[(layers, heads, 2)](k, v, slots, path, al, k.stride(0), k.stride(1), k.stride(2), d,
                                          A_PAD=max(2, triton.next_power_of_2(max_accept)),
                                          D_PAD=triton.next_power_of_2(d), num_warps=4)


def path_probabilities_kernel(top_logprobs: Tensor, tree: Tree, log_scale: float) -> Tensor:
    """``policy.path_probabilities`` in one launch (grid (1,)): node i's probability that the target
    accepts its whole path, exp(its path's summed log-probs + ``log_scale``) truncated to int64, each node
    walking up its parents (at most L); entry 0, the root, exp(log_scale). The tensor-op form's six
    launches cost ~0.012 ms of an adaptive tree step on an H200 (2026-12-05); this one sums in float32
    from the leaf up where the form's product sums in its own order, so an entry may differ by one."""
    depth, k = top_logprobs.shape
    t = tree.tokens.numel()
    out = torch.empty(t, dtype=torch.long, device=top_logprobs.device)
    _path_probs_kernel[(1,)](top_logprobs.contiguous(), tree.parents, tree.depths, tree.ranks, out, t, k, depth,
                             log_scale, T_PAD=max(16, triton.next_power_of_2(t)), num_warps=4)
    return out


if triton is not None:

    @triton.jit(do_not_specialize=["T", "MAXD", "N", "ENTRIES"])
    def _walk_kernel(tok_ptr, par_ptr, rank_ptr, post_ptr, start_ptr, seq_ptr, path_ptr, packed_ptr, tail_ptr, T,
                     MAXD, N, ENTRIES, T_PAD: tl.constexpr, N_PAD: tl.constexpr, HAS_TAIL: tl.constexpr):
        # From the root, follow the child whose token is the target's choice at the current node
        # (siblings hold distinct tokens: at most one matches) until none does.
        n = tl.arange(0, T_PAD)
        vn = n < T
        toks = tl.load(tok_ptr + n, mask=vn, other=-1)
        pars = tl.load(par_ptr + n, mask=vn, other=-2)
        path = tl.zeros([T_PAD], tl.int64)  # path[0] = 0, the root
        cur = tl.zeros([], tl.int64)
        al = tl.full([], 1, tl.int64)
        going = tl.full([], 1, tl.int32)
        side = tl.zeros([], tl.int32)
        for _ in range(0, MAXD):
            want = tl.load(post_ptr + cur)
            nxt = tl.min(tl.where(vn & (pars == cur) & (toks == want), n, T_PAD), axis=0).to(tl.int64)
            going = going * (nxt < T).to(tl.int32)
            step = going > 0
            path = tl.where(step & (n == al), nxt, path)
            side = side | (step & (tl.load(rank_ptr + nxt, mask=step, other=0) > 0)).to(tl.int32)
            cur = tl.where(step, nxt, cur)
            al = al + going
        has_child = tl.sum((vn & (pars == cur)).to(tl.int32), axis=0) > 0
        bonus = tl.load(post_ptr + cur)
        path = tl.where(n >= al, cur, path)  # past the path: the last node (a valid index)
        tl.store(path_ptr + n, path, mask=vn)
        s = tl.load(start_ptr)  # before the barrier: every thread has it before one stores s + al
        tl.debug_barrier()
        nxt_node = tl.load(path_ptr + n + 1, mask=vn & (n + 1 < T), other=0)
        new = tl.where(n < al - 1, tl.load(tok_ptr + nxt_node, mask=vn, other=0), bonus)
        tl.store(seq_ptr + s + 1 + n, new, mask=n < al)
        tl.store(packed_ptr + 3 + n, new, mask=vn)
        tl.store(packed_ptr, al)
        tl.store(packed_ptr + 1, has_child.to(tl.int64))
        tl.store(packed_ptr + 2, side.to(tl.int64))
        tl.store(start_ptr, s + al)
        if HAS_TAIL:  # the adaptive policy's: the proposal's path probabilities 1..N, the path's first ENTRIES
            i = tl.arange(0, N_PAD)
            tl.store(packed_ptr + 3 + T + i, tl.load(tail_ptr + 1 + i, mask=i < N, other=0), mask=i < N)
            tl.store(packed_ptr + 3 + T + N + n, path, mask=n < ENTRIES)

    @triton.jit
    def _move_rows_kernel(k_ptr, v_ptr, slot_ptr, path_ptr, al_ptr, s_layer, s_slot, s_head, D,
                          A_PAD: tl.constexpr, D_PAD: tl.constexpr):
        layer = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        if tl.program_id(2) == 0:
            base = k_ptr + layer * s_layer + head * s_head
        else:
            base = v_ptr + layer * s_layer + head * s_head
        a = tl.arange(0, A_PAD)
        col = tl.arange(0, D_PAD)
        va = a < tl.load(al_ptr)
        src = tl.load(slot_ptr) + tl.load(path_ptr + a, mask=va, other=0)
        dst = tl.load(slot_ptr + a, mask=va, other=0)
        m = va[:, None] & (col < D)[None, :]
        rows = tl.load(base + src[:, None] * s_slot + col[None, :], mask=m, other=0.0)
        tl.debug_barrier()  # a row may be read from the slot another one is written to
        tl.store(base + dst[:, None] * s_slot + col[None, :], rows, mask=m)

    @triton.jit
    def _packed(key, idx, LOW: tl.constexpr):
        # A float64 key as a signed int64 that sorts as the key, its low bits replaced by LOW - idx:
        # a descending sort orders by key, exact ties (and keys within 2**-39 of each other) to the
        # lower index.
        bits = key.to(tl.int64, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFFFFFFFFFF)
        return (ordered & ~LOW) | (LOW - idx)

    @triton.jit
    def _first(sorted_vec, ROWS: tl.constexpr, COLS: tl.constexpr):
        # The first COLS entries of a [ROWS * COLS] vector (a row-major reshape's row 0).
        grid = tl.reshape(sorted_vec, [ROWS, COLS])
        return tl.sum(tl.where((tl.arange(0, ROWS) == 0)[:, None], grid, 0), axis=0)

    @triton.jit
    def _merge_ascending(up, down, N: tl.constexpr, LOG_N: tl.constexpr):
        # The N largest of ``up`` (ascending) and ``down`` (descending), ascending: their elementwise
        # maximum holds exactly those and is bitonic (falling, then rising), so log2(N) half-cleaners
        # sort it (a full sort of the 2N would take ~(log2 2N)^2 / 2 such stages).
        x = tl.maximum(up, down)
        for s in tl.static_range(LOG_N):
            y = tl.reshape(x, [1 << s, 2, N >> (s + 1)])  # the pairs half a block apart
            side = tl.arange(0, 2)[None, :, None]
            a = tl.sum(tl.where(side == 0, y, 0), axis=1)[:, None, :]
            b = tl.sum(tl.where(side == 1, y, 0), axis=1)[:, None, :]
            x = tl.reshape(tl.where(side == 0, tl.minimum(a, b), tl.maximum(a, b)), [N])
        return x

    @triton.jit
    def _tree_kernel(lp_ptr, ids_ptr, root_ptr, tok_ptr, par_ptr, dep_ptr, rank_ptr, mask_ptr,
                          epar_ptr, erank_ptr, edep_ptr, efinal_ptr, escore_ptr, prob_ptr, log_scale, root_prob,
                          L, K, B, N, CHAIN, FORCED_KEY: tl.constexpr, DEPTH_TIE: tl.constexpr, PROBS: tl.constexpr,
                          LOW: tl.constexpr,
                          P_PAD: tl.constexpr, LOG_P: tl.constexpr, K_PAD: tl.constexpr, C_PAD: tl.constexpr,
                          BLOCK_M: tl.constexpr):
        # Entries: 0 the root, then depth 1's kept candidates in key order, depth 2's, ... (as
        # build_tree_device concatenates them). Per depth everything stays in registers: the parents'
        # scores in their kept order, the candidates that can be kept packed and sorted, the best B of
        # them kept; across depths the best entries so far as one sorted packed list.
        forced_key = tl.full([], FORCED_KEY, tl.float64)  # float64 constants: a Python float is fp32
        depth_tie = tl.full([], DEPTH_TIE, tl.float64)
        sent = tl.full([], -9223372036854775807 - 1, tl.int64)  # sorts after every packed key
        n1 = N + 1
        for m0 in range(0, n1 * n1, BLOCK_M):  # the mask starts all False
            mo = m0 + tl.arange(0, BLOCK_M)
            tl.store(mask_ptr + mo, tl.zeros([BLOCK_M], tl.int1), mask=mo < n1 * n1)
        tl.store(epar_ptr, -1)
        tl.store(efinal_ptr, 0)
        ps = tl.arange(0, P_PAD)
        rs = tl.arange(0, K_PAD)
        # The candidates (parent slot p, rank r) that can end up in the tree (candidate_count): rank
        # r's parents 0..min(B - 1, B // (r + 2)), rank-major. cp, cr: each candidate's slot and rank;
        # the sort key's index stays p * K + r, so ties order as over the full grid.
        cs = tl.arange(0, C_PAD)
        cp = tl.zeros([C_PAD], tl.int32)
        cr = tl.zeros([C_PAD], tl.int32)
        first = tl.zeros([], tl.int32)  # rank r's first candidate
        for r_loop in range(0, K):
            r_now = tl.zeros([], tl.int32) + r_loop
            after = first + tl.minimum(B - 1, B // (r_now + 2)) + 1
            here = (cs >= first) & (cs < after)
            cp = tl.where(here, cs - first, cp)
            cr = tl.where(here, r_now, cr)
            first = after
        c_ok = cs < first
        cand = cp * K + cr
        pscore = tl.zeros([P_PAD], tl.float64)  # the root's score: 0
        best = tl.zeros([P_PAD], tl.int64) + sent  # ascending (all equal here)
        p_count = tl.full([], 1, tl.int32)  # the previous depth's entries (build_tree_device's m)
        p_live = tl.full([], 1, tl.int32)  # of those, the ones the candidates above could fill
        p_off = tl.full([], 0, tl.int32)
        off = tl.full([], 1, tl.int32)
        for d_loop in range(0, L):
            d = tl.zeros([], tl.int32) + d_loop  # a tensor also in the interpreter (whose loop index is an int)
            m = tl.minimum(B, p_count * K)
            lp_d = tl.load(lp_ptr + d * K + rs, mask=rs < K, other=0.0).to(tl.float64)
            # as build_tree_device: the parent's score + lp, float64
            score = tl.gather(pscore, cp, 0) + tl.gather(lp_d, cr, 0)
            forced = (cp == 0) & (cr == 0) & (d < CHAIN)  # the chain seed's rank-0 path
            key = tl.where(forced, forced_key - d, score - d.to(tl.float64) * depth_tie)
            packed = tl.where(c_ok & (cp < p_live), _packed(key, cand, LOW), sent)
            top = _first(tl.sort(packed, descending=True), C_PAD // P_PAD, P_PAD)
            keep = (ps < m) & (top != sent)
            i = LOW - (top & LOW)
            p = tl.where(keep, i // K, 0)
            r = tl.where(keep, i % K, 0)
            e = off + ps
            tl.store(epar_ptr + e, p_off + p, mask=keep)
            tl.store(erank_ptr + e, r, mask=keep)
            tl.store(edep_ptr + e, d + 1 + ps * 0, mask=keep)
            entry = tl.where(keep, (top & ~LOW) | (LOW - e), sent)  # descending, as top
            best = _merge_ascending(best, entry, P_PAD, LOG_P)
            # the kept entries' scores, by the same float64 add as their candidates'
            pscore = tl.where(keep, tl.gather(pscore, p, 0) + tl.gather(lp_d, r, 0), 0.0)
            if PROBS:  # the entry's path score, for its node's probability (the forced chain's too)
                tl.store(escore_ptr + e, pscore, mask=keep)
            p_off = off
            off += m  # entry indices as build_tree_device's (ties between depths order by them)
            p_count = m
            p_live = tl.sum(keep.to(tl.int32), 0)

        # The best N entries are the tree, in order: node n + 1 is best[n] (descending).
        best = tl.flip(best, 0)
        chosen = (ps < N) & (best != sent)  # (always N of them: never an entry index past the scratch)
        en = LOW - (best & LOW)
        tl.store(efinal_ptr + en, ps + 1, mask=chosen)
        tl.debug_barrier()  # the entries' records and final indices (and the zeroed mask), before any reads
        fdep = tl.load(edep_ptr + en, mask=chosen, other=1)
        fr = tl.load(erank_ptr + en, mask=chosen, other=0)
        par = tl.load(efinal_ptr + tl.load(epar_ptr + en, mask=chosen, other=0), mask=chosen, other=0)
        dst = ps + 1
        tl.store(tok_ptr + dst, tl.load(ids_ptr + (fdep - 1) * K + fr, mask=chosen, other=0).to(tl.int64),
                 mask=chosen)
        tl.store(dep_ptr + dst, fdep.to(tl.int64), mask=chosen)
        tl.store(rank_ptr + dst, fr.to(tl.int64), mask=chosen)
        tl.store(par_ptr + dst, par.to(tl.int64), mask=chosen)
        if PROBS:
            sc = tl.load(escore_ptr + en, mask=chosen, other=0.0) + log_scale
            tl.store(prob_ptr + dst, tl.exp(sc.to(tl.float32)).to(tl.int64), mask=chosen)
            tl.store(prob_ptr, root_prob.to(tl.int64))
        tl.store(tok_ptr, tl.load(root_ptr).to(tl.int64))
        tl.store(par_ptr, tl.full([], -1, tl.int64))
        tl.store(dep_ptr, tl.zeros([], tl.int64))
        tl.store(rank_ptr, tl.zeros([], tl.int64))
        # Ancestor mask: the root marks itself; node n + 1 marks itself, then walks up its at most L
        # ancestors, its parents read from registers (par[n]: node n + 1's).
        tl.store(mask_ptr, tl.full([], 1, tl.int1))
        cur = tl.where(chosen, dst, -1)
        for _ in range(0, L + 1):
            live = cur >= 0
            tl.store(mask_ptr + dst * n1 + cur, tl.full([P_PAD], 1, tl.int1), mask=live)
            up = tl.gather(par, tl.maximum(cur - 1, 0), 0)
            cur = tl.where(live & (cur > 0), up, -1)

    @triton.jit(do_not_specialize=["T", "K", "L"])
    def _path_probs_kernel(lp_ptr, par_ptr, dep_ptr, rank_ptr, out_ptr, T, K, L, log_scale, T_PAD: tl.constexpr):
        ns = tl.arange(0, T_PAD)
        ok = ns < T
        total = tl.zeros([T_PAD], tl.float32)
        cur = tl.where(ok, ns, 0).to(tl.int64)  # the parents are int64: the loop keeps one type
        for _ in range(0, L):  # a node's path has at most L drafted nodes above the root
            live = cur > 0
            d = tl.load(dep_ptr + cur, mask=live, other=1)
            r = tl.load(rank_ptr + cur, mask=live, other=0)
            total += tl.where(live, tl.load(lp_ptr + (d - 1) * K + r, mask=live, other=0.0).to(tl.float32), 0.0)
            cur = tl.where(live, tl.load(par_ptr + cur, mask=live, other=0), 0)
        tl.store(out_ptr + ns, tl.exp(total + log_scale).to(tl.int64), mask=ok)
