#!/usr/bin/env bash
# Issue #28 on the lent GPU (benchmarks/DEVICE.md), carrying .device/gguf (the tests' gguf package) or
# nothing: the 27B Q4_K_M shape's AR step and the kernel of GGUF blocks, random weights only.
#   1. kernel_bench quant: every weight of the 27B Q4_K_M step through the 1-row kernel (the word decode
#      beside the half-word one), summed over the step's launches; exactness against dequantized weights;
#   2. gpu_bench large --weights q4_k_m: warm AR and verify against the roofline of the blocks' bytes, as the engine
#      loads (on an H100/H200: Q4_K and Q6_K as the operand-register decode's planes; Q4K_DECODE=kernel: every format
#      through quant_kernel; Q4K_COMPARE=kernel: both, one after the other) (DRAFT_RECIPE=q8_0: its draft held in
#      Q8_0 blocks, `--draft-recipe`);
#   3. the quantized GPU tests (with .device/gguf); 4. kernel_bench quant-tiles: the 1-row launches of the
#      27B's and SmolLM2's weights (QT_SHAPES="SmolLM2": labels' starts or NxK, as KQ_SHAPES for 1; QT_ROWS="1 33":
#      a budget-32 verify's launches too, the K split as the step's);
#      5. PROFILE=1: the kernels' share of a step (PROFILE_DECODE=kernel: through quant_kernel); MEMORY=1: the 27B
#      Q4_K_M's measured peak at 32k tokens against
#      its plan (tests/engine/test_memory_gpu.py -k "$MEMORY_K": default q4_k_m, its draft in bf16, @q8_0 and
#      @q4_k_m; MEMORY_K=draft the two quantized drafts'; a test per case and config, so
#      MEMORY_K="draft-q8_0 and ddtree" runs the reference DDTree of the Q8_0 draft's case alone).
#      VRAM=1 (with .device/wheels): the sweep under a VRAM limit (experiments/qwen35-27b-q4km-vram.yaml) and its
#      report. PACKED=1: the Q4_K bf16-pair decode prototype (benchmarks/quant_packed.py): tests, launches, the step.
#      NCU=1: the few-row Q4_K launches under Nsight Compute (benchmarks/quant_ncu.py; $OUT/ncu_q4k.txt).
#      GLUON=1: the Q4_K / Q6_K decode into operand registers (benchmarks/quant_gluon.py): static counts, tests,
#      launches, the 27B Q4_K_M step through it (gluon_large; GLUON_WARPS="4 8": again with every launch on that many
#      warps). GRAPHS=1: the step's graphs
#      replayed alone, their kernels by name (GRAPHS_DECODE; GRAPHS_VS="k8": again with those options, compared
#      launch by launch). MIN_ROWS=16: the engine's step again with a launch's
#      fewest rows a program at 16 (gpu_bench's --gluon-min-rows; the engine's 8 since 2026-12-06); STEPS="s3 p t0
#      ...": the step again with other quant_gluon options (below). SKIP="large_q4km ..." leaves sections out.
# The limits add up to 580 s, under a call's 600: quant_tiles gets what is left; for all of it, a second call
# on the warm machine: TILES_LIMIT=580 SKIP="kernel_quant large_q4km quant_tests" bash benchmarks/device/quant.sh
# MEMORY=1 adds up to 560 s: give it a call of its own, SKIP="kernel_quant large_q4km quant_tests quant_tiles"
source benchmarks/device/common.sh quant
# step_flags NAME: gpu_bench's flags for one of STEPS (below), or exit 2 naming it: each letter with its number
step_flags() {
  flags=""
  local v=$1
  if [ "$v" != engine ] && ! [[ $v =~ ^(s[0-9]|m[0-9]+|r[0-9]+|w[0-9]+|f[0-9]+|k[0-9]+|v[0-9]+|p[0-9]*|t[0-9]*)+$ ]]; then
    say "STEPS: $v: a step is engine or letters with their numbers (sN mN rN wN fN kN vN p p0 t t0 t16)"; exit 2
  fi
  if [[ $v =~ s([0-9]) ]]; then flags+=" --gluon-stages ${BASH_REMATCH[1]}"; fi
  if [[ $v =~ m([0-9]+) ]]; then flags+=" --gluon-min-rows ${BASH_REMATCH[1]}"; fi
  if [[ $v =~ r([0-9]+) ]]; then flags+=" --gluon-maxnreg ${BASH_REMATCH[1]}"; fi
  if [[ $v =~ w([0-9]+) ]]; then flags+=" --gluon-wide-warps ${BASH_REMATCH[1]}"; fi
  if [[ $v =~ f([0-9]+) ]]; then flags+=" --gluon-fold-from ${BASH_REMATCH[1]}"; fi
  if [[ $v =~ k([0-9]+) ]]; then flags+=" --gluon-programs-per-sm ${BASH_REMATCH[1]}"; fi
  if [[ $v =~ v([0-9]+) ]]; then flags+=" --gluon-verify-sliver ${BASH_REMATCH[1]}"; fi
  if [[ $v =~ p([0-9]*) ]]; then
    case ${BASH_REMATCH[1]} in
      "") flags+=" --gluon-pdl on" ;; 0) flags+=" --gluon-pdl off" ;;
      *) say "STEPS: $v: p takes nothing or 0"; exit 2 ;;
    esac
  fi
  if [[ $v =~ t([0-9]*) ]]; then
    case ${BASH_REMATCH[1]} in
      "") flags+=" --gluon-tails on" ;; 0) flags+=" --gluon-tails off" ;; 16) flags+=" --gluon-tails 16" ;;
      *) say "STEPS: $v: t takes nothing, 0 or 16"; exit 2 ;;
    esac
  fi
}
STEPS="${MIN_ROWS:+m$MIN_ROWS} ${STEPS:-}"
for v in ${STEPS:-} ${GRAPHS_VS:-}; do step_flags "$v"; done  # every step checked before any section runs
check_attentions ${ATTENTIONS:-}  # and every attention launch
if ls .device/gguf/*.whl >/dev/null 2>&1; then install_wheels .device/gguf/*.whl; fi
section kernel_quant ${KQ_LIMIT:-150} python3 benchmarks/kernel_bench.py quant ${KQ_SHAPES:+--shapes $KQ_SHAPES} --md "$OUT/quant.md"
# the step as the engine loads it (Q4K_DECODE as gpu_bench's --q4k-decode); Q4K_COMPARE="kernel": that decode's step
# too, on the same machine (large_q4km_kernel), for a like-for-like ratio
for decode in ${Q4K_DECODE:-engine} ${Q4K_COMPARE:-}; do
  suffix=$([ "$decode" = "${Q4K_DECODE:-engine}" ] || echo "_$decode")
  section large_q4km$suffix ${LARGE_LIMIT:-170} python3 benchmarks/gpu_bench.py large --weights q4_k_m --q4k-decode $decode \
    --presets qwen35-27b-shape --context 4096 --budgets ${BUDGETS:-8 32} ${DRAFT_RECIPE:+--draft-recipe $DRAFT_RECIPE} \
    --md "$OUT/large_q4km$suffix.md" --out "$OUT/large_q4km$suffix.json"
done
# MIN_ROWS=N: the engine's step again with a launch's fewest rows a program at N (quant_gluon.MIN_BLOCK_M: 8, the
# engine's since 2026-12-06, is wgmma's narrowest N; 16 as before), on the same machine as large_q4km: STEPS' mN
# STEPS="s3 p s3p m8 ...": the engine's step again with quant_gluon's options, a section each on the same machine
# (large_q4km_s3, ...): sN its products' tiles staged in shared memory (STAGES, --gluon-stages N), p programmatic
# dependent launch (PDL, --gluon-pdl on: the engine's since 2026-12-07; p0 off), mN a launch's fewest rows a program
# (MIN_BLOCK_M, --gluon-min-rows N), t a verify's 33-48 rows as 32 and a tail (TAILS, --gluon-tails on: the engine's since 2026-12-07; t0 off, t16 17-24
# rows as 16 + 8 too), rN registers at most for a tail's 8-warp launches (MAXNREG, --gluon-maxnreg N: 128 the
# engine's, r0 ptxas' own), wN a verify's launches on N warps (WIDE_WARPS, --gluon-wide-warps N: 8 the engine's, 16
# 256-row tiles), fN a launch folds an even split's parts in pairs from N rows a program (FOLD_FROM, --gluon-fold-from
# N: f32 a verify's launches, f0 never: the engine's, no gain measured at 4 an SM), kN a weight's split aimed at N programs an SM at 1 row (PROGRAMS_PER_SM,
# --gluon-programs-per-sm N: 4 the engine's; k8: faster 1-row launches alone, a slower AR step, 2026-12-07), vN a
# weight whose verify launch spills at most 1/N of a wave past whole waves takes twice the parts, its other launches
# folding them (VERIFY_SLIVER, --gluon-verify-sliver N: v0 never); "engine" the step as the engine loads it
# (large_q4km_engine)
for v in ${STEPS:-}; do
  step_flags "$v"
  section large_q4km_$v ${LARGE_LIMIT:-170} python3 benchmarks/gpu_bench.py large --weights q4_k_m --q4k-decode engine \
    $flags --presets qwen35-27b-shape --context 4096 --budgets ${BUDGETS:-8 32} --md "$OUT/large_q4km_$v.md" \
    --out "$OUT/large_q4km_$v.json"
done
# ATTENTIONS="32x4f1 32x4f8 ...": the engine's step again with every decode step's attention on that launch
# (gpu_bench's --step-attention BLOCK_NxWARPS[xSPAN][mBLOCK_M][fFOLD]: AR and verify alike; fFOLD: spans a run of
# the merge's fold), a section each (large_q4km_attn_32x8m64)
for a in ${ATTENTIONS:-}; do
  section large_q4km_attn_$a ${LARGE_LIMIT:-170} python3 benchmarks/gpu_bench.py large --weights q4_k_m --q4k-decode \
    engine --step-attention $a --presets qwen35-27b-shape --context 4096 --budgets ${BUDGETS:-8 32} \
    --md "$OUT/large_q4km_attn_$a.md" --out "$OUT/large_q4km_attn_$a.json"
done
section quant_tests ${TESTS_LIMIT:-90} python3 -m pytest -o addopts="" -q -p no:cacheprovider -rs \
  tests/engine/models/test_quant_kernel.py tests/engine/models/test_quantize.py tests/engine/test_gguf_archs.py \
  -k "cuda or gpu"
section quant_tiles ${TILES_LIMIT:-170} python3 benchmarks/kernel_bench.py quant-tiles ${QT_SHAPES:+--shapes $QT_SHAPES} \
  ${QT_ROWS:+--rows $QT_ROWS} --md "$OUT/quant_tiles.md"
# MEMORY=1: the 27B Q4_K_M shape (weights native) with its draft at 32k tokens, AR, DDTree b22 on the graphs and
# the generic chain: the measured peak per part against `autotune plan`'s (the bar: within 10%; the issue's: the
# total within 22 GiB), ~45 s to build the preset, then a 32k prefill per pass. 240 s was not enough on the H200
# (2026-12-06, third session: cut before one config ended); each config is a test of its own (`-k` picks one),
# its rows printed as it ends
if [ -n "${MEMORY:-}" ]; then
  section memory_q4km ${MEMORY_LIMIT:-560} python3 -m pytest -o addopts="" -q -s -p no:cacheprovider -rs \
    tests/engine/test_memory_gpu.py -k "${MEMORY_K:-q4_k_m}"
fi
# VRAM=1 (carry .device/wheels too: optuna and the rest): the sweep under a limit the largest trees do not fit
# (experiments/qwen35-27b-q4km-vram.yaml: DDTree b8-b128 against 19.33 GiB; b64 and b128 over by their plan),
# its report's "Planned against measured" for the bar's "plan within 10% of the measured peaks"
if [ -n "${VRAM:-}" ]; then
  install_wheels .device/wheels/*.whl
  section vram_sweep ${VRAM_LIMIT:-420} python3 -m autotune sweep experiments/qwen35-27b-q4km-vram.yaml \
    --storage "sqlite:///$OUT/vram.db" --tracking-uri none --no-progress --timeout "$(( ${VRAM_LIMIT:-420} - 90 ))s"
  section vram_report 60 python3 -m autotune report qwen35-27b-q4km-vram --storage "sqlite:///$OUT/vram.db" \
    --out "$OUT/vram_report"
fi
# PACKED=1: the Q4_K bf16-pair decode prototype (benchmarks/quant_packed.py): its tests on the GPU (one-hot rows read
# each weight, rows invariant), its launches beside the engine kernel's (kernel_bench.py packed), and the 27B Q4_K_M
# step with its Q4_K products through it (gpu_bench.py large --q4k-decode packed: AR against the roofline, verify)
if [ -n "${PACKED:-}" ]; then
  section packed_tests 90 python3 -m pytest -o addopts="" -q -p no:cacheprovider -rs tests/test_quant_packed.py
  section packed_kernel ${PACKED_LIMIT:-150} python3 benchmarks/kernel_bench.py packed --md "$OUT/packed.md"
  section packed_large ${LARGE_LIMIT:-170} python3 benchmarks/gpu_bench.py large --weights q4_k_m --q4k-decode packed \
    --presets qwen35-27b-shape --context 4096 --budgets ${BUDGETS:-8 32} --md "$OUT/large_packed.md"
fi
# GLUON=1: the Q4_K decode into the matrix unit's operand registers (benchmarks/quant_gluon.py): its static counts
# with this machine's Triton (does its Gluon take the kernel?), its tests (rows invariant, its weight's product),
# its launches beside the engine kernel's on the 27B Q4_K weights, and the 27B Q4_K_M step with its Q4_K products
# through it (GLUON_DECODE=gluon-pairs, the bf16 pair decode, Q6_K's products too, by default; or gluon, Q4_K's
# float decode); large_q4km is the same step on the engine's kernel
if [ -n "${GLUON:-}" ]; then
  section gluon_static 120 python3 benchmarks/quant_gluon.py
  section gluon_tests ${GLUON_TESTS_LIMIT:-150} python3 -m pytest -o addopts="" -q -p no:cacheprovider -rs tests/engine/models/test_quant_gluon.py \
    tests/engine/models/test_quant_gluon_q4_1.py tests/engine/models/test_quant_gluon_options.py tests/test_quant_gluon_install.py \
    tests/engine/test_gguf_archs.py::test_qwen35_q4_k_m_on_cuda_equals_its_own_ar_on_every_path
  section gluon_bench ${GLUON_LIMIT:-150} python3 benchmarks/quant_gluon.py --bench --md "$OUT/gluon.md"
  # the 27B Q4_K_M step through it: gluon_large, then (GLUON_WARPS="4 8") gluon_large_wN with every launch on N
  # warps
  gluon_step() {  # section suffix, then gpu_bench's extra flags
    local suffix=$1; shift
    section gluon_large$suffix ${LARGE_LIMIT:-170} python3 benchmarks/gpu_bench.py large --weights q4_k_m \
      --q4k-decode ${GLUON_DECODE:-gluon-pairs} "$@" --presets qwen35-27b-shape --context 4096 \
      --budgets ${BUDGETS:-8 32} --md "$OUT/large_gluon$suffix.md"
  }
  gluon_step ""
  for w in ${GLUON_WARPS:-}; do gluon_step _w$w --gluon-warps "$w"; done
fi
# NCU=1: one warm launch of each few-row Q4_K product (engine kernel, packed prototype, bf16 on the dequantized
# weight; 1 and 33 rows) under Nsight Compute: stall reasons, occupancy, memory throughput (NCU_SHAPE=NxK)
if [ -n "${NCU:-}" ]; then
  section ncu_q4k ${NCU_LIMIT:-150} ncu --profile-from-start off --clock-control none --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section InstructionStats --log-file "$OUT/ncu_q4k.txt" \
    python3 benchmarks/quant_ncu.py ${NCU_SHAPE:+--shape $NCU_SHAPE}
fi
if [ -n "${PROFILE:-}" ]; then
  section profile_q4km 150 python3 benchmarks/gpu_bench.py profile --presets qwen35-27b-shape \
    --weights q4_k_m --context 4096 --new-tokens 32 --q4k-decode ${PROFILE_DECODE:-engine} --md "$OUT/profile_q4km.md"
fi
# GRAPHS=1: the 27B Q4_K_M step graphs (AR once, DDTree's propose and verify at each of BUDGETS, 32 by default)
# replayed alone, their kernels by name: where a step's time goes beside its products (GRAPHS_DECODE, as
# gpu_bench's --q4k-decode: engine by default; kernel: quant_kernel's)
# GRAPHS_VS="k8 f32" (with GRAPHS=1): the graphs again with each of those quant_gluon options (STEPS' letters), and
# benchmarks/graphs_versus.py of the engine's against each: the launches matched one by one, grouped by the kernel
# before them (where a step's time moved; 2026-12-07: the 1-row launches at 8 programs an SM faster alone, the AR
# step slower)
if [ -n "${GRAPHS:-}" ]; then
  section graphs_q4km ${GRAPHS_LIMIT:-170} python3 benchmarks/gpu_bench.py graphs --presets qwen35-27b-shape \
    --weights q4_k_m --context 4096 --new-tokens 8 --budgets ${BUDGETS:-32} --q4k-decode ${GRAPHS_DECODE:-engine} \
    --md "$OUT/graphs_q4km.md" --out "$OUT/graphs_q4km.json"
  for v in ${GRAPHS_VS:-}; do
    step_flags "$v"
    section graphs_q4km_$v ${GRAPHS_LIMIT:-170} python3 benchmarks/gpu_bench.py graphs --presets qwen35-27b-shape \
      --weights q4_k_m --context 4096 --new-tokens 8 --budgets ${BUDGETS:-32} $flags \
      --md "$OUT/graphs_q4km_$v.md" --out "$OUT/graphs_q4km_$v.json"
    section graphs_versus_$v 30 python3 benchmarks/graphs_versus.py --a "$OUT/graphs_q4km.json" \
      --b "$OUT/graphs_q4km_$v.json" --md "$OUT/graphs_versus_$v.md"
  done
fi
summary
