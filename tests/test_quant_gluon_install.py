"""``benchmarks/quant_gluon.py``: the operand-register decode's static counts (it compiles for sm_90 with the decoded
tile never in shared memory) and ``install``, a benchmark's routing of products through it with options the engine
does not take (``engine.models.quant_gluon`` itself: ``tests/engine/models/test_quant_gluon.py``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.models.quant import FORMATS
from tests.engine.gguf_files import random_blocks

gguf = pytest.importorskip("gguf")
BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import quant_gluon  # noqa: E402

N, K = 100, 512  # rows not a multiple of the 64-row tile; two 256-value blocks, four 128-column tiles


def _blocks(seed: int, n: int = N) -> torch.Tensor:
    return torch.from_numpy(random_blocks(gguf.GGMLQuantizationType.Q4_K, n, K, seed, scale=0.05))


@pytest.mark.skipif(quant_gluon.gluon is None or not (Path(__import__("triton").__file__).parent / "backends"
                    / "nvidia" / "bin" / "cuobjdump").is_file(), reason="no Gluon, or no NVIDIA tools in this Triton")
def test_it_compiles_for_hopper_with_the_decoded_tile_never_in_shared_memory():
    """The point, statically (sm_90, a process of its own: Triton's interpreter may be on here): the conversion into
    the operand layout is a renaming (``assert_trivial``: the layout is the operand's, not where each nibble lands,
    which the last test replays), and the K loop's shared memory holds the x tile (the float decode's steps too)
    only."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for warps in (4, 8):
        proc = subprocess.run([sys.executable, str(BENCH / "quant_gluon.py"), "--rows", "16", "64", "--warps",
                               str(warps)], capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = re.findall(r"^\| (float|pairs|q6_k|q4_1) \| (\d+) \| \d+ \| \d+ \| [\d.]+ \| (\d+) \| (\d+) \| (\d+) \|",
                          proc.stdout, flags=re.M)
        assert [r[:2] for r in rows] == [(d, m) for d in ("float", "pairs", "q6_k", "q4_1") for m in ("16", "64")], \
            proc.stdout
        for decode, block_m, hgmma, sts, lds in rows:
            # shared memory: the x tile [128, BLOCK_M] bf16 in 16-byte stores over 32 W threads; the float decode's
            # four step / offset tensors [8 W, 4] too (one a thread where they are decoded, four a thread where
            # used: a 16-byte read each; the pair decode gathers them by warp shuffles); the decoded tile (the
            # engine kernel's 15 LDS + 8 LDSM a tile) not at all
            steps = 4 if decode == "float" else 0
            x_stores = 128 * int(block_m) * 2 // 16 // (32 * warps)
            assert int(hgmma) == 8 and int(lds) == steps and int(sts) == x_stores + steps, (warps, rows)


@pytest.mark.skipif(quant_gluon.gluon is None or not (Path(__import__("triton").__file__).parent / "backends"
                    / "nvidia" / "bin" / "cuobjdump").is_file(), reason="no Gluon, or no NVIDIA tools in this Triton")
def test_the_options_compile_for_hopper_staged_with_pdl_and_with_a_tail():
    """The engine's options, statically (sm_90): ``STAGES`` 3 with ``PDL`` (the engine's since 2026-12-07: the planes
    by cp.async, no x tile stored from registers) and a tail of 8 after 32 rows on 8 warps (``TAILS``, the engine's
    since 2026-12-07: two products a tile, 16 HGMMA), and on 16 warps (``WIDE_WARPS`` 16: 256-row tiles)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for flags, hgmma, sts in [(["--rows", "16", "--stages", "3", "--pdl"], "8", "0"),
                              (["--rows", "32", "--tail", "8", "--warps", "8"], "16", None),
                              (["--rows", "32", "--tail", "8", "--warps", "16", "--pdl"], "16", None)]:
        proc = subprocess.run([sys.executable, str(BENCH / "quant_gluon.py"), *flags], capture_output=True, text=True,
                              env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = re.findall(r"^\| (pairs|q6_k|q4_1) \| \d+ \| \d+ \| \d+ \| [\d.]+ \| (\d+) \| (\d+) \| \d+ \| "
                          r"([^|]*) \|", proc.stdout, flags=re.M)
        assert [r[0] for r in rows] == ["pairs", "q6_k", "q4_1"], proc.stdout
        for _, got_hgmma, got_sts, loads in rows:
            assert got_hgmma == hgmma and (sts is None or got_sts == sts), (flags, rows)
            assert ("LDGSTS" in loads) == ("--stages" in flags), (flags, loads)


@pytest.mark.parametrize("pairs", [False, True])
def test_install_routes_only_bf16_q4_k_products_of_whole_blocks_and_repacks_a_weight_once(monkeypatch, pairs):
    """``gpu_bench.py --q4k-decode gluon`` (``gluon-pairs``: Q6_K too): bf16 rows (any count: row blocks) of a Q4_K
    weight of whole blocks and no bias take the prototype, its weight repacked on the first call and kept; anything
    else the engine's kernel."""
    from engine.models import quant_kernel as qk

    calls, packs = [], []
    blocks = _blocks(seed=2)
    q6 = torch.zeros(N, FORMATS["Q6_K"].row_bytes(K), dtype=torch.uint8)
    monkeypatch.setattr(qk, "linear", lambda x, blocks, fmt, cols, bias=None: calls.append("engine"))
    monkeypatch.setattr(quant_gluon, "repack", lambda b, cols, pairs: packs.append((cols, pairs)) or ("words", "heads"))
    monkeypatch.setattr(quant_gluon, "repack_q6_k", lambda b, cols: packs.append((cols, "Q6_K")) or "planes")
    monkeypatch.setattr(quant_gluon, "linear", lambda x, w, h, n, cols, split=1, pairs=False, x_ahead=False,
                        warps=None: calls.append(("gluon", tuple(x.shape), w, h, n, split, pairs,
                                                                    warps)) or torch.zeros(x.shape[0], n))
    monkeypatch.setattr(quant_gluon, "linear_q6_k", lambda x, planes, n, cols, split=1, x_ahead=False, warps=None:
                        calls.append(("gluon-q6", tuple(x.shape), planes, n, split, warps))
                        or torch.zeros(x.shape[0], n))
    warps = 8 if pairs else None  # asked for, every launch's; else the launch's own choice
    quant_gluon.install(pairs, warps=warps)  # wraps the (fake) engine linear above; monkeypatch restores it after
    cases = [("Q4_K", 1, None, torch.bfloat16, "gluon"), ("Q4_K", 64, None, torch.bfloat16, "gluon"),
             ("Q4_K", 65, None, torch.bfloat16, "gluon"), ("Q6_K", 1, None, torch.bfloat16, "gluon-q6" if pairs
                                                              else "engine"),
             ("Q8_0", 1, None, torch.bfloat16, "engine"),
             ("Q4_K", 1, torch.zeros(4), torch.bfloat16, "engine"), ("Q4_K", 1, None, torch.float16, "engine")]
    for fmt, rows, bias, dtype, want in cases:
        calls.clear()
        weight = q6 if fmt == "Q6_K" else blocks
        out = qk.linear(torch.zeros(rows, K, dtype=dtype), weight, FORMATS[fmt], K, bias)
        assert [c if c == "engine" else c[0] for c in calls] == [want], (fmt, rows, bias, dtype)
        if want == "gluon":
            assert calls[0][1:] == ((rows, K), "words", "heads", N, quant_gluon.split_for(N, K), pairs, warps)
        if want == "gluon-q6":
            assert calls[0][1:] == ((rows, K), "planes", N, quant_gluon.split_for(N, K), warps)
        if want != "engine":
            assert out.shape == (rows, N)
    assert packs == [(K, pairs)] + ([(K, "Q6_K")] if pairs else [])  # each weight, repacked once


def test_install_asks_for_eight_warps_only_where_they_take_whole_tiles(monkeypatch):
    """``--gluon-warps 8`` on a weight whose padded rows are not whole 128-row tiles (60 rows: 64) leaves that
    weight's launches their own choice instead of failing the run."""
    from engine.models import quant_kernel as qk

    asked = []

    def fake_linear(x, words, heads, n, cols, split=1, pairs=False, x_ahead=False, warps=None):
        asked.append(warps)
        return torch.zeros(x.shape[0], n)

    monkeypatch.setattr(qk, "linear", lambda x, blocks, fmt, cols, bias=None: None)
    monkeypatch.setattr(quant_gluon, "repack", lambda b, cols, pairs: ("words", "heads"))
    monkeypatch.setattr(quant_gluon, "linear", fake_linear)
    quant_gluon.install(pairs=True, warps=8)
    for n in (60, 100):
        blocks = torch.zeros(n, FORMATS["Q4_K"].row_bytes(K), dtype=torch.uint8)
        qk.linear(torch.zeros(1, K, dtype=torch.bfloat16), blocks, FORMATS["Q4_K"], K)
    assert asked == [None, 8]


def test_the_q4_1_bench_flag_without_the_bench_is_refused(capsys):
    """``quant_gluon.py --q4-1`` picks ``--bench``'s weights; alone it would do nothing (the static counts cover every
    decode): refused, exit 2, before anything is compiled."""
    with pytest.raises(SystemExit) as exit_:
        quant_gluon.main(["--q4-1"])
    assert exit_.value.code == 2 and "--q4-1: a choice of --bench's weights" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--bench", "--launches"], "--bench and --launches: one table a run"),
    (["--fold", "--stages", "3"], "--fold with --stages 3: a folded program takes the register path"),
])
def test_a_bad_mix_of_the_static_counts_and_bench_flags_is_refused(capsys, argv, says):
    """Two tables asked for at once, or a fold with shared-memory stages (which do not fold): refused, exit 2, before
    anything is compiled or timed."""
    with pytest.raises(SystemExit) as exit_:
        quant_gluon.main(argv)
    assert exit_.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's")
def test_the_launches_sweep_without_a_gpu_exits_2_naming_it(capsys):
    assert quant_gluon.main(["--launches"]) == 2
    assert "--launches needs CUDA" in capsys.readouterr().err
