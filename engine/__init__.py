"""DFlash + DDTree speculative decoding engine: exact, switchable paths, per-phase timing."""

from engine.api import Pair, bench, load
from engine.config import EngineConfig, EngineInputError
from engine.decode import generate
from engine.grammar import CompiledGrammar
from engine.registry import check_model_spec
from engine.stats import BenchResult, Generation, GenerationStats, PromptResult

__all__ = [
    "BenchResult",
    "CompiledGrammar",
    "EngineConfig",
    "EngineInputError",
    "Generation",
    "GenerationStats",
    "Pair",
    "PromptResult",
    "bench",
    "check_model_spec",
    "generate",
    "load",
]
