#!/usr/bin/env bash
# Issue #27 on the lent H200: the adaptive step policy's bars, one call (600 s) per PART, every output
# checked against AR's (benchmarks/DEVICE.md).
#
# PART=pair (default; right after call 1, the stashed half; carry .device/smol2 .device/gguf
#   .device/workloads .device/assets): installs SmolLM2, the policy's GPU tests, then `gpu_bench.py pair`
#   with the shipped draft on HumanEval, chat and agent traffic: AR, chain, DDTree-48 and the adaptive
#   policy up to 48, fixed budgets 22 and 32 and the policy up to 32 beside (--also); then the random draft (a weak one) on
#   HumanEval. (2026-12-04, seventh session: 3 sets x 4 configs took ~100 s; 6 configs ~150 s.)
# PART=mix (the same carry, after PART=pair on the same machine, which keeps SmolLM2): the same
#   configs on one set interleaving the three sets' prompts (`--mix`, 3 x N_PROMPTS prompts).
# PART=early (the same carry as pair, after call 1 and the joins): an early, under-trained draft (EARLY_STEPS,
#   default 300, of a new 3-layer draft on benchmarks/data's self-distilled answers, ~2 minutes), then the pair's
#   configs with it on HumanEval: the second weak draft (the random one is PART=pair's).
# PART=oracle (no carry, no asset): the policy's GPU tests of the taught oracle, then `gpu_bench.py
#   oracle` on qwen35-27b-shape (random weights, its random 5-layer DFlash draft under the taught
#   oracle): oracle:0.1,0.5,0.9 (a mix: prompt i takes P number i mod 3) first, then P = 0.1, 0.5, 0.9
#   alone; AR, chain, DDTree 8/16/32/64 and the adaptive policy up to 64. Not measured before; estimated
#   from RESULTS.md (2026-12-03: AR 15.2-15.5 ms a step on the graphs, DDTree 1.02-1.41x that at budgets
#   8-64, propose ~2.7 ms): 6 prompts x 64 tokens, 3 passes per config, ~300 s in all (P = 0.9, AL near
#   1, the longest: ~100 s); each row is in the log as it is timed, should the limit come first.
PART=${PART:-pair}
source benchmarks/device/common.sh "policy_$PART"
W=.device/workloads
N=${N_PROMPTS:-12}
NEW=${NEW:-128}
# fixed budgets beside --budget's (top_k 8 as the pair's own DDTree), and the adaptive policy up to 32
# (2026-12-05: fixed 32 was agent traffic's best config, a budget the policy up to 48 never takes)
# (2026-12-05, seventh session: the first proposal read before its budget is chosen, policy_preview; its one
# host synchronisation a generation timed against the blind start in the same run: b48-blind)
ALSO=(--also b22:verify=ddtree,budget=22,top_k=8 --also b32:verify=ddtree,budget=32,top_k=8
      --also b32-adaptive:verify=ddtree,budget=32,top_k=8,policy=adaptive
      --also b48-blind:verify=ddtree,budget=48,top_k=8,policy=adaptive,policy_preview=false)
PAIR=(python3 benchmarks/gpu_bench.py pair --n-prompts $N --max-new-tokens $NEW --repeats 2 --paths runtime
      --budget ${BUDGET:-48} --top-k 8 --adaptive "${ALSO[@]}" --no-fp32-check)
case $PART in
  pair)
    join_smollm2
    install_assets smollm2 humaneval bfcl
    section policy_tests ${TESTS_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_gpu.py \
      tests/engine/decoding/test_runtime.py tests/engine/decoding/test_runtime_policy.py \
      tests/engine/decoding/test_policy.py tests/engine/decoding/test_tree_kernel.py tests/engine/models/test_common.py
    section pair_adaptive ${PAIR_LIMIT:-200} "${PAIR[@]}" --sets humaneval $W/eval_chat.jsonl agent \
      --md "$OUT/pair_adaptive.md" --out "$OUT/pair_adaptive.json"
    section weak_adaptive ${WEAK_LIMIT:-90} "${PAIR[@]}" --draft random --sets humaneval \
      --md "$OUT/weak_adaptive.md" --out "$OUT/weak_adaptive.json"
    ;;
  mix)
    join_smollm2
    install_assets smollm2 humaneval bfcl
    section pair_mix ${MIX_LIMIT:-300} "${PAIR[@]}" --sets --mix humaneval $W/eval_chat.jsonl agent \
      --md "$OUT/pair_mix.md" --out "$OUT/pair_mix.json"
    ;;
  oracle)
    section oracle_tests ${TESTS_LIMIT:-90} python3 -m pytest -q -p no:cacheprovider -rs \
      tests/engine/decoding/test_oracle_drafters.py -k captured_graphs
    section oracle_27b ${ORACLE_LIMIT:-470} python3 benchmarks/gpu_bench.py oracle --presets qwen35-27b-shape \
      --n-prompts ${ORACLE_PROMPTS:-6} --context 512 --new-tokens ${ORACLE_NEW:-64} --repeats 2 --budgets 8 16 32 64 \
      --top-k 8 --oracles ${ORACLES:-oracle:0.1,0.5,0.9 oracle:0.1 oracle:0.5 oracle:0.9} \
      --md "$OUT/oracle_27b.md" --out "$OUT/oracle_27b.json"
    ;;
  early)
    # the other weak draft, an early under-trained one: EARLY_STEPS steps of a new 3-layer draft on the
    # committed self-distilled data (its features recomputed each batch: nothing computed up front), then the
    # same configs as the random draft's on HumanEval, every output checked against AR's
    join_smollm2
    install_assets smollm2 humaneval
    rm -rf /root/stash/early
    section early_train ${EARLY_LIMIT:-200} python3 -m engine train-draft --target smollm2-135m-instruct \
      --data benchmarks/data/smollm2-selfdistill.jsonl.xz --out /root/stash/early --layers 3 --intermediate-size 640 \
      --block-size 16 --steps ${EARLY_STEPS:-300} --wall-budget ${EARLY_WALL:-150} --feature-store recompute \
      --val-fraction 0.01 --no-progress --device cuda
    section early_adaptive ${WEAK_LIMIT:-90} "${PAIR[@]}" --draft /root/stash/early --sets humaneval \
      --md "$OUT/early_adaptive.md" --out "$OUT/early_adaptive.json"
    cp /root/stash/early/training.json "$OUT/early_training.json" 2>/dev/null
    ;;
  *)
    say "PART=$PART: expected pair, mix, oracle or early"; exit 2 ;;
esac
summary
