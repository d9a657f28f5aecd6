"""Attention for a few query rows (decode steps, tree verifies, draft blocks) in two launches,
SDPA for the rest.

A decode step or a verify has a handful of query rows against hundreds or thousands of keys: one
program per K/V head would leave the GPU idle, so the keys are split into spans of ``SPLIT_KEYS``
at fixed positions, each program one span of one K/V head for all the query heads sharing it, and
a second launch merges the spans' partial softmaxes in order (and applies Qwen3.5's output gate).
The spans sit where they sit whatever the key span, and a span with no visible key adds exactly
zero: an AR step and a verify over more (masked) slots round alike. The dispatch follows
``engine.models.fused`` (its kernel switch and PyTorch forms).

Decode steps (an AR step, a chain or tree verify, a replay) take ``step_attention``: the new tokens'
keys are found by logical position, not by slot. A tree node at depth d attends the committed prefix,
then its ancestors by depth, then itself, each key at the position it will hold once committed, in
the same spans and key blocks as an AR step at position start + d, so the node's result has the AR
step's bits (the ancestors sit at other slots of the verify: they are gathered into place per
token). The mask form (``attention``) serves prefills, draft blocks and training. The Triton kernels are in
``attention_kernels``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.models import fused

try:
    import triton
except ImportError:  # pragma: no cover - installs without Triton use the PyTorch forms
    triton = None
if triton is not None:  # the kernels (attention_kernels)
    from engine.models.attention_kernels import (
        _attention_merge_kernel,
        _small_attention_kernel,
        _step_attention_kernel,
    )

# Decode steps, tree verifies (any budget the search spaces reach) and draft blocks take the
# kernel; a longer prefill takes SDPA. Both the AR step and the verify must take the same one.
SMALL_QUERIES = 256
# Keys per span of the split decode attention: a multiple of every key block (attention_launch).
SPLIT_KEYS = 128
# Query rows per program (the launches' BLOCK_M): part of the arithmetic, the same for an AR step (a few
# rows) and a verify (many) of a head_dim (a different BLOCK_M may select other matrix instructions and
# round otherwise).
ATTN_BLOCK_M = 16
# Spans a decode step's partial softmaxes are folded in runs of (``_attention_merge_kernel``): a run of
# FOLD spans is folded alone, then the runs in order, in every step, so a verify's programs may fold
# the runs of committed spans themselves (``step_attention``: each row then writes one partial a run,
# not FOLD) with the bits the merge gives an AR step. Part of the arithmetic: the same for every
# launch of a head_dim.
FOLD_SPANS = 4
# A verify's programs fold their runs while they number at least this many times the SMs, counted
# over half the key span (``folds_runs``; a choice of speed, not of bits; 0: always where a run is
# whole, inf: never; the GPU tests pin both ways). On an H100 (2026-12-07, `kernel_bench.py
# attention`, us a call, the same bits folded or not, no dead spans) the 27B shape's budget-32 verify
# took 87.7 -> 83.5 folded at 4,129 keys (468 programs) and 615.2 -> 549.5 at 32,801 (3,380), but
# 29.5 -> 43.3 at 1,057 (104), as the 8B's (144: 26.0 -> 35.5) and SmolLM2's budget 48 at 512 keys
# (60, folded always: 9.2 -> 13.9). The gain is 5-11%, the loss up to 47%: folded only where even
# the fewest live keys a captured bucket holds give twice the SMs' programs.
FOLD_FROM_SMS = 2.0
# The gate's exp through libdevice (PyTorch's expf: _attention_merge_kernel), except in Triton's
# interpreter (the CPU tests), which has none; read as triton.jit reads it, when the module loads.
_LIBDEVICE = triton is not None and not triton.knobs.runtime.interpret
# Triton's interpreter runs tl.dot as NumPy's matmul, whose rounding depends on the operands' shapes
# and a row's place in them: there the step kernel's products are explicit sums (over head dims, then
# over keys in order), so the CPU tests check that a row's bits do not depend on its launch.
_INTERPRET = triton is not None and triton.knobs.runtime.interpret


@dataclass(frozen=True)
class StepKeys:
    """Where a decode step's T new tokens sit among the keys (``step_attention``).

    start: [1] long on the device, the position (and cache slot) of the first new token (the root):
        every slot before it holds a committed key.
    depths: [T] int32, token i at position ``start + depths[i]`` (a chain: i).
    ancestors: [T, W] int32, ``ancestors[i, j]`` the new token on token i's path at depth j, for
        j <= depths[i] (``ancestors[i, depths[i]] == i``; entries past a token's depth are not read).
        New token m's key sits at slot ``start + m``.
    key_len: the slots the step may read (static: a captured step's key span), covering start + T.
    """

    start: Tensor
    depths: Tensor
    ancestors: Tensor
    key_len: int
    # the PyTorch form's mask, made by the first layer that needs it (one StepKeys serves a forward)
    _masks: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def width(self) -> int:
        return self.ancestors.shape[1]

    def dense_mask(self) -> Tensor:
        """[T, key_len] bool: the committed slots (before start), and each token's ancestors and
        itself at their slots start + index (the PyTorch form's view of the layout)."""
        if "mask" not in self._masks:
            t, key_len, dev = self.depths.shape[0], self.key_len, self.ancestors.device
            start = self.start.reshape(1)
            committed = torch.arange(key_len, device=dev)[None, :] < start  # [1, key_len]
            visible = torch.arange(self.width, device=dev)[None, :] <= self.depths.long()[:, None]  # [T, W]
            # column start + ancestors[i, j] of row i for j <= depth_i, the rest into a dump column
            # past the span: fixed shapes and no host read, so a captured step (the runtime's graphs
            # with the PyTorch forms) can build it (boolean indexing would read a count back)
            cols = torch.where(visible, start + self.ancestors.long(), key_len)
            tree = torch.zeros(t, key_len + 1, dtype=torch.bool, device=dev).scatter_(1, cols, True)
            self._masks["mask"] = tree[:, :key_len] | committed
        return self._masks["mask"]


def chain_keys(start: Tensor, t: int, key_len: int, table: tuple[Tensor, Tensor] | None = None) -> StepKeys:
    """``StepKeys`` of ``t`` tokens in a row (an AR step, a chain, a replay): token i at depth i, its
    ancestors the tokens before it. ``table``: (depths, ancestors) made once (``chain_table``)."""
    depths, ancestors = table if table is not None else chain_table(t, start.device)
    return StepKeys(start.reshape(1), depths, ancestors, key_len)


def chain_table(t: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(depths [t], ancestors [t, t]) of a chain of ``t`` tokens, int32."""
    idx = torch.arange(t, dtype=torch.int32, device=device)
    return idx, idx[None, :].expand(t, t).contiguous()


def ancestor_table(mask: Tensor, depths: Tensor, width: int) -> Tensor:
    """[T, width] int32 ancestors (``StepKeys.ancestors``) from a tree's ancestor mask [T, T] (mask[i, j]:
    j is i or an ancestor of i) and its depths [T]: column depth[j] of row i holds j. Entries past a
    node's depth are 0 (never read). Tensor ops (the tree kernel writes the table itself on CUDA)."""
    t = mask.shape[0]
    cols = torch.where(mask, depths.long()[None, :].expand(t, t), width)  # non-ancestors go to a dump column
    table = torch.zeros(t, width + 1, dtype=torch.int32, device=mask.device)
    table.scatter_(1, cols, torch.arange(t, dtype=torch.int32, device=mask.device)[None, :].expand(t, t))
    return table[:, :width].contiguous()


def attention_torch(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None = None,
                    gate: Tensor | None = None) -> Tensor:
    hq, hkv = q.shape[-2], k.shape[-2]
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=-2)
        v = v.repeat_interleave(hq // hkv, dim=-2)
    if mask is not None:
        mask = mask.unsqueeze(-3)  # one mask for every head
    out = F.scaled_dot_product_attention(
        q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2), attn_mask=mask, scale=scale
    ).transpose(-3, -2)
    return out if gate is None else out * torch.sigmoid(gate)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None = None,
              gate: Tensor | None = None) -> Tensor:
    """q [B?, T, Hq, D], k/v [B?, S, Hkv, D] (grouped heads share a K/V head), mask [B?, T, S] bool
    (True = attend) or None -> [B?, T, Hq, D]; B? an optional batch axis.

    ``gate`` [B?, T, Hq, D] (q's shape and dtype, any strides: Qwen3.5's gate is a view of the
    fused query projection): the result is ``out * torch.sigmoid(gate)`` with the bits of those two
    eager ops (the sigmoid rounded to the dtype, then the product), on the fused path inside the
    merge launch (two launches fewer).

    A few query rows (T <= SMALL_QUERIES: decode steps, tree verifies, draft blocks, batched decode
    of many sequences) with a mask take one fused launch that reads each K/V head once for all its
    query heads, with no K/V copies, and a second that merges the key spans (and applies the gate);
    anything else takes SDPA."""
    if gate is not None and (tuple(gate.shape) != tuple(q.shape) or gate.dtype != q.dtype):
        raise ValueError(f"gate must have the queries' shape {tuple(q.shape)} and dtype {q.dtype}, got "
                         f"{tuple(gate.shape)} and {gate.dtype}")
    batched = q.dim() == 4
    small = (mask is not None and q.dim() in (3, 4) and k.dim() == q.dim() and v.dim() == q.dim()
             and mask.dim() in (2, q.dim() - 1) and q.shape[-3] <= SMALL_QUERIES
             and k.stride(-1) == 1 and v.stride(-1) == 1)
    if not (small and fused.use_kernels(q, k, v, *([] if gate is None else [gate]))):  # a gate's gradient too
        return attention_torch(q, k, v, mask, scale, gate)
    qc = q.contiguous() if batched else q.contiguous()[None]
    kb, vb = (k, v) if batched else (k[None], v[None])
    m = mask if mask.stride(-1) == 1 else mask.contiguous()  # rows may repeat (stride 0): one mask for all
    mb = m if m.dim() == 3 else m[None]
    b, t, hq, d = qc.shape
    s, hkv = kb.shape[1], kb.shape[2]
    group = hq // hkv
    n_split = triton.cdiv(s, SPLIT_KEYS)
    # Split over the keys: each program one span of SPLIT_KEYS keys (a decode step has few query
    # rows, so one program per K/V head would leave the GPU idle), then one launch merges the spans'
    # partial softmaxes in order. The spans sit at fixed key positions whatever the key span, and a
    # span with no visible key adds exactly zero: an AR step and a verify over more (masked) slots
    # round alike. Always both launches: a one-span call rounds as a many-span one. The partials
    # take T * HQ * D float32 values per span: at most what the keys hold while T * GROUP <= 128.
    acc = torch.empty(b, n_split, t, hq, d, device=qc.device, dtype=torch.float32)
    m_l = torch.empty(b, n_split, t, hq, 2, device=qc.device, dtype=torch.float32)
    launch = attention_launch(d, q.dtype == torch.float32)
    row_blocks = triton.cdiv(t * group, launch["BLOCK_M"])
    grid = (row_blocks * n_split, hkv, b)  # spans on the first axis: its limit is 2**31 - 1, not 65,535
    _small_attention_kernel[grid](
        qc, kb, vb, mb, acc, m_l, t, s, n_split, row_blocks, kb.stride(0), kb.stride(1), kb.stride(2),
        vb.stride(0), vb.stride(1), vb.stride(2), mb.stride(0) if mb.shape[0] > 1 else 0, mb.stride(1),
        scale if scale is not None else d**-0.5, HQ=hq, GROUP=group, D=d, IEEE=q.dtype == torch.float32,
        SPLIT=SPLIT_KEYS, **launch,
    )
    out = torch.empty_like(qc)
    if gate is None:
        gb, g_strides = out, (0, 0, 0)  # not read (GATED=False)
    else:
        gb = gate if gate.stride(-1) == 1 else gate.contiguous()
        gb = gb if batched else gb[None]
        g_strides = (gb.stride(0) if b > 1 else 0, gb.stride(1), gb.stride(2))
    _attention_merge_kernel[(t * hq, b)](acc, m_l, out, gb, acc, t * hq, n_split, 0, *g_strides, 0, HQ=hq, D=d,
                                         BLOCK_D=launch["BLOCK_D"], GATED=gate is not None, LIBDEVICE=_LIBDEVICE,
                                         STEP=False, SPLIT=SPLIT_KEYS, FOLD=FOLD_SPANS,
                                         TRIGGER=fused.lets_dependents_launch(out.device))
    return out if batched else out[0]


def step_attention_torch(q: Tensor, k: Tensor, v: Tensor, keys: StepKeys, scale: float | None = None,
                         gate: Tensor | None = None) -> Tensor:
    """``step_attention`` by SDPA over the slots (the mask of committed keys, ancestors and self):
    the PyTorch form (the CPU path, and the reference the kernel is tested against)."""
    return attention_torch(q, k[: keys.key_len], v[: keys.key_len], keys.dense_mask(), scale, gate)


def step_attention(q: Tensor, k: Tensor, v: Tensor, keys: StepKeys, scale: float | None = None,
                   gate: Tensor | None = None) -> Tensor:
    """Attention of a decode step's T new tokens, q [T, Hq, D], over a layer's cache k, v [S, Hkv, D]
    (their keys already written at slots start..start+T-1), laid out by ``keys`` -> [T, Hq, D].

    A token at depth d sees the committed keys (slots before start), then its ancestors by depth,
    then itself, each at its logical position start + depth: on the kernel path every key block
    holds what an AR step at that position holds, so the token's output carries the AR step's bits
    (``gate`` as in ``attention``). Any T: the kernel serves every verify."""
    if gate is not None and (tuple(gate.shape) != tuple(q.shape) or gate.dtype != q.dtype):
        raise ValueError(f"gate must have the queries' shape {tuple(q.shape)} and dtype {q.dtype}, got "
                         f"{tuple(gate.shape)} and {gate.dtype}")
    ok = (q.dim() == 3 and k.dim() == 3 and v.dim() == 3 and k.stride(-1) == 1 and v.stride(-1) == 1
          and keys.ancestors.dtype == torch.int32 and keys.depths.dtype == torch.int32)
    if not (ok and fused.use_kernels(q, k, v, *([] if gate is None else [gate]))):
        return step_attention_torch(q, k, v, keys, scale, gate)
    qc = q.contiguous()
    t, hq, d = qc.shape
    hkv = k.shape[1]
    group = hq // hkv
    launch = step_attention_launch(d, q.dtype == torch.float32)
    n_split = triton.cdiv(keys.key_len, launch["SPLIT"])
    acc = torch.empty(1, n_split, t, hq, d, device=qc.device, dtype=torch.float32)
    m_l = torch.empty(1, n_split, t, hq, 2, device=qc.device, dtype=torch.float32)
    row_blocks = triton.cdiv(t * group, launch["BLOCK_M"])  # programs of several tokens' rows, per span
    sub = triton.cdiv(group, launch["BLOCK_M"])  # and programs of one token's rows (see the kernel),
    n_tail = min(n_split, triton.cdiv(t - 1, launch["SPLIT"]) + 1)  # in the spans the new tokens reach
    span_run = launch["FOLD"] if folds_runs(row_blocks, n_split, hkv, launch["FOLD"], qc.device) else 1
    anc = keys.ancestors if keys.ancestors.stride(-1) == 1 else keys.ancestors.contiguous()
    _step_attention_kernel[(row_blocks * triton.cdiv(n_split, span_run) + t * sub * n_tail, hkv)](
        qc, k, v, keys.start, keys.depths, anc, acc, m_l, t, keys.key_len, n_split, n_tail, row_blocks, t * sub,
        anc.stride(0), span_run, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        scale if scale is not None else d**-0.5, HQ=hq, GROUP=group, SUB=sub, D=d, IEEE=q.dtype == torch.float32,
        FOLDING=span_run > 1, INTERPRET=_INTERPRET, **launch,
    )
    out = torch.empty_like(qc)
    if gate is None:
        gb, g_strides = out, (0, 0, 0)  # not read (GATED=False)
    else:
        gb = gate if gate.stride(-1) == 1 else gate.contiguous()
        g_strides = (0, gb.stride(0), gb.stride(1))
    _attention_merge_kernel[(t * hq, 1)](acc, m_l, out, gb, keys.start, t * hq, n_split, n_tail, *g_strides,
                                         int(span_run > 1), HQ=hq, D=d, BLOCK_D=launch["BLOCK_D"],
                                         GATED=gate is not None, LIBDEVICE=_LIBDEVICE, STEP=True,
                                         SPLIT=launch["SPLIT"], FOLD=launch["FOLD"],
                                         TRIGGER=fused.lets_dependents_launch(out.device))
    return out


def folds_runs(row_blocks: int, n_split: int, kv_heads: int, fold: int, device: torch.device) -> bool:
    """Whether a step's programs fold their runs of ``fold`` committed spans themselves (the bits are the
    same either way: a choice of speed). Rows in several row blocks (a verify's; an AR step's only where
    a K/V head's query heads outnumber BLOCK_M) write their partials row_blocks times over per span, which
    then cost more than the keys themselves (the 27B shape at budget 32: 3x the K/V bytes read and
    written again): folded, a run's programs write one; while they still number at least
    ``FOLD_FROM_SMS`` times the SMs (one row block keeps its span-wide parallelism). A captured step's key
    span is its bucket (``runtime.bucket_for``: a power of two), of which at least half may be live, the
    rest runs past start that end at once: the programs are counted over half the spans."""
    if row_blocks < 2 or fold < 2 or FOLD_FROM_SMS == float("inf"):
        return False
    sms = _sm_count(device.index) if device.type == "cuda" else 0  # the interpreter: folded wherever it can be
    return row_blocks * triton.cdiv(max(n_split // 2, 1), fold) * kv_heads >= FOLD_FROM_SMS * sms


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()
                                            ).multi_processor_count


def attention_launch(d: int, fp32: bool = False) -> dict[str, int]:
    """Block sizes and launch options of the attention kernel for head_dim ``d`` (``fp32``: float32
    inputs). Two pipeline stages and smaller key blocks for wide heads keep shared memory within a
    Hopper SM's 227 KB (head_dim 256 with three stages does not fit); 8 warps from head_dim 64, and
    float32 key blocks of 32 from head_dim 64 (16 at head_dim 128), keep every value in registers
    (no spills on sm_90 with Triton 3.6, benchmarks/kernel_check.py)."""
    block_d = max(16, triton.next_power_of_2(d))
    narrow_keys = block_d >= 256 or (fp32 and block_d >= 64)
    return dict(BLOCK_M=ATTN_BLOCK_M, BLOCK_N=(16 if fp32 and block_d == 128 else 32) if narrow_keys else 64,
                BLOCK_D=block_d,
                num_warps=8 if block_d >= 64 else 4, num_stages=2)


def step_attention_launch(d: int, fp32: bool = False) -> dict[str, int]:
    """``attention_launch`` for ``_step_attention_kernel``, which also holds a gathered value block
    beside the key block. In half precision: key blocks of 32 and 4 warps at every head_dim, spans
    of 64 keys up to head_dim 64 and of 128 above. On the H200 (2026-12-04, `kernel_bench.py
    attention`, us per call): SmolLM2's d64 AR step 6.6 -> 5.9 and its budget-48 verify 10.9 -> 9.0
    against 64 x 8 warps in spans of 128; the 8B shape's d128 9.8 -> 9.6 and 36.9 -> 26.9, the 27B
    shape's d256 12.8 -> 12.3 and 37.3 -> 31.6 against 32 x 8 (spans of 64 there cost the verify
    10-17%); on the pair, the AR step 0.946 -> 0.935 ms and the DDTree-48 verify 1.13 -> 1.09 ms. In
    float32 (a check of the algorithm, not a speed path): ``attention_launch``'s warps with key
    blocks of 16 from head_dim 128. At head_dims 128 and 256 the 4 warps spill a little and are still
    the faster launch (`benchmarks/kernel_check.py`, ``MAY_SPILL``). One launch per
    head_dim and dtype, whatever the rows: an AR step and a verify reduce their keys in the same
    spans (``SPLIT``; the mask kernel's need not match, since no AR step takes it), blocks, rows a
    program (``BLOCK_M``) and runs of spans folded (``FOLD``): all part of the arithmetic."""
    launch = attention_launch(d, fp32)
    if fp32:
        if launch["BLOCK_D"] >= 128:
            launch["BLOCK_N"] = 16
        return {**launch, "SPLIT": step_split(d, fp32), "FOLD": FOLD_SPANS}
    return {**launch, "BLOCK_N": 32, "num_warps": 4, "SPLIT": step_split(d, fp32), "FOLD": FOLD_SPANS}


def step_split(d: int, fp32: bool = False) -> int:
    """Keys per span of the step kernel at head_dim ``d`` (``step_attention_launch``'s ``SPLIT``),
    without Triton: what the memory plan prices its float32 partials by (one per span, row, head)."""
    block_d = max(16, 1 << (max(int(d), 1) - 1).bit_length())
    return SPLIT_KEYS if fp32 or block_d > 64 else 64
