"""DFlash + DDTree speculative decoding engine: exact, switchable paths, per-phase timing."""

from engine.api import Pair, bench, diagnose, load
from engine.config import EngineConfig, EngineInputError
from engine.decode import generate
from engine.grammar import CompiledGrammar
from engine.registry import check_model_spec
from engine.stats import BenchResult, Divergence, Generation, GenerationStats, PromptResult

__all__ = [
    "BenchResult",
    "CompiledGrammar",
    "Divergence",
    "EngineConfig",
    "EngineInputError",
    "Generation",
    "GenerationStats",
    "Pair",
    "PromptResult",
    "bench",
    "check_model_spec",
    "diagnose",
    "generate",
    "load",
]
