"""Qwen3.5 hybrid target: Gated DeltaNet layers interleaved with gated full-attention layers.

Same forward signature and cache protocol as ``DenseModel``. Gated DeltaNet state cannot be
cropped after a verify, so a tree forward leaves the committed state alone and records every
node's delta-rule inputs and conv input (one launch per layer: ``engine.models.delta_rule``);
``commit_path`` then rebuilds the state of the accepted path from those records, recomputing the
path's recurrence for every layer in one launch (``fast`` rollback), and ``snapshot``/``restore``
support ``replay``. ``forward_static`` and
``HybridCache.commit_recurrent`` are the shape-static forms the CUDA-graph runtime replays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from engine.config import EngineInputError
from engine.models import fused
from engine.models.common import (
    Linear,
    RMSNorm,
    StepKeys,
    SwiGLU,
    VerifyTree,
    attention,
    attention_layout,
    final_norm,
    head_norms,
    new_positions,
    project,
    rope_cos_sin,
    rope_inv_freq,
    rope_rows,
)
from engine.models.delta_rule import delta_rule_path, restart_flags, tree_delta_rule
from engine.models.dense import KVCache

FULL, LINEAR = "full_attention", "linear_attention"


@dataclass(frozen=True)
class HybridConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000_000.0
    rms_norm_eps: float = 1e-6
    full_attention_interval: int = 4
    layer_types: tuple[str, ...] | None = None  # None: derived from full_attention_interval
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262144
    arch: str = "qwen3_5"

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        types = self.layer_types
        if types is None:
            every = self.full_attention_interval
            types = tuple(FULL if (i + 1) % every == 0 else LINEAR for i in range(n))
        types = tuple(types)
        if len(types) != n or any(t not in (FULL, LINEAR) for t in types):
            raise EngineInputError(
                f"layer_types must list {n} entries of {FULL!r}/{LINEAR!r}, but got {list(types)}"
            )
        object.__setattr__(self, "layer_types", types)
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise EngineInputError(
                "linear_num_value_heads must be a multiple of linear_num_key_heads, but got "
                f"{self.linear_num_value_heads} and {self.linear_num_key_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise EngineInputError(
                "num_attention_heads must be a multiple of num_key_value_heads, but got "
                f"{self.num_attention_heads} and {self.num_key_value_heads}"
            )
        if self.linear_conv_kernel_dim < 2:
            raise EngineInputError(
                f"linear_conv_kernel_dim must be >= 2, but got {self.linear_conv_kernel_dim}"
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


def hybrid_config_from_hf(cfg: Mapping) -> HybridConfig:
    """HybridConfig from an HF config.json dict: a text config, or a Qwen3.5 one nesting ``text_config``."""
    nested = cfg.get("text_config")
    text: Mapping = nested if isinstance(nested, Mapping) else cfg

    def need(key: str):
        if text.get(key) is None:
            raise EngineInputError(f"Qwen3.5 config.json: missing required key {key!r}")
        return text[key]

    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    # Text-only mrope has equal t/h/w positions, which is plain RoPE.
    if rope_type not in ("default", "mrope"):
        raise EngineInputError(f"Qwen3.5 config.json: rope_type must be 'default', but got {rope_type!r}")
    theta = rope.get("rope_theta", text.get("rope_theta"))
    if theta is None:
        raise EngineInputError("Qwen3.5 config.json: missing required key 'rope_theta'")
    # 0.25 is HF's own default for configs that predate rope_parameters.
    rotary = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    layer_types = text.get("layer_types")
    tie = text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    return HybridConfig(
        vocab_size=need("vocab_size"),
        hidden_size=need("hidden_size"),
        num_hidden_layers=need("num_hidden_layers"),
        num_attention_heads=need("num_attention_heads"),
        num_key_value_heads=need("num_key_value_heads"),
        head_dim=need("head_dim"),
        intermediate_size=need("intermediate_size"),
        linear_num_key_heads=need("linear_num_key_heads"),
        linear_num_value_heads=need("linear_num_value_heads"),
        linear_key_head_dim=need("linear_key_head_dim"),
        linear_value_head_dim=need("linear_value_head_dim"),
        linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
        partial_rotary_factor=float(rotary),
        rope_theta=float(theta),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        full_attention_interval=text.get("full_attention_interval", 4),
        layer_types=tuple(layer_types) if layer_types is not None else None,
        attention_bias=bool(text.get("attention_bias", False)),
        tie_word_embeddings=bool(tie),
        max_position_embeddings=text.get("max_position_embeddings", 262144),
    )


_HF_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
_HF_DROPPED = ("model.visual.", "visual.", "mtp.", "model.mtp.")  # vision tower, multi-token-prediction head


def hybrid_state_dict_from_hf(
    sd: Mapping[str, Tensor], tie_word_embeddings: bool = False
) -> dict[str, Tensor]:
    """HF parameter names -> ours (prefix stripped); a tied checkpoint may omit ``lm_head.weight``."""
    out: dict[str, Tensor] = {}
    for name, tensor in sd.items():
        if name.startswith(_HF_DROPPED):
            continue
        for prefix in _HF_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        out[name] = tensor
    if tie_word_embeddings and "lm_head.weight" not in out and "embed_tokens.weight" in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


class HybridCache(KVCache):
    """K/V of the attention layers (``KVCache``) plus Gated DeltaNet state per linear layer.

    rec: [gdn_layers, v_heads, dk, dv] float32 and conv: [gdn_layers, kernel-1, conv_dim], the state
    after ``length`` tokens. From the last tree forward: tree_inputs (q, k, v, g, beta, each
    [gdn_layers, nodes, ...] float32) hold every node's delta-rule inputs, tree_conv[:, i] node i's
    conv input, and tree_rec[:, i] node i's recurrent state where a later node restarts from it
    (scratch of the tree kernel; the commit recomputes the accepted path from tree_inputs).
    """

    def __init__(self, cfg: HybridConfig, max_len: int, device: torch.device, dtype: torch.dtype,
                 max_tree: int = 0) -> None:
        n_attn = cfg.layer_types.count(FULL)
        n_gdn = cfg.num_hidden_layers - n_attn
        super().__init__(n_attn, max_len, cfg.num_key_value_heads, cfg.head_dim, device, dtype)
        self.kernel = cfg.linear_conv_kernel_dim
        shape = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        self.rec = torch.zeros(n_gdn, *shape, device=device, dtype=torch.float32)
        self.conv = torch.zeros(n_gdn, self.kernel - 1, cfg.conv_dim, device=device, dtype=dtype)
        self.conv_prev = torch.zeros_like(self.conv)  # the window before the last commit
        self.tree_rec = self.rec.new_zeros(n_gdn, 0, *shape)
        self.tree_conv = self.conv.new_zeros(n_gdn, 0, cfg.conv_dim)
        self._input_shapes = [(cfg.linear_num_key_heads, cfg.linear_key_head_dim)] * 2 + [
            (cfg.linear_num_value_heads, cfg.linear_value_head_dim), (cfg.linear_num_value_heads,),
            (cfg.linear_num_value_heads,)]
        self.tree_inputs = tuple(self.rec.new_zeros(n_gdn, 0, *shp) for shp in self._input_shapes)
        # With ``keep_previous`` a commit first keeps the state it replaces (a grammar may cut the
        # step after it: ``recommit_recurrent``); allocated on the first such commit. Set for a whole
        # generation after its prefill (``reset`` clears it), so that every commit of it keeps the
        # state: a captured commit replays without this object knowing, so it cannot track them.
        self.keep_previous = False
        self.rec_prev: Tensor | None = None
        self._tree: tuple[int, int] | None = None  # (start, size) of the tree forward commit_path may use
        # True when a step launched ahead (engine.runtime) left the state past ``length``: the
        # K/V past ``length`` are ignored, but a recurrent state cannot be taken back
        self.ahead = False
        self.reserve_tree(max_tree)

    def reserve_tree(self, nodes: int) -> None:
        """Grow the per-node buffers (a fixed budget allocates once; memory is per node, per layer).
        Growing replaces the tensors: captured CUDA graphs that used the old ones are stale."""
        if nodes <= self.tree_conv.shape[1]:
            return
        n_gdn, _, *shape = self.tree_rec.shape
        self.tree_rec = self.rec.new_zeros(n_gdn, nodes, *shape)
        self.tree_conv = self.conv.new_zeros(n_gdn, nodes, self.conv.shape[-1])
        # Rows for a multiple of 4 nodes: every layer's g and beta then start 16-byte aligned, as
        # the path commit's do (the tree kernel compiles to the variant the path commit runs).
        rows = -(-nodes // 4) * 4
        self.tree_inputs = tuple(self.rec.new_zeros(n_gdn, rows, *shp) for shp in self._input_shapes)

    def begin(self, start: int, tree_size: int | None) -> None:
        """Called by the model before a forward: checks the recurrent state matches ``start``."""
        if start == 0:
            self.reset()  # a new sequence starts from zero recurrent state
        elif self.ahead:
            raise RuntimeError(f"the recurrent state was advanced past the {self.length} committed tokens (a "
                               "step launched ahead past a generation's end): only a new sequence can start here")
        elif start != self.length:
            raise RuntimeError(f"recurrent state holds {self.length} tokens; cannot run a forward at {start}")
        if tree_size is None:
            self._tree = None
        else:
            self.reserve_tree(tree_size)
            self._tree = (start, tree_size)

    def reset(self) -> None:
        super().reset()
        self.rec.zero_()
        self.conv.zero_()
        self._tree = None
        self.ahead = False
        self.keep_previous = False

    def commit_path(self, start: int, path: Tensor, al: int) -> None:
        """Fast rollback: KV compaction, then the recurrent state of node path[al-1] and the conv
        inputs along path[:al] (after the old committed ones) become the committed state."""
        al = int(al)
        if self._tree is None or self._tree[0] != start:
            raise RuntimeError(f"commit_path at {start} needs a tree forward at {start} first")
        if not 1 <= al <= self._tree[1]:
            raise RuntimeError(f"accepted length {al} outside 1..{self._tree[1]} (the tree's size)")
        path = path.to(self.rec.device)
        super().commit_path(start, path[:al], al)
        self.commit_recurrent(path, torch.tensor([al], device=path.device))
        self._tree = None

    def commit_recurrent(self, path: Tensor, al: Tensor) -> None:
        """The recurrent half of a fast commit, on the device: ``path`` [>= al] the accepted nodes
        root first (entries past ``al`` ignored), ``al`` [1] how many. The state becomes node
        path[al-1]'s, recomputed along the path from the recorded inputs (the bits the tree forward
        computed); the conv window becomes the last kernel-1 inputs along the path, reaching back
        into the old window when the path is shorter than that (kept for ``recommit_recurrent``)."""
        self.conv_prev.copy_(self.conv)
        if self.keep_previous:
            if self.rec_prev is None:
                self.rec_prev = torch.empty_like(self.rec)
            self.rec_prev.copy_(self.rec)
        self._commit_recurrent(path, al)

    def recommit_recurrent(self, path: Tensor, al: Tensor) -> None:
        """Commit a shorter prefix of the same tree instead (a grammar cut after the commit): the
        per-node records are still those of the last tree forward; the state replaced by the commit
        was kept (``keep_previous``)."""
        if not self.keep_previous or self.rec_prev is None:
            raise RuntimeError("recommit_recurrent needs the state the last commit replaced: set keep_previous "
                               "before the generation's first commit")
        self.conv.copy_(self.conv_prev)
        self.rec.copy_(self.rec_prev)
        self._commit_recurrent(path, al)

    def _commit_recurrent(self, path: Tensor, al: Tensor) -> None:
        w = self.kernel - 1
        j = al - w + torch.arange(w, device=path.device)  # path positions of the new window's slots
        from_tree = self.tree_conv.index_select(1, path.index_select(0, j.clamp(min=0)))
        from_old = self.conv.index_select(1, (j + w).clamp(0, w - 1))
        self.conv.copy_(torch.where((j >= 0)[None, :, None], from_tree, from_old))
        delta_rule_path(*self.tree_inputs, path, al, self.rec)

    def snapshot(self) -> object:
        return self.length, self.rec.clone(), self.conv.clone()

    def restore(self, snap: object) -> None:
        length, rec, conv = snap  # type: ignore[misc]
        self.length = int(length)
        self.rec.copy_(rec)
        self.conv.copy_(conv)
        self._tree = None
        self.ahead = False


def conv_window_index(parents: Tensor, kernel: int) -> Tensor:
    """[T, kernel] rows of cat(conv_state [kernel-1], new inputs [T]) forming each token's causal
    conv window: its ancestors' inputs (parents[i] = -1: the committed state) then its own."""
    p = kernel - 1
    dev = parents.device
    committed = (torch.arange(p, device=dev) - 1).clamp(min=0)  # slot 0's predecessor is never read
    back = torch.cat([committed, torch.where(parents >= 0, parents + p, p - 1)])
    cols = [torch.arange(parents.numel(), device=dev) + p]
    for _ in range(p):
        cols.append(back[cols[-1]])
    return torch.stack(cols[::-1], dim=1)


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
    restarts: Tensor | None  # a tree's restart_flags (the nodes whose state the kernel stores), once a forward


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
            out = tree_delta_rule(q, k, v, g, beta, p.parents, cache.rec[layer], cache.tree_rec[layer, :t],
                                  restarts=p.restarts)
        else:
            out = tree_delta_rule(q, k, v, g, beta, p.parents, cache.rec[layer])
        # the norm rounds the float32 output to the model's dtype (z's) itself
        return self.out_proj(self.norm(out, z.view(t, self.hv, self.dv)).reshape(t, -1))


class GatedAttention(nn.Module):
    """Full attention with q/k norm, partial RoPE and a sigmoid output gate (from q_proj)."""

    FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        d, bias = cfg.head_dim, cfg.attention_bias
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * d * 2, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * d, bias=bias)
        self.o_proj = Linear(self.n_heads * d, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, zero_centred=True)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, zero_centred=True)

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

    def forward(self, x: Tensor, delta: Tensor | None, p: _Pass) -> tuple[Tensor, Tensor]:
        """As ``DenseBlock.forward``: the input is ``x + delta``; returns the residual after the mixer
        and the MLP's output, each residual add fused with the norm that reads it."""
        mixer = self.self_attn if self.kind == FULL else self.linear_attn
        x, h = (x, self.input_layernorm(x)) if delta is None else self.input_layernorm.add_and_norm(x, delta)
        x, h = self.post_attention_layernorm.add_and_norm(x, mixer(h, p, self.slot))
        return x, self.mlp(h)


class HybridModel(nn.Module):
    """Parameter names follow HF (``model.`` / ``model.language_model.`` stripped)."""

    has_recurrent = True

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        kinds = cfg.layer_types
        self.layers = nn.ModuleList(
            HybridBlock(cfg, kind, kinds[:i].count(kind)) for i, kind in enumerate(kinds)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=True)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rotary_dim, cfg.rope_theta), persistent=False)
        self._rope_tables: dict[tuple, tuple[Tensor, Tensor]] = {}  # rope_rows
        self._chains: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}  # _chain_indices

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, max_len: int, max_tree: int = 0) -> HybridCache:
        """max_tree: tree nodes to allocate per-node state for now (0: on the first tree forward)."""
        return HybridCache(self.cfg, max_len, self.device, self.dtype, max_tree)

    def forward(
        self,
        tokens: Tensor,
        cache: HybridCache,
        start: int,
        tree: VerifyTree | None = None,
        feature_layers: Sequence[int] = (),
        last_only: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """As ``DenseModel.forward``. The recurrent state must hold exactly ``start`` tokens
        (``start == 0`` starts a new sequence). Without a tree the tokens are committed; with a tree
        the committed state is left alone and ``cache.commit_path`` (or restore + replay) follows."""
        t = tokens.shape[0]
        cache.begin(start, None if tree is None else t)
        positions = new_positions(start, tree, t, tokens.device)
        parents = torch.arange(t, device=tokens.device) - 1 if tree is None else tree.parents.to(tokens.device)
        mask = attention_layout(start, tree, t, tokens.device)
        logits, features = self._run(tokens, positions, cache, cache, start, mask, parents, tree is not None,
                                     feature_layers, last_only)
        if tree is None:
            cache.length = start + t
        return logits, features

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

    def _run(self, tokens: Tensor, positions: Tensor, kv, cache: HybridCache, start: int, mask: Tensor | StepKeys,
             parents: Tensor, tree: bool, feature_layers: Sequence[int], last_only: bool,
             chain: tuple[Tensor, Tensor, Tensor] | None = None, rope: tuple[Tensor, Tensor] | None = None
             ) -> tuple[Tensor, Tensor | None]:
        x = self.embed_tokens(tokens)
        cos, sin = rope if rope is not None else rope_cos_sin(positions, self.inv_freq, x.dtype)
        conv_index, parents32 = (chain[1], chain[2]) if chain is not None else (
            conv_window_index(parents, self.cfg.linear_conv_kernel_dim), parents.to(torch.int32))
        p = _Pass(kv=kv, state=cache, start=start, cos=cos, sin=sin, mask=mask, conv_index=conv_index,
                  parents=parents32, tree=tree, restarts=restart_flags(parents32) if tree else None)
        wanted = set(feature_layers)
        feats, delta = [], None
        for i, layer in enumerate(self.layers):
            x, delta = layer(x, delta, p)
            if i in wanted:
                feats.append(x + delta)  # the layer's output (the next norm computes the same sum)
        features = torch.cat(feats, -1) if feats else None
        return self.lm_head(final_norm(self.norm, x, delta, last_only)), features
