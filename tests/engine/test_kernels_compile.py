"""Every Triton kernel compiles for Hopper (sm_90) at the presets' shapes within an SM's shared
memory and without register spills (benchmarks/kernel_check.py, in a process of its own: the CPU
suite runs kernels in Triton's interpreter, and one process cannot do both). Three shards, so that
the workers compile side by side; together they check every kernel once."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[2]
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SHARDS = 3


@pytest.mark.slow
@pytest.mark.skipif(not (TOOLS / "cuobjdump").is_file(), reason="this Triton wheel carries no NVIDIA tools")
@pytest.mark.parametrize("shard", range(1, SHARDS + 1))
def test_every_kernel_compiles_for_hopper_without_spills(shard):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kernel_check.py"), "--shard",
                           f"{shard}/{SHARDS}"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = re.search(r"^kernels: (\d+) of (\d+) \(shard (\d+)/(\d+)\)  bad: 0$", proc.stdout, flags=re.M)
    assert m, proc.stdout[-3000:]
    checked, total = int(m.group(1)), int(m.group(2))
    assert total > 200 and checked == len(range(shard - 1, total, SHARDS))  # this shard's share of all of them
    assert ("tree delta rule dk=128" in proc.stdout) == (shard == 2)  # the 27B shape's, second in the list


@pytest.mark.slow
@pytest.mark.skipif(not (TOOLS / "cuobjdump").is_file(), reason="this Triton wheel carries no NVIDIA tools")
def test_the_quantized_step_loops_wait_on_no_global_load():
    """The 27B Q4_K_M step's block-kernel launches (benchmarks/kernel_sass.py: Q4_K and Q6_K, 1 row, sm_90)
    take the word decode and read every byte of their K loop through asynchronous copies the pipeline
    overlaps, Q4_K's nibbles 16 bytes a copy: the structure the word decode's 2.6x rests on (H100,
    2026-12-05; the half-word decode waited on 10 and 36 loads an iteration). A rewrite that loses the
    loads' contiguity (byte addresses for Q4_K made 4-byte copies and 14.5 instructions a value) fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kernel_sass.py")], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.startswith(("| Q4_K", "| Q6_K"))]
    assert len(rows) == 7 and all(" words " in r[1] for r in rows), proc.stdout
    for r in rows:
        loads = dict(item.rsplit(" ", 1) for item in r[7].strip().split(", "))
        assert set(loads) <= {"LDGSTS.E", "LDGSTS.E.BYPASS.128", "LDGDEPBAR"}, r  # no LDG: nothing waited on
        if "Q4_K" in r[1]:
            assert int(loads.get("LDGSTS.E.BYPASS.128", 0)) >= 3, r
