#!/usr/bin/env bash
# Issue #28's SmolLM2 Q4_1 bars on the lent GPU (benchmarks/DEVICE.md): the packaged GGUF held natively or
# dequantized, the grid of experiments/smollm2-weights-h200.yaml (AR, chain, DDTree 22/48 in both forms; its chat
# set the carried eval prompts), every output checked against AR with the same weights, then its report ("Weights:
# native vs dequantized": each form's AR tok/s and the acceptance of each config in both forms).
# After call 1 and the joins on the same machine (SmolLM2's wheel stashed); carry .device/wheels .device/gguf
# .device/workloads .device/assets. SWEEP_LIMIT (default 470 s): the sweep starts no trial after it less 60 s.
source benchmarks/device/common.sh weights
install_wheels .device/wheels/*.whl
install_assets smollm2 humaneval bfcl
read -r STUDY N_PROMPTS NEW_TOKENS < <(device_experiment experiments/smollm2-weights-h200.yaml experiments/weights-device.yaml)
say "study $STUDY: $N_PROMPTS prompts a set, $NEW_TOKENS new tokens"
section weights_sweep ${SWEEP_LIMIT:-470} python3 -m autotune sweep experiments/weights-device.yaml \
  --storage "sqlite:///$OUT/weights.db" --tracking-uri none --no-progress --timeout "$(( ${SWEEP_LIMIT:-470} - 60 ))s"
section weights_report 60 python3 -m autotune report "$STUDY" --storage "sqlite:///$OUT/weights.db" \
  --out "$OUT/weights_report"
summary
