"""Fused row-wise kernels (Triton, interpreted on the CPU) against their PyTorch forms; a row's
result must not depend on the batch of rows it is computed in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.models import fused

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# bf16: a few ulps (Triton's interpreter converts float32 to bf16 by truncation, the GPU rounds)
TOL = {torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def kernels_on(monkeypatch):
    """Off CUDA the dispatchers take the PyTorch forms: here the kernels run (interpreted) anyway.
    On a GPU the real dispatch stays: a CPU tensor there must take the PyTorch form."""
    if DEVICE == "cuda":
        return
    monkeypatch.setattr(fused, "use_kernels", lambda *t: fused.kernels_enabled() and not (
        torch.is_grad_enabled() and any(x.requires_grad for x in t)))


def _r(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _rows_invariant(fn, x, *rest):
    """fn over all rows at once equals fn row by row, bit for bit."""
    whole = fn(x, *rest)
    single = torch.cat([fn(x[i : i + 1], *(r[i : i + 1] if r.shape[:1] == x.shape[:1] else r for r in rest))
                        for i in range(x.shape[0])])
    assert torch.equal(whole, single)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centred", [False, True])
@pytest.mark.parametrize("d", [64, 576, 100])
def test_rms_norm(dtype, zero_centred, d):
    x, w = _r(7, d, dtype=dtype), 0.1 * _r(d, dtype=dtype, seed=1)
    got = fused.rms_norm(x, w, 1e-6, zero_centred)
    assert got.dtype == dtype and got.shape == x.shape
    assert _rel(got, fused.rms_norm_torch(x, w, 1e-6, zero_centred)) < TOL[dtype]
    _rows_invariant(lambda a: fused.rms_norm(a, w, 1e-6, zero_centred), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm(dtype):
    x, g, w = _r(5, 3, 16, dtype=dtype), _r(5, 3, 16, dtype=dtype, seed=2), 1 + 0.1 * _r(16, dtype=dtype, seed=3)
    got = fused.gated_rms_norm(x, g, w, 1e-6)
    assert got.shape == x.shape and _rel(got, fused.gated_rms_norm_torch(x, g, w, 1e-6)) < TOL[dtype]
    _rows_invariant(lambda a, b: fused.gated_rms_norm(a, b, w, 1e-6), x, g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centred", [False, True])
def test_add_rms_norm(dtype, zero_centred):
    """The fused residual add gives the add's sum and the norm of that sum (the rounded value)."""
    x, delta, w = _r(7, 576, dtype=dtype), _r(7, 576, dtype=dtype, seed=1), 0.1 * _r(576, dtype=dtype, seed=2)
    total, normed = fused.add_rms_norm(x, delta, w, 1e-6, zero_centred)
    want_total, want_norm = fused.add_rms_norm_torch(x, delta, w, 1e-6, zero_centred)
    assert total.dtype == normed.dtype == dtype and total.shape == normed.shape == x.shape
    if dtype == torch.float32 or DEVICE == "cuda":  # the interpreter rounds to half precision by truncation
        assert torch.equal(total, want_total)
        assert torch.equal(normed, fused.rms_norm(total, w, 1e-6, zero_centred))  # normalised from the sum
    assert _rel(total, want_total) < TOL[dtype] and _rel(normed, want_norm) < TOL[dtype]
    _rows_invariant(lambda a, b: torch.cat(fused.add_rms_norm(a, b, w, 1e-6, zero_centred), -1), x, delta)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_rounds_a_float32_input_to_the_gate_dtype(dtype):
    """The delta rule's float32 output goes in as is: the same as rounding it to the model's dtype first."""
    x, g, w = _r(5, 3, 16), _r(5, 3, 16, dtype=dtype, seed=2), 1 + 0.1 * _r(16, dtype=dtype, seed=3)
    got = fused.gated_rms_norm(x, g, w, 1e-6)
    assert got.dtype == dtype
    if dtype == torch.float32 or DEVICE == "cuda":  # the interpreter rounds to half precision by truncation
        assert torch.equal(got, fused.gated_rms_norm(x.to(dtype), g, w, 1e-6))
    assert _rel(got, fused.gated_rms_norm_torch(x, g, w, 1e-6)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    g, u = _r(6, 200, dtype=dtype), _r(6, 200, dtype=dtype, seed=1)
    got = fused.silu_mul(g, u)
    assert _rel(got, fused.silu_mul_torch(g.float(), u.float())) < TOL[dtype]
    _rows_invariant(fused.silu_mul, g, u)
    # the two halves of one fused gate-up product (strided rows) give the same bits as copies
    gate, up = torch.cat([g, u], dim=1).split(200, dim=1)
    assert not gate.is_contiguous() and torch.equal(fused.silu_mul(gate, up), got)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,rd", [(64, 64), (32, 8), (24, 12)])  # full, partial (Qwen3.5: a quarter), odd
def test_rope(dtype, d, rd):
    from engine.models.common import rope_cos_sin, rope_inv_freq

    x = _r(5, 3, d, dtype=dtype)
    cos, sin = rope_cos_sin(torch.arange(7, 12, device=DEVICE), rope_inv_freq(rd, 10000.0), dtype)
    got = fused.rope(x, cos, sin)
    assert got.shape == x.shape
    assert _rel(got, fused.rope_torch(x.float(), cos.float(), sin.float())) < TOL[dtype]
    assert torch.equal(got[..., rd:], x[..., rd:])  # the unrotated tail passes through untouched
    _rows_invariant(fused.rope, x, cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,rd", [(64, 64), (32, 8)])
def test_rope_write_rotates_and_writes_the_cache_slots_as_rope_and_index_copy(dtype, d, rd):
    """One launch: the rotated queries, and the rotated keys and the values at their slots, from
    strided views of one fused projection, with the bits of ``rope`` and ``index_copy_``."""
    from engine.models.common import rope_cos_sin, rope_inv_freq

    t, hq, hkv, s = 5, 3, 2, 12
    qkv = _r(t, (hq + 2 * hkv) * d, dtype=dtype)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=1))
    assert not q.is_contiguous()
    cos, sin = rope_cos_sin(torch.arange(7, 7 + t, device=DEVICE), rope_inv_freq(rd, 10000.0), dtype)
    slots = torch.tensor([9, 2, 4, 3, 11], device=DEVICE)
    kc, vc = _r(s, hkv, d, dtype=dtype, seed=5), _r(s, hkv, d, dtype=dtype, seed=6)
    want_k, want_v = kc.clone(), vc.clone()
    want_k.index_copy_(0, slots, fused.rope(k, cos, sin))
    want_v.index_copy_(0, slots, v)
    got = fused.rope_write(q, k, v, cos, sin, slots, kc, vc)
    assert got.shape == (t, hq, d) and got.is_contiguous()
    assert torch.equal(got, fused.rope(q, cos, sin))
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)  # the other slots untouched
    assert _rel(got, fused.rope_torch(q.float(), cos.float(), sin.float())) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,rd,zero_centred", [(64, 64, False), (32, 8, True), (24, 12, False)])
def test_rope_write_with_head_norms_equals_rms_norm_then_rope(dtype, d, rd, zero_centred):
    """The query and key heads' RMSNorms in the same launch: the bits of ``rms_norm`` then ``rope``
    (Qwen3's plain and Qwen3.5's zero-centred weights; a partial and an odd-width rotation)."""
    from engine.models.common import rope_cos_sin, rope_inv_freq

    t, hq, hkv, s = 4, 3, 1, 9
    qkv = _r(t, (hq + 2 * hkv) * d, dtype=dtype, seed=1) * 3
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=1))
    norms = fused.HeadNorms(_r(d, dtype=dtype, seed=2), _r(d, dtype=dtype, seed=3), 1e-6, zero_centred)
    cos, sin = rope_cos_sin(torch.arange(3, 3 + t, device=DEVICE), rope_inv_freq(rd, 10000.0), dtype)
    slots = torch.tensor([8, 0, 5, 1], device=DEVICE)
    kc, vc = torch.zeros(s, hkv, d, device=DEVICE, dtype=dtype), torch.zeros(s, hkv, d, device=DEVICE, dtype=dtype)
    got = fused.rope_write(q, k, v, cos, sin, slots, kc, vc, norms)
    qn, kn = norms.apply(q, k)
    assert torch.equal(got, fused.rope(qn, cos, sin))
    assert torch.equal(kc[slots], fused.rope(kn, cos, sin)) and torch.equal(vc[slots], v)
    assert not kc[[2, 3, 4, 6, 7]].any()  # the other slots untouched
    ref_q = fused.rope_torch(fused.rms_norm_torch(q.float(), norms.q_weight.float(), 1e-6, zero_centred),
                             cos.float(), sin.float())
    assert _rel(got, ref_q) < TOL[dtype]
    with fused.using_kernels(False):  # the eager path applies the same norms
        kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
        eager = fused.rope_write(q, k, v, cos, sin, slots, kc2, vc2, norms)
    assert _rel(eager, ref_q) < TOL[dtype] and _rel(kc2, kc) < TOL[dtype]


def test_autograd_takes_the_pytorch_forms():
    """The kernels have no backward: with a gradient needed, the eager forms run (draft training)."""
    w = torch.ones(8, device=DEVICE, requires_grad=True)
    x = _r(3, 8)
    y = fused.rms_norm(x, w, 1e-6)
    y.sum().backward()
    assert w.grad is not None and w.grad.shape == (8,)


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
    got = fused.attention(q, k, v, mask)
    want = fused.attention_torch(q.float(), k.float(), v.float(), mask)
    assert got.shape == q.shape and got.dtype == dtype
    assert _rel(got, want) < {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_query_attention_rows_do_not_depend_on_their_batch_or_on_masked_padding(dtype):
    """A row gives the same bits alone or among others (33 tokens x 4 heads: many programs), and
    with masked key slots appended (the runtime's key-span buckets): tree verify rows and AR steps
    round alike."""
    t = 33
    q, k, v, mask = _attn_inputs(t, 90, 8, 2, 32, dtype, seed=4)
    whole = fused.attention(q, k, v, mask)
    for i in (0, 5, t - 1):
        alone = fused.attention(q[i : i + 1], k, v, mask[i : i + 1])
        if DEVICE == "cuda":
            assert torch.equal(alone, whole[i : i + 1])
        else:  # the interpreter's dot is NumPy's matmul, whose rounding depends on the matrix shape
            assert _rel(alone, whole[i : i + 1]) < (1e-6 if dtype == torch.float32 else 2e-2)
    if dtype != torch.float32:
        return
    pad = 200 - 90
    k2, v2 = torch.cat([k, _r(pad, 2, 32, seed=9)]), torch.cat([v, _r(pad, 2, 32, seed=10)])
    mask2 = torch.cat([mask, torch.zeros(t, pad, dtype=torch.bool, device=DEVICE)], dim=1)
    assert torch.equal(fused.attention(q, k2, v2, mask2), whole)


def test_split_attention_spans():
    """Keys split into spans of 128 at fixed positions, merged in order: a long context (36 spans)
    and a one-key-visible row come out as the PyTorch form's, and masked slots appended past 4,096
    keys (an AR step's key span against a verify's) change no bit."""
    q, k, v, mask = _attn_inputs(2, 4500, 4, 2, 16, torch.float32, seed=7)
    mask[1] = False
    mask[1, 4321] = True  # one visible key, in the last span but one
    got = fused.attention(q, k, v, mask)
    assert _rel(got, fused.attention_torch(q, k, v, mask)) < 1e-5
    assert torch.allclose(got[1], v[4321].repeat_interleave(2, dim=0), atol=1e-6)
    pad = 4700 - 4500
    k2, v2 = torch.cat([k, _r(pad, 2, 16, seed=11)]), torch.cat([v, _r(pad, 2, 16, seed=12)])
    mask2 = torch.cat([mask, torch.zeros(2, pad, dtype=torch.bool, device=DEVICE)], dim=1)
    assert torch.equal(fused.attention(q, k2, v2, mask2), got)


def test_attention_with_strided_cache_views_and_large_queries():
    """K/V as slices of a [layers, slots, heads, D] cache; more rows than SMALL_QUERIES take SDPA."""
    cache = _r(2, 256, 2, 16, seed=3)
    q, _, _, mask = _attn_inputs(3, 100, 4, 2, 16, torch.float32, seed=2)
    got = fused.attention(q, cache[1, :100], cache[0, :100], mask)
    assert _rel(got, fused.attention_torch(q, cache[1, :100], cache[0, :100], mask)) < 1e-5
    big_q, k, v, big_mask = _attn_inputs(fused.SMALL_QUERIES + 1, 80, 4, 2, 16, torch.float32, seed=5)
    assert torch.equal(fused.attention(big_q, k, v, big_mask), fused.attention_torch(big_q, k, v, big_mask))


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
    got = fused.attention(q, k, v, mask, gate=gate)
    assert got.shape == q.shape and got.dtype == dtype
    _assert_gate_bits(got, fused.attention(q, k, v, mask) * torch.sigmoid(gate), dtype)
    # a contiguous gate (its copy) gives the same bits as the strided view
    assert torch.equal(fused.attention(q, k, v, mask, gate=gate.contiguous()), got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batched_gated_attention_equals_the_eager_gate(dtype):
    """[B, T, H, D] queries with a strided [B, T, H, D] gate: each sequence its own gate rows."""
    b, t, s_len, hq, hkv, d = 3, 2, 50, 4, 2, 16
    q = _r(b, t, hq, d, dtype=dtype)
    k, v = _r(b, s_len, hkv, d, dtype=dtype, seed=1), _r(b, s_len, hkv, d, dtype=dtype, seed=2)
    mask = (torch.rand(b, t, s_len, generator=torch.Generator().manual_seed(3)) < 0.7).to(DEVICE)
    mask[:, :, -1] = True
    gate = _model_gate(b, t, hq=hq, d=d, dtype=dtype, seed=4)
    got = fused.attention(q, k, v, mask, gate=gate)
    _assert_gate_bits(got, fused.attention(q, k, v, mask) * torch.sigmoid(gate), dtype)
    for i in range(b):  # as each sequence's own unbatched call
        assert torch.equal(got[i], fused.attention(q[i], k[i], v[i], mask[i], gate=gate[i]))


def test_gated_attention_on_the_sdpa_path_applies_the_eager_ops():
    """SDPA (no mask, or more query rows than SMALL_QUERIES) and autograd take the eager ops."""
    big_q, k, v, big_mask = _attn_inputs(fused.SMALL_QUERIES + 1, 80, 4, 2, 16, torch.bfloat16, seed=5)
    gate = _model_gate(fused.SMALL_QUERIES + 1, hq=4, d=16, dtype=torch.bfloat16, seed=6)
    for mask in (big_mask, None):
        want = fused.attention_torch(big_q, k, v, mask) * torch.sigmoid(gate)
        assert torch.equal(fused.attention(big_q, k, v, mask, gate=gate), want)
    q, k, v, mask = _attn_inputs(3, 40, 4, 2, 16, torch.float32, seed=7)
    gate = _model_gate(3, hq=4, d=16, dtype=torch.float32, seed=8).detach().requires_grad_()
    out = fused.attention(q, k, v, mask, gate=gate)  # the kernels have no backward: the eager ops run
    assert torch.equal(out, fused.attention_torch(q, k, v, mask) * torch.sigmoid(gate))
    out.sum().backward()
    assert gate.grad is not None and gate.grad.shape == gate.shape


def test_gated_attention_refuses_a_gate_unlike_the_queries():
    q, k, v, mask = _attn_inputs(2, 20, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="gate must have the queries' shape"):
        fused.attention(q, k, v, mask, gate=_r(2, 4, 8))
    with pytest.raises(ValueError, match="dtype"):
        fused.attention(q, k, v, mask, gate=_r(2, 4, 16, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hk,dk,hv,dv", [(2, 16, 4, 8), (1, 12, 3, 20)])  # GQA-like groups; odd widths
def test_gdn_inputs(dtype, hk, dk, hv, dv):
    from engine.models.hybrid import conv_window_index

    kernel, t = 4, 9
    c = 2 * hk * dk + hv * dv
    hist = _r(kernel - 1 + t, c, dtype=dtype)
    conv, mixed = hist[: kernel - 1], hist[kernel - 1 :]
    parents = torch.tensor([-1, 0, 0, 1, 2, 3, 3, 5, 7], device=DEVICE)  # a tree: windows follow ancestors
    idx = conv_window_index(parents, kernel)
    w, a, b = 0.5 * _r(c, kernel, dtype=dtype, seed=1), _r(t, hv, dtype=dtype, seed=2), _r(t, hv, dtype=dtype, seed=3)
    a_log, dt = 0.3 * _r(hv, seed=4), _r(hv, seed=5)
    a[0, 0] = 30.0  # softplus's linear branch
    got = fused.gdn_inputs(conv, mixed, idx, w, a, b, a_log, dt, hk, dk, hv, dv)
    want = fused.gdn_inputs_torch(hist, idx, w, a, b, a_log, dt, hk, dk, hv, dv)
    # a and b as views of one fused in-projection's output (strided rows), mixed too: the same bits
    b_view, a_view = torch.cat([_r(t, 5, dtype=dtype, seed=6), b, a], dim=1)[:, 5:].split(hv, dim=1)
    mixed_view = torch.cat([mixed, a], dim=1)[:, :c]
    assert not a_view.is_contiguous() and not mixed_view.is_contiguous()
    assert all(torch.equal(x, y) for x, y in zip(
        fused.gdn_inputs(conv, mixed_view, idx, w, a_view, b_view, a_log, dt, hk, dk, hv, dv), got, strict=True))
    for name, x, y in zip(("q", "k", "v", "g", "beta"), got, want, strict=True):
        assert x.shape == y.shape and x.dtype == torch.float32, name
        assert _rel(x, y) < {torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype], name
    # rows are independent of the batch: the first token alone gives the same bits
    alone = fused.gdn_inputs(conv, mixed[:1], idx[:1], w, a[:1], b[:1], a_log, dt, hk, dk, hv, dv)
    assert all(torch.equal(x, y[:1]) for x, y in zip(alone, got, strict=True))
    # a tree records its nodes' conv inputs; nothing else is written
    record, conv_before = torch.zeros_like(mixed), conv.clone()
    fused.gdn_inputs(conv, mixed_view, idx, w, a, b, a_log, dt, hk, dk, hv, dv, record=record)
    assert torch.equal(record, mixed) and torch.equal(conv, conv_before)


@pytest.mark.parametrize("t", [1, 2, 5])  # one token: the window shifted in the kernel; more: after it
def test_gdn_inputs_commits_a_chains_conv_window(t):
    hk, dk, hv, dv, kernel = 2, 16, 4, 8, 4
    c = 2 * hk * dk + hv * dv
    conv, mixed = _r(kernel - 1, c, dtype=torch.bfloat16), _r(t, c, dtype=torch.bfloat16, seed=1)
    idx = (torch.arange(t, device=DEVICE)[:, None] + torch.arange(kernel, device=DEVICE)[None, :])  # a chain
    w, a, b = 0.5 * _r(c, kernel, seed=2), _r(t, hv, seed=3), _r(t, hv, seed=4)
    a_log, dt = 0.3 * _r(hv, seed=5), _r(hv, seed=6)
    want_window = torch.cat([conv, mixed])[t:].clone()
    want = fused.gdn_inputs(conv.clone(), mixed, idx, w, a, b, a_log, dt, hk, dk, hv, dv)
    got = fused.gdn_inputs(conv, torch.cat([mixed, a.to(mixed.dtype)], dim=1)[:, :c], idx, w, a, b, a_log, dt, hk,
                           dk, hv, dv, commit=True)
    assert torch.equal(conv, want_window)  # the window after the chain
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))  # read before it moved


def test_kernels_can_be_turned_off_for_a_comparison():
    from engine.models import delta_rule

    assert fused.set_kernels(False) is True
    try:
        assert not fused.kernels_enabled()
        # the tree delta rule's automatic backend follows the same switch
        q = torch.nn.functional.normalize(_r(2, 1, 4), dim=-1)
        out = delta_rule.tree_delta_rule(q, q, _r(2, 1, 4), -torch.ones(2, 1, device=DEVICE),
                                         torch.ones(2, 1, device=DEVICE) / 2, torch.tensor([-1, 0], device=DEVICE),
                                         torch.zeros(1, 4, 4, device=DEVICE))
        assert out.shape == (2, 1, 4)
    finally:
        assert fused.set_kernels(True) is False
    assert fused.kernels_enabled()


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
    got = fused.attention(q, k, v, mask)
    want = fused.attention_torch(q.float(), k.float(), v.float(), mask)
    assert got.shape == q.shape and _rel(got, want) < {torch.float32: 1e-5, torch.float16: 5e-3}[dtype]
    for i in range(b):  # each sequence alone: as its own unbatched call
        assert _rel(got[i], fused.attention(q[i], k[i], v[i], mask[i])) < 1e-6
    shared = fused.attention(q, k, v, mask[0])
    assert _rel(shared, fused.attention_torch(q.float(), k.float(), v.float(), mask[0])) < 5e-3


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


def test_a_generation_chooses_its_kernels_and_the_choice_is_restored():
    import engine
    from engine import EngineConfig, EngineInputError

    with fused.using_kernels(False):
        assert not fused.kernels_enabled()
        with fused.using_kernels(True):
            assert fused.kernels_enabled()
        assert not fused.kernels_enabled()
    assert fused.kernels_enabled()
    with pytest.raises(RuntimeError), fused.using_kernels(False):
        raise RuntimeError("a generation that fails")
    assert fused.kernels_enabled()
    with pytest.raises(EngineInputError, match=r"kernels must be one of \['fused', 'eager'\], but got 'triton'"):
        EngineConfig(kernels="triton")
    pair = engine.load("tiny-dense", "random", device="cpu")
    ids = pair.encode("kernels are an implementation path")
    # A small tree and few tokens: off CUDA the kernels run in Triton's interpreter (see kernels_on).
    cfg = dict(verify="ddtree", budget=4, top_k=2)
    outs = {k: engine.generate(pair, ids, EngineConfig(kernels=k, **cfg), 6, ignore_eos=True).tokens
            for k in ("fused", "eager")}
    assert outs["fused"] == outs["eager"]


def _with_kernels_env(value: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env={**os.environ, "ENGINE_KERNELS": value})


def test_engine_kernels_environment_variable_sets_the_process_default():
    code = "from engine.models import fused; print(fused.kernels_enabled())"
    assert _with_kernels_env("eager", "-c", code).stdout.strip() == "False"
    assert _with_kernels_env("fused", "-c", code).stdout.strip() == "True"
    # A bad value: importing still works; the first use and both CLIs refuse it (exit 2), naming it.
    bad = _with_kernels_env("off", "-c", code)
    assert bad.returncode != 0 and "ENGINE_KERNELS must be 'fused' or 'eager', got 'off'" in bad.stderr
    cli = _with_kernels_env("off", "-m", "engine", "generate", "--target", "tiny-dense", "--prompt", "x")
    assert cli.returncode == 2 and "ENGINE_KERNELS must be 'fused' or 'eager', got 'off'" in cli.stderr


def test_autotune_refuses_a_bad_engine_kernels_value():
    pytest.importorskip("optuna")  # the GPU machine runs the engine's tests without autotune's stack
    quickstart = Path(__file__).resolve().parents[2] / "experiments" / "quickstart.yaml"
    sweep = _with_kernels_env("off", "-m", "autotune", "sweep", str(quickstart))
    assert sweep.returncode == 2 and "environment: ENGINE_KERNELS: must be 'fused' or 'eager'" in sweep.stderr


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
    from engine.models.tree_kernel import build_tree_kernel
    from engine.tree import ancestor_mask, build_tree_device

    lp, ids = _tie_free_proposals(depth, k, seed=depth * 100 + k * 10 + budget)
    root = torch.tensor([5], device=DEVICE)
    ref = build_tree_device(lp, ids, root, budget, chain_seed)
    tree, mask = build_tree_kernel(lp, ids, root, budget, chain_seed)
    _assert_same_tree(tree, ref)
    assert mask.dtype == torch.bool and torch.equal(mask.cpu(), ancestor_mask(ref.parents, depth).cpu())


@pytest.mark.parametrize("depth,k,budget,chain_seed", [(4, 3, 10, 0), (7, 4, 22, None), (5, 8, 40, 2)])
def test_tree_kernel_equals_the_host_builder(depth, k, budget, chain_seed):
    from engine.models.tree_kernel import build_tree_kernel
    from engine.tree import build_tree_host

    gen = torch.Generator().manual_seed(budget)
    top_lp, top_ids = torch.topk(torch.log_softmax(torch.randn(depth, 50, generator=gen) * 2, -1), k, dim=-1)
    host = build_tree_host(top_lp, top_ids, 3, budget, chain_seed)
    tree, _ = build_tree_kernel(top_lp.to(DEVICE), top_ids.to(DEVICE), torch.tensor(3, device=DEVICE), budget,
                                chain_seed)
    _assert_same_tree(tree, host)


def test_tree_kernel_breaks_exact_ties_by_the_lower_index(monkeypatch):
    """Quantised log-probs tie exactly (children of distinct parents too); the kernel orders ties by
    lower index, as build_tree_device does with a stable top-k."""
    from engine.models.tree_kernel import build_tree_kernel
    from engine.tree import ancestor_mask, build_tree_device

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
    from engine.models import tree_kernel
    from engine.tree import ancestor_mask, build_tree_device

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
    from engine.tree import ancestor_mask, build_tree_device

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
    from engine.models import tree_kernel

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
    from engine.models import tree_kernel

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
