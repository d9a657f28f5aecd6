"""The split attention for few query rows (Triton, interpreted on the CPU) against SDPA: rows that
do not depend on their batch or on masked padding, the key spans, Qwen3.5's output gate."""

from __future__ import annotations

import pytest
import torch

from engine.models import attention as split_attention
from engine.models import fused
from tests.engine.models.test_fused import DEVICE, DTYPES, TOL, _r, _rel, kernels_on  # noqa: F401  (kernels_on: autouse)

pytest.importorskip("triton")


def _attn_inputs(t, s, hq, hkv, d, dtype, seed=0):
    q, k, v = _r(t, hq, d, dtype=dtype, seed=seed), _r(s, hkv, d, dtype=dtype, seed=seed + 1), \
        _r(s, hkv, d, dtype=dtype, seed=seed + 2)
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(t, s, generator=gen) < 0.6
    mask[torch.arange(t), torch.randint(0, s, (t,), generator=gen)] = True  # every row sees something
    return q, k, v, mask.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,s,hq,hkv,d", [(1, 130, 4, 2, 64), (5, 10, 9, 3, 64), (33, 300, 8, 8, 16),
                                          (16, 70, 6, 2, 24),
                                          (65, 200, 6, 1, 256)])  # Qwen3.5-27B-like heads, a budget-64 verify
def test_small_query_attention(dtype, t, s, hq, hkv, d):
    q, k, v, mask = _attn_inputs(t, s, hq, hkv, d, dtype)
    got = split_attention.attention(q, k, v, mask)
    want = split_attention.attention_torch(q.float(), k.float(), v.float(), mask)
    assert got.shape == q.shape and got.dtype == dtype
    assert _rel(got, want) < {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_query_attention_rows_do_not_depend_on_their_batch_or_on_masked_padding(dtype):
    """A row gives the same bits alone or among others (33 tokens x 4 heads: many programs), and
    with masked key slots appended (the runtime's key-span buckets): tree verify rows and AR steps
    round alike."""
    t = 33
    q, k, v, mask = _attn_inputs(t, 90, 8, 2, 32, dtype, seed=4)
    whole = split_attention.attention(q, k, v, mask)
    for i in (0, 5, t - 1):
        alone = split_attention.attention(q[i : i + 1], k, v, mask[i : i + 1])
        if DEVICE == "cuda":
            assert torch.equal(alone, whole[i : i + 1])
        else:  # the interpreter's dot is NumPy's matmul, whose rounding depends on the matrix shape
            assert _rel(alone, whole[i : i + 1]) < (1e-6 if dtype == torch.float32 else 2e-2)
    if dtype != torch.float32:
        return
    pad = 200 - 90
    k2, v2 = torch.cat([k, _r(pad, 2, 32, seed=9)]), torch.cat([v, _r(pad, 2, 32, seed=10)])
    mask2 = torch.cat([mask, torch.zeros(t, pad, dtype=torch.bool, device=DEVICE)], dim=1)
    assert torch.equal(split_attention.attention(q, k2, v2, mask2), whole)


def test_split_attention_spans():
    """Keys split into spans of 128 at fixed positions, merged in order: a long context (36 spans)
    and a one-key-visible row come out as the PyTorch form's, and masked slots appended past 4,096
    keys (an AR step's key span against a verify's) change no bit."""
    q, k, v, mask = _attn_inputs(2, 4500, 4, 2, 16, torch.float32, seed=7)
    mask[1] = False
    mask[1, 4321] = True  # one visible key, in the last span but one
    got = split_attention.attention(q, k, v, mask)
    assert _rel(got, split_attention.attention_torch(q, k, v, mask)) < 1e-5
    assert torch.allclose(got[1], v[4321].repeat_interleave(2, dim=0), atol=1e-6)
    pad = 4700 - 4500
    k2, v2 = torch.cat([k, _r(pad, 2, 16, seed=11)]), torch.cat([v, _r(pad, 2, 16, seed=12)])
    mask2 = torch.cat([mask, torch.zeros(2, pad, dtype=torch.bool, device=DEVICE)], dim=1)
    assert torch.equal(split_attention.attention(q, k2, v2, mask2), got)


def test_attention_with_strided_cache_views_and_large_queries():
    """K/V as slices of a [layers, slots, heads, D] cache; more rows than SMALL_QUERIES take SDPA."""
    cache = _r(2, 256, 2, 16, seed=3)
    q, _, _, mask = _attn_inputs(3, 100, 4, 2, 16, torch.float32, seed=2)
    got = split_attention.attention(q, cache[1, :100], cache[0, :100], mask)
    assert _rel(got, split_attention.attention_torch(q, cache[1, :100], cache[0, :100], mask)) < 1e-5
    big_q, k, v, big_mask = _attn_inputs(split_attention.SMALL_QUERIES + 1, 80, 4, 2, 16, torch.float32, seed=5)
    assert torch.equal(split_attention.attention(big_q, k, v, big_mask),
                       split_attention.attention_torch(big_q, k, v, big_mask))


def _model_gate(*lead, hq, d, dtype, seed):
    """The gate as Qwen3.5's GatedAttention takes it: the second half of each head of the fused
    query projection's output, [..., T, HQ, D] with head stride 2 * D."""
    q_gate = 3 * _r(*lead, hq, 2 * d, dtype=dtype, seed=seed)  # wide enough to reach sigmoid's tails
    gate = q_gate.chunk(2, dim=-1)[1]
    assert gate.stride()[-3:] == (hq * 2 * d, 2 * d, 1)
    return gate


def _assert_gate_bits(got, want, dtype):
    if dtype != torch.float32 or DEVICE == "cuda":
        assert torch.equal(got, want)
    else:  # the interpreter's exp is NumPy's, PyTorch's CPU sigmoid Sleef's: a few float32 ulps apart
        assert torch.allclose(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 5])  # an AR step, a small verify
def test_gated_attention_equals_the_eager_gate(dtype, t):
    """The gate applied in the merge kernel gives the bits of ``attention(...) * sigmoid(gate)``
    (the sigmoid rounded to the dtype, then the product): GQA groups of 3, two key spans."""
    q, k, v, mask = _attn_inputs(t, 140, 6, 2, 24, dtype, seed=13)
    gate = _model_gate(t, hq=6, d=24, dtype=dtype, seed=14)
    got = split_attention.attention(q, k, v, mask, gate=gate)
    assert got.shape == q.shape and got.dtype == dtype
    _assert_gate_bits(got, split_attention.attention(q, k, v, mask) * torch.sigmoid(gate), dtype)
    # a contiguous gate (its copy) gives the same bits as the strided view
    assert torch.equal(split_attention.attention(q, k, v, mask, gate=gate.contiguous()), got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batched_gated_attention_equals_the_eager_gate(dtype):
    """[B, T, H, D] queries with a strided [B, T, H, D] gate: each sequence its own gate rows."""
    b, t, s_len, hq, hkv, d = 3, 2, 50, 4, 2, 16
    q = _r(b, t, hq, d, dtype=dtype)
    k, v = _r(b, s_len, hkv, d, dtype=dtype, seed=1), _r(b, s_len, hkv, d, dtype=dtype, seed=2)
    mask = (torch.rand(b, t, s_len, generator=torch.Generator().manual_seed(3)) < 0.7).to(DEVICE)
    mask[:, :, -1] = True
    gate = _model_gate(b, t, hq=hq, d=d, dtype=dtype, seed=4)
    got = split_attention.attention(q, k, v, mask, gate=gate)
    _assert_gate_bits(got, split_attention.attention(q, k, v, mask) * torch.sigmoid(gate), dtype)
    for i in range(b):  # as each sequence's own unbatched call
        assert torch.equal(got[i], split_attention.attention(q[i], k[i], v[i], mask[i], gate=gate[i]))


def test_gated_attention_on_the_sdpa_path_applies_the_eager_ops():
    """SDPA (no mask, or more query rows than SMALL_QUERIES) and autograd take the eager ops."""
    big_q, k, v, big_mask = _attn_inputs(split_attention.SMALL_QUERIES + 1, 80, 4, 2, 16, torch.bfloat16, seed=5)
    gate = _model_gate(split_attention.SMALL_QUERIES + 1, hq=4, d=16, dtype=torch.bfloat16, seed=6)
    for mask in (big_mask, None):
        want = split_attention.attention_torch(big_q, k, v, mask) * torch.sigmoid(gate)
        assert torch.equal(split_attention.attention(big_q, k, v, mask, gate=gate), want)
    q, k, v, mask = _attn_inputs(3, 40, 4, 2, 16, torch.float32, seed=7)
    gate = _model_gate(3, hq=4, d=16, dtype=torch.float32, seed=8).detach().requires_grad_()
    out = split_attention.attention(q, k, v, mask, gate=gate)  # the kernels have no backward: the eager ops run
    assert torch.equal(out, split_attention.attention_torch(q, k, v, mask) * torch.sigmoid(gate))
    out.sum().backward()
    assert gate.grad is not None and gate.grad.shape == gate.shape


def test_gated_attention_refuses_a_gate_unlike_the_queries():
    q, k, v, mask = _attn_inputs(2, 20, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="gate must have the queries' shape"):
        split_attention.attention(q, k, v, mask, gate=_r(2, 4, 8))
    with pytest.raises(ValueError, match="dtype"):
        split_attention.attention(q, k, v, mask, gate=_r(2, 4, 16, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_batched_small_query_attention_over_a_padded_cache(dtype):
    """Many sequences decoding at once (self-distillation): [B, T, H, D] queries over strided views
    of a [B, slots, Hkv, D] cache, one mask per sequence (left padding) or one shared mask."""
    b, t, s_len, hq, hkv, d = 3, 2, 50, 6, 2, 32
    q = _r(b, t, hq, d, dtype=dtype)
    cache_k, cache_v = _r(b, 64, hkv, d, dtype=dtype, seed=1), _r(b, 64, hkv, d, dtype=dtype, seed=2)
    k, v = cache_k[:, :s_len], cache_v[:, :s_len]
    mask = torch.rand(b, t, s_len, generator=torch.Generator().manual_seed(3)) < 0.7
    mask[:, :, -1] = True
    mask = mask.to(DEVICE)
    got = split_attention.attention(q, k, v, mask)
    want = split_attention.attention_torch(q.float(), k.float(), v.float(), mask)
    assert got.shape == q.shape and _rel(got, want) < {torch.float32: 1e-5, torch.float16: 5e-3}[dtype]
    for i in range(b):  # each sequence alone: as its own unbatched call
        assert _rel(got[i], split_attention.attention(q[i], k[i], v[i], mask[i])) < 1e-6
    shared = split_attention.attention(q, k, v, mask[0])
    assert _rel(shared, split_attention.attention_torch(q.float(), k.float(), v.float(), mask[0])) < 5e-3


def test_batched_decode_uses_the_fused_attention_and_matches_sdpa():
    """forward_padded (batched greedy generation for draft training): one decode step through the
    fused path equals the memory-efficient SDPA path it replaces."""
    from engine.models.dense import _grouped_attention

    b, t, s_len, hq, hkv, d = 2, 1, 40, 6, 2, 16
    q, k, v = _r(b, t, hq, d), _r(b, s_len, hkv, d, seed=1), _r(b, s_len, hkv, d, seed=2)
    mask = torch.ones(b, t, s_len, dtype=torch.bool, device=DEVICE)
    mask[0, :, :7] = False  # sequence 0 is left-padded
    fused_out = _grouped_attention(q, k, v, mask)
    fused.set_kernels(False)
    try:
        sdpa_out = _grouped_attention(q, k, v, mask)
    finally:
        fused.set_kernels(True)
    assert fused_out.shape == sdpa_out.shape == (b, t, hq * d) and _rel(fused_out, sdpa_out) < 1e-5


# ------------------------------------------------------------------ decode steps (step_attention)

# A tree of 33 nodes (parents before children, as the DDTree builder orders them): depths up to 6.
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 5, 6, 7, 7, 8, 9, 10, 11, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                21, 3, 3, 28, 29, 30]


def _tree(parents):
    t = len(parents)
    depths, mask = torch.zeros(t, dtype=torch.int32), torch.eye(t, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            depths[i] = depths[p] + 1
            mask[i] |= mask[p]
    return depths.to(DEVICE), mask.to(DEVICE)


def _path(parents, i):
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def _step_inputs(parents, start, slots, hq, hkv, d, dtype, seed):
    """A verify's queries and a cache of ``slots``: committed keys below ``start``, node i's at start + i."""
    t = len(parents)
    q = _r(t, hq, d, dtype=dtype, seed=seed)
    k, v = _r(slots, hkv, d, dtype=dtype, seed=seed + 1), _r(slots, hkv, d, dtype=dtype, seed=seed + 2)
    depths, mask = _tree(parents)
    width = int(depths.max()) + 1
    keys = split_attention.StepKeys(torch.tensor([start], device=DEVICE), depths,
                                    split_attention.ancestor_table(mask, depths, width), start + t)
    return q, k, v, keys


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True])
def test_step_attention_matches_the_mask_form(dtype, gated):
    """A tree verify over a committed prefix spanning several key spans: the kernel against the
    PyTorch form (SDPA over the mask of committed keys and ancestors)."""
    q, k, v, keys = _step_inputs(TREE_PARENTS, 200, 300, 8, 2, 32, dtype, seed=3)
    gate = _r(*q.shape, dtype=dtype, seed=8) if gated else None
    got = split_attention.step_attention(q, k, v, keys, gate=gate)
    want = split_attention.step_attention_torch(q.float(), k.float(), v.float(), keys,
                                                gate=None if gate is None else gate.float())
    assert got.shape == q.shape and got.dtype == dtype
    assert _rel(got, want) < {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]


@pytest.mark.parametrize("gated,spans_before", [(False, "none"), (True, "none"), (True, "one run")])
def test_a_step_neither_writes_nor_merges_the_spans_past_its_new_tokens(monkeypatch, gated, spans_before):
    """A verify whose key span runs far past its tokens (a captured step's bucket): the spans past the last one a
    new token reaches hold no key any row sees, so the step kernel writes no partial there and the merge reads
    none (their buffers left NaN change no bit), while every span up to it is written; the output has the bits
    of the same call over buffers that held zeros, and of the verify over a key span ending at its last token.
    With a whole run of FOLD_SPANS committed spans before start ("one run"), the verify's programs fold it
    themselves: its first span's place holds the run's partial, the others are neither written nor read."""
    monkeypatch.setattr(split_attention, "FOLD_FROM_SMS", 0.0)  # a verify folds every whole run it can
    split, fold = _spans(torch.bfloat16)
    spans_before = {"none": 2, "one run": fold + 1}[spans_before]
    start, slots, t = spans_before * split + 5, 3 * (fold + 1) * split, len(TREE_PARENTS)
    q, k, v, keys = _step_inputs(TREE_PARENTS, start, slots, 8, 2, 32, torch.bfloat16, seed=6)
    keys = split_attention.StepKeys(keys.start, keys.depths, keys.ancestors, slots)  # the tokens in 2 of 3 (FOLD + 1)
    gate = _r(*q.shape, dtype=torch.bfloat16, seed=7) if gated else None
    live = start // split + -(-(t - 1) // split) + 1
    made, empty = [], torch.empty

    def partials(*shape, fill, **kwargs):
        out = empty(*shape, **kwargs)
        if len(shape) == 5 and kwargs.get("dtype") == torch.float32:  # the spans' partials [1, spans, T, HQ, *]
            made.append(out.fill_(fill))
        return out

    outs = []
    for fill in (0.0, float("nan")):
        monkeypatch.setattr(torch, "empty", lambda *shape, fill=fill, **kw: partials(*shape, fill=fill, **kw))
        outs.append(split_attention.step_attention(q, k, v, keys, gate=gate))
        monkeypatch.setattr(torch, "empty", empty)
    acc, m_l = made[2:]
    assert acc.shape[1] == 3 * (fold + 1) and live < acc.shape[1]
    assert acc[:, live:].isnan().all() and m_l[:, live:].isnan().all()
    runs = spans_before // fold if fold > 1 else 0  # runs wholly before start's span: folded by the step kernel
    unread = [sp for sp in range(runs * fold) if sp % fold]
    assert runs == (spans_before > fold > 1)
    for sp in range(live):
        assert acc[:, sp].isnan().all() == (sp in unread) and m_l[:, sp].isnan().all() == (sp in unread), sp
        assert sp in unread or not (acc[:, sp].isnan().any() or m_l[:, sp].isnan().any()), sp
    assert not outs[1].isnan().any() and torch.equal(outs[1], outs[0])
    # and the bits of the same verify over a key span that ends at its last token (every span live there)
    own = split_attention.StepKeys(keys.start, keys.depths, keys.ancestors, start + t)
    assert torch.equal(outs[0], split_attention.step_attention(q, k, v, own, gate=gate))


def _spans(dtype: torch.dtype, d: int = 32) -> tuple[int, int]:
    """(SPLIT, FOLD) of the step kernel at head_dim d in dtype."""
    launch = split_attention.step_attention_launch(d, dtype == torch.float32)
    return launch["SPLIT"], launch["FOLD"]


def _past_runs(dtype: torch.dtype, d: int = 32, extra: int = 7) -> int:
    """A start with a whole run of FOLD spans before start's span, ``extra`` keys into the span after it."""
    split, fold = _spans(dtype, d)
    return (fold + 1) * split + extra


@pytest.mark.slow
@pytest.mark.parametrize("dtype,hq,hkv,d,start", [
    *((dtype, 8, 2, 32, 150) for dtype in DTYPES),
    (torch.bfloat16, 6, 1, 64, 150),
    (torch.bfloat16, 20, 1, 16, 150),  # a token's 20 heads in two row blocks (ATTN_BLOCK_M 16)
    (torch.bfloat16, 8, 2, 32, 2 * _spans(torch.bfloat16)[0] - 3),  # across a span's end
    # a run of FOLD spans wholly before start: the verify's programs fold it, an AR step's merge does
    *((dtype, 8, 2, 32, _past_runs(dtype)) for dtype in DTYPES),
    (torch.bfloat16, 9, 3, 64, _past_runs(torch.bfloat16, 64)),  # SmolLM2's heads
    # start on a span's first key, the run before it whole: the fold's limit (s_lo + FOLD == start's span)
    (torch.bfloat16, 8, 2, 32, _spans(torch.bfloat16)[0] * _spans(torch.bfloat16)[1]),
    (torch.bfloat16, 8, 2, 32, _spans(torch.bfloat16)[0] * _spans(torch.bfloat16)[1] + 1),
    # the shapes the engine runs: the 8B's and the 27B's heads (the GPU only: minutes in the interpreter)
    pytest.param(torch.bfloat16, 32, 8, 128, _past_runs(torch.bfloat16, 128), marks=pytest.mark.skipif(
        DEVICE != "cuda", reason="the 8B shape's heads: on the GPU")),
    pytest.param(torch.bfloat16, 24, 4, 256, _past_runs(torch.bfloat16, 256), marks=pytest.mark.skipif(
        DEVICE != "cuda", reason="the 27B shape's heads: on the GPU")),
])
@pytest.mark.parametrize("fold_from_sms", [0.0, float("inf")], ids=["folded", "unfolded"])
def test_a_tree_node_has_the_bits_of_an_ar_step_at_its_position(monkeypatch, dtype, hq, hkv, d, start, fold_from_sms):
    """Row invariance of the attention: node i of a verify at depth d gives the bits an AR step gives
    at position start + d over the same keys (its ancestors committed at start..start+d), whatever
    the verify's size (1, 7 or 33 nodes), the node's slot among them, and the key span (the AR step's
    bucket against the verify's). Queries past the first span's end: committed blocks shared by every
    row of a program, tree blocks gathered per token. A verify's programs folding the runs of committed
    spans themselves (``FOLD_FROM_SMS`` 0) or leaving them to the merge (inf) give the same bits."""
    split, fold = _spans(dtype, d)
    if fold_from_sms and start // split < fold:
        pytest.skip("no whole run before start's span: the two cases are one")
    monkeypatch.setattr(split_attention, "FOLD_FROM_SMS", fold_from_sms)
    slots = max(400, start + 64)
    q, k, v, keys = _step_inputs(TREE_PARENTS, start, slots, hq, hkv, d, dtype, seed=11)
    full = split_attention.step_attention(q, k, v, keys)
    sub_parents = TREE_PARENTS[:7]
    _, _, _, sub_keys = _step_inputs(sub_parents, start, slots, hq, hkv, d, dtype, seed=11)
    sub = split_attention.step_attention(q[:7], k, v, sub_keys)
    assert torch.equal(sub, full[:7])
    # Nodes at the root, mid-tree and the last slot, each against AR steps of a different key span
    # (the AR step's own, a bucket past it, the whole cache; the tree is 6 deep). Each launch runs in
    # Triton's interpreter on a CPU: a few well-chosen ones, not every pair.
    for i, spans in ((0, ("own", "all")), (6, ("bucket",)), (13, ("own",)), (27, ("bucket",)), (32, ("all",))):
        path = _path(TREE_PARENTS, i)
        depth = len(path) - 1
        # the AR step at start + depth: the path committed in order, nothing else past it
        k_ar, v_ar = k.clone(), v.clone()
        k_ar[start : start + depth + 1], v_ar[start : start + depth + 1] = k[start + torch.tensor(path)], \
            v[start + torch.tensor(path)]
        pos = torch.tensor([start + depth], device=DEVICE)
        for span in spans:
            key_len = {"own": start + depth + 1, "bucket": start + 40, "all": slots}[span]
            ar = split_attention.step_attention(q[i : i + 1], k_ar, v_ar, split_attention.chain_keys(pos, 1, key_len))
            assert torch.equal(ar, full[i : i + 1]), f"node {i} (depth {depth}), key span {key_len}"


def test_a_chain_is_the_tree_of_one_path():
    """``chain_keys``: token i at depth i, its ancestors the tokens before it; the same bits as the
    tree layout of a path (a chain verify, a replay) and as one AR step per token."""
    t, start = 7, 130
    parents = [-1, 0, 1, 2, 3, 4, 5]
    q, k, v, keys = _step_inputs(parents, start, 200, 4, 2, 32, torch.bfloat16, seed=5)
    chain = split_attention.chain_keys(torch.tensor([start], device=DEVICE), t, start + t)
    assert chain.depths.tolist() == list(range(t)) and chain.ancestors[t - 1].tolist() == list(range(t))
    got = split_attention.step_attention(q, k, v, chain)
    assert torch.equal(got, split_attention.step_attention(q, k, v, keys))
    for i in range(t):
        one = split_attention.chain_keys(torch.tensor([start + i], device=DEVICE), 1, 256)
        assert torch.equal(split_attention.step_attention(q[i : i + 1], k, v, one), got[i : i + 1])


def test_ancestor_table_lists_each_nodes_path_by_depth():
    depths, mask = _tree(TREE_PARENTS)
    table = split_attention.ancestor_table(mask, depths, 7)
    for i in (0, 9, 32):
        path = _path(TREE_PARENTS, i)
        assert table[i, : len(path)].tolist() == path


@pytest.mark.parametrize("d", [16, 32, 48, 64, 80, 128, 256])
@pytest.mark.parametrize("fp32", [False, True])
def test_the_plan_s_step_split_is_the_kernel_s(d, fp32):
    pytest.importorskip("triton")
    assert split_attention.step_split(d, fp32) == split_attention.step_attention_launch(d, fp32)["SPLIT"]
