#!/usr/bin/env bash
# A tuning call that needs no model asset (benchmarks/DEVICE.md): where a decode step's time goes and
# what the kernels' launch choices cost, on one machine. HEAD=folder (carried): an earlier tree's
# graphs beside (`git archive REV engine benchmarks | tar -x -C .device/head`, checkpoints removed).
#   graphs_new/graphs_head  the SmolLM2 pair's captured step graphs (random target, the shipped draft)
#                           from this tree and the earlier one: kernels by name (BUDGETS, 48 by default)
#   plans                   `kernel_bench.py plans`: a measured LinearPlan per weight (SHAPES, SmolLM2's
#                           by default) at ROWS (1 16 49: an AR step, a chain, a budget-48 verify)
#   plans_large             the same for LARGE_SHAPES at 1 and 33 rows (an AR step, a budget-32 verify)
#   attention               `kernel_bench.py attention`: step vs mask kernel by span and key block
#   graphs_27b              the 27B shape's AR step and budget-32 verify graphs (GRAPHS27=1)
source benchmarks/device/common.sh tune
DRAFT=$PWD/engine/checkpoints/smollm2-135m-dflash
graphs() {  # $1: name, $2: tree
  section "graphs_$1" 110 bash -c "cd $2 && python3 benchmarks/gpu_bench.py graphs --target smollm2-135m-shape \
    --draft $DRAFT --budgets ${BUDGETS:-48} --context 256 --new-tokens 32 --repeats 10 --out $OUT/graphs_$1.json"
}
graphs new .
section plans ${PLANS_LIMIT:-220} python3 benchmarks/kernel_bench.py plans --shapes ${SHAPES:-SmolLM2} \
  --rows ${ROWS:-1 16 49} --md "$OUT/plans.md" --out "$OUT/plans.json"
if [ -n "${LARGE_SHAPES:-}" ]; then
  section plans_large ${PLANS_LIMIT:-220} python3 benchmarks/kernel_bench.py plans --shapes $LARGE_SHAPES --rows 1 33 \
    --md "$OUT/plans_large.md" --out "$OUT/plans_large.json"
fi
section attention 100 python3 benchmarks/kernel_bench.py attention --md "$OUT/attention.md" --out "$OUT/attention.json"
[ -n "${HEAD:-}" ] && graphs head "$HEAD"
if [ -n "${GRAPHS27:-}" ]; then
  section graphs_27b 120 python3 benchmarks/gpu_bench.py graphs --presets qwen35-27b-shape --budgets 32 \
    --new-tokens 8 --repeats 10 --out "$OUT/graphs_27b.json"
fi
summary
