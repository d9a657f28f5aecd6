"""The few-row products' K loop in Hopper SASS, without a GPU: the dense bf16 kernel and the GGUF-block
kernel (``quant_kernel``) compiled for sm_90 on a weight's 1-row (step) launch (``--rows N``: the launch of N
rows, a verify's past 16), and per weight value
the thread instructions of one loop iteration, with registers and the loop's loads (issue #28: how
much decode work a quantized AR step issues against the bf16 one's).

    python benchmarks/kernel_sass.py                      # the 27B Q4_K_M step's weights
    python benchmarks/kernel_sass.py --dump DIR           # also each loop's SASS, one file a kernel
    python benchmarks/kernel_sass.py --packed             # and the Q4_K bf16-pair prototype (quant_packed.py)

Static counts, not timings: an upper bound on what issue rate alone allows, not a measurement.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_check import compile_for_hopper, loop, resources  # noqa: E402

from engine.models import linear as rows_linear  # noqa: E402
from engine.models import quant_kernel  # noqa: E402
from engine.models.quant import FORMATS  # noqa: E402

CASES = [(34816, 5120, "Q4_K"), (16480, 5120, "Q4_K"), (5120, 17408, "Q4_K"), (5120, 6144, "Q4_K"),
         (14336, 5120, "Q4_K"), (5120, 17408, "Q6_K"), (248320, 5120, "Q6_K"),
         (5120, 6144, "Q8_0"), (49152, 576, "Q8_0")]  # Q8_0: a Q8_0 file's o_proj; SmolLM2's Q8_0 head
TYPES = dict(x_ptr="*bf16", b_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32", ticket_ptr="*i32", M="i32", N="i32",
             K="i32", sxm="i32", k_iters="i32", split="i32", tiles="i32", nibble="i32")
ALIGNED = ("x_ptr", "b_ptr", "out_ptr", "part_ptr", "ticket_ptr", "N", "K", "sxm")


def row(name: str, compiled, warps: int, values: int, dump: Path | None) -> str:
    body = loop(compiled)
    ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0] for ins in body)
    loads = ", ".join(f"{k} {v}" for k, v in sorted(ops.items()) if k.startswith(("LDG", "LDGSTS")))
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{name.replace(' ', '_')}.sass").write_text("\n".join(body) + "\n")
    res = resources(compiled)
    return (f"| {name} | {res['REG']} | {warps} | {len(body)} | {len(body) * 32 * warps / values:.1f} | "
            f"{sum(v for op, v in ops.items() if op.startswith('HGMMA'))} | {loads} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", type=Path, help="write each loop's SASS into this folder")
    ap.add_argument("--half-words", action="store_true",
                    help="compile the half-word decode for every format (the word formats' other path)")
    ap.add_argument("--packed", action="store_true",
                    help="also the Q4_K prototype of benchmarks/quant_packed.py on each Q4_K weight's launch")
    ap.add_argument("--rows", type=int, default=1,
                    help="the launch for this many rows (default 1: the step's; 33: a budget-32 verify's)")
    args = ap.parse_args(argv)
    if not 1 <= args.rows <= rows_linear.MAX_ROWS:
        ap.error(f"--rows must lie in 1..{rows_linear.MAX_ROWS}, got {args.rows}")
    print(f"| kernel ({args.rows}-row launch) | registers | warps | loop instructions a thread | thread instructions a "
          "weight value | HGMMA | global loads a thread |\n|---|---|---|---|---|---|---|")
    for n, k, name in CASES:
        cfg = rows_linear.tuned_plan(n, k, (9, 0), name).for_rows(args.rows)
        fmt = FORMATS[name]
        words = not args.half_words and quant_kernel.words_fit(fmt, cfg.block_k, fmt.row_bytes(k))
        block_m, warps = quant_kernel.launch_shape(fmt, cfg, args.rows)
        # the dense kernel's own row tile and stages (linear._kernel_linear's rule); the block kernel's below
        dense_m = min(cfg.row_block, max(16, triton.next_power_of_2(args.rows)))
        shape = dict(HAS_BIAS=False, EVEN_K=k % cfg.block_k == 0, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                     INTERPRET=False)
        dense = compile_for_hopper(rows_linear._linear_kernel, dict(TYPES, w_ptr="*bf16", swn="i32"),
                                   dict(shape, BLOCK_M=dense_m, PDL=rows_linear.PDL), cfg.num_warps,
                                   rows_linear.stages_for(cfg, dense_m, 2), (*ALIGNED, "w_ptr", "swn"))
        print(row(f"bf16 {n}x{k}", dense, cfg.num_warps, cfg.block_n * cfg.block_k, args.dump))
        unit = 4 if words else 2  # the row stride's element: a word or a half-word (aligned: 16 of them)
        quant = compile_for_hopper(
            quant_kernel._quant_kernel, dict(TYPES, blocks_ptr="*i32" if words else "*fp16", row_stride="i32"),
            dict(shape, BLOCK_M=block_m, FMT=quant_kernel.KERNEL_FORMATS[name], VALUES=fmt.values, NBYTES=fmt.nbytes,
                 GROUP=quant_kernel.group_size(fmt, cfg.block_k), **quant_kernel.word_constants(fmt, words)),
            warps, quant_kernel.launch_stages(cfg, block_m, 2),
            (*ALIGNED, "blocks_ptr") + (("row_stride",) if fmt.row_bytes(k) % (16 * unit) == 0 else ()),
            quant_kernel.register_cap(fmt, words, block_m, warps))  # as kernel_linear launches it
        label = f"{name}{' words' if words else ''} {n}x{k}"
        print(row(label, quant, warps, cfg.block_n * cfg.block_k, args.dump), flush=True)
        if args.packed and name == "Q4_K":
            import quant_packed

            packed = compile_for_hopper(
                quant_packed._packed_kernel, dict(TYPES, blocks_ptr="*i32", row_stride="i32"),
                dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_M=block_m, INTERPRET=False), warps,
                quant_kernel.launch_stages(cfg, block_m, 2), (*ALIGNED, "blocks_ptr", "row_stride"))
            print(row(f"Q4_K packed {n}x{k}", packed, warps, cfg.block_n * cfg.block_k, args.dump), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
