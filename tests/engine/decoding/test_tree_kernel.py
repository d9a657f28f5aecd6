"""DDTree's tree and mask in one launch, the verify's walk and the KV compaction (Triton,
interpreted on the CPU) against their tensor-op forms."""

from __future__ import annotations

import pytest
import torch

from engine.models import fused
from tests.engine.models.test_fused import DEVICE, _r, kernels_on  # noqa: F401  (kernels_on: autouse)

pytest.importorskip("triton")


# ------------------------------------------------------------------ DDTree: tree + mask in one launch


def _tie_free_proposals(depth: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs sorted descending per row, no two prefix sums equal (random positive steps)."""
    gen = torch.Generator().manual_seed(seed)
    lp = -torch.cumsum(torch.rand(depth, k, generator=gen) + 1e-3, dim=1) - torch.rand(depth, 1, generator=gen)
    return lp.to(DEVICE), torch.randint(0, 1000, (depth, k), generator=gen).to(DEVICE)


def _assert_same_tree(a, b):
    for x, y in zip((a.tokens, a.parents, a.depths, a.ranks), (b.tokens, b.parents, b.depths, b.ranks), strict=True):
        assert x.dtype == y.dtype == torch.long and torch.equal(x.cpu(), y.cpu())


# budget past the node count (2, 3, 40), k=1, chain seed none/0/partial/full, an exact-size budget
@pytest.mark.parametrize("depth,k,budget,chain_seed", [
    (1, 3, 5, None), (2, 3, 40, 0), (4, 1, 3, None), (4, 3, 10, 0), (5, 2, 9, 2), (7, 4, 22, None),
    (6, 3, 17, 6), (3, 5, 155, 1), (8, 8, 16, 3), (15, 8, 48, None), (15, 8, 64, 4), (10, 16, 128, 0),
])
def test_tree_kernel_equals_the_device_builder_and_its_mask(depth, k, budget, chain_seed):
    from engine.decoding.tree import ancestor_mask, build_tree_device
    from engine.decoding.tree_kernel import build_tree_kernel

    lp, ids = _tie_free_proposals(depth, k, seed=depth * 100 + k * 10 + budget)
    root = torch.tensor([5], device=DEVICE)
    ref = build_tree_device(lp, ids, root, budget, chain_seed)
    tree, mask = build_tree_kernel(lp, ids, root, budget, chain_seed)
    _assert_same_tree(tree, ref)
    assert mask.dtype == torch.bool and torch.equal(mask.cpu(), ancestor_mask(ref.parents, depth).cpu())


def _mixed_proposals(seed: int) -> tuple[torch.Tensor, int, int | None]:
    """Log-probs whose rows fall steeply or stay nearly flat across ranks (row by row at random), so
    that a tree's nodes reach far along a depth's parents or its ranks; a budget and chain seed."""
    gen = torch.Generator().manual_seed(seed)
    depth, k = int(torch.randint(2, 7, (1,), generator=gen)), int(torch.randint(2, 9, (1,), generator=gen))
    scales = torch.tensor([1e-3, 0.1, 1.0, 10.0])[torch.randint(0, 4, (depth, 1), generator=gen)]
    offset = torch.tensor([0.0, 1e-3, 1.0])[int(torch.randint(0, 3, (1,), generator=gen))]
    lp = -torch.cumsum(scales * torch.rand(depth, k, generator=gen), 1) - offset * torch.rand(depth, 1, generator=gen)
    budget = int(torch.randint(2, 65, (1,), generator=gen))
    return lp, budget, [None, 0, 1, 2][int(torch.randint(0, 4, (1,), generator=gen))]


def test_every_tree_node_is_among_the_candidates_the_kernel_sorts():
    """``candidate_count``'s bound, on the reference builder: a node whose parent sits in slot p >= 1
    of its depth (tree nodes of one depth sit in key order) and that is its parent's rank-r child has
    p * (r + 2) <= budget. Random trees reach within 0.8 of the bound (it is not loose by a rank)."""
    from engine.decoding.tree import build_tree_host

    closest = 0.0
    for seed in range(1500):
        lp, budget, chain_seed = _mixed_proposals(seed)
        tree = build_tree_host(lp, torch.zeros_like(lp, dtype=torch.long), 0, budget, chain_seed)
        parents, depths, ranks = tree.parents.tolist(), tree.depths.tolist(), tree.ranks.tolist()
        for node in range(1, len(parents)):
            parent = parents[node]
            slot = sum(1 for j in range(1, parent) if depths[j] == depths[parent])  # (the root: none)
            if slot:
                assert slot * (ranks[node] + 2) <= budget, (seed, node)
                closest = max(closest, slot * (ranks[node] + 2) / budget)
    assert closest > 0.8


@pytest.mark.parametrize("seed", [654, 626, 969, 1409, 605, 919, 1342, 261])  # the closest to the bound
def test_tree_kernel_equals_the_device_builder_on_steep_and_flat_ranks(seed):
    """The kernel sorts ``candidate_count`` candidates a depth, not the full parents x ranks grid: the
    same trees as the reference where nodes reach far along the parents or the ranks."""
    from engine.decoding.tree import ancestor_mask, build_tree_device
    from engine.decoding.tree_kernel import build_tree_kernel

    lp, budget, chain_seed = _mixed_proposals(seed)
    ids = torch.randint(0, 1000, lp.shape, generator=torch.Generator().manual_seed(seed))
    root = torch.tensor([5], device=DEVICE)
    ref = build_tree_device(lp.to(DEVICE), ids.to(DEVICE), root, budget, chain_seed)
    tree, mask = build_tree_kernel(lp.to(DEVICE), ids.to(DEVICE), root, budget, chain_seed)
    _assert_same_tree(tree, ref)
    assert torch.equal(mask.cpu(), ancestor_mask(ref.parents, lp.shape[0]).cpu())


@pytest.mark.parametrize("depth,k,budget,chain_seed", [(4, 3, 10, 0), (7, 4, 22, None), (5, 8, 40, 2)])
def test_tree_kernel_equals_the_host_builder(depth, k, budget, chain_seed):
    from engine.decoding.tree import build_tree_host
    from engine.decoding.tree_kernel import build_tree_kernel

    gen = torch.Generator().manual_seed(budget)
    top_lp, top_ids = torch.topk(torch.log_softmax(torch.randn(depth, 50, generator=gen) * 2, -1), k, dim=-1)
    host = build_tree_host(top_lp, top_ids, 3, budget, chain_seed)
    tree, _ = build_tree_kernel(top_lp.to(DEVICE), top_ids.to(DEVICE), torch.tensor(3, device=DEVICE), budget,
                                chain_seed)
    _assert_same_tree(tree, host)


def test_tree_kernel_breaks_exact_ties_by_the_lower_index(monkeypatch):
    """Quantised log-probs tie exactly (children of distinct parents too); the kernel orders ties by
    lower index, as build_tree_device does with a stable top-k."""
    from engine.decoding.tree import ancestor_mask, build_tree_device
    from engine.decoding.tree_kernel import build_tree_kernel

    def stable_topk(x, n, *args, **kwargs):
        values, order = torch.sort(x, descending=True, stable=True)
        return values[:n], order[:n]

    tied_first = -torch.tensor([[0.5, 0.5, 1.0], [0.0, 0.5, 0.5], [0.5, 1.0, 1.0], [0.5, 0.5, 0.5]])
    # distinct parents at depth 2 whose children tie exactly
    distinct_first = -torch.tensor([[0.125, 0.75, 1.5], [0.5, 0.5, 1.0], [0.25, 0.25, 0.375], [0.5, 0.5, 0.5]])
    ids = torch.arange(12).view(4, 3)
    for lp, budget, chain_seed in ((tied_first, 9, 0), (tied_first, 14, 2), (distinct_first, 9, 0),
                                   (distinct_first, 7, None), (distinct_first, 12, 1)):
        tree, mask = build_tree_kernel(lp.to(DEVICE), ids.to(DEVICE), torch.tensor(1, device=DEVICE), budget,
                                       chain_seed)
        with monkeypatch.context() as m:
            m.setattr(torch, "topk", stable_topk)
            ref = build_tree_device(lp, ids, torch.tensor(1), budget, chain_seed)
        _assert_same_tree(tree, ref)
        assert torch.equal(mask.cpu(), ancestor_mask(ref.parents, 4))


def test_tree_dispatch_falls_back_off_cuda_and_past_the_kernel_sizes():
    from engine.decoding import tree_kernel
    from engine.decoding.tree import ancestor_mask, build_tree_device

    lp, ids = _tie_free_proposals(4, 3, seed=1)
    assert not tree_kernel.use_tree_kernel(lp.cpu(), 10, 4)
    tree, mask = tree_kernel.build_tree_and_mask(lp.cpu(), ids.cpu(), torch.tensor(2), 10, None)
    _assert_same_tree(tree, build_tree_device(lp.cpu(), ids.cpu(), torch.tensor(2), 10, None))
    assert torch.equal(mask, ancestor_mask(tree.parents, 4))
    assert tree_kernel.kernel_supports(31, 16, 256)
    assert not tree_kernel.kernel_supports(32, 8, 22) and not tree_kernel.kernel_supports(15, 17, 22)
    assert not tree_kernel.kernel_supports(15, 8, 257)
    assert tree_kernel.tree_sizes(3, 4, 10) == ([4, 10, 10], 10)


# ------------------------------------------------------------------ the verify's walk and commit in two launches


def _walk_case(depth: int, k: int, budget: int, seed: int):
    """A DDTree, and target choices that follow it from the root down to a random node (and leave
    it with a token none of its children holds), plus a sequence buffer and the root's position."""
    from engine.decoding.tree import ancestor_mask, build_tree_device

    lp, ids = _tie_free_proposals(depth, k, seed)
    tree = build_tree_device(lp, ids, torch.tensor([5], device=DEVICE), budget, None)
    gen = torch.Generator().manual_seed(seed)
    t = tree.tokens.numel()
    posterior = torch.randint(2000, 3000, (t,), generator=gen).to(DEVICE)  # no node holds these
    node = int(torch.randint(0, t, (1,), generator=gen))
    parents = tree.parents.tolist()
    while parents[node] >= 0:  # each ancestor's target choice is its child on the way to `node`
        posterior[parents[node]] = tree.tokens[node]
        node = parents[node]
    seq = torch.randint(0, 100, (t + 40,), generator=gen).to(DEVICE)
    return tree, ancestor_mask(tree.parents, depth), posterior, seq, torch.tensor([17], device=DEVICE)


@pytest.mark.parametrize("depth,k,budget,seed", [(4, 3, 10, 0), (7, 4, 22, 1), (15, 8, 22, 2), (15, 8, 64, 3),
                                                 (5, 1, 5, 4), (1, 2, 2, 5)])
def test_walk_kernel_equals_the_tensor_op_walk_and_commit(depth, k, budget, seed):
    from engine.decoding import tree_kernel

    tree, anc, posterior, seq, start = _walk_case(depth, k, budget, seed)
    seq_ref, start_ref = seq.clone(), start.clone()
    with fused.using_kernels(False):
        path_ref, al_ref, packed_ref = tree_kernel.walk_and_advance(tree, anc, posterior, start_ref, seq_ref, depth)
    path, al, packed = tree_kernel.walk_and_advance_kernel(tree, posterior, start, seq, depth)
    a = int(al_ref)
    assert a >= 1 and al.tolist() == [a] and torch.equal(packed, packed_ref)
    assert torch.equal(path[:a], path_ref[:a]) and torch.equal(start, start_ref)
    assert torch.equal(seq[: 18 + a], seq_ref[: 18 + a])  # committed tokens after the root, nothing before
    assert torch.equal(seq[18 + a :], _walk_case(depth, k, budget, seed)[3][18 + a :])  # the rest untouched


@pytest.mark.parametrize("al,max_accept", [(1, 4), (3, 4), (4, 4), (6, 16)])
def test_move_accepted_rows_kernel_compacts_like_index_copy(al, max_accept):
    """Rows read from slots other rows are written to (path [0, 2, 3, 5, ...]) still move intact."""
    from engine.decoding import tree_kernel

    layers, slots_n, heads, d, t, s = 3, 40, 2, 24, 12, 9
    k, v = _r(layers, slots_n, heads, d, seed=7), _r(layers, slots_n, heads, d, seed=8)
    slots = s + torch.arange(t, device=DEVICE)
    path = torch.tensor([0, 2, 3, 5, 6, 7, 9, 10, 11, 1, 4, 8], device=DEVICE)
    k_ref, v_ref = k.clone(), v.clone()
    with fused.using_kernels(False):
        tree_kernel.move_accepted_rows(k_ref, v_ref, slots, path, torch.tensor([al], device=DEVICE), max_accept)
    k0, v0 = k.clone(), v.clone()
    tree_kernel.move_accepted_rows_kernel(k, v, slots, path, torch.tensor([al], device=DEVICE), max_accept)
    n = min(al, max_accept)
    assert torch.equal(k[:, : s + n], k_ref[:, : s + n]) and torch.equal(v[:, : s + n], v_ref[:, : s + n])
    assert torch.equal(k[:, s + n :], k0[:, s + n :]) and torch.equal(v[:, s + n :], v0[:, s + n :])


# ------------------------------------------------------------------ the adaptive policy's estimate in one launch


@pytest.mark.parametrize("depth,k,budget,chain_seed", [(1, 3, 3, None), (5, 2, 9, 2), (7, 4, 22, None),
                                                       (15, 8, 48, 4), (10, 16, 128, 0)])
def test_path_probabilities_in_one_launch_equal_the_tensor_op_form_within_one(depth, k, budget, chain_seed):
    """Node i's fixed-point probability of its whole path, walked up its parents in the kernel,
    against the ancestor mask's product: the same up to float32 summation order (at most one unit),
    the root's exactly FIXED_POINT; on trees with deep paths and with flat rows (probabilities near 1)."""
    import math

    from engine.decoding.policy import FIXED_POINT, path_probabilities, root_row
    from engine.decoding.tree import ancestor_mask, build_tree_device
    from engine.decoding.tree_kernel import path_probabilities_kernel

    lp, ids = _tie_free_proposals(depth, k, seed=depth * 7 + budget)
    for rows in (lp, lp * 1e-3):  # steep rows (small probabilities) and nearly flat ones (close to 1)
        tree = build_tree_device(rows, ids, torch.tensor([5], device=DEVICE), budget, chain_seed)
        ref = path_probabilities(rows, tree, ancestor_mask(tree.parents, depth), root_row(k, rows.device))
        got = path_probabilities_kernel(rows, tree, math.log(FIXED_POINT))
        assert got.dtype == torch.long and got.shape == ref.shape
        assert int(got[0]) == FIXED_POINT and (got - ref).abs().max().item() <= 1
        assert (got[1:] <= FIXED_POINT).all() and bool((ref[1:] > 0).any())


@pytest.mark.parametrize("depth,k,budget,chain_seed", [(1, 3, 3, None), (5, 2, 9, 2), (7, 4, 22, None),
                                                       (15, 8, 48, 4), (10, 16, 128, 0)])
def test_the_tree_launch_scores_its_nodes_as_path_probabilities_within_one(depth, k, budget, chain_seed):
    """The adaptive policy's estimate from the builder's own launch: the same tree and mask as
    ``build_tree_kernel``, each node's fixed-point path probability within one unit of the tensor-op
    form (float64 sums against float32), the root's exactly FIXED_POINT; the forced chain's nodes
    scored by their log-probs, not by the key that forces them."""
    import math

    from engine.decoding.policy import FIXED_POINT, path_probabilities, root_row
    from engine.decoding.tree import ancestor_mask
    from engine.decoding.tree_kernel import build_scored_tree_kernel, build_tree_kernel

    lp, ids = _tie_free_proposals(depth, k, seed=depth * 11 + budget)
    root = torch.tensor([5], device=DEVICE)
    for rows in (lp, lp * 1e-3):  # steep rows (small probabilities) and nearly flat ones (close to 1)
        tree, mask = build_tree_kernel(rows, ids, root, budget, chain_seed)
        scored, scored_mask, got = build_scored_tree_kernel(rows, ids, root, budget, chain_seed, math.log(FIXED_POINT))
        _assert_same_tree(scored, tree)
        assert torch.equal(scored_mask.cpu(), mask.cpu())
        ref = path_probabilities(rows, tree, ancestor_mask(tree.parents, depth), root_row(k, rows.device))
        assert got.dtype == torch.long and got.shape == ref.shape
        assert int(got[0]) == FIXED_POINT and (got[1:] - ref[1:]).abs().max().item() <= 1
        assert bool((ref[1:] > 0).any())


def test_scored_tree_gives_the_policy_its_estimate_on_every_form(monkeypatch):
    """``loop.scored_tree(path_probs=True)``: the tree kernel's own estimate where it builds the tree (on
    the CPU in Triton's interpreter), the tensor-op form's elsewhere (host-built trees): the same tree,
    probabilities within one."""
    from engine.config import EngineConfig
    from engine.decoding import tree_kernel
    from engine.decoding.loop import UNTIMED, scored_tree

    launched = []
    real = tree_kernel.build_scored_tree_kernel
    monkeypatch.setattr(tree_kernel, "use_tree_kernel", lambda *_a: True)
    monkeypatch.setattr(tree_kernel, "build_scored_tree_kernel", lambda *a: launched.append(1) or real(*a))

    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(7, 50, generator=gen) * 3).to(DEVICE)
    cfg = EngineConfig(verify="ddtree", budget=20, top_k=4)
    root = torch.tensor([9], device=DEVICE)
    tree, mask, top_lp = scored_tree(cfg, logits, root, UNTIMED, 7, host=False)
    kernel = scored_tree(cfg, logits, root, UNTIMED, 7, host=False, path_probs=True)
    host = scored_tree(cfg, logits, root, UNTIMED, 7, host=True, path_probs=True)
    for t, m, p in (kernel, host):
        _assert_same_tree(t, tree)
        assert torch.equal(m.cpu(), mask.cpu()) and p.shape == (tree.tokens.numel(),)
        assert (p[1:].cpu() - kernel[2][1:].cpu()).abs().max().item() <= 1 and p.device == logits.device
    assert top_lp.shape == (7, 4) and launched == [1]  # the kernel's form, once (the host form builds its own)


@pytest.mark.parametrize("depth,k,budget,seed,entries", [(7, 4, 22, 1, 8), (15, 8, 64, 3, 16), (5, 1, 5, 4, 6),
                                                         (1, 2, 2, 5, 1)])
def test_walk_kernel_packs_the_policys_tail_as_the_concatenation_would(depth, k, budget, seed, entries):
    """The adaptive policy's readback: the step's packed result, then the proposal's path probabilities
    1..N and the path's first ``entries`` nodes, from the walk's one launch, equal to the tensor-op form's
    concatenation where the host reads it (the path past AL is not read); a bad ``entries`` is refused."""
    from engine.decoding import tree_kernel

    tree, anc, posterior, seq, start = _walk_case(depth, k, budget, seed)
    t = tree.tokens.numel()
    entries = min(entries, t)
    tail = torch.randint(0, 1 << 16, (t + 3,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    seq_ref, start_ref = seq.clone(), start.clone()
    with fused.using_kernels(False):
        path_ref, al_ref, packed_ref = tree_kernel.walk_and_advance(tree, anc, posterior, start_ref, seq_ref, depth,
                                                                    tail, entries)
    path, al, packed = tree_kernel.walk_and_advance_kernel(tree, posterior, start, seq, depth, tail, entries)
    a = int(al_ref)
    head = 3 + t + tail.numel() - 1
    assert packed.numel() == packed_ref.numel() == head + entries
    assert torch.equal(packed[:head], packed_ref[:head]) and torch.equal(packed[3 + t : head], tail[1:])
    read = min(a, entries)  # the host reads the path's first AL entries
    assert torch.equal(packed[head : head + read], packed_ref[head : head + read])
    assert torch.equal(packed[head : head + read], path[:read]) and torch.equal(start, start_ref)
    with pytest.raises(ValueError, match="entries must be 1.."):
        tree_kernel.walk_and_advance(tree, anc, posterior, start, seq, depth, tail, t + 1)
