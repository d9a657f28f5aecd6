"""Fused row-wise kernels: one launch where eager PyTorch takes several.

A decode step of a dense or hybrid target is mostly tiny elementwise work between the weight
reads: an RMSNorm in float32 alone is eight launches, RoPE by slicing and concatenation seven.
Inside a CUDA graph each launch still costs a few microseconds, which for a 36-layer model is
milliseconds per token. These kernels do each of those in one launch.

Every function has a PyTorch form (the CPU path, and the reference the kernels are tested
against) and a Triton form used for CUDA tensors outside autograd. Each Triton program owns one
row and its reductions depend only on the row's width, so a row gives the same bits whichever
batch of rows it is computed in: a tree verify and an AR step round alike (exactness).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.config import EngineInputError

try:
    import triton
    import triton.language as tl
    try:  # (the engine's kernels take them from here: linear, attention)
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # a Triton without grid dependency control: no kernel lets another launch early
        gdc_launch_dependents = gdc_wait = None
except ImportError:  # pragma: no cover - installs without Triton use the PyTorch forms
    triton = gdc_launch_dependents = gdc_wait = None


def _from_environment() -> tuple[bool, str | None]:
    # ENGINE_KERNELS=eager turns the kernels off for a whole process from outside (a GPU whose
    # Triton cannot build them, or a benchmark run without them): the default of set_kernels.
    value = os.environ.get("ENGINE_KERNELS", "fused").strip().lower()
    if value not in ("fused", "eager"):
        return False, f"environment variable ENGINE_KERNELS must be 'fused' or 'eager', got {value!r}"
    return value == "fused", None


_enabled, _environment_error = _from_environment()
QUANT_DECODES = ("auto", "kernel")


def _quant_decode_from_environment() -> tuple[str, str | None]:
    # ENGINE_QUANT_DECODE=kernel keeps Q4_K, Q6_K and Q4_1 in their blocks for quant_kernel where the
    # operand-register decode would take them (engine.models.quant_gluon: an sm_90 GPU in bf16)
    raw = os.environ.get("ENGINE_QUANT_DECODE", "auto")
    value = raw.strip().lower()
    if value not in QUANT_DECODES:
        return "auto", (f"environment variable ENGINE_QUANT_DECODE must be 'auto' (Q4_K, Q6_K and Q4_1 decoded into "
                        f"the matrix unit's registers where that runs) or 'kernel' (quant_kernel's, every format), "
                        f"got {raw!r}")
    return value, None


_quant_decode, _quant_decode_error = _quant_decode_from_environment()
_AT_IMPORT = {name: os.environ.get(name, "") for name in ("ENGINE_KERNELS", "ENGINE_QUANT_DECODE")}  # as judged


def environment_errors() -> dict[str, tuple[str, str]]:
    """The engine's environment variables set to a bad value: name -> (the rule, the value read at import)."""
    rules = {"ENGINE_KERNELS": (_environment_error, "must be 'fused' or 'eager'"),
             "ENGINE_QUANT_DECODE": (_quant_decode_error, "must be 'auto' or 'kernel'")}
    return {name: (rule, _AT_IMPORT[name]) for name, (error, rule) in rules.items() if error is not None}


def check_environment() -> None:
    """A bad ENGINE_KERNELS or ENGINE_QUANT_DECODE is an input error, raised here (the CLIs call this first:
    exit 2) and at the first use of the kernels, never at import."""
    for error in (_environment_error, _quant_decode_error):
        if error is not None:
            raise EngineInputError(error)


def quant_decode() -> str:
    """``ENGINE_QUANT_DECODE`` as read at import (or ``set_quant_decode``'s): "auto" or "kernel" (a bad value
    raises, naming it)."""
    if _quant_decode_error is not None:
        raise EngineInputError(_quant_decode_error)
    return _quant_decode


def set_quant_decode(choice: str) -> str:
    """Choose the quantized decode for later loads, as ``ENGINE_QUANT_DECODE`` does from outside (read at import:
    a benchmark that has imported the engine sets it here); returns the previous choice."""
    global _quant_decode
    if choice not in QUANT_DECODES:
        raise EngineInputError(f"set_quant_decode: must be one of {list(QUANT_DECODES)}, got {choice!r}")
    previous, _quant_decode = _quant_decode, choice
    return previous


def set_kernels(enabled: bool) -> bool:
    """Turn the Triton kernels (these and the tree delta rule) on or off for this process; returns
    the previous setting. Off, CUDA runs the PyTorch forms: benchmarks compare the two this way."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def kernels_enabled() -> bool:
    if _environment_error is not None:  # every op asks: a global read, not a call (check_environment)
        raise EngineInputError(_environment_error)
    return _enabled and _wanted and triton is not None


_wanted = True  # this generation's choice (EngineConfig.kernels), under the process switch above


@contextlib.contextmanager
def using_kernels(wanted: bool) -> Iterator[None]:
    """The kernels on (``wanted``) or off for one generation, restoring the previous choice after;
    ``set_kernels(False)`` still turns them off for the whole process."""
    global _wanted
    previous, _wanted = _wanted, bool(wanted)
    try:
        yield
    finally:
        _wanted = previous


def use_kernels(*tensors: Tensor) -> bool:
    """Triton for CUDA tensors when no gradient is needed (the kernels have no backward)."""
    if not kernels_enabled() or not tensors[0].is_cuda:
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


# ------------------------------------------------------------------------------- PyTorch forms


def rms_norm_torch(x: Tensor, weight: Tensor, eps: float, zero_centred: bool) -> Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float()
    if zero_centred:
        w = 1.0 + w
    return (h * w).to(dtype)


def add_rms_norm_torch(x: Tensor, delta: Tensor, weight: Tensor, eps: float, zero_centred: bool
                       ) -> tuple[Tensor, Tensor]:
    total = x + delta
    return total, rms_norm_torch(total, weight, eps, zero_centred)


def gated_rms_norm_torch(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    dtype = gate.dtype
    h = x.to(dtype).float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (weight * h * F.silu(gate.float())).to(dtype)


def silu_mul_torch(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def rope_torch(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    x1, x2 = rot[..., : rd // 2], rot[..., rd // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    out = rot * cos[..., None, :] + rotated * sin[..., None, :]
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


# ------------------------------------------------------------------------------- dispatch


def rms_norm(x: Tensor, weight: Tensor, eps: float, zero_centred: bool = False) -> Tensor:
    """RMSNorm over the last axis in float32, scaled by ``weight`` (``1 + weight`` when zero-centred)."""
    if not use_kernels(x, weight):
        return rms_norm_torch(x, weight, eps, zero_centred)
    rows, d = _rows(x)
    out = torch.empty_like(rows)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, rows, rows, out, d, eps, 1, d, 0, rows, 0,
                                       ZERO_CENTRED=zero_centred, GATED=False, RESIDUAL=False, TEE=False,
                                       TRIGGER=lets_dependents_launch(x.device), **row_launch(d))
    return out.view(x.shape)


def add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float, zero_centred: bool = False,
                 tee: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(x + delta, rms_norm(x + delta))``: a residual add and the norm that reads it in one launch.
    The sum is rounded to the dtype (as PyTorch's add) and normalised from the rounded value, so both
    outputs carry the bits of the two separate ops. ``tee`` (x's shape; rows may be strided, as a column
    slice of a wider buffer): the sum written there as well, by the same launch (a decode step's
    target features: the layer outputs the next layers' adds compute anyway)."""
    if tee is not None and (tee.shape != x.shape or tee.dtype != x.dtype or tee.device != x.device):
        raise ValueError(f"tee: {tuple(tee.shape)} {tee.dtype} on {tee.device} where the sum is "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}")
    if not use_kernels(x, delta, weight):
        total, out = add_rms_norm_torch(x, delta, weight, eps, zero_centred)
        if tee is not None:
            tee.copy_(total)
        return total, out
    rows, d = _rows(x)
    dr = delta.reshape(-1, d).contiguous()
    total, out = torch.empty_like(rows), torch.empty_like(rows)
    tee_rows = _tee_rows(tee, d) if tee is not None else None
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, dr, total, out, d, eps, 1, d, 0,
                                       rows if tee_rows is None else tee_rows,
                                       0 if tee_rows is None else tee_rows.stride(0),
                                       ZERO_CENTRED=zero_centred, GATED=False, RESIDUAL=True,
                                       TEE=tee_rows is not None, TRIGGER=lets_dependents_launch(x.device),
                                       **row_launch(d))
    return total.view(x.shape), out.view(x.shape)


def _tee_rows(t: Tensor, d: int) -> Tensor:
    """``t`` as [rows, d] rows of unit column stride, a view (rows apart by any stride): where the kernel
    writes. A tensor that cannot be such a view is refused (a copy would take the write)."""
    rows = t.reshape(-1, d)
    if rows.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() or rows.stride(1) != 1:
        raise ValueError(f"tee: a [rows, {d}] view with unit column stride is needed, got shape "
                         f"{tuple(t.shape)} strides {t.stride()}")
    return rows


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``norm(x) * silu(gate)`` (Gated DeltaNet's output norm; plain weight, rounding as the eager
    form) in the gate's dtype; ``x`` (the delta rule's float32 output) is rounded to it first."""
    if not use_kernels(x, gate, weight):
        return gated_rms_norm_torch(x, gate, weight, eps)
    rows, d = _rows(x)
    # The gate is read in place when it is [T, heads, d] with unit column stride (Qwen3.5's z: a
    # view of the fused in-projection, rows strided): row r is token r // heads, head r % heads.
    if gate.dim() == 3 and gate.stride(-1) == 1:
        g, heads, s_tok, s_head = gate, gate.shape[1], gate.stride(0), gate.stride(1)
    else:
        g = gate.reshape(-1, d).contiguous()
        heads, s_tok, s_head = 1, d, 0
    out = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, g, g, out, d, eps, heads, s_tok, s_head, rows, 0,
                                       ZERO_CENTRED=False, GATED=True, RESIDUAL=False, TEE=False,
                                       TRIGGER=lets_dependents_launch(x.device), **row_launch(d))
    return out


def _strided_rows(x: Tensor, d: int) -> Tensor:
    """[rows, d] with unit column stride, a view where it can be (the halves of a fused projection)."""
    rows = x.reshape(-1, d)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` (SwiGLU's inner product), computed in float32 and rounded once. The two
    may be views of one fused projection (rows strided)."""
    if not use_kernels(gate, up):
        return silu_mul_torch(gate, up)
    d = gate.shape[-1]
    g, u = _strided_rows(gate, d), _strided_rows(up, d)
    out = torch.empty(g.shape, device=g.device, dtype=g.dtype)
    block = min(triton.next_power_of_2(d), 2048)  # elementwise: tiles of a wide row, no spills
    _silu_mul_kernel[(g.shape[0], triton.cdiv(d, block))](g, u, out, d, g.stride(0), u.stride(0), BLOCK=block,
                                                           TRIGGER=lets_dependents_launch(g.device))
    return out.view(gate.shape)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE (HF half layout) on the first ``cos.shape[-1]`` dims of every head; x [T, heads, D],
    cos/sin [T, rd]; the rest of each head passes through (partial RoPE)."""
    if x.dim() != 3 or cos.dim() != 2 or not use_kernels(x, cos, sin):
        return rope_torch(x, cos, sin)
    t, heads, d = x.shape
    xc, cc, sc = x.contiguous(), cos.contiguous(), sin.contiguous()
    out = torch.empty_like(xc)
    rd = cc.shape[-1]
    _rope_kernel[(t * heads,)](xc, cc, sc, out, heads, d, rd, HALF=triton.next_power_of_2(max(rd // 2, 1)),
                               BLOCK=triton.next_power_of_2(d))
    return out


def rope_write(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, k_cache: Tensor,
               v_cache: Tensor, norms: HeadNorms | None = None) -> Tensor:
    """RoPE on the query and key heads, the rotated keys and the values written to their cache
    ``slots``, in one launch on CUDA (three or five otherwise: a rotation each, a copy each, and on
    a verify two more that make the strided query and key views contiguous for the rotation).
    ``norms``: the per-head RMSNorms of the queries and keys (Qwen3, Qwen3.5, the DFlash draft),
    applied first in the same launch (two more launches otherwise).

    q [T, HQ, D], k and v [T, HKV, D] (views of one fused projection: any row and head strides),
    cos/sin [T, rd], slots [T] (long), k_cache/v_cache [S, HKV, D]. Returns the rotated queries
    [T, HQ, D]; the norm is ``rms_norm``'s and the rotation ``rope``'s, bit for bit."""
    if not (q.dim() == k.dim() == v.dim() == 3 and cos.dim() == 2 and q.stride(-1) == k.stride(-1)
            == v.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
            and use_kernels(q, k, v, cos, sin, k_cache, v_cache)):
        if norms is not None:
            q, k = norms.apply(q, k)
        k_cache.index_copy_(0, slots, rope(k, cos, sin))
        v_cache.index_copy_(0, slots, v)
        return rope(q, cos, sin)
    t, hq, d = q.shape
    cc, sc = cos.contiguous(), sin.contiguous()
    out = torch.empty(t, hq, d, device=q.device, dtype=q.dtype)
    rd = cc.shape[-1]
    qw, kw = (norms.q_weight, norms.k_weight) if norms is not None else (cc, cc)  # unread without NORM
    _rope_write_kernel[(t, hq + k.shape[1])](
        q, k, v, cc, sc, slots, out, k_cache, v_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        hq, d, rd, qw, kw, norms.eps if norms is not None else 0.0, NORM=norms is not None,
        ZERO_CENTRED=norms is not None and norms.zero_centred, HALF=triton.next_power_of_2(max(rd // 2, 1)),
        BLOCK=triton.next_power_of_2(d))
    return out


@dataclass(frozen=True)
class HeadNorms:
    """The query and key heads' RMSNorms (weights [D], one eps, zero-centred or not) as
    ``rope_write`` applies them before the rotation."""

    q_weight: Tensor
    k_weight: Tensor
    eps: float
    zero_centred: bool = False

    def apply(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """The norms as separate ops (the path without the fused kernel)."""
        return (rms_norm(q, self.q_weight, self.eps, self.zero_centred),
                rms_norm(k, self.k_weight, self.eps, self.zero_centred))


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gdn_inputs_torch(hist: Tensor, conv_index: Tensor, conv_w: Tensor, a: Tensor, b: Tensor, a_log: Tensor,
                     dt_bias: Tensor, hk: int, dk: int, hv: int, dv: int) -> tuple[Tensor, ...]:
    t = conv_index.shape[0]
    # Accumulate in float32 and round once, as F.conv1d does in HF's path.
    qkv = F.silu((hist[conv_index].float() * conv_w.t().float()).sum(1).to(hist.dtype))  # [T, C]
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q = _l2norm(q.float().view(t, hk, dk)) / math.sqrt(dk)
    k = _l2norm(k.float().view(t, hk, dk))
    v = v.float().view(t, hv, dv)
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = b.sigmoid().float()
    return q, k, v, g, beta


def gdn_inputs(conv: Tensor, mixed: Tensor, conv_index: Tensor, conv_w: Tensor, a: Tensor, b: Tensor,
               a_log: Tensor, dt_bias: Tensor, hk: int, dk: int, hv: int, dv: int, commit: bool = False,
               record: Tensor | None = None, out: tuple[Tensor, ...] | None = None) -> tuple[Tensor, ...]:
    """What the gated delta rule needs from one Gated DeltaNet layer's projections.

    conv [K-1, C]: the conv window's inputs before this forward; mixed [T, C]: this forward's
    ``in_proj_qkv`` output (strided rows allowed); conv_index [T, K]: each token's window rows in
    ``cat(conv, mixed)`` (its ancestors for a tree); conv_w [C, K] the depthwise conv weight; a, b
    [T, HV] the ``in_proj_a`` / ``in_proj_b`` outputs. ``commit``: ``conv`` becomes the window after
    a chain (the last K-1 rows of ``cat(conv, mixed)``); ``record`` [T, C]: receives ``mixed`` (a
    tree's per-node conv inputs). ``out``: contiguous float32 tensors of the five results' shapes
    that receive them (a tree forward keeps every node's inputs in the cache for its commit).

    Returns q, k [T, HK, DK] (causal conv, SiLU, L2-normalised, q scaled by 1/sqrt(DK)), v [T, HV, DV],
    g (log decay) and beta [T, HV], all float32. On CUDA one launch instead of about thirty; the
    window is read in place and, for one token, committed or recorded in the same launch (a
    concatenation and a copy each otherwise)."""
    t, kernel = conv_index.shape
    if record is not None and tuple(record.shape) != tuple(mixed.shape):
        raise ValueError(f"record must be shaped like mixed {tuple(mixed.shape)}, got {tuple(record.shape)}")
    shapes = [(t, hk, dk), (t, hk, dk), (t, hv, dv), (t, hv), (t, hv)]
    if out is not None and ([tuple(o.shape) for o in out] != shapes or not all(o.is_contiguous() for o in out)
                            or any(o.dtype != torch.float32 for o in out)):
        raise ValueError(f"out must be contiguous float32 tensors shaped {shapes}, got "
                         f"{[(tuple(o.shape), o.dtype) for o in out]}")
    if not (use_kernels(conv, mixed, conv_w, a, b) and mixed.stride(-1) == 1 and conv.is_contiguous()
            and (record is None or (record.stride(-1) == 1))):
        hist = torch.cat([conv, mixed])
        res = gdn_inputs_torch(hist, conv_index, conv_w, a, b, a_log, dt_bias, hk, dk, hv, dv)
        if record is not None:
            record.copy_(mixed)
        if commit:
            conv.copy_(hist[t:])
        if out is None:
            return res
        for o, r in zip(out, res, strict=True):
            o.copy_(r)
        return out
    idx, w = conv_index.contiguous(), conv_w.contiguous()
    a, b = _strided_rows(a, hv), _strided_rows(b, hv)  # views of the fused in-projection's output
    if out is None:
        out = tuple(torch.empty(shape, device=mixed.device, dtype=torch.float32) for shape in shapes)
    q, k, v, g, beta = out
    # A program owns its channels in every row: with one token it can shift the window in place.
    in_kernel = commit and t == 1
    rec = record if record is not None else mixed
    # One launch: per token, the conv segments (q heads, k heads, v heads) and one program for the gates.
    _gdn_inputs_kernel[(t, 2 * hk + hv + 1)](
        conv, mixed, mixed.stride(0), rec, rec.stride(0), idx, w, q, k, v, a, b, a.stride(0), b.stride(0), a_log,
        dt_bias, g, beta, mixed.shape[1], HK=hk, DK=dk, HV=hv, DV=dv, KERNEL=kernel,
        BLOCK=triton.next_power_of_2(max(dk, dv)), BLOCK_H=triton.next_power_of_2(hv), COMMIT=in_kernel,
        RECORD=record is not None,
    )
    if commit and not in_kernel:  # after the kernel's reads (stream order)
        conv.copy_(torch.cat([conv, mixed])[t:])
    return q, k, v, g, beta


@functools.cache
def lets_dependents_launch(device: torch.device) -> bool:
    """Whether the kernels before a product in a decode step (the norms, the attention's merge, SwiGLU's product)
    let the launch after them start as they start (``griddepcontrol.launch_dependents``, sm_90 and later; not in
    Triton's interpreter): a product launched with programmatic dependent launch (``quant_gluon.PDL``) then asks
    for its weight's tiles while they run and waits (``griddepcontrol.wait``) for their writes only before it reads
    x. A hint: a launch after them without PDL starts when they end, as before."""
    if triton is None or gdc_launch_dependents is None or triton.knobs.runtime.interpret or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def row_launch(d: int) -> dict[str, int]:
    """A whole row per program (its reduction needs it): more warps for wider rows keep the values
    a thread holds in registers (a width sets one launch, so a row's bits never depend on T). At
    8 warps a zero-centred bf16 row of 8,192 spilled on sm_90 with Triton 3.6 (kernel_check)."""
    block = triton.next_power_of_2(d)
    return dict(BLOCK=block, num_warps=4 if block <= 2048 else 8 if block <= 4096 else 16)


def _rows(x: Tensor) -> tuple[Tensor, int]:
    d = x.shape[-1]
    return x.reshape(-1, d).contiguous(), d


# ------------------------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, other_ptr, total_ptr, out_ptr, D, eps, other_heads, other_tok, other_head,
                         tee_ptr, tee_stride, ZERO_CENTRED: tl.constexpr, GATED: tl.constexpr,
                         RESIDUAL: tl.constexpr, TEE: tl.constexpr, BLOCK: tl.constexpr, TRIGGER: tl.constexpr):
        # other_ptr: the gate (GATED) or the residual update (RESIDUAL: x + other goes to total_ptr,
        # and with TEE to row * tee_stride of tee_ptr too); its row r at
        # (r // other_heads) * other_tok + (r % other_heads) * other_head
        if TRIGGER:  # the product after this launch may start (lets_dependents_launch)
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)  # row * D overflows int32 on long prefills of wide models
        other_row = (row // other_heads) * other_tok + (row % other_heads) * other_head
        cols = tl.arange(0, BLOCK)
        m = cols < D
        ty = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * D + cols, mask=m, other=0.0).to(tl.float32)
        if RESIDUAL:  # the sum rounded as PyTorch's add rounds it, then normalised from that value
            x = (x + tl.load(other_ptr + other_row + cols, mask=m, other=0.0).to(tl.float32)).to(ty)
            tl.store(total_ptr + row * D + cols, x, mask=m)
            if TEE:
                tl.store(tee_ptr + row * tee_stride + cols, x, mask=m)
            x = x.to(tl.float32)
        if GATED:  # x may be float32 (the delta rule's output): rounded to the dtype first
            x = x.to(ty).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + cols, mask=m, other=0.0)
        if GATED:
            # as the eager form: normalised x and its product with the weight rounded to the dtype
            # (a product of two values of the dtype is exact in float32: rounding it is the dtype's product)
            h = (x * r).to(out_ptr.dtype.element_ty).to(tl.float32)
            hw = (w.to(tl.float32) * h).to(out_ptr.dtype.element_ty).to(tl.float32)
            g = tl.load(other_ptr + other_row + cols, mask=m, other=0.0).to(tl.float32)
            y = hw * (g * tl.sigmoid(g))
        else:
            wf = w.to(tl.float32)
            if ZERO_CENTRED:
                wf = 1.0 + wf
            y = (x * r) * wf
        tl.store(out_ptr + row * D + cols, y.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, D, g_stride, u_stride, BLOCK: tl.constexpr, TRIGGER: tl.constexpr):
        if TRIGGER:  # the down projection may start (lets_dependents_launch)
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < D
        g = tl.load(g_ptr + row * g_stride + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * u_stride + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * D + cols, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _head_norm(src, w_ptr, cols, scale, ZERO_CENTRED: tl.constexpr, ty: tl.constexpr):
        # Entries ``cols`` of one head normalised as _rms_norm_kernel does (its product order, rounded
        # to the dtype), in float32 for the rotation.
        x = tl.load(src + cols).to(tl.float32)
        w = tl.load(w_ptr + cols).to(tl.float32)
        if ZERO_CENTRED:
            w = 1.0 + w
        return ((x * scale) * w).to(ty).to(tl.float32)

    @triton.jit
    def _rotate_head(src, dst, cos_ptr, sin_ptr, tok, D, RD, w_ptr, eps, NORM: tl.constexpr,
                     ZERO_CENTRED: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
        # One head at src rotated (HF half layout) into dst: the first RD dims, the rest copied;
        # with NORM the head is RMS-normalised by the weight at w_ptr first.
        half = RD // 2
        ty = dst.dtype.element_ty
        j = tl.arange(0, BLOCK)
        mj = j < D
        scale = 1.0
        if NORM:  # the head's sum of squares over the same [BLOCK] layout as _rms_norm_kernel's row
            xs = tl.load(src + j, mask=mj, other=0.0).to(tl.float32)
            scale = 1.0 / tl.sqrt(tl.sum(xs * xs, axis=0) / D + eps)
        i = tl.arange(0, HALF)
        mi = i < half
        if NORM:
            x1 = _head_norm(src, w_ptr, tl.where(mi, i, 0), scale, ZERO_CENTRED, ty)
            x2 = _head_norm(src, w_ptr, tl.where(mi, half + i, 0), scale, ZERO_CENTRED, ty)
        else:
            x1 = tl.load(src + i, mask=mi, other=0.0).to(tl.float32)
            x2 = tl.load(src + half + i, mask=mi, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + tok * RD + i, mask=mi, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + tok * RD + half + i, mask=mi, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + tok * RD + i, mask=mi, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + tok * RD + half + i, mask=mi, other=0.0).to(tl.float32)
        tl.store(dst + i, (x1 * c1 - x2 * s1).to(ty), mask=mi)
        tl.store(dst + half + i, (x2 * c2 + x1 * s2).to(ty), mask=mi)
        mt = (j >= RD) & mj  # the unrotated tail of a partial RoPE
        if NORM:
            tail = _head_norm(src, w_ptr, tl.where(mt, j, 0), scale, ZERO_CENTRED, ty).to(ty)
        else:
            tail = tl.load(src + j, mask=mt, other=0.0)
        tl.store(dst + j, tail, mask=mt)

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, HEADS, D, RD, HALF: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # one (token, head)
        _rotate_head(x_ptr + row * D, out_ptr + row * D, cos_ptr, sin_ptr, row // HEADS, D, RD, cos_ptr, 0.0,
                     False, False, HALF, BLOCK)

    @triton.jit(do_not_specialize=["sq_t", "sk_t", "sv_t"])
    def _rope_write_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slot_ptr, qo_ptr, kc_ptr, vc_ptr, sq_t, sq_h,
                           sk_t, sk_h, sv_t, sv_h, skc_t, skc_h, svc_t, svc_h, HQ, D, RD, qw_ptr, kw_ptr, eps,
                           NORM: tl.constexpr, ZERO_CENTRED: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        if h < HQ:  # a query head, rotated into the contiguous output
            src = q_ptr + tok * sq_t + h * sq_h
            dst = qo_ptr + (tok * HQ + h) * D
            w_ptr = qw_ptr
        else:  # a key head, rotated into its cache slot; its value head copied to the same slot
            hk = h - HQ
            slot = tl.load(slot_ptr + tok)
            src = k_ptr + tok * sk_t + hk * sk_h
            dst = kc_ptr + slot * skc_t + hk * skc_h
            w_ptr = kw_ptr
            j = tl.arange(0, BLOCK)
            mv = j < D
            val = tl.load(v_ptr + tok * sv_t + hk * sv_h + j, mask=mv, other=0.0)
            tl.store(vc_ptr + slot * svc_t + hk * svc_h + j, val, mask=mv)
        _rotate_head(src, dst, cos_ptr, sin_ptr, tok, D, RD, w_ptr, eps, NORM, ZERO_CENTRED, HALF, BLOCK)

    @triton.jit
    def _gdn_inputs_kernel(conv_ptr, mix_ptr, mix_stride, rec_ptr, rec_stride, idx_ptr, w_ptr, q_ptr, k_ptr, v_ptr,
                           a_ptr, b_ptr, a_stride, b_stride, alog_ptr, dt_ptr, g_ptr, beta_ptr, C,
                           HK: tl.constexpr, DK: tl.constexpr, HV: tl.constexpr, DV: tl.constexpr,
                           KERNEL: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, COMMIT: tl.constexpr,
                           RECORD: tl.constexpr):
        # Program (token, seg): seg < 2 * HK + HV one (token, head) segment of the conv channels
        # (q heads, then k heads, then v heads); the last seg the token's gates. Row r of the
        # window rows cat(conv, mixed) is conv's r-th (r < KERNEL - 1) or mixed's (r - KERNEL + 1)-th.
        tok = tl.program_id(0).to(tl.int64)
        seg = tl.program_id(1)
        if seg == 2 * HK + HV:
            h = tl.arange(0, BLOCK_H)
            mh = h < HV
            x = tl.load(a_ptr + tok * a_stride + h, mask=mh, other=0.0).to(tl.float32) \
                + tl.load(dt_ptr + h, mask=mh, other=0.0).to(tl.float32)
            softplus = tl.where(x > 20.0, x, tl.where(x < -15.0, tl.exp(x), tl.log(1.0 + tl.exp(x))))
            decay = tl.exp(tl.load(alog_ptr + h, mask=mh, other=0.0).to(tl.float32))
            tl.store(g_ptr + tok * HV + h, -decay * softplus, mask=mh)
            bb = tl.load(b_ptr + tok * b_stride + h, mask=mh, other=0.0).to(tl.float32)
            tl.store(beta_ptr + tok * HV + h, tl.sigmoid(bb).to(b_ptr.dtype.element_ty).to(tl.float32), mask=mh)
        else:
            is_v = seg >= 2 * HK
            width = tl.where(is_v, DV, DK)
            start = tl.where(is_v, 2 * HK * DK + (seg - 2 * HK) * DV, seg * DK)
            cols = tl.arange(0, BLOCK)
            m = cols < width
            ch = start + cols
            acc = tl.zeros([BLOCK], tl.float32)
            for j in range(KERNEL):
                row = tl.load(idx_ptr + tok * KERNEL + j)
                in_conv = (row + cols * 0) < KERNEL - 1  # a vector (scalar & vector masks: int32 in the interpreter)
                old = tl.load(conv_ptr + row * C + ch, mask=m & in_conv, other=0.0)
                new = tl.load(mix_ptr + (row - (KERNEL - 1)) * mix_stride + ch, mask=m & ~in_conv, other=0.0)
                x = tl.where(in_conv, old, new).to(tl.float32)
                acc += x * tl.load(w_ptr + ch * KERNEL + j, mask=m, other=0.0).to(tl.float32)
            if RECORD:
                tl.store(rec_ptr + tok * rec_stride + ch, tl.load(mix_ptr + tok * mix_stride + ch, mask=m), mask=m)
            if COMMIT:  # one token: the window shifts by one row, in this program's channels only
                for r in tl.static_range(KERNEL - 1):
                    if r + 1 < KERNEL - 1:
                        nxt = tl.load(conv_ptr + (r + 1) * C + ch, mask=m)
                    else:
                        nxt = tl.load(mix_ptr + ch, mask=m)
                    tl.store(conv_ptr + r * C + ch, nxt, mask=m)
            ty = mix_ptr.dtype.element_ty
            y = acc.to(ty).to(tl.float32)  # as the eager form: the conv rounded, then SiLU rounded
            y = (y * tl.sigmoid(y)).to(ty).to(tl.float32)
            if is_v:
                tl.store(v_ptr + tok * (C - 2 * HK * DK) + (seg - 2 * HK) * DV + cols, y, mask=m)
            else:
                n = y * (1.0 / tl.sqrt(tl.sum(y * y, axis=0) + 1e-6))
                if seg < HK:
                    tl.store(q_ptr + (tok * HK + seg) * DK + cols, n / tl.sqrt(DK * 1.0), mask=m)
                else:
                    tl.store(k_ptr + (tok * HK + seg - HK) * DK + cols, n, mask=m)
