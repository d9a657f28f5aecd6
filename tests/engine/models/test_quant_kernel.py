"""The in-register kernel of GGUF blocks (``engine.models.quant_kernel``): in Triton's interpreter on the
CPU (its dot an explicit ordered sum, as ``test_linear.py`` runs the dense kernel), every format's product
equals the weight dequantized and multiplied by the dense kernel on the same launch, bit for bit, and a
row's bits do not depend on the rows beside it; on a GPU the same through the engine's dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models import fused
from engine.models import linear as lin
from engine.models import quant_kernel as qk
from engine.models.common import Linear
from engine.models.quant import FORMATS, QuantLinear, dequantize, hold, unhold
from tests.engine.gguf_files import random_blocks

pytest.importorskip("triton")
gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _blocks(name: str, n: int, k: int, seed: int) -> torch.Tensor:
    """Random blocks of ``name`` as a ``QuantLinear`` holds them (``quant.hold``: Q4_0, Q5_0, Q8_0 and Q6_K in
    planes), which is what the kernel reads; scales up to 0.05: products of the size a model's weights have,
    rounding in bf16 as they do."""
    return hold(torch.from_numpy(random_blocks(Q[name], n, k, seed, scale=0.05)), FORMATS[name]).to(DEVICE)


def _x(rows: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _reference(x, blocks, fmt, k, bias, cfg):
    """What the kernel must equal: the values a dequantized load holds, on the dense kernel's launch."""
    return lin._kernel_linear(x, dequantize(unhold(blocks, fmt), fmt, k, x.dtype), bias, cfg)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # -0.0 != 0.0, NaN payloads compared too


def _width(name: str, blocks: float) -> int:
    return int(FORMATS[name].values * blocks)


# (K in 32-value blocks, launch): K in blocks of 64 split in 2 with a ragged last part (EVEN_K off: K = 96);
# K blocks of 16 (a group of 16 values: half a 32-value block); tiles of 512 over several blocks, the
# last masked past K (for the K formats: 3 super-blocks, a tile and a half)
LAUNCHES = [(3, lin.LinearConfig(64, 64, 2)), (2, lin.LinearConfig(32, 16, 3)), (3, lin.LinearConfig(32, 512, 1))]


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("launch", range(len(LAUNCHES)), ids=["k64-split2", "k16-split3", "k512"])
def test_the_kernel_equals_dequantize_then_the_dense_kernel_bit_for_bit(name, launch):
    """Every format, in bf16, with a bias, N = 100 (not a multiple of the tile): the kernel decodes the
    values ``quant.dequantize`` gives (gguf's reference), rounds them as a dequantized load does and
    sums them in the dense kernel's order. A float64 product checks that both are the product."""
    fmt = FORMATS[name]
    count, cfg = LAUNCHES[launch]
    if fmt.values == 256:  # super-blocks: 2, or 1 in tiles of 16 (16 tiles), or 3 in one tile and a half
        count = {64: 2, 16: 1, 512: 3}[cfg.block_k]
    k = _width(name, count)
    blocks = _blocks(name, 100, k, seed=k + len(name))
    x, bias = _x(5, k, torch.bfloat16, seed=1), _x(1, 100, torch.bfloat16, seed=2)[0]
    got = qk.kernel_linear(x, blocks, fmt, k, bias, cfg)
    want = _reference(x, blocks, fmt, k, bias, cfg)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 100)
    assert torch.equal(_bits(got), _bits(want))
    exact = x.double() @ dequantize(unhold(blocks, fmt), fmt, k).double().T + bias.double()
    assert float((got.double() - exact).norm() / exact.norm()) < 1e-2


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K", "Q6_K"])
def test_half_precision_too(name):
    """fp16 activations: the values rounded to fp16 (which the interpreter rounds to nearest itself)."""
    fmt = FORMATS[name]
    k = _width(name, 2)
    blocks = _blocks(name, 40, k, seed=3)
    x = _x(3, k, torch.float16, seed=4)
    cfg = lin.LinearConfig(32, 64, 2)
    assert torch.equal(_bits(qk.kernel_linear(x, blocks, fmt, k, None, cfg)), _bits(_reference(x, blocks, fmt, k,
                                                                                                 None, cfg)))


# A plan whose step and verify launches differ in tile width, warps and stages (as tuned ones do), K in
# three parts
ROW_PLAN = lin.LinearPlan(lin.LinearConfig(64, 64, 3, 4, 3), lin.LinearConfig(128, 64, 3, 8, 4))


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_rows_bits_do_not_depend_on_its_launch(name):
    """Row invariance (a verify's rows must round as AR steps do): a row alone (the step launch), among 7
    and among 33 (the verify launch) gives the same bits wherever it sits; Q6_K, whose programs take at most
    64 rows (``quant_kernel.ROW_BLOCK_CAP``), among 70 too (two row blocks)."""
    fmt = FORMATS[name]
    k = _width(name, 2 if fmt.values == 256 else 9)
    blocks = _blocks(name, 72, k, seed=5)
    rows = 70 if name == "Q6_K" else 33
    x = _x(rows, k, torch.bfloat16, seed=6)
    whole = qk.kernel_linear(x, blocks, fmt, k, None, ROW_PLAN.for_rows(rows))
    for pick in ([0], [32], list(range(3, 10)), [9, 2, 30, 0, 17, 4, 11] + ([69] if rows > 33 else [])):
        got = qk.kernel_linear(x[pick], blocks, fmt, k, None, ROW_PLAN.for_rows(len(pick)))
        assert torch.equal(_bits(got), _bits(whole[pick])), f"rows {pick}"


# (format, K, launch) of every format: K tiles of one chunk (Q4_1, Q4_K) and of several, over several blocks;
# the held planes of the 18-, 22-, 34- and 210-byte formats (whose blocks sat at 2 mod 4 bytes); a K tile past K
# (EVEN_K off: the masked part +0.0, where Q4_0's, Q5_0's and Q6_K's offsets would make it -0.0)
WORD_LAUNCHES = [("Q4_1", 288, lin.LinearConfig(32, 32, 2)), ("Q4_K", 768, lin.LinearConfig(32, 64, 3))] + [
    (name, k, cfg) for name in FORMATS
    for k, cfg in (((256, lin.LinearConfig(32, 128, 2)), (192, lin.LinearConfig(16, 256, 1)))
                   if FORMATS[name].values == 32
                   else ((1024, lin.LinearConfig(32, 128, 2)), (1536, lin.LinearConfig(16, 1024, 1))))]


@pytest.mark.parametrize(("name", "k", "cfg"), WORD_LAUNCHES, ids=lambda c: str(c))
def test_the_word_decode_equals_the_half_word_decode_and_dequantize(name, k, cfg):
    """Every format's blocks read as 32-bit words (``quant_kernel.WORD_FORMATS``): the same bits as the
    half-word decode and as the dequantized weight on the same launch, with a bias, N = 37 (rows past N
    masked), bf16 and fp16."""
    fmt = FORMATS[name]
    blocks = _blocks(name, 37, k, seed=k)
    assert qk.reads_words(fmt, cfg.block_k, blocks)
    for dtype in (torch.bfloat16, torch.float16):
        x, bias = _x(4, k, dtype, seed=11), _x(1, 37, dtype, seed=12)[0]
        got = qk.kernel_linear(x, blocks, fmt, k, bias, cfg)
        assert torch.equal(_bits(got), _bits(qk.kernel_linear(x, blocks, fmt, k, bias, cfg, words=False)))
        assert torch.equal(_bits(got), _bits(_reference(x, blocks, fmt, k, bias, cfg)))


def test_blocks_that_words_cannot_read_take_the_half_word_decode():
    """Words need a K tile of whole chunks, rows of whole words and rows that start 4-byte aligned; any
    other launch decodes half-words, with the same result."""
    q6, q4k = FORMATS["Q6_K"], FORMATS["Q4_K"]
    odd = _blocks("Q6_K", 8, 768, seed=13)  # 3 blocks a row: 630 bytes, not whole words
    assert not qk.reads_words(q6, 256, odd) and qk.reads_words(q6, 256, _blocks("Q6_K", 8, 1024, seed=13))
    assert not qk.reads_words(q6, 64, _blocks("Q6_K", 8, 1024, seed=13))  # a tile of half a chunk
    assert not qk.reads_words(q4k, 32, _blocks("Q4_K", 8, 512, seed=14))
    wide = _blocks("Q4_K", 8, 768, seed=15)
    shifted = torch.cat([torch.zeros(8, 2, dtype=torch.uint8, device=wide.device), wide], dim=1)[:, 2:]
    assert shifted.data_ptr() % 4 == 2 and not qk.reads_words(q4k, 64, shifted)
    x, cfg = _x(2, 768, torch.bfloat16, seed=16), lin.LinearConfig(32, 64, 1)
    assert torch.equal(_bits(qk.kernel_linear(x, shifted, q4k, 768, None, cfg)),
                       _bits(qk.kernel_linear(x, wide, q4k, 768, None, cfg)))
    got = qk.kernel_linear(_x(2, 768, torch.bfloat16, seed=17), odd, q6, 768, None, lin.LinearConfig(16, 256, 1))
    assert torch.equal(_bits(got), _bits(_reference(_x(2, 768, torch.bfloat16, seed=17), odd, q6, 768, None,
                                                    lin.LinearConfig(16, 256, 1))))


def test_a_steps_word_launch_on_8_warps_is_capped_where_its_format_asks():
    """``register_cap``: Q6_K's step launches read as words on 8 warps take 128 registers a thread on sm_90 (two
    programs an SM); its verify launches, 4-warp launches, half-word launches, other formats and other
    architectures none."""
    q6, q4k = FORMATS["Q6_K"], FORMATS["Q4_K"]
    assert qk.register_cap(q6, True, 16, 8) == 128
    assert qk.register_cap(q6, True, 64, 8) is None and qk.register_cap(q6, True, 16, 4) is None
    assert qk.register_cap(q6, False, 16, 8) is None and qk.register_cap(q4k, True, 16, 8) is None
    assert qk.register_cap(q6, True, 16, 8, (8, 9)) is None  # checked on sm_90 only (an RTX 4090 is sm_89)


def test_a_verify_launch_of_the_block_kernel_is_at_most_three_stages_deep():
    """The dense kernel's stages, at most ``MAX_VERIFY_STAGES`` past a step's rows: the 27B gate_up's verify
    launch (64 rows) drops from the dense plan's 6 (one program an SM on sm_90) to 3; every step launch keeps
    the dense rule's, 6 included (four programs an SM either way)."""
    gate_up = lin.TUNED[(9, 0)][(34816, 5120)]
    assert lin.stages_for(gate_up.verify, 64, 2) == 6
    assert qk.launch_stages(gate_up.verify, 64, 2) == qk.MAX_VERIFY_STAGES == 3
    for plan in [*lin.TUNED[(9, 0)].values(), *lin.TUNED_NATIVE[(9, 0)].values()]:
        assert qk.launch_stages(plan.step, lin.STEP_ROWS, 2) == lin.stages_for(plan.step, lin.STEP_ROWS, 2)
        assert qk.launch_stages(plan.verify, 64, 2) == min(lin.stages_for(plan.verify, 64, 2), 3)
    assert qk.launch_stages(lin.LinearConfig(32, 64, num_stages=2), 128, 2) == 2


def test_every_format_has_a_kernel_and_a_group_within_a_tile():
    assert set(qk.KERNEL_FORMATS) == set(FORMATS)
    assert qk.group_size(FORMATS["Q6_K"], 128) == 16 and qk.group_size(FORMATS["Q4_K"], 128) == 32
    assert qk.group_size(FORMATS["Q4_0"], 16) == 16


def test_dispatch_takes_the_kernel_for_a_steps_rows_and_dequantizes_otherwise(monkeypatch):
    """``QuantLinear`` takes the kernel where the kernels are on (here forced on the CPU: Triton's
    interpreter), on the weight's plan (its format's own where ``TUNED_NATIVE`` has one, else its shape's), for
    half-precision rows up to ``MAX_ROWS``; float32, more rows, or the kernels off dequantize the weight and
    multiply (``kernels: eager``, the CPU)."""
    fmt = FORMATS["Q8_0"]
    layer = QuantLinear(fmt, 96, 40, bias=True, blocks=_blocks("Q8_0", 40, 96, seed=7))
    with torch.no_grad():
        layer.bias.copy_(_x(1, 40, torch.float32, seed=8)[0])
    layer = layer.to(torch.bfloat16)
    x = _x(3, 96, torch.bfloat16, seed=9)
    assert not qk.use_kernel(x, layer.blocks, fmt, layer.bias) or DEVICE == "cuda"  # no CUDA: the PyTorch form
    monkeypatch.setattr(fused, "use_kernels", lambda *tensors: True)
    calls = []
    kernel = qk.kernel_linear
    monkeypatch.setattr(qk, "kernel_linear", lambda *a: calls.append(a[-1]) or kernel(*a))
    plan = lin.plan_for_shape(40, 96, x.device)
    assert torch.equal(layer(x), _reference(x, layer.blocks, fmt, 96, layer.bias, plan.step))
    assert calls == [plan.step]
    # a plan of the format's own (linear.TUNED_NATIVE) comes before the shape's
    own = lin.LinearPlan(lin.LinearConfig(16, 32, 3, num_stages=2), lin.LinearConfig(32, 32, 3, row_block=16))
    monkeypatch.setitem(lin.TUNED_NATIVE, lin.capability(x.device), {("Q8_0", 40, 96): own})
    assert own.step.split != plan.step.split and torch.equal(
        layer(x), _reference(x, layer.blocks, fmt, 96, layer.bias, own.step))
    assert calls == [plan.step, own.step]
    monkeypatch.setitem(lin.TUNED_NATIVE, lin.capability(x.device), {})
    assert not qk.use_kernel(x.float(), layer.blocks, fmt)  # float32: dequantize, then cuBLAS / the CPU
    big = torch.zeros(qk.MAX_ROWS + 1, 96, dtype=torch.bfloat16, device=DEVICE)
    assert not qk.use_kernel(big, layer.blocks, fmt)  # a long prefill: dequantize once, then a GEMM
    big[:3] = x
    assert torch.equal(layer(big), F.linear(big, layer.dequantized(torch.bfloat16), layer.bias))
    assert len(calls) == 2


def test_a_fused_groups_part_takes_the_kernel_on_its_own_rows_of_blocks(monkeypatch):
    """``QuantFusedLinear.part`` (a draft's context K/V, ``project_part``): where the kernel takes the rows,
    its own rows of blocks through it, on the plan a weight of its shape has (kernels forced on: Triton's
    interpreter); else those rows dequantized."""
    from engine.models.quant import QuantFusedLinear

    fmt = FORMATS["Q8_0"]
    parts = [QuantLinear(fmt, 96, n, blocks=_blocks("Q8_0", n, 96, seed=11 + n)) for n in (40, 24)]
    group = QuantFusedLinear(parts)
    x = _x(3, 96, torch.bfloat16, seed=12)
    want = F.linear(x, parts[1].dequantized(torch.bfloat16))
    assert torch.equal(group.part(x, 1), want)  # (no CUDA: dequantized)
    monkeypatch.setattr(fused, "use_kernels", lambda *tensors: True)
    calls = []
    kernel = qk.kernel_linear
    monkeypatch.setattr(qk, "kernel_linear", lambda *a: calls.append(a[1].data_ptr()) or kernel(*a))
    plan = lin.plan_for_shape(24, 96, x.device)
    assert torch.equal(group.part(x, 1), _reference(x, parts[1].blocks, fmt, 96, None, plan.step))
    assert calls == [group.blocks[40:].data_ptr()]


# ------------------------------------------------------------------------------------------ on the GPU

GPU_CASES = [("Q4_1", 960, 576), ("Q8_0", 49152, 576), ("Q8_0", 5120, 6144), ("Q4_0", 576, 1536), ("Q5_0", 576, 1536),
             ("Q5_1", 576, 1536), ("Q4_K", 576, 1536), ("Q5_K", 576, 1536), ("Q6_K", 576, 1536), ("Q4_K", 34816, 5120),
             ("Q4_K", 5120, 17408), ("Q6_K", 5120, 17408), ("Q6_K", 1024, 5120)]
GPU_CASES += [case for case in lin.TUNED_NATIVE[(9, 0)] if case not in GPU_CASES]  # every format's own plan too


@pytest.mark.skipif(DEVICE != "cuda", reason="the matrix unit's own order: on a GPU")
@pytest.mark.parametrize(("name", "n", "k"), GPU_CASES, ids=lambda c: str(c))
def test_on_the_gpu_native_equals_dequantized_and_rows_round_alike(name, n, k):
    """Through the engine's dispatch in bf16 on the GPU, SmolLM2's and the 27B shape's weights (tuned, native and
    default plans): the blocks' product equals the dequantized weight's on the dense kernel and the same plan
    (``Linear``'s where the weight takes its shape's plan; a format's own, ``linear.TUNED_NATIVE``, splits K its own
    way) bit for bit at 1 to 200 rows, and a row's bits are the same alone, among 7, 16, 17, 33, 65 and 200."""
    previous = fused.set_kernels(True)
    try:
        fmt = FORMATS[name]
        from engine.models.quantize import quantize

        weight = 0.02 * torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        layer = QuantLinear(fmt, k, n, blocks=hold(quantize(weight, fmt), fmt))
        twin = Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            twin.weight.copy_(layer.dequantized(torch.bfloat16))
        x = torch.randn(200, k, device="cuda", dtype=torch.bfloat16)
        plan = lin.plan_for_shape(n, k, x.device, name)
        if plan == lin.plan_for_shape(n, k, x.device):
            dequantized = twin
        else:  # the dense kernel on the format's own plan
            def dequantized(rows_x):
                return lin.linear(rows_x, twin.weight, config=plan.for_rows(rows_x.shape[0]))
        with torch.no_grad():
            whole = layer(x)
            assert torch.equal(whole, dequantized(x))
            exact = F.linear(x.float(), twin.weight.float())
            assert float((whole.float() - exact).norm() / exact.norm()) < 1e-2
            for rows in ([0], [199], list(range(7)), list(range(16)), list(range(17)), list(range(33)),
                         list(range(100, 165)), [150, 3, 77, 0, 199, 42, 8]):
                got = layer(x[rows])
                assert torch.equal(got, whole[rows]), f"{len(rows)} rows"
                assert torch.equal(got, dequantized(x[rows])), f"{len(rows)} rows against the dequantized weight"
    finally:
        fused.set_kernels(previous)
