#!/usr/bin/env bash
# The first call on a fresh machine, when which card comes is a lottery (a call that names no kind gets an H100
# or an H200): runs H200_CMD on an H200 and H100_CMD on any other card; carry what either needs. 2026-12-06: an
# H100 came where the plan wanted an H200, and ran #28's quant.sh (no asset needed) instead of SmolLM2's stash:
#   H200_CMD='SKIP="kernel_check kernel_tests gpu_tests kernel_bench large" bash benchmarks/device/call1.sh' \
#   H100_CMD='KQ_SHAPES="SmolLM2 27B" SKIP="large_q4km quant_tiles" bash benchmarks/device/quant.sh' \
#   bash benchmarks/device/by_card.sh          # carry .device/smol1 .device/gguf (63.6 MiB)
for var in H200_CMD H100_CMD; do
  if [ -z "${!var:-}" ]; then
    echo "by_card.sh: $var must name the command to run (H200_CMD on an H200, H100_CMD on any other card)" >&2
    exit 2
  fi
done
name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "GPU: ${name:-none found}"
if [[ "$name" == *H200* ]]; then
  eval "$H200_CMD"
else
  eval "$H100_CMD"
fi
