"""The winner → something a server runs: engine YAML, JSON, or a llama-server command line.

Every export carries its provenance: study, trial, git sha, device, workload hash, TPS ± spread
and speedup, so a config file found on a server months later still says where it came from.
"""

from __future__ import annotations

import datetime as dt
import json
import shlex
from typing import Any

import optuna
import yaml

from autotune import results
from autotune.errors import InputError

FORMATS = ("engine", "llama-server", "json")


def provenance(study: optuna.Study, w: results.Winner) -> dict[str, Any]:
    a = study.user_attrs
    return {
        "study": study.study_name,
        "trial": w.trial,
        "role": w.role,
        "confirmed": w.confirmed,
        "experiment": a.get("experiment"),
        "git_sha": a.get("git_sha", "unknown"),
        "device": w.device or a.get("device"),
        "dtype": a.get("dtype"),
        "workload_hash": w.workload_hash or a.get("workload_hash"),
        "workloads": a.get("workloads"),
        "decode_tps": round(w.median_tps, 4),
        "decode_tps_spread": round(w.spread, 4),
        "decode_tps_conservative": round(w.value, 4),
        "speedup_vs_ar": None if w.speedup_vs_ar is None else round(w.speedup_vs_ar, 4),
        "ar_decode_tps": None if w.ar_median_tps is None else round(w.ar_median_tps, 4),
        "positive_vs_ar": w.positive_vs_ar,
        "acceptance_length": w.acceptance_length,
        "break_even_al": w.break_even_al,
        "exact_match": w.exact_match,
        "exported_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def build(study: optuna.Study) -> dict[str, Any]:
    """The exported document: {engine: EngineConfig fields, model: {...}, provenance: {...}}."""
    w = results.winner(study)
    if w is None:
        raise InputError("STUDY", None, "has no feasible completed trial to export yet", study.study_name)
    from engine.config import EngineConfig

    # round-trip through EngineConfig: every field present, and nothing the engine would refuse
    engine_fields = EngineConfig.from_dict(dict(w.config), source=f"trial {w.trial}").to_dict()
    model = dict(study.user_attrs.get("model", {}))
    return {"engine": engine_fields, "model": model, "provenance": provenance(study, w)}


def render(doc: dict[str, Any], fmt: str) -> str:
    if fmt == "engine":
        header = "# autotune export: load with `python -m engine generate --config THIS_FILE ...`\n"
        return header + yaml.safe_dump(doc, sort_keys=False)
    if fmt == "json":
        return json.dumps(doc, indent=2) + "\n"
    if fmt == "llama-server":
        return llama_server(doc)
    raise InputError("--format", None, f"must be one of {list(FORMATS)}", fmt)


# The DFlash/DDTree llama.cpp port (lucebox-hub's dflash_server) takes the target .gguf as its first
# argument and these flags. The exact flag names are checked against the port in the serving issue;
# fields without a flag there are listed in the header rather than guessed.
_FLAGS = {"budget": "--ddtree-budget", "top_k": "--ddtree-topk", "proposal_temp": "--ddtree-temp",
          "block_size": "--draft-block-size"}


def llama_server(doc: dict[str, Any], binary: str = "dflash_server") -> str:
    cfg, model, prov = doc["engine"], doc["model"], doc["provenance"]
    args = [binary, str(model.get("target", "TARGET.gguf"))]
    unmapped = []
    if cfg["verify"] != "ar":
        args += ["--draft", str(model.get("draft", "DRAFT.gguf"))]
    if cfg["verify"] == "ddtree":
        args.append("--ddtree")
        for field, flag in _FLAGS.items():
            if cfg.get(field) is not None:
                args += [flag, str(cfg[field])]
        if cfg.get("rollback") == "fast":
            args.append("--fast-rollback")
        unmapped += [f"chain_seed={cfg.get('chain_seed')}"]
    elif cfg["verify"] == "chain" and cfg.get("block_size") is not None:
        args += ["--draft-block-size", str(cfg["block_size"])]
    unmapped += [f"target_feat_ctx={cfg.get('target_feat_ctx')}", f"draft_path={cfg.get('draft_path')}"]
    if cfg.get("temperature"):
        unmapped.append(f"temperature={cfg['temperature']} (set per request)")
    lines = ["#!/bin/sh",
             f"# autotune export for the llama.cpp DFlash/DDTree port: study {prov['study']}, trial {prov['trial']}",
             *(f"# {k}: {v}" for k, v in prov.items()),
             f"# not mapped to a server flag (checked in the serving issue): {', '.join(unmapped)}",
             " ".join(shlex.quote(a) for a in args) + ' --host 127.0.0.1 --port "${PORT:-8000}"', ""]
    return "\n".join(lines)
