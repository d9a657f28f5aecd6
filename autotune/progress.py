"""The sweep's progress bar (stderr): configs measured out of ``n_trials``, what runs now and where
inside it (the pass and the prompt: :meth:`Progress.tick`), the best so far under the one
definition every command uses (``results.winner``), and an elapsed time that
moves while a long trial runs. Off (``--no-progress``): nothing is drawn and nothing is computed."""

from __future__ import annotations

import sys
import threading

import optuna
from tqdm import tqdm

from autotune import results
from autotune import study as st


class Progress:
    def __init__(self, name: str, total: int, done: int, enabled: bool) -> None:
        self.name, self.total = name, total
        # configs measured out of n_trials (baselines are the yardstick, not counted)
        self.bar = tqdm(total=total, initial=min(done, total), desc=name, unit="config", file=sys.stderr,
                        dynamic_ncols=True) if enabled else None
        self._refresher = _Refresher(self.bar) if self.bar is not None else None
        self._what = name  # the phase; tick() adds where inside it the running job is

    def phase(self, role: str, number: int, study: optuna.Study, stage: str | None = None) -> None:
        """What is measured now: the AR baseline, the reference config, or config i of ``total``
        (the budget's count: finished and running configs), with its trial number and, with a fidelity
        ladder, its ``stage`` (``autotune.fidelity.stage``)."""
        if self.bar is None:
            return
        if role in ("baseline", "reference"):
            what = "AR baseline" if role == "baseline" else "reference DDTree"
        else:
            what = f"config {min(sum(st.budget_state(study)), self.total)}/{self.total}"
        self._what = f"{self.name}: {what} (trial {number}{', ' + stage if stage else ''})"
        self.bar.set_description(self._what)

    def confirming(self, n: int) -> None:
        if self.bar is not None:
            self._what = f"{self.name}: confirming the best {n} configs"
            self.bar.set_description(self._what)

    def tick(self, where: str) -> None:
        """Where the running job is (``Worker.measure``'s progress callback), e.g. "pass 2/3:
        humaneval 4/12"; drawn between generations, outside their timed decode."""
        if self.bar is not None:
            self.bar.set_description(f"{self._what} · {where}")

    def update(self, study: optuna.Study, advance: int = 0) -> None:
        """The best so far by its conservative value (the study's objective: median - spread), the
        median beside it; then ``advance`` configs."""
        if self.bar is None:
            return
        w = results.winner(study)
        if w is not None:
            sp = "n/a" if w.speedup_vs_ar is None else f"{w.speedup_vs_ar:.2f}x"
            self.bar.set_postfix_str(f"best #{w.trial}: value {w.value:.1f} (median {w.median_tps:.1f}) tok/s, "
                                     f"{sp} vs AR")
        if advance:
            self.bar.update(advance)

    def close(self) -> None:
        if self._refresher is not None:
            self._refresher.stop()
        if self.bar is not None:
            self.bar.close()


class _Refresher:
    """Redraws a progress bar every second from a thread of its own, so that its elapsed time and
    rate move while the loop waits on one long trial (tqdm redraws only when told)."""

    def __init__(self, bar: tqdm, every_s: float = 1.0) -> None:
        self._bar, self._stop = bar, threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True, name="autotune-progress")
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self._bar.refresh()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
