"""llama.cpp GGUF targets (llama, qwen2, qwen3): the file's metadata into a ``DenseConfig``, its
tensor names into ours, each tensor dequantized, or with ``weights="native"`` each quantized
projection kept in its blocks (``engine.models.quant``).

Built on ``engine.loading``'s shared steps (``build_model``, ``load_state``, ``finish_model``), so
a GGUF is refused as a safetensors checkpoint is: a file cut short or corrupt, a weight holding NaN
or inf, a config too large for the device's free memory, each named. Only GGUF users pay for
importing the ``gguf`` package.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from engine.config import EngineInputError
from engine.files import preview
from engine.loading import Device, NativePlan, TensorSource, build_model, finish_model, load_state
from engine.models.common import rope_inv_freq
from engine.models.dense import DenseConfig, DenseModel
from engine.models.quant import FORMATS, WEIGHTS, BlockFormat, QuantLinear, bad_scales

GGUF_ARCHS = ("llama", "qwen2", "qwen3")
_MISSING = object()
_GGUF_TOP = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_GGUF_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def load_target_gguf(path: Path, device: Device, dtype: torch.dtype,
                     weights: str = "dequantized") -> tuple[DenseModel, dict]:
    """A llama / qwen2 / qwen3 `.gguf` file; returns the model and its metadata as plain data.

    ``weights="dequantized"`` (the default) dequantises every tensor into ``dtype``. ``"native"`` keeps
    each projection weight (attention q/k/v/o, MLP gate/up/down, an untied output head) whose type has
    a native form (``quant.FORMATS``: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) in its blocks, as
    a ``quant.QuantLinear``. Everything else is dequantised as with ``"dequantized"``: the embedding
    (rows are gathered, not multiplied), the norms and biases (F32 in every file), F32/F16/BF16
    tensors, and projections of a type with no native form (Q2_K, Q3_K, the IQ types, ...): such a
    file still loads, and ``quant.weights_summary`` lists those under ``fallback``, since llama.cpp
    mixes types within one file and refusing all of it for one tensor would help no one."""
    import gguf  # only GGUF users pay for the import

    if weights not in WEIGHTS:
        raise EngineInputError(f"weights must be one of {list(WEIGHTS)}, but got {weights!r}")
    path = Path(path)
    if not path.is_file():
        raise EngineInputError(f"GGUF file {path} does not exist")
    try:
        reader = gguf.GGUFReader(path)
    except MemoryError:
        raise EngineInputError(f"{path}: not a readable GGUF file: its header asks for more memory than there "
                               "is (a corrupt count)") from None
    except Exception as exc:  # a truncated or corrupt header fails in the reader in many ways (IndexError, ...)
        raise EngineInputError(f"{path}: not a readable GGUF file ({type(exc).__name__}: "
                               f"{preview(str(exc))})") from None
    meta = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}
    tensors = {t.name: t for t in reader.tensors}
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise EngineInputError(f"{path}: general.architecture {arch!r} is not supported; "
                               f"supported: {list(GGUF_ARCHS)}")
    cfg = _dense_config_from_gguf(meta, tensors, arch, path)
    model = build_model(DenseModel, cfg, device, dtype, _native_plan(tensors) if weights == "native" else None)
    kept = {name for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    source: TensorSource = {}
    for name, t in tensors.items():
        if name == "rope_freqs.weight":
            continue
        parts, heads = name.split("."), None
        if arch == "llama" and len(parts) == 4 and parts[2] in ("attn_q", "attn_k"):
            # llama.cpp permutes llama's q/k rows to its interleaved RoPE; K by the KV head count.
            heads = cfg.num_attention_heads if parts[2] == "attn_q" else cfg.num_key_value_heads
        ours = _gguf_to_ours(name)
        owner = ours.removesuffix(".weight")
        if ours.endswith(".weight") and owner in kept:
            source[f"{owner}.blocks"] = partial(_gguf_blocks, t, heads, FORMATS[t.tensor_type.name], path)
        else:
            source[ours] = partial(_gguf_tensor, t, heads, path)
    load_state(model, source, str(path))
    if weights == "native":  # built on the meta device (``build_model``): the RoPE frequencies, made not loaded, again
        model.inv_freq = rope_inv_freq(cfg.dim_per_head, cfg.rope_theta, cfg.rope_scaling).to(model.device)
    if "rope_freqs.weight" in tensors:
        # Llama 3 rope scaling travels as per-frequency divisors instead of config keys.
        factors = _gguf_tensor(tensors["rope_freqs.weight"], None, path).flatten()
        base = rope_inv_freq(cfg.dim_per_head, cfg.rope_theta)
        if factors.shape != base.shape:
            raise EngineInputError(f"{path}: rope_freqs has {factors.numel()} values, not {base.numel()}")
        model.inv_freq = (base / factors).to(model.inv_freq.device)
    model.weight_types = {_gguf_to_ours(n): t.tensor_type.name for n, t in tensors.items() if n != "rope_freqs.weight"}
    return finish_model(model), meta


_GGUF_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _native_plan(tensors: dict) -> NativePlan:
    """The projection weights a native load keeps in their blocks: our module name -> (format, the
    [out, in] shape the file gives). ``build_model`` swaps in a block layer only where the model's
    projection has that shape, so a misshapen tensor is refused as in a dequantized load."""
    plan: NativePlan = {}
    for name, t in tensors.items():
        parts = name.split(".")
        projection = parts == ["output", "weight"] or (
            len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_PROJECTIONS and parts[3] == "weight")
        if projection and t.tensor_type.name in FORMATS and len(t.shape) == 2:
            cols, rows = (int(n) for n in t.shape)  # GGUF shapes are [in, out]
            plan[_gguf_to_ours(name).removesuffix(".weight")] = (FORMATS[t.tensor_type.name], (rows, cols))
    return plan


def _dense_config_from_gguf(meta: dict, tensors: dict, arch: str, where: Path) -> DenseConfig:
    def key(name: str, default: Any = _MISSING) -> Any:
        full = f"{arch}.{name}"
        found = meta.get(full, default)
        if found is _MISSING:
            raise EngineInputError(f"{where}: metadata key {full!r} is missing")
        if isinstance(found, list):  # per-layer values: fine only when all layers agree
            if len(set(found)) != 1:
                raise EngineInputError(f"{where}: {full} differs between layers ({found}); not supported")
            found = found[0]
        return found

    if "token_embd.weight" not in tensors:
        raise EngineInputError(f"{where}: tensor 'token_embd.weight' is missing")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    rope_dim = int(key("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise EngineInputError(f"{where}: {arch}.rope.dimension_count {rope_dim} must equal the head dim "
                               f"{head_dim} (partial RoPE is not supported for dense targets)")
    scaling = key("rope.scaling.type", "none")
    if scaling != "none":
        raise EngineInputError(f"{where}: {arch}.rope.scaling.type {scaling!r} is not supported (only none)")
    return DenseConfig(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # GGUF shapes are [n_embd, n_vocab]
        hidden_size=hidden, num_hidden_layers=int(key("block_count")), num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        intermediate_size=int(key("feed_forward_length")), head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        qk_norm="blk.0.attn_q_norm.weight" in tensors, attention_bias="blk.0.attn_q.bias" in tensors,
        tie_word_embeddings="output.weight" not in tensors,  # no output tensor: tied to token_embd
        max_position_embeddings=int(key("context_length", 4096)), arch=arch,
    )


def _gguf_to_ours(name: str) -> str:
    """blk.3.attn_q.weight -> layers.3.self_attn.q_proj.weight; unknown names pass through, reported later."""
    parts = name.split(".")
    if parts[0] in _GGUF_TOP and len(parts) == 2:
        return f"{_GGUF_TOP[parts[0]]}.{parts[1]}"
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_BLOCK:
        return f"layers.{parts[1]}.{_GGUF_BLOCK[parts[2]]}.{parts[3]}"
    return name


def _gguf_tensor(t: Any, heads: int | None, where: Path) -> Tensor:
    from gguf.quants import dequantize

    try:
        # The reader's numpy arrays already have PyTorch's row-major shape ([out, in]).
        array = dequantize(t.data, t.tensor_type)
    except NotImplementedError as exc:
        raise EngineInputError(f"{where}: tensor {t.name!r} has type {t.tensor_type.name}, which cannot be "
                               f"dequantised: {exc}") from None
    except Exception as exc:  # data cut short or of a size its type cannot hold: a corrupt file
        raise EngineInputError(f"{where}: tensor {t.name!r} cannot be read ({type(exc).__name__}: "
                               f"{preview(str(exc))}): the file is corrupt") from None
    w = torch.from_numpy(np.require(array, np.float32, ["C", "W"]))
    if heads:
        # Inverse of llama.cpp's permute(w, n) = w.reshape(n, 2, d/2, ...).swapaxes(1, 2).reshape(w.shape):
        # rows go from interleaved pairs (x0, y0, x1, y1, ...) back to HF's halves (x0, x1, ..., y0, y1, ...).
        d = w.shape[0] // heads
        w = w.reshape(heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    return w


def _gguf_blocks(t: Any, heads: int | None, fmt: BlockFormat, where: Path) -> Tensor:
    """A quantized tensor's blocks as stored, uint8 [out, row_bytes] (llama's q/k rows un-permuted:
    quantisation is per row, so whole rows of blocks move), its scales checked finite."""
    rows, cols = int(t.shape[1]), int(t.shape[0])
    expect = (rows, fmt.row_bytes(cols))
    try:
        data = np.array(t.data, dtype=np.uint8, copy=True)  # the reader's arrays are read-only file maps
    except Exception as exc:  # data cut short: a corrupt file
        raise EngineInputError(f"{where}: tensor {t.name!r} cannot be read ({type(exc).__name__}: "
                               f"{preview(str(exc))}): the file is corrupt") from None
    if cols % fmt.values or tuple(data.shape) != expect:
        raise EngineInputError(f"{where}: tensor {t.name!r} ({fmt.name}, [{rows}, {cols}]) holds bytes "
                               f"{list(data.shape)}, not {list(expect)}: the file is corrupt")
    blocks = torch.from_numpy(data)
    bad = bad_scales(blocks, fmt)
    if bad:
        raise EngineInputError(f"{where}: tensor {t.name!r} ({fmt.name}) holds {bad:,} NaN or inf block scales "
                               f"in {blocks.numel() // fmt.nbytes:,} blocks: the weights are corrupt")
    if heads:  # as _gguf_tensor's, on rows of blocks
        d = rows // heads
        blocks = blocks.reshape(heads, d // 2, 2, -1).transpose(1, 2).reshape(expect).contiguous()
    return blocks


