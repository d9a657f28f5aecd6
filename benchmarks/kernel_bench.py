"""Time single Triton kernels by launch configuration on the GPU, against what they replace.

    python benchmarks/kernel_bench.py delta                 # the tree delta rule, 27B-shape GDN heads
    python benchmarks/kernel_bench.py delta --old old.py    # also another version of delta_rule.py
    python benchmarks/kernel_bench.py tree                  # the DDTree kernel by launch configuration
    python benchmarks/kernel_bench.py blas                  # one-row products of the large presets
    python benchmarks/kernel_bench.py attention             # the split attention by keys per span
    python benchmarks/kernel_bench.py linear                # the few-row linear kernel against cuBLAS

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

from engine.models import delta_rule  # noqa: E402
from engine.tree import build_tree_host  # noqa: E402

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


def bench_tree() -> tuple[list[dict], list[str]]:
    """The DDTree kernel (L = 15, k = 8: SmolLM2's draft) per budget, by warp count; tie-free random
    log-probs, and log-probs in steps of 1/8 (bf16 draft logits repeat values: exact ties)."""
    from engine.models import tree_kernel

    gen = torch.Generator().manual_seed(0)
    lp = (-torch.cumsum(torch.rand(15, 8, generator=gen) + 1e-3, dim=1)).cuda()
    tied = torch.sort((lp * 8).round() / 8, dim=1, descending=True).values
    ids = torch.randint(0, 1000, (15, 8), generator=gen).cuda()
    root = torch.tensor([5], device="cuda")
    own = tree_kernel.kernel_warps
    rows = []
    try:
        for warps in TREE_WARPS:
            tree_kernel.kernel_warps = own if warps is None else (lambda budget, w=warps: w)
            name = f"warps={warps}" if warps else "its own (4 up to budget 32, 8 beyond)"
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


LINEAR_SHAPES = BLAS_SHAPES + [("8B lm_head", 151936, 4096), ("SmolLM2 lm_head", 49152, 576)]
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
    tuned = lin.TUNED.get(torch.cuda.get_device_capability(), {}).get((n, k), {})
    row["chosen"] = {cls: cfg.__dict__ for cls, cfg in tuned.items()}
    for m in (1, 33):  # the engine's launch (cuBLAS where it has none)
        row[f"chosen{m}"] = _time(lambda m=m: lin.linear(xs[m], pick()))
    cfg = tuned.get("step") or lin.LinearConfig(64, 128)
    one = lin._kernel_linear(xs[16][:1], ws[0], None, cfg)
    row["bits_equal"] = {16: bool(torch.equal(lin._kernel_linear(xs[16], ws[0], None, cfg)[:1], one))}
    cfg = tuned.get("verify") or lin.LinearConfig(128, 128, 1, 8, 5)
    one = lin._kernel_linear(xs[65][:17], ws[0], None, cfg)
    row["bits_equal"].update({m: bool(torch.equal(lin._kernel_linear(xs[65][:m], ws[0], None, cfg)[:17], one))
                              for m in (33, 65)})
    row["best"], row["errors"], row["tried"] = ok[:3], [t for t in tried if "error" in t][:3], tried
    return row


# (label, query heads, K/V heads, head_dim, key span, query rows): SmolLM2 and the 27B shape's
# attention in an AR step and a DDTree verify (budget 48 and 32)
ATTN_CASES = [("SmolLM2 AR", 9, 3, 64, 290, 1), ("SmolLM2 verify b48", 9, 3, 64, 512, 49),
              ("27B AR", 24, 4, 256, 522, 1), ("27B verify b32", 24, 4, 256, 1024, 33)]
# keys per span of the split attention (engine.models.attention.SPLIT_KEYS; the first: the engine's)
ATTN_SPLITS = (128, 64, 32)


def bench_attention() -> tuple[list[dict], list[str]]:
    """The split decode attention (both launches) by keys per span: more spans, more programs."""
    from engine.models import attention as split_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    saved = split_attention.SPLIT_KEYS
    rows = []
    try:
        for label, hq, hkv, d, s_len, t in ATTN_CASES:
            q = torch.randn(t, hq, d, generator=gen, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(s_len, hkv, d, generator=gen, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(s_len, hkv, d, generator=gen, device="cuda", dtype=torch.bfloat16)
            mask = torch.ones(t, s_len, dtype=torch.bool, device="cuda").tril(s_len - t)
            row = {"case": f"{label} (T={t}, keys {s_len})"}
            for split in ATTN_SPLITS:
                split_attention.SPLIT_KEYS = split
                row[f"split{split}"] = _time(lambda q=q, k=k, v=v, m=mask: split_attention.attention(q, k, v, m))
            rows.append(row)
    finally:
        split_attention.SPLIT_KEYS = saved
    return rows, _table("case", [(f"{s} keys/span us", f"split{s}") for s in ATTN_SPLITS], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=["delta", "tree", "blas", "attention", "linear"])
    ap.add_argument("--shapes", nargs="+", help="linear: only the weights whose label starts with one of these")
    ap.add_argument("--narrow", action="store_true", help="linear: the narrower and deeper tiles instead")
    ap.add_argument("--configs", nargs="+", default=["32,4", "32,8", "16,4", "16,2", "64,8", "128,8"],
                    help="delta: BLOCK_V,num_warps pairs to time (BLOCK_V a power of two <= DV)")
    ap.add_argument("--old", help="delta: another copy of engine/models/delta_rule.py to time beside (its own config)")
    ap.add_argument("--md", help="write the table here")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_bench needs CUDA", file=sys.stderr)
        return 2
    if args.kernel == "tree":
        return _report(args, *bench_tree())
    if args.kernel == "blas":
        return _report(args, *bench_blas())
    if args.kernel == "attention":
        return _report(args, *bench_attention())
    if args.kernel == "linear":
        shapes = [s for s in LINEAR_SHAPES if not args.shapes or any(s[0].startswith(p) for p in args.shapes)]
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
    if args.old:
        spec = importlib.util.spec_from_file_location("old_delta_rule", args.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        rows.append({"config": f"{Path(args.old).name} (its own)", **bench_delta(old)})
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
