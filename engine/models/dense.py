"""Dense Llama / Qwen3-family target: RMSNorm, RoPE, GQA, SwiGLU, optional q/k norm, tied lm_head."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from engine.models import attention as split_attention
from engine.models import fused
from engine.models.common import (
    AttentionProjections,
    Linear,
    RMSNorm,
    StepKeys,
    SwiGLU,
    TargetModel,
    VerifyTree,
    apply_rope,
    attention,
    head_norms,
    project,
    rope_cos_sin,
    rope_inv_freq,
    rope_rows,
)


@dataclass(frozen=True)
class DenseConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    qk_norm: bool = False  # Qwen3
    attention_bias: bool = False  # Qwen2
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    arch: str = "llama"

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


class KVCache:
    """Static K/V for every attention layer, allocated once: [layers, max_len, kv_heads, head_dim]."""

    def __init__(self, n_layers: int, max_len: int, kv_heads: int, head_dim: int, device, dtype) -> None:
        self.k = torch.zeros(n_layers, max_len, kv_heads, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.max_len = max_len
        self.length = 0

    def reset(self) -> None:
        self.length = 0

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        end = start + k.shape[0]
        if end > self.max_len:
            raise RuntimeError(f"KV cache overflow: need {end} slots, have {self.max_len}")
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        return self.k[layer, :end], self.v[layer, :end]

    def rope_write(self, layer: int, start: int, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
                   norms: fused.HeadNorms | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """The heads' norms (if any) and RoPE on q and k, then ``write``: (rotated q, the layer's
        keys, its values)."""
        if norms is not None:
            q, k = norms.apply(q, k)
        return apply_rope(q, cos, sin), *self.write(layer, start, apply_rope(k, cos, sin), v)

    def commit_path(self, start: int, path: Tensor, al: int) -> None:
        """KV compaction: the accepted nodes' slots move to start..start+al-1."""
        src = path[:al] + start
        dst = slice(start, start + al)
        self.k[:, dst] = self.k[:, src]  # advanced indexing copies before the write
        self.v[:, dst] = self.v[:, src]
        self.length = start + al

    def snapshot(self) -> object:
        return self.length

    def restore(self, snap: object) -> None:
        self.length = int(snap)  # type: ignore[arg-type]


class DenseAttention(AttentionProjections):
    def __init__(self, cfg: DenseConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dim_per_head,
                         cfg.attention_bias, cfg.rms_norm_eps, cfg.qk_norm, out=Linear)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int, start: int,
                mask: Tensor | StepKeys) -> Tensor:
        t = x.shape[0]
        q, k, v = project(self, "qkv_proj", x)
        q = q.view(t, self.n_heads, self.head_dim)
        k = k.view(t, self.n_kv, self.head_dim)
        v = v.view(t, self.n_kv, self.head_dim)
        norms = head_norms(self.q_norm, self.k_norm) if self.q_norm is not None else None
        q, keys, values = cache.rope_write(layer, start, q, k, v, cos, sin, norms)
        return self.o_proj(attention(q, keys, values, mask).reshape(t, -1))


class DenseBlock(nn.Module):
    def __init__(self, cfg: DenseConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DenseAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: Tensor, delta: Tensor | None, cos: Tensor, sin: Tensor, cache, layer: int, start: int,
                mask: Tensor | StepKeys, tee: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """This layer's input is ``x + delta`` (``delta``: the previous layer's MLP output, None for
        the first layer; ``tee``: that input written there too, the previous layer's features).
        Returns the residual after attention and this layer's MLP output: each residual add is fused
        with the norm that reads it (``RMSNorm.add_and_norm``)."""
        x, h = (x, self.input_layernorm(x)) if delta is None else self.input_layernorm.add_and_norm(x, delta, tee)
        x, h = self.post_attention_layernorm.add_and_norm(x, self.self_attn(h, cos, sin, cache, layer, start, mask))
        return x, self.mlp(h)


class DenseModel(TargetModel):
    """Parameter names follow HF (`model.` prefix stripped) so checkpoints load by name."""

    has_recurrent = False

    def __init__(self, cfg: DenseConfig) -> None:
        super().__init__(cfg, lambda: nn.ModuleList(DenseBlock(cfg) for _ in range(cfg.num_hidden_layers)),
                         RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), DenseModel.rope_freqs(cfg))

    @staticmethod
    def rope_freqs(cfg: DenseConfig) -> Tensor:
        """The RoPE frequencies (float32) a model of ``cfg`` holds: made again for one built on the meta
        device and given memory after (``build_model`` with blocks leaves them unmade)."""
        return rope_inv_freq(cfg.dim_per_head, cfg.rope_theta, cfg.rope_scaling)

    def new_cache(self, max_len: int) -> KVCache:
        c = self.cfg
        return KVCache(c.num_hidden_layers, max_len, c.num_key_value_heads, c.dim_per_head, self.device, self.dtype)

    def _forward(self, tokens: Tensor, positions: Tensor, cache: KVCache, start: int, mask: Tensor | StepKeys,
                 tree: VerifyTree | None, feature_layers: Sequence[int], last_only: bool
                 ) -> tuple[Tensor, Tensor | None]:
        return self._run(self.embed_tokens(tokens), positions, cache, start, mask, feature_layers, last_only)

    def forward_static(self, tokens: Tensor, positions: Tensor, slots: Tensor, keys: StepKeys, cache: KVCache,
                       feature_layers: Sequence[int] = (), parents: Tensor | None = None
                       ) -> tuple[Tensor, Tensor | None]:
        """The shape-static forward CUDA graphs replay: K/V land in the device-held ``slots`` [T]
        and every query attends over the first ``keys.key_len`` slots as ``keys`` lays them out
        (``step_attention``). No host value depends on where the sequence is, so one capture serves
        every step. (``parents`` matters to recurrent targets only: attention sees the tree through
        ``keys``.)"""
        x = self.embed_tokens(tokens)
        return self._run(x, positions, _SlotWriter(cache, slots, keys.key_len), 0, keys, feature_layers, False,
                         rope_rows(self, positions, keys.key_len, x.dtype))

    def _run(self, x: Tensor, positions: Tensor, cache, start: int, mask: Tensor | StepKeys,
             feature_layers: Sequence[int], last_only: bool, rope: tuple[Tensor, Tensor] | None = None
             ) -> tuple[Tensor, Tensor | None]:
        cos, sin = rope if rope is not None else rope_cos_sin(positions, self.inv_freq, x.dtype)
        return self._stack(x, lambda layer, i, h, delta, tee: layer(h, delta, cos, sin, cache, i, start, mask, tee),
                           feature_layers, last_only)


class _SlotWriter:
    """A KVCache seen through device-held write slots and a fixed key span (``forward_static``)."""

    def __init__(self, cache: KVCache, slots: Tensor, key_len: int) -> None:
        self.cache, self.slots, self.key_len = cache, slots, key_len

    def rope_write(self, layer: int, start: int, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
                   norms: fused.HeadNorms | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``KVCache.rope_write`` at the device-held slots: one launch on CUDA (``fused.rope_write``)."""
        c = self.cache
        q = fused.rope_write(q, k, v, cos, sin, self.slots, c.k[layer], c.v[layer], norms)
        return q, c.k[layer, : self.key_len], c.v[layer, : self.key_len]


@dataclass
class BatchKV:
    """K/V for a batch of left-padded sequences (draft training data generation)."""

    k: Tensor  # [layers, B, S, kv_heads, head_dim]
    v: Tensor
    valid: Tensor  # [B, S] bool: slot holds a real token (not padding)


def forward_padded(
    model: DenseModel,
    tokens: Tensor,
    positions: Tensor,
    valid: Tensor,
    kv: BatchKV | None = None,
    start: int = 0,
    feature_layers: Sequence[int] = (),
    logits: bool = True,
    last_only: bool = False,
) -> tuple[Tensor | None, Tensor | None]:
    """A batched forward of the dense target over [B, T] tokens (left padding allowed).

    The decode engine runs one sequence at a time; this batched form exists to generate
    self-distillation data and target features fast. ``valid`` marks real tokens of this chunk;
    with ``kv`` the chunk is written to slots start..start+T-1 and attends to earlier slots.
    Returns (logits [B, T, V] or None, features [B, T, n_ids * H] or None); with ``last_only`` the
    logits of the last position only, [B, 1, V] (a prefill of 512 long prompts would need ~90 GiB
    for all of SmolLM2's).
    """
    b, t = tokens.shape
    d = model.cfg.dim_per_head
    x = model.embed_tokens(tokens)
    cos, sin = rope_cos_sin(positions.reshape(-1), model.inv_freq, x.dtype)
    if kv is not None:
        kv.valid[:, start : start + t] = valid
        key_valid = kv.valid[:, : start + t]
    else:
        key_valid = valid
    s = key_valid.shape[1]
    q_slot = torch.arange(start, start + t, device=x.device)
    causal = torch.arange(s, device=x.device)[None, :] <= q_slot[:, None]  # [T, S]
    # Padding queries see themselves only, so no row of the mask is empty (no NaNs).
    own = torch.arange(s, device=x.device)[None, :] == q_slot[:, None]
    mask = (causal[None] & key_valid[:, None, :]) | own[None]  # [B, T, S]
    wanted, feats = set(feature_layers), []
    for i, layer in enumerate(model.layers):
        att = layer.self_attn
        h = layer.input_layernorm(x).reshape(b * t, -1)
        q, k, v = project(att, "qkv_proj", h)
        q, k, v = q.view(b * t, att.n_heads, d), k.view(b * t, att.n_kv, d), v.view(b, t, att.n_kv, d)
        if att.q_norm is not None:
            q, k = att.q_norm(q), att.k_norm(k)
        q = apply_rope(q, cos, sin).view(b, t, att.n_heads, d)
        k = apply_rope(k, cos, sin).view(b, t, att.n_kv, d)
        if kv is not None:
            kv.k[i, :, start : start + t], kv.v[i, :, start : start + t] = k, v
            k, v = kv.k[i, :, : start + t], kv.v[i, :, : start + t]
        x = x + att.o_proj(_grouped_attention(q, k, v, mask))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if i in wanted:
            feats.append(x)
    out = model.lm_head(model.norm(x[:, -1:] if last_only else x)) if logits else None
    return out, (torch.cat(feats, -1) if feats else None)


def _grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """q [B, T, H, D], k/v [B, S, Hkv, D], mask [B, T, S] -> [B, T, H * D].

    The query heads that share a K/V head are stacked along the query axis, so the memory-efficient
    kernel (which takes any mask but not grouped heads) runs without copying K/V once per group.
    A decode step of many sequences (few query rows) takes the fused attention on CUDA instead:
    batched SDPA over a long padded cache with three query rows per head is mostly idle.
    """
    b, t, h, d = q.shape
    if t <= split_attention.SMALL_QUERIES and fused.use_kernels(q, k, v):
        return split_attention.attention(q, k, v, mask).reshape(b, t, h * d)
    hkv = k.shape[2]
    g = h // hkv
    q = q.view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
    m = mask[:, None, None].expand(b, 1, g, t, mask.shape[-1]).reshape(b, 1, g * t, mask.shape[-1])
    o = torch.nn.functional.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=m)
    return o.view(b, hkv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, h * d)
