"""Time single Triton kernels by launch configuration on the GPU, against what they replace.

    python benchmarks/kernel_bench.py delta                 # the tree delta rule, 27B-shape GDN heads
    python benchmarks/kernel_bench.py delta --old a.py b.py # also other versions of delta_rule.py, their
                                                            # results compared bit for bit with the engine's
    python benchmarks/kernel_bench.py tree                  # the DDTree kernel by launch configuration
    python benchmarks/kernel_bench.py tree --old old.py     # also another version of tree_kernel.py
    python benchmarks/kernel_bench.py blas                  # one-row products of the large presets
    python benchmarks/kernel_bench.py attention             # decode attention by keys per span and block
    python benchmarks/kernel_bench.py linear                # the few-row linear kernel against cuBLAS
    python benchmarks/kernel_bench.py plans --shapes SmolLM2  # a measured LinearPlan per weight
    python benchmarks/kernel_bench.py quant-tiles           # the block kernel's 1-row launches per 27B weight
                                                            # (--rows 33: a budget-32 verify's, K split as its step)
    python benchmarks/kernel_bench.py quant-plans           # a measured plan per weight kept in GGUF blocks
                                                            # (SmolLM2's Q4_1 GGUF; --shapes 576x1536:Q4_1 ...)
    python benchmarks/kernel_bench.py quant                 # GGUF blocks dequantized in registers, against
                                                            # dequantize-then-multiply and the bf16 weight
    python benchmarks/kernel_bench.py packed                # the Q4_K bf16-pair decode prototype beside the
                                                            # engine's kernel (benchmarks/quant_packed.py)

Every number is GPU microseconds per launch: ``LAUNCHES`` launches captured in one CUDA graph and
replayed (median of 5), so host launch costs are left out, as in the engine's captured steps.

``delta``: one row per (BLOCK_V, num_warps); columns for an AR step (T = 1), budget-32 and budget-64
DDTree verifies (T = 33 and 65, best-first trees of random draft log-probs) and a 512-token prefill
chain. Only the launch configuration changes between rows: within one
configuration tree and chain forwards share one compiled kernel, which keeps speculative decoding
exact; across configurations the float32 rounding may differ.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_timing import LAUNCHES  # noqa: E402
from kernel_timing import time_us as _time
from linear_bench import LINEAR_NARROW_TILES, LINEAR_SHAPES, LINEAR_TILES, bench_blas, bench_linear, bench_plans  # noqa: E402
from quant_bench import (  # noqa: E402
    NATIVE_SHAPES,
    QUANT_ROWS,
    QUANT_SHAPES,
    TILE_SHAPES,
    bench_packed,
    bench_quant,
    bench_quant_plans,
    bench_quant_tiles,
)

from engine.decoding.tree import build_tree_host  # noqa: E402
from engine.models import delta_rule  # noqa: E402

HK, HV, DK, DV = 16, 48, 128, 128  # qwen35-27b-shape's linear attention heads


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


def _delta_cases(gen: torch.Generator):
    """(name, inputs, parents, tree forward?) of an AR step, budget-32 and budget-64 trees and a
    512-token chain: what the delta rule is timed and compared on."""
    for name, t in (("ar", 1), ("verify33", 33), ("verify65", 65), ("prefill512", 512)):
        x = _inputs(t, gen)
        if name.startswith("verify"):
            yield name, x, _tree_parents(t - 1, gen), True
        else:
            yield name, x, torch.arange(t, device="cuda") - 1, False


def _tree_call(module, x: dict, parents: torch.Tensor):
    """A tree forward of ``module`` (the engine's, or an ``--old`` copy with the API it had), its
    per-forward tables made outside the call (the engine makes them once for every layer), and what
    its programs do: (the call, how many leaf paths it walks or states it stores)."""
    if hasattr(module, "leaf_paths"):
        paths = module.leaf_paths(parents)
        return (lambda: module.tree_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], parents, x["state"],
                                               tree=True, paths=paths, backend="triton"),
                f"{int((paths.counts > 0).sum())} paths")
    # before 2026-12-05: one program walked the whole tree, storing the states later nodes restart from
    t = parents.numel()
    nodes = torch.zeros(t, HV, DK, DV, device="cuda")
    extra = {"restarts": module.restart_flags(parents)} if hasattr(module, "restart_flags") else {}
    stored = f"{int(extra['restarts'].sum())} states stored" if extra else f"{t} states stored"
    return (lambda: module.tree_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], parents, x["state"], nodes,
                                           backend="triton", **extra), stored)


def bench_delta(module) -> dict[str, float]:
    row = {}
    gen = torch.Generator().manual_seed(0)
    for name, x, parents, tree in _delta_cases(gen):
        if tree:
            fn, row[name + " programs"] = _tree_call(module, x, parents)
            row[name] = _time(fn)
        else:
            row[name] = _time(lambda x=x, c=parents: module.tree_delta_rule(
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


def delta_bits(module) -> dict[str, torch.Tensor]:
    """What a copy of the kernel computes on fixed inputs, to compare bit for bit with the engine's:
    an AR step, two trees' outputs, a 512-token chain and a path commit."""
    gen = torch.Generator().manual_seed(1)
    out = {}
    for name, x, parents, tree in _delta_cases(gen):
        if tree:
            out[name] = _tree_call(module, x, parents)[0]()
        else:
            out[name] = module.tree_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], parents, x["state"],
                                               backend="triton")
            out[name + " state"] = x["state"]
    x = {k: v.unsqueeze(0).expand(4, *v.shape).contiguous() for k, v in _inputs(33, gen).items() if k != "state"}
    state = torch.randn(4, HV, DK, DV, generator=gen).cuda() * 0.1
    module.delta_rule_path(x["q"], x["k"], x["v"], x["g"], x["beta"], torch.arange(33, device="cuda"),
                           torch.tensor([5], device="cuda"), state)
    out["commit state"] = state
    return out


def _walks_agree() -> str:
    """The engine's kernel at its config as set now on a budget-32 tree of the 27B's heads:
    its error against the torch loop, and whether its walks agree bit for bit: every leaf's path as a chain against
    the tree forward, the chain against AR steps one token at a time, a path commit against the chain's state."""
    gen = torch.Generator().manual_seed(2)
    x = _inputs(33, gen)
    parents = _tree_parents(32, gen)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    tree = delta_rule.tree_delta_rule(*args, parents, x["state"], tree=True, backend="triton")
    ref = delta_rule.tree_delta_rule(*args, parents, x["state"].clone(), tree=True, backend="torch")
    err = float((tree - ref).norm() / ref.norm())
    wrong = []
    paths = delta_rule.leaf_paths(parents)
    for leaf in torch.nonzero(paths.counts).flatten().tolist():
        path = paths.index[leaf, : int(paths.counts[leaf])].long()
        chain = delta_rule.tree_delta_rule(*(a[path] for a in args), torch.arange(len(path), device="cuda") - 1,
                                           x["state"].clone(), backend="triton")
        if not torch.equal(chain, tree[path]):
            wrong.append(f"leaf {leaf}'s path")
    chain_idx = torch.arange(12, device="cuda") - 1
    chain_state = x["state"].clone()
    chain = delta_rule.tree_delta_rule(*(a[:12] for a in args), chain_idx, chain_state, backend="triton")
    steps_state = x["state"].clone()
    steps = torch.cat([delta_rule.tree_delta_rule(*(a[i:i + 1] for a in args), chain_idx[:1], steps_state,
                                                  backend="triton") for i in range(12)])
    if not (torch.equal(steps, chain) and torch.equal(steps_state, chain_state)):
        wrong.append("AR steps")
    committed = x["state"].clone()[None]
    delta_rule.delta_rule_path(*(a[:12][None].contiguous() for a in args), torch.arange(12, device="cuda"),
                               torch.tensor([12], device="cuda"), committed, backend="triton")
    if not torch.equal(committed[0], chain_state):
        wrong.append("path commit")
    return f"error {err:.1e} against the torch loop, walks {'alike' if not wrong else 'differ: ' + ', '.join(wrong)}"


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str:
    differ = [k for k in a
              if a[k].shape != b[k].shape or not torch.equal(a[k].view(torch.int32), b[k].view(torch.int32))]
    return "same" if not differ else "differ: " + ", ".join(differ)


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


# (label, query heads, K/V heads, head_dim, committed keys, new tokens): SmolLM2 and the 27B shape's
# attention in an AR step and a DDTree verify (budget 48 and 32), the 27B's also at 4k and 32k keys
ATTN_CASES = [("SmolLM2 AR", 9, 3, 64, 290, 1), ("SmolLM2 verify b48", 9, 3, 64, 463, 49),
              ("8B AR", 32, 8, 128, 522, 1), ("8B verify b32", 32, 8, 128, 991, 33),
              ("27B AR", 24, 4, 256, 522, 1), ("27B verify b32", 24, 4, 256, 991, 33),
              ("27B AR 4k", 24, 4, 256, 4096, 1), ("27B verify b32 4k", 24, 4, 256, 4096, 33),
              ("27B AR 32k", 24, 4, 256, 32768, 1), ("27B verify b32 32k", 24, 4, 256, 32768, 33)]
# the step kernel's launch candidates: step_attention_launch's ("engine") with these keys overridden
# (SPLIT keys per span, BLOCK_N x num_warps, BLOCK_M query rows a program, FOLD spans a run of the merge's
# fold); FOLD_FROM_SMS is the module's (a verify's programs folding the runs of committed spans themselves,
# from that many times the SMs' programs: the same bits either way, checked)
ATTN_VARIANTS = [("engine", {}), ("unfolded", {"FOLD_FROM_SMS": float("inf")}),
                 ("folded always", {"FOLD_FROM_SMS": 0.0}), ("fold 8", {"FOLD": 8}), ("spans 64", {"SPLIT": 64}),
                 ("32x8", {"num_warps": 8}), ("m32 32x8", {"BLOCK_M": 32, "num_warps": 8}),
                 ("m64 32x8", {"BLOCK_M": 64, "num_warps": 8})]


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
    saved_launch, saved_fold = split_attention.step_attention_launch, split_attention.FOLD_FROM_SMS
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
            for name, variant in ATTN_VARIANTS:
                own = {key: v for key, v in variant.items() if key != "FOLD_FROM_SMS"}
                split_attention.FOLD_FROM_SMS = variant.get("FOLD_FROM_SMS", saved_fold)
                launch = {**saved_launch(d), **own}
                if launch["SPLIT"] % launch["BLOCK_N"]:
                    row[name] = float("nan")
                    continue
                split_attention.step_attention_launch = lambda dd, fp32=False, o=own: {**saved_launch(dd, fp32), **o}
                try:
                    row[name] = _time(lambda q=q, k=k, v=v, keys=keys: split_attention.step_attention(q, k, v, keys))
                    blocks = ("SPLIT", "BLOCK_N", "BLOCK_M", "FOLD")
                    got = split_attention.step_attention(q, k, v, keys)
                    same_blocks = all(launch[b] == saved_launch(d)[b] for b in blocks)
                    if same_blocks and not torch.equal(got, want):
                        print(f"  {label} {name}: bits differ from the engine's launch (same spans and blocks)")
                except Exception as exc:  # a launch that does not fit: said so
                    print(f"  {label} {name}: {str(exc).splitlines()[0][:100]}")
                    row[name] = float("nan")
                finally:
                    split_attention.step_attention_launch = saved_launch
            print(row, flush=True)
            rows.append(row)
    finally:
        split_attention.step_attention_launch, split_attention.FOLD_FROM_SMS = saved_launch, saved_fold
    cols = [("mask kernel", "mask")] + [(name, name) for name, _ in ATTN_VARIANTS]
    return rows, _table("case", cols, rows)


def _quant(args: argparse.Namespace) -> int:
    """``quant``, ``quant-tiles`` and ``quant-plans``: their weights (``--shapes``: labels' starts or NxK; quant-plans
    also NxK:FORMAT, any weight in any block format)."""
    table = {"quant": QUANT_SHAPES, "quant-tiles": TILE_SHAPES, "quant-plans": NATIVE_SHAPES}[args.kernel]

    def named(s: tuple, w: str) -> bool:  # a weight of the table by its label's start or its NxK
        return s[0].startswith(w) or w == f"{s[1]}x{s[2]}"

    shapes = [s for s in table if not args.shapes or any(named(s, w) for w in args.shapes)]
    if args.kernel == "quant-plans":
        from engine.models.linear import BLOCK_FORMATS

        for w in args.shapes or []:  # any weight by its dims and format: NxK:FORMAT
            dims, _, name = w.partition(":")
            nk = dims.split("x")
            if name or not any(named(s, w) for s in table):
                if len(nk) != 2 or not all(d.isdigit() and int(d) > 0 for d in nk) or name not in BLOCK_FORMATS:
                    print(f"quant-plans: --shapes {w!r} is neither a label's start of {[s[0] for s in table]}, their "
                          f"NxK, nor NxK:FORMAT with FORMAT one of {', '.join(BLOCK_FORMATS)}", file=sys.stderr)
                    return 2
                shapes.append((w, int(nk[0]), int(nk[1]), name))
    if not shapes:
        print(f"{args.kernel}: --shapes {args.shapes} match none of {[s[0] for s in table]}", file=sys.stderr)
        return 2
    default_rows = {"quant": QUANT_ROWS, "quant-tiles": [1], "quant-plans": [1, 49]}[args.kernel]
    rows = sorted(set(args.rows or default_rows))
    if any(not 1 <= m <= 1024 for m in rows) or args.workers < 0:
        print(f"{args.kernel}: --rows {rows} must lie in 1..1024, --workers {args.workers} be 0 (the CPUs less two) "
              "or a count of processes", file=sys.stderr)
        return 2
    if args.kernel == "quant":
        return _report(args, *bench_quant(shapes, rows=tuple(rows)))
    if args.kernel == "quant-plans":
        return _report(args, *bench_quant_plans(shapes, rows=rows, workers=args.workers, out_path=args.out))
    return _report(args, *bench_quant_tiles(shapes, rows=rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=["delta", "tree", "blas", "attention", "linear", "plans", "quant",
                                           "quant-tiles", "quant-plans", "packed"])
    ap.add_argument("--shapes", nargs="+",
                    help="linear, plans, quant, quant-tiles, quant-plans: the weights whose label starts so (or NxK; "
                         "quant-plans: NxK:FORMAT too)")
    ap.add_argument("--rows", nargs="+", type=int,
                    help="plans (default 1 16 49), quant (1 16 33), quant-tiles (1), quant-plans (1 49): the row "
                         "counts timed (up to 16: the step launch; beyond: the verify's, quant-tiles keeping the "
                         "step's K partition)")
    ap.add_argument("--workers", type=int, default=0,
                    help="quant-plans: processes compiling the launches ahead of timing (0: the CPUs less two, <= 16; "
                         "plans takes that default)")
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
        args.rows = args.rows or [1, 16, 49]
        if not shapes or any(not 1 <= m <= 1024 for m in args.rows):
            print(f"plans: --shapes {args.shapes} must match a weight of {[s[0] for s in LINEAR_SHAPES]} and "
                  f"--rows {args.rows} lie in 1..1024", file=sys.stderr)
            return 2
        return _report(args, *bench_plans(shapes, args.rows, args.keep_step))
    if args.kernel in ("quant", "quant-tiles", "quant-plans"):
        return _quant(args)
    if args.kernel == "packed":
        return _report(args, *bench_packed(rows=sorted(set(args.rows or [1, 33]))))
    if args.kernel == "linear":
        shapes = _pick_shapes(args.shapes)
        return _report(args, *bench_linear(shapes, LINEAR_NARROW_TILES if args.narrow else LINEAR_TILES))
    return _delta(args)


def _delta(args) -> int:
    """``delta``: the tree delta rule's kernel at each of ``--configs`` (and the ``--old`` copies) on the 27B's
    heads."""
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
    engine_bits = delta_bits(delta_rule)
    for i, path in enumerate(args.old or []):
        old = _load_module(f"old_delta_rule_{i}", path)
        rows.append({"config": f"{Path(path).name} (its own)", "bits": _same_bits(engine_bits, delta_bits(old)),
                     **bench_delta(old)})
    rows.append({"config": f"default {default(DK, DV)[1:]}", "bits": f"the engine's; {_walks_agree()}",
                 **bench_delta(delta_rule)})
    try:
        for block_v, warps in configs:
            delta_rule.kernel_config = lambda dk, dv, bv=block_v, w=warps: (default(dk, dv)[0], bv, w)
            rows.append({"config": f"BLOCK_V={block_v} warps={warps}",
                         "bits": f"{_same_bits(engine_bits, delta_bits(delta_rule))}; {_walks_agree()}",
                         **bench_delta(delta_rule)})
    finally:
        delta_rule.kernel_config = default
    lines = ["| config | AR step (T=1) us | verify, budget 32 (T=33) us | budget 64 (T=65) us | its programs "
             "(b32 / b64) | prefill (T=512) us | commit, 48 layers, AL 5 us | bits against the engine's |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['config']} | {r['ar']:.1f} | {r['verify33']:.1f} | {r['verify65']:.1f} | "
              f"{r['verify33 programs']} / {r['verify65 programs']} | {r['prefill512']:.1f} | {r['commit']:.1f} | "
              f"{r.get('bits', 'the engine kernel at this config')} |" for r in rows]
    return _report(args, rows, lines)


def _load_module(name: str, path: str):
    """A module from a file (another copy of an engine module, ``--old``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass in it looks its module up there (delta_rule's LeafPaths)
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
