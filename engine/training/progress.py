"""What a training run shows while it runs: a progress line on stderr and ``curves.png``."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

UPDATE_S = 1.0  # the bar is redrawn at most this often: it costs nothing next to a step


class ProgressBar:
    """step / total, loss, held-out loss, tokens/s and the ETA: whichever ends the run first, the
    steps left at this call's rate or the call's time budget."""

    def __init__(self, total: int, start: int, time_budget_s: float = 0.0, enabled: bool = True,
                 file: TextIO | None = None) -> None:
        self.total, self.start, self.budget = total, start, time_budget_s
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.tokens = 0
        self.held_out: float | None = None
        self.pending: tuple[int, float] | None = None
        self.bar = tqdm(total=total, initial=start, file=file or sys.stderr, disable=not enabled, dynamic_ncols=True,
                        bar_format="{desc} |{bar}| {n_fmt}/{total_fmt}{postfix}", mininterval=UPDATE_S)

    def update(self, step: int, loss: float, tokens: int) -> None:
        """After step index ``step`` (0-based) trained on ``tokens`` sequence tokens."""
        self.tokens += tokens
        self.pending = (step, loss)
        now = time.perf_counter()
        if now - self.last < UPDATE_S and step + 1 < self.total:
            return
        self.last = now
        self.pending = None
        elapsed = max(now - self.t0, 1e-9)
        done = step + 1 - self.start
        eta = (self.total - step - 1) * elapsed / max(done, 1)
        if self.budget:
            eta = min(eta, max(self.budget - elapsed, 0.0))
        held = "-" if self.held_out is None else f"{self.held_out:.4f}"
        self.bar.set_description_str(f"step {step + 1}", refresh=False)
        self.bar.set_postfix_str(f"loss {loss:.4f} held-out {held} {self.tokens / elapsed:,.0f} tok/s "
                                 f"eta {_hms(eta)}", refresh=False)
        self.bar.update(step + 1 - self.bar.n)

    def close(self) -> None:
        if self.pending is not None:  # the call's last step, drawn however soon after the one before
            self.last = 0.0
            self.update(*self.pending, tokens=0)
        self.bar.close()


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def plot_curves(path: Path, history: Sequence[dict[str, float]], val_history: Sequence[dict[str, Any]],
                title: str = "") -> Path:
    """Training loss (raw and a running mean) and held-out loss over steps; beside them the held-out
    acceptance per block slot (the share of blocks whose drafted prefix reaches the slot) at the
    first and the latest scoring. Written atomically (a temp file, then a rename)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a GPU host or in CI
    import matplotlib.pyplot as plt

    slots = [v for v in val_history if v.get("slot_acc")]
    fig, axes = plt.subplots(1, 2 if slots else 1, figsize=(11 if slots else 6.5, 4), squeeze=False)
    ax = axes[0, 0]
    if history:
        losses = [h["loss"] for h in history]
        steps = range(1, len(losses) + 1)
        # A few thousand points are enough for the eye and keep the plot fast on long runs.
        stride = max(1, len(losses) // 4000)
        ax.plot(list(steps)[::stride], losses[::stride], lw=0.5, alpha=0.35, color="tab:blue")
        window = max(1, min(200, len(losses) // 20))
        acc, smooth = 0.0, []
        for i, v in enumerate(losses):
            acc += v - (losses[i - window] if i >= window else 0.0)
            smooth.append(acc / min(i + 1, window))
        ax.plot(list(steps)[::stride], smooth[::stride], color="tab:blue", label=f"training (mean of {window})")
    if val_history:
        sampled = [v for v in val_history if "loss_sampled" in v]
        ax.plot([v["step"] for v in val_history], [v["loss"] for v in val_history], "o-", color="tab:orange",
                ms=3, label="held-out (greedy answers)" if sampled else "held-out")
        if sampled:  # the sampled answers held out beside them: the draft is kept by the greedy ones
            ax.plot([v["step"] for v in sampled], [v["loss_sampled"] for v in sampled], "o--", color="tab:red",
                    ms=3, label="held-out (sampled answers)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title or "draft training")
    ax.grid(alpha=0.3)
    ax.legend()
    if slots:
        ax = axes[0, 1]
        for v in (slots[0], slots[-1]) if len(slots) > 1 else (slots[0],):
            ax.plot(range(1, len(v["slot_acc"]) + 1), v["slot_acc"], "o-", ms=3, label=f"step {v['step']}")
        ax.set_xlabel("block slot")
        ax.set_ylabel("held-out acceptance")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(path)
    return path
