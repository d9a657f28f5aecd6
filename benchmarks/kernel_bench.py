"""Time single Triton kernels by launch configuration on the GPU, against what they replace.

    python benchmarks/kernel_bench.py delta                 # the tree delta rule, 27B-shape GDN heads
    python benchmarks/kernel_bench.py delta --old a.py b.py # also other versions of delta_rule.py
    python benchmarks/kernel_bench.py tree                  # the DDTree kernel by launch configuration
    python benchmarks/kernel_bench.py tree --old old.py     # also another version of tree_kernel.py
    python benchmarks/kernel_bench.py blas                  # one-row products of the large presets
    python benchmarks/kernel_bench.py attention             # decode attention by keys per span and block
    python benchmarks/kernel_bench.py linear                # the few-row linear kernel against cuBLAS
    python benchmarks/kernel_bench.py plans --shapes SmolLM2  # a measured LinearPlan per weight

Every number is GPU microseconds per launch: ``LAUNCHES`` launches captured in one CUDA graph and
replayed (median of 5), so host launch costs are left out, as in the engine's captured steps.

``delta``: one row per (BLOCK_V, num_warps); columns for an AR step (T = 1), a budget-32 DDTree
verify (T = 33, every node's state stored, a best-first tree of random draft log-probs) and a
512-token prefill chain. Only the launch configuration changes between rows: within one
configuration tree and chain forwards share one compiled kernel, which keeps speculative decoding
exact; across configurations the float32 rounding may differ.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.decoding.tree import build_tree_host  # noqa: E402
from engine.models import delta_rule  # noqa: E402

HK, HV, DK, DV = 16, 48, 128, 128  # qwen35-27b-shape's linear attention heads
LAUNCHES = 48  # the 27B shape has 48 Gated DeltaNet layers


def _inputs(t: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    def r(*shape):
        return torch.randn(*shape, generator=gen).cuda()

    q = torch.nn.functional.normalize(r(t, HK, DK), dim=-1) * DK ** -0.5
    k = torch.nn.functional.normalize(r(t, HK, DK), dim=-1)
    return dict(q=q, k=k, v=r(t, HV, DV), g=-torch.rand(t, HV, generator=gen).cuda(),
                beta=torch.rand(t, HV, generator=gen).cuda(), state=r(HV, DK, DV) * 0.1)


def _tree_parents(budget: int, gen: torch.Generator) -> torch.Tensor:
    lp = -torch.cumsum(torch.rand(15, 8, generator=gen) * 2, dim=1)
    return build_tree_host(lp, torch.arange(8).expand(15, 8), 0, budget, None).parents.cuda()


def _time(fn, reps: int = 5) -> float:
    """GPU microseconds per call: LAUNCHES calls captured in one graph, replayed ``reps`` times."""
    fn()  # compile, warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAUNCHES):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(1000.0 * a.elapsed_time(b) / LAUNCHES)
    return statistics.median(times)


def bench_delta(module) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    row = {}
    for name, t in (("ar", 1), ("verify33", 33), ("prefill512", 512)):
        x = _inputs(t, gen)
        if name == "verify33":
            parents = _tree_parents(32, gen)
            nodes = torch.empty(t, HV, DK, DV, device="cuda")
            # made once a forward in the engine (every layer reads them): outside the timed launch
            extra = {"restarts": module.restart_flags(parents)} if hasattr(module, "restart_flags") else {}
            row[name] = _time(lambda x=x, p=parents, n=nodes, e=extra: module.tree_delta_rule(
                x["q"], x["k"], x["v"], x["g"], x["beta"], p, x["state"], n, backend="triton", **e))
            row["stored"] = int(extra["restarts"].sum()) if extra else t
        else:
            chain = torch.arange(t, device="cuda") - 1
            row[name] = _time(lambda x=x, c=chain: module.tree_delta_rule(
                x["q"], x["k"], x["v"], x["g"], x["beta"], c, x["state"], backend="triton"))
    row["commit"] = _commit_time(module, gen)
    return row


def _commit_time(module, gen: torch.Generator, al: int = 5) -> float:
    """GPU us of a fast commit of every GDN layer's recurrent state (AL ``al`` of a budget-32 tree):
    ``delta_rule_path`` (the accepted path recomputed, one launch) where the module has it, else the
    accepted node's stored state gathered and copied (``HybridCache._commit_recurrent``'s)."""
    t = 33
    state = torch.randn(LAUNCHES, HV, DK, DV, generator=gen).cuda() * 0.1
    path = torch.arange(t, device="cuda")
    length = torch.tensor([al], device="cuda")
    if hasattr(module, "delta_rule_path"):
        x = {k: v.unsqueeze(0).expand(LAUNCHES, *v.shape).contiguous() for k, v in _inputs(t, gen).items()
             if k != "state"}
        fn = lambda: module.delta_rule_path(x["q"], x["k"], x["v"], x["g"], x["beta"], path, length, state)  # noqa: E731
    else:
        nodes = torch.empty(LAUNCHES, t, HV, DK, DV, device="cuda")
        fn = lambda: state.copy_(nodes.index_select(1, path.index_select(0, length - 1)).squeeze(1))  # noqa: E731
    return _time(fn)  # one commit (every layer) a call


TREE_BUDGETS = (8, 16, 22, 32, 48, 64)
TREE_WARPS = (None, 8, 4, 2, 16)  # warps per program of the DDTree kernel; None: its own (kernel_warps)


def bench_tree(old_module=None) -> tuple[list[dict], list[str]]:
    """The DDTree kernel (L = 15, k = 8: SmolLM2's draft) per budget, by warp count; tie-free random
    log-probs, and log-probs in steps of 1/8 (bf16 draft logits repeat values: exact ties).
    ``old_module``: another copy of ``tree_kernel.py`` (``--old``) timed first, its trees checked
    equal to this one's."""
    from engine.decoding import tree_kernel

    gen = torch.Generator().manual_seed(0)
    lp = (-torch.cumsum(torch.rand(15, 8, generator=gen) + 1e-3, dim=1)).cuda()
    tied = torch.sort((lp * 8).round() / 8, dim=1, descending=True).values
    ids = torch.randint(0, 1000, (15, 8), generator=gen).cuda()
    root = torch.tensor([5], device="cuda")
    own = tree_kernel.kernel_warps
    rows = []
    if old_module is not None:
        for label, x in (("", lp), (", exact ties", tied)):
            row = {"config": f"--old (its own warps){label}"}
            for b in TREE_BUDGETS:
                new_tree, new_mask = tree_kernel.build_tree_kernel(x, ids, root, b, None)
                old_tree, old_mask = old_module.build_tree_kernel(x, ids, root, b, None)
                fields = ("tokens", "parents", "depths", "ranks")
                if not (all(torch.equal(getattr(new_tree, f), getattr(old_tree, f)) for f in fields)
                        and torch.equal(new_mask, old_mask)):
                    raise SystemExit(f"tree: --old builds another tree at budget {b}{label}")
                row[f"b{b}"] = _time(lambda b=b, x=x: old_module.build_tree_kernel(x, ids, root, b, None))
            rows.append(row)
    try:
        for warps in TREE_WARPS:
            tree_kernel.kernel_warps = own if warps is None else (lambda budget, w=warps: w)
            name = f"warps={warps}" if warps else "its own (kernel_warps)"
            for label, x in (("", lp), (", exact ties", tied)):
                if label and warps is not None:
                    continue
                row = {"config": name + label}
                for b in TREE_BUDGETS:
                    row[f"b{b}"] = _time(lambda b=b, x=x: tree_kernel.build_tree_kernel(x, ids, root, b, None))
                rows.append(row)
    finally:
        tree_kernel.kernel_warps = own
    return rows, _table("config", [(f"budget {b} us", f"b{b}") for b in TREE_BUDGETS], rows)


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
        st, ve = row["step"], row["verify"]
        entries.append(f"        ({n}, {k}): _plan(_C{_cfg_tuple(st)}, _C{_cfg_tuple(ve)}),  # {label}")
        print(f"{row['shape']}: split {st['split']} block_k {st['block_k']}: " + ", ".join(
            f"{m} rows {row['us'][m]:.1f} us (cuBLAS {row['cublas'][m]:.1f})" for m in rows), flush=True)
        torch.cuda.empty_cache()
    lines = ["| weights | plan (step; verify: N, K, split, warps, stages, rows a program) | "
             + " | ".join(f"{m} rows us (cuBLAS)" for m in rows) + " |", "|---|---|" + "---|" * len(rows)]
    lines += [f"| {r['shape']} | {_cfg_tuple(r['step'])}; {_cfg_tuple(r['verify'])} | "
              + " | ".join(f"{r['us'][m]:.1f} ({r['cublas'][m]:.1f})" for m in rows) + " |" for r in out]
    return out, lines + ["", "```python", *entries, "```"]


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
    ref = {m: F.linear(xs[m].float(), ws[0].float()) for m in rows}
    cublas = {m: _time(lambda m=m: F.linear(xs[m], pick())) for m in rows}
    kinds = {"step": [m for m in rows if m <= lin.STEP_ROWS], "verify": [m for m in rows if m > lin.STEP_ROWS]}
    parts: dict[tuple[int, int], dict] = {}  # (split, block_k) -> kind -> (us summed, config, us by rows)
    tried: list[dict] = []  # every launch timed: its config, kind and us by rows

    def timed(cfg: lin.LinearConfig, m: int) -> float:
        got = lin._kernel_linear(xs[m], ws[0], None, cfg).float()
        if float((got - ref[m]).norm() / ref[m].norm()) > 1e-2:
            raise RuntimeError(f"a wrong product at {m} rows")
        return _time(lambda: lin._kernel_linear(xs[m], pick(), None, cfg))

    def consider(kind: str, cfg: lin.LinearConfig) -> None:
        ms = kinds[kind]
        best = parts.setdefault((cfg.split, cfg.block_k), {})
        try:
            us = {m: timed(cfg, m) for m in ms}
        except Exception as exc:  # a tile that does not fit (shared memory): skipped, said so
            print(f"  {label} {cfg}: {str(exc).splitlines()[0][:100]}", flush=True)
            return
        tried.append({"kind": kind, "config": _cfg_tuple(cfg.__dict__), "us": us})
        if keep_step:
            print(f"  {label} {kind} {_cfg_tuple(cfg.__dict__)}: "
                  + ", ".join(f"{m} rows {u:.1f} us" for m, u in us.items()), flush=True)
        if ms and (kind not in best or sum(us.values()) < best[kind][0]):
            best[kind] = (sum(us.values()), cfg, us)

    for kind, cfg in _plan_candidates(lin.plan_for(ws[0]) if keep_step else None, k, list(kinds)):
        consider(kind, cfg)
    needed = [kind for kind, ms in kinds.items() if ms]
    ranked = sorted((sum(p[kind][0] for kind in needed), key, p) for key, p in parts.items()
                    if all(kind in p for kind in needed))
    total, _, best = ranked[0]
    step = best["step"][1] if "step" in best else best["verify"][1]
    verify = best["verify"][1] if "verify" in best else step
    us = {m: u for kind in needed for m, u in best[kind][2].items()}
    return {"shape": f"{label} ({n} x {k})", "n": n, "k": k, "cublas": cublas, "us": us, "total": total,
            "step": step.__dict__, "verify": verify.__dict__,
            "runners_up": [{"split": key[0], "block_k": key[1], "total": t} for t, key, _ in ranked[1:4]],
            "tried": tried}


def _plan_candidates(engine, k: int, kinds: list[str]):
    """The (kind, launch) pairs a plan search times: with the engine's plan (``--keep-step``) its
    step launch, its verify launch, then ``PLAN_VERIFY_TILES`` under its K partition; else every
    tile of ``PLAN_TILES`` (``PLAN_TILES_LARGE`` from K 4,096) at every split."""
    from engine.models import linear as lin

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


# (label, query heads, K/V heads, head_dim, committed keys, new tokens): SmolLM2 and the 27B shape's
# attention in an AR step and a DDTree verify (budget 48 and 32)
ATTN_CASES = [("SmolLM2 AR", 9, 3, 64, 290, 1), ("SmolLM2 verify b48", 9, 3, 64, 463, 49),
              ("8B AR", 32, 8, 128, 522, 1), ("8B verify b32", 32, 8, 128, 991, 33),
              ("27B AR", 24, 4, 256, 522, 1), ("27B verify b32", 24, 4, 256, 991, 33)]
# the step kernel's launch candidates: step_attention_launch's ("engine") with these keys overridden
# (SPLIT keys per span, BLOCK_N x num_warps)
ATTN_VARIANTS = [("engine", {}), ("spans 64", {"SPLIT": 64}), ("spans 128", {"SPLIT": 128}),
                 ("64x4", {"BLOCK_N": 64}), ("32x8", {"num_warps": 8}), ("64x8", {"BLOCK_N": 64, "num_warps": 8})]


def _random_tree(t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(depths [t] int32, ancestor-or-self mask [t, t]) of a random tree: node i's parent among the
    nodes before it, picked towards the latest (a DDTree's best-first trees are deep and narrow)."""
    parents = [-1] + [max(0, i - 1 - int(torch.randint(0, 4, (1,), generator=gen))) for i in range(1, t)]
    depths, mask = [0] * t, torch.eye(t, dtype=torch.bool)
    for i in range(1, t):
        depths[i] = depths[parents[i]] + 1
        mask[i] |= mask[parents[i]]
    return torch.tensor(depths, dtype=torch.int32), mask


def bench_attention() -> tuple[list[dict], list[str]]:
    """The decode attention by launch: the step kernel (``step_attention``: every decode step and
    verify since issue #21) on the engine's launch and on each of ``ATTN_VARIANTS``, against the mask
    kernel (``attention``: a verify's before it, not row-invariant), each case's keys laid out as the
    engine lays them out. A candidate a case cannot take (SPLIT not a multiple of BLOCK_N): blank."""
    from engine.models import attention as split_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    cpu = torch.Generator().manual_seed(0)
    saved_launch = split_attention.step_attention_launch
    rows = []
    try:
        for label, hq, hkv, d, start, t in ATTN_CASES:
            q = torch.randn(t, hq, d, generator=gen, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(start + t, hkv, d, generator=gen, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(start + t, hkv, d, generator=gen, device="cuda", dtype=torch.bfloat16)
            depths, anc_mask = _random_tree(t, cpu)
            keys = split_attention.StepKeys(torch.tensor([start], device="cuda"), depths.cuda(),
                                            split_attention.ancestor_table(anc_mask, depths, t).cuda(), start + t)
            mask = keys.dense_mask()
            row = {"case": f"{label} (T={t}, keys {start + t}, depth {int(depths.max())})",
                   "mask": _time(lambda q=q, k=k, v=v, m=mask: split_attention.attention(q, k, v, m))}
            want = split_attention.step_attention(q, k, v, keys)
            for name, own in ATTN_VARIANTS:
                launch = {**saved_launch(d), **own}
                if launch["SPLIT"] % launch["BLOCK_N"]:
                    row[name] = float("nan")
                    continue
                split_attention.step_attention_launch = lambda dd, fp32=False, o=own: {**saved_launch(dd, fp32), **o}
                try:
                    row[name] = _time(lambda q=q, k=k, v=v, keys=keys: split_attention.step_attention(q, k, v, keys))
                    engine_blocks = (saved_launch(d)["SPLIT"], saved_launch(d)["BLOCK_N"])
                    got = split_attention.step_attention(q, k, v, keys)
                    if (launch["SPLIT"], launch["BLOCK_N"]) == engine_blocks and not torch.equal(got, want):
                        print(f"  {label} {name}: bits differ from the engine's launch (same spans and blocks)")
                except Exception as exc:  # a launch that does not fit: said so
                    print(f"  {label} {name}: {str(exc).splitlines()[0][:100]}")
                    row[name] = float("nan")
                finally:
                    split_attention.step_attention_launch = saved_launch
            print(row, flush=True)
            rows.append(row)
    finally:
        split_attention.step_attention_launch = saved_launch
    cols = [("mask kernel", "mask")] + [(name, name) for name, _ in ATTN_VARIANTS]
    return rows, _table("case", cols, rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=["delta", "tree", "blas", "attention", "linear", "plans"])
    ap.add_argument("--shapes", nargs="+", help="linear, plans: the weights whose label starts so (or NxK)")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 16, 49],
                    help="plans: the row counts a plan is timed at (up to 16: its step launch; beyond: verify)")
    ap.add_argument("--keep-step", action="store_true",
                    help="plans: keep the engine's step launch per weight; try only verify tiles of its K partition")
    ap.add_argument("--narrow", action="store_true", help="linear: the narrower and deeper tiles instead")
    ap.add_argument("--configs", nargs="+", default=["32,4", "32,8", "16,4", "16,2", "64,8", "128,8"],
                    help="delta: BLOCK_V,num_warps pairs to time (BLOCK_V a power of two <= DV)")
    ap.add_argument("--old", nargs="+", help="delta: other copies of engine/models/delta_rule.py to time beside "
                                             "(each its own config); tree: a copy of engine/decoding/tree_kernel.py")
    ap.add_argument("--md", help="write the table here")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_bench needs CUDA", file=sys.stderr)
        return 2
    if args.kernel == "tree":
        return _report(args, *bench_tree(_load_module("old_tree_kernel", args.old[0]) if args.old else None))
    if args.kernel == "blas":
        return _report(args, *bench_blas())
    if args.kernel == "attention":
        return _report(args, *bench_attention())
    if args.kernel == "plans":
        shapes = _pick_shapes(args.shapes)
        if not shapes or any(not 1 <= m <= 1024 for m in args.rows):
            print(f"plans: --shapes {args.shapes} must match a weight of {[s[0] for s in LINEAR_SHAPES]} and "
                  f"--rows {args.rows} lie in 1..1024", file=sys.stderr)
            return 2
        return _report(args, *bench_plans(shapes, args.rows, args.keep_step))
    if args.kernel == "linear":
        shapes = _pick_shapes(args.shapes)
        return _report(args, *bench_linear(shapes, LINEAR_NARROW_TILES if args.narrow else LINEAR_TILES))
    configs = []
    for c in args.configs:
        try:
            block_v, warps = (int(x) for x in c.split(","))
        except ValueError:
            print(f"--configs: {c!r} is not BLOCK_V,num_warps (two integers)", file=sys.stderr)
            return 2
        if block_v < 1 or block_v & (block_v - 1) or block_v > DV or warps not in (1, 2, 4, 8, 16):
            print(f"--configs: {c!r}: BLOCK_V must be a power of two <= {DV}, num_warps 1, 2, 4, 8 or 16",
                  file=sys.stderr)
            return 2
        configs.append((block_v, warps))
    default = delta_rule.kernel_config
    rows = []
    for i, path in enumerate(args.old or []):
        old = _load_module(f"old_delta_rule_{i}", path)
        rows.append({"config": f"{Path(path).name} (its own)", **bench_delta(old)})
    rows.append({"config": f"default {default(DK, DV)[1:]}", **bench_delta(delta_rule)})
    try:
        for block_v, warps in configs:
            delta_rule.kernel_config = lambda dk, dv, bv=block_v, w=warps: (default(dk, dv)[0], bv, w)
            rows.append({"config": f"BLOCK_V={block_v} warps={warps}", **bench_delta(delta_rule)})
    finally:
        delta_rule.kernel_config = default
    lines = ["| config | AR step (T=1) us | verify, budget 32 (T=33) us | states stored | prefill (T=512) us | "
             "commit, 48 layers, AL 5 us |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['config']} | {r['ar']:.1f} | {r['verify33']:.1f} | {r['stored']} | {r['prefill512']:.1f} | "
              f"{r['commit']:.1f} |" for r in rows]
    return _report(args, rows, lines)


def _load_module(name: str, path: str):
    """A module from a file (another copy of an engine module, ``--old``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pick_shapes(wanted: list[str] | None) -> list[tuple[str, int, int]]:
    """``LINEAR_SHAPES`` whose label starts with one of ``wanted`` (all: None), and any weight named by
    its dims ``NxK``."""
    first: dict[tuple[int, int], tuple[str, int, int]] = {}  # one label per shape
    for label, n, k in LINEAR_SHAPES:
        if not wanted or any(label.startswith(w) or w == f"{n}x{k}" for w in wanted):
            first.setdefault((n, k), (label, n, k))
    for w in wanted or []:  # any other weight, by its dims: N x K (out x in features)
        dims = w.split("x")
        if len(dims) == 2 and all(d.isdigit() and int(d) > 0 for d in dims):
            first.setdefault((int(dims[0]), int(dims[1])), (w, int(dims[0]), int(dims[1])))
    return list(first.values())


def _table(first: str, columns: list[tuple[str, str]], rows: list[dict]) -> list[str]:
    """Markdown lines: the ``first`` key's value, then each (header, key) column's value in us."""
    lines = [f"| {first} | " + " | ".join(h for h, _ in columns) + " |", "|---|" + "---|" * len(columns)]
    return lines + [f"| {r[first]} | " + " | ".join(f"{r[k]:.1f}" for _, k in columns) + " |" for r in rows]


def _report(args, rows: list[dict], lines: list[str]) -> int:
    table = "\n".join(lines)
    print(table)
    if args.md:
        Path(args.md).write_text(table + "\n")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
