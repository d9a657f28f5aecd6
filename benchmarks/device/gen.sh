#!/usr/bin/env bash
# Device call 3 of a draft session (benchmarks/DEVICE.md), carrying .device/train .device/gguf, right
# after call 2 (SmolLM2 is installed in this machine's asset cache): self-distils the train prompts
# the kept data lacks, and trains a first draft on all of it in the time left. The data (kept +
# new) and the draft stay in /root/stash for train.sh and come back in $OUT.
source benchmarks/device/common.sh gen
WALL=${WALL:-540}  # seconds for self-distillation + training (the call has 600 in all)
GEN=${GEN:-400}  # of which self-distillation at most
NPROMPTS=${NPROMPTS:-40000}  # train prompts to answer (those of the kept data are not answered again)
# INIT=engine/checkpoints/smollm2-135m-dflash continues the shipped draft (run 8 did: on 5k
# sequences it overfit); the default trains a new one.
INIT=${INIT:-}
# Self-distilled data kept from earlier sessions: reused, and only the prompts it lacks answered.
DATA=${DATA:-benchmarks/data/smollm2-selfdistill.jsonl.xz}
if [ -n "$INIT" ]; then LR=${LR:-6e-4}; else LR=${LR:-1e-3}; fi
install_wheels .device/gguf/*.whl
gunzip -c .device/train/train.jsonl.gz > /root/stash/train.jsonl
say "train prompts: $(wc -l < /root/stash/train.jsonl)"
rm -rf /root/stash/draft
section train $((WALL + 50)) python3 -m engine train-draft --target smollm2-135m-instruct --out /root/stash/draft \
  --prompts /root/stash/train.jsonl --n-prompts "$NPROMPTS" --gen-max-new-tokens 256 --gen-batch-size 512 \
  --gen-budget "$GEN" --max-seq-len 2048 --steps 1000000 --wall-budget "$WALL" --batch-size 32 --num-anchors 32 \
  --layers 3 --intermediate-size 640 ${INIT:+--init "$INIT"} ${DATA:+--data "$DATA" --gen-more} --lr "$LR" \
  --device cuda --save-data /root/stash/selfdistill.jsonl.xz
cp /root/stash/draft/* "$OUT/" 2>/dev/null && say "draft: $(ls /root/stash/draft)"
# The data (kept + new) comes back: it replaces benchmarks/data/smollm2-selfdistill.jsonl.xz.
cp /root/stash/selfdistill.jsonl.xz "$OUT/" 2>/dev/null && say "data: $(stat -c %s "$OUT/selfdistill.jsonl.xz") bytes"
summary
