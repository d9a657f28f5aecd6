"""The server's counters and gauges, rendered as Prometheus text for ``GET /metrics``."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any


@dataclass
class Outcome:
    text: str
    finish_reason: str  # stop | length
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (usage.prompt_tokens_details)


class Metrics:
    """Counters and gauges for /metrics, updated from the engine thread and the event loop."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.prompt_tokens = self.completion_tokens = 0
        self.steps = self.step_tokens = 0  # speculative steps and the tokens they accepted (AL = ratio)
        self.decode_s = 0.0
        self.decode_tokens = 0
        self.last_decode_tps = 0.0
        self.last_al = 0.0
        self.prefill_s = 0.0
        self.last_prefill_s = 0.0

    def count_request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1

    def record(self, outcome: Outcome, stats: Any | None) -> None:
        with self.lock:
            self.prompt_tokens += outcome.prompt_tokens
            self.completion_tokens += outcome.completion_tokens
            if stats is not None:  # a generation cut short by a stop string or a disconnect has none
                self.steps += len(stats.accept_lengths)
                self.step_tokens += sum(stats.accept_lengths)
                self.decode_s += stats.decode_s
                self.decode_tokens += max(stats.new_tokens - 1, 0)
                self.last_decode_tps = stats.decode_tps
                self.last_al = stats.acceptance_length
                self.prefill_s += stats.prefill_s
                self.last_prefill_s = stats.prefill_s

    def render(self, queue_depth: int, running: int, capacity: int, prefix_cache: dict[str, float] | None) -> str:
        """``prefix_cache``: ``PrefixCache.stats()`` (None: no cache, its rows read 0)."""
        pc = prefix_cache or {}
        with self.lock:
            rows = [
                ("requests_total", "counter", "HTTP requests by endpoint and status code.",
                 [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())]),
                ("prompt_tokens_total", "counter", "Prompt tokens of served generations.", [("", self.prompt_tokens)]),
                ("completion_tokens_total", "counter", "Generated tokens.", [("", self.completion_tokens)]),
                ("speculative_steps_total", "counter", "Speculative decode steps (verify passes).", [("", self.steps)]),
                ("accepted_tokens_total", "counter", "Tokens committed by speculative steps.",
                 [("", self.step_tokens)]),
                ("acceptance_length", "gauge", "Mean tokens committed per speculative step since start.",
                 [("", self.step_tokens / self.steps if self.steps else 0.0)]),
                ("acceptance_length_last", "gauge", "Acceptance length of the last finished generation.",
                 [("", self.last_al)]),
                ("decode_seconds_total", "counter", "Decode time (first to last token) of finished generations.",
                 [("", self.decode_s)]),
                ("decode_tokens_per_second", "gauge", "Decode tokens/s over all finished generations.",
                 [("", self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0)]),
                ("decode_tokens_per_second_last", "gauge", "Decode tokens/s of the last finished generation.",
                 [("", self.last_decode_tps)]),
                ("prefill_seconds_total", "counter", "Prefill time (start to first token, the prefix cache's "
                 "restore included) of finished generations.", [("", self.prefill_s)]),
                ("prefill_seconds_last", "gauge", "Prefill time of the last finished generation.",
                 [("", self.last_prefill_s)]),
                ("prefix_cache_hits_total", "counter", "Generations whose prompt reused cached positions.",
                 [("", int(pc.get("hits", 0)))]),
                ("prefix_cache_misses_total", "counter", "Generations whose prompt reused nothing.",
                 [("", int(pc.get("misses", 0)))]),
                ("prefix_cache_hit_rate", "gauge", "Hits / (hits + misses) since start.",
                 [("", float(pc.get("hit_rate", 0.0)))]),
                ("prompt_tokens_cached_total", "counter", "Prompt tokens reused from the prefix cache, not prefilled "
                 "(usage.prompt_tokens_details.cached_tokens).", [("", int(pc.get("cached_tokens", 0)))]),
                ("prefix_cache_token_hit_rate", "gauge", "Cached / all prompt tokens of generations since start.",
                 [("", float(pc.get("token_hit_rate", 0.0)))]),
                ("prefix_cache_evictions_total", "counter", "Cached nodes and state checkpoints evicted (LRU).",
                 [("", int(pc.get("evictions", 0)))]),
                ("prefix_cache_bytes", "gauge", "Bytes the prefix cache holds on the device.",
                 [("", int(pc.get("bytes", 0)))]),
                ("prefix_cache_capacity_bytes", "gauge", "The prefix cache's budget (0: off).",
                 [("", int(pc.get("capacity_bytes", 0)))]),
                ("queue_depth", "gauge", "Requests waiting for the engine.", [("", queue_depth)]),
                ("running", "gauge", "Generations running now (0 or 1).", [("", running)]),
                ("queue_capacity", "gauge", "Waiting requests accepted before 503.", [("", capacity)]),
            ]
        out = []
        for name, kind, help_text, samples in rows:
            out += [f"# HELP autotune_{name} {help_text}", f"# TYPE autotune_{name} {kind}"]
            out += [f"autotune_{name}{labels} {_num(v)}" for labels, v in samples]
        return "\n".join(out) + "\n"


def _num(v: float) -> str:
    return str(v) if isinstance(v, int) else repr(float(v))
