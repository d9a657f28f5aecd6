"""`python -m engine train-draft`: self-distil a target and train a DFlash draft for it."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from engine.config import EngineInputError
from engine.training.checkpoint import MANIFEST, CheckpointConfig, check_resumable, read_manifest
from engine.training.sequences import generate_responses, load_sequence_records, save_sequences
from engine.training.train import TrainConfig, grow_draft, train_draft

ARCH_DEFAULTS = dict(layers=2, block_size=16, num_target_ids=5)
SAVE_MARGIN_S = 15.0  # --wall-budget: seconds kept for writing the checkpoint after training
SMOKE = dict(n_prompts=8, gen_max_new_tokens=16, steps=5, layers=1, block_size=4, num_anchors=4, batch_size=2)


def add_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train-draft", help="train a DFlash draft on the target's own answers")
    t.add_argument("--target", required=True, help="dense target: preset, HF folder or .gguf")
    t.add_argument("--out", required=True, help="folder for the checkpoint (public DFlash layout)")
    t.add_argument("--prompts", nargs="*", default=None,
                   help="JSONL prompt files; default: train split of code (HumanEval + code-like chat), chat, agent, "
                        "stdlib (standard-library functions posed like HumanEval), chat-turns (later chat turns) "
                        "and stdlib-rest (the standard library's other functions)")
    t.add_argument("--n-prompts", type=int, default=3000, help="prompts to self-distil at most (default 3000)")
    t.add_argument("--gen-max-new-tokens", type=int, default=256,
                   help="tokens the target answers each prompt with at most (default 256)")
    t.add_argument("--gen-batch-size", type=int, default=128, help="prompts answered together (default 128)")
    t.add_argument("--gen-batch-tokens", type=int, default=0,
                   help="also at most this many cache positions a batch (rows x (longest prompt + "
                        "--gen-max-new-tokens)): with a large --gen-batch-size, short prompts share big batches "
                        "and long ones small (0: --gen-batch-size alone)")
    t.add_argument("--gen-temperature", type=float, default=0.0,
                   help="sample the answers at this temperature (default 0: greedy). Sampled answers give "
                        "more sequences than there are prompts (--gen-samples) and contexts greedy decoding "
                        "never reaches; each token is still the target's own")
    t.add_argument("--gen-samples", type=int, default=1,
                   help="answers a prompt gets at --gen-temperature (default 1; more needs a temperature > 0). "
                        "With --data and --gen-more, the answers already there at that temperature count")
    t.add_argument("--gen-budget", type=float, default=0.0,
                   help="seconds of self-distillation at most: no new batch starts after it, the prompts not "
                        "answered are left out (0: no limit)")
    t.add_argument("--init", metavar="DRAFT",
                   help="warm start: continue training this draft checkpoint (its sizes, block size, target "
                        "layers and mask token are kept; --layers above its own adds blocks after its layers that "
                        "start as the identity, so the deeper draft begins where this one ended)")
    t.add_argument("--layers", type=int, default=None, help=f"draft layers (default {ARCH_DEFAULTS['layers']})")
    t.add_argument("--intermediate-size", type=int, default=None, help="draft MLP width (default: the target's)")
    t.add_argument("--block-size", type=int, default=None,
                   help=f"block size (default {ARCH_DEFAULTS['block_size']})")
    t.add_argument("--num-target-ids", type=int, default=None,
                   help=f"target layers the draft reads (default {ARCH_DEFAULTS['num_target_ids']})")
    t.add_argument("--num-anchors", type=int, default=32,
                   help="blocks drawn per sequence per step, each starting at a random position (default 32)")
    t.add_argument("--gamma", type=float, default=7.0,
                   help="loss weight of block position k: exp(-(k-1)/gamma), early positions count more (the DFlash "
                        "paper's decay; it suggests 7 for block size 16, 5 for 10, 4 for 8; default 7)")
    t.add_argument("--lr", type=float, default=6e-4, help="AdamW learning rate (default 6e-4)")
    t.add_argument("--steps", type=int, default=600, help="optimizer steps (default 600)")
    t.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    t.add_argument("--max-seq-len", type=int, default=640,
                   help="tokens of a training sequence at most, prompt and answer (default 640)")
    t.add_argument("--time-budget", type=float, default=0.0, help="seconds of training at most (0: no limit)")
    t.add_argument("--wall-budget", type=float, default=0.0,
                   help="seconds for the whole command (data, features, training, saving): the training budget "
                        "shrinks to fit (0: no limit)")
    t.add_argument("--val-fraction", type=float, default=0.02,
                   help="held-out share of the sequences (at most 256, and the rest of the last held-out "
                        "prompt's answers), scored every --val-every steps; the "
                        "checkpoint written is the one with the lowest held-out loss (0: none, keep the last)")
    t.add_argument("--val-every", type=int, default=250, help="steps between held-out scorings")
    t.add_argument("--feature-store", choices=["auto", "device", "partial", "host", "recompute"], default="auto",
                   help="where the target features of every training position live: on the GPU, a seeded "
                        "random part of them there (partial: the other sequences' recomputed each batch), in "
                        "host memory (a batch copied each step), nowhere (recompute: the frozen target's "
                        "forward over each batch), or auto (the GPU when they fit in 70%% of its free memory, "
                        "partial when a quarter of them does, else recompute)")
    t.add_argument("--mask-token-id", type=int, default=None,
                   help="the id the draft's masked block positions carry (default: the tokenizer's mask token)")
    t.add_argument("--save-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the saved weights (default bfloat16)")
    t.add_argument("--data", nargs="+", metavar="FILE",
                   help="reuse self-distilled sequences from these JSONL files (.jsonl, .jsonl.gz, .jsonl.xz)")
    t.add_argument("--gen-more", action="store_true",
                   help="with --data: also self-distil the prompts that have fewer reused answers at "
                        "--gen-temperature than --gen-samples (within --gen-budget), and train on all")
    t.add_argument("--save-data",
                   help="write the training sequences (reused and new) to this JSONL file (.gz/.xz: compressed)")
    t.add_argument("--checkpoint-dir", metavar="DIR",
                   help="write a resumable checkpoint here (weights, AdamW state, schedule position, RNG states, "
                        "best draft, loss history) every --checkpoint-every steps and when the command ends, with "
                        "curves.png; the learning rate then decays over --steps only, so a run can span many calls")
    t.add_argument("--checkpoint-every", type=int, default=500, help="steps between checkpoints (default 500)")
    t.add_argument("--part-mb", type=float, default=15.0,
                   help="checkpoint part files of at most this many MiB, each its own file (default 15)")
    t.add_argument("--state-dtype", choices=["float32", "bfloat16", "int8"], default="float32",
                   help="checkpoint weights and AdamW moments in float32 (a resume is exact), bfloat16 (half "
                        "the size, rounded once per checkpoint) or int8 (a third: bfloat16 weights, 8-bit "
                        "blockwise moments); the last two resume close, not exact: for state that must travel "
                        "through size limits")
    t.add_argument("--resume", metavar="DIR",
                   help="continue the run checkpointed in DIR (and keep checkpointing there unless "
                        "--checkpoint-dir says otherwise): give the first call's flags and data (--data; the "
                        "architecture flags left out keep the checkpoint's values). What may change: "
                        "the length and budgets (--steps, --time-budget, --wall-budget, --stop-after), "
                        "--val-every, --feature-store, the generation flags (--gen-batch-size, "
                        "--gen-max-new-tokens), how checkpoints are written (--checkpoint-dir, --checkpoint-every, "
                        "--part-mb, --state-dtype), --device, --out and --no-progress; any other change is refused "
                        "naming the flag")
    t.add_argument("--stop-after", type=int, default=None, metavar="N",
                   help="end this call after N steps (checkpoint written); the schedule still runs over --steps")
    t.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    t.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default auto)")
    t.add_argument("--seed", type=int, default=0, help="seed of the data order, anchors and initial weights")
    t.add_argument("--smoke", action="store_true", help="a few steps on a few prompts (CPU check)")


def _prompts(args: argparse.Namespace, pair, n: int) -> list[list[int]]:
    from engine.data.workloads import load_workload

    if args.prompts:
        prompts = []
        for f in args.prompts:
            prompts.extend(load_workload(f, Path.cwd(), n_prompts=10**9, seed=args.seed, split="all").prompts)
        prompts = prompts[:n]
    else:
        from engine.data.workloads import TRAINING_MIX, training_prompts

        prompts = training_prompts(TRAINING_MIX, n, args.seed)
    encoded = [pair.encode(p) for p in prompts]
    # A prompt that leaves no room for an answer inside max_seq_len teaches nothing.
    keep = [ids for ids in encoded if len(ids) <= args.max_seq_len - 32]
    if len(keep) < len(encoded):
        print(f"skipped {len(encoded) - len(keep)} prompts longer than {args.max_seq_len - 32} tokens", flush=True)
    return keep


def _warm_start(args: argparse.Namespace, pair) -> tuple:
    """The --init draft (float32; grown to --layers when that asks for more), checked against the target
    and the flags given, its training summary, and the layers it had before growing (None: not grown)."""
    from engine.loading import load_draft_folder

    draft = load_draft_folder(Path(args.init), pair.target, pair.target.device, torch.float32)
    have = _architecture(draft)
    grown_from = None
    deeper = args.layers is not None and args.layers != have["layers"]
    wider = args.intermediate_size is not None and args.intermediate_size != have["intermediate_size"]
    if deeper or wider:
        # more layers or a wider MLP than the --init draft: it grows (what is new starts as the identity)
        grown_from = {"layers": have["layers"], "intermediate_size": have["intermediate_size"]}
        draft = grow_draft(draft, args.layers or have["layers"], seed=args.seed,
                           intermediate_size=args.intermediate_size)
        have = _architecture(draft)
    for key, value in have.items():
        asked = getattr(args, key)
        if asked is not None and asked != value:
            raise EngineInputError(f"--{key.replace('_', '-')} {asked} disagrees with the --init draft "
                                   f"{args.init!r}, which has {key} {value}; leave the flag out to keep its value")
    summary = Path(args.init) / "training.json"
    try:
        previous = json.loads(summary.read_text()) if summary.is_file() else None
    except json.JSONDecodeError as e:
        raise EngineInputError(f"{summary}: not JSON ({e})") from None
    if previous is not None:
        previous.pop("init_training", None)  # one level of history; total_steps carries the rest
    grown = ""
    if grown_from:
        parts = [f"{grown_from['layers']} layers"] if grown_from["layers"] != have["layers"] else []
        if grown_from["intermediate_size"] != have["intermediate_size"]:
            parts.append(f"MLP width {grown_from['intermediate_size']}")
        grown = f" (grown from {' and '.join(parts)}: what is new starts as the identity)"
    print(f"warm start from {args.init}: {have['layers']} layers, MLP width {have['intermediate_size']}{grown}, "
          f"block {have['block_size']}, {_steps_so_far(previous)} steps so far", flush=True)
    return draft, previous, grown_from


def _architecture(draft) -> dict[str, int]:
    """A draft's architecture under the names of the flags that set it."""
    c = draft.cfg
    return dict(layers=c.num_hidden_layers, block_size=c.block_size, num_target_ids=len(c.target_layer_ids),
                intermediate_size=c.intermediate_size, mask_token_id=c.mask_token_id)


def _steps_so_far(training: dict | None) -> int:
    """Training steps behind a checkpoint, from its training.json (0 without one)."""
    training = training or {}
    return int(training.get("total_steps", training.get("steps", 0)))


def _sizes(args: argparse.Namespace) -> dict[str, int]:
    """The run's sizes: the flags given, else ``--smoke``'s (the architecture's kept for ``--init``),
    else the architecture's defaults (the rest stay None until the flags' defaults fill them)."""
    values = {k: getattr(args, k) for k in ("n_prompts", "gen_max_new_tokens", "steps", "layers", "block_size",
                                            "num_target_ids", "num_anchors", "batch_size")}
    if args.smoke:
        values.update({k: v for k, v in SMOKE.items() if not (args.init and k in ARCH_DEFAULTS)})
    for k, v in ARCH_DEFAULTS.items():
        values[k] = v if values[k] is None else values[k]
    return values


def _mask_id(args: argparse.Namespace, pair, init) -> int:
    """The draft's mask token: a warm start's own, else ``--mask-token-id``, else the tokenizer's."""
    mask_id = args.mask_token_id if args.mask_token_id is not None else getattr(pair.tokenizer, "mask_id", None)
    if init is not None:
        mask_id = init.cfg.mask_token_id
    if mask_id is None or not 0 <= mask_id < pair.target.cfg.vocab_size:
        raise EngineInputError(f"a mask token id inside the vocabulary is needed (--mask-token-id), got {mask_id}")
    return mask_id


def _sequences(args: argparse.Namespace, pair, cfg: TrainConfig, n_prompts: int
               ) -> tuple[list[list[int]], list[int], list[float], int]:
    """The self-distilled sequences (prompt + the target's answer), their prompt lengths and answers'
    temperatures: those of ``--data``, then (without it, or with ``--gen-more``) each prompt's answers at
    ``--gen-temperature`` up to ``--gen-samples`` (with ``--gen-more``: less those reused at that
    temperature), answered by the target within ``--gen-budget``; saved to ``--save-data``. Also how many
    were reused."""
    seqs, plens, temps = [], [], []
    for f in args.data or ():
        more, more_plens, more_temps = load_sequence_records(Path(f))
        seqs.extend(more)
        plens.extend(more_plens)
        temps.extend(more_temps)
    reused = len(seqs)
    if not args.data or args.gen_more:
        prompts = _prompts(args, pair, n_prompts)
        # answered already: a reused sequence at this temperature starts with the prompt
        have = Counter(tuple(sq[:n]) for sq, n, t in zip(seqs, plens, temps, strict=True)
                       if t == args.gen_temperature)
        todo = [ids for ids in prompts for _ in range(max(args.gen_samples - have[tuple(ids)], 0))]
        if args.data:
            print(f"--gen-more: {len(seqs)} sequences reused, {len(todo)} answers to give "
                  f"({args.gen_samples} a prompt at temperature {args.gen_temperature:g})", flush=True)
        # Sampled, the seed moves with the data reused and the temperature: a later --gen-more draws other samples
        # than the first, and two temperatures other streams. (Greedy, the seed orders the batches alone.)
        seed = args.seed if args.gen_temperature == 0 else args.seed + reused + round(args.gen_temperature * 1e6)
        answers = generate_responses(pair.target, todo, cfg.gen_max_new_tokens, cfg.gen_batch_size, pair.stop_ids,
                                     time_budget_s=args.gen_budget, seed=seed,
                                     batch_tokens=args.gen_batch_tokens, temperature=args.gen_temperature)
        done = [(p, a) for p, a in zip(todo, answers, strict=True) if a is not None]
        if len(done) < len(todo):
            print(f"--gen-budget {args.gen_budget:.0f}s: {len(done)} of {len(todo)} answers given", flush=True)
        seqs.extend(p + a for p, a in done)
        plens.extend(len(p) for p, _ in done)
        temps.extend(args.gen_temperature for _ in done)
    if args.save_data:
        save_sequences(Path(args.save_data), seqs, plens, temps)
    return seqs, plens, temps, reused


def _train_config(args: argparse.Namespace, values: dict[str, int]) -> TrainConfig:
    resumable = bool(args.checkpoint_dir or args.resume)
    return TrainConfig(
        layers=values["layers"], intermediate_size=args.intermediate_size, block_size=values["block_size"],
        num_target_ids=values["num_target_ids"], num_anchors=values["num_anchors"], gamma=args.gamma, lr=args.lr,
        steps=values["steps"], batch_size=values["batch_size"], max_seq_len=args.max_seq_len,
        gen_max_new_tokens=values["gen_max_new_tokens"], gen_batch_size=args.gen_batch_size, seed=args.seed,
        time_budget_s=args.time_budget, warmup_steps=min(30, max(1, values["steps"] // 10)),
        val_fraction=args.val_fraction, val_every=args.val_every, feature_store=args.feature_store,
        # A run over many calls decays over its steps: each call's budget ends the call, not the schedule.
        decay_over="steps" if resumable else "steps-or-time",
    )


def grown_but_idle(summary: dict, out: Path) -> str | None:
    """The warning for a grown draft whose held-out scorings never beat its step 0: the draft written is
    the --init draft with idle layers (the same proposals, more cost), None otherwise."""
    if not summary.get("grown_from_layers") or not summary.get("held_out") or summary.get("kept_step") != 0:
        return None
    idle = summary["config"]["layers"] - summary["grown_from_layers"]
    was, now = summary.get("grown_from_intermediate_size"), summary["config"].get("intermediate_size")
    what = [f"{idle} idle layers"] if idle else []
    if was is not None and now is not None and now != was:
        what.append(f"{now - was} idle MLP units a layer")
    return (f"warning: no step beat the grown draft's start on the held-out set: {out} is the --init draft with "
            f"{' and '.join(what)} (the same proposals, slower): keep the --init draft")


def _check_flags(args: argparse.Namespace) -> None:
    if args.gen_more and not args.data:
        raise EngineInputError("--gen-more adds to the sequences of --data: give --data FILE too")
    if not math.isfinite(args.gen_temperature) or args.gen_temperature < 0:
        raise EngineInputError(f"--gen-temperature must be a finite number >= 0 (0: greedy), "
                               f"got {args.gen_temperature}")
    if args.gen_samples < 1:
        raise EngineInputError(f"--gen-samples must be >= 1 answers a prompt, got {args.gen_samples}")
    if args.data and not args.gen_more and (args.gen_temperature or args.gen_samples != 1):
        raise EngineInputError(f"--gen-temperature {args.gen_temperature:g} --gen-samples {args.gen_samples} with "
                               "--data: the reused sequences are all that trains; add --gen-more to answer the "
                               "prompts at that temperature too")
    if args.gen_samples > 1 and args.gen_temperature == 0:
        raise EngineInputError(f"--gen-samples {args.gen_samples} at --gen-temperature 0: greedy answers to one "
                               "prompt are one answer repeated; give a temperature > 0 (e.g. 0.8)")
    if args.gen_batch_tokens < 0:
        raise EngineInputError(f"--gen-batch-tokens must be >= 0 (0: no token budget), got {args.gen_batch_tokens}")
    for flag in ("wall_budget", "gen_budget"):
        if getattr(args, flag) < 0:
            raise EngineInputError(f"--{flag.replace('_', '-')} must be >= 0 seconds (0: no limit), "
                                   f"got {getattr(args, flag)}")
    if args.init and args.resume:
        raise EngineInputError(f"--init {args.init!r} and --resume {args.resume!r}: the checkpoint holds the draft "
                               f"to continue (its --init is in its history); leave --init out")
    if args.stop_after is not None and args.stop_after < 1:
        raise EngineInputError(f"--stop-after must be a positive number of steps, got {args.stop_after}")


def _checkpointing(args: argparse.Namespace, cfg: TrainConfig
                   ) -> tuple[CheckpointConfig | None, dict | None, TrainConfig]:
    """Where checkpoints go, and the manifest of the one to resume, checked against this run's config
    (returned with the checkpoint's warm-up length, which --steps would otherwise set anew) before any
    model loads. A fresh run refuses a folder that holds a checkpoint already."""
    folder = args.checkpoint_dir or args.resume
    if folder is None:
        return None, None, cfg
    ck = CheckpointConfig(Path(folder), every=args.checkpoint_every, part_mb=args.part_mb,
                          state_dtype=args.state_dtype)
    if not args.resume:
        if (ck.dir / MANIFEST).exists():
            step = read_manifest(ck.dir)["step"]
            raise EngineInputError(f"--checkpoint-dir {folder!r} holds a checkpoint (step {step}); continue it "
                                   f"with --resume {folder}, or give an empty folder")
        return ck, None, cfg
    manifest = read_manifest(Path(args.resume))
    cfg = replace(cfg, warmup_steps=manifest["config"].get("warmup_steps", cfg.warmup_steps))
    check_resumable(manifest, Path(args.resume), cfg)
    return ck, manifest, cfg


def _resumed_architecture(args: argparse.Namespace, values: dict[str, int]) -> None:
    """With --resume, the architecture flags left out keep the checkpoint's values (as with --init,
    whose draft's sizes the first call took without flags)."""
    if not args.resume:
        return
    saved = read_manifest(Path(args.resume))["config"]
    for key in ARCH_DEFAULTS:
        if getattr(args, key) is None and key in saved:
            values[key] = saved[key]
    if args.intermediate_size is None:
        args.intermediate_size = saved.get("intermediate_size")


def _check_out(out: Path, manifest: dict | None) -> None:
    """--out must be empty, unless it holds this very run's draft from an earlier call (overwritten)."""
    if not out.exists() or not any(out.iterdir()):
        return
    if manifest is not None and (out / "training.json").is_file():
        try:
            if json.loads((out / "training.json").read_text()).get("run_id") == manifest["run_id"]:
                return
        except json.JSONDecodeError:
            pass
    raise EngineInputError(f"--out {str(out)!r} exists and is not empty; refusing to overwrite a checkpoint")


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    from engine.api import load
    from engine.loading import save_draft_folder

    values = _sizes(args)
    _check_flags(args)
    _resumed_architecture(args, values)
    cfg = _train_config(args, values)
    ck, manifest, cfg = _checkpointing(args, cfg)
    out = Path(args.out)
    _check_out(out, manifest)
    pair = load(args.target, "none", device=args.device, dtype="auto")
    init, lineage = None, (manifest or {}).get("lineage")
    if args.init:
        init, init_training, grown_from = _warm_start(args, pair)
        arch = _architecture(init)
        values.update({k: arch[k] for k in ARCH_DEFAULTS})
        args.intermediate_size = arch["intermediate_size"]
        cfg = _train_config(args, values)
        lineage = {"init": args.init, "init_training": init_training}
        if grown_from is not None:
            lineage["grown_from_layers"] = grown_from["layers"]
            lineage["grown_from_intermediate_size"] = grown_from["intermediate_size"]
    mask_id = _mask_id(args, pair, init)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    seqs, plens, temps, reused = _sequences(args, pair, cfg, values["n_prompts"])
    gen_s = time.perf_counter() - t0
    print(f"self-distillation: {len(seqs)} sequences, {sum(map(len, seqs))} tokens, {gen_s:.0f}s", flush=True)
    deadline = None
    if args.wall_budget:
        # train_draft trains until this, less a margin for saving, once the target features are in.
        deadline = t_start + args.wall_budget - SAVE_MARGIN_S
        if time.perf_counter() >= deadline:
            raise EngineInputError(f"--wall-budget {args.wall_budget:.0f}s is spent before training starts")
    draft, summary = train_draft(pair.target, seqs, plens, cfg, mask_id, log=lambda m: print(m, flush=True),
                                 init=init, deadline=deadline, checkpoint=ck,
                                 resume=Path(args.resume) if args.resume else None, stop_after=args.stop_after,
                                 progress=not args.no_progress, lineage=lineage,
                                 curves=(out if ck is None else ck.dir) / "curves.png", temperatures=temps)
    summary.update(target=args.target, generation_seconds=round(gen_s, 1), mask_token_id=mask_id,
                   data=args.data, prompts=args.prompts or f"default mix: {', '.join(_default_mix())}",
                   reused_sequences=reused, resumed_from=args.resume,
                   sampled_sequences={str(t): n for t, n in sorted(Counter(t for t in temps if t).items())},
                   command="python -m engine " + " ".join(sys.argv[1:]))
    if lineage is not None:
        # The checkpoint's whole history: what it was trained from, and how long in all.
        summary.update(init=lineage["init"], init_training=lineage["init_training"],
                       total_steps=summary["steps"] + _steps_so_far(lineage["init_training"]))
        for key in ("grown_from_layers", "grown_from_intermediate_size"):
            if key in lineage:
                summary[key] = lineage[key]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.save_dtype]
    save_draft_folder(draft.to(dtype), out, extra={"training": summary})
    summary["wall_seconds"] = round(time.perf_counter() - t_start, 1)  # this call's, saving included
    (out / "training.json").write_text(json.dumps(summary, indent=2))
    for key in ("steps", "steps_planned", "train_seconds", "final_loss", "final_acc1", "final_chain_al_train",
                "sequences", "tokens", "tokens_per_s", "held_out_sequences", "held_out_loss", "kept_step",
                "wall_seconds"):
        print(f"{key}: {summary[key]}")
    if (warning := grown_but_idle(summary, out)) is not None:
        print(warning, flush=True)
    if ck is not None:
        print(f"resumable: {ck.dir} (step {summary['steps']} of {summary['steps_planned']})")
    print(f"checkpoint: {out}")
    return 0


def _default_mix() -> tuple[str, ...]:
    from engine.data.workloads import TRAINING_MIX

    return TRAINING_MIX
