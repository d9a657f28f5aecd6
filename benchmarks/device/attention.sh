#!/usr/bin/env bash
# Issue #28 on the lent GPU (benchmarks/DEVICE.md), carrying nothing: the decode steps' attention and the memory plan's
# whole-prompt prefill, random weights only, in one call (~5-8 minutes; SKIP="name ..." leaves sections out).
#   1. memory_short: tests/engine/test_memory_gpu.py's 384-token SmolLM2-shape case (one forward, SDPA's math path):
#      AR, DDTree and the generic chain, each measured peak against its plan (the bar: within 10%; the plan prices
#      SDPA's float32 scores and the prefill stream's cuBLAS workspace since 2026-12-07);
#   2. attention_tests: tests/engine/models/test_attention.py on the GPU, slow ones too: a verify whose programs
#      fold the runs of committed spans (FOLD_FROM_SMS 0) and one whose merge folds them (inf) against AR steps,
#      bit for bit, at head_dims 32 and 64 and the 8B's and the 27B's heads;
#   3. attention_bench: kernel_bench.py attention: the engine's launch beside unfolded, always folded, 32- and 64-row
#      programs at 1k, 4k and 32k keys (folded against unfolded checked for equal bits);
#   4. large_q4km and large_q4km_attn_*: the 27B Q4_K_M step (BUDGETS, 32 by default) as the engine runs it, then
#      with each of ATTENTIONS (default "32x4f1 32x4f8": runs of 1 span, which no verify folds, and of 8;
#      --step-attention's grammar; "" none), as quant.sh's ATTENTIONS.
source benchmarks/device/common.sh attention
ATTENTIONS=${ATTENTIONS-32x4f1 32x4f8}
check_attentions $ATTENTIONS  # every launch checked before any section runs
section memory_short 120 python3 -m pytest -o addopts="" -q -s -p no:cacheprovider -rs tests/engine/test_memory_gpu.py \
  -k smollm2-135m-shape-short
section attention_tests 150 python3 -m pytest -o addopts="" -q -p no:cacheprovider -rs -m "slow or not slow" \
  tests/engine/models/test_attention.py
section attention_bench 180 python3 benchmarks/kernel_bench.py attention --md "$OUT/kernel_attention.md"
for a in "" $ATTENTIONS; do
  name=large_q4km${a:+_attn_$a}
  section "$name" ${LARGE_LIMIT:-100} python3 benchmarks/gpu_bench.py large --weights q4_k_m --q4k-decode engine \
    ${a:+--step-attention $a} --presets qwen35-27b-shape --context 4096 --budgets ${BUDGETS:-32} \
    --md "$OUT/$name.md" --out "$OUT/$name.json"
done
summary
