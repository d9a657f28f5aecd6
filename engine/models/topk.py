"""Top-k of a row's log-softmax and greedy argmax in two launches: the draft's proposals and
every greedy token choice.

``log_softmax`` + ``topk`` over a 49k vocabulary take about twenty launches on CUDA, and
``torch.argmax`` reduces a row in one block (~13 us on an H200). Here each program of the first
launch takes the top k, the max and the sum of exponentials of a 2,048-entry slice of a row, and
the second merges a row's slices. Exact ties go to the lower index. Off CUDA, or with the kernels
off, the PyTorch forms run (the reference the kernels are tested against).
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.models import fused

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - installs without Triton use the PyTorch forms
    triton = None

TOPK_CHUNK = 2048  # vocabulary entries per program of the first pass


def topk_rows_torch(logits: Tensor, k: int, temperature: float = 1.0, log_probs: bool = True
                    ) -> tuple[Tensor, Tensor]:
    x = logits.float() / temperature
    return torch.topk(torch.log_softmax(x, dim=-1) if log_probs else x, k, dim=-1)


def topk_rows(logits: Tensor, k: int, temperature: float = 1.0, log_probs: bool = True) -> tuple[Tensor, Tensor]:
    """Per row of ``logits`` [R, V]: the ``k`` largest of ``logits / temperature`` in float32,
    sorted descending, as log-softmax values (``log_probs``) or as they are, and their indices
    (long); exact ties go to the lower index. Two launches on CUDA (the module's docstring)."""
    r, v = logits.shape
    if not (1 <= k <= min(16, v) and logits.stride(-1) == 1 and fused.use_kernels(logits)):
        return topk_rows_torch(logits, k, temperature, log_probs)
    kp = max(2, triton.next_power_of_2(k))
    chunks = triton.cdiv(v, TOPK_CHUNK)
    vals = torch.empty(r, chunks, kp, device=logits.device, dtype=torch.float32)
    idx = torch.empty(r, chunks, kp, device=logits.device, dtype=torch.int32)
    mx = torch.empty(r, chunks, device=logits.device, dtype=torch.float32)
    se = torch.empty_like(mx)
    _topk_chunk_kernel[(r, chunks)](logits, v, logits.stride(0), float(temperature), vals, idx, mx, se, chunks,
                                    K=k, KP=kp, BLOCK=TOPK_CHUNK, LSE=log_probs, num_warps=4)
    top_v = torch.empty(r, k, device=logits.device, dtype=torch.float32)
    top_i = torch.empty(r, k, device=logits.device, dtype=torch.long)
    _topk_merge_kernel[(r,)](vals, idx, mx, se, top_v, top_i, chunks, K=k, KP=kp,
                             CAND=triton.next_power_of_2(chunks * kp), CH=max(2, triton.next_power_of_2(chunks)),
                             LSE=log_probs, num_warps=4)
    return top_v, top_i


def argmax_rows(logits: Tensor) -> Tensor:
    """``torch.argmax(logits, dim=-1)`` for [R, V] (the first index of the maximum), in two launches
    on CUDA: the reduction over a 49k vocabulary in one block per row takes ~13 us on an H200.
    (A row of NaNs, which torch answers with a NaN's index, has no maximum here.)"""
    if logits.dim() != 2 or logits.stride(-1) != 1 or not fused.use_kernels(logits):
        return torch.argmax(logits, dim=-1)
    return topk_rows(logits, 1, log_probs=False)[1][:, 0]


if triton is not None:

    @triton.jit
    def _take_top(x, offs, avail, kk, K: tl.constexpr, KP: tl.constexpr):
        # K rounds of (largest available value, its lowest index): sorted, ties to the lower index
        big = 2147483647
        vals = tl.full([KP], float("-inf"), tl.float32)
        ids = tl.full([KP], big, tl.int32)
        for j in tl.static_range(K):
            m = tl.max(tl.where(avail, x, float("-inf")), axis=0)
            i = tl.min(tl.where(avail & (x == m), offs, big), axis=0)
            vals = tl.where(kk == j, m, vals)
            ids = tl.where(kk == j, i, ids)
            avail = avail & (offs != i)
        return vals, ids

    @triton.jit(do_not_specialize=["V", "stride", "NCHUNK"])
    def _topk_chunk_kernel(x_ptr, V, stride, temp, val_ptr, idx_ptr, m_ptr, s_ptr, NCHUNK, K: tl.constexpr,
                           KP: tl.constexpr, BLOCK: tl.constexpr, LSE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        valid = offs < V
        x = tl.load(x_ptr + row * stride + offs, mask=valid, other=float("-inf")).to(tl.float32) / temp
        out = row * NCHUNK + c
        if LSE:  # this slice's max and sum of exponentials (an all -inf slice: -inf and 0)
            m = tl.max(x, axis=0)
            ms = tl.where(m == float("-inf"), 0.0, m)
            tl.store(m_ptr + out, m)
            tl.store(s_ptr + out, tl.sum(tl.exp(x - ms), axis=0))
        kk = tl.arange(0, KP)
        vals, ids = _take_top(x, offs, valid, kk, K, KP)
        tl.store(val_ptr + out * KP + kk, vals)
        tl.store(idx_ptr + out * KP + kk, ids)

    @triton.jit(do_not_specialize=["NCHUNK"])
    def _topk_merge_kernel(val_ptr, idx_ptr, m_ptr, s_ptr, top_v_ptr, top_i_ptr, NCHUNK, K: tl.constexpr,
                           KP: tl.constexpr, CAND: tl.constexpr, CH: tl.constexpr, LSE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, CAND)
        ve = (e < NCHUNK * KP) & ((e % KP) < K)
        x = tl.load(val_ptr + row * NCHUNK * KP + e, mask=ve, other=float("-inf"))
        ids = tl.load(idx_ptr + row * NCHUNK * KP + e, mask=ve, other=2147483647)
        # the vocabulary index orders ties (slices hold disjoint indices); an unfilled slot is never taken
        kk = tl.arange(0, KP)
        vals, top = _take_top(x, ids, ve & (ids < 2147483647), kk, K, KP)
        if LSE:
            c = tl.arange(0, CH)
            vc = c < NCHUNK
            m = tl.load(m_ptr + row * NCHUNK + c, mask=vc, other=float("-inf"))
            sm = tl.load(s_ptr + row * NCHUNK + c, mask=vc, other=0.0)
            mm = tl.max(m, axis=0)
            mms = tl.where(mm == float("-inf"), 0.0, mm)
            lse = mms + tl.log(tl.sum(sm * tl.exp(m - mms), axis=0))
            vals = vals - lse
        tl.store(top_v_ptr + row * K + kk, vals, mask=kk < K)
        tl.store(top_i_ptr + row * K + kk, top.to(tl.int64), mask=kk < K)
