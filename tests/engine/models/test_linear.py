"""The few-row linear kernel (Triton, interpreted on the CPU) against a float64 product, its
split-K ticket protocol, and the dispatch between it and cuBLAS."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from engine.models import fused
from engine.models import linear as lin
from engine.models.common import Linear
from tests.engine.models.test_quant_gluon_options import _Launches

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 / fp16 outputs: one rounding of a float32 sum (the interpreter truncates bf16: a few ulps)
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _r(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k", "rows", "split"), [
    (192, 256, 1, 1),  # a step, whole K
    (100, 300, 5, 3),  # ragged N and K: masked tiles, a last part shorter than the others
    (64, 1024, 33, 4),  # a verify's rows (BLOCK_M 64), four parts
    (80, 512, 16, 8),  # as many parts as K blocks
])
def test_kernel_matches_the_product(dtype, n, k, rows, split):
    w, x = 0.05 * _r(n, k, dtype=dtype, seed=n), _r(rows, k, dtype=dtype, seed=k)
    bias = _r(n, dtype=dtype, seed=3)
    cfg = lin.LinearConfig(64, 64, split)
    ref = x.double() @ w.double().T
    got = lin._kernel_linear(x, w, None, cfg)
    assert got.dtype == dtype and got.shape == (rows, n) and not got.isnan().any()
    assert _rel(got, ref) < TOL[dtype]
    assert _rel(lin._kernel_linear(x, w, bias, cfg), ref + bias.double()) < TOL[dtype]
    # Every part's ticket was taken and the tile's reset for the next launch.
    if split > 1:
        assert not lin._tickets(x.device, 1).any()


@pytest.mark.skipif(DEVICE == "cuda", reason="the reference parts are float32 products: tf32 on a GPU")
def test_parts_add_in_order():
    """The result is the parts' float32 sums added in order 0..split-1, then rounded: the same bits
    as single-part launches added that way. (The interpreter runs the parts in grid order, so the last
    one takes the last ticket here; on a GPU any part may, and the order of the sum is the same.)"""
    n, k, split = 64, 512, 4
    w, x = 0.05 * _r(n, k, dtype=torch.float16, seed=1), _r(1, k, dtype=torch.float16, seed=2)
    got = lin._kernel_linear(x, w, None, lin.LinearConfig(64, 64, split))
    parts = torch.zeros(1, n, dtype=torch.float32, device=DEVICE)
    for p in range(split):
        lo, hi = p * k // split, (p + 1) * k // split
        # a part alone, summed in float32 by the same kernel (one part: no ticket)
        parts += _float32_product(x[:, lo:hi], w[:, lo:hi])
    assert torch.equal(got, parts.to(torch.float16))


def _float32_product(x, w):
    return lin._kernel_linear(x.float(), w.float(), None, lin.LinearConfig(64, 64, 1))


def test_strided_rows_and_leading_dims():
    w = 0.05 * _r(96, 128, dtype=torch.bfloat16, seed=5)
    x = _r(2, 3, 256, dtype=torch.bfloat16, seed=6)[..., ::2]  # a strided view: rows copied contiguous
    cfg = lin.LinearConfig(32, 64, 2)
    got = lin._kernel_linear(x, w, None, cfg)
    assert got.shape == (2, 3, 96)
    assert _rel(got, x.double() @ w.double().T) < TOL[torch.bfloat16]


def test_config_is_validated():
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        lin.LinearConfig(48, 64)
    with pytest.raises(ValueError, match="num_warps 4 or 8"):
        lin.LinearConfig(64, 64, 1, 2)
    with pytest.raises(ValueError, match="split >= 1"):
        lin.LinearConfig(64, 64, 0)
    for row_block in (8, 48, 2 * lin.ROW_BLOCK):
        with pytest.raises(ValueError, match="row_block must be a power of two"):
            lin.LinearConfig(64, 64, row_block=row_block)


def test_a_plan_splits_k_alike_in_its_two_launches():
    with pytest.raises(ValueError, match="must split K alike"):
        lin.LinearPlan(lin.LinearConfig(64, 128, 2), lin.LinearConfig(64, 128, 1))
    with pytest.raises(ValueError, match="must split K alike"):
        lin.LinearPlan(lin.LinearConfig(64, 128, 2), lin.LinearConfig(64, 64, 2))
    plan = lin.LinearPlan(lin.LinearConfig(64, 128, 2, 4, 3), lin.LinearConfig(128, 128, 2, 8, 5))
    assert plan.for_rows(1) is plan.step and plan.for_rows(lin.STEP_ROWS) is plan.step
    assert plan.for_rows(lin.STEP_ROWS + 1) is plan.verify and plan.for_rows(lin.MAX_ROWS) is plan.verify


@pytest.mark.parametrize(("n", "k"), [(576, 576), (1536, 576), (192, 1536), (100, 2100)])
def test_default_plans_cover_any_weight(n, k):
    """Any weight gets a plan from its shape: K blocks of 64 below K 1,024 (else 128), a part at least
    two blocks long, about TARGET_PROGRAMS programs."""
    plan = lin.default_plan(n, k)
    cfg = plan.step
    assert plan.step == plan.verify and cfg.block_k == (64 if k < 1024 else 128)
    blocks = -(-k // cfg.block_k)
    assert 1 <= cfg.split <= max(1, blocks // 2)
    assert cfg.split == 1 or -(-n // cfg.block_n) * (cfg.split - 1) < lin.TARGET_PROGRAMS


def _plans_file(tmp_path, entries) -> str:
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(entries))
    return str(path)


def test_a_plans_file_comes_before_the_tuned_plans(tmp_path, monkeypatch):
    """``ENGINE_LINEAR_PLANS``: the file ``kernel_bench.py plans --out`` writes (extra fields such as
    the timings are ignored) gives its weights their plans; every other weight keeps its own."""
    step = dict(block_n=32, block_k=64, split=3, num_warps=4, num_stages=2, row_block=128)
    verify = {**step, "block_n": 64, "row_block": 16}
    path = _plans_file(tmp_path, [{"shape": "mine (96 x 640)", "n": 96, "k": 640, "us": {"1": 2.0},
                                   "step": step, "verify": verify}])
    monkeypatch.setenv(lin.PLANS_ENV, path)
    w, other = torch.zeros(96, 640), torch.zeros(100, 640)
    assert lin.plan_for(w) == lin.LinearPlan(lin.LinearConfig(**step), lin.LinearConfig(**verify))
    assert lin.plan_for(other) == lin.default_plan(100, 640)
    monkeypatch.delenv(lin.PLANS_ENV)
    assert lin.plan_for(w) == lin.default_plan(96, 640)


def test_a_block_weights_own_plan_comes_before_its_shapes(tmp_path, monkeypatch):
    """A weight kept in GGUF blocks takes its format's plan where one is measured: a plans file's entry with its
    ``format``, then ``TUNED_NATIVE``'s (measured on the block kernel: before a file's plan of the dense shape),
    then the shape's (the file's, then ``TUNED``'s); a dense weight, or one in another format, never takes it.
    Several files (``os.pathsep``) add up; a weight planned in two is refused, naming both."""
    def plan(block_n: int, split: int) -> lin.LinearPlan:
        cfg = lin.LinearConfig(block_n, 64, split, 4, 3)
        return lin.LinearPlan(cfg, cfg)

    def entry(p: lin.LinearPlan, **fmt) -> dict:
        return {"n": 96, "k": 640, **fmt, "step": p.step.__dict__, "verify": p.verify.__dict__}

    cpu = torch.device("cpu")  # (capability (0, 0))
    native, tuned, filed_native, filed_dense = plan(16, 3), plan(32, 2), plan(64, 5), plan(128, 4)
    assert lin.plan_for_shape(96, 640, cpu, "Q4_1") == lin.default_plan(96, 640)
    monkeypatch.setitem(lin.TUNED, (0, 0), {(96, 640): tuned})
    assert lin.plan_for_shape(96, 640, cpu, "Q4_1") == tuned == lin.tuned_plan(96, 640, (0, 0), "Q4_1")
    monkeypatch.setitem(lin.TUNED_NATIVE, (0, 0), {("Q4_1", 96, 640): native})
    assert lin.plan_for_shape(96, 640, cpu, "Q4_1") == native == lin.tuned_plan(96, 640, (0, 0), "Q4_1")
    assert lin.plan_for_shape(96, 640, cpu, "Q8_0") == lin.plan_for_shape(96, 640, cpu) == tuned
    dense = _plans_file(tmp_path, [entry(filed_dense)])
    monkeypatch.setenv(lin.PLANS_ENV, dense)
    assert lin.plan_for_shape(96, 640, cpu) == lin.plan_for_shape(96, 640, cpu, "Q8_0") == filed_dense
    assert lin.plan_for_shape(96, 640, cpu, "Q4_1") == native  # measured on the block kernel
    (tmp_path / "native").mkdir()
    mine = _plans_file(tmp_path / "native", [entry(filed_native, format="Q4_1")])
    monkeypatch.setenv(lin.PLANS_ENV, os.pathsep.join([dense, mine]))
    assert lin.plan_for_shape(96, 640, cpu, "Q4_1") == filed_native
    assert lin.plan_for_shape(96, 640, cpu) == filed_dense
    assert lin.tuned_plan(96, 640, (0, 0), "Q4_1") == native  # no file
    (tmp_path / "again").mkdir()
    again = _plans_file(tmp_path / "again", [entry(filed_dense, format="Q4_1")])
    monkeypatch.setenv(lin.PLANS_ENV, os.pathsep.join([mine, again]))
    with pytest.raises(ValueError, match=f"{mine!r} and {again!r} both plan the weight \\('Q4_1', 96, 640\\)"):
        lin.plan_for_shape(96, 640, cpu, "Q4_1")


@pytest.mark.parametrize(("content", "message"), [
    ("{}", "must hold a list of plans"),
    ("[1]", "entry 0 must be an object with n, k, step and verify"),
    ('[{"n": 0, "k": 64, "step": {}, "verify": {}}]', "n and k must be positive integers, got n=0"),
    ('[{"n": 64, "k": 64, "step": {"block_n": 64}, "verify": {}}]', "step must be an object of the integers"),
    ('[{"n": 64, "k": 64, "step": {"block_n": 48, "block_k": 64, "split": 1, "num_warps": 4, "num_stages": 2, '
     '"row_block": 128}, "verify": {}}]', "step: LinearConfig.block_n must be a power of two"),
    ('[{"n": 64, "k": 64, "step": {"block_n": 64, "block_k": 64, "split": 1, "num_warps": 4, "num_stages": 2, '
     '"row_block": 128}, "verify": {"block_n": 64, "block_k": 64, "split": 2, "num_warps": 4, "num_stages": 2, '
     '"row_block": 128}}]', r"entry 0 \(64 x 64\): a LinearPlan's step and verify launches must split K alike"),
    ("[{", "is not JSON"),
    ('[{"n": 64, "k": 64, "format": "Q4_2", "step": {}, "verify": {}}]',
     "entry 0: format must be one of Q4_0, Q4_1, .* or absent .*, got 'Q4_2'"),
])
def test_a_bad_plans_file_is_refused_with_the_entry_and_the_rule(tmp_path, content, message):
    path = tmp_path / "plans.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        lin.load_plans(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        lin.load_plans(str(tmp_path / "missing.json"))


def test_engine_load_refuses_a_bad_plans_file_before_any_work(tmp_path, monkeypatch):
    import engine

    monkeypatch.setenv(lin.PLANS_ENV, _plans_file(tmp_path, {"n": 1}))
    with pytest.raises(engine.EngineInputError, match="ENGINE_LINEAR_PLANS: .*must hold a list"):
        engine.load("tiny-dense", "random", device="cpu", dtype="float32")


# The plans a row's bits are checked under: default ones (SmolLM2-like narrow and wide weights, an odd
# K) and one whose step and verify launches differ in tile width, warps and stages (as tuned ones do).
ROW_PLANS = [
    lin.default_plan(96, 576),
    lin.default_plan(64, 1100),
    lin.LinearPlan(lin.LinearConfig(64, 64, 3, 4, 3), lin.LinearConfig(128, 64, 3, 8, 4)),
    lin.LinearPlan(lin.LinearConfig(32, 64, 1, 4, 4), lin.LinearConfig(64, 64, 1, 4, 2, row_block=16)),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("plan", ROW_PLANS, ids=["narrow", "odd-k", "two-launches", "row-blocks-of-16"])
def test_a_rows_bits_do_not_depend_on_its_launch(dtype, plan):
    """Row invariance (speculative decoding commits AR's tokens only if a verify's rows round as AR
    steps do): a row gives the same bits alone (an AR step), among 7 (a chain or a draft block) and
    among 33 (a verify, the plan's other launch), wherever it sits among them."""
    n, k = 96, plan.step.block_k * 9 + 5
    w = 0.05 * _r(n, k, dtype=dtype, seed=k)
    x = _r(33, k, dtype=dtype, seed=n)
    whole = lin._kernel_linear(x, w, None, plan.for_rows(33))
    for rows in ([0], [32], [5], list(range(3, 10)), [9, 2, 30, 0, 17, 4, 11]):
        sub = x[rows]
        got = lin._kernel_linear(sub, w, None, plan.for_rows(len(rows)))
        assert torch.equal(got, whole[rows]), f"rows {rows}"


def test_dispatch_takes_cublas_off_the_steps():
    """CPU tensors, float32, gradients and row counts past MAX_ROWS (long prefills) take F.linear,
    and ``Linear`` is an ``nn.Linear`` with the same parameters and result; every weight has a launch
    for every row count a step uses."""
    layer = Linear(64, 32)
    x = torch.randn(3, 64)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert not lin.use_kernel(x, layer.weight)  # float32 on the CPU
    assert set(layer.state_dict()) == {"weight", "bias"}
    if DEVICE == "cuda":
        w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        assert lin.launch_config(torch.randn(lin.MAX_ROWS + 1, 4096, device="cuda", dtype=torch.bfloat16), w) is None
        assert lin.launch_config(torch.randn(1, 4096, device="cuda"), w[:100]) == lin.default_plan(100, 4096).step


@pytest.mark.skipif(DEVICE != "cuda", reason="the tuned launches are for GPUs")
@pytest.mark.parametrize("shape", [(6144, 4096), (151936, 4096), (5120, 17408), (576, 576), (1536, 576),
                                   (49152, 576)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_plans_on_the_gpu_match_cublas_and_round_alike_across_rows(shape):
    """Through the engine's dispatch on the GPU, the matrix unit's own order: tuned weights (8B qkv
    and lm_head, 27B down: step and verify launches differ in tile, warps and stages) and SmolLM2's
    (default plans). Close to cuBLAS, and a row's bits the same alone, among 7 and 16 (a step
    launch) and among 17, 33, 65 and 200 rows (the verify launch, BLOCK_M 32 to 128, row blocks)."""
    previous = fused.set_kernels(True)
    try:
        n, k = shape
        w = 0.02 * torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(200, k, device="cuda", dtype=torch.bfloat16)
        whole = lin.linear(x, w)
        assert _rel(whole, F.linear(x.float(), w.float())) < 1e-2
        for rows in ([0], [199], list(range(7)), list(range(5, 21)), list(range(17)), list(range(33)),
                     list(range(100, 165)), [150, 3, 77, 0, 199, 42, 8]):
            assert torch.equal(lin.linear(x[rows], w), whole[rows]), f"{len(rows)} rows"
    finally:
        fused.set_kernels(previous)


def test_free_rows_takes_the_draft_off_the_kernel(monkeypatch):
    """A draft's projections (``free_rows_``: its outputs only propose tokens the target verifies)
    take cuBLAS; every other ``Linear`` and ``FusedLinear`` keeps the row-invariant dispatch."""
    from torch import nn

    from engine.models.common import FusedLinear, free_rows_

    calls = []
    monkeypatch.setattr(lin, "linear", lambda x, w, b=None: calls.append(w.shape) or F.linear(x, w, b))
    target = nn.Sequential(Linear(8, 4), FusedLinear([nn.Linear(4, 3), nn.Linear(4, 5)]))
    draft = free_rows_(nn.Sequential(Linear(8, 4), FusedLinear([nn.Linear(4, 3), nn.Linear(4, 5)])))
    x = torch.randn(2, 8)
    for model in (target, draft):
        h = model[0](x)
        parts = model[1](h)
        assert [p.shape for p in parts] == [(2, 3), (2, 5)]
        assert torch.equal(torch.cat(parts, -1), F.linear(h, model[1].weight, model[1].bias))
    assert calls == [(4, 8), (8, 4)]  # the target's two, none of the draft's
    assert not any(m.row_invariant for m in draft if hasattr(m, "row_invariant"))


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("lets", [False, True])
def test_a_launch_takes_pdl_only_where_asked_and_the_gpu_lets_it(monkeypatch, pdl, lets):
    """``linear.PDL`` reaches the kernel (as a constexpr and as ``launch_pdl``) only where the kernels before it may
    let it launch (``fused.lets_dependents_launch``: sm_90 and later, not the interpreter); off by default."""
    assert lin.PDL is False
    monkeypatch.setattr(lin, "PDL", pdl)
    monkeypatch.setattr(fused, "lets_dependents_launch", lambda device: lets)
    kernel = _Launches()
    monkeypatch.setattr(lin, "_linear_kernel", kernel)
    lin._kernel_linear(torch.zeros(3, 256, dtype=torch.bfloat16), torch.zeros(128, 256, dtype=torch.bfloat16), None,
                       lin.LinearConfig(64, 64, 2))
    ((_, kw, _),) = kernel.seen
    assert kw["PDL"] is (pdl and lets) and kw["launch_pdl"] is (pdl and lets)


def test_the_kernels_before_a_product_let_it_launch_only_on_sm90_gpus():
    """No trigger on the CPU (nor in the interpreter, where the tests run the kernels)."""
    assert fused.lets_dependents_launch(torch.device("cpu")) is False
