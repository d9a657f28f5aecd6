#!/usr/bin/env bash
# Follow-up call 6, carrying .device/wheels .device/workloads .device/assets .device/gguf, right after call 5
# (SmolLM2 installed): the grammar GPU tests, warm workers against a process per trial, and a short
# agent sweep that picks the grammar's placement (experiments/smollm2-agent-h200-short.yaml).
source benchmarks/device/common.sh call6
install_wheels .device/wheels/*.whl
install_assets humaneval bfcl
SWEEP=${SWEEP:-240}
section grammar_tests 45 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_gpu.py -k grammar
section executors 90 python3 benchmarks/executor_bench.py --target smollm2-135m-instruct --draft smollm2-135m-dflash \
  --device cuda --dtype bfloat16 --variants local process --n-prompts 2 --max-new-tokens 64 --trials 6 \
  --process-trials 3 --rounds 1 --out "$OUT/executors.json"
section sweep "$SWEEP" python3 -m autotune sweep experiments/smollm2-agent-h200-short.yaml --timeout "$((SWEEP - 50))s" \
  --storage sqlite:////root/stash/agent-short.db --tracking-uri none
section report 20 python3 -m autotune report smollm2-agent-h200-short --storage sqlite:////root/stash/agent-short.db \
  --out /root/stash/report-short
cp /root/stash/report-short/*.md "$OUT/" 2>/dev/null
summary
