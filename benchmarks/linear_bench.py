"""The few-row linear kernel on the GPU: one-row products by BLAS library (`blas`), the kernel against
cuBLAS by tile and split (`linear`) and a measured ``LinearPlan`` per weight (`plans`). Run through
``benchmarks/kernel_bench.py`` (its subcommands of these names)."""

from __future__ import annotations

import dataclasses
import functools

import torch
from kernel_timing import precompile
from kernel_timing import time_us as _time

# One-row products of the large presets (N outputs, K inputs): what an AR step streams.
BLAS_SHAPES = [
    ("27B GDN in_proj", 16480, 5120), ("27B GDN out_proj", 5120, 6144), ("27B attn qkv", 14336, 5120),
    ("27B attn o_proj", 5120, 6144), ("27B gate_up", 34816, 5120), ("27B down", 5120, 17408),
    ("27B lm_head", 248320, 5120), ("8B qkv", 6144, 4096), ("8B o_proj", 4096, 4096), ("8B gate_up", 24576, 4096),
    ("8B down", 4096, 12288),
]
COPIES = 4  # weight copies cycled through, so that no launch reads its weights from L2 (50 MB)


def bench_blas() -> tuple[list[dict], list[str]]:
    """A one-row bf16 product per way torch can ask for it: ``F.linear`` (the engine's) with each
    BLAS library torch can prefer, ``torch.mv`` (a GEMV) and ``W @ x.T`` (the weight as the left
    operand). GPU us per call and the weight stream's GB/s; the copy bandwidth for reference."""
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(0)  # the lm_head's copies are 10 GB: made on the GPU
    n_bytes = 1 << 30
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_us = _time(lambda: dst.copy_(src))
    rows = [{"shape": "copy 1 GiB (read + write)", "copy": copy_us, "gbs": {"copy": 2 * n_bytes / copy_us / 1e3}}]
    forms = {
        "linear (default)": ("default", lambda x, w: F.linear(x, w)),
        "linear (cublas)": ("cublas", lambda x, w: F.linear(x, w)),
        "linear (cublaslt)": ("cublaslt", lambda x, w: F.linear(x, w)),
        "mv": ("default", lambda x, w: torch.mv(w, x[0])),
        "W @ x.T": ("default", lambda x, w: w @ x.t()),
    }
    previous = torch.backends.cuda.preferred_blas_library()
    for label, n, k in BLAS_SHAPES:
        ws = [torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        x = torch.randn(1, k, generator=gen, device="cuda", dtype=torch.bfloat16)
        calls = iter(range(1 << 30))
        row = {"shape": f"{label} ({n} x {k})", "gbs": {}}
        for name, (lib, fn) in forms.items():
            torch.backends.cuda.preferred_blas_library(lib)
            try:
                row[name] = _time(lambda fn=fn, x=x, ws=ws, calls=calls: fn(x, ws[next(calls) % COPIES]))
            finally:
                torch.backends.cuda.preferred_blas_library(previous)
            row["gbs"][name] = 2 * n * k / row[name] / 1e3
        rows.append(row)
        ws = None  # freed before the next shape's copies
        torch.cuda.empty_cache()
    names = list(forms)
    lines = ["| weights | " + " | ".join(f"{n} us (GB/s)" for n in names) + " |", "|---|" + "---|" * len(names),
             f"| copy 1 GiB: {copy_us:.1f} us, {rows[0]['gbs']['copy']:.0f} GB/s |" + " |" * (len(names) - 1)]
    lines += [f"| {r['shape']} | " + " | ".join(f"{r[n]:.1f} ({r['gbs'][n]:.0f})" for n in names) + " |"
              for r in rows[1:]]
    return rows, lines


# SmolLM2-135M's target weights (q/k/v and gate/up stacked, as the engine fuses them)
SMOLLM2_SHAPES = [("SmolLM2 qkv", 960, 576), ("SmolLM2 o_proj", 576, 576), ("SmolLM2 gate_up", 3072, 576),
                  ("SmolLM2 down", 576, 1536), ("SmolLM2 lm_head", 49152, 576)]
LINEAR_SHAPES = BLAS_SHAPES + [("8B lm_head", 151936, 4096)] + SMOLLM2_SHAPES
# (BLOCK_N, BLOCK_K, num_warps, num_stages) tried per shape, each with every split of K below
# (BLOCK_K 256 took more shared memory than an SM has at 4 stages, and lost at 3, 2026-12-02)
LINEAR_TILES = [(64, 128, 4, st) for st in (3, 4, 6)] + [(128, 128, w, st) for w in (4, 8) for st in (3, 4, 5)]
# narrower and deeper tiles, for outputs too narrow to fill the GPU with the ones above (--narrow)
LINEAR_NARROW_TILES = [(32, 128, 4, st) for st in (4, 6, 8)] + [(32, 256, 4, st) for st in (3, 4)] + [
    (64, 64, 4, st) for st in (6, 8)] + [(64, 128, 4, 8)]
LINEAR_SPLITS = (1, 2, 3, 4, 6)


def _rotating(n: int, k: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Weight copies cycled through so that a launch reads its weight from memory, not L2 (50 MB)."""
    copies = max(2, -(-256 * 2**20 // (2 * n * k)))
    return [torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]


def bench_linear(shapes: list[tuple[str, int, int]] | None = None, tiles: list | None = None
                 ) -> tuple[list[dict], list[str]]:
    """``engine.models.linear`` (split-K few-row kernel) against cuBLAS (``F.linear``) per weight:
    GPU us per call at 1 row (an AR step) and 33 (a budget-32 verify) for every tile and split; the
    engine's choice (``linear.TUNED``, cuBLAS where it has none); whether a row's bits are the same
    at 1 and 16 rows with the step launch, and at 17, 33 and 65 (BLOCK_M 32, 64, 128) with the
    verify launch."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for label, n, k in shapes or LINEAR_SHAPES:
        row = _linear_shape(label, n, k, gen, tiles or LINEAR_TILES)
        rows.append(row)
        b = row["best"][0] if row["best"] else {"config": None, "us1": float("nan"), "us33": float("nan")}
        print(f"{row['shape']}: cuBLAS {row['cublas1']:.1f}/{row['cublas33']:.1f} us, engine {row['chosen']} "
              f"{row['chosen1']:.1f}/{row['chosen33']:.1f} us, best {b['config']} {b['us1']:.1f}/{b['us33']:.1f} us, "
              f"bits {row['bits_equal']}", flush=True)
        torch.cuda.empty_cache()
    lines = ["| weights | cuBLAS 1 row us (GB/s) | 33 rows us | engine 1 row us (GB/s) | 33 rows us "
             "| best at 1 row (N, K, split, warps, stages) | its us at 1 / 33 rows | row bits equal at 16 / 33 / 65 |",
             "|---|" + "---|" * 7]
    for r in rows:
        b = r["best"][0] if r["best"] else None
        best = (f"{b['config']['block_n']}, {b['config']['block_k']}, {b['config']['split']}, "
                f"{b['config']['num_warps']}, {b['config']['num_stages']} | {b['us1']:.1f} / {b['us33']:.1f}"
                if b else "- | -")
        lines.append(f"| {r['shape']} | {r['cublas1']:.1f} ({r['gb'] / r['cublas1']:.0f}) | {r['cublas33']:.1f} | "
                     f"{r['chosen1']:.1f} ({r['gb'] / r['chosen1']:.0f}) | {r['chosen33']:.1f} | {best} | "
                     f"{'/'.join('y' if r['bits_equal'][m] else 'n' for m in (16, 33, 65))} |")
    return rows, lines


def _linear_shape(label: str, n: int, k: int, gen: torch.Generator, tiles: list) -> dict:
    import torch.nn.functional as F

    from engine.models import linear as lin

    ws = _rotating(n, k, gen)
    calls = iter(range(1 << 30))

    def pick() -> torch.Tensor:
        return ws[next(calls) % len(ws)]

    xs = {m: torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16) for m in (1, 16, 33, 65)}
    row = {"shape": f"{label} ({n} x {k})", "n": n, "k": k, "gb": 2 * n * k / 1e3,
           "cublas1": _time(lambda: F.linear(xs[1], pick())), "cublas33": _time(lambda: F.linear(xs[33], pick()))}
    ref = F.linear(xs[33].float(), ws[0].float())
    tried = []
    for bn, bk, warps, stages in tiles:
        for split in LINEAR_SPLITS:
            if split > 1 and k // split < 2 * bk:
                continue
            cfg = lin.LinearConfig(bn, bk, split, warps, stages)
            try:
                out = lin._kernel_linear(xs[33], ws[0], None, cfg)
                err = float((out.float() - ref).norm() / ref.norm())
                us = _time(lambda cfg=cfg: lin._kernel_linear(xs[1], pick(), None, cfg))
                us33 = _time(lambda cfg=cfg: lin._kernel_linear(xs[33], pick(), None, cfg))
            except Exception as exc:  # a tile that does not fit (shared memory): skipped, said so
                tried.append({"config": cfg.__dict__, "error": str(exc).splitlines()[0][:120]})
                continue
            tried.append({"config": cfg.__dict__, "us1": us, "us33": us33, "err": err})
    ok = sorted((t for t in tried if "us1" in t and t["err"] < 1e-2), key=lambda t: t["us1"])
    plan = lin.plan_for(ws[0])
    row["chosen"] = {"step": plan.step.__dict__, "verify": plan.verify.__dict__}
    for m in (1, 33):  # the engine's launch
        row[f"chosen{m}"] = _time(lambda m=m: lin.linear(xs[m], pick()))
    cfg = plan.step
    one = lin._kernel_linear(xs[16][:1], ws[0], None, cfg)
    row["bits_equal"] = {16: bool(torch.equal(lin._kernel_linear(xs[16], ws[0], None, cfg)[:1], one))}
    cfg = plan.verify
    one = lin._kernel_linear(xs[65][:17], ws[0], None, cfg)
    row["bits_equal"].update({m: bool(torch.equal(lin._kernel_linear(xs[65][:m], ws[0], None, cfg)[:17], one))
                              for m in (33, 65)})
    row["best"], row["errors"], row["tried"] = ok[:3], [t for t in tried if "error" in t][:3], tried
    return row


# plans: the tiles tried for each K partition, (BLOCK_N, BLOCK_K, num_warps, num_stages); a BLOCK_K of
# 32 gives small models' short K (576 for SmolLM2) more parts
PLAN_TILES = [(bn, bk, 8 if bn == 128 else 4, st) for bn in (32, 64, 128) for bk in (32, 64, 128) for st in (2, 4)]
# from K 4,096 (the 8B and 27B weights): the tiles their earlier tuning kept, with deeper pipelines
# (a large weight's launch streams from HBM) and no 32-wide block (too many programs, too short a K step)
PLAN_TILES_LARGE = ([(64, 128, 4, st) for st in (3, 4, 6)] + [(128, 128, 8, st) for st in (4, 5)]
                    + [(64, 64, 4, 4), (128, 64, 8, 4)])
PLAN_SPLITS = (1, 2, 3, 4, 6, 8)
PLAN_ROW_BLOCKS = (128, 32, 16)  # a verify launch's rows per program at most (LinearConfig.row_block)
# --keep-step: the verify tiles tried under the engine's step launch's K partition (the AR step kept as
# it is): wider tiles read the rows' block once for more columns (a 33-row verify re-reads it per tile
# from L2), 4 or 8 warps, shallow to deep pipelines
PLAN_VERIFY_TILES = ([(64, w, st) for w in (4, 8) for st in (2, 3, 4, 6, 8)]
                     + [(128, w, st) for w in (4, 8) for st in (2, 3, 4, 5)] + [(256, 8, st) for st in (2, 3)])


def bench_plans(shapes: list[tuple[str, int, int]], rows: list[int], keep_step: bool = False
                ) -> tuple[list[dict], list[str]]:
    """A ``LinearPlan`` per weight, measured: for every K partition (split, BLOCK_K) the fastest
    step tile (summed over the row counts up to ``STEP_ROWS`` in ``rows``) and the fastest verify
    tile (over the larger ones); the partition with the least total wins. ``keep_step``: the
    engine's step launch stays (an AR step at the roofline is not traded away) and only verify tiles
    of its K partition are tried (``PLAN_VERIFY_TILES``), the engine's own verify launch among them.
    cuBLAS at the same row counts beside it. Prints the winners as ``linear.TUNED`` entries."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    out, entries = [], []
    for label, n, k in shapes:
        row = _plan_shape(label, n, k, rows, gen, keep_step)
        out.append(row)
        st = row["step"]
        entries.append(plan_entry(f"{n}, {k}", row, label))
        print(f"{row['shape']}: split {st['split']} block_k {st['block_k']}: " + ", ".join(
            f"{m} rows {row['us'][m]:.1f} us (cuBLAS {row['cublas'][m]:.1f})" for m in rows), flush=True)
        torch.cuda.empty_cache()
    lines = ["| weights | plan (step; verify: N, K, split, warps, stages, rows a program) | "
             + " | ".join(f"{m} rows us (cuBLAS)" for m in rows) + " |", "|---|---|" + "---|" * len(rows)]
    lines += [f"| {r['shape']} | {_cfg_tuple(r['step'])}; {_cfg_tuple(r['verify'])} | "
              + " | ".join(f"{r['us'][m]:.1f} ({r['cublas'][m]:.1f})" for m in rows) + " |" for r in out]
    return out, lines + ["", "```python", *entries, "```"]


def plan_entry(key: str, row: dict, label: str) -> str:
    """A searched plan (``row``'s step and verify launches) as a line of ``linear.TUNED`` / ``TUNED_NATIVE``."""
    return f"        ({key}): _plan(_C{_cfg_tuple(row['step'])}, _C{_cfg_tuple(row['verify'])}),  # {label}"


def _cfg_tuple(cfg: dict) -> tuple[int, ...]:
    return tuple(cfg[f] for f in ("block_n", "block_k", "split", "num_warps", "num_stages", "row_block"))


def _plan_shape(label: str, n: int, k: int, rows: list[int], gen: torch.Generator, keep_step: bool = False) -> dict:
    import torch.nn.functional as F

    from engine.models import linear as lin

    ws = _rotating(n, k, gen)
    calls = iter(range(1 << 30))

    def pick() -> torch.Tensor:
        return ws[next(calls) % len(ws)]

    xs = {m: torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16) for m in rows}
    cublas = {m: _time(lambda m=m: F.linear(xs[m], pick())) for m in rows}
    candidates = list(_plan_candidates(lin.plan_for(ws[0]) if keep_step else None, k, rows))
    compile_ahead(label, k, candidates, rows, functools.partial(_dense_launch, n, k))
    found = plan_search(label, rows, xs, {m: F.linear(xs[m].float(), ws[0].float()) for m in rows}, ws[0], pick,
                        lambda x, w, cfg: lin._kernel_linear(x, w, None, cfg), candidates, keep_step)
    return {"shape": f"{label} ({n} x {k})", "n": n, "k": k, "cublas": cublas, **found}


def compile_ahead(label: str, k: int, candidates: list, rows: list[int], launch, workers: int = 0) -> None:
    """Every compiled variant ``candidates`` (kind, config) launch at their kind's ``rows`` over K = ``k``, compiled
    ahead in parallel (``kernel_timing.precompile``: ``launch((config fields, rows))`` in each worker): one launch a
    variant. The few-row kernels take the split and the K blocks a part as runtime arguments, but a launch of one
    part passes its bf16 output where several pass float32 partial sums: two variants, split 1 and 2."""
    from engine.models import linear as lin

    def variant(c: lin.LinearConfig) -> tuple[int, ...]:
        return _cfg_tuple(dataclasses.replace(c, split=1 if lin.k_parts(k, c)[1] == 1 else 2).__dict__)

    launches = sorted({(variant(c), m) for kind, c in candidates for m in rows
                       if (m <= lin.STEP_ROWS) == (kind == "step")})
    seconds = precompile(launch, launches, workers)
    print(f"{label}: {len(launches)} launches compiled in {seconds:.0f} s", flush=True)


@functools.cache
def _dense_weight(n: int, k: int) -> torch.Tensor:
    return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02


def _dense_launch(n: int, k: int, launch: tuple[tuple[int, ...], int]) -> None:
    """One launch of the dense few-row kernel (``compile_ahead``'s worker): (the config's fields, rows)."""
    from engine.models import linear as lin

    cfg, m = launch
    lin._kernel_linear(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), _dense_weight(n, k), None,
                       lin.LinearConfig(*cfg))


def plan_search(label: str, rows: list[int], xs: dict, ref: dict, first, pick, launch, candidates,
                verbose: bool = False) -> dict:
    """The plan search of one weight (``bench_plans``, ``quant_bench.bench_quant_plans``): each (kind, launch) of
    ``candidates`` timed at the row counts of its kind (``launch(x, weight, cfg)``: on ``first`` checked against
    ``ref`` (float32 products), then timed on ``pick()``'s weights); per K partition (split, BLOCK_K) the fastest
    step and verify launches; the partition with the least total wins."""
    from engine.models import linear as lin

    kinds = {"step": [m for m in rows if m <= lin.STEP_ROWS], "verify": [m for m in rows if m > lin.STEP_ROWS]}
    parts: dict[tuple[int, int], dict] = {}  # (split, block_k) -> kind -> (us summed, config, us by rows)
    tried: list[dict] = []  # every launch timed: its config, kind and us by rows

    def timed(cfg: lin.LinearConfig, m: int) -> float:
        got = launch(xs[m], first, cfg).float()
        if float((got - ref[m]).norm() / ref[m].norm()) > 1e-2:
            raise RuntimeError(f"a wrong product at {m} rows")
        return _time(lambda: launch(xs[m], pick(), cfg))

    for kind, cfg in candidates:
        ms = kinds[kind]
        best = parts.setdefault((cfg.split, cfg.block_k), {})
        try:
            us = {m: timed(cfg, m) for m in ms}
        except Exception as exc:  # a tile that does not fit (shared memory, registers): skipped, said so
            print(f"  {label} {cfg}: {str(exc).splitlines()[0][:100]}", flush=True)
            continue
        tried.append({"kind": kind, "config": _cfg_tuple(cfg.__dict__), "us": us})
        if verbose:
            print(f"  {label} {kind} {_cfg_tuple(cfg.__dict__)}: "
                  + ", ".join(f"{m} rows {u:.1f} us" for m, u in us.items()), flush=True)
        if ms and (kind not in best or sum(us.values()) < best[kind][0]):
            best[kind] = (sum(us.values()), cfg, us)
    needed = [kind for kind, ms in kinds.items() if ms]
    ranked = sorted((sum(p[kind][0] for kind in needed), key, p) for key, p in parts.items()
                    if all(kind in p for kind in needed))
    total, _, best = ranked[0]
    step = best["step"][1] if "step" in best else best["verify"][1]
    verify = best["verify"][1] if "verify" in best else step
    us = {m: u for kind in needed for m, u in best[kind][2].items()}
    return {"us": us, "total": total, "step": step.__dict__, "verify": verify.__dict__,
            "runners_up": [{"split": key[0], "block_k": key[1], "total": t} for t, key, _ in ranked[1:4]],
            "tried": tried}


def _plan_candidates(engine, k: int, rows: list[int]):
    """The (kind, launch) pairs a plan search times: with the engine's plan (``--keep-step``) its
    step launch, its verify launch, then ``PLAN_VERIFY_TILES`` under its K partition; else every
    tile of ``PLAN_TILES`` (``PLAN_TILES_LARGE`` from K 4,096) at every split."""
    from engine.models import linear as lin

    kinds = [kind for kind, there in (("step", min(rows) <= lin.STEP_ROWS), ("verify", max(rows) > lin.STEP_ROWS))
             if there]
    if engine is not None:
        yield "step", engine.step
        yield "verify", engine.verify
        for bn, warps, stages in PLAN_VERIFY_TILES:
            for row_block in PLAN_ROW_BLOCKS:
                cfg = lin.LinearConfig(bn, engine.step.block_k, engine.step.split, warps, stages, row_block)
                if cfg != engine.verify:
                    yield "verify", cfg
        return
    for bn, bk, warps, stages in PLAN_TILES_LARGE if k >= 4096 else PLAN_TILES:
        for split in PLAN_SPLITS:
            if split > 1 and k // split < bk:
                continue
            for kind in kinds:
                for row_block in (PLAN_ROW_BLOCKS if kind == "verify" else (lin.ROW_BLOCK,)):
                    yield kind, lin.LinearConfig(bn, bk, split, warps, stages, row_block)
