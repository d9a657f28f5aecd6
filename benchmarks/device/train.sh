#!/usr/bin/env bash
# Device call 4 of a draft session (benchmarks/DEVICE.md), carrying .device/workloads .device/assets
# .device/gguf, right after gen.sh: more training on its data (/root/stash/selfdistill.jsonl.xz,
# nothing generated), from its draft (INIT, default /root/stash/draft; INIT= trains a new one),
# then the acceptance lengths of the result on the eval prompts, on the GPU in float32 (every
# output checked against AR), and the pair's runtime path on HumanEval with it. The draft comes
# back in $OUT.
source benchmarks/device/common.sh train
WALL=${WALL:-380}
INIT=${INIT-/root/stash/draft}
if [ -n "$INIT" ]; then LR=${LR:-6e-4}; else LR=${LR:-1e-3}; fi
if [ ! -f /root/stash/selfdistill.jsonl.xz ]; then say "FATAL: no data in /root/stash (call 2 ran elsewhere?)"; exit 3; fi
install_wheels .device/gguf/*.whl
rm -rf /root/stash/draft2
section train $((WALL + 50)) python3 -m engine train-draft --target smollm2-135m-instruct --out /root/stash/draft2 \
  --data /root/stash/selfdistill.jsonl.xz --max-seq-len 2048 --steps 1000000 --wall-budget "$WALL" \
  --batch-size 32 --num-anchors 32 --layers 3 --intermediate-size 640 ${INIT:+--init "$INIT"} --lr "$LR" \
  --device cuda
cp /root/stash/draft2/* "$OUT/" 2>/dev/null && say "draft: $(ls /root/stash/draft2)"
if [ -f /root/stash/draft2/model.safetensors ]; then
  # The first 8 of the 12 exported chat prompts are the 8 `--sets chat --n-prompts 8` selects.
  head -8 .device/workloads/eval_chat.jsonl > /root/stash/eval_chat.jsonl
  section eval 75 python3 benchmarks/eval_draft.py --target smollm2-135m-instruct --draft /root/stash/draft2 \
    --sets humaneval /root/stash/eval_chat.jsonl agent --n-prompts 8 --max-new-tokens 96 --device cuda \
    --dtype float32 --out "$OUT/eval.json"
  cp /root/stash/draft2/config.json /root/stash/draft2/model.safetensors engine/checkpoints/smollm2-135m-dflash/
  section pair 80 python3 benchmarks/gpu_bench.py pair --sets humaneval --n-prompts 4 --max-new-tokens 96 \
    --repeats 2 --paths runtime --no-fp32-check --md "$OUT/pair_new.md"
fi
summary
