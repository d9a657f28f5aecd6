#!/usr/bin/env bash
# Issue #28's SmolLM2 native AR, launch by launch (benchmarks/DEVICE.md): its Q4_1 weights on the operand-register
# decode beside quant_kernel and the dense kernel, each split of K at 1 and 49 rows (`quant_gluon.py --bench --q4-1`),
# the 30 layers' projections in one graph (`layer_probe.py`), the Q4_1 GPU tests, then the pair's captured step graphs
# replayed alone (`gpu_bench.py graphs`: AR, DDTree's propose and verify at BUDGETS, default "22 48") in each of FORMS
# (below), on one machine. After call 1 and the joins on the same machine (SmolLM2's wheel stashed); carry
# .device/gguf .device/assets. SKIP="q4_1_bench layer_probe ..." (or a graphs_FORM) splits it over calls.
source benchmarks/device/common.sh smol_native
# FORMS: dequantized, dequantized_pdl (--linear-pdl on: the dense kernel's PDL, an option), native (the engine's:
# PDL on since 2026-12-07), native_pdl (--gluon-pdl on), native_nopdl (--gluon-pdl off), native_sN (--gluon-stages N:
# every launch's tiles through shared memory; 0 the register path everywhere), native_fN (--gluon-few-rows-stages N:
# an AR step's launches'), native_vN (--gluon-staged-rows N: that rule up to N rows, a verify's launches too)
form_flags() {
  flags=()
  case $1 in
    dequantized) ;;
    dequantized_pdl) flags+=(--linear-pdl on) ;;
    native) flags+=(--weights native) ;;
    native_pdl) flags+=(--weights native --gluon-pdl on) ;;
    native_nopdl) flags+=(--weights native --gluon-pdl off) ;;
    native_s[0-9]) flags+=(--weights native --gluon-stages "${1#native_s}") ;;
    native_f[0-9]) flags+=(--weights native --gluon-few-rows-stages "${1#native_f}") ;;
    native_v[0-9]*) flags+=(--weights native --gluon-staged-rows "${1#native_v}") ;;
    *) say "FORMS / PROFILE_FORMS: $1 is none of dequantized dequantized_pdl native native_pdl native_nopdl" \
         "native_sN native_fN native_vN"; exit 2 ;;
  esac
}
for form in ${FORMS:-dequantized native native_nopdl} ${PROFILE:+${PROFILE_FORMS:-dequantized native native_nopdl}}; do
  form_flags "$form"  # each form checked before any section runs
done
install_assets smollm2 humaneval
section q4_1_bench 150 python3 benchmarks/quant_gluon.py --bench --q4-1 --md "$OUT/q4_1.md"
section layer_probe 150 python3 benchmarks/layer_probe.py --md "$OUT/layer_probe.md"
section q4_1_tests 200 python3 -m pytest -o addopts="" -q -p no:cacheprovider -rs \
  tests/engine/models/test_quant_gluon_q4_1.py tests/engine/models/test_quant_gluon_options.py \
  tests/engine/models/test_quant_gluon.py::test_on_the_gpu_a_few_rows_on_wgmmas_narrowest_n_round_as_in_a_verify
for form in ${FORMS:-dequantized native native_nopdl}; do
  form_flags "$form"
  section "graphs_$form" 110 python3 benchmarks/gpu_bench.py graphs --target smollm2-135m-instruct \
    --draft smollm2-135m-dflash --sets humaneval "${flags[@]}" --budgets ${BUDGETS:-22 48} --new-tokens 32 \
    --repeats 20 --md "$OUT/graphs_$form.md" --out "$OUT/graphs_$form.json"
done
# PROFILE=1: the decode loop itself in each of PROFILE_FORMS (`gpu_bench.py profile`: AR, DDTree at budget 22 and the
# generic AR, 64 new tokens: its wall a step not profiled, then its kernels a step under the profiler), against the
# graphs replayed alone above (2026-12-07: the sweep's native AR step 0.80 ms where its graph alone took 0.92)
for form in ${PROFILE:+${PROFILE_FORMS:-dequantized native native_nopdl}}; do
  form_flags "$form"
  section "profile_$form" 120 python3 benchmarks/gpu_bench.py profile --target smollm2-135m-instruct \
    --draft smollm2-135m-dflash --sets humaneval "${flags[@]}" --budget 22 --new-tokens 64 \
    --md "$OUT/profile_$form.md" --out "$OUT/profile_$form.json"
done
summary
