"""``engine.memory`` on CUDA (skipped without it), issue #28's bar: the planned static parts equal the
tensors the pair holds, and a generation's measured peak (``torch.cuda.max_memory_allocated``, after a
warm-up that captures the graphs) is within 10% of the plan's total, for the Qwen3-8B and Qwen3.5-27B
timing shapes at long contexts, and the SmolLM2 shape at a long prompt (prefilled in chunks) and a short one
(one masked forward).

    pytest -q -s -n 0 tests/engine/test_memory_gpu.py    # -s prints plan against measurement, per part
    pytest -q -s -n 0 tests/engine/test_memory_gpu.py -k "q4_k_m and not draft"    # the 27B Q4_K_M at 32k tokens
    pytest -q -s -n 0 tests/engine/test_memory_gpu.py -k draft    # the same with its draft in blocks (Q8_0, Q4_K_M)
    pytest -q -s -n 0 tests/engine/test_memory_gpu.py -k "draft-q8_0 and ddtree"    # one config of one case

Each (case, config) is a test of its own (ids ``<case>-<config>``); the pair loaded is kept for the next test
of the same case (a 27B's takes ~45 s), freed when the case changes and at the module's end.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest
import torch

import engine
from engine import EngineConfig
from engine.memory import MEMORY_PARTS, held_memory, measure_memory, plan_memory, release_memory, reserve_memory

# one process holds the cached pair (``-n auto`` would build a 27B on the one GPU in each worker)
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"), pytest.mark.gpu,
              pytest.mark.xdist_group("memory_gpu")]

SMOLLM2_DRAFT = str(Path(engine.__file__).parent / "checkpoints" / "smollm2-135m-dflash")
# target, draft, context (prompt + new tokens), new tokens, the bar on |measured - planned| / measured; the
# last is the seed user's question (issue #28): the 27B at Q4_K_M held in its blocks (weights native), its
# draft, 32k tokens, against 24 GB
# (SmolLM2's bar was 25% until its plan counted the draft's cuBLAS workspaces: 2026-12-07, within 7.1% at 4096)
CASES = [("smollm2-135m-shape", SMOLLM2_DRAFT, 4096, 64, 0.10),
         ("smollm2-135m-shape", SMOLLM2_DRAFT, 448, 64, 0.10),  # a prompt of 384: one forward, not chunks
         ("qwen3-8b-shape", "qwen3-8b-shape-dflash", 8192, 64, 0.10),
         ("qwen35-27b-shape", "qwen35-27b-shape-dflash", 16384, 64, 0.10),
         ("qwen35-27b-shape-q4_k_m", "qwen35-27b-shape-dflash", 32768, 64, 0.10),
         # the draft in blocks: Q8_0, and Q4_K_M's mix (planned 20.80 and 19.99 GiB for the reference DDTree-22;
         # 22.40 in bf16)
         ("qwen35-27b-shape-q4_k_m", "qwen35-27b-shape-dflash@q8_0", 32768, 64, 0.10),
         ("qwen35-27b-shape-q4_k_m", "qwen35-27b-shape-dflash@q4_k_m", 32768, 64, 0.10)]
# the reference DDTree first: at 32k tokens on the 27B a config takes a minute or more, and a call's limit may
# cut the rest (each config's rows are printed as it ends)
CONFIGS = {"ddtree-graphs": EngineConfig(budget=22, top_k=8), "ar": EngineConfig(verify="ar"),
           "chain-generic": EngineConfig(verify="chain", draft_path="generic")}
STATIC = ("target_weights", "draft_weights", "kv_cache", "recurrent_state", "tree_state", "features", "draft_context")


_CASE_IDS = [c[0] + ("-draft-" + c[1].rpartition("@")[2] if "@" in c[1] else "") + ("-short" if c[2] < 1024 else "")
             for c in CASES]
# the one pair loaded: (target, draft, weights) -> (pair, memory allocated before it was loaded)
_LOADED: dict[tuple[str, str, str], tuple[object, int]] = {}


def _free_pair() -> None:
    _LOADED.clear()  # the pair's last reference (a test's own is deleted as it ends)
    gc.collect()
    torch.cuda.empty_cache()


def _load_pair(target: str, draft: str, weights: str):
    key = (target, draft, weights)
    if key not in _LOADED:
        _free_pair()
        before = torch.cuda.memory_allocated()  # what other tests left: not this pair's
        _LOADED[key] = (engine.load(target, draft, device="cuda", dtype="bfloat16", weights=weights), before)
    return _LOADED[key]


@pytest.fixture(scope="module", autouse=True)
def _free_the_loaded_pair():
    yield
    _free_pair()


@pytest.mark.parametrize("target,draft,context,new,bar,name", [(*c, n) for c in CASES for n in CONFIGS],
                         ids=[f"{i}-{n}" for i in _CASE_IDS for n in CONFIGS])
def test_measured_peak_within_the_bar_of_the_plan(target, draft, context, new, bar, name):
    weights = "native" if target.endswith("q4_k_m") else "dequantized"  # (a quantized preset: kept in its blocks)
    pair, before = _load_pair(target, draft, weights)
    prompt = torch.randint(10, pair.target.cfg.vocab_size, (context - new,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    cfg = CONFIGS[name]
    try:  # (a failure's traceback, kept by pytest, must not hold the pair past the next case's load)
        start = time.perf_counter()
        plan = plan_memory(pair, cfg, len(prompt), new)
        reserve_memory(pair, cfg, len(prompt), new)
        engine.bench(pair, cfg, [prompt], new, ignore_eos=True)  # warm-up: kernels compiled, graphs captured
        peak = engine.bench(pair, cfg, [prompt], new, ignore_eos=True).peak_memory_bytes - before
        measured = measure_memory(pair, cfg, len(prompt), new, peak)
        held = held_memory(pair)
        _print_rows(f"{target} {name} at {context} tokens ({plan.loop}, {time.perf_counter() - start:.0f} s)",
                    plan, measured)
        assert {k: held[k] for k in STATIC} == {k: plan.parts[k] for k in STATIC}, name
        assert abs(measured.total - plan.total) <= bar * measured.total, (name, plan.total, measured.total)
    except AssertionError:
        raise
    except Exception:  # an engine error (out of memory...) may leave the pair half-reserved: not for the next config
        _free_pair()
        raise
    finally:
        del pair


def test_a_configs_measured_peak_leaves_out_the_configs_measured_before_it():
    """One pair, configs measured one after another as a sweep's trials are (``reserve_memory`` before each): what
    the pair holds between configs stays what it held after the first, and the last config, AR again, measures the
    peak the first AR did. On 2026-12-07 (the fifteenth session, an H100) the SmolLM2 weights sweep's measured peaks
    grew by ~170 MiB a config (its "activations": 78 MiB at the first AR trial, 950 at the same config eight trials
    on): the cuBLAS workspace PyTorch keeps per stream, one for each stream a capture's warm-up ran on, which
    ``release_memory`` now gives back; the rotary tables made per workspace length stayed too (~0.5 MiB a config)."""
    pair, before = _load_pair("smollm2-135m-shape", SMOLLM2_DRAFT, "dequantized")
    new = 64
    prompt = torch.randint(10, pair.target.cfg.vocab_size, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
    totals, idle = [], []
    try:
        for cfg in (EngineConfig(verify="ar"), EngineConfig(budget=22, top_k=8), EngineConfig(verify="chain"),
                    EngineConfig(budget=48, top_k=8), EngineConfig(verify="ar")):
            release_memory(pair)
            idle.append(torch.cuda.memory_allocated() - before)  # what the pair holds between configs
            reserve_memory(pair, cfg, len(prompt), new)
            engine.bench(pair, cfg, [prompt], new, ignore_eos=True)  # warm-up: graphs captured
            peak = engine.bench(pair, cfg, [prompt], new, ignore_eos=True).peak_memory_bytes - before
            totals.append(measure_memory(pair, cfg, len(prompt), new, peak).total)
            print(f"{cfg.verify} budget {cfg.budget}: held between configs {idle[-1] / 2**20:.1f} MiB, measured "
                  f"{totals[-1] / 2**20:.1f} MiB, planned {plan_memory(pair, cfg, len(prompt), new).total / 2**20:.1f}"
                  f"\n  {_allocated_by_pool_and_stream()}", flush=True)
        # (after the first config: what it cached once for every later one, rotary tables and the like, stays)
        assert idle[-1] - idle[1] <= 2**20, [round(t / 2**20, 1) for t in idle]
        assert abs(totals[-1] - totals[0]) <= 0.05 * totals[0], [round(t / 2**20, 1) for t in totals]
    finally:
        del pair


def _allocated_by_pool_and_stream() -> str:
    """The allocator's allocated bytes per (pool, stream) (a leak's owner: a graph pool kept, or a stream's buffer)."""
    sums: dict[tuple, int] = {}
    for seg in torch.cuda.memory_snapshot():
        key = (tuple(seg.get("segment_pool_id", ())), seg.get("stream"))
        sums[key] = sums.get(key, 0) + int(seg["allocated_size"])
    return ", ".join(f"pool {k[0]} stream {k[1]:#x}: {v / 2**20:.1f} MiB" for k, v in sorted(sums.items()) if v)


def _print_rows(title: str, plan, measured) -> None:
    print(f"\n{title}: planned {plan.total / 2**30:.3f} GiB, measured {measured.total / 2**30:.3f} GiB "
          f"({(plan.total - measured.total) / measured.total:+.1%})")
    for part in MEMORY_PARTS:
        print(f"  {part:16s} planned {plan.parts[part] / 2**20:10.1f} MiB   "
              f"measured {measured.parts[part] / 2**20:10.1f} MiB", flush=True)
