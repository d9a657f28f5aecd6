#!/usr/bin/env bash
# Candidates session, call 3 of 3, carrying .device/head .device/workloads .device/gguf, right after
# call 2 (exact2.sh: SmolLM2 installed) on the same machine: the cost of candidates against an
# earlier tree (.device/head, as exact3.sh) and this one, in one call on one machine:
#   pair_head, pair_new     the pair's AR and DDTree-48 on HumanEval (24 prompts), exact against AR
#   pair_attn_NxW           this tree with the decode steps' attention on each STEP_ATTN candidate
#                           (`gpu_bench.py --step-attention`, e.g. STEP_ATTN="32x4 16x4")
#   large_new, large_plans  the 8B/27B shapes' AR against the roofline and verify@32; the second with
#                           call 1's measured plans (/root/stash/plans_large.json, ENGINE_LINEAR_PLANS)
#   exact_27b               exactness on the 27B hybrid shape, both rollbacks (EXACT27=0 skips)
source benchmarks/device/common.sh cands3
install_wheels .device/gguf/*.whl
W=.device/workloads
DRAFT=$PWD/engine/checkpoints/smollm2-135m-dflash
pair_cost() {  # $1: name, $2: tree, $3...: gpu_bench options
  local name=$1 tree=$2
  shift 2
  section "pair_$name" 120 bash -c "cd $tree && python3 benchmarks/gpu_bench.py pair --draft $DRAFT \
    --sets $PWD/$W/eval_humaneval.jsonl --n-prompts 24 --max-new-tokens 128 --repeats 3 --paths runtime --budget 48 \
    --no-fp32-check --md $OUT/pair_$name.md --out $OUT/pair_$name.json $*"
}
pair_cost head .device/head
pair_cost new .
for cand in ${STEP_ATTN:-}; do pair_cost "attn_$cand" . --step-attention "$cand"; done
section large_new 120 python3 benchmarks/gpu_bench.py large --budgets 32 --repeats 3 --new-tokens 24 \
  --md "$OUT/large_new.md" --out "$OUT/large_new.json"
if [ -f /root/stash/plans_large.json ]; then
  section large_plans 120 env ENGINE_LINEAR_PLANS=/root/stash/plans_large.json python3 benchmarks/gpu_bench.py \
    large --budgets 32 --repeats 3 --new-tokens 24 --md "$OUT/large_plans.md" --out "$OUT/large_plans.json"
fi
if [ "${EXACT27:-1}" != 0 ]; then
  section exact_27b ${EXACT_LIMIT:-200} python3 benchmarks/exact_bench.py --target qwen35-27b-shape \
    --draft qwen35-27b-shape-dflash --random-prompts 8 --prompt-len 64 --max-new-tokens 128 --budgets 8 22 64 \
    --top-ks 1 8 --rollbacks fast replay --md "$OUT/exact_27b.md" --out "$OUT/exact_27b.json"
fi
summary
