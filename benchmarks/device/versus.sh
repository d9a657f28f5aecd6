#!/usr/bin/env bash
# Two trees on the lent GPU (benchmarks/DEVICE.md), carrying the earlier one as HEAD (a folder in .device/: `git archive
# REV engine benchmarks | tar -x -C .device/head`, its checkpoints removed), random weights only: `gpu_bench.py large`
# of HEAD's tree and of this one alternated PAIRS times (2 by default; head first in each pair), one process a run and
# its JSON kept, then `benchmarks/versus.py`: AR and verify ms per tree, min / median / max over the runs, and this
# tree's medians over HEAD's. PRESET (qwen35-27b-shape), WEIGHTS (q4_k_m), CONTEXT (4096), BUDGETS (32) as gpu_bench's;
# LARGE_LIMIT (150 s) a run. The 27B Q4_K_M runs took 74-101 s each on an H100 (2026-12-07): 2 pairs fit one call.
source benchmarks/device/common.sh versus
if [ -z "${HEAD:-}" ] || [ ! -f "${HEAD}/benchmarks/gpu_bench.py" ]; then
  say "HEAD: '${HEAD:-}' must name an earlier tree carried in .device/ (its benchmarks/gpu_bench.py there): git archive REV engine benchmarks | tar -x -C .device/head"
  exit 2
fi
PAIRS=${PAIRS:-2}
if ! [[ $PAIRS =~ ^[1-9][0-9]*$ ]]; then say "PAIRS: $PAIRS: the pairs of runs, a whole number from 1"; exit 2; fi
run_flags="--presets ${PRESET:-qwen35-27b-shape} --weights ${WEIGHTS:-q4_k_m} --context ${CONTEXT:-4096} --budgets ${BUDGETS:-32}"
here=$PWD
for k in $(seq 1 "$PAIRS"); do
  for side in head this; do
    dir=$([ $side = head ] && echo "$HEAD" || echo "$here")
    section ${side}_$k ${LARGE_LIMIT:-150} bash -c "cd $dir && python3 benchmarks/gpu_bench.py large $run_flags \
      --out $OUT/versus_${side}_$k.json"
  done
done
section table 30 python3 benchmarks/versus.py --head "$OUT"/versus_head_*.json --this "$OUT"/versus_this_*.json \
  --md "$OUT/versus.md"
summary
