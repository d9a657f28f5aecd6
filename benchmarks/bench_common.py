"""What the GPU benchmarks share (``gpu_bench.py`` and its sections' modules): the run's environment
record, timed passes, a set's prompts, the spread of a few timings."""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

import engine
from engine import EngineConfig, EngineInputError
from engine.data.workloads import load_workload


def env_record() -> dict:
    """The GPU (or CPU), torch, the date, the command line and whether the Triton kernels are on."""
    gpu = (torch.cuda.get_device_name() if torch.cuda.is_available()
           else f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)")
    from engine.models import fused

    return {"gpu": gpu, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python " + " ".join(sys.argv), "triton_kernels": fused.kernels_enabled()}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def spread(xs: list[float]) -> str:
    """``median (min..max)`` to one decimal."""
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}..{max(xs):.1f})"


def large_pair(preset: str, weights: str, draft_recipe: str | None = None) -> tuple[str, str | None, str]:
    """A shape preset's (target, draft, weights held) for ``large``, ``profile`` and ``graphs``: with
    ``weights`` a recipe (``q4_k_m``) its registry twin quantized to that mix (``<preset>-q4_k_m``, built in
    its blocks on the GPU: ``engine.registry.quantized_preset``) held native; the draft is the preset's own
    either way (``registry.draft_for``), held in ``draft_recipe``'s blocks where given (``@q8_0``)."""
    from engine.registry import DRAFT_RECIPE_MARK, draft_for

    target = preset if weights == "bf16" else f"{preset}-{weights}"
    draft = draft_for(target)
    if draft is not None and draft_recipe is not None:
        draft += DRAFT_RECIPE_MARK + draft_recipe
    return target, draft, "dequantized" if weights == "bf16" else "native"


def set_prompts(pair, spec: str, n: int) -> list[list[int]]:
    """The first ``n`` eval prompts of a named workload or JSONL file, encoded by ``pair``."""
    wl = load_workload(spec, Path.cwd(), n, 0, split="eval")
    return [pair.encode(p) for p in wl.prompts]


def timed(pair, cfg: EngineConfig, prompts, max_new: int, repeats: int, reference=None, ignore_eos: bool = True,
          ar_config: EngineConfig | None = None) -> list:
    """``repeats`` passes of ``engine.bench`` after an untimed one (``BenchResult``s)."""
    # Warm-up: every prompt at full length, so that every key-span bucket the timed passes reach has
    # its graphs captured (one short prompt left the others' captures in the first timed pass: AR's
    # 363 against 824 tok/s on HumanEval, 2026-12-01 evening).
    engine.bench(pair, cfg, prompts, max_new, ignore_eos=True)
    return [engine.bench(pair, cfg, prompts, max_new, reference=reference, ignore_eos=ignore_eos, ar_config=ar_config)
            for _ in range(repeats)]


def named_config(text: str, flag: str, forbidden: dict[str, str] | None = None) -> tuple[str, dict]:
    """``NAME:KEY=VALUE,...`` (a benchmark's ``flag``: ``--also``, ``--config``) -> (name, EngineConfig
    fields), each value read as YAML (numbers, null); refused at parse time, before any model loads,
    naming the field and the rule. ``forbidden``: fields the command sets itself -> why."""
    name, sep, body = text.partition(":")
    pairs = [item.partition("=") for item in body.split(",")] if body else []
    if not sep or not name or not pairs or any(not k or not eq for k, eq, _ in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:KEY=VALUE[,KEY=VALUE...], e.g. "
                                         "winner:verify=ddtree,budget=30")
    try:
        fields = {k.strip(): yaml.safe_load(v) for k, _, v in pairs}
    except yaml.YAMLError as exc:
        raise argparse.ArgumentTypeError(f"{flag} {name}: a value is not YAML ({str(exc).splitlines()[0]})") from None
    for key, why in (forbidden or {}).items():
        if key in fields:
            raise argparse.ArgumentTypeError(f"{flag} {name}: {why}")
    try:
        EngineConfig.from_dict(fields, source=f"{flag} {name}")
    except EngineInputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name, fields
