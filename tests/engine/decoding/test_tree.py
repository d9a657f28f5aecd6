"""Pure tree functions: best-first order, budget, top_k, chain_seed, mask, walk."""

import itertools

import pytest
import torch

from engine.decoding.tree import (
    Tree,
    ancestor_mask,
    build_tree_device,
    build_tree_host,
    chain_tree,
    effective_chain_seed,
    walk_device,
    walk_host,
)


def _proposals(depth: int, k: int, seed: int, vocab: int = 50):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, vocab, generator=gen) * 2
    lp = torch.log_softmax(logits, -1)
    return torch.topk(lp, k, dim=-1)


def _all_prefix_scores(top_lp, depth, k):
    """Brute force: every rank-prefix with its summed log-prob."""
    out = {}
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            out[ranks] = sum(float(top_lp[i, r]) for i, r in enumerate(ranks))
    return out


def _rank_paths(tree: Tree) -> list[tuple[int, ...]]:
    paths = [()]
    for i in range(1, tree.size):
        paths.append(paths[int(tree.parents[i])] + (int(tree.ranks[i]),))
    return paths[1:]


@pytest.mark.parametrize("depth,k,budget", [(4, 3, 10), (5, 2, 7), (3, 4, 30), (6, 1, 4)])
def test_best_first_picks_the_top_budget_prefixes_in_score_order(depth, k, budget):
    top_lp, top_ids = _proposals(depth, k, seed=depth * 10 + k)
    tree = build_tree_host(top_lp, top_ids, root_token=7, budget=budget, chain_seed=0)
    scores = _all_prefix_scores(top_lp, depth, k)
    expected = sorted(scores, key=lambda r: -scores[r])[: min(budget, len(scores))]
    got = _rank_paths(tree)
    assert set(got) == set(expected)
    got_scores = [scores[r] for r in got]
    assert got_scores == sorted(got_scores, reverse=True)  # popped in decreasing score
    assert tree.size - 1 == min(budget, len(scores))


def test_tree_invariants_topological_tokens_depths():
    top_lp, top_ids = _proposals(5, 3, seed=1)
    tree = build_tree_host(top_lp, top_ids, root_token=11, budget=12, chain_seed=None)
    assert int(tree.tokens[0]) == 11 and int(tree.parents[0]) == -1 and int(tree.depths[0]) == 0
    for i in range(1, tree.size):
        p = int(tree.parents[i])
        assert 0 <= p < i
        assert int(tree.depths[i]) == int(tree.depths[p]) + 1
        d, r = int(tree.depths[i]) - 1, int(tree.ranks[i])
        assert int(tree.tokens[i]) == int(top_ids[d, r])
    # siblings carry distinct tokens, which the walk relies on
    for p in set(tree.parents.tolist()):
        kids = [int(tree.tokens[i]) for i in range(tree.size) if int(tree.parents[i]) == p]
        assert len(kids) == len(set(kids))


@pytest.mark.parametrize("chain_seed", [0, 2, 5, None])
def test_chain_seed_inserts_the_top1_chain_first(chain_seed):
    depth, k, budget = 5, 3, 9
    top_lp, top_ids = _proposals(depth, k, seed=3)
    tree = build_tree_host(top_lp, top_ids, 0, budget, chain_seed)
    c = effective_chain_seed(chain_seed, depth, budget)
    paths = _rank_paths(tree)
    assert paths[:c] == [(0,) * d for d in range(1, c + 1)]
    # the rest is best-first among everything else
    scores = _all_prefix_scores(top_lp, depth, k)
    rest = [r for r in sorted(scores, key=lambda r: -scores[r]) if r not in paths[:c]][: budget - c]
    assert set(paths[c:]) == set(rest)


def test_budget_larger_than_the_space_takes_everything_and_budget_one_takes_one():
    top_lp, top_ids = _proposals(2, 2, seed=5)
    assert build_tree_host(top_lp, top_ids, 0, 100, 0).size == 1 + 2 + 4
    assert build_tree_host(top_lp, top_ids, 0, 1, 0).size == 2
    assert build_tree_host(top_lp, top_ids, 0, 1, None).size == 2  # chain clipped to the budget


@pytest.mark.parametrize("depth,k,budget,chain_seed", [(4, 3, 10, 0), (7, 4, 22, None), (5, 8, 40, 2),
                                                       (3, 1, 5, 1), (6, 2, 63, 0)])
def test_device_builder_equals_host_builder(depth, k, budget, chain_seed):
    top_lp, top_ids = _proposals(depth, k, seed=budget)
    host = build_tree_host(top_lp, top_ids, 3, budget, chain_seed)
    dev = build_tree_device(top_lp, top_ids, torch.tensor(3), budget, chain_seed)
    for a, b in zip((host.tokens, host.parents, host.depths, host.ranks),
                    (dev.tokens, dev.parents, dev.depths, dev.ranks), strict=True):
        assert torch.equal(a, b)


def test_ancestor_mask_marks_exactly_ancestors_or_self():
    parents = torch.tensor([-1, 0, 0, 1, 3, 2, 1])
    mask = ancestor_mask(parents, max_depth=4)
    expected = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 3, 4}, 5: {0, 2, 5}, 6: {0, 1, 6}}
    for i, anc in expected.items():
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == anc


def _toy_tree():
    # root(0) -> a(1, tok 5) -> c(3, tok 7) -> d(4, tok 9)
    #         -> b(2, tok 6) -> e(5, tok 8)
    tokens = torch.tensor([1, 5, 6, 7, 9, 8])
    parents = torch.tensor([-1, 0, 0, 1, 3, 2])
    depths = torch.tensor([0, 1, 1, 2, 3, 2])
    ranks = torch.tensor([0, 0, 1, 0, 0, 0])
    return Tree(tokens, parents, depths, ranks)


@pytest.mark.parametrize("posterior,path", [
    ([6, 0, 8, 0, 0, 4], [0, 2, 5]),  # side branch b -> e, then correction 4
    ([5, 7, 0, 9, 3, 0], [0, 1, 3, 4]),  # full depth, bonus 3
    ([2, 0, 0, 0, 0, 0], [0]),  # nothing accepted
    ([5, 8, 0, 0, 0, 0], [0, 1]),  # a accepted, no child matches
])
def test_walk_host_and_device_agree(posterior, path):
    tree = _toy_tree()
    post = torch.tensor(posterior)
    assert walk_host(tree.tokens.tolist(), tree.parents.tolist(), posterior) == path
    order, al = walk_device(tree, ancestor_mask(tree.parents, 3), post)
    assert int(al) == len(path)
    assert order[: len(path)].tolist() == path


def test_chain_tree_is_one_path():
    tree = chain_tree(torch.tensor(4), torch.tensor([9, 8, 7]))
    assert tree.tokens.tolist() == [4, 9, 8, 7]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    mask = ancestor_mask(tree.parents, 3)
    assert torch.equal(mask, torch.ones(4, 4, dtype=torch.bool).tril())



@pytest.mark.parametrize("budget", [3, 15, 40])
def test_ddtree_with_top_k_1_is_the_chain(budget):
    """top_k 1: every builder's tree is the chain of the draft's top-1 tokens, cut at the budget (the
    exactness grid's DDTree k1 rows accept exactly what chain accepts once budget >= the depth)."""
    depth = 15
    top_lp, top_ids = _proposals(depth, 1, seed=7)
    root = torch.tensor(3)
    chain = chain_tree(root, top_ids[:, 0][: min(budget, depth)])
    for tree in (build_tree_host(top_lp, top_ids, int(root), budget, None),
                 build_tree_device(top_lp, top_ids, root, budget, None)):
        for field in ("tokens", "parents", "depths", "ranks"):
            assert getattr(tree, field).tolist() == getattr(chain, field).tolist(), (budget, field)
