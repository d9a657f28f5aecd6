"""Every Triton kernel compiles for Hopper (sm_90) at the presets' shapes within an SM's shared
memory and without register spills (benchmarks/kernel_check.py, in a process of its own: the CPU
suite runs kernels in Triton's interpreter, and one process cannot do both)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[2]
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@pytest.mark.slow
@pytest.mark.skipif(not (TOOLS / "cuobjdump").is_file(), reason="this Triton wheel carries no NVIDIA tools")
def test_every_kernel_compiles_for_hopper_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kernel_check.py")], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "bad: 0" in proc.stdout and "tree delta rule dk=128" in proc.stdout
