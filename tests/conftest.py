"""Suite-wide settings: tiny models run fastest (and least disturbed by a busy machine) on one thread."""

import torch

torch.set_num_threads(1)
