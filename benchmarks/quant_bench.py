"""Weights kept in GGUF blocks on the GPU (`quant`): the in-register kernel (``engine.models.quant_kernel``)
against the weight dequantized per call and then multiplied (what a native load did before it), and
against the bf16 weight on the dense few-row kernel (a dequantized load). Run through
``benchmarks/kernel_bench.py quant``."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence

import torch
from kernel_timing import time_us as _time

# (label, N, K, formats): SmolLM2-135M's fused weights (its GGUF is Q4_1; K = 576 is not whole 256-value
# blocks, so no K format) and the Qwen3.5-27B shape's MLP and output projections (a Q4_K_M file: Q4_K,
# Q6_K for the down projections of some layers and the head)
QUANT_SHAPES = [
    ("SmolLM2 qkv", 960, 576, ("Q4_1", "Q8_0")), ("SmolLM2 gate_up", 3072, 576, ("Q4_1", "Q8_0")),
    ("SmolLM2 down", 576, 1536, ("Q4_1", "Q4_K", "Q6_K")), ("SmolLM2 lm_head", 49152, 576, ("Q4_1", "Q8_0")),
    ("27B down", 5120, 17408, ("Q4_K", "Q6_K")), ("27B gate or up", 17408, 5120, ("Q4_K",)),
    ("27B gate_up", 34816, 5120, ("Q4_K",)), ("27B o_proj", 5120, 6144, ("Q4_K", "Q8_0")),
    ("27B lm_head", 248320, 5120, ("Q6_K",)), ("27B GDN in_proj", 16480, 5120, ("Q4_K",)),
    ("27B qkv", 14336, 5120, ("Q4_K",)), ("27B q_proj", 12288, 5120, ("Q4_K",)),
    ("27B k or v", 1024, 5120, ("Q4_K", "Q6_K")),
]
STEP_PRESET = "qwen35-27b-shape-q4_k_m"  # the preset whose AR step the 1-row kernel times add up to
QUANT_ROWS = (1, 16, 33)  # an AR step, a step launch's widest, a budget-32 verify
ROTATE_BYTES = 256 * 2**20  # weight copies cycled through, so that a launch reads its weight from HBM (L2: 50 MB)


def _copies(nbytes: int) -> int:
    return max(2, -(-ROTATE_BYTES // nbytes))


def bench_quant(shapes: list[tuple[str, int, int, tuple[str, ...]]] | None = None, rows: tuple[int, ...] = QUANT_ROWS
                ) -> tuple[list[dict], list[str]]:
    """GPU us per call at each row count for each weight and format: the in-register kernel on the
    weight's plan, the weight dequantized then multiplied (``quant.dequantize`` + ``linear.linear``), and
    the bf16 weight on the dense kernel; the kernel's weight stream in GB/s at 1 row; whether its output
    equals the dequantize-then-multiply one bit for bit at every row count (the exactness claim of
    ``quant_kernel``: native and dequantized weights decode alike) and a row's bits at 1 row equal its
    bits among the most rows (row invariance); where the kernel reads a weight's blocks as 32-bit words,
    the half-word decode's times on the same launches too."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    step_launches()  # built first (a model on the meta device, seconds): a time limit cuts timings, not the sum
    out = []
    for label, n, k, formats in shapes or QUANT_SHAPES:
        out += _quant_shape(label, n, k, formats, rows, gen)
        torch.cuda.empty_cache()
        if rows[0] == 1:  # the sum so far, each weight: what a cut run still tells
            print(step_sum(out), flush=True)
    lines = ["| weights | format | MB | " + " | ".join(f"{m} rows: kernel / dequantize / bf16 us" for m in rows)
             + f" | kernel GB/s at {rows[0]} row(s) | bits = dequantized | row-invariant | half-word decode us, "
             f"{rows[0]} / {rows[-1]} rows (its bits = dequantized) |",
             "|---|---|---|" + "---|" * (len(rows) + 4)]
    lines += [f"| {r['shape']} | {r['format']} | {r['bytes'] / 1e6:.1f} | "
              + " | ".join(f"{r['kernel'][m]:.1f} / {r['dequantize'][m]:.1f} / {r['bf16'][m]:.1f}" for m in rows)
              + f" | {r['gbs']:.0f} | {'y' if r['bits_equal_dequantized'] else 'n'} | "
              f"{'y' if r['row_invariant'] else 'n'} | "
              + (f"{r['half_words'][rows[0]]:.1f} / {r['half_words'][rows[-1]]:.1f} "
                 f"({'y' if r['half_words_bits_equal'] else 'n'}) |" if r["half_words"] else "- |")
              for r in out]
    if rows[0] == 1:
        lines += ["", step_sum(out)]
        halves = [{**r, "kernel": r["half_words"]} for r in out if r["half_words"]]
        if len(halves) == len(out):
            lines += ["", "the half-word decode's: " + step_sum(halves)]
    return out, lines


@functools.cache
def step_launches(preset: str = STEP_PRESET) -> dict[tuple[str, int, int], int]:
    """(format, N, K) -> launches an AR step of ``preset`` makes: each projection held in blocks once
    (built on the meta device: shapes only, as ``engine.load(device="meta")`` builds it)."""
    from collections import Counter

    import engine
    from engine.models.quant import QuantLinear

    target = engine.load(preset, "none", device="meta", dtype="bfloat16", weights="native").target
    return dict(Counter((m.fmt.name, m.out_features, m.in_features) for m in target.modules()
                        if isinstance(m, QuantLinear)))


def step_sum(results: list[dict], preset: str = STEP_PRESET) -> str:
    """The 1-row kernel times of ``results`` summed over an AR step's launches of ``preset``
    (``step_launches``): what the projections alone cost a step, against ``gpu_bench.py large --weights
    q4_k_m``'s AR ms/token (their gap: the step's other kernels, launch gaps, or something else). Shapes
    not timed are named, with their share of the step's blocks."""
    times = {(r["format"], r["n"], r["k"]): r["kernel"][1] for r in results}
    launches = step_launches(preset)
    timed = {key: count for key, count in launches.items() if key in times}
    total_us = sum(count * times[key] for key, count in timed.items())
    untimed = sorted(f"{f} {n}x{k} x{c}" for (f, n, k), c in launches.items() if (f, n, k) not in times)
    return (f"{preset} AR step, its quantized projections' 1-row kernel times summed: {total_us / 1000:.2f} ms "
            f"over {sum(timed.values())} of {sum(launches.values())} launches"
            + (f" (not timed: {', '.join(untimed)})" if untimed else ""))


def _rotating(copies: list[torch.Tensor]):
    """A call that returns the next of ``copies`` each time (a launch reads a weight L2 does not hold)."""
    calls = iter(range(1 << 30))
    return lambda: copies[next(calls) % len(copies)]


def _rotated(t: torch.Tensor):
    """``_rotating`` over ``t`` and as many clones as ``ROTATE_BYTES`` of them take (``_copies``)."""
    return _rotating([t] + [t.clone() for _ in range(_copies(t.numel() * t.element_size()) - 1)])


def _quant_shape(label: str, n: int, k: int, formats: tuple[str, ...], rows: tuple[int, ...],
                 gen: torch.Generator) -> list[dict]:
    from engine.models import linear as lin
    from engine.models import quant_kernel
    from engine.models.quant import FORMATS, dequantize, hold, unhold
    from engine.models.quantize import quantize

    dense = [torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
             for _ in range(_copies(2 * n * k))]
    xs = {m: torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16) for m in rows}
    pick_dense = _rotating(dense)
    bf16 = {m: _time(lambda m=m: lin.linear(xs[m], pick_dense())) for m in rows}
    out = []
    for name in formats:
        fmt = FORMATS[name]
        first = hold(quantize(dense[0], fmt), fmt)  # as a QuantLinear holds it (in planes where the format says)
        pick = _rotated(first)
        kernel = {m: _time(lambda m=m, f=fmt, p=pick: quant_kernel.linear(xs[m], p(), f, k)) for m in rows}
        # the half-word decode on the same launches, where the kernel reads this weight's blocks as words
        plan = lin.plan_for_shape(n, k, first.device, name)  # (the format's own where it has one)
        halves = ({m: _time(lambda m=m, f=fmt, p=pick, pl=plan: quant_kernel.kernel_linear(
            xs[m], p(), f, k, None, pl.for_rows(m), words=False)) for m in rows}
            if quant_kernel.reads_words(fmt, plan.step.block_k, first) else None)
        deq = {m: _time(lambda m=m, f=fmt, p=pick: lin.linear(xs[m], dequantize(unhold(p(), f), f, k, torch.bfloat16)))
               for m in rows}
        w = dequantize(unhold(first, fmt), fmt, k, torch.bfloat16)
        # against the dequantized weight on the dense kernel and the same plan (a format's own splits K its own way)
        twin = {m: lin.linear(xs[m], w, config=plan.for_rows(m)) for m in rows}
        bits = all(torch.equal(quant_kernel.linear(xs[m], first, fmt, k), twin[m]) for m in rows)
        # the half-word decode's bits too: whether a weight the word decode is slow on could take it instead
        half_bits = None if halves is None else all(torch.equal(quant_kernel.kernel_linear(
            xs[m], first, fmt, k, None, plan.for_rows(m), words=False), twin[m]) for m in rows)
        many = quant_kernel.linear(xs[max(rows)], first, fmt, k)
        invariant = torch.equal(quant_kernel.linear(xs[max(rows)][:1], first, fmt, k), many[:1])
        row = {"shape": f"{label} ({n} x {k})", "n": n, "k": k, "format": name, "bytes": first.numel(),
               "kernel": kernel, "half_words": halves, "dequantize": deq, "bf16": bf16,
               "gbs": first.numel() / kernel[rows[0]] / 1e3,
               "bits_equal_dequantized": bits, "row_invariant": invariant, "half_words_bits_equal": half_bits}
        out.append(row)
        print(f"{row['shape']} {name}: " + ", ".join(
            f"{m} rows {kernel[m]:.1f} us (dequantize {deq[m]:.1f}, bf16 {bf16[m]:.1f})" for m in rows)
            + f"; {row['gbs']:.0f} GB/s; bits = dequantized: {bits}; row-invariant: {invariant}"
            + (f"; half-word decode {halves[rows[0]]:.1f} us at {rows[0]} row(s), bits = dequantized: {half_bits}"
               if halves else ""), flush=True)
    return out


# The 1-row launches the tile sweep tries (block_n, block_k, split, warps, stages): the tiles of the dense
# plans, narrower and wider, split over K (more programs a weight: the decode is latency-bound, not the
# stream), on 4 and 8 warps (a thread decodes fewer values)
QUANT_TILES = [(bn, 128, sp, w, 3) for sp in (1, 2, 4) for bn in (32, 64, 128) for w in (4, 8)]
# by their share of the 27B Q4_K_M step (the half-word decode's 1-row times x launches, 2026-12-05, H100)
# Q8_0 since 2026-12-05: on the H200 its word decode took 175.4 us at 1 row where the half-word decode took
# 47.4, with 130 registers a thread on 8 warps (one program an SM); held in planes since (94 registers)
TILE_SHAPES = [("27B gate_up", 34816, 5120, "Q4_K"), ("27B down", 5120, 17408, "Q4_K"),
               ("27B lm_head", 248320, 5120, "Q6_K"), ("27B down", 5120, 17408, "Q6_K"),
               ("27B o_proj", 5120, 6144, "Q8_0"), ("SmolLM2 lm_head", 49152, 576, "Q8_0"),
               # SmolLM2's Q4_1 projections: 1.8-2.6x slower native than bf16 a call on an H100 (2026-12-05, the
               # half-word decode): K = 576 or 1536 in 4-12 tiles, 9-48 programs on the plan's launch
               ("SmolLM2 qkv", 960, 576, "Q4_1"), ("SmolLM2 gate_up", 3072, 576, "Q4_1"),
               ("SmolLM2 down", 576, 1536, "Q4_1")]


def bench_quant_tiles(shapes: list[tuple[str, int, int, str]] | None = None,
                      tiles: list[tuple[int, ...]] | None = None, rows: Sequence[int] = (1,)
                      ) -> tuple[list[dict], list[str]]:
    """GPU us of the block kernel at each of ``rows`` on each launch of ``tiles`` per weight (a launch that
    does not fit is skipped, said so; a format whose blocks are not 16-byte aligned also with its registers
    capped at 128), the engine's launch first (the weight's plan, its stages and register cap): how much of
    the time the launch shape leaves, ahead of a
    per-format plan (a plan of its own splits K its own way: native and dequantized weights would then round
    apart, each still row-invariant on its one plan). Past ``linear.STEP_ROWS`` rows (a verify's launch)
    only the tiles that split K as the plan's step does are tried, each with every row block: a verify's
    rows must sum in its steps' order, so its launch may change the tile's width, warps and row block, not
    the K partition."""
    from engine.models import linear as lin
    from engine.models import quant_kernel
    from engine.models.quant import FORMATS, hold
    from engine.models.quantize import quantize

    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for label, n, k, name in shapes or TILE_SHAPES:
        fmt = FORMATS[name]
        first = hold(quantize(torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02, fmt), fmt)
        pick = _rotated(first)
        plan = lin.plan_for_shape(n, k, first.device, name)
        for m in rows:
            x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
            own = plan.for_rows(m)
            configs = [lin.LinearConfig(*t) for t in tiles or QUANT_TILES]
            if m > lin.STEP_ROWS:  # (row blocks past the format's cap launch as the cap: left out)
                widest = quant_kernel.ROW_BLOCK_CAP.get(name, lin.ROW_BLOCK)
                configs = [dataclasses.replace(c, row_block=rb) for c in configs for rb in (16, 32, 64, 128)
                           if (c.split, c.block_k) == (plan.step.split, plan.step.block_k) and rb <= widest]
            timed = []
            # over 128 registers a thread on 8 warps, one program an SM: the unaligned formats' decodes
            caps = (0, 128) if fmt.nbytes % 16 else (0,)  # 0: no cap
            # the engine's launch first (its stages and register cap: None), then the plan's on the dense
            # kernel's stages where the block kernel's rule takes fewer (quant_kernel.launch_stages: at most
            # MAX_VERIFY_STAGES on a verify's tile, for programs an SM), then the other tiles
            block_m = quant_kernel.launch_shape(fmt, own, m)[0]
            dense_stages = lin.stages_for(own, block_m, 2)
            launches = [(own, None, None)] + (
                [(own, dense_stages, None)] if dense_stages != quant_kernel.launch_stages(own, block_m, 2) else []
            ) + [(c, None, cap) for c in [own, *configs] for cap in caps if (c, cap) != (own, None)]
            for cfg, stages, cap in launches:
                try:
                    us = _time(lambda c=cfg, p=pick, x=x, f=fmt, k=k, r=cap, s=stages: quant_kernel.kernel_linear(
                        x, p(), f, k, None, c, max_registers=r, stages=s))
                except Exception as exc:  # shared memory or registers past the GPU's: skipped, said so
                    print(f"  {label} {name} {m} rows {cfg}: {str(exc).splitlines()[0][:100]}", flush=True)
                    continue
                runs = stages or quant_kernel.launch_stages(cfg, quant_kernel.launch_shape(fmt, cfg, m)[0], 2)
                launch = (f"{cfg.block_n}x{cfg.block_k} split {cfg.split}, {cfg.num_warps} warps, "
                          f"rows {cfg.row_block}, {runs} stages" + (" (the dense rule's)" if stages else "")
                          + (" (the engine's launch)" if cap is None and stages is None
                             else f", maxnreg {cap}" if cap else ""))
                timed.append((us, launch))
                print(f"{label} {name} {m} rows {launch}: {us:.1f} us", flush=True)
            best_us, best = min(timed, key=lambda t: t[0])
            out.append({"shape": f"{label} ({n} x {k})", "format": name, "rows": m, "bytes": first.numel(),
                        "own_us": timed[0][0], "own": str(own), "best_us": best_us, "best": str(best),
                        "tried": [{"cfg": c, "us": u} for u, c in timed]})
        del first, pick
        torch.cuda.empty_cache()
    lines = ["| weights | format | rows | MB | the engine's launch, us (GB/s) | fastest launch | its us (GB/s) |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['format']} | {r['rows']} | {r['bytes'] / 1e6:.1f} | {r['own_us']:.1f} "
              f"({r['bytes'] / r['own_us'] / 1e3:.0f}) | `{r['best']}` | {r['best_us']:.1f} "
              f"({r['bytes'] / r['best_us'] / 1e3:.0f}) |" for r in out]
    return out, lines


# quant-plans: the weights of SmolLM2-135M-Instruct's Q4_1 GGUF as a native load launches them (q/k/v and gate/up
# stacked; its head is tied to the Q8_0 embedding, which a native load dequantizes: not here, ``--shapes
# 49152x576:Q8_0`` names it), on the block kernel its decode is latency-bound at K = 576 (RESULTS.md, 2026-12-07:
# 1.1-2.4x the bf16 weight's time a call on the dense plans), the largest gap a step first (a cut run keeps those).
# (On an sm_90 GPU in bf16 these Q4_1 weights take quant_gluon's decode instead: the plans are other GPUs'.)
NATIVE_SHAPES = [("SmolLM2 gate_up", 3072, 576, "Q4_1"), ("SmolLM2 qkv", 960, 576, "Q4_1"),
                 ("SmolLM2 o_proj", 576, 576, "Q4_1"), ("SmolLM2 down", 576, 1536, "Q4_1")]
# the tiles tried (block_n, block_k, warps, stages), each at every K partition of NATIVE_SPLITS: narrow tiles and
# short K blocks (a short loop's latency a program, more programs), 3 stages (the loops are 2-18 blocks long);
# from 16,384 outputs (a head: hundreds of programs already) wider tiles on 4 and 8 warps
NATIVE_TILES = [(bn, bk, 4, 3) for bn in (16, 32, 64) for bk in (32, 64, 128)]
NATIVE_TILES_WIDE = [(bn, bk, w, 3) for bn, w in ((64, 4), (128, 4), (128, 8)) for bk in (32, 64, 128)]
NATIVE_SPLITS = (1, 2, 3, 4, 6, 8, 12)
NATIVE_ROW_BLOCKS = (128, 16)  # a verify launch's rows a program at most (LinearConfig.row_block)


def native_candidates(n: int, k: int, rows: Sequence[int]):
    """The (kind, launch) pairs the native plan search times for an [n, k] block weight: every tile of
    ``NATIVE_TILES`` (``NATIVE_TILES_WIDE`` from 16,384 outputs) at every K partition, a partition once (splits
    that cut K into the same parts, ``linear.k_parts``, are one); verify launches (past ``STEP_ROWS`` rows) on the
    two widest tiles, at each of ``NATIVE_ROW_BLOCKS``."""
    from engine.models import linear as lin

    tiles = NATIVE_TILES_WIDE if n >= 16384 else NATIVE_TILES
    verify_widths = sorted({t[0] for t in tiles})[-2:]
    for bn, bk, warps, stages in tiles:
        seen = set()
        for split in NATIVE_SPLITS:
            parts = lin.k_parts(k, lin.LinearConfig(bn, bk, split))
            if (split > 1 and k // split < bk) or parts in seen:
                continue
            seen.add(parts)
            if min(rows) <= lin.STEP_ROWS:
                yield "step", lin.LinearConfig(bn, bk, split, warps, stages)
            if max(rows) > lin.STEP_ROWS and bn in verify_widths:
                for row_block in NATIVE_ROW_BLOCKS:
                    yield "verify", lin.LinearConfig(bn, bk, split, warps, stages, row_block)


@functools.cache
def _native_weight(n: int, k: int, name: str) -> torch.Tensor:
    from engine.models.quant import FORMATS, hold
    from engine.models.quantize import quantize

    fmt = FORMATS[name]
    return hold(quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, fmt), fmt)


def _native_launch(n: int, k: int, name: str, launch: tuple[tuple[int, ...], int]) -> None:
    """One launch of the block kernel (``kernel_timing.precompile``'s worker): (the config's fields, rows)."""
    from engine.models import linear as lin
    from engine.models import quant_kernel
    from engine.models.quant import FORMATS

    cfg, m = launch
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    quant_kernel.kernel_linear(x, _native_weight(n, k, name), FORMATS[name], k, None, lin.LinearConfig(*cfg))


def bench_quant_plans(shapes: list[tuple[str, int, int, str]] | None = None, rows: Sequence[int] = (1, 49),
                      workers: int = 0, out_path: str | None = None) -> tuple[list[dict], list[str]]:
    """A plan of its own per weight kept in GGUF blocks (``linear.TUNED_NATIVE``), measured as ``plans`` measures a
    dense weight's (``linear_bench.plan_search``: per K partition the fastest step and verify launches, the
    partition with the least total at ``rows``) on the block kernel over ``native_candidates``, every launch
    compiled ahead in ``workers`` processes (``kernel_timing.precompile``). Beside it at each row count: the
    block kernel on the weight's plan now (``quant_kernel.linear``) and its dequantized twin on the dense kernel
    (``linear.linear``, the dense plan: what a dequantized load takes); and whether the new plan keeps a row's
    bits across row counts (step launch at 1 row against the verify launch at the most rows). Prints the winners
    as ``linear.TUNED_NATIVE`` entries; ``out_path``: the rows so far as JSON after each weight (a plans file, as
    ``kernel_bench.py --out`` writes at the end: a run cut short keeps the weights done)."""
    from linear_bench import _cfg_tuple, plan_entry

    rows = sorted(set(rows))
    gen = torch.Generator(device="cuda").manual_seed(0)
    out, entries = [], []
    for label, n, k, name in shapes or NATIVE_SHAPES:
        row = _native_plan_shape(label, n, k, name, rows, gen, workers)
        out.append(row)
        entries.append(plan_entry(f'"{name}", {n}, {k}', row, label))
        print(entries[-1], flush=True)  # (a run cut short keeps the weights done)
        if out_path:
            with open(out_path, "w") as f:
                json.dump(out, f, indent=1)
        torch.cuda.empty_cache()
    lines = ["| weights | format | plan (step; verify: N, K, split, warps, stages, rows a program) | "
             + " | ".join(f"{m} rows: plan / now / dequantized us" for m in rows) + " | rows invariant |",
             "|---|---|---|" + "---|" * (len(rows) + 1)]
    lines += [f"| {r['shape']} | {r['format']} | {_cfg_tuple(r['step'])}; {_cfg_tuple(r['verify'])} | "
              + " | ".join(f"{r['us'][m]:.1f} / {r['now'][m]:.1f} / {r['dense'][m]:.1f}" for m in rows)
              + f" | {'y' if r['row_invariant'] else 'n'} |" for r in out]
    return out, lines + ["", "```python", *entries, "```"]


def _native_plan_shape(label: str, n: int, k: int, name: str, rows: list[int], gen: torch.Generator,
                       workers: int) -> dict:
    import torch.nn.functional as F
    from linear_bench import compile_ahead, plan_search

    from engine.models import linear as lin
    from engine.models import quant_kernel
    from engine.models.quant import FORMATS, dequantize, hold, unhold
    from engine.models.quantize import quantize

    fmt = FORMATS[name]
    candidates = list(native_candidates(n, k, rows))
    compile_ahead(f"{label} {name}", k, candidates, rows, functools.partial(_native_launch, n, k, name), workers)
    first = hold(quantize(torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02, fmt), fmt)
    pick = _rotated(first)
    twin = dequantize(unhold(first, fmt), fmt, k, torch.bfloat16)
    pick_twin = _rotated(twin)
    xs = {m: torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16) for m in rows}

    def launch(x: torch.Tensor, w: torch.Tensor, cfg: lin.LinearConfig) -> torch.Tensor:
        return quant_kernel.kernel_linear(x, w, fmt, k, None, cfg)

    now = {m: _time(lambda m=m: quant_kernel.linear(xs[m], pick(), fmt, k)) for m in rows}
    dense = {m: _time(lambda m=m: lin.linear(xs[m], pick_twin())) for m in rows}
    found = plan_search(label, rows, xs, {m: F.linear(xs[m].float(), twin.float()) for m in rows}, first, pick,
                        launch, candidates)
    plan = lin.LinearPlan(lin.LinearConfig(**found["step"]), lin.LinearConfig(**found["verify"]))
    most = xs[rows[-1]]
    alone = launch(most[:1], first, plan.for_rows(1))
    invariant = torch.equal(alone, launch(most, first, plan.for_rows(len(most)))[:1])
    step = found["step"]
    print(f"{label} ({n} x {k}) {name}: split {step['split']} block_k {step['block_k']}: " + ", ".join(
        f"{m} rows {found['us'][m]:.1f} us (now {now[m]:.1f}, dequantized {dense[m]:.1f})" for m in rows)
        + f"; rows invariant: {invariant}", flush=True)
    return {"shape": f"{label} ({n} x {k})", "n": n, "k": k, "format": name, "bytes": first.numel(), "now": now,
            "dense": dense, "row_invariant": invariant, **found}


# The prototype of the decode redesign (benchmarks/quant_packed.py: Q4_K as bf16 pairs): the 27B Q4_K_M step's Q4_K
# weights, on the engine's launch and on wider tiles (fewer loop instructions a value, kernel_sass.py --packed)
PACKED_SHAPES = [("27B gate_up", 34816, 5120), ("27B down", 5120, 17408), ("27B GDN in_proj", 16480, 5120),
                 ("27B o_proj", 5120, 6144)]
PACKED_TILES = [(128, 128, 1, 4), (64, 256, 1, 4), (128, 128, 2, 4), (128, 256, 1, 8)]  # block_n, block_k, split, warps


def bench_packed(shapes: list[tuple[str, int, int]] | None = None, rows: Sequence[int] = (1, 33)
                 ) -> tuple[list[dict], list[str]]:
    """GPU us per call of the engine's Q4_K kernel and the packed prototype on the same launch (the weight's plan),
    and of the prototype on ``PACKED_TILES``; its row invariance (1 row = that row among the most) and its error
    against the dequantized weight's product (relative norm, beside the engine kernel's)."""
    import quant_packed

    from engine.models import linear as lin
    from engine.models import quant_kernel
    from engine.models.quant import FORMATS, dequantize
    from engine.models.quantize import quantize

    fmt, gen, out = FORMATS["Q4_K"], torch.Generator(device="cuda").manual_seed(0), []
    for label, n, k in shapes or PACKED_SHAPES:
        first = quantize(torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02, fmt)
        pick = _rotated(first)
        xs = {m: torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16) for m in rows}
        plan = lin.plan_for_shape(n, k, first.device, "Q4_K")
        row = {"shape": f"{label} ({n} x {k})", "bytes": first.numel(), "plan": {}, "tiles": {}}
        for m in rows:
            cfg, x = plan.for_rows(m), xs[m]
            row["plan"][m] = (_time(lambda x=x, p=pick, k=k: quant_kernel.linear(x, p(), fmt, k)),
                              _time(lambda x=x, p=pick, k=k, c=cfg: quant_packed.linear(x, p(), k, c)))
            for bn, bk, sp, w in PACKED_TILES:
                tile = dataclasses.replace(cfg, block_n=bn, block_k=bk, split=sp, num_warps=w)
                row["tiles"][(bn, bk, sp, w, m)] = _time(
                    lambda x=x, p=pick, k=k, c=tile: quant_packed.linear(x, p(), k, c))
        many = quant_packed.linear(xs[max(rows)], first, k)
        row["row_invariant"] = torch.equal(quant_packed.linear(xs[max(rows)][:1], first, k), many[:1])
        exact = xs[max(rows)].double() @ dequantize(first, fmt, k).double().T
        row["error"] = {name: float((got.double() - exact).norm() / exact.norm()) for name, got in (
            ("engine", quant_kernel.linear(xs[max(rows)], first, fmt, k)), ("packed", many))}
        out.append(row)
        print(f"{row['shape']}: " + ", ".join(f"{m} rows engine {e:.1f} / packed {p:.1f} us" for m, (e, p) in
                                              row["plan"].items())
              + f"; packed row-invariant: {row['row_invariant']}; error engine {row['error']['engine']:.2e}, "
              f"packed {row['error']['packed']:.2e}", flush=True)
        torch.cuda.empty_cache()
    lines = ["| weights | MB | " + " | ".join(f"{m} rows: engine / packed us (same launch)" for m in rows)
             + " | packed, best tile: " + " / ".join(f"{m} rows" for m in rows) + " | row-invariant | "
             "error against the dequantized product: engine / packed |", "|---|---|" + "---|" * (len(rows) + 3)]
    for r in out:
        best = [min((t for key, t in r["tiles"].items() if key[-1] == m), default=float("nan")) for m in rows]
        lines.append(f"| {r['shape']} | {r['bytes'] / 1e6:.1f} | " + " | ".join(
            f"{e:.1f} / {p:.1f}" for e, p in r["plan"].values()) + " | " + " / ".join(f"{b:.1f}" for b in best)
            + f" | {'y' if r['row_invariant'] else 'n'} | {r['error']['engine']:.1e} / {r['error']['packed']:.1e} |")
    return [{**r, "tiles": {str(key): t for key, t in r["tiles"].items()}} for r in out], lines
