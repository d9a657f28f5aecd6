#!/usr/bin/env bash
# Exactness session, call 2 of 3, carrying .device/smol2 .device/gguf .device/workloads .device/assets,
# right after call 1: SmolLM2 installed as in call2.sh, then every output of chain and DDTree at
# budgets 8/22/48/64 x top_k 1..8 against AR in bf16: 24 eval prompts of HumanEval, chat and agent
# traffic, 256 new tokens, and three configs also run to each prompt's stop token. STEP_ATTN: a
# candidate launch of the decode steps' attention (`--step-attention`) instead of the engine's.
source benchmarks/device/common.sh exact2
join_smollm2
install_assets smollm2 humaneval bfcl
W=.device/workloads
section exact_pair ${EXACT_LIMIT:-480} python3 benchmarks/exact_bench.py --sets $W/eval_humaneval.jsonl \
  $W/eval_chat.jsonl $W/eval_agent.jsonl --n-prompts 24 --max-new-tokens 256 --budgets ${BUDGETS:-8 22 48 64} \
  --top-ks ${TOPKS:-1 2 3 4 5 6 7 8} ${STEP_ATTN:+--step-attention $STEP_ATTN} --md "$OUT/exact_pair.md" \
  --out "$OUT/exact_pair.json"
summary
