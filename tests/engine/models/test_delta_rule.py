"""The tree-aware gated delta rule: Triton kernel (interpreted on the CPU) against the torch loop
and a float64 sequential reference along every node's ancestor path."""

from __future__ import annotations

import pytest
import torch

from engine.models.delta_rule import ancestor_rows, delta_rule_path, delta_step, leaf_paths, tree_delta_rule

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(t: int, hk: int, hv: int, dk: int, dv: int, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    q = torch.nn.functional.normalize(r(t, hk, dk), dim=-1) / dk**0.5
    k = torch.nn.functional.normalize(r(t, hk, dk), dim=-1)
    v, g = r(t, hv, dv), -torch.rand(t, hv, generator=gen) * 2
    beta = torch.rand(t, hv, generator=gen)
    state = 0.5 * r(hv, dk, dv)
    return [x.to(DEVICE) for x in (q, k, v, g, beta, state)]


def _random_tree(t: int, seed: int) -> torch.Tensor:
    """parents[0] = -1 (the root), every other node under an earlier one; a few chains, many branches."""
    gen = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) if i > 1 else 0 for i in range(1, t)]
    return torch.tensor(parents, device=DEVICE)


def _reference(q, k, v, g, beta, parents, state):
    """float64, node by node along each node's own ancestor path (the definition of the tree rule)."""
    rep = v.shape[1] // q.shape[1]
    q, k = q.double().repeat_interleave(rep, 1), k.double().repeat_interleave(rep, 1)
    v, g, beta, state = v.double(), g.double(), beta.double(), state.double()
    states, outs = [], []
    for i, p in enumerate(parents.tolist()):
        s, o = delta_step(state if p < 0 else states[p], q[i], k[i], v[i], g[i], beta[i])
        states.append(s)
        outs.append(o)
    return torch.stack(outs), torch.stack(states)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


SHAPES = [(23, 2, 4, 16, 8), (9, 1, 3, 12, 10), (17, 4, 4, 32, 64)]  # T, HK, HV, DK, DV (odd sizes: masking)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_tree_forward_matches_the_per_path_reference(backend, shape):
    t, hk, hv, dk, dv = shape
    q, k, v, g, beta, state = _inputs(t, hk, hv, dk, dv, seed=t)
    parents = _random_tree(t, seed=t)
    ref_out, _ = _reference(q, k, v, g, beta, parents, state)
    before = state.clone()
    out = tree_delta_rule(q, k, v, g, beta, parents, state, tree=True, backend=backend)
    assert torch.equal(state, before)  # a tree forward leaves the committed state alone
    assert not out.isnan().any() and _rel(out, ref_out) < 1e-5


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("parents", [[-1], [-1, 0], [-1, 0, 0]], ids=["root", "chain2", "two-leaves"])
def test_the_smallest_trees_match_the_reference(backend, parents):
    """Paths of one and two nodes (a root-only tree's one-entry rows): a walk reads its node indices two nodes
    ahead, wrapping to the first past its end."""
    parents = torch.tensor(parents, device=DEVICE)
    q, k, v, g, beta, state = _inputs(parents.numel(), 1, 2, 16, 8, seed=4)
    ref_out, _ = _reference(q, k, v, g, beta, parents, state)
    out = tree_delta_rule(q, k, v, g, beta, parents, state, tree=True, backend=backend)
    assert _rel(out, ref_out) < 1e-5


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chain_forward_advances_the_state_in_place(backend):
    t, hk, hv, dk, dv = 12, 2, 4, 16, 8
    q, k, v, g, beta, state = _inputs(t, hk, hv, dk, dv, seed=3)
    chain = torch.arange(t, device=DEVICE) - 1
    ref_out, ref_states = _reference(q, k, v, g, beta, chain, state)
    out = tree_delta_rule(q, k, v, g, beta, chain, state, backend=backend)
    assert _rel(out, ref_out) < 1e-5 and _rel(state, ref_states[-1]) < 1e-5


def test_kernel_is_bit_identical_for_tree_and_chain_forwards():
    """Exactness of speculative decoding rests on this: a node computes the same bits whether a
    tree forward (states captured) or a committing forward (state in place) runs it."""
    t, hk, hv, dk, dv = 15, 2, 4, 16, 8
    q, k, v, g, beta, state = _inputs(t, hk, hv, dk, dv, seed=5)
    chain = torch.arange(t, device=DEVICE) - 1
    tree_out = tree_delta_rule(q, k, v, g, beta, chain, state, tree=True, backend="triton")
    s = state.clone()
    chain_out = tree_delta_rule(q, k, v, g, beta, chain, s, backend="triton")
    assert torch.equal(tree_out, chain_out)
    # The path commit (a chain over the nodes' recorded inputs, one layer here) lands on the same bits.
    committed = state.clone()[None]
    delta_rule_path(q[None], k[None], v[None], g[None], beta[None], torch.arange(t, device=DEVICE),
                    torch.tensor([t], device=DEVICE), committed, backend="triton")
    assert torch.equal(committed[0], s)
    # One token at a time (AR steps) gives the same bits as the whole chain at once.
    s1 = state.clone()
    step_out = [tree_delta_rule(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1],
                                chain[:1], s1, backend="triton") for i in range(t)]
    assert torch.equal(torch.cat(step_out), chain_out) and torch.equal(s1, s)


def test_torch_and_triton_agree_on_a_real_tree():
    from engine.decoding.tree import build_tree_host

    gen = torch.Generator().manual_seed(0)
    lp, ids = torch.topk(torch.log_softmax(torch.randn(15, 50, generator=gen), -1), 4, dim=-1)
    tree = build_tree_host(lp, ids, 7, 22, 0)
    parents = tree.parents.to(DEVICE)
    t = parents.numel()
    q, k, v, g, beta, state = _inputs(t, 2, 4, 16, 16, seed=9)
    outs = [tree_delta_rule(q, k, v, g, beta, parents, state, tree=True, backend=backend)
            for backend in ("torch", "triton")]
    assert _rel(outs[1], outs[0]) < 1e-5
    # Every node lies on a leaf's path, so every output row was written, and a node on several paths
    # (the root) got the same bits from each: the same as the chain of its own path computes.
    paths = leaf_paths(parents)
    assert int((paths.counts > 0).sum()) > 1
    for leaf in torch.nonzero(paths.counts).flatten().tolist():
        path = paths.index[leaf, : int(paths.counts[leaf])].long()
        chain = tree_delta_rule(q[path], k[path], v[path], g[path], beta[path],
                                torch.arange(len(path), device=DEVICE) - 1, state.clone(), backend="triton")
        assert torch.equal(chain, outs[1][path])


def test_leaf_paths_list_each_leafs_path_root_first():
    #          0   1  2  3  4  5  6  7
    parents = [-1, 0, 1, 0, 3, 1, 5, 0]  # leaves: 2, 4, 6, 7
    paths = leaf_paths(torch.tensor(parents, device=DEVICE))
    assert paths.counts.tolist() == [0, 0, 3, 0, 3, 0, 4, 2]
    rows = {i: paths.index[i, :c].tolist() for i, c in enumerate(paths.counts.tolist()) if c}
    assert rows == {2: [0, 1, 2], 4: [0, 3, 4], 6: [0, 1, 5, 6], 7: [0, 7]}
    chain = leaf_paths(torch.arange(6, device=DEVICE) - 1)  # a chain: one path, the whole of it
    assert chain.counts.tolist() == [0] * 5 + [6] and chain.index[5].tolist() == list(range(6))
    # the tables a decode step's layout brings are the ones made from the parents
    from engine.models.attention import ancestor_table

    ancestors, depths = ancestor_rows(torch.tensor(parents, device=DEVICE))
    assert depths.tolist() == [0, 1, 2, 1, 2, 2, 3, 1]
    mask = torch.zeros(8, 8, dtype=torch.bool, device=DEVICE)
    for i in range(8):
        j = i
        while j >= 0:
            mask[i, j], j = True, parents[j]
    assert torch.equal(ancestor_table(mask, depths, 8), ancestors)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_path_commit_reproduces_each_accepted_nodes_state_bit_for_bit(backend):
    """fast rollback: every layer's state after the accepted path, recomputed from the tree forward's
    inputs, has the bits that forward computed at the path's last node (``path`` padded as the walk
    pads it: entries past ``length`` are ignored)."""
    t, hk, hv, dk, dv, layers = 13, 2, 4, 16, 8, 3
    parents = torch.tensor([-1, 0, 1, 1, 0, 4, 2, 6, 5, 3, 9, 9, 7], device=DEVICE)
    ins = [_inputs(t, hk, hv, dk, dv, seed=20 + layer) for layer in range(layers)]
    q, k, v, g, beta, state = (torch.stack(x) for x in zip(*ins, strict=True))
    # root..node 12 (a path through two branch points), then padding
    path = torch.tensor([0, 1, 2, 6, 7, 12, 3, 4, 5, 8, 9, 10, 11], device=DEVICE)
    for length in range(1, 7):
        committed = state.clone()
        delta_rule_path(q, k, v, g, beta, path, torch.tensor([length], device=DEVICE), committed, backend=backend)
        node = int(path[length - 1])
        for layer in range(layers):
            # the same node by the float64 definition, and through a chain forward of the path's
            # nodes (the kernel a tree forward runs)
            _, ref_states = _reference(q[layer], k[layer], v[layer], g[layer], beta[layer], parents, state[layer])
            assert _rel(committed[layer], ref_states[node]) < 1e-5
            idx = path[:length]
            chain_state = state[layer].clone()
            tree_delta_rule(q[layer][idx], k[layer][idx], v[layer][idx], g[layer][idx], beta[layer][idx],
                            torch.arange(length, device=DEVICE) - 1, chain_state, backend=backend)
            assert torch.equal(committed[layer], chain_state)
            # The tree forward computed that node's output from the same state: its bits are the
            # path chain's (the output is the state's only trace a tree forward leaves).
            chain_out = tree_delta_rule(q[layer][idx], k[layer][idx], v[layer][idx], g[layer][idx],
                                        beta[layer][idx], torch.arange(length, device=DEVICE) - 1,
                                        state[layer].clone(), backend=backend)
            tree_out = tree_delta_rule(q[layer], k[layer], v[layer], g[layer], beta[layer], parents, state[layer],
                                       tree=True, backend=backend)
            assert torch.equal(tree_out[node], chain_out[-1])


def test_bad_shapes_and_backend_are_refused():
    q, k, v, g, beta, state = _inputs(4, 2, 4, 8, 8, seed=1)
    parents = torch.arange(4, device=DEVICE) - 1
    with pytest.raises(ValueError, match="backend must be one of"):
        tree_delta_rule(q, k, v, g, beta, parents, state, backend="cuda")
    with pytest.raises(ValueError, match="shapes do not match"):
        tree_delta_rule(q, k, v[:, :3], g, beta, parents, state)
    with pytest.raises(ValueError, match="shapes do not match"):  # a bad beta alone is caught too
        tree_delta_rule(q, k, v, g, beta[:, :3], parents, state)
    with pytest.raises(ValueError, match="shapes do not match"):  # parents for another tree
        tree_delta_rule(q, k, v, g, beta, parents[:3], state, tree=True)
    bad = leaf_paths(parents[:3])
    with pytest.raises(ValueError, match=r"paths must hold \[4, W\] rows"):
        tree_delta_rule(q, k, v, g, beta, parents, state, tree=True, paths=bad)
    with pytest.raises(ValueError, match="shapes do not match"):  # the path commit: one layer too few states
        delta_rule_path(q[None], k[None], v[None], g[None], beta[None], parents, torch.tensor([1]),
                        state[None].expand(2, -1, -1, -1))
