#!/usr/bin/env bash
# Issue #27 on the lent H200, right after call 1 (the stashed half), carrying .device/smol2 .device/gguf
# .device/workloads .device/assets: installs SmolLM2, then the adaptive step policy's GPU tests and the
# pair with and without it (`gpu_bench.py pair --adaptive`): the shipped draft on HumanEval, chat and
# agent traffic, and the random draft (a weak draft) on HumanEval; every output checked against AR.
source benchmarks/device/common.sh policy
join_smollm2
install_assets smollm2 humaneval bfcl
W=.device/workloads
N=${N_PROMPTS:-12}
section policy_tests 150 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_gpu.py \
  tests/engine/decoding/test_runtime.py tests/engine/decoding/test_runtime_policy.py tests/engine/decoding/test_policy.py
section pair_adaptive ${PAIR_LIMIT:-200} python3 benchmarks/gpu_bench.py pair --sets humaneval $W/eval_chat.jsonl agent \
  --n-prompts $N --max-new-tokens ${NEW:-128} --repeats 2 --paths runtime --budget ${BUDGET:-48} --top-k 8 --adaptive \
  --no-fp32-check --md "$OUT/pair_adaptive.md" --out "$OUT/pair_adaptive.json"
section weak_adaptive ${WEAK_LIMIT:-120} python3 benchmarks/gpu_bench.py pair --draft random --sets humaneval \
  --n-prompts $N --max-new-tokens ${NEW:-128} --repeats 2 --paths runtime --budget ${BUDGET:-48} --top-k 8 --adaptive \
  --no-fp32-check --md "$OUT/weak_adaptive.md" --out "$OUT/weak_adaptive.json"
summary
