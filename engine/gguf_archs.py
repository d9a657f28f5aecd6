"""The llama.cpp GGUF architectures the engine reads, each as one of our models: its ``{arch}.*``
metadata into that model's config, and each tensor name into our parameter name with the layout
llama.cpp's converter (``convert_hf_to_gguf.py``) changed put back (``engine.gguf_loading`` reads
the file and applies these maps, to float tensors or to rows of quantized blocks).

What the converter changes, and is undone here:

- ``llama``: the q/k rows of each head permuted from HF's halves to interleaved RoPE pairs.
- ``qwen35`` (Qwen3.5, Gated DeltaNet + gated attention): the zero-centred norms (input,
  post-attention, final, q/k) stored as ``1 + w``; ``A_log`` stored as ``A = -exp(A_log)``
  (``ssm_a``); ``dt_bias`` as ``ssm_dt.bias``; the conv1d weight squeezed to [C, K]; and, where a
  linear-attention layer has more value heads than key heads, the value heads reordered from
  grouped by key head (HF: v0 v1 of k0, then of k1) to tiled (v0 of k0, v0 of k1, v1 of k0, ...) in
  every tensor indexed by them: the V rows of ``in_proj_qkv`` and of the conv, ``in_proj_z``,
  ``in_proj_a`` / ``in_proj_b``, ``A_log``, ``dt_bias`` (rows) and ``out_proj`` (columns).
  Multi-token-prediction layers (``nextn_predict_layers``) are skipped: the engine drafts with DFlash.
- ``qwen2`` / ``qwen3``: tensors as in HF (Qwen3's q/k norms are plain RMSNorms, stored as is).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from engine.config import EngineInputError
from engine.models.common import rope_inv_freq
from engine.models.dense import DenseConfig, DenseModel
from engine.models.hybrid import HybridModel
from engine.models.hybrid_config import HybridConfig

_MISSING = object()


@dataclass(frozen=True)
class TensorMap:
    """How one GGUF tensor becomes one of our parameters: ``value(file[rows][:, cols])``, named ``name``.

    ``rows`` / ``cols``: our row i (column j) is the file's row ``rows[i]`` (column ``cols[j]``); both
    move whole rows of quantized blocks as well (a row is quantized on its own); ``cols`` moves
    blocks only where each block's columns stay together, else the loader keeps the file's column
    order and has the model permute the layer's input instead (``GatedDeltaNet.out_order``).
    ``value``: applied to the float tensor last; a tensor with one is never kept in blocks."""

    name: str
    rows: Tensor | None = None
    cols: Tensor | None = None
    value: Callable[[Tensor], Tensor] | None = None


@dataclass(frozen=True)
class GgufTarget:
    """A file's target: the model class and its config, the map of each tensor name (None: a tensor
    that is not ours to load, or ``rope_freqs``, left to the loader), and the RoPE frequencies, given
    the file's per-frequency divisors or None (a native load builds the model on the meta device
    and must make them again)."""

    model: type[nn.Module]
    config: Any
    tensor: Callable[[str], TensorMap | None]
    inv_freq: Callable[[Tensor | None], Tensor]


class Metadata:
    """A file's ``{arch}.*`` keys; a missing required key or a per-layer list whose layers disagree is
    refused naming the file and the key."""

    def __init__(self, meta: dict, arch: str, where: Path) -> None:
        self.meta, self.arch, self.where = meta, arch, where

    def __call__(self, name: str, default: Any = _MISSING) -> Any:
        full = f"{self.arch}.{name}"
        found = self.meta.get(full, default)
        if found is _MISSING:
            raise EngineInputError(f"{self.where}: metadata key {full!r} is missing")
        if isinstance(found, list):  # per-layer values: fine only when all layers agree
            if len(set(found)) != 1:
                raise EngineInputError(f"{self.where}: {full} differs between layers ({found}); not supported")
            found = found[0]
        return found

    def count(self, name: str, default: Any = _MISSING) -> int:
        """A size or count: a whole number >= 1 (a corrupt file's 0 would divide by zero later)."""
        found = self(name, default)
        if isinstance(found, bool) or not isinstance(found, (int, np.integer)) or found < 1:
            raise self.refuse(f"{self.arch}.{name} must be a whole number >= 1, but got {found!r}")
        return int(found)

    def real(self, name: str, default: float) -> float:
        """A float32 key as the shortest decimal that is that float32 (1e-06, not 9.99999997e-07):
        the value the model's config.json said, whatever arithmetic reads it."""
        return float(str(np.float32(self(name, default))))

    def refuse(self, rule: str) -> EngineInputError:
        return EngineInputError(f"{self.where}: {rule}")


def split_name(name: str) -> tuple[int | None, str, str]:
    """``blk.3.attn_q.weight`` -> (3, "attn_q", "weight"); ``blk.0.ssm_a`` -> (0, "ssm_a", "");
    ``output_norm.weight`` -> (None, "output_norm", "weight")."""
    parts = name.split(".")
    layer = None
    if len(parts) >= 3 and parts[0] == "blk" and parts[1].isdigit():
        layer, parts = int(parts[1]), parts[2:]
    if len(parts) > 1 and parts[-1] in ("weight", "bias"):
        return layer, ".".join(parts[:-1]), parts[-1]
    return layer, ".".join(parts), ""


def _with_suffix(module: str, suffix: str) -> str:
    return f"{module}.{suffix}" if suffix else module


def _common_checks(key: Metadata, tensors: dict, head_dim: int) -> None:
    if "token_embd.weight" not in tensors:
        raise key.refuse("tensor 'token_embd.weight' is missing")
    value_dim = int(key("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise key.refuse(f"{key.arch}.attention.value_length {value_dim} must equal attention.key_length {head_dim}")
    scaling = key("rope.scaling.type", "none")
    if scaling != "none":
        raise key.refuse(f"{key.arch}.rope.scaling.type {scaling!r} is not supported (only none)")


def _vocab(tensors: dict) -> int:
    return int(tensors["token_embd.weight"].shape[1])  # GGUF shapes are [n_embd, n_vocab]


# ------------------------------------------------------------------------------ llama, qwen2, qwen3
_TOP = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_DENSE_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def dense_target(key: Metadata, tensors: dict) -> GgufTarget:
    hidden, heads = key.count("embedding_length"), key.count("attention.head_count")
    head_dim = key.count("attention.key_length", hidden // heads)
    _common_checks(key, tensors, head_dim)
    rope_dim = key.count("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise key.refuse(f"{key.arch}.rope.dimension_count {rope_dim} must equal the head dim {head_dim} "
                         "(partial RoPE is not supported for dense targets)")
    cfg = DenseConfig(
        vocab_size=_vocab(tensors), hidden_size=hidden, num_hidden_layers=key.count("block_count"),
        num_attention_heads=heads, num_key_value_heads=key.count("attention.head_count_kv", heads),
        intermediate_size=key.count("feed_forward_length"), head_dim=head_dim,
        rms_norm_eps=key.real("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=key.real("rope.freq_base", 10000.0),
        qk_norm="blk.0.attn_q_norm.weight" in tensors, attention_bias="blk.0.attn_q.bias" in tensors,
        tie_word_embeddings="output.weight" not in tensors,  # no output tensor: tied to token_embd
        max_position_embeddings=int(key("context_length", 4096)), arch=key.arch,
    )
    # llama.cpp permutes llama's q/k rows to its interleaved RoPE, per head (K by the KV head count):
    # rows (h, i, s) of the file are our (h, s, i), s the pair's half.
    unpermute = {role: _pairs_to_halves(n, cfg.dim_per_head) for role, n in
                 (("attn_q", cfg.num_attention_heads), ("attn_k", cfg.num_key_value_heads))} \
        if key.arch == "llama" else {}

    def tensor(name: str) -> TensorMap | None:
        layer, role, suffix = split_name(name)
        if layer is None:
            if role == "rope_freqs":
                return None  # Llama 3 rope scaling: the loader divides the frequencies by it
            return TensorMap(_with_suffix(_TOP[role], suffix) if role in _TOP else name)
        if role not in _DENSE_BLOCK:
            return TensorMap(name)  # not ours: load_state names it
        return TensorMap(f"layers.{layer}.{_with_suffix(_DENSE_BLOCK[role], suffix)}", rows=unpermute.get(role))

    def inv_freq(factors: Tensor | None) -> Tensor:
        if factors is None:
            return rope_inv_freq(cfg.dim_per_head, cfg.rope_theta, cfg.rope_scaling)
        base = rope_inv_freq(cfg.dim_per_head, cfg.rope_theta)
        if factors.shape != base.shape:
            raise key.refuse(f"rope_freqs has {factors.numel()} values, not {base.numel()}")
        return base / factors

    return GgufTarget(DenseModel, cfg, tensor, inv_freq)


def _pairs_to_halves(heads: int, head_dim: int) -> Tensor:
    return torch.arange(heads * head_dim).view(heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)


# ---------------------------------------------------------------------------------------- qwen35
_HYBRID_BLOCK = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
}
_HYBRID_PARAMS = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}  # by their whole names
# Zero-centred RMSNorms (x * (1 + w)): llama.cpp stores 1 + w. The gated norm's weight is plain.
_ONE_PLUS = ("output_norm", "attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm")


def hybrid_target(key: Metadata, tensors: dict) -> GgufTarget:
    hidden, heads = key.count("embedding_length"), key.count("attention.head_count")
    head_dim = key.count("attention.key_length", hidden // heads)
    _common_checks(key, tensors, head_dim)
    rope_dim = key.count("rope.dimension_count", head_dim)
    # rope.dimension_sections (interleaved M-RoPE) splits the rotary pairs between time, height and
    # width positions; for text all three are the token's position, which is plain RoPE.
    hv, inner = key.count("ssm.time_step_rank"), key.count("ssm.inner_size")
    if inner % hv:
        raise key.refuse(f"{key.arch}.ssm.inner_size {inner} must be a multiple of ssm.time_step_rank {hv} "
                         "(the value heads)")
    blocks, nextn = key.count("block_count"), int(key("nextn_predict_layers", 0))
    if not 0 <= nextn < blocks:
        raise key.refuse(f"{key.arch}.nextn_predict_layers {nextn} must be >= 0 and below block_count {blocks}")
    fields = dict(
        vocab_size=_vocab(tensors), hidden_size=hidden, num_hidden_layers=blocks - nextn,
        num_attention_heads=heads, num_key_value_heads=key.count("attention.head_count_kv", heads), head_dim=head_dim,
        intermediate_size=key.count("feed_forward_length"), linear_num_key_heads=key.count("ssm.group_count"),
        linear_num_value_heads=hv, linear_key_head_dim=key.count("ssm.state_size"),
        linear_value_head_dim=inner // hv, linear_conv_kernel_dim=key.count("ssm.conv_kernel"),
        partial_rotary_factor=rope_dim / head_dim, rope_theta=key.real("rope.freq_base", 10_000_000.0),
        rms_norm_eps=key.real("attention.layer_norm_rms_epsilon", 1e-6),
        full_attention_interval=key.count("full_attention_interval", 4),
        attention_bias=any(split_name(n)[1:] == ("attn_q", "bias") for n in tensors),
        tie_word_embeddings="output.weight" not in tensors, max_position_embeddings=int(key("context_length", 262144)),
    )
    try:
        cfg = HybridConfig(**fields)
    except EngineInputError as exc:  # the config's own rules, named for this file
        raise key.refuse(f"not a valid {key.arch} model: {exc}") from None
    layers = cfg.num_hidden_layers
    if cfg.rotary_dim != rope_dim:
        raise key.refuse(f"{key.arch}.rope.dimension_count {rope_dim} of head dim {head_dim} is not supported "
                         f"(it would be read as {cfg.rotary_dim})")
    values = _value_orders(cfg)
    fix = {"ssm_a": lambda a: torch.log(-a.double()).float(),  # A = -exp(A_log)
           "ssm_conv1d": lambda w: w.unsqueeze(1)}  # [C, K] -> nn.Conv1d's [C, 1, K]

    def tensor(name: str) -> TensorMap | None:
        layer, role, suffix = split_name(name)
        if layer is None:
            if role not in _TOP:
                return TensorMap(name)
            return TensorMap(_with_suffix(_TOP[role], suffix), value=_minus_one if role in _ONE_PLUS else None)
        if layer >= layers and nextn:
            return None  # a multi-token-prediction layer
        whole = _with_suffix(role, suffix)
        if whole in _HYBRID_PARAMS:
            ours = _HYBRID_PARAMS[whole]
        elif role in _HYBRID_BLOCK and suffix:
            ours = _with_suffix(_HYBRID_BLOCK[role], suffix)
        else:
            return TensorMap(name)  # not ours: load_state names it
        if role == "ssm_out":
            return TensorMap(f"layers.{layer}.{ours}", cols=values.get("value"))
        value = _minus_one if role in _ONE_PLUS else fix.get(role)
        return TensorMap(f"layers.{layer}.{ours}", rows=values.get(role), value=value)

    # rope_freqs is not this architecture's: mapped as its own name, load_state refuses it
    return GgufTarget(HybridModel, cfg, tensor, lambda _: rope_inv_freq(cfg.rotary_dim, cfg.rope_theta))


def _minus_one(w: Tensor) -> Tensor:
    return w - 1


def _value_orders(cfg: HybridConfig) -> dict[str, Tensor]:
    """Each linear-attention tensor's rows (``value``: out_proj's columns) in HF's grouped order, read
    from llama.cpp's tiled order; none where there is one value head per key head (nothing moved)."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if hk == hv:
        return {}

    def grouped(width: int) -> Tensor:
        # the file's value heads: [replica, key head, width]; ours: [key head, replica, width]
        return torch.arange(hv * width).view(hv // hk, hk, width).transpose(0, 1).reshape(-1)

    value, head = grouped(cfg.linear_value_head_dim), grouped(1)
    qkv = torch.cat([torch.arange(2 * cfg.key_dim), 2 * cfg.key_dim + value])  # q and k rows stay
    return {"attn_qkv": qkv, "ssm_conv1d": qkv, "attn_gate": value, "ssm_beta": head, "ssm_alpha": head,
            "ssm_a": head, "ssm_dt": head, "value": value}


# general.architecture -> the target it is read as (model class, config, tensor maps)
GGUF_ARCHS: dict[str, Callable[[Metadata, dict], GgufTarget]] = {
    "llama": dense_target, "qwen2": dense_target, "qwen3": dense_target, "qwen35": hybrid_target,
}
