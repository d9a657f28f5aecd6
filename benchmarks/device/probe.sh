#!/usr/bin/env bash
# A probe that needs no model asset (benchmarks/DEVICE.md; alone in one call, or after call 1 in
# the same command): each captured step graph of the SmolLM2 pair's shapes (random target, the
# shipped draft) and of the 27B hybrid shape replayed alone (`gpu_bench.py graphs`: wall against
# kernel time, kernels by name, every kernel in launch order in the JSON); BLAS=1: the large
# presets' one-row products by BLAS library and call form (`kernel_bench.py blas`); LT=1: the large
# presets with the default BLAS choice, then with cuBLASLt preferred (one machine: a fair A/B).
source benchmarks/device/common.sh probe
section graphs_smol 120 python3 benchmarks/gpu_bench.py graphs --target smollm2-135m-shape \
  --draft engine/checkpoints/smollm2-135m-dflash --budgets ${BUDGETS:-22 32} --context 256 --new-tokens 32 \
  --repeats 20 --out "$OUT/graphs_smol.json"
section graphs_27b 150 python3 benchmarks/gpu_bench.py graphs --presets qwen35-27b-shape --budgets 32 \
  --new-tokens 8 --repeats 10 --out "$OUT/graphs_27b.json"
if [ -n "${BLAS:-}" ]; then
  section blas 120 python3 benchmarks/kernel_bench.py blas --md "$OUT/blas.md"
fi
if [ -n "${LT:-}" ]; then
  section large 120 python3 benchmarks/gpu_bench.py large --presets qwen35-27b-shape qwen3-8b-shape \
    --budgets 32 --repeats 3 --new-tokens 24 --md "$OUT/large.md"
  section large_lt 120 python3 benchmarks/gpu_bench.py large --presets qwen35-27b-shape qwen3-8b-shape \
    --budgets 32 --repeats 3 --new-tokens 24 --blas cublaslt --md "$OUT/large_lt.md"
fi
summary
