"""``benchmarks/quant_gluon.py``, the prototype of a Q4_K decode straight into the matrix unit's operand registers
(issue #28). No interpreter runs Gluon, so on the CPU: the repacked words hold each thread's fragment as the module
says (explicit positions), read back as ``quant.dequantize``'s values, and the kernel compiles for sm_90 with the
decoded tile never in shared memory. On a GPU: the product against the dequantized weight's, rows invariant."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.models.quant import FORMATS, dequantize
from tests.engine.gguf_files import random_blocks

gguf = pytest.importorskip("gguf")
BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import quant_gluon  # noqa: E402

N, K = 100, 512  # rows not a multiple of the 64-row tile; two 256-value blocks, four 128-column tiles


def _blocks(seed: int) -> torch.Tensor:
    return torch.from_numpy(random_blocks(gguf.GGMLQuantizationType.Q4_K, N, K, seed, scale=0.05))


@pytest.mark.parametrize("pairs", [False, True])
def test_a_word_holds_one_threads_eight_values_of_a_slice(pairs):
    """Word [G][kt][g][t][s], nibble 4 j + 2 h + e (pairs: 4 e + 2 j + h): row 16 G + 8 h + g, column
    128 kt + 16 s + 8 j + 2 t + e (the operand layout's register bits e, h, j), read here position by position,
    not by the module's permutation; read back, the float decode's values are ``quant.dequantize``'s and the pair
    decode's ``quant_packed.values``'s."""
    import quant_packed

    blocks = _blocks(seed=0)
    words, heads = quant_gluon.repack(blocks, K, pairs)
    assert words.numel() == (128 // 16) * (K // 128) * 256 and heads.shape == (128, K // 256, 4)
    want = quant_packed.values(blocks, K) if pairs else dequantize(blocks, FORMATS["Q4_K"], K)
    assert torch.equal(quant_gluon.reference(words, heads, N, K, pairs), want)
    for G, kt, g, t, s in [(0, 0, 0, 0, 0), (1, 2, 5, 3, 7), (6, 3, 3, 1, 4), (5, 1, 7, 2, 2)]:
        word = int(words[((G * (K // 128) + kt) * 8 + g) * 32 + t * 8 + s]) & 0xFFFFFFFF
        for j in range(2):
            for h in range(2):
                for e in range(2):
                    row, col = 16 * G + 8 * h + g, 128 * kt + 16 * s + 8 * j + 2 * t + e
                    got = (word >> (4 * ((4 * e + 2 * j + h) if pairs else (4 * j + 2 * h + e)))) & 15
                    if row >= N:
                        assert got == 0  # padded rows are zero
                        continue
                    blk, v = divmod(col, 256)  # Q4_K: 32-byte chunk c holds values 64 c + i (low), 64 c + 32 + i
                    chunk, i = divmod(v, 64)
                    byte = int(blocks[row, blk * 144 + 16 + chunk * 32 + i % 32])
                    assert got == (byte >> 4 if i >= 32 else byte & 15), (G, kt, g, t, s, j, h, e)


@pytest.mark.skipif(quant_gluon.gluon is None or not (Path(__import__("triton").__file__).parent / "backends"
                    / "nvidia" / "bin" / "cuobjdump").is_file(), reason="no Gluon, or no NVIDIA tools in this Triton")
def test_it_compiles_for_hopper_with_the_decoded_tile_never_in_shared_memory():
    """The point, statically (sm_90, a process of its own: Triton's interpreter may be on here): the conversion into
    the operand layout is a renaming (``assert_trivial``: the layout is the operand's, not where each nibble lands,
    which the last test replays), and the K loop's shared memory holds the x tile and the steps only."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(BENCH / "quant_gluon.py"), "--rows", "16", "64"], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^\| (float|pairs) \| (\d+) \| \d+ \| \d+ \| [\d.]+ \| (\d+) \| (\d+) \| (\d+) \|",
                      proc.stdout, flags=re.M)
    assert [r[:2] for r in rows] == [("float", "16"), ("float", "64"), ("pairs", "16"), ("pairs", "64")], proc.stdout
    for _, block_m, hgmma, sts, lds in rows:
        # 8 products of 16 columns a 128-column tile; the x tile [128, BLOCK_M] bf16 in 16-byte stores
        # shared memory: the x tile [128, BLOCK_M] bf16 in 16-byte stores, and the four step / offset tensors
        # [32, 4] (one a thread where they are decoded, four a thread where used: a 16-byte read each); the decoded
        # tile (the engine kernel's 15 LDS + 8 LDSM a tile) not at all
        assert int(hgmma) == 8 and int(lds) == 4 and int(sts) == 128 * int(block_m) * 2 // 16 // 128 + 4, rows


@pytest.mark.skipif(not torch.cuda.is_available() or quant_gluon.gluon is None, reason="needs CUDA and Gluon")
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("pairs", [False, True])
def test_on_the_gpu_the_product_is_its_weights_and_rows_do_not_round_together(split, pairs):
    """Each row of the product is the dot of its x row with the decode's weight (``reference``: one-hot rows read
    the weight's values back bit for bit), and its bits do not depend on the rows launched beside it."""
    blocks = _blocks(seed=1).cuda()
    words, heads = quant_gluon.repack(blocks, K, pairs)
    weight = quant_gluon.reference(words, heads, N, K, pairs).to(torch.bfloat16)
    eye = torch.eye(64, K, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(quant_gluon.linear(eye, words, heads, N, K, split, pairs), weight[:, :64].T)
    x = torch.randn(33, K, device="cuda", dtype=torch.bfloat16)
    many = quant_gluon.linear(x, words, heads, N, K, split, pairs)
    assert torch.equal(quant_gluon.linear(x[:1], words, heads, N, K, split, pairs), many[:1])
    exact = x.double() @ weight.double().T
    assert float((many.double() - exact).norm() / exact.norm()) < 1e-2


def test_install_routes_only_few_row_q4_k_products_and_repacks_a_weight_once(monkeypatch):
    """``gpu_bench.py --q4k-decode gluon``: bf16 rows (up to 64) of a Q4_K weight of whole blocks and no bias take
    the prototype, its weight repacked on the first call and kept; anything else the engine's kernel."""
    from engine.models import quant_kernel as qk

    calls, packs = [], []
    blocks = _blocks(seed=2)
    monkeypatch.setattr(qk, "linear", lambda x, blocks, fmt, cols, bias=None: calls.append("engine"))
    monkeypatch.setattr(quant_gluon, "repack", lambda b, cols, pairs: packs.append((cols, pairs)) or ("words", "heads"))
    monkeypatch.setattr(quant_gluon, "linear", lambda x, w, h, n, cols, split=1, pairs=False: calls.append(
        ("gluon", tuple(x.shape), w, h, n, split, pairs)) or torch.zeros(x.shape[0], n))
    quant_gluon.install(pairs=True)  # wraps the (fake) engine linear above; monkeypatch restores the real one after
    cases = [("Q4_K", 1, None, torch.bfloat16, "gluon"), ("Q4_K", 64, None, torch.bfloat16, "gluon"),
             ("Q4_K", 65, None, torch.bfloat16, "engine"), ("Q6_K", 1, None, torch.bfloat16, "engine"),
             ("Q4_K", 1, torch.zeros(4), torch.bfloat16, "engine"), ("Q4_K", 1, None, torch.float16, "engine")]
    for fmt, rows, bias, dtype, want in cases:
        calls.clear()
        out = qk.linear(torch.zeros(rows, K, dtype=dtype), blocks, FORMATS[fmt], K, bias)
        assert [c if c == "engine" else c[0] for c in calls] == [want], (fmt, rows, bias, dtype)
        if want == "gluon":
            assert calls[0][1:] == ((rows, K), "words", "heads", N, quant_gluon.split_for(N, K), True)
            assert out.shape == (rows, N)
    assert packs == [(K, True)]  # the one weight, repacked once


@pytest.mark.parametrize("pairs", [False, True])
def test_the_kernels_joins_and_permutation_put_each_nibble_at_its_row_and_column(pairs):
    """``_gluon_kernel``'s assembly of a 64 x 128 tile replayed in PyTorch (a join is a stack on a new minor
    dimension; the pair decode's ``mov`` splits an int32 into its low then high 16 bits on a new minor dimension):
    its word addresses, its nibbles' joins, its reshape and permutation give the tile of the natural weight. The
    compile checks that the layout is the operand's; this checks that the data is the tile's (the first version
    joined the nibbles the other way round and compiled all the same)."""
    from engine.models.quant import _nibbles

    blocks = _blocks(seed=3)
    words, _ = quant_gluon.repack(blocks, K, pairs)
    q = _nibbles(blocks.reshape(-1, 144)[:, 16:].reshape(-1, 4, 32)).reshape(N, K)

    def join(a, b):
        return torch.stack([a, b], dim=-1)

    rr, cc = torch.arange(32)[:, None], torch.arange(32)[None, :]
    for tile in range(2):
        for kt in range(K // 128):
            wbase = (tile * 4 + rr // 8) * ((K // 128) * 256) + (rr % 8) * 32 + cc  # as the kernel's
            w = words[wbase + kt * 256].to(torch.int64) & 0xFFFFFFFF
            if pairs:  # _pairs_tile: (w >> 4 (2 j + h)) & 0x000F000F, joined on j then h, split into halves
                p = [(w >> (4 * n)) & 0x000F000F for n in range(4)]
                both = join(join(p[0], p[2]), join(p[1], p[3]))
                a = join(both & 0xFFFF, both >> 16)
            else:  # _values_tile
                v = [(w >> (4 * n)) & 15 for n in range(8)]
                a = join(join(join(v[0], v[4]), join(v[2], v[6])), join(join(v[1], v[5]), join(v[3], v[7])))
            a = a.reshape(4, 8, 4, 8, 2, 2, 2).permute(0, 5, 1, 3, 4, 2, 6).reshape(64, 128)
            rows = slice(64 * tile, min(64 * tile + 64, N))
            assert torch.equal(a[: rows.stop - rows.start], q[rows, 128 * kt:128 * kt + 128]), (tile, kt)
            assert not a[rows.stop - rows.start:].any()  # padded rows
