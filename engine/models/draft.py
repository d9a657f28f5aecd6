"""DFlash block-diffusion draft: target features injected as keys/values into every layer.

Parameter names match the public DFlash checkpoints (`fc`, `hidden_norm`, `layers.*`, `norm`);
the draft has no embedding or lm_head of its own: it borrows the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from engine.models import fused
from engine.models.common import (
    AttentionProjections,
    RMSNorm,
    SwiGLU,
    apply_rope,
    attention,
    final_norm,
    head_norms,
    project,
    project_part,
    rope_cos_sin,
    rope_inv_freq,
    rope_rows,
)


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    block_size: int = 16
    mask_token_id: int = 0
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    output_multiplier: float = 1.0

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


def default_target_layer_ids(n_target_layers: int, n_ids: int = 5) -> tuple[int, ...]:
    """Evenly spaced from 1 to n-3 (36 layers -> 1, 9, 17, 25, 33), as the public drafts pick them."""
    lo, hi = 1, max(1, n_target_layers - 3)
    n_ids = max(1, min(n_ids, hi - lo + 1))
    if n_ids == 1:
        return (lo,)
    return tuple(sorted({round(lo + i * (hi - lo) / (n_ids - 1)) for i in range(n_ids)}))


class DraftAttention(AttentionProjections):
    # q/k/v fused for inference (``DFlashDrafter``): checkpoints and training keep the three parts.
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dim_per_head,
                         cfg.attention_bias, cfg.rms_norm_eps, qk_norm=True, out_bias=cfg.attention_bias)

    def forward(self, h: Tensor, ctx: Tensor, cos_q: Tensor, sin_q: Tensor, cos_k: Tensor, sin_k: Tensor,
                mask: Tensor | None) -> Tensor:
        """Keys and values: the context's first, then the block's own."""
        lead = h.shape[:-1]  # [..., B]: a batch of sequences in training, one block at decode time
        q = project_part(self, "qkv_proj", "q_proj", h).view(*lead, self.n_heads, self.head_dim)
        q = apply_rope(self.q_norm(q), cos_q, sin_q)
        k, v = self._kv(torch.cat([ctx, h], dim=-2), cos_k, sin_k)
        return self.o_proj(attention(q, k, v, mask).reshape(*lead, -1))

    def forward_cached(self, h: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, lo: int,
                       start: int, mask: Tensor) -> Tensor:
        """The generic loop's step: the block ``h`` [B, H] at positions start..start+B-1; its keys and values
        written at those slots of the caches [S, kv_heads, head_dim] (whose slots before ``start`` hold the
        context's, ``DFlashDraft.context_kv``'s), and its queries attending over slots lo..start+B-1 in place
        through ``mask`` [B, start + B - lo]: on CUDA the few-row kernel, which reads each K/V head once (no
        copy of the context's keys and values, none widened to every query head or cast to float32)."""
        b = h.shape[0]
        q = project_part(self, "qkv_proj", "q_proj", h).view(b, self.n_heads, self.head_dim)
        q = apply_rope(self.q_norm(q), cos, sin)
        k_cache[start : start + b], v_cache[start : start + b] = self._kv(h, cos, sin)
        return self.o_proj(attention(q, k_cache[lo : start + b], v_cache[lo : start + b], mask).reshape(b, -1))

    def _kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        shape = (*x.shape[:-1], self.n_kv, self.head_dim)
        k = self.k_norm(project_part(self, "qkv_proj", "k_proj", x).view(shape))
        return apply_rope(k, cos, sin), project_part(self, "qkv_proj", "v_proj", x).view(shape)

    def forward_static(self, x: Tensor, block: int, cos: Tensor, sin: Tensor, slots: Tensor, k_cache: Tensor,
                       v_cache: Tensor, key_len: int, mask: Tensor) -> Tensor:
        """The runtime's step: ``x`` [C + block, H] the normed new context rows then the block's;
        their keys and values land at ``slots`` of the caches [S, kv_heads, head_dim] (one GEMM and
        one launch for the norms, RoPE and the writes; the context rows' queries are computed and
        dropped, cheaper than a second GEMM), and the block's queries attend over the first
        ``key_len`` slots through ``mask`` [block, key_len]. Returns [block, H]."""
        t = x.shape[0]
        q, k, v = project(self, "qkv_proj", x)
        q = fused.rope_write(q.view(t, self.n_heads, self.head_dim), k.view(t, self.n_kv, self.head_dim),
                             v.view(t, self.n_kv, self.head_dim), cos, sin, slots, k_cache, v_cache,
                             head_norms(self.q_norm, self.k_norm))
        o = attention(q[t - block:], k_cache[:key_len], v_cache[:key_len], mask)
        return self.o_proj(o.reshape(block, -1))


class DraftBlock(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, ctx, cos_q, sin_q, cos_k, sin_k, mask) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), ctx, cos_q, sin_q, cos_k, sin_k, mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_cached(self, h: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, lo: int,
                       start: int, mask: Tensor) -> Tensor:
        h = h + self.self_attn.forward_cached(self.input_layernorm(h), cos, sin, k_cache, v_cache, lo, start, mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_static(self, x: Tensor, delta: Tensor | None, ctx: Tensor, cos: Tensor, sin: Tensor, slots: Tensor,
                       k_cache: Tensor, v_cache: Tensor, key_len: int, mask: Tensor) -> tuple[Tensor, Tensor]:
        """As the target's blocks: the input is ``x + delta``, each residual add fused with the norm
        that reads it; returns the residual after attention and the MLP's output."""
        x, h = (x, self.input_layernorm(x)) if delta is None else self.input_layernorm.add_and_norm(x, delta)
        a = self.self_attn.forward_static(torch.cat([ctx, h]), x.shape[0], cos, sin, slots, k_cache, v_cache,
                                          key_len, mask)
        x, h = self.post_attention_layernorm.add_and_norm(x, a)
        return x, self.mlp(h)


class DFlashDraft(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        n_feat = len(cfg.target_layer_ids)
        self.fc = nn.Linear(n_feat * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.dim_per_head, cfg.rope_theta), persistent=False)
        self._rope_tables: dict[tuple, tuple[Tensor, Tensor]] = {}  # rope_rows

    def forward(
        self,
        block_embeds: Tensor,
        ctx_features: Tensor,
        ctx_positions: Tensor,
        block_positions: Tensor,
        mask: Tensor | None = None,
    ) -> Tensor:
        """block_embeds [..., B, H]; ctx_features [..., W, n_ids * H]; positions absolute ([..., B],
        [..., W]). Returns [..., B, H]. Leading dims batch several sequences (training).

        ``mask`` ([..., B, W + B] bool) is for training many blocks at once (block-diagonal); at
        decode time the block sees all its context and itself bidirectionally.
        """
        ctx = self.hidden_norm(self.fc(ctx_features))
        dtype = block_embeds.dtype
        cos_q, sin_q = rope_cos_sin(block_positions, self.inv_freq, dtype)
        cos_k, sin_k = rope_cos_sin(torch.cat([ctx_positions, block_positions], dim=-1), self.inv_freq, dtype)
        h = block_embeds
        for layer in self.layers:
            h = layer(h, ctx, cos_q, sin_q, cos_k, sin_k, mask)
        return self.norm(h)

    def context_kv(self, ctx_features: Tensor, ctx_positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per layer, the context's keys (normed, rotated) and values, [W, kv_heads, head_dim] each.

        They depend only on the target features and their positions (every layer attends to the
        same projected features, not to the draft's evolving hidden state), so a drafter can
        compute each committed position's once and keep them (``forward_cached``).
        """
        ctx = self.hidden_norm(self.fc(ctx_features))
        cos, sin = rope_cos_sin(ctx_positions, self.inv_freq, ctx.dtype)
        return [layer.self_attn._kv(ctx, cos, sin) for layer in self.layers]

    def forward_cached(self, block_embeds: Tensor, context: tuple[Tensor, Tensor], lo: int, start: int) -> Tensor:
        """``forward`` of the block ``block_embeds`` [B, H] at positions start..start+B-1 over the context
        of positions lo..start-1 held as keys and values in ``context`` ([layers, S, kv_heads, head_dim]
        each, S >= start + B: ``context_kv``'s at slots lo..start-1). Each layer writes the block's keys
        and values at slots start..start+B-1 (not context: the next call's context overwrites them) and
        attends over the slots in place: the block sees all of them and itself (a step's transient is the
        block's, not the context's: ``DraftAttention.forward_cached``). Returns [B, H]."""
        b = block_embeds.shape[0]
        cos, sin = rope_cos_sin(torch.arange(start, start + b, device=block_embeds.device), self.inv_freq,
                                block_embeds.dtype)
        mask = torch.ones(b, start + b - lo, dtype=torch.bool, device=block_embeds.device)
        h = block_embeds
        for i, layer in enumerate(self.layers):
            h = layer.forward_cached(h, cos, sin, context[0][i], context[1][i], lo, start, mask)
        return self.norm(h)

    def forward_static(self, block_embeds: Tensor, ctx_features: Tensor, slots: Tensor, k_cache: Tensor,
                       v_cache: Tensor, key_len: int, mask: Tensor) -> Tensor:
        """The runtime's shape-static step over cached context keys and values.

        ctx_features [C, n_ids * H]: the target features of the context positions ``slots[:C]``
        (positions committed since the last step among them); block_embeds [B, H] at positions
        ``slots[C:]``. Every layer writes the keys and values of both to those slots of its
        caches (``k_cache``/``v_cache`` [layers, S, kv_heads, head_dim]: the context's stay for
        later steps, the block's are overwritten by the next step's) and the block attends over
        the first ``key_len`` slots through ``mask`` [B, key_len]. Returns [B, H] (``forward``'s
        output for that context, up to rounding)."""
        ctx = self.hidden_norm(self.fc(ctx_features))
        cos, sin = rope_rows(self, slots, key_len, block_embeds.dtype)  # a slot is its position (< key_len)
        x, delta = block_embeds, None
        for i, layer in enumerate(self.layers):
            x, delta = layer.forward_static(x, delta, ctx, cos, sin, slots, k_cache[i], v_cache[i], key_len, mask)
        return final_norm(self.norm, x, delta, False)
