"""One launch of each few-row Q4_K product under Nsight Compute (issue #28: why the 1-row kernel streams
0.8 TB/s when its instructions alone would allow ~2.5x that): the engine's block kernel, the bf16-pair
prototype (``quant_packed``), the decode into operand registers (``quant_gluon``, where the
Triton has Gluon) and the bf16 kernel on the dequantized weight, at 1 and 33 rows, on a 27B
weight. Every kernel is compiled and run before the profiled range, so ncu sees warm launches only:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \\
        python3 benchmarks/quant_ncu.py --shape 34816x5120

Without ncu it prints the launches' GPU us (median of 20), so the profiled range is known to be the one timed.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="34816x5120", help="NxK of the weight (K a multiple of 256)")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 33])
    args = ap.parse_args(argv)
    try:
        n, k = (int(v) for v in args.shape.lower().split("x"))
    except ValueError:
        print(f"--shape {args.shape!r}: expected NxK, e.g. 34816x5120", file=sys.stderr)
        return 2
    if k % 256 or n < 1 or not all(1 <= m <= 64 for m in args.rows):
        print(f"--shape {args.shape}: K must be a multiple of 256; --rows {args.rows} must lie in 1..64",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("quant_ncu needs CUDA", file=sys.stderr)
        return 2
    import quant_gluon
    import quant_packed

    from engine.models import linear as lin
    from engine.models import quant_kernel
    from engine.models.quant import FORMATS, dequantize
    from engine.models.quantize import quantize

    fmt = FORMATS["Q4_K"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = quantize(torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02, fmt)
    dense = dequantize(blocks, fmt, k).to(torch.bfloat16)
    calls = []
    regs = {pairs: quant_gluon.repack(blocks, k, pairs) for pairs in (False, True)} if quant_gluon.gluon else None
    split = quant_gluon.split_for(n, k)
    for m in args.rows:
        x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
        calls += [(f"engine Q4_K, {m} rows", lambda x=x: quant_kernel.linear(x, blocks, fmt, k)),
                  (f"packed Q4_K, {m} rows", lambda x=x: quant_packed.linear(x, blocks, k)),
                  (f"bf16 dequantized, {m} rows", lambda x=x: lin.linear(x, dense))]
        if regs is not None:  # the decode into operand registers (its split's parts, then their sum: two kernels)
            calls += [(f"gluon{' pairs' if pairs else ''} Q4_K, {m} rows",
                       lambda x=x, p=pairs: quant_gluon.linear(x, *regs[p], n, k, split, p)) for pairs in regs]
    kept = []
    for name, call in calls:  # compile and warm outside the profiled range
        try:
            for _ in range(3):
                call()
            torch.cuda.synchronize()
        except Exception as e:  # e.g. a Triton whose Gluon does not take the prototype: profile the rest
            print(f"{name}: left out ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})",
                  flush=True)
            continue
        kept.append((name, call))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(20):
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        print(f"{name}: {sorted(times)[10]:.1f} us", flush=True)
    calls = kept
    torch.cuda.cudart().cudaProfilerStart()
    for name, call in calls:
        torch.cuda.nvtx.range_push(name)
        call()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled, in order: " + "; ".join(name for name, _ in calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
