"""A worker's utilisation while it measures one job: NVML's GPU utilisation (and the device memory
in use) on a GPU, the process's CPU time over wall time on a CPU (``Record.utilisation``)."""

from __future__ import annotations

import threading
import time
from typing import Any


class Utilisation:
    """Utilisation of this worker's device while one job runs.

    GPU: NVML utilisation of the worker's GPU (``torch.cuda.utilization``, which maps
    ``CUDA_VISIBLE_DEVICES`` to the NVML index), sampled every 0.2 s, and the device memory in use.
    CPU: this process's CPU time over wall time (100 = one core busy the whole time).
    """

    def __init__(self, device: str) -> None:
        self.device = str(device)
        self.result: dict[str, Any] = {}
        self._samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Utilisation:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        if self.device.startswith("cuda") and nvml_reading(self.device) is not None:
            self._thread = threading.Thread(target=self._sample, name="autotune-nvml", daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while (value := nvml_reading(self.device)) is not None:
            self._samples.append(value)
            if self._stop.wait(0.2):
                return

    def __exit__(self, *exc: object) -> None:
        wall = max(time.perf_counter() - self._wall, 1e-9)
        cpu_percent = round(100.0 * (time.process_time() - self._cpu) / wall, 1)
        if self._thread is None:
            self.result = {"kind": "cpu", "percent": cpu_percent}
            return
        self._stop.set()
        self._thread.join()
        try:
            import torch

            mem: int | None = int(torch.cuda.device_memory_used(self.device))
        except Exception:  # NVML gone meanwhile: the utilisation samples still stand
            mem = None
        percent = round(sum(self._samples) / len(self._samples), 1) if self._samples else None
        self.result = {"kind": "gpu", "percent": percent, "samples": len(self._samples), "memory_used_bytes": mem,
                       "cpu_percent": cpu_percent}


def nvml_reading(device: str) -> int | None:
    """GPU utilisation in percent, or None where NVML (the nvidia-ml-py package or the driver) is missing."""
    try:
        import torch

        return int(torch.cuda.utilization(device))
    except Exception:  # no pynvml, no driver, a poisoned context: report CPU facts only
        return None
