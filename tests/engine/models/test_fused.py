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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gated_rms_norm_reads_a_strided_gate_in_place(dtype):
    """Qwen3.5's gate z is a [T, heads, d] view of the fused in-projection (rows strided): the same
    result as from a contiguous copy, bit for bit."""
    t, heads, d = 3, 4, 32
    x = _r(t, heads, d, seed=1)  # the delta rule's float32 output
    fused_proj = _r(t, 2 * heads * d + 7, dtype=dtype, seed=2)
    gate = fused_proj[:, heads * d : 2 * heads * d].view(t, heads, d)
    assert not gate.is_contiguous()
    w = 1 + 0.1 * _r(d, dtype=dtype, seed=3)
    got = fused.gated_rms_norm(x, gate, w, 1e-6)
    assert got.shape == gate.shape and torch.equal(got, fused.gated_rms_norm(x, gate.contiguous(), w, 1e-6))


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hk,dk,hv,dv", [(2, 16, 4, 8), (1, 12, 3, 20)])  # GQA-like groups; odd widths
def test_gdn_inputs(dtype, hk, dk, hv, dv):
    from engine.models.hybrid_cache import conv_window_index

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


@pytest.mark.slow
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
    ids = pair.encode("kernels")
    # A short prompt, a small tree and few tokens: off CUDA the kernels run in Triton's interpreter
    # (see kernels_on), the prefill too.
    cfg = dict(verify="ddtree", budget=4, top_k=2)
    outs = {k: engine.generate(pair, ids, EngineConfig(kernels=k, **cfg), 5, ignore_eos=True).tokens
            for k in ("fused", "eager")}
    assert outs["fused"] == outs["eager"]


def _with_kernels_env(value: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env={**os.environ, "ENGINE_KERNELS": value})


@pytest.mark.slow
def test_engine_kernels_environment_variable_sets_the_process_default():
    code = "from engine.models import fused; print(fused.kernels_enabled())"
    assert _with_kernels_env("eager", "-c", code).stdout.strip() == "False"
    assert _with_kernels_env("fused", "-c", code).stdout.strip() == "True"
    # A bad value: importing still works; the first use and both CLIs refuse it (exit 2), naming it.
    bad = _with_kernels_env("off", "-c", code)
    assert bad.returncode != 0 and "ENGINE_KERNELS must be 'fused' or 'eager', got 'off'" in bad.stderr
    cli = _with_kernels_env("off", "-m", "engine", "generate", "--target", "tiny-dense", "--prompt", "x")
    assert cli.returncode == 2 and "ENGINE_KERNELS must be 'fused' or 'eager', got 'off'" in cli.stderr


@pytest.mark.parametrize(("name", "says"), [("ENGINE_KERNELS", "must be 'fused' or 'eager'"),
                                           ("ENGINE_QUANT_DECODE", "must be 'auto' or 'kernel'")])
def test_autotune_refuses_a_bad_engine_environment_value(name, says):
    pytest.importorskip("optuna")  # the GPU machine runs the engine's tests without autotune's stack
    quickstart = Path(__file__).resolve().parents[3] / "experiments" / "quickstart.yaml"
    sweep = subprocess.run([sys.executable, "-m", "autotune", "sweep", str(quickstart)], capture_output=True,
                           text=True, env={**os.environ, name: "off"})
    assert sweep.returncode == 2 and f"environment: {name}: {says}" in sweep.stderr and "'off'" in sweep.stderr
