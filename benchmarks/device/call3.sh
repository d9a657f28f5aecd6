#!/usr/bin/env bash
# Device call 3 of 3, carrying .device/wheels .device/ref .device/workloads .device/assets .device/gguf, made
# right after call 2 (SmolLM2 is installed in this machine's asset cache; the new draft, if call 2
# trained one, is in /root/stash/draft and replaces the shipped one in this copy of the tree).
# The pair on every path, transformers and the DFlash reference on the same weights, executors,
# grammar placements and an agent sweep.
source benchmarks/device/common.sh call3
install_wheels .device/wheels/*.whl
install_assets humaneval bfcl
if [ -f /root/stash/draft/model.safetensors ]; then
  cp /root/stash/draft/config.json /root/stash/draft/model.safetensors engine/checkpoints/smollm2-135m-dflash/
  say "using the draft trained in call 2"
fi
python3 -m engine assets list 2>&1 | tee -a "$LOG"
W=.device/workloads
section grammar_tests 45 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_gpu.py -k grammar
section pair 130 python3 benchmarks/gpu_bench.py pair --sets humaneval $W/eval_chat.jsonl agent --n-prompts 4 \
  --max-new-tokens 96 --repeats 2 --md "$OUT/pair.md"
# GENERIC=1: the generic decode path beside the runtime path (its steps are 10-16x dearer: a short set).
if [ -n "${GENERIC:-}" ]; then
  section generic 150 python3 benchmarks/gpu_bench.py pair --sets humaneval --n-prompts 2 --max-new-tokens 64 \
    --repeats 1 --paths generic runtime --no-fp32-check --md "$OUT/generic.md"
fi
section hf 45 python3 benchmarks/gpu_bench.py hf --sets humaneval --n-prompts 2 --max-new-tokens 64 --repeats 1 \
  --md "$OUT/hf.md"
section reference 50 python3 benchmarks/gpu_bench.py reference --reference-src .device/ref --sets humaneval \
  --n-prompts 2 --max-new-tokens 64 --repeats 1 --md "$OUT/reference.md"
section executors 60 python3 benchmarks/executor_bench.py --target smollm2-135m-instruct --draft smollm2-135m-dflash \
  --device cuda --dtype bfloat16 --variants local process --n-prompts 2 --max-new-tokens 64 --trials 6 \
  --process-trials 3 --rounds 1 --out "$OUT/executors.json"
section grammar 60 python3 benchmarks/grammar_bench.py --device cuda --dtype float32 --n-prompts 2 \
  --max-new-tokens 64 --repeats 2 \
  --configs ar-constrained,ddtree-walk,ddtree-commit,ar-constrained-generic,ddtree-commit-generic
# The short study: the full one (smollm2-agent-h200.yaml) needs over 80 s per `walk` trial.
section sweep 100 python3 -m autotune sweep experiments/smollm2-agent-h200-short.yaml --n-trials 8 --timeout 60s \
  --storage sqlite:////root/stash/agent.db --tracking-uri none --no-progress
section report 20 python3 -m autotune report smollm2-agent-h200-short --storage sqlite:////root/stash/agent.db \
  --out /root/stash/report
cp /root/stash/report/*.md "$OUT/" 2>/dev/null
summary
