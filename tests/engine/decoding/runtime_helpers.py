"""Helpers shared by the runtime's CPU tests (test_runtime.py, test_runtime_policy.py)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class NoHostRead(TorchDispatchMode):
    """Raises on an op that reads a device value back to the host (a count, a scalar) or makes a
    shape from one: under CUDA graph capture such an op invalidates the capture
    (cudaErrorStreamCaptureInvalidated; the flagship sweep's runtime + eager trials, 2026-12-04)."""

    READS = {"nonzero", "_local_scalar_dense", "masked_select", "unique", "_unique2", "unique_consecutive",
             "unique_dim", "bincount", "repeat_interleave", "nonzero_static_fallback"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        # repeat_interleave reads its repeats' sum only when they are a tensor and no output_size is given
        sums = name != "repeat_interleave" or (func._overloadname != "self_int"
                                               and not (kwargs or {}).get("output_size"))
        # indexing by a boolean mask counts its True entries first (x[mask], x[mask] = v)
        masked = name in ("index", "index_put", "index_put_", "_index_put_impl_") and any(
            i is not None and i.dtype == torch.bool for i in args[1])
        if (name in self.READS and sums) or masked:
            raise AssertionError(f"{func} reads a device value on the host inside a captured step")
        return func(*args, **(kwargs or {}))


def peeking_draft(pair, prompt_len: int, truth: list[int], side_every: int = 3):
    """A propose_static that runs the draft's real forward (the runtime's shapes and buffers), then
    replaces its logits: the token of ``truth`` first, except at every ``side_every``-th position,
    where a decoy is first and the true token second (so accepted paths take side branches)."""
    real = pair.drafter.propose_static
    truth_t = torch.tensor(truth, dtype=torch.long)

    def propose(seq, start, block_size, window, features, *context):
        logits = real(seq, start, block_size, window, features, *context)
        pos = start - prompt_len + torch.arange(1, block_size)
        true_tok = truth_t[pos.clamp(0, truth_t.numel() - 1)]
        side = pos % side_every == 0
        fake = torch.zeros_like(logits)
        fake.scatter_(1, ((true_tok + 1) % logits.shape[1])[:, None], torch.where(side, 10.0, 0.0)[:, None])
        return fake.scatter(1, true_tok[:, None], torch.where(side, 9.0, 10.0)[:, None])

    return real, propose
