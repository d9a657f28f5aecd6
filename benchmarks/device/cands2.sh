#!/usr/bin/env bash
# Candidates session, call 2 of 3, carrying .device/smol2 .device/gguf .device/workloads .device/assets
# .device/head, right after call 1 (the stashed half): installs SmolLM2, then the cost of candidates
# against an earlier tree (.device/head: `git archive REV engine benchmarks`, checkpoints removed) and
# this one, in one call on one machine: the pair's AR and DDTree-48 on HumanEval (24 prompts, 128
# tokens, 3 repeats), each exact against its AR:
#   pair_head, pair_new     the earlier tree, this one
#   pair_attn_C             this tree with the decode steps' attention on each STEP_ATTN candidate
#                           (`gpu_bench.py --step-attention`, e.g. STEP_ATTN="32x4 32x4x64")
source benchmarks/device/common.sh cands2
join_smollm2
install_assets smollm2 humaneval bfcl
W=.device/workloads
DRAFT=$PWD/engine/checkpoints/smollm2-135m-dflash
pair_cost() {  # $1: name, $2: tree, $3...: gpu_bench options
  local name=$1 tree=$2
  shift 2
  section "pair_$name" ${PAIR_LIMIT:-100} bash -c "cd $tree && python3 benchmarks/gpu_bench.py pair --draft $DRAFT \
    --sets $PWD/$W/eval_humaneval.jsonl --n-prompts 24 --max-new-tokens 128 --repeats 3 --paths runtime --budget 48 \
    --no-fp32-check --md $OUT/pair_$name.md --out $OUT/pair_$name.json $*"
}
pair_cost head .device/head
pair_cost new .
for cand in ${STEP_ATTN:-}; do pair_cost "attn_$cand" . --step-attention "$cand"; done
summary
