#!/usr/bin/env bash
# Issue #28's SmolLM2 Q4_1 bars on the lent GPU (benchmarks/DEVICE.md): the packaged GGUF held natively or
# dequantized, the grid of experiments/smollm2-weights-h200.yaml (AR, chain, DDTree 22/48 in both forms; its chat
# set the carried eval prompts), every output checked against AR with the same weights, then its report ("Weights:
# native vs dequantized": each form's AR tok/s and the acceptance of each config in both forms).
# After call 1 and the joins on the same machine (SmolLM2's wheel stashed); carry .device/wheels .device/gguf
# .device/workloads .device/assets. SWEEP_LIMIT (default 470 s): the sweep starts no trial after it less 60 s.
# FORM / VERIFY (below): one form's configs alone, e.g. FORM=native VERIFY=ddtree (VERIFY=ar: both forms' AR alone,
# the dimensions only DDTree takes left out; it stopped on the budget's condition before 2026-12-07's fourteenth
# session). Its NATIVE_PLANS=1, which measured `kernel_bench.py quant-plans` first, went on 2026-12-07: on the lent
# H100/H200 SmolLM2's Q4_1 takes quant_gluon's decode, which no plan reaches; on another GPU run quant-plans and set
# ENGINE_LINEAR_PLANS (docs/exactness.md).
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
    for name, dim in list(space.items()):  # a dimension only a verify left out takes goes (VERIFY=ar: no budget)
        needs = dim.get("when", {}).get("verify") if isinstance(dim, dict) else None
        needs = [needs] if isinstance(needs, str) else list(needs or [])
        if needs and not set(needs) & set(verify.split()):
            del space[name]
yaml.safe_dump(space, open("experiments/weights-device-space.yaml", "w"), sort_keys=False)
exp["search_space"] = "weights-device-space.yaml"
yaml.safe_dump(exp, open("experiments/weights-device.yaml", "w"), sort_keys=False)
PY
  [ $? = 0 ] || { say "weights.sh: FORM / VERIFY not applied (above); nothing run"; exit 2; }
  STUDY=$(python3 -c "import yaml; print(yaml.safe_load(open('experiments/weights-device.yaml'))['name'])")
fi
SWEEP_LIMIT=${SWEEP_LIMIT:-470}
say "study $STUDY: $N_PROMPTS prompts a set, $NEW_TOKENS new tokens"
section weights_sweep $SWEEP_LIMIT python3 -m autotune sweep experiments/weights-device.yaml \
  --storage "sqlite:///$OUT/weights.db" --tracking-uri none --no-progress --timeout "$(( SWEEP_LIMIT - 60 ))s"
section weights_report 60 python3 -m autotune report "$STUDY" --storage "sqlite:///$OUT/weights.db" \
  --out "$OUT/weights_report"
summary
