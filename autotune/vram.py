"""The VRAM budget, ``model: {vram_limit: 24GiB}``: sizes as people write them, and a trial's device
memory against the limit (its constraint ``vram`` and the reason it is over). The report's memory
section is ``autotune.report``'s; ``autotune plan`` is ``autotune.plan``.

A trial's memory is ``engine.memory``'s breakdown per part at the workload's longest prompt plus
``max_new_tokens`` (:func:`memory_at`; a session workload's prefix cache is part ``prefix_cache``):
planned before the trial is measured (a config whose plan is over the limit is never measured: the
cheap refusal), measured on CUDA after its passes (the plan stands on other devices, marked
``planned``). Over the limit is infeasible, as an inexact output is:
never the winner, and the sampler learns the region.
"""

from __future__ import annotations

import math
import re
from typing import Any

from autotune.errors import InputError

# Units as people write them: decimal (GB) and binary (GiB) prefixes, a bare number is bytes.
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
MAX_LIMIT = 2**50  # 1 PiB: past any device; a typo (24e30) is refused rather than never binding
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
SIZE_RULE = "must be a size like 24GiB, 22.5GB, 8000MiB or a whole number of bytes, above 0 and at most 1 PiB"


def parse_size(value: Any, where: str, key: str | None) -> int:
    """``24GiB``, ``22.5GB``, ``8000MiB``, ``1.5 TiB`` or a byte count (an integer, or digits) -> bytes;
    anything else is an :class:`InputError` naming ``where``, ``key``, the rule and the value."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InputError(where, key, SIZE_RULE, value)
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else ""
        if match is None or (unit and unit not in UNITS):
            raise InputError(where, key, f"{SIZE_RULE} (units: {', '.join(sorted(UNITS, key=UNITS.get))})", value)
        number = float(match.group(1))
        size = math.floor(number * UNITS[unit or "b"])
        if not unit and number != size:
            raise InputError(where, key, f"{SIZE_RULE} (a number without a unit is bytes: a whole number)", value)
    if not 0 < size <= MAX_LIMIT:
        raise InputError(where, key, SIZE_RULE, value)
    return size


def size(n: int | float) -> str:
    """Bytes for people: ``21.30 GiB``, ``270.5 MiB``, ``12.0 KiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def memory_at(longest_prompt: int | None, max_new_tokens: int, session_turns: int = 0,
              context: int | None = None) -> tuple[int, int] | None:
    """Where a trial's memory is planned and reserved: (the workload's longest prompt in tokens,
    ``max_new_tokens``), the context the sweep checks against the target's (``sweep._check_fits``);
    None when the workers did not say their longest prompt. For sessions (``session_turns``: the most
    model turns a session has) the longest prompt is a whole script, whose earlier answers the replies
    replace: each may be ``max_new_tokens`` long, so the last turn's request is planned that much longer,
    but never past the target's ``context`` (a turn that would outgrow it ends its session instead:
    ``engine.replay_sessions``)."""
    if not longest_prompt:
        return None
    prompt = int(longest_prompt) + max(int(session_turns) - 1, 0) * int(max_new_tokens)
    if session_turns and context:
        prompt = max(min(prompt, int(context) - int(max_new_tokens)), 1)
    return prompt, int(max_new_tokens)


def over_reason(memory: dict[str, Any], limit: int | None) -> str | None:
    """Why ``memory`` (a breakdown's ``to_dict``) is over ``limit``, by how much and which part
    dominates; None when it fits or there is no limit."""
    if limit is None or memory["total"] <= limit:
        return None
    part = memory["dominant"]
    how = "planned" if memory["kind"] == "planned" else "measured"
    return (f"{how} peak {size(memory['total'])} is {size(memory['total'] - limit)} over model.vram_limit "
            f"{size(limit)}; {part} dominates ({size(memory['parts'][part])})")


def record(trial: Any, memory: dict[str, Any], limit: int | None) -> str | None:
    """``memory`` on ``trial`` as user attributes (``memory``: the breakdown; ``peak_memory_bytes`` and
    ``peak_memory_kind``: its total, measured or planned) and, under a limit, its constraint ``vram``
    (the fraction over the limit: feasible at or below 0) and ``vram_limit_bytes``; returns why it is
    over the limit (also the attribute ``over_vram``), or None."""
    if not memory:
        return None
    trial.set_user_attr("memory", memory)
    trial.set_user_attr("peak_memory_bytes", memory["total"])
    trial.set_user_attr("peak_memory_kind", memory["kind"])
    if limit is None:
        return None
    trial.set_user_attr("vram_limit_bytes", limit)
    trial.set_constraint("vram", (memory["total"] - limit) / limit)
    reason = over_reason(memory, limit)
    if reason is not None:
        trial.set_user_attr("over_vram", reason)
    return reason
