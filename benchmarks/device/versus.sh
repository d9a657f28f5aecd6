#!/usr/bin/env bash
# Two trees on the lent GPU (benchmarks/DEVICE.md), carrying the earlier one as HEAD (a folder in .device/: `git archive
# REV engine benchmarks | tar -x -C .device/head`, its checkpoints removed), random weights only: `gpu_bench.py large`
# of HEAD's tree and of this one alternated PAIRS times (2 by default; the order swapped every other pair, head first
# in the first: H T T H ...), one process a run and its JSON kept, then `benchmarks/versus.py` over the runs that wrote
# one: AR and verify ms per tree, min / median / max over the runs, and this tree's medians over HEAD's. PRESET
# (qwen35-27b-shape), WEIGHTS (q4_k_m), CONTEXT (4096), BUDGETS (32) as gpu_bench's, 3 AR runs and 32 tokens a run
# pinned; LARGE_LIMIT (130 s) a run. The 27B Q4_K_M runs took 74-101 s each on an H100 (2026-12-07): 2 pairs fit one
# call of 600 s.
source benchmarks/device/common.sh versus
if [ -z "${HEAD:-}" ] || [ ! -f "${HEAD}/benchmarks/gpu_bench.py" ]; then
  say "HEAD: '${HEAD:-}' must name an earlier tree carried in .device/ (its benchmarks/gpu_bench.py there): git archive REV engine benchmarks | tar -x -C .device/head"
  exit 2
fi
PAIRS=${PAIRS:-2}
if ! [[ $PAIRS =~ ^[1-9][0-9]*$ ]]; then say "PAIRS: $PAIRS: the pairs of runs, a whole number from 1"; exit 2; fi
read -r -a run_flags <<< "--presets ${PRESET:-qwen35-27b-shape} --weights ${WEIGHTS:-q4_k_m} --context ${CONTEXT:-4096} --budgets ${BUDGETS:-32} --repeats 3 --new-tokens 32"
out=$(cd "$OUT" && pwd)
head_tree=$(cd "$HEAD" && pwd)
runs_head=() runs_this=()
for k in $(seq 1 "$PAIRS"); do
  order="head this"
  if [ $((k % 2)) = 0 ]; then order="this head"; fi  # drift spread over both trees
  for side in $order; do
    dir=$([ $side = head ] && echo "$head_tree" || echo "$PWD")
    json="$out/versus_${side}_$k.json"
    rm -f "$json"  # (a reused $OUT: only this call's runs are pooled)
    section ${side}_$k ${LARGE_LIMIT:-130} bash -c 'cd "$1" && shift && exec python3 benchmarks/gpu_bench.py large "$@"' _ \
      "$dir" "${run_flags[@]}" --out "$json"
    if [ -f "$json" ]; then
      if [ $side = head ]; then runs_head+=("$json"); else runs_this+=("$json"); fi
    else
      say "$side $k: no JSON (rc=$LAST_RC): not pooled"
    fi
  done
done
if [ ${#runs_head[@]} = 0 ] || [ ${#runs_this[@]} = 0 ]; then
  say "table: no run of $([ ${#runs_head[@]} = 0 ] && echo head || echo this) wrote its JSON: nothing to compare"
else
  if [ ${#runs_head[@]} != ${#runs_this[@]} ]; then
    say "table: head has ${#runs_head[@]} runs, this ${#runs_this[@]}: compared as they are"
  fi
  section table 30 python3 benchmarks/versus.py --head "${runs_head[@]}" --this "${runs_this[@]}" --md "$out/versus.md"
fi
summary
