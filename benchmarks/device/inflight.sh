#!/usr/bin/env bash
# Issue #28 on the lent GPU (benchmarks/DEVICE.md), carrying .device/gguf (the tests' gguf package): the Q4_K and Q6_K
# products left in flight (quant_gluon.ASYNC_FROM: each decoded tile through shared memory, its matrix-unit products
# running while the next tile is decoded) beside the engine's, random weights only, in one call (~6-8 minutes;
# SKIP="name ..." leaves sections out).
#   1. async_bench: quant_gluon.py --bench --async-from 8: the 27B's Q4_K and Q6_K launches at 1-64 rows, engine
#      against in flight, their bits compared;
#   2. async_tests: the GPU tests of it (test_quant_gluon_options.py -k flight: one-hot rows read back, every row count
#      the register path's bits, 4 and 8 warps, splits 1 and 4);
#   3. large_q4km and large_q4km_a*: the 27B Q4_K_M step (BUDGETS, 32 by default) as the engine runs it, then with
#      products in flight from each of ASYNC_FROMS rows a program (default "32 8": a verify's launches only, then every
#      launch, an AR step's too; gpu_bench's --gluon-async-from); HEAD=folder (carried in .device/: `git archive REV
#      engine benchmarks | tar -x -C .device/head`): that tree's step first, on the same machine.
source benchmarks/device/common.sh inflight
ASYNC_FROMS=${ASYNC_FROMS-32 8}
for a in $ASYNC_FROMS; do
  case $a in 8|16|32|64) ;; *) say "ASYNC_FROMS: $a: rows a program are 8, 16, 32 or 64"; exit 2 ;; esac
done
if ls .device/gguf/*.whl >/dev/null 2>&1; then install_wheels .device/gguf/*.whl; fi
section async_bench ${BENCH_LIMIT:-150} python3 benchmarks/quant_gluon.py --bench --async-from 8 --md "$OUT/async.md"
section async_tests ${TESTS_LIMIT:-150} python3 -m pytest -o addopts="" -q -p no:cacheprovider -rs -x \
  tests/engine/models/test_quant_gluon_options.py -k flight
section gluon_tests ${GLUON_TESTS_LIMIT:-120} python3 -m pytest -o addopts="" -q -p no:cacheprovider -rs -x \
  tests/engine/models/test_quant_gluon.py
if [ -n "${HEAD:-}" ]; then
  section large_q4km_head ${LARGE_LIMIT:-100} bash -c "cd $HEAD && python3 benchmarks/gpu_bench.py large --weights q4_k_m \
    --q4k-decode engine --presets qwen35-27b-shape --context 4096 --budgets ${BUDGETS:-32} --md $OUT/large_q4km_head.md"
fi
for a in "" $ASYNC_FROMS; do
  name=large_q4km${a:+_a$a}
  section "$name" ${LARGE_LIMIT:-100} python3 benchmarks/gpu_bench.py large --weights q4_k_m --q4k-decode engine \
    ${a:+--gluon-async-from $a} --presets qwen35-27b-shape --context 4096 --budgets ${BUDGETS:-32} \
    --md "$OUT/$name.md" --out "$OUT/$name.json"
done
summary
