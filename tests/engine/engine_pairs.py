"""Loaded pairs shared by the engine tests: loading once per process keeps the suite fast."""

from functools import cache

import engine


@cache
def pair_for(target: str, draft: str) -> engine.Pair:
    return engine.load(target, draft, device="cpu", dtype="float32")
