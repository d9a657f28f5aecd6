"""Qwen3.5 hybrid target: Gated DeltaNet layers interleaved with gated full-attention layers.

Same forward signature and cache protocol as ``DenseModel``. Gated DeltaNet state cannot be
cropped after a verify, so a tree forward leaves the committed state alone and records every
node's delta-rule inputs and conv input (one launch per layer: ``engine.models.delta_rule``);
``commit_path`` then rebuilds the state of the accepted path from those records, recomputing the
path's recurrence for every layer in one launch (``fast`` rollback), and ``snapshot``/``restore``
support ``replay``. ``forward_static`` and
``HybridCache.commit_recurrent`` are the shape-static forms the CUDA-graph runtime replays. The
configuration and its HF mapping are ``engine.models.hybrid_config``, the state
``engine.models.hybrid_cache``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from engine.models import fused
from engine.models.common import (
    AttentionProjections,
    Linear,
    RMSNorm,
    StepKeys,
    SwiGLU,
    TargetModel,
    VerifyTree,
    attention,
    head_norms,
    project,
    rope_cos_sin,
    rope_inv_freq,
    rope_rows,
)
from engine.models.delta_rule import LeafPaths, kernel_runs, leaf_paths, tree_delta_rule
from engine.models.dense import KVCache
from engine.models.hybrid_cache import HybridCache, conv_window_index
from engine.models.hybrid_config import FULL, HybridConfig


class GatedRMSNorm(nn.Module):
    """norm(x) * silu(gate). Unlike the model's other norms the weight is plain (HF inits it to 1)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        return fused.gated_rms_norm(x, gate, self.weight, self.eps)


@dataclass
class _Pass:
    """What every layer of one forward needs."""

    kv: KVCache | object  # where attention layers write K/V (the cache, or device-held slots)
    state: HybridCache  # recurrent and conv state
    start: int
    cos: Tensor
    sin: Tensor
    mask: Tensor | StepKeys  # a prefill's [T, keys] mask, or a decode step's layout (``attention_layout``)
    conv_index: Tensor  # [T, kernel]
    parents: Tensor  # [T] int32 on the device (as the delta rule kernel reads them: converted once a forward)
    tree: bool  # True: record every node's inputs, leave the committed state; False: commit a chain
    paths: LeafPaths | None  # a tree's root-to-leaf paths (the delta rule kernel's programs), once a forward


class GatedDeltaNet(nn.Module):
    FUSED = {"in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim, self.kernel = cfg.key_dim, cfg.value_dim, cfg.linear_conv_kernel_dim
        c = cfg.conv_dim
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, c, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.hv, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.hv, bias=False)
        # Only the weight [C, 1, K] is used; nn.Conv1d keeps HF's name and shape.
        self.conv1d = nn.Conv1d(c, c, self.kernel, groups=c, bias=False, padding=self.kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, cfg.hidden_size, bias=False)
        # out_proj's input order, where it is not the value heads' (a GGUF's out_proj kept in blocks
        # whose columns llama.cpp tiled and whose blocks span heads: engine.gguf_loading sets it)
        self.register_buffer("out_order", None, persistent=False)

    def forward(self, x: Tensor, p: _Pass, layer: int) -> Tensor:
        t, cache = x.shape[0], p.state
        mixed, z, b, a = project(self, "in_proj", x)  # [T, C], [T, HV * DV], [T, HV], [T, HV]
        # A tree records every node's conv input and delta-rule inputs (the commit gathers the accepted
        # path's window and recomputes its recurrence); a chain commits its window here.
        inputs = tuple(buf[layer, :t] for buf in cache.tree_inputs) if p.tree else None
        q, k, v, g, beta = fused.gdn_inputs(cache.conv[layer], mixed, p.conv_index, self.conv1d.weight[:, 0, :], a,
                                            b, self.A_log, self.dt_bias, self.hk, self.dk, self.hv, self.dv,
                                            commit=not p.tree, record=cache.tree_conv[layer, :t] if p.tree else None,
                                            out=inputs)
        if p.tree:
            out = tree_delta_rule(q, k, v, g, beta, p.parents, cache.rec[layer], tree=True, paths=p.paths)
        else:
            out = tree_delta_rule(q, k, v, g, beta, p.parents, cache.rec[layer])
        # the norm rounds the float32 output to the model's dtype (z's) itself
        y = self.norm(out, z.view(t, self.hv, self.dv)).reshape(t, -1)
        return self.out_proj(y if self.out_order is None else y.index_select(1, self.out_order))


class GatedAttention(AttentionProjections):
    """Full attention with q/k norm, partial RoPE and a sigmoid output gate (from q_proj)."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.attention_bias, cfg.rms_norm_eps, qk_norm=True, out=Linear, out_bias=cfg.attention_bias,
                         gated=True, zero_centred=True)

    def forward(self, x: Tensor, p: _Pass, layer: int) -> Tensor:
        t = x.shape[0]
        q_gate, k, v = project(self, "qkv_proj", x)
        # q_proj rows are per head [query | gate], not [all queries | all gates].
        q, gate = q_gate.view(t, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k, v = k.view(t, self.n_kv, self.head_dim), v.view(t, self.n_kv, self.head_dim)
        q, keys, values = p.kv.rope_write(layer, p.start, q, k, v, p.cos, p.sin, head_norms(self.q_norm, self.k_norm))
        # the output gate inside the attention's merge launch: a sigmoid and a product fewer per layer
        return self.o_proj(attention(q, keys, values, p.mask, gate=gate).reshape(t, -1))


class HybridBlock(nn.Module):
    def __init__(self, cfg: HybridConfig, kind: str, slot: int) -> None:
        super().__init__()
        self.kind, self.slot = kind, slot  # slot: index among the layers of this kind (cache row)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=True)
        if kind == FULL:
            self.self_attn = GatedAttention(cfg)
        else:
            self.linear_attn = GatedDeltaNet(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=True)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: Tensor, delta: Tensor | None, p: _Pass, tee: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """As ``DenseBlock.forward``: the input is ``x + delta`` (also written to ``tee``); returns the
        residual after the mixer and the MLP's output, each residual add fused with the norm that reads it."""
        mixer = self.self_attn if self.kind == FULL else self.linear_attn
        x, h = (x, self.input_layernorm(x)) if delta is None else self.input_layernorm.add_and_norm(x, delta, tee)
        x, h = self.post_attention_layernorm.add_and_norm(x, mixer(h, p, self.slot))
        return x, self.mlp(h)


class HybridModel(TargetModel):
    """Parameter names follow HF (``model.`` / ``model.language_model.`` stripped)."""

    has_recurrent = True

    def __init__(self, cfg: HybridConfig) -> None:
        kinds = cfg.layer_types
        super().__init__(cfg, lambda: nn.ModuleList(HybridBlock(cfg, kind, kinds[:i].count(kind))
                                                    for i, kind in enumerate(kinds)),
                         RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=True), HybridModel.rope_freqs(cfg))
        self._chains: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}  # _chain_indices

    @staticmethod
    def rope_freqs(cfg: HybridConfig) -> Tensor:
        """The RoPE frequencies (float32) a model of ``cfg`` holds (``DenseModel.rope_freqs``)."""
        return rope_inv_freq(cfg.rotary_dim, cfg.rope_theta)

    def new_cache(self, max_len: int, max_tree: int = 0) -> HybridCache:
        """max_tree: tree nodes to allocate per-node state for now (0: on the first tree forward)."""
        return HybridCache(self.cfg, max_len, self.device, self.dtype, max_tree)

    def _begin(self, cache: HybridCache, start: int, tree: VerifyTree | None, t: int) -> None:
        """The recurrent state must hold exactly ``start`` tokens (``start == 0`` starts a new
        sequence). With a tree the committed state is left alone (``HybridCache.begin``)."""
        cache.begin(start, None if tree is None else t)

    def _forward(self, tokens: Tensor, positions: Tensor, cache: HybridCache, start: int, mask: Tensor | StepKeys,
                 tree: VerifyTree | None, feature_layers: Sequence[int], last_only: bool
                 ) -> tuple[Tensor, Tensor | None]:
        parents = torch.arange(tokens.shape[0], device=tokens.device) - 1 if tree is None \
            else tree.parents.to(tokens.device)
        return self._run(tokens, positions, cache, cache, start, mask, parents, tree is not None, feature_layers,
                         last_only)

    def forward_static(self, tokens: Tensor, positions: Tensor, slots: Tensor, keys: StepKeys, cache: HybridCache,
                       feature_layers: Sequence[int] = (), parents: Tensor | None = None
                       ) -> tuple[Tensor, Tensor | None]:
        """The shape-static forward CUDA graphs replay (``DenseModel.forward_static``). Without
        ``parents`` the tokens are a chain committed to the recurrent state (an AR step); with
        ``parents`` [T] a tree whose every node's inputs are recorded for ``commit_recurrent``.
        Nothing is checked on the host: the caller keeps the state at the root's position."""
        from engine.models.dense import _SlotWriter

        tree = parents is not None
        chain = None if tree else self._chain_indices(tokens.shape[0], tokens.device)
        if parents is None:
            parents = chain[0]
        return self._run(tokens, positions, _SlotWriter(cache, slots, keys.key_len), cache, 0, keys, parents, tree,
                         feature_layers, False, chain, rope_rows(self, positions, keys.key_len, self.dtype))

    def _chain_indices(self, t: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """A chain of ``t`` tokens' parents, conv window rows and int32 parents: the same at every
        step, made once (an AR step's graph reads them instead of making them: ~17 launches)."""
        if (t, device) not in self._chains:
            parents = torch.arange(t, device=device) - 1
            self._chains[(t, device)] = (parents, conv_window_index(parents, self.cfg.linear_conv_kernel_dim),
                                         parents.to(torch.int32))
        return self._chains[(t, device)]

    @staticmethod
    def _leaf_paths(parents: Tensor, mask: Tensor | StepKeys) -> LeafPaths | None:
        """A tree's root-to-leaf paths for the delta rule kernel, once a forward (None where the torch
        loop runs: it follows the parents); a decode step's layout brings its ancestor tables."""
        if not kernel_runs(parents):
            return None
        if isinstance(mask, StepKeys):
            return leaf_paths(parents, mask.ancestors, mask.depths)
        return leaf_paths(parents)

    def _run(self, tokens: Tensor, positions: Tensor, kv, cache: HybridCache, start: int, mask: Tensor | StepKeys,
             parents: Tensor, tree: bool, feature_layers: Sequence[int], last_only: bool,
             chain: tuple[Tensor, Tensor, Tensor] | None = None, rope: tuple[Tensor, Tensor] | None = None
             ) -> tuple[Tensor, Tensor | None]:
        x = self.embed_tokens(tokens)
        cos, sin = rope if rope is not None else rope_cos_sin(positions, self.inv_freq, x.dtype)
        conv_index, parents32 = (chain[1], chain[2]) if chain is not None else (
            conv_window_index(parents, self.cfg.linear_conv_kernel_dim), parents.to(torch.int32))
        p = _Pass(kv=kv, state=cache, start=start, cos=cos, sin=sin, mask=mask, conv_index=conv_index,
                  parents=parents32, tree=tree, paths=self._leaf_paths(parents32, mask) if tree else None)
        return self._stack(x, lambda layer, i, h, delta, tee: layer(h, delta, p, tee), feature_layers, last_only)
