"""The winner → something a server runs: engine YAML, JSON, or a llama-server command line.

Every export carries its provenance: study, trial, git sha, device, workload hash, TPS ± spread
and speedup, so a config file found on a server months later still says where it came from.
"""

from __future__ import annotations

import datetime as dt
import json
import shlex
from pathlib import Path
from typing import Any

import optuna
import yaml

from autotune import results
from autotune.errors import InputError

FORMATS = ("engine", "llama-server", "json")


def provenance(study: optuna.Study, w: results.Winner) -> dict[str, Any]:
    a, f = study.user_attrs, w.figures(4)
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
        "objective": w.objective,
        w.objective: f[w.objective],
        f"{w.objective}_spread": f["spread"],
        f"{w.objective}_conservative": f["value"],
        "speedup_vs_ar": f["speedup_vs_ar"],
        f"ar_{w.objective}": f[f"ar_{w.objective}"],
        **({"decode_tps": f["decode_tps"]} if w.objective != "decode_tps" else {}),
        "positive_vs_ar": w.positive_vs_ar,
        "acceptance_length": w.acceptance_length,  # (unrounded, as exported files have had it)
        "break_even_al": w.break_even_al,
        "exact_match": w.exact_match,
        # dimensions the sweep did not search because their value cannot matter there (autotune.dimensions)
        **({"fixed_dimensions": a["fixed_dimensions"]} if a.get("fixed_dimensions") else {}),
        "reliable": w.drift is None,  # False: the study's AR baselines drifted (results.ar_drift)
        **({"unreliable_because": w.drift.describe()} if w.drift is not None else {}),
        "exported_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def build(study: optuna.Study) -> dict[str, Any]:
    """The exported document: {engine: EngineConfig fields, model: {...}, provenance: {...}}."""
    w = results.winner(study)
    if w is None:
        raise InputError("STUDY", None, "has no feasible completed trial to export yet", study.study_name)
    from engine import EngineConfig

    # round-trip through EngineConfig (nothing the engine would refuse); only the fields that apply
    # to the winner's verify mode: an AR winner carries no budget it was never tuned at
    engine_fields = EngineConfig.from_dict(dict(w.config), source=f"trial {w.trial}").applicable()
    model = dict(study.user_attrs.get("model", {}))
    # a searched `weights` is how the model is loaded: the model section's, as model.weights is
    if engine_fields.get("weights") is not None:
        model["weights"] = engine_fields.pop("weights")
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


# The public llama.cpp DFlash/DDTree port is lucebox-hub (github.com/Luce-Org/lucebox-hub, read at
# commit 8305b6c), built on its ggml fork Luce-Org/llama.cpp-dflash-ggml. It has two programs:
#   dflash_server  the OpenAI-compatible HTTP server (server/src/server/server_main.cpp): target .gguf
#                  first, then --draft PATH, --ddtree (tree verify; also turns fast rollback on),
#                  --ddtree-budget N, --host, --port.
#   test_dflash    the decode daemon its scripts drive (server/test/test_dflash.cpp): TARGET DRAFT
#                  --daemon, --fast-rollback, --ddtree, --ddtree-budget=N, --ddtree-temp=X,
#                  --ddtree-no-chain-seed, --draft-ctx-max=N (or DFLASH27B_DRAFT_CTX_MAX).
# docs/serving.md holds the full mapping, with what has no equivalent and why.
SERVER_BINARY, DAEMON_BINARY = "dflash_server", "test_dflash"
PORT_MIN_DRAFT_CTX = 2048  # the port windows the draft at max(2048, --draft-ctx-max) positions


def _full_chain_seed(cfg: dict[str, Any]) -> bool:
    seed, block = cfg.get("chain_seed"), cfg.get("block_size")
    return seed is None or (block is not None and seed >= block - 1)


def llama_server_mapping(cfg: dict[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """EngineConfig fields -> (dflash_server flags, extra test_dflash daemon flags, unmapped notes)."""
    server: list[str] = []
    daemon: list[str] = []
    unmapped: list[str] = []
    verify = cfg["verify"]
    if verify == "ddtree":
        server += ["--ddtree", "--ddtree-budget", str(cfg["budget"])]
        if cfg.get("rollback") == "replay":
            unmapped.append("rollback=replay (the port's --ddtree always uses fast rollback)")
        unmapped.append(f"top_k={cfg.get('top_k')} (no flag: the port fixes K at 8 when the budget exceeds the "
                        f"draft depth, else 1)")
        if cfg.get("proposal_temp") != 1.0:
            daemon.append(f"--ddtree-temp={cfg['proposal_temp']}")
        if cfg.get("chain_seed") == 0:
            daemon.append("--ddtree-no-chain-seed")
        elif not _full_chain_seed(cfg):
            unmapped.append(f"chain_seed={cfg['chain_seed']} (the port seeds the whole top-1 chain or none)")
        if cfg.get("policy") == "adaptive":
            unmapped.append(f"policy=adaptive (the port verifies a tree of --ddtree-budget={cfg['budget']} every "
                            f"step: no AR steps, no smaller trees; see the warning above)")
    elif verify == "chain" and cfg.get("rollback") == "fast":
        daemon.append("--fast-rollback")
    if verify != "ar":
        ctx = cfg.get("target_feat_ctx") or 0
        if ctx >= PORT_MIN_DRAFT_CTX:
            daemon.append(f"--draft-ctx-max={ctx}")
        else:
            unmapped.append(f"target_feat_ctx={ctx} (the port's draft sees max(2048, --draft-ctx-max) positions, "
                            f"default 4096, capped by its feature ring)")
    if cfg.get("block_size") is not None:
        unmapped.append(f"block_size={cfg['block_size']} (the draft GGUF's own block size is used)")
    unmapped.append(f"draft_path={cfg.get('draft_path')} (an engine implementation path)")
    if "kernels" in cfg:
        unmapped.append(f"kernels={cfg['kernels']} (an engine implementation path)")
    return server, daemon, unmapped


def llama_server_warnings(doc: dict[str, Any]) -> list[str]:
    """What makes the exported command not run as written, or not as the study measured it: the port
    loads a GGUF file (a preset or a folder target is neither), and it has no adaptive step policy
    (`autotune export` prints these to stderr too)."""
    warnings = []
    target = str(doc["model"].get("target", ""))
    if not (target.endswith(".gguf") and Path(target).is_file()):
        warnings.append(f"target {target!r} is not a .gguf file: the port loads GGUF only; put the target's GGUF "
                        "path in the command (convert an HF folder with llama.cpp's convert_hf_to_gguf.py)")
    cfg = doc["engine"]
    if cfg.get("verify") == "ddtree" and cfg.get("policy") == "adaptive":
        warnings.append("the winner uses the adaptive step policy, which the port does not have: this command "
                        f"runs a fixed tree of budget {cfg.get('budget')} every step, which is what the study "
                        "measured only where the policy chose that budget (see the report's budget histogram; "
                        "`--format engine` keeps the policy)")
    return warnings


def llama_server(doc: dict[str, Any], binary: str = SERVER_BINARY) -> str:
    cfg, model, prov = doc["engine"], doc["model"], doc["provenance"]
    target, draft = str(model.get("target", "TARGET.gguf")), str(model.get("draft", "DRAFT.gguf"))
    server, daemon, unmapped = llama_server_mapping(cfg)
    args = [binary, target] + (["--draft", draft] if cfg["verify"] != "ar" else []) + server
    request = [f"temperature={cfg.get('temperature')}", f"seed={cfg.get('seed')}"]
    lines = ["#!/bin/sh",
             f"# autotune export for the llama.cpp DFlash/DDTree port (lucebox-hub {binary}): "
             f"study {prov.get('study')}, trial {prov.get('trial')}; mapping in docs/serving.md",
             *(f"# {k}: {v}" for k, v in prov.items()),
             *(f"# WARNING: {w}" for w in llama_server_warnings(doc))]
    if daemon:
        budget = [f"--ddtree-budget={cfg['budget']}"] if cfg["verify"] == "ddtree" else []
        ddtree = ["--ddtree"] if cfg["verify"] == "ddtree" else []
        cmd = [DAEMON_BINARY, target, draft, "--daemon", *ddtree, *budget, *daemon]
        lines.append(f"# only the {DAEMON_BINARY} daemon takes {' '.join(daemon)}; its command: "
                     + " ".join(shlex.quote(a) for a in cmd))
    lines += [f"# no equivalent in the port: {'; '.join(unmapped) if unmapped else 'none'}",
              f"# per request (OpenAI body): {', '.join(request)}",
              " ".join(shlex.quote(a) for a in args) + ' --host 127.0.0.1 --port "${PORT:-8000}"', ""]
    return "\n".join(lines)


def parse_llama_server(text: str) -> dict[str, Any]:
    """The EngineConfig fields a `--format llama-server` export sets, read back from its two commands."""
    fields: dict[str, Any] = {}
    server = next(ln for ln in reversed(text.splitlines()) if ln.strip() and not ln.startswith("#"))
    marker = f"its command: {DAEMON_BINARY} "
    daemon = next((ln.split("its command: ", 1)[1] for ln in text.splitlines() if marker in ln), "")
    argv = shlex.split(server.replace('"${PORT:-8000}"', "8000"))
    fields["verify"] = "ddtree" if "--ddtree" in argv else ("chain" if "--draft" in argv else "ar")
    if "--ddtree-budget" in argv:
        fields["budget"] = int(argv[argv.index("--ddtree-budget") + 1])
    if fields["verify"] == "ddtree":
        fields["rollback"] = "fast"
    for arg in shlex.split(daemon):
        key, _, value = arg.partition("=")
        if key == "--ddtree-temp":
            fields["proposal_temp"] = float(value)
        elif key == "--ddtree-no-chain-seed":
            fields["chain_seed"] = 0
        elif key == "--draft-ctx-max":
            fields["target_feat_ctx"] = int(value)
        elif key == "--fast-rollback":
            fields["rollback"] = "fast"
    if fields["verify"] == "ddtree":  # the port's defaults where no flag was written
        fields.setdefault("proposal_temp", 1.0)
        fields.setdefault("chain_seed", None)
    return fields
