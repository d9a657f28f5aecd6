"""Building blocks shared by the targets and the DFlash draft."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from engine.models import fused


@dataclass(frozen=True)
class VerifyTree:
    """How the new tokens of a verify forward relate to each other.

    parents: [T] long, parents[0] == -1 (the root continues the committed context).
    depths: [T] long; token i sits at position ``start + depths[i]``.
    mask: [T, T] bool, mask[i, j] iff j is i or an ancestor of i.
    """

    parents: Tensor
    depths: Tensor
    mask: Tensor


class Cache(Protocol):
    """Per-generation state of a target: what the decode loop relies on."""

    length: int  # committed tokens whose state is in the cache

    def reset(self) -> None: ...

    def commit_path(self, start: int, path: Tensor, al: int) -> None:
        """After a verify at ``start``: keep nodes ``path[:al]`` (root first) as positions start.."""

    def snapshot(self) -> object: ...

    def restore(self, snap: object) -> None: ...


class RMSNorm(nn.Module):
    """RMSNorm; ``zero_centred`` (Qwen3.5) scales by (1 + w) with w initialised at 0."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centred: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centred = zero_centred
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return fused.rms_norm(x, self.weight, self.eps, self.zero_centred)


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict | None = None) -> Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return inv_freq.float()


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [..., T, rd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., T, rd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [..., T, heads, head_dim], cos/sin [..., T, rd]: rotates the first rd dims (partial RoPE),
    HF half layout."""
    return fused.rope(x, cos, sin)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None = None) -> Tensor:
    """q: [..., Tq, Hq, D]; k, v: [..., Tk, Hkv, D]; mask: [..., Tq, Tk] bool (True = attend) or
    None (full). Leading dims are a batch (training many sequences at once).

    Returns [..., Tq, Hq, D]. Grouped-query heads share their key/value head.
    """
    return fused.attention(q, k, v, mask, scale)


def context_mask(start: int, tree: VerifyTree | None, t: int, device: torch.device) -> Tensor:
    """[T, start + T] bool: all committed context visible; new tokens causal or ancestor-only."""
    if tree is None:
        inner = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    else:
        inner = tree.mask
    ctx = torch.ones(t, start, dtype=torch.bool, device=device)
    return torch.cat([ctx, inner], dim=1)


def new_positions(start: int, tree: VerifyTree | None, t: int, device: torch.device) -> Tensor:
    if tree is None:
        return torch.arange(start, start + t, device=device)
    return tree.depths + start


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(fused.silu_mul(self.gate_proj(x), self.up_proj(x)))


def cast_module_(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Move and cast weights, keeping RoPE frequencies in float32 (bf16 would round them)."""
    keep = {name: buf.float() for name, buf in module.named_buffers() if name.endswith("inv_freq")}
    module.to(device=device, dtype=dtype)
    for name, buf in keep.items():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        owner.register_buffer(attr, buf.to(device), persistent=False)
    return module
