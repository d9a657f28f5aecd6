#!/usr/bin/env bash
# Issue #21's cost against an earlier tree, like with like (benchmarks/tree_compare.py), on a machine
# where SmolLM2 is installed (after call 2, exact2.sh or policy.sh), carrying .device/head (`git
# archive REV engine | tar -x -C .device/head`, its checkpoints' weights removed) .device/workloads
# .device/gguf: the eval prompts (SETS, default humaneval; N_PROMPTS a set, 24) as ids, AR and DDTree-48 timed with the
# earlier tree's engine, then this tree's (DRIFT=1: then the earlier one's again), each NEW tokens
# (128) a prompt, 3 passes; the comparison over every prompt and over those both decode to AR's text.
source benchmarks/device/common.sh compare
install_wheels .device/gguf/*.whl
W=.device/workloads
DRAFT=$PWD/engine/checkpoints/smollm2-135m-dflash
IDS=/root/stash/compare_ids.json
section prompts 60 env PYTHONPATH="$PWD:$PYTHONPATH" python3 benchmarks/tree_compare.py prompts \
  --sets $(for s in ${SETS:-humaneval}; do echo $W/eval_$s.jsonl; done) \
  --n-prompts ${N_PROMPTS:-24} --target smollm2-135m-instruct --out $IDS
run() {  # $1: name, $2: the engine's tree
  section "run_$1" ${RUN_LIMIT:-150} env PYTHONPATH="$2:$PYTHONPATH" python3 benchmarks/tree_compare.py run \
    --prompts $IDS --draft $DRAFT --budget ${BUDGET:-48} --max-new-tokens ${NEW:-128} --repeats 3 --out "$OUT/$1.json"
}
run old $PWD/.device/head
run new $PWD
[ -n "${DRIFT:-}" ] && run old2 $PWD/.device/head
section compare 30 python3 benchmarks/tree_compare.py compare "$OUT/old.json" "$OUT/new.json" --md "$OUT/compare.md"
[ -n "${DRIFT:-}" ] && section compare_drift 30 python3 benchmarks/tree_compare.py compare "$OUT/old.json" \
  "$OUT/old2.json" --md "$OUT/compare_drift.md"
summary
