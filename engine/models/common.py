"""Building blocks shared by the targets and the DFlash draft."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.config import EngineInputError
from engine.models import attention as split_attention
from engine.models import fused
from engine.models import linear as rows_linear
from engine.models.attention import StepKeys
from engine.models.quant import QuantFusedLinear, QuantLinear, fusable


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

    def add_and_norm(self, x: Tensor, delta: Tensor, tee: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The residual add and the norm that reads it, in one launch on CUDA:
        ``(x + delta, norm(x + delta))``, the sum rounded to the dtype as PyTorch's add rounds it
        (``tee``: written there too, ``fused.add_rms_norm``)."""
        return fused.add_rms_norm(x, delta, self.weight, self.eps, self.zero_centred, tee)


def head_norms(q_norm: RMSNorm, k_norm: RMSNorm) -> fused.HeadNorms:
    """The query and key heads' norms as ``fused.rope_write`` applies them (one eps: the model's)."""
    return fused.HeadNorms(q_norm.weight, k_norm.weight, q_norm.eps, q_norm.zero_centred)


def final_norm(norm: RMSNorm, x: Tensor, delta: Tensor | None, last_only: bool, tee: Tensor | None = None
               ) -> Tensor:
    """The model's final norm of the last layer's output ``x + delta`` (of its last row only with
    ``last_only``); ``tee``: that output of every row written there (the last layer's features)."""
    if tee is not None and (last_only or delta is None):  # the norm reads fewer rows (or no add): a sum of its own
        if delta is None:
            tee.copy_(x)
        else:
            torch.add(x, delta, out=tee)
        tee = None
    if last_only:
        x, delta = x[-1:], None if delta is None else delta[-1:]
    return norm(x) if delta is None else norm.add_and_norm(x, delta, tee)[1]


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


def rope_rows(module: nn.Module, positions: Tensor, size: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``rope_cos_sin(positions, module.inv_freq, dtype)`` for positions below ``size``, as rows of
    a table of every such position made once per (size, dtype) and kept on ``module`` (its
    ``_rope_tables``): a captured step gathers two rows instead of computing them in seven launches.
    The values are rope_cos_sin's, elementwise, so the bits are too."""
    key = (size, dtype, positions.device)
    tables = module._rope_tables
    if key not in tables:
        tables[key] = rope_cos_sin(torch.arange(size, device=positions.device), module.inv_freq, dtype)
    cos, sin = tables[key]
    return cos[positions], sin[positions]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [..., T, heads, head_dim], cos/sin [..., T, rd]: rotates the first rd dims (partial RoPE),
    HF half layout."""
    return fused.rope(x, cos, sin)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | StepKeys | None, scale: float | None = None,
              gate: Tensor | None = None) -> Tensor:
    """q: [..., Tq, Hq, D]; k, v: [..., Tk, Hkv, D]; mask: [..., Tq, Tk] bool (True = attend) or
    None (full). Leading dims are a batch (training many sequences at once). gate: [..., Tq, Hq, D]
    or None: the output times ``sigmoid(gate)``, with the eager ops' bits (``engine.models.attention``).
    A decode step's layout (``StepKeys``, unbatched) takes ``step_attention``: each new token's
    result has the bits of an AR step at its position.

    Returns [..., Tq, Hq, D]. Grouped-query heads share their key/value head.
    """
    if isinstance(mask, StepKeys):
        return split_attention.step_attention(q, k, v, mask, scale, gate)
    return split_attention.attention(q, k, v, mask, scale, gate)


def context_mask(start: int, tree: VerifyTree | None, t: int, device: torch.device) -> Tensor:
    """[T, start + T] bool: all committed context visible; new tokens causal or ancestor-only."""
    if tree is None:
        inner = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    else:
        inner = tree.mask
    ctx = torch.ones(t, start, dtype=torch.bool, device=device)
    return torch.cat([ctx, inner], dim=1)


def attention_layout(start: int, tree: VerifyTree | None, t: int, device: torch.device,
                     as_steps: bool = False) -> Tensor | StepKeys:
    """How a forward of ``t`` tokens at ``start`` attends. A prefill (``start`` 0, no tree) takes the
    mask of ``context_mask`` unless ``as_steps``; every other forward continues a sequence (an AR step,
    a verify, a replay) and is a decode step: ``StepKeys``, so that its rows round as AR steps at their
    positions do and speculative decoding commits AR's tokens in half precision too."""
    if start == 0 and tree is None and not as_steps:
        return context_mask(start, tree, t, device)
    start_t = torch.tensor([start], device=device)
    if tree is None:
        return split_attention.chain_keys(start_t, t, start + t)
    depths = tree.depths.to(device=device, dtype=torch.int32)
    return StepKeys(start_t, depths, split_attention.ancestor_table(tree.mask, depths, t), start + t)


def new_positions(start: int, tree: VerifyTree | None, t: int, device: torch.device) -> Tensor:
    if tree is None:
        return torch.arange(start, start + t, device=device)
    return tree.depths + start


class TargetModel(nn.Module):
    """What the dense and hybrid targets share: HF's parameter names (``embed_tokens``, ``layers``,
    ``norm``, ``lm_head``, tied to the embedding if the config says so), created in that order (the
    seeded random presets draw their weights in it), the RoPE frequencies and the row tables
    ``rope_rows`` keeps, and where the weights live."""

    def __init__(self, cfg, make_layers: Callable[[], nn.ModuleList], norm: RMSNorm, inv_freq: Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = make_layers()
        self.norm = norm
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # Each checkpoint tensor's type in its file (a GGUF's tensor types, by our names; empty where the
        # loader does not say): what ``quant.weights_summary`` reports beside the blocks kept native.
        self.weight_types: dict[str, str] = {}
        self._rope_tables: dict[tuple, tuple[Tensor, Tensor]] = {}  # rope_rows

    @property
    def device(self) -> torch.device:
        embed = self.embed_tokens  # (a ``quant.QuantEmbedding`` in blocks says its own)
        return embed.weight.device if isinstance(embed, nn.Embedding) else embed.device

    @property
    def dtype(self) -> torch.dtype:
        embed = self.embed_tokens
        return embed.weight.dtype if isinstance(embed, nn.Embedding) else embed.dtype

    def forward(self, tokens: Tensor, cache, start: int, tree: VerifyTree | None = None,
                feature_layers: Sequence[int] = (), last_only: bool = False, as_steps: bool = False
                ) -> tuple[Tensor, Tensor | None]:
        """tokens [T] at positions start.. (or start + tree depths), positions known on the host (a
        prefill, the generic loop); K/V land in slots start..start+T-1. ``forward_static`` is the
        same layers with the positions, slots and key layout held on the device (the runtime).

        Returns logits [T, V] (or [1, V] with last_only) and the outputs of ``feature_layers``
        concatenated on the feature axis, [T, len * H] (None when no layers are asked). Without a
        tree the tokens are committed (cache.length = start + T); with a tree the caller commits the
        accepted path (``cache.commit_path``, or on a hybrid restore + replay). ``as_steps``: a forward
        at 0 takes the decode steps' layout too (``attention_layout``; the prefix cache's prefill:
        every row then rounds as an AR step at its position, ``engine.decoding.prefix_cache``)."""
        t = tokens.shape[0]
        self._begin(cache, start, tree, t)
        positions = new_positions(start, tree, t, tokens.device)
        mask = attention_layout(start, tree, t, tokens.device, as_steps)
        logits, features = self._forward(tokens, positions, cache, start, mask, tree, feature_layers, last_only)
        if tree is None:
            cache.length = start + t
        return logits, features

    def _begin(self, cache, start: int, tree: VerifyTree | None, t: int) -> None:
        """Checks or prepares the cache before a host-position forward (the hybrid's recurrent state)."""

    def _forward(self, tokens: Tensor, positions: Tensor, cache, start: int, mask: Tensor | StepKeys,
                 tree: VerifyTree | None, feature_layers: Sequence[int], last_only: bool
                 ) -> tuple[Tensor, Tensor | None]:
        raise NotImplementedError

    def _stack(self, x: Tensor,
               layer_call: Callable[[nn.Module, int, Tensor, Tensor | None, Tensor | None], tuple[Tensor, Tensor]],
               feature_layers: Sequence[int], last_only: bool) -> tuple[Tensor, Tensor | None]:
        """Every layer over ``x`` (``layer_call(layer, i, x, delta, tee)``: a layer's input is ``x + delta``,
        the previous MLP's output, added in its first norm, which writes that sum to ``tee`` as well), the
        outputs of ``feature_layers`` (ascending: the draft's fc reads them in layer order), the logits.

        Layer i's output is the sum layer i + 1's first norm computes anyway, so the features are its
        ``tee``: each feature layer's column slice of one buffer, written by the add that was running.
        No launch of their own (a decode step's feature row was a sum per layer and a cat, 6 launches
        for SmolLM2's 5 layers, then 3: ~0.03 ms of an H100's 0.94 ms AR step), and no copy of every
        layer's output held until a cat (a prefill's or a training batch's many rows)."""
        n = len(self.layers)
        wanted = sorted(set(feature_layers))
        if wanted and not 0 <= wanted[0] <= wanted[-1] < n:
            raise EngineInputError(f"feature_layers {list(feature_layers)}: this model's layers are 0..{n - 1} "
                                   "(a draft's target_layer_ids must name layers of its target)")
        d = x.shape[-1]
        feats = x.new_empty(*x.shape[:-1], len(wanted) * d) if wanted else None
        tees = {i: feats[..., j * d:(j + 1) * d] for j, i in enumerate(wanted)}
        delta = None
        for i, layer in enumerate(self.layers):
            x, delta = layer_call(layer, i, x, delta, tees.get(i - 1))
        return self.lm_head(final_norm(self.norm, x, delta, last_only, tees.get(n - 1))), feats


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) whose product takes ``engine.models.linear``: a
    decode step's or a verify's few rows round alike (``row_invariant``; ``free_rows_`` turns it off)."""

    row_invariant = True

    def forward(self, x: Tensor) -> Tensor:
        if not self.row_invariant:
            return F.linear(x, self.weight, self.bias)
        return rows_linear.linear(x, self.weight, self.bias)


class AttentionProjections(nn.Module):
    """Grouped-query attention's weights under the names HF checkpoints use: the q, k and v
    projections (one ``qkv_proj`` GEMM for inference, ``FUSED``), the output projection (``out``:
    the target's row-invariant ``Linear``, the draft's ``nn.Linear``: the draft only proposes) and
    the per-head q and k norms (``qk_norm``; None without; ``zero_centred`` as Qwen3.5's). ``gated``:
    q_proj also yields each head's output gate (Qwen3.5: twice the width). The dense target's, the
    hybrid's and the draft's attention differ in what they do with them, not in what they hold."""

    FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, hidden: int, n_heads: int, n_kv: int, head_dim: int, bias: bool, eps: float,
                 qk_norm: bool, out: type[nn.Linear] = nn.Linear, out_bias: bool = False, gated: bool = False,
                 zero_centred: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.q_proj = nn.Linear(hidden, n_heads * head_dim * (2 if gated else 1), bias=bias)
        self.k_proj = nn.Linear(hidden, n_kv * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, n_kv * head_dim, bias=bias)
        self.o_proj = out(n_heads * head_dim, hidden, bias=out_bias)
        self.q_norm = RMSNorm(head_dim, eps, zero_centred=zero_centred) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps, zero_centred=zero_centred) if qk_norm else None


class FusedLinear(nn.Module):
    """Projections that read the same input as one GEMM: their weight rows stacked, so a decode step
    reads them in one launch instead of one each (a tiny projection alone is all launch latency).
    ``forward`` returns each projection's output, as views of the one product."""

    def __init__(self, parts: Sequence[nn.Linear]) -> None:
        super().__init__()
        self.sizes = [p.out_features for p in parts]
        self.biased = [p.bias is not None for p in parts]  # a missing bias is stored as zeros
        w = parts[0].weight
        self.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=w.requires_grad)
        if any(self.biased):
            bias = [p.bias.detach() if p.bias is not None else w.new_zeros(p.out_features) for p in parts]
            self.bias = nn.Parameter(torch.cat(bias), requires_grad=w.requires_grad)
        else:
            self.register_parameter("bias", None)

    row_invariant = True

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        if not self.row_invariant:
            return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
        return rows_linear.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)

    def part(self, x: Tensor, i: int) -> Tensor:
        """Projection ``i`` alone, through its rows of the stacked weight (views: nothing copied)."""
        lo = sum(self.sizes[:i])
        hi = lo + self.sizes[i]
        return F.linear(x, self.weight[lo:hi], None if self.bias is None else self.bias[lo:hi])


def free_rows_(model: nn.Module) -> nn.Module:
    """Let ``model``'s projections round as cuBLAS launches them for each row count (``row_invariant``
    off): for a draft, whose outputs only propose tokens that the target verifies, so no output of a
    speculative run depends on them, and whose block always has the same rows. Returns ``model``."""
    for module in model.modules():
        if isinstance(module, (Linear, FusedLinear, QuantLinear)):
            module.row_invariant = False
    return model


def fuse_projections_(model: nn.Module) -> nn.Module:
    """Stack every module's projection groups (its class's ``FUSED``: fused name -> the names of
    the ``nn.Linear`` parts it replaces) into one ``FusedLinear`` each, freeing the parts. For
    inference after loading (targets, and drafts in ``DFlashDrafter``); checkpoints keep the parts'
    names (``unfused_state_dict``). Idempotent.

    Quantized parts (``quant.QuantLinear``, a GGUF loaded with ``weights="native"``) of one format and
    width stack their rows of blocks into one ``QuantFusedLinear``; a group that mixes formats, or
    blocks and floats, stays as its parts (``quant.fusable``). Each group's parts are freed before the
    next group is stacked, so a load's peak holds one group twice, not every group (a list of all the
    modules would keep each replaced part alive to the end: +8.4 GiB on the 27B shape at Q4_K_M)."""
    for module in [m for m in model.modules() if getattr(m, "FUSED", None)]:  # the owners alone
        for name, parts in module.FUSED.items():
            if name in module._modules:
                continue
            linears = [module.get_submodule(p) for p in parts]
            if not any(isinstance(p, QuantLinear) for p in linears):
                setattr(module, name, FusedLinear(linears))
            elif fusable(linears):  # GGUF blocks of one format: their rows stacked (engine.models.quant)
                setattr(module, name, QuantFusedLinear(linears))
            else:  # a mixed group keeps its parts, each in its own blocks (quant.fusable says why); a
                # float part among them takes the row-invariant product a fused group would have given it
                for p, linear in zip(parts, linears, strict=True):
                    setattr(module, p, _row_invariant(linear))
                continue
            for p in parts:
                delattr(module, p)
    return model


def _row_invariant(part: nn.Module) -> nn.Module:
    """A plain ``nn.Linear`` as the row-invariant ``Linear`` (its parameters, not copies); else ``part``."""
    if type(part) is not nn.Linear:
        return part
    out = Linear(part.in_features, part.out_features, bias=part.bias is not None, device="meta")
    out.weight, out.bias = part.weight, part.bias
    return out


def unfused_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` in its checkpoint's names: each ``FusedLinear`` split back into the
    parts it replaced (views), for code that hands the weights to another implementation."""
    out = dict(model.state_dict())
    for owner, module in model.named_modules():
        for name, parts in getattr(module, "FUSED", {}).items():
            fused_linear = module._modules.get(name)
            if fused_linear is None:
                continue
            prefix = f"{owner}." if owner else ""
            # A quantized group splits back into its parts' rows of blocks (``part.blocks``).
            kind = "blocks" if isinstance(fused_linear, QuantFusedLinear) else "weight"
            weights = out.pop(f"{prefix}{name}.{kind}").split(fused_linear.sizes)
            biases = out.pop(f"{prefix}{name}.bias").split(fused_linear.sizes) \
                if fused_linear.bias is not None else [None] * len(parts)
            for part, w, b, biased in zip(parts, weights, biases, fused_linear.biased, strict=True):
                out[f"{prefix}{part}.{kind}"] = w
                if biased:
                    out[f"{prefix}{part}.bias"] = b
    return out


def project(module: nn.Module, name: str, x: Tensor) -> tuple[Tensor, ...]:
    """The outputs of ``module``'s projection group ``name`` for ``x``: one GEMM once fused
    (``fuse_projections_``), one per part before."""
    fused_linear = module._modules.get(name)
    if fused_linear is not None:
        return fused_linear(x)
    return tuple(module.get_submodule(p)(x) for p in module.FUSED[name])


def project_part(module: nn.Module, name: str, part: str, x: Tensor) -> Tensor:
    """One projection of ``module``'s group ``name`` alone: its own ``nn.Linear``, or once fused
    the stacked weight's rows of that part (code that needs one part works in both layouts)."""
    fused_linear = module._modules.get(name)
    if fused_linear is None:
        return module.get_submodule(part)(x)
    return fused_linear.part(x, module.FUSED[name].index(part))


class SwiGLU(nn.Module):
    FUSED = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(fused.silu_mul(*project(self, "gate_up_proj", x)))


def cast_module_(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Move and cast weights, keeping RoPE frequencies in float32 (bf16 would round them)."""
    keep = {name: buf.float() for name, buf in module.named_buffers() if name.endswith("inv_freq")}
    module.to(device=device, dtype=dtype)
    for name, buf in keep.items():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        owner.register_buffer(attr, buf.to(device), persistent=False)
    return module
