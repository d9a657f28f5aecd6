"""Qwen3.5's configuration: the model's fields (``HybridConfig``), HF's config.json mapped onto them
(text and multimodal forms, with the keys and values the loader refuses named), and HF's checkpoint
tensor names mapped onto the model's (``engine.models.hybrid`` is the model, ``hybrid_cache`` its
state)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor

from engine.config import EngineInputError

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
