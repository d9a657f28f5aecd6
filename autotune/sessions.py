"""A session job's figures (``objective: session_tps``, docs/measurement.md "Sessions"), as pure
functions of ``engine.bench`` results over a session set's turns, in order; ``session_of`` gives each
turn's session (``engine.SessionReplay.session_of``). The worker measures, these count."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def cache_bytes(mb: float) -> int:
    """A prefix cache budget of ``mb`` MiB in bytes (``PrefixCache.budget_bytes``; 0: no cache)."""
    return int(mb * 2**20) if mb > 0 else 0


def prefix_cache(mb: float) -> Any:
    """A fresh prefix cache of ``mb`` MiB (None for 0: every turn prefilled whole)."""
    import engine

    return engine.PrefixCache(cache_bytes(mb)) if mb > 0 else None


def later_turns(session_of: Sequence[int]) -> list[bool]:
    """Per turn: whether it is a later turn of its session (not the first)."""
    return [i > 0 and session_of[i - 1] == s for i, s in enumerate(session_of)]


def pass_session_tps(results: Sequence[Any]) -> float:
    """Session tok/s of one pass: every turn's new tokens / every turn's time (prefill, decode and the
    prefix cache's commit after it: ``PromptResult.total_s``): the sessions' completion tokens over
    their wall time in the engine."""
    seconds = sum(p.total_s for r in results for p in r.prompts)
    return sum(p.new_tokens for r in results for p in r.prompts) / seconds if seconds > 0 else 0.0


def per_session_tps(result: Any, session_of: Sequence[int]) -> list[float]:
    """Each session's tok/s in one set's pass, in session order."""
    tokens: dict[int, int] = {}
    seconds: dict[int, float] = {}
    for p, s in zip(result.prompts, session_of, strict=True):
        tokens[s] = tokens.get(s, 0) + p.new_tokens
        seconds[s] = seconds.get(s, 0.0) + p.total_s
    return [tokens[s] / seconds[s] if seconds[s] > 0 else 0.0 for s in sorted(tokens)]


def ttft_ms(results: Sequence[Any], ofs: Sequence[Sequence[int]]) -> tuple[float | None, float | None]:
    """Time to first token (ms) of first and of later turns, the median over every result's turns
    (``ofs``: each result's ``session_of``); None where there is no such turn."""
    first, later = [], []
    for r, of in zip(results, ofs, strict=True):
        for p, lt in zip(r.prompts, later_turns(of), strict=True):
            (later if lt else first).append(1000.0 * p.ttft_s)
    return (statistics.median(first) if first else None, statistics.median(later) if later else None)


def cached_share(results: Sequence[Any], ofs: Sequence[Sequence[int]]) -> float | None:
    """The later turns' share of prompt tokens the prefix cache gave, over ``results`` (one pass: a
    result per set); None without a later turn."""
    later = [p for r, of in zip(results, ofs, strict=True)
             for p, lt in zip(r.prompts, later_turns(of), strict=True) if lt]
    prompt = sum(p.prompt_tokens for p in later)
    return sum(p.cached_tokens for p in later) / prompt if prompt else None


def set_figures(passes: Sequence[Any], session_of: Sequence[int]) -> dict[str, Any]:
    """One set's figures over its passes (a result each): session tok/s (median over passes), TTFT of
    first and later turns, the cached share (first pass), its sessions and turns."""
    first, later = ttft_ms(passes, [session_of] * len(passes))
    return {"session_tps_median": statistics.median(pass_session_tps([r]) for r in passes),
            "ttft_first_ms": first, "ttft_later_ms": later,
            "cached_share_later": cached_share(passes[:1], [session_of]),
            "sessions": len(set(session_of)), "turns": len(session_of)}
