"""DDTree: build a draft tree from per-depth top-k proposals, mask it, walk it. Pure functions.

A tree is stored in topological order with the root (the last committed token) at index 0:
``tokens[i]``, ``parents[i]`` (``parents[0] == -1``, otherwise ``parents[i] < i``), ``depths[i]``
(root 0) and ``ranks[i]`` (rank of the token among its depth's top-k; root 0).

Two builders produce the same tree (tie-breaking aside):
- ``build_tree_host``: the reference best-first heap on host floats (the ``generic`` path);
- ``build_tree_device``: a per-depth beam on tensors that never leaves the device (``runtime``).

Why the beam equals best-first: a prefix's score (sum of log-probs) never exceeds its parent's
nor its previous sibling's, so the ``budget`` prefixes best-first pops are exactly the
``budget`` highest-scoring prefixes, and every one of them has its parent among the ``budget``
highest-scoring prefixes one depth up. Keeping the top ``budget`` per depth therefore loses
nothing, and a final top-``budget`` over all depths picks the same set.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from torch import Tensor

# Forced (chain-seeded) nodes sort before everything; depth breaks score ties so a parent is
# never ordered (or selected) after its child.
_FORCED_KEY = 1e9
_DEPTH_TIE = 1e-12


@dataclass(frozen=True)
class Tree:
    tokens: Tensor  # [N+1] long
    parents: Tensor  # [N+1] long
    depths: Tensor  # [N+1] long
    ranks: Tensor  # [N+1] long

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def to(self, device: torch.device | str) -> Tree:
        return Tree(*(t.to(device) for t in (self.tokens, self.parents, self.depths, self.ranks)))


def effective_chain_seed(chain_seed: int | None, depth: int, budget: int) -> int:
    """None means the whole top-1 chain; the chain never exceeds the depth or the budget."""
    c = depth if chain_seed is None else chain_seed
    return max(0, min(c, depth, budget))


def build_tree_host(
    top_logprobs: Tensor, top_ids: Tensor, root_token: int, budget: int, chain_seed: int | None
) -> Tree:
    """Best-first over prefixes scored by summed log-probs, as the DDTree reference does it.

    top_logprobs, top_ids: [L, k] (host), sorted descending along k.
    """
    lp: list[list[float]] = top_logprobs.double().tolist()
    ids: list[list[int]] = top_ids.tolist()
    depth, k = len(lp), len(lp[0]) if lp else 0
    tokens, parents, depths, ranks = [root_token], [-1], [0], [0]

    def add(parent: int, d: int, r: int) -> int:
        tokens.append(ids[d][r])
        parents.append(parent)
        depths.append(d + 1)
        ranks.append(r)
        return len(tokens) - 1

    heap: list[tuple[float, int, int, int, int, float]] = []
    counter = 0

    def push(parent: int, d: int, r: int, parent_score: float) -> None:
        nonlocal counter
        score = parent_score + lp[d][r]
        # (-score, depth) keeps parents ahead of children on exact ties, as the device beam does.
        heapq.heappush(heap, (-score, d, counter, parent, r, parent_score))
        counter += 1

    c = effective_chain_seed(chain_seed, depth, budget)
    parent, score = 0, 0.0
    for d in range(c):
        if k > 1:
            push(parent, d, 1, score)
        score += lp[d][0]
        parent = add(parent, d, 0)
    if c < depth and k > 0:
        push(parent, c, 0, score)
    while len(tokens) - 1 < budget and heap:
        neg_score, d, _, par, r, parent_score = heapq.heappop(heap)
        node = add(par, d, r)
        if r + 1 < k:
            push(par, d, r + 1, parent_score)
        if d + 1 < depth:
            push(node, d + 1, 0, -neg_score)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)
    return Tree(as_long(tokens), as_long(parents), as_long(depths), as_long(ranks))


def build_tree_device(
    top_logprobs: Tensor, top_ids: Tensor, root_token: Tensor, budget: int, chain_seed: int | None
) -> Tree:
    """The same tree as ``build_tree_host``, built with tensor ops only (no host sync).

    top_logprobs, top_ids: [L, k] on the device; root_token: a 0-d or [1] long tensor.
    """
    device = top_logprobs.device
    depth, k = top_logprobs.shape
    c = effective_chain_seed(chain_seed, depth, budget)
    lp = top_logprobs.double()
    rank_ids = torch.arange(k, device=device)

    prev_score = torch.zeros(1, dtype=torch.float64, device=device)
    prev_forced = torch.ones(1, dtype=torch.bool, device=device)
    keys, scores, parent_slots, ranks = [], [], [], []
    for d in range(depth):
        cand_score = prev_score[:, None] + lp[d][None, :]  # [P, k]
        cand_forced = prev_forced[:, None] & (rank_ids == 0)[None, :] & (d < c)
        key = torch.where(cand_forced, _FORCED_KEY - d, cand_score - d * _DEPTH_TIE).flatten()
        m = min(budget, key.numel())
        sel_key, sel = torch.topk(key, m)
        keys.append(sel_key)
        scores.append(cand_score.flatten()[sel])
        parent_slots.append(sel // k)
        ranks.append(sel % k)
        prev_score, prev_forced = scores[-1], cand_forced.flatten()[sel]

    sizes = [x.numel() for x in keys]
    offsets = [0]
    for s in sizes[:-1]:
        offsets.append(offsets[-1] + s)
    all_keys = torch.cat(keys)
    all_depth = torch.cat([torch.full((s,), d + 1, device=device) for d, s in enumerate(sizes)])
    all_rank = torch.cat(ranks)
    # Global index of each entry's parent entry (-1: the root).
    all_parent_entry = torch.cat(
        [torch.full_like(parent_slots[0], -1)] + [p + offsets[d - 1] for d, p in enumerate(parent_slots) if d]
    )
    all_token = torch.cat([top_ids[d][r] for d, r in enumerate(ranks)])

    n = min(budget, all_keys.numel())
    _, chosen = torch.topk(all_keys, n)  # sorted by key: forced chain first, then best-first order
    # Final index of every chosen entry (root = 0); entries not chosen map to -1.
    final_index = torch.full((all_keys.numel(),), -1, dtype=torch.long, device=device)
    final_index[chosen] = torch.arange(1, n + 1, device=device)
    par_entry = all_parent_entry[chosen]
    parents = torch.where(par_entry >= 0, final_index[par_entry.clamp(min=0)], torch.zeros_like(par_entry))

    root = root_token.reshape(1).to(device=device, dtype=torch.long)
    zero = torch.zeros(1, dtype=torch.long, device=device)
    return Tree(
        tokens=torch.cat([root, all_token[chosen].long()]),
        parents=torch.cat([zero - 1, parents]),
        depths=torch.cat([zero, all_depth[chosen]]),
        ranks=torch.cat([zero, all_rank[chosen]]),
    )


def chain_tree(root_token: Tensor, proposals: Tensor) -> Tree:
    """The degenerate tree of plain DFlash: root followed by the greedy block, one path."""
    device = proposals.device
    n = proposals.numel()
    idx = torch.arange(n + 1, device=device)
    return Tree(
        tokens=torch.cat([root_token.reshape(1).to(device=device, dtype=torch.long), proposals.long()]),
        parents=idx - 1,
        depths=idx,
        ranks=torch.zeros_like(idx),
    )


def ancestor_mask(parents: Tensor, max_depth: int) -> Tensor:
    """[N+1, N+1] bool: mask[i, j] is True iff node j is node i or one of its ancestors."""
    n = parents.numel()
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    cur = parents
    for _ in range(max_depth):
        valid = cur >= 0
        mask |= torch.nn.functional.one_hot(cur.clamp(min=0), n).bool() & valid[:, None]
        cur = torch.where(valid, parents[cur.clamp(min=0)], cur)
    return mask


def walk_host(tokens: list[int], parents: list[int], target_tokens: list[int]) -> list[int]:
    """Posterior walk: from the root, descend while the target's token at the node is a child.

    Returns the accepted path as node indices, root first. Committed tokens are the path's
    tokens after the root followed by ``target_tokens[path[-1]]``.
    """
    children: dict[int, dict[int, int]] = {}
    for i in range(1, len(tokens)):
        children.setdefault(parents[i], {})[tokens[i]] = i
    path = [0]
    while True:
        nxt = children.get(path[-1], {}).get(target_tokens[path[-1]])
        if nxt is None:
            return path
        path.append(nxt)


def walk_device(tree: Tree, mask: Tensor, target_tokens: Tensor) -> tuple[Tensor, Tensor]:
    """The walk with tensor ops: returns (path_by_depth [N+1] padded, accepted length AL).

    ``path_by_depth[:AL]`` are the accepted node indices ordered by depth, root first. A node is
    on the accepted path iff every edge from the root to it matches the target's token; sibling
    tokens are distinct, so those nodes form one path, and its deepest node ends it.
    """
    edge_ok = (tree.tokens == target_tokens[tree.parents.clamp(min=0)]) | (tree.parents < 0)  # the root
    on_path = ~(mask & ~edge_ok[None, :]).any(dim=1)
    # Index with [1]-shaped tensors: a 0-d tensor index is read back to the host (no CUDA graphs).
    last = torch.argmax(torch.where(on_path, tree.depths, -1)).view(1)
    on_last_path = mask.index_select(0, last)[0]
    order = torch.argsort(torch.where(on_last_path, tree.depths, tree.depths.numel() + 1))
    return order, tree.depths.index_select(0, last)[0] + 1
