#!/usr/bin/env bash
# A kernel session that needs no asset (benchmarks/DEVICE.md). Each part on request:
#   HEAD=folder   an earlier tree carried in .device/: its 27B AR step and budget-32 verify first (a
#                 fair A/B on one machine)
#   LINEAR=1      the few-row linear kernel against cuBLAS by tile and split (`kernel_bench.py linear`,
#                 SHAPES="27B 8B" by default)
#   OLD_DELTA=f   the tree delta rule against other copies of delta_rule.py ("a.py b.py"; `kernel_bench.py
#                 delta`, the engine's kernel at DELTA_CONFIGS: BLOCK_V,warps pairs), first
#   TESTS=1       the GPU tests of the kernels this session touches and `test_gpu.py` (TEST_FILES: others)
#   LARGE=1       `gpu_bench.py large` (27B and 8B shapes, budget 32; LARGE_REPEATS, 3 by default)
#   GRAPHS=1      the 27B shape's captured AR and budget-32 verify graphs alone, kernels by name
source benchmarks/device/common.sh kernels
if [ -n "${OLD_DELTA:-}" ]; then
  section delta 150 python3 benchmarks/kernel_bench.py delta --old $OLD_DELTA --configs ${DELTA_CONFIGS:-16,1 16,2} \
    --md "$OUT/delta.md" --out "$OUT/delta.json"
fi
if [ -n "${HEAD:-}" ]; then
  section large_head 200 bash -c "cd $HEAD && python3 benchmarks/gpu_bench.py large --presets qwen35-27b-shape \
    --budgets 32 --repeats 3 --new-tokens 24 --md $OUT/large_head.md --out $OUT/large_head.json"
fi
if [ -n "${LARGE:-}" ]; then
  section large 200 python3 benchmarks/gpu_bench.py large --presets qwen35-27b-shape qwen3-8b-shape --budgets 32 \
    --repeats "${LARGE_REPEATS:-3}" --new-tokens 24 --md "$OUT/large.md" --out "$OUT/large.json"
fi
if [ -n "${TESTS:-}" ]; then
  section tests 240 python3 -m pytest -q -p no:cacheprovider -rs \
    ${TEST_FILES:-tests/engine/models/test_delta_rule.py tests/engine/models/test_linear.py tests/engine/test_gpu.py}
fi
if [ -n "${GRAPHS:-}" ]; then
  section graphs_27b 150 python3 benchmarks/gpu_bench.py graphs --presets qwen35-27b-shape --budgets 32 \
    --new-tokens 8 --repeats 10 --md "$OUT/graphs_27b.md" --out "$OUT/graphs_27b.json"
fi
if [ -n "${LINEAR:-}" ]; then
  section linear ${LINEAR_LIMIT:-300} python3 benchmarks/kernel_bench.py linear --shapes ${SHAPES:-27B 8B} ${NARROW:+--narrow} \
    --md "$OUT/linear.md" --out "$OUT/linear.json"
fi
summary
