"""The operand-register decode of Q4_K, Q6_K and Q4_1 (``engine.models.quant_gluon``, issue #28) on its own: static
counts of its K loop for sm_90 (no GPU needed: ``python benchmarks/quant_gluon.py [--warps 8] [--x-ahead]``), its
launches timed beside the engine's other kernel (``--bench``, ``quant_gluon_bench.py``), and ``install``, which routes a
benchmark's products through it with options the engine does not take (the float decode, x read ahead, the warps
of every launch) for ``gpu_bench.py --q4k-decode gluon*``."""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: run as a script, engine imports

from engine.models import quant  # noqa: E402
from engine.models.quant_gluon import (  # noqa: E402
    TILE_K,
    TILE_N,
    compile_for_hopper,
    gluon,
    linear,
    linear_q6_k,
    padded_rows,
    repack,
    repack_q6_k,
    split_for,
)

__all__ = ["TILE_K", "TILE_N", "install", "linear", "linear_q6_k", "repack", "repack_q6_k", "split_for"]


def install(pairs: bool = False, x_ahead: bool = False, warps: int | None = None) -> None:
    """Route the engine's Q4_K products that reach ``quant_kernel`` (bf16, K whole 256-value blocks, no bias) through
    the operand-register decode with a benchmark's options (``pairs``: the bf16 pair decode, the engine's, and the
    Q6_K products through ``linear_q6_k`` too; else the float decode, ``dequantize``'s values), every other
    product through ``quant_kernel``: ``quant_kernel.linear`` replaced in place, for a benchmark process only
    (``gpu_bench.py --q4k-decode gluon``, ``gluon-pairs`` or ``gluon-pairs-ahead``, which load with
    the decode set to "kernel", ``fused.set_quant_decode``, so that the weights stay in their blocks and reach it).
    ``x_ahead``: x read an iteration ahead; ``warps``: every launch on 4 or 8 where they take whole tiles of the
    weight's padded rows, else as ``_warps`` picks. A weight is repacked on its first such call and kept (the blocks
    stay too): that call must come before a graph is captured, as the engine's eager warm-up steps do; one first met
    during a capture takes the engine's kernel. A launch of more than 64 rows takes row blocks (a verify of any
    budget reads the AR step's weight); a prefill takes the engine's dequantized product, ``dequantize``'s values
    (with ``pairs``: not the decode's; the benchmarks time steps)."""
    from engine.models import quant_kernel

    engine_linear = quant_kernel.linear
    formats = ("Q4_K", "Q6_K") if pairs else ("Q4_K",)
    # by the rows' address and shape (a fused group's ``part`` is a fresh slice each call, the same rows), with a
    # weak reference to the tensor that owns them: a dead owner's address may hold another weight's blocks
    # with its planes, the weight's split and warps (one split a weight: every launch of it rounds alike)
    repacked: dict[tuple[int, tuple[int, ...]], tuple[weakref.ref, tuple[Tensor, ...], int, int | None]] = {}

    def routed(x: Tensor, blocks: Tensor, fmt, cols: int, bias: Tensor | None = None) -> Tensor:
        rows = x.numel() // cols
        if fmt.name not in formats or cols % quant.QK_K or bias is not None or x.dtype != torch.bfloat16:
            return engine_linear(x, blocks, fmt, cols, bias)
        key = (blocks.data_ptr(), tuple(blocks.shape))
        if key not in repacked or repacked[key][0]() is None:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                return engine_linear(x, blocks, fmt, cols, bias)
            owner = blocks if blocks._base is None else blocks._base
            planes = repack_q6_k(blocks, cols) if fmt.name == "Q6_K" else repack(blocks, cols, pairs)
            n = blocks.shape[0]
            split = split_for(n, cols, fmt=fmt.name)
            # asked-for warps where they take whole tiles of this weight's padded rows, else each launch's own choice
            w = warps if warps is None or padded_rows(n) % (16 * warps) == 0 else None
            repacked[key] = (weakref.ref(owner), planes, split, w)
        _, planes, split, w = repacked[key]
        n = blocks.shape[0]
        options = {"x_ahead": x_ahead, "warps": w}
        if fmt.name == "Q6_K":
            out = linear_q6_k(x.reshape(rows, cols), planes, n, cols, split, **options)
        else:
            out = linear(x.reshape(rows, cols), *planes, n, cols, split, pairs, **options)
        return out.view(*x.shape[:-1], n)

    quant_kernel.linear = routed


def main(argv: list[str] | None = None) -> int:
    """Static counts of the K loop (sm_90): thread instructions a weight value and the loop's shared-memory traffic
    (the x tile's store only: the decoded values never go through shared memory); ``--bench`` times it on a GPU."""
    import argparse
    import re
    import sys
    from collections import Counter
    from pathlib import Path

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64], help="BLOCK_M of each launch (16, 32, 64)")
    ap.add_argument("--bench", action="store_true", help="on a GPU: time it beside the engine kernel (27B weights)")
    ap.add_argument("--launches", action="store_true",
                    help="on a GPU: each 27B weight's launch at every split and warp count, 1 and 33 rows")
    ap.add_argument("--md", help="--bench, --launches: write the table here too")
    ap.add_argument("--q4-1", action="store_true",
                    help="--bench: SmolLM2's Q4_1 weights instead (beside quant_kernel and the dense bf16 kernel)")
    ap.add_argument("--x-ahead", action="store_true", help="the static counts with x's rows read an iteration ahead")
    ap.add_argument("--warps", type=int, choices=[4, 8, 16], default=4,
                    help="the static counts of a 16 x WARPS-row tile")
    ap.add_argument("--pdl", action="store_true", help="the static counts with programmatic dependent launch")
    ap.add_argument("--tail", type=int, choices=[0, 8, 16], default=0,
                    help="the static counts with a tail of this many rows after BLOCK_M's (two products a tile)")
    ap.add_argument("--fold", action="store_true",
                    help="the static counts of a program adding two parts of K itself (FOLD: a verify's launch)")
    ap.add_argument("--maxnreg", type=int, help="the static counts with registers a thread capped (MAXNREG)")
    ap.add_argument("--stages", type=int, choices=[0, 2, 3, 4], default=0,
                    help="the pair decode's static counts with its tiles staged in shared memory (cp.async)")
    args = ap.parse_args(argv)
    if args.bench and args.launches:
        ap.error("--bench and --launches: one table a run (each times the 27B's weights for a minute or more)")
    if args.fold and args.stages > 1:
        ap.error(f"--fold with --stages {args.stages}: a folded program takes the register path (stages 0)")
    if args.q4_1 and not args.bench:
        ap.error("--q4-1: a choice of --bench's weights (SmolLM2's Q4_1 instead of the 27B's); the static counts "
                 "cover every decode, Q4_1 included")
    if gluon is None:
        print("this Triton has no Gluon", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.bench or args.launches:
        if not torch.cuda.is_available():
            print(f"{'--bench' if args.bench else '--launches'} needs CUDA", file=sys.stderr)
            return 2
        from quant_gluon_bench import bench, bench_launches, bench_q4_1

        lines = bench_launches() if args.launches else bench_q4_1() if args.q4_1 else bench()
        if args.md:
            Path(args.md).write_text("\n".join(lines) + "\n")
        return 0
    from kernel_check import loop, resources

    print("| decode | BLOCK_M | registers | loop instructions a thread | a weight value | HGMMA | STS | LDS / LDSM | "
          "global loads | barriers, wgmma waits |\n|---|---|---|---|---|---|---|---|---|---|")
    for decode, block_m in [(decode, block_m) for decode in ("float", "pairs", "q6_k", "q4_1")
                            for block_m in args.rows]:
        # (shared-memory stages: the pair decodes' only, Q4_K's, Q6_K's and Q4_1's)
        stages = 0 if decode == "float" else args.stages
        compiled = compile_for_hopper(block_m, decode, args.x_ahead, args.warps, stages, args.pdl, args.tail,
                                      args.fold, args.maxnreg)
        body = loop(compiled, containing="HGMMA")  # the K loop (not the parts' sum)
        body = [ins for ins in body if not ins.startswith("@!PT ")]  # (never executed: ptxas' padding)
        ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0] for ins in body)
        hgmma, sts, lds = (sum(v for op, v in ops.items() if op.startswith(p)) for p in ("HGMMA", "STS", "LDS"))
        loads = ", ".join(f"{op} {v}" for op, v in sorted(ops.items()) if op.startswith("LDG"))  # LDGSTS: cp.async
        waits = [ins.split(None, 1)[-1].replace(" ", "") for ins in body if "WARPGROUP.DEPBAR" in ins]
        print(f"| {decode} | {block_m} | {resources(compiled)['REG']} | {len(body)} | "
              f"{len(body) * 128 / (TILE_N * TILE_K):.2f} | "
              f"{hgmma} | {sts} | {lds} | {loads} | {ops['BAR.SYNC.DEFER_BLOCKING']}, {' '.join(waits)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
