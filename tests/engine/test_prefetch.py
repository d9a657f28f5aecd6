"""The L2 prefetch experiment: off by default, a no-op outside CUDA graph capture, read-only."""

import os
import subprocess
import sys

import pytest
import torch

from engine.models import prefetch


def test_prefetch_is_off_by_default_and_a_no_op_outside_a_capture():
    assert prefetch._scale == 0.0 or os.environ.get("ENGINE_L2_PREFETCH")
    previous = prefetch.set_scale(1.0)
    try:
        w = torch.randn(64, 256)
        prefetch.ahead(w, 1.0)  # a CPU weight, no capture: nothing forked
        assert not prefetch._forked
        prefetch.join()
    finally:
        prefetch.set_scale(previous)
    with pytest.raises(ValueError, match="prefetch scale must be >= 0, got -1"):
        prefetch.set_scale(-1)


def test_a_bad_environment_value_is_refused_at_first_use_not_at_import():
    code = ("from engine.models import prefetch; import torch\n"
            "try:\n    prefetch.ahead(torch.zeros(2, 2), 1)\nexcept Exception as e:\n    print(type(e).__name__, e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "ENGINE_L2_PREFETCH": "lots"}).stdout
    assert "EngineInputError environment variable ENGINE_L2_PREFETCH must be a number >= 0, got 'lots'" in out


def test_the_prefetch_kernel_only_reads():
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or Triton's interpreter")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w = torch.randn(40, 128, device=device).to(torch.bfloat16)
    before = w.clone()
    sink = torch.full((1,), 7.0, device=device)
    prefetch._prefetch_kernel[(10,)](w, sink, 40, w.stride(0), COLS=64, ROWS=4)
    assert torch.equal(w, before) and sink.item() == 7.0
