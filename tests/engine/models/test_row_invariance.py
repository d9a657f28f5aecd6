"""Row invariance of the per-row kernels a decode step runs (Triton, interpreted on the CPU; compiled
on a GPU): a row's bits do not depend on how many rows share its launch (1: an AR step, 7: a chain or
a draft block, 33: a verify) nor on where it sits among them. With the few-row linear kernel
(``test_linear.py``) and the step attention (``test_attention.py``) this is what lets a verify's
rows round as AR steps do, so that speculative decoding commits AR's tokens in bf16 too."""

from __future__ import annotations

import functools

import pytest
import torch

from engine.models import fused, topk
from engine.models.delta_rule import tree_delta_rule
from tests.engine.models.test_fused import DEVICE, _r, kernels_on  # noqa: F401  (kernels_on: autouse)

pytest.importorskip("triton")

ROWS = 33
# (row indices of a smaller launch): alone at the front and at the back, 7 in a row, 7 scattered
SUBSETS = [[0], [ROWS - 1], list(range(3, 10)), [30, 2, 17, 0, 9, 25, 11]]


def _each_subset(fn, *inputs):
    """fn over all rows, then over each subset of the rows: the subsets' rows must be bit-equal."""
    whole = fn(*inputs)
    whole = whole if isinstance(whole, tuple) else (whole,)
    for rows in SUBSETS:
        got = fn(*(x[rows] for x in inputs))
        got = got if isinstance(got, tuple) else (got,)
        for g, w in zip(got, whole, strict=True):
            assert torch.equal(g, w[rows]), f"rows {rows}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zero_centred", [False, True])
def test_norms(dtype, zero_centred):
    w = _r(576, dtype=dtype, seed=1)
    x, delta, gate = (_r(ROWS, 576, dtype=dtype, seed=s) for s in (2, 3, 4))
    _each_subset(lambda a: fused.rms_norm(a, w, 1e-6, zero_centred), x)
    _each_subset(lambda a, b: fused.add_rms_norm(a, b, w, 1e-6, zero_centred), x, delta)
    _each_subset(lambda a, b: fused.gated_rms_norm(a.float(), b, w, 1e-6), x, gate)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_activation_and_rope(dtype):
    gate, up = _r(ROWS, 1536, dtype=dtype, seed=5), _r(ROWS, 1536, dtype=dtype, seed=6)
    _each_subset(fused.silu_mul, gate, up)
    x = _r(ROWS, 9, 64, dtype=dtype, seed=7)
    angles = torch.rand(ROWS, 32, generator=torch.Generator().manual_seed(8)).to(DEVICE) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    _each_subset(fused.rope, x, cos, sin)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_write_at_any_slot(dtype):
    """Queries rotated and keys written to the cache: a token's bits whichever slot it lands in (a
    tree node at start + i against the AR step at start + depth) and however many tokens write."""
    q, k, v = _r(ROWS, 6, 64, dtype=dtype, seed=9), _r(ROWS, 2, 64, dtype=dtype, seed=10), \
        _r(ROWS, 2, 64, dtype=dtype, seed=11)
    angles = torch.rand(ROWS, 32, generator=torch.Generator().manual_seed(12)).to(DEVICE) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    norms = fused.HeadNorms(_r(64, dtype=dtype, seed=13), _r(64, dtype=dtype, seed=14), 1e-6, True)

    def caches():
        return torch.zeros(100, 2, 64, dtype=dtype, device=DEVICE), torch.zeros(100, 2, 64, dtype=dtype, device=DEVICE)

    kc, vc = caches()
    whole = fused.rope_write(q, k, v, cos, sin, torch.arange(ROWS, device=DEVICE) + 40, kc, vc, norms)
    for rows in SUBSETS:
        kc2, vc2 = caches()
        slots = torch.tensor([60 + 2 * j for j in range(len(rows))], device=DEVICE)
        got = fused.rope_write(q[rows], k[rows], v[rows], cos[rows], sin[rows], slots, kc2, vc2, norms)
        assert torch.equal(got, whole[rows])
        assert torch.equal(kc2[slots], kc[40 + torch.tensor(rows)]) and torch.equal(vc2[slots], v[rows])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_top_k_and_argmax(dtype):
    logits = _r(ROWS, 3000, dtype=dtype, seed=15)
    logits[4, 100] = logits[4, 2000] = logits[4].max() + 1  # an exact tie: the lower index, in any launch
    _each_subset(lambda x: topk.topk_rows(x, 8, 0.7), logits)
    _each_subset(topk.argmax_rows, logits)
    assert int(topk.argmax_rows(logits[[4]])) == 100


def test_a_tree_nodes_recurrence_is_a_chain_tokens():
    """The gated delta rule: node i of a tree gives the output (and, at a leaf, the state) that its
    path run as a chain gives at its last token: an AR step's, step by step."""
    hk, hv, dk, dv = 2, 4, 16, 8
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 5, 6, 8]
    t = len(parents)
    gen = torch.Generator().manual_seed(16)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE)

    q = torch.nn.functional.normalize(rand(t, hk, dk), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(rand(t, hk, dk), dim=-1)
    v, g, beta = rand(t, hv, dv), -rand(t, hv).abs(), rand(t, hv).sigmoid()
    state = rand(hv, dk, dv)
    par = torch.tensor(parents, device=DEVICE)
    rule = functools.partial(tree_delta_rule, backend="triton")  # the kernel (interpreted on the CPU)
    tree_out = rule(q, k, v, g, beta, par, state.clone(), tree=True)
    for i in (0, 4, 9, 10):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path = path[::-1]
        chain_state = state.clone()
        chain = torch.arange(len(path), device=DEVICE) - 1
        out = rule(q[path], k[path], v[path], g[path], beta[path], chain, chain_state)
        assert torch.equal(out[-1], tree_out[i]), f"node {i}"
        # and one token at a time, as AR steps run it
        step_state = state.clone()
        for j in path:
            one = rule(q[[j]], k[[j]], v[[j]], g[[j]], beta[[j]], torch.tensor([-1], device=DEVICE),
                                  step_state)
        assert torch.equal(one[0], tree_out[i]) and torch.equal(step_state, chain_state)
