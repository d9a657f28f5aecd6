"""A candidate launch for the decode steps' attention, tried without editing the engine:
``--step-attention BLOCK_NxWARPS[xSPAN][mBLOCK_M][fFOLD]`` of ``gpu_bench.py`` and ``exact_bench.py`` replaces
``engine.models.attention.step_attention_launch`` for the whole process (AR and verify alike, so a
candidate keeps exactness and is timed as the engine would run it)."""

from __future__ import annotations

import re
import sys

STEP_ATTENTION_HELP = ("the decode steps' attention launch (key block and warps, keys per span, query rows per "
                       "program, spans a run of the merge's fold: e.g. 32x4, 32x4x64, 32x8m64 or 32x8m64f8) "
                       "instead of step_attention_launch's, for every head_dim: a candidate timed (and its "
                       "exactness checked) before it becomes the engine's")


def override_step_attention(text: str) -> None:
    """Every decode step's attention (AR and verify alike: one launch, so exactness is kept) on the
    launch ``text`` names: ``BLOCK_NxWARPS``, then optionally ``xSPAN`` (keys per span), ``mBLOCK_M``
    (query rows per program) and ``fFOLD`` (spans a run of the merge's fold, which a verify's programs
    fold themselves by ``folds_runs``' rule). Raises ValueError naming the rule and the value."""
    from engine.models import attention

    match = re.fullmatch(r"([0-9]+)x([0-9]+)(?:x([0-9]+))?(?:m([0-9]+))?(?:f([0-9]+))?", text.lower())
    block_n, warps, split, block_m, fold = (int(v) if v else None for v in (match.groups() if match else [0] * 5))
    if (not block_n or block_n < 16 or block_n & (block_n - 1) or warps not in (1, 2, 4, 8)
            or (split is not None and (split < block_n or split % block_n))
            or (block_m is not None and (block_m < 16 or block_m > 128 or block_m & (block_m - 1)))
            or (fold is not None and not 1 <= fold <= 64)):
        raise ValueError(f"--step-attention must be BLOCK_NxWARPS[xSPAN][mBLOCK_M][fFOLD] (BLOCK_N a power of two "
                         f">= 16, then 1, 2, 4 or 8 warps, then keys per span: a multiple of BLOCK_N, then query "
                         f"rows per program: a power of two from 16 to 128, then spans a run: 1 to 64), got {text!r}")
    engine_launch = attention.step_attention_launch

    def launch(d: int, fp32: bool = False) -> dict[str, int]:
        own = engine_launch(d, fp32)
        return {**own, "BLOCK_N": block_n, "num_warps": warps, "SPLIT": split or own["SPLIT"],
                "BLOCK_M": block_m or own["BLOCK_M"], "FOLD": fold or own["FOLD"]}

    attention.step_attention_launch = launch


def apply_step_attention(text: str | None) -> bool:
    """``--step-attention``'s value applied (nothing when None); False, the rule printed, on a bad one."""
    if text is None:
        return True
    try:
        override_step_attention(text)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return False
    return True
