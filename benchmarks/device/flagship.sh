#!/usr/bin/env bash
# Flagship session, call 3 (benchmarks/DEVICE.md), carrying .device/wheels .device/workloads .device/gguf,
# on the machine where call 2 (exact2.sh or cands2.sh) installed SmolLM2: the flagship study in bf16
# with strict exactness (EXPERIMENT, default experiments/smollm2-h200-short.yaml; its chat set read
# from the carried eval prompts), its report and winner, and `gpu_bench.py pair` on the same prompts
# and tokens, each run to its stop token as the study's are (AR, chain, DDTree at budgets 22 and 48),
# to compare the confirmed winner with. SWEEP: the study's --timeout (default 5m); SWEEP_LIMIT the
# section's seconds (default 420). RESUME=file: a study database an earlier call brought back
# (carried in .device/), resumed; PAIRS=0 skips the gpu_bench.py comparison (measured already).
source benchmarks/device/common.sh flagship
install_wheels .device/wheels/*.whl
W=$PWD/.device/workloads
EXPERIMENT=${EXPERIMENT:-experiments/smollm2-h200-short.yaml}
# the experiment as committed, its chat set read from the carried eval prompts
read -r STUDY N_PROMPTS NEW_TOKENS < <(device_experiment "$EXPERIMENT" experiments/flagship-device.yaml)
say "experiment $EXPERIMENT: study $STUDY, $N_PROMPTS prompts a set, $NEW_TOKENS new tokens"
for budget in $([ "${PAIRS:-1}" = 0 ] || echo 22 48); do
  section "pair_b$budget" ${PAIR_LIMIT:-90} python3 benchmarks/gpu_bench.py pair --sets humaneval $W/eval_chat.jsonl agent \
    --n-prompts "$N_PROMPTS" --max-new-tokens "$NEW_TOKENS" --repeats 3 --paths runtime --budget $budget \
    --no-fp32-check --stop-at-eos --md "$OUT/pair_b$budget.md"
done
DB=sqlite:////root/stash/flagship.db
if [ -n "${RESUME:-}" ]; then cp "$RESUME" /root/stash/flagship.db && chmod u+w /root/stash/flagship.db && say "resuming the study in $RESUME"; fi
section sweep ${SWEEP_LIMIT:-420} python3 -m autotune sweep experiments/flagship-device.yaml --timeout ${SWEEP:-5m} \
  --storage $DB --tracking-uri none --no-progress
section best 30 python3 -m autotune best "$STUDY" --storage $DB
section report 30 python3 -m autotune report "$STUDY" --storage $DB --out /root/stash/flagship_report
cp /root/stash/flagship_report/*.md "$OUT/" 2>/dev/null
cp /root/stash/flagship.db "$OUT/flagship.db" 2>/dev/null
summary
