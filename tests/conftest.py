"""Suite-wide settings.

- Tiny models run fastest (and least disturbed by a busy machine) on one thread.
- Without CUDA, Triton kernels run in Triton's interpreter (NumPy on the CPU), so the CPU suite
  checks the kernels' logic; on a GPU machine they compile for the device. Set before any test
  module imports the engine: ``triton.jit`` reads it when a kernel is defined.
"""

import os

import torch

torch.set_num_threads(1)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
