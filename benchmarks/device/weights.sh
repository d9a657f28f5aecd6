#!/usr/bin/env bash
# Issue #28's SmolLM2 Q4_1 bars on the lent GPU (benchmarks/DEVICE.md): the packaged GGUF held natively or
# dequantized, the grid of experiments/smollm2-weights-h200.yaml (AR, chain, DDTree 22/48 in both forms; its chat
# set the carried eval prompts), every output checked against AR with the same weights, then its report ("Weights:
# native vs dequantized": each form's AR tok/s and the acceptance of each config in both forms).
# After call 1 and the joins on the same machine (SmolLM2's wheel stashed); carry .device/wheels .device/gguf
# .device/workloads .device/assets. SWEEP_LIMIT (default 470 s): the sweep starts no trial after it less 60 s.
# FORM / VERIFY (below): one form's configs alone, e.g. FORM=native VERIFY=ddtree. NATIVE_PLANS=1 (below): the
# native weights' own plans measured and taken first.
source benchmarks/device/common.sh weights
install_wheels .device/wheels/*.whl
install_assets smollm2 humaneval bfcl
read -r STUDY N_PROMPTS NEW_TOKENS < <(device_experiment experiments/smollm2-weights-h200.yaml experiments/weights-device.yaml)
# FORM=native (or dequantized): that form alone, its pair loaded so (model.weights) and `weights` left out of the
# space; VERIFY="ddtree": those verify choices alone (a rerun of what an earlier call did not reach)
if [ -n "${FORM:-}${VERIFY:-}" ]; then
  python3 - "${FORM:-}" "${VERIFY:-}" <<'PY'
import sys

import yaml

form, verify = sys.argv[1:]
if form not in ("", "native", "dequantized") or not set(verify.split()) <= {"ar", "chain", "ddtree"}:
    sys.exit(f"weights.sh: FORM={form!r} must be native or dequantized, VERIFY={verify!r} among ar chain ddtree")
exp = yaml.safe_load(open("experiments/weights-device.yaml"))
space = yaml.safe_load(open("search_spaces/weights.yaml"))
if form:
    exp["model"]["weights"] = form
    exp["name"] += f"-{form}"
    del space["weights"]
if verify:
    space["verify"]["choices"] = verify.split()
    exp["name"] += "-" + "-".join(verify.split())
yaml.safe_dump(space, open("experiments/weights-device-space.yaml", "w"), sort_keys=False)
exp["search_space"] = "weights-device-space.yaml"
yaml.safe_dump(exp, open("experiments/weights-device.yaml", "w"), sort_keys=False)
PY
  [ $? = 0 ] || { say "weights.sh: FORM / VERIFY not applied (above); nothing run"; exit 2; }
  STUDY=$(python3 -c "import yaml; print(yaml.safe_load(open('experiments/weights-device.yaml'))['name'])")
fi
# NATIVE_PLANS=1: the native weights' own plans measured first (`kernel_bench.py quant-plans`: SmolLM2's Q4_1
# weights on the block kernel, the launches compiled ahead; on an H100/H200 in bf16 those take quant_gluon's decode
# since 2026-12-07, so there the plans are used by nothing: a GPU of another kind's option; PLANS_LIMIT, default 240 s, taken off SWEEP_LIMIT) into the
# stash (a later call on this machine reuses them: remove /root/stash/native_plans.json to measure again; a
# measurement cut short keeps the weights it finished) and the sweep run on them (ENGINE_LINEAR_PLANS): native AR
# on plans of its own, the dequantized form on the dense ones. Until linear.TUNED_NATIVE has them (then without it)
SWEEP_LIMIT=${SWEEP_LIMIT:-470}
if [ -n "${NATIVE_PLANS:-}" ]; then
  if [ ! -s /root/stash/native_plans.json ]; then
    plans_start=$(date +%s)
    section native_plans ${PLANS_LIMIT:-240} python3 benchmarks/kernel_bench.py quant-plans --rows 1 49 \
      --md "$OUT/native_plans.md" --out /root/stash/native_plans.json
    # the call's 600 s: the sweep gets what the plans left of its limit
    SWEEP_LIMIT=$(( SWEEP_LIMIT - ($(date +%s) - plans_start) ))
  fi
  if [ -s /root/stash/native_plans.json ]; then
    cp /root/stash/native_plans.json "$OUT/"
    export ENGINE_LINEAR_PLANS=/root/stash/native_plans.json
  else
    say "NATIVE_PLANS: no plans measured (above); the sweep runs on the engine's plans"
  fi
fi
say "study $STUDY: $N_PROMPTS prompts a set, $NEW_TOKENS new tokens"
section weights_sweep $SWEEP_LIMIT python3 -m autotune sweep experiments/weights-device.yaml \
  --storage "sqlite:///$OUT/weights.db" --tracking-uri none --no-progress --timeout "$(( SWEEP_LIMIT - 60 ))s"
section weights_report 60 python3 -m autotune report "$STUDY" --storage "sqlite:///$OUT/weights.db" \
  --out "$OUT/weights_report"
summary
