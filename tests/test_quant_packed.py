"""``benchmarks/quant_packed.py``, the prototype of a Q4_K decode two values an instruction (issue #28): in
Triton's interpreter on the CPU, the product reads each weight as ``values`` says (one-hot rows pick single
weights out), its K order and the x tile's agree, a row's bits do not depend on the rows beside it, and the
values stay within two bf16 roundings of ``quant.dequantize``'s."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine.models import linear as lin
from engine.models.quant import FORMATS, dequantize
from tests.engine.gguf_files import random_blocks

pytest.importorskip("triton")
gguf = pytest.importorskip("gguf")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import quant_packed  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, K = 100, 512  # not a multiple of the tile; two super-blocks
LAUNCHES = [lin.LinearConfig(64, 128, 2), lin.LinearConfig(32, 256, 1, row_block=32)]


def _blocks(seed: int) -> torch.Tensor:
    return torch.from_numpy(random_blocks(gguf.GGMLQuantizationType.Q4_K, N, K, seed, scale=0.05)).to(DEVICE)


@pytest.mark.parametrize("launch", range(len(LAUNCHES)), ids=["k128-split2", "k256-rows32"])
def test_one_hot_rows_read_each_weight_as_values_says(launch):
    """Row k of the identity picks column k of the weight: every weight's bits, and the x tile's permutation
    matching the decode's (a swap of K positions would move the one)."""
    blocks = _blocks(seed=launch)
    eye = torch.eye(K, dtype=torch.bfloat16, device=DEVICE)  # 512 rows: row blocks of 128 (or 32)
    got = quant_packed.linear(eye, blocks, K, LAUNCHES[launch])
    want = quant_packed.values(blocks.cpu(), K).T + 0.0  # (a -0.0 weight sums to +0.0 with the zeros)
    assert torch.equal(got.cpu().view(torch.int16), want.contiguous().view(torch.int16))


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    """In the interpreter each row is summed on its own anyway; on a GPU (``quant.sh PACKED=1``) this is the claim
    exactness rests on: the matrix unit's sums of a row do not depend on the row tile's other rows."""
    blocks = _blocks(seed=7)
    x = torch.randn(17, K, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    cfg = LAUNCHES[0]
    together = quant_packed.linear(x, blocks, K, cfg)
    for i in (0, 5, 16):
        alone = quant_packed.linear(x[i:i + 1], blocks, K, cfg)
        assert torch.equal(alone[0].view(torch.int16), together[i].view(torch.int16))
    exact = x.double() @ quant_packed.values(blocks.cpu(), K).double().T.to(DEVICE)
    assert float((together.double() - exact).norm() / exact.norm()) < 1e-2


def test_the_values_are_within_two_bf16_roundings_of_dequantize():
    """The step and the offset rounded to bf16 before the product, the product rounded once: per value at most
    2**-7 of |step x q| + |offset| from the exact value (gguf's float32), and most values equal to
    ``dequantize``'s bf16."""
    blocks = _blocks(seed=3).cpu()
    exact = dequantize(blocks, FORMATS["Q4_K"], K, torch.float32).double()
    got = quant_packed.values(blocks, K).double()
    bf16 = exact.float().to(torch.bfloat16).double()
    # |step x q| + |offset| per value: dequantize with the offsets' sign flipped gives step x q + offset
    b = blocks.clone().view(N, K // 256, 144)
    flipped = b.clone()
    flipped[..., 3] ^= 0x80  # dmin's sign bit (fp16, little-endian)
    terms = (exact - dequantize(flipped.view(N, -1), FORMATS["Q4_K"], K, torch.float32).double()) / 2  # the offset
    scale = (exact - terms).abs() + terms.abs()  # |step x q| + |offset|
    assert bool(((got - exact).abs() <= 2 ** -7 * scale + 1e-30).all())
    assert float((got == bf16).double().mean()) > 0.5
    assert float((got - exact).norm() / exact.norm()) < 4e-3


def test_install_routes_only_the_q4_k_products_through_the_prototype(monkeypatch):
    """``gpu_bench.py --q4k-decode packed``: bf16 rows of a Q4_K weight of whole super-blocks and no bias take the
    prototype; any other format, bias, dtype or width the engine's kernel."""
    from engine.models import quant_kernel as qk

    calls = []
    monkeypatch.setattr(qk, "linear", lambda x, blocks, fmt, cols, bias=None: calls.append("engine"))
    monkeypatch.setattr(quant_packed, "linear", lambda x, blocks, cols, cfg=None: calls.append("packed"))
    quant_packed.install()  # wraps the (fake) engine linear above; monkeypatch restores the real one after
    cases = [("Q4_K", K, None, torch.bfloat16, "packed"), ("Q6_K", K, None, torch.bfloat16, "engine"),
             ("Q4_K", K, torch.zeros(4), torch.bfloat16, "engine"), ("Q4_K", K, None, torch.float16, "engine"),
             ("Q4_K", 288, None, torch.bfloat16, "engine")]
    for fmt, cols, bias, dtype, want in cases:
        calls.clear()
        qk.linear(torch.zeros(1, cols, dtype=dtype), None, FORMATS[fmt], cols, bias)
        assert calls == [want], (fmt, cols, bias, dtype)


@pytest.mark.slow
@pytest.mark.skipif(not (Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
                    .is_file(), reason="this Triton wheel carries no NVIDIA tools")
def test_its_loop_issues_fewer_instructions_a_value_than_the_engine_kernel():
    """The prototype's point, statically (sm_90, ``kernel_sass.py --packed``, in a process of its own: this one runs
    Triton's interpreter): on every Q4_K weight of the 27B step, its K loop issues fewer thread instructions a
    value than the engine kernel's on the same launch (2026-12-06: 5.7-5.8 against 8.3)."""
    import os
    import re
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_sass.py"),
                           "--packed"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    per_value = {(m.group(1), m.group(2)): float(m.group(3)) for m in re.finditer(
        r"^\| Q4_K (words|packed) (\d+x\d+) \| \d+ \| \d+ \| \d+ \| ([\d.]+) \|", proc.stdout, flags=re.M)}
    shapes = {shape for _, shape in per_value}
    assert len(shapes) >= 4 and all(per_value["packed", s] < per_value["words", s] for s in shapes), per_value
