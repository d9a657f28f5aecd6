"""DFlash + DDTree speculative decoding engine: exact, switchable paths, per-phase timing.

The front door: what ``autotune`` (and any other caller) uses; nothing deeper is a contract.
``serve`` (the OpenAI-compatible server) loads its web stack on first use. ``PrefixCache``: earlier
prompts' and answers' positions kept for ``generate(..., prefix_cache=...)`` (the server's). ``WEIGHTS``: how
``load`` may hold a target's weights (``dequantized``, ``native``). The device memory of a pair
decoding a config, per part, planned or measured: ``engine.memory`` (``plan_memory`` and the rest)."""

from engine.api import Pair, bench, diagnose, draft_in_blocks, load, replay_sessions
from engine.config import EngineConfig, EngineInputError
from engine.data.prompts import Prompt
from engine.data.sessions import SESSION_SETS, load_sessions
from engine.data.sessions import request_prompt as session_request
from engine.data.sessions import turns as session_turns
from engine.data.workloads import Workload, load_workload
from engine.decoding.decode import generate
from engine.decoding.grammar import CompiledGrammar
from engine.decoding.prefix_cache import DEFAULT_PREFIX_CACHE_MB, PrefixCache
from engine.decoding.stats import (
    VERDICTS,
    BenchResult,
    Divergence,
    Generation,
    GenerationStats,
    PromptResult,
    SessionReplay,
    first_divergence,
    policy_summary,
)
from engine.files import MAX_WORKLOAD_BYTES, FileRefused, parse_json, preview, read_text, read_yaml
from engine.memory import (
    MEMORY_PARTS,
    MemoryBreakdown,
    held_memory,
    largest_budget,
    longest_context,
    measure_memory,
    plan_memory,
    release_memory,
    reserve_memory,
)
from engine.models.fused import check_environment, environment_errors
from engine.models.quant import WEIGHTS
from engine.models.quantize import RECIPES as DRAFT_RECIPES
from engine.registry import check_model_spec

__all__ = [
    "DEFAULT_PREFIX_CACHE_MB",
    "DRAFT_RECIPES",
    "MEMORY_PARTS",
    "VERDICTS",
    "WEIGHTS",
    "BenchResult",
    "CompiledGrammar",
    "Divergence",
    "EngineConfig",
    "EngineInputError",
    "FileRefused",
    "MAX_WORKLOAD_BYTES",
    "Generation",
    "GenerationStats",
    "MemoryBreakdown",
    "Pair",
    "PrefixCache",
    "Prompt",
    "PromptResult",
    "SESSION_SETS",
    "SessionReplay",
    "Workload",
    "bench",
    "check_environment",
    "check_model_spec",
    "diagnose",
    "draft_in_blocks",
    "environment_errors",
    "first_divergence",
    "generate",
    "held_memory",
    "largest_budget",
    "load",
    "load_sessions",
    "load_workload",
    "longest_context",
    "measure_memory",
    "parse_json",
    "plan_memory",
    "policy_summary",
    "preview",
    "read_text",
    "read_yaml",
    "replay_sessions",
    "release_memory",
    "reserve_memory",
    "serve",
    "session_request",
    "session_turns",
]


def __getattr__(name: str) -> object:
    if name == "serve":  # the web stack (FastAPI, uvicorn) only for a server
        from engine.serving.server import serve

        return serve
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
