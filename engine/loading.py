"""Checkpoint loading: HF target folders (dense, hybrid), DFlash draft folders, and what every
loader shares (``build_model``, ``load_state``, ``finish_model``; llama.cpp GGUF files are read by
``engine.gguf_loading`` on top of them).

Every wrong input raises ``EngineInputError`` naming the file, the key, the rule and the value.
Weights are copied by name into a model built directly in the wanted dtype on the wanted device,
so a large model is never staged in float32 on the host first. On the meta device (``engine.load(
device="meta")``: a pair to plan memory on) only the checkpoint's headers are read: the model is
built of the stored names and shapes, each checked as a load checks it, and no tensor data is read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from engine.config import EngineInputError
from engine.files import read_mapping
from engine.models.common import unfused_state_dict
from engine.models.dense import DenseConfig, DenseModel
from engine.models.draft import DFlashConfig, DFlashDraft
from engine.models.quant import BlockFormat, QuantEmbedding, QuantLinear, keeps_embedding, shared_parameters

if TYPE_CHECKING:
    from engine.models.hybrid import HybridModel

# model_type -> the HF class that writes it; the values are accepted in `architectures` too.
DENSE_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
HYBRID_TYPES = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_text": "Qwen3_5ForCausalLM"}
DRAFT_ARCHITECTURES = ("DFlashDraftModel",)
_ARCH_TO_TYPE = {cls: mt for mt, cls in (DENSE_TYPES | HYBRID_TYPES).items()}
_MISSING = object()
Device = str | torch.device
TensorSource = dict[str, Callable[[], Tensor]]  # our parameter name -> reads the tensor when called
# module name -> (format, [out, in]) of each projection (and an untied embedding: [vocab, hidden]) a model is
# built with in blocks (``build_model``; a GGUF's native load makes one, engine.gguf_loading)
NativePlan = dict[str, tuple[BlockFormat, tuple[int, int]]]


# ---------------------------------------------------------------------------------------- targets
def load_target_folder(path: Path, device: Device, dtype: torch.dtype) -> DenseModel | HybridModel:
    """An HF model folder (config.json + model.safetensors or a sharded index) as an eval-mode target."""
    folder = _folder(path, "target")
    cfg_path = folder / "config.json"
    cfg = _read_json(cfg_path)
    model_type = _model_type(cfg, cfg_path)
    files = _weight_files(folder)
    if model_type in HYBRID_TYPES:
        # Imported here so dense loading works whether or not the hybrid model is installed.
        from engine.models import hybrid, hybrid_config

        try:
            hcfg = hybrid_config.hybrid_config_from_hf(cfg)
        except (KeyError, TypeError, ValueError) as exc:  # EngineInputError is a ValueError
            raise EngineInputError(f"{cfg_path}: not a valid {model_type} config: {exc}") from None
        model: nn.Module = build_model(hybrid.HybridModel, hcfg, device, dtype)
        with _open_safetensors(files, _is_meta(device)) as source:
            # hybrid_state_dict_from_hf takes the whole state dict (it may drop or alias tensors).
            state = hybrid_config.hybrid_state_dict_from_hf({name: read() for name, read in source.items()})
        load_state(model, {name: (lambda t=t: t) for name, t in state.items()}, str(folder))
    else:
        model = build_model(DenseModel, _dense_config_from_hf(cfg, model_type, cfg_path), device, dtype)
        with _open_safetensors(files, _is_meta(device)) as source:
            # Our dense parameter names are HF's without the `model.` prefix.
            renamed = {name.removeprefix("model."): read for name, read in source.items()}
            load_state(model, renamed, str(folder))
    return finish_model(model)


def _model_type(cfg: dict, where: Path) -> str:
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type") or next((_ARCH_TO_TYPE[a] for a in archs if a in _ARCH_TO_TYPE), None)
    if model_type not in DENSE_TYPES and model_type not in HYBRID_TYPES:
        supported = [f"{mt} ({cls})" for mt, cls in (DENSE_TYPES | HYBRID_TYPES).items()]
        raise EngineInputError(f"{where}: model_type {model_type!r} (architectures {archs}) is not "
                               f"supported; supported model types: {', '.join(supported)}")
    return model_type


def _dense_config_from_hf(cfg: dict, model_type: str, where: Path) -> DenseConfig:
    def need(key: str) -> Any:
        if key not in cfg:
            raise EngineInputError(f"{where}: required key {key!r} is missing")
        return cfg[key]

    # Features DenseModel does not implement: refuse them rather than produce wrong logits.
    if cfg.get("hidden_act", "silu") != "silu":
        raise EngineInputError(f"{where}: hidden_act must be 'silu', but got {cfg['hidden_act']!r}")
    if cfg.get("mlp_bias"):
        raise EngineInputError(f"{where}: mlp_bias must be false (no MLP biases), but got true")
    if model_type != "qwen2" and cfg.get("attention_bias"):
        raise EngineInputError(f"{where}: attention_bias must be false for {model_type} (no o_proj bias), "
                               "but got true")
    sliding = [t for t in cfg.get("layer_types") or [] if t != "full_attention"]
    if sliding or cfg.get("use_sliding_window") or (model_type == "mistral" and cfg.get("sliding_window")):
        raise EngineInputError(f"{where}: sliding-window attention is not supported, but got "
                               f"use_sliding_window={cfg.get('use_sliding_window')}, sliding_window="
                               f"{cfg.get('sliding_window')}, layer types {sorted(set(sliding))}")
    theta, scaling = _rope(cfg, where, allow_llama3=True)
    heads = int(need("num_attention_heads"))
    return DenseConfig(
        vocab_size=int(need("vocab_size")), hidden_size=int(need("hidden_size")),
        num_hidden_layers=int(need("num_hidden_layers")), num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        intermediate_size=int(need("intermediate_size")), head_dim=cfg.get("head_dim"),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        qk_norm=model_type == "qwen3",
        attention_bias=model_type == "qwen2",  # Qwen2 has q/k/v biases whatever the config says
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)), arch=model_type,
    )


def _rope(cfg: dict, where: Path, allow_llama3: bool) -> tuple[float, dict | None]:
    """(theta, scaling); transformers 5 writes `rope_parameters`, older ones `rope_theta`, `rope_scaling`."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "llama3" and allow_llama3:
        for key in ("factor", "original_max_position_embeddings"):
            if key not in params:
                raise EngineInputError(f"{where}: llama3 rope scaling needs {key!r}, but got {params}")
        return theta, dict(params)
    supported = ["default", "llama3"] if allow_llama3 else ["default"]
    raise EngineInputError(f"{where}: rope type {kind!r} is not supported; supported: {supported}")


# ----------------------------------------------------------------------------------------- drafts
def load_draft_folder(path: Path, target: nn.Module, device: Device, dtype: torch.dtype) -> DFlashDraft:
    """A public-layout DFlash checkpoint folder, checked against the target it will draft for."""
    folder = _folder(path, "draft")
    cfg_path = folder / "config.json"
    hidden, vocab, n_layers = _target_dims(target)
    dcfg = _draft_config_from_hf(_read_json(cfg_path), cfg_path, n_layers)
    if dcfg.hidden_size != hidden:
        raise EngineInputError(f"{cfg_path}: draft hidden_size {dcfg.hidden_size} does not match "
                               f"target hidden_size {hidden}")
    if dcfg.vocab_size != vocab:
        raise EngineInputError(f"{cfg_path}: draft vocab_size {dcfg.vocab_size} does not match "
                               f"target vocab_size {vocab}")
    if max(dcfg.target_layer_ids) >= n_layers:
        raise EngineInputError(f"{cfg_path}: draft target_layer_ids {list(dcfg.target_layer_ids)} must be "
                               f"< the target's {n_layers} layers, but got {max(dcfg.target_layer_ids)}")
    if dcfg.mask_token_id >= vocab:
        raise EngineInputError(f"{cfg_path}: draft mask_token_id {dcfg.mask_token_id} must be < target "
                               f"vocab_size {vocab}")
    model = build_model(DFlashDraft, dcfg, device, dtype)
    with _open_safetensors(_weight_files(folder), _is_meta(device)) as source:
        load_state(model, {name.removeprefix("model."): read for name, read in source.items()}, str(folder))
    return finish_model(model)


def save_draft_folder(draft: DFlashDraft, path: Path, extra: dict | None = None) -> None:
    """Write config.json + model.safetensors in the public DFlash layout (readable by the public tools)."""
    c = draft.cfg
    dtype = str(next(draft.parameters()).dtype).removeprefix("torch.")
    config: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",  # Qwen3 decoder layers
        "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "intermediate_size": c.intermediate_size, "head_dim": c.dim_per_head, "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        # Both spellings: transformers 5 reads rope_parameters, 4.x-based tools read rope_theta.
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
        "attention_bias": c.attention_bias, "attention_dropout": 0.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
        "layer_types": ["full_attention"] * c.num_hidden_layers,
        "num_target_layers": c.num_target_layers, "block_size": c.block_size,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids),
                          "block_size": c.block_size, "output_multiplier": c.output_multiplier},
        "dtype": dtype, "torch_dtype": dtype,  # transformers 5 and 4 spellings
    }
    clash = sorted(set(extra or {}) & set(config))
    if clash:
        raise EngineInputError(f"save_draft_folder: extra keys {clash} would overwrite DFlash config keys")
    text = json.dumps(config | (extra or {}), indent=2, sort_keys=True)  # before touching the disk
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(text + "\n")
    # a draft fused for inference (DFlashDrafter) is saved in the checkpoint layout
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in unfused_state_dict(draft).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _draft_config_from_hf(cfg: dict, where: Path, target_layers: int) -> DFlashConfig:
    archs = cfg.get("architectures") or []
    if not any(a in DRAFT_ARCHITECTURES for a in archs):
        raise EngineInputError(f"{where}: architectures {archs} is not a supported draft; "
                               f"supported: {list(DRAFT_ARCHITECTURES)}")
    dflash = cfg.get("dflash_config") or {}

    def value(key: str, default: Any = _MISSING) -> Any:
        # The public code reads dflash_config first, then the top level.
        found = dflash.get(key, cfg.get(key, default))
        if found is _MISSING:
            raise EngineInputError(f"{where}: required key {key!r} is missing (looked in dflash_config and "
                                   "the top level)")
        return found

    # Variants DFlashDraft does not implement (sliding/causal layers, logit softcapping, embed scale).
    layer_types, causal = cfg.get("layer_types") or [], cfg.get("is_causal")
    if any(t != "full_attention" for t in layer_types) or causal:
        raise EngineInputError(f"{where}: only bidirectional full-attention draft layers are supported, "
                               f"but got layer_types {layer_types}, is_causal {causal}")
    if value("final_logit_softcapping", None):
        raise EngineInputError(f"{where}: final_logit_softcapping is not supported, but got "
                               f"{value('final_logit_softcapping')}")
    if float(value("input_embedding_scale", 1.0)) != 1.0:
        raise EngineInputError(f"{where}: input_embedding_scale must be 1.0, but got "
                               f"{value('input_embedding_scale')}")
    ids = tuple(int(i) for i in value("target_layer_ids"))
    # The target concatenates feature layers in ascending order, which is the order fc was trained on.
    if not ids or any(a >= b for a, b in zip(ids, ids[1:], strict=False)) or ids[0] < 0:
        raise EngineInputError(f"{where}: target_layer_ids must be non-empty, >= 0 and strictly ascending, "
                               f"but got {list(ids)}")
    theta, _ = _rope(cfg, where, allow_llama3=False)
    heads = int(value("num_attention_heads"))
    return DFlashConfig(
        hidden_size=int(value("hidden_size")), num_hidden_layers=int(value("num_hidden_layers")),
        num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        intermediate_size=int(value("intermediate_size")), vocab_size=int(value("vocab_size")),
        target_layer_ids=ids, num_target_layers=int(cfg.get("num_target_layers", target_layers)),
        block_size=int(value("block_size", 16)), mask_token_id=int(value("mask_token_id")),
        head_dim=cfg.get("head_dim"), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        attention_bias=bool(cfg.get("attention_bias", False)),
        output_multiplier=float(value("output_multiplier", 1.0)),
    )


def _target_dims(target: nn.Module) -> tuple[int, int, int]:
    """(hidden, vocab, layers) of a dense or hybrid target; the draft borrows its embedding and lm_head."""
    vocab, hidden = target.embed_tokens.num_embeddings, target.embed_tokens.embedding_dim
    return int(hidden), int(vocab), len(target.layers)


# --------------------------------------------------------------------------------- shared helpers
def _folder(path: Path, what: str) -> Path:
    folder = Path(path)
    if not folder.exists():
        raise EngineInputError(f"{what} folder {folder} does not exist")
    if not folder.is_dir():
        raise EngineInputError(f"{what} path {folder} is not a folder (expected config.json + safetensors)")
    if not (folder / "config.json").is_file():
        raise EngineInputError(f"{what} folder {folder} has no config.json")
    return folder


def _read_json(path: Path) -> dict:
    return read_mapping(path, "json")


def _weight_files(folder: Path) -> list[Path]:
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise EngineInputError(f"{index}: 'weight_map' must be a non-empty mapping of tensor -> file")
        names = sorted({str(v) for v in weight_map.values()})
        inside = folder.resolve()
        outside = [n for n in names if not (folder / n).resolve().is_relative_to(inside)]
        if outside:  # a shard is read from the model folder only, never through ../ or an absolute path
            raise EngineInputError(f"{index}: weight_map names shard file(s) outside the model folder: "
                                   f"{_few(outside)}")
        files = [folder / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise EngineInputError(f"{index}: shard file(s) {missing} listed in weight_map do not exist")
        return files
    hint = " (.bin weights are not supported: convert to safetensors)" if any(folder.glob("*.bin")) else ""
    raise EngineInputError(f"{folder}: no weights: expected model.safetensors or "
                           f"model.safetensors.index.json{hint}")


def _is_meta(device: Device) -> bool:
    return torch.device(device).type == "meta"


@contextmanager
def _open_safetensors(files: list[Path], shapes_only: bool = False) -> Iterator[TensorSource]:
    """Checkpoint name -> lazy reader, over every shard; old rotary inv_freq buffers are skipped.
    ``shapes_only``: each reader gives an empty tensor of the stored shape on the meta device, from
    the file's header (no data is read)."""
    with ExitStack() as stack:
        source: TensorSource = {}
        for file in files:
            try:
                handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            except (SafetensorError, OSError) as exc:
                raise EngineInputError(f"{file}: not a readable safetensors file: {exc}") from None
            for name in handle.keys():
                if not name.endswith("rotary_emb.inv_freq"):
                    source[name] = partial(_stored_shape, handle, name) if shapes_only else \
                        partial(handle.get_tensor, name)
        yield source


def _stored_shape(handle: Any, name: str) -> Tensor:
    return torch.empty(handle.get_slice(name).get_shape(), device="meta")


def load_state(model: nn.Module, source: TensorSource, where: str) -> None:
    """Strict by-name copy: every parameter / persistent buffer filled, nothing left over, shapes
    equal, values finite; ``where`` (the checkpoint) opens every refusal. A model on the meta device
    is checked by name and shape alone (``source`` gives meta tensors: nothing to copy or check)."""
    own = model.state_dict(keep_vars=True)
    aliases: dict[int, list[str]] = {}  # tied weights (lm_head = embed_tokens) share one tensor
    for name, t in own.items():
        aliases.setdefault(id(t), []).append(name)
    missing = [" or ".join(names) for names in aliases.values() if not any(n in source for n in names)]
    unexpected = sorted(set(source) - set(own))
    if missing or unexpected:
        hint = ""
        if any(m.startswith("lm_head") for m in missing):
            hint = " (lm_head is missing: is tie_word_embeddings wrongly false?)"
        raise EngineInputError(f"{where}: checkpoint tensors do not match the model: missing "
                               f"{_few(missing)}, unexpected {_few(unexpected)}{hint}")
    with torch.no_grad():
        for names in aliases.values():
            name = next(n for n in names if n in source)  # first alias wins, as HF ties to the embedding
            tensor, dest = source[name](), own[name]
            if tensor.shape != dest.shape:
                raise EngineInputError(f"{where}: tensor {name!r} has shape {list(tensor.shape)}, but the "
                                       f"model expects {list(dest.shape)}")
            if dest.is_meta:
                continue
            dest.copy_(tensor)
            if dest.is_floating_point() and not bool(torch.isfinite(dest).all()):
                bad = int((~torch.isfinite(dest)).sum())
                raise EngineInputError(f"{where}: tensor {name!r} holds {bad:,} non-finite values (NaN or inf) of "
                                       f"{dest.numel():,}: the weights are corrupt")


def _few(names: list[str], n: int = 8) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return f"[{shown}{', ...' if len(names) > n else ''}] ({len(names)})"


def build_model(cls: type[nn.Module], cfg: Any, device: Device, dtype: torch.dtype,
                native: NativePlan | None = None) -> nn.Module:
    """Construct directly in dtype on device: no full-precision CPU copy of a large model. A config
    whose weights cannot fit in the device's free memory is refused first, with the numbers (a
    corrupt or mistyped size would otherwise ask the allocator for terabytes). ``native``: the
    projections (and an untied embedding) held in blocks (``_with_blocks``); the model is then made on the
    meta device, its layers swapped, and only then given memory, so no float copy of those weights is ever
    made (its non-persistent buffers, the RoPE frequencies, are left for the caller to make)."""
    _check_fits(cls, cfg, device, dtype, native)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if not native:
            with torch.device(device):
                return cls(cfg)
        with torch.device("meta"):
            model = _with_blocks(cls(cfg), native)
        return _to_empty(model, device)
    finally:
        torch.set_default_dtype(previous)


def _to_empty(model: nn.Module, device: Device) -> nn.Module:
    """``model.to_empty(device)`` with its tied parameters (lm_head = embed_tokens) tied again: from the
    meta device each module's parameter is given its own new tensor."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    model.to_empty(device=device)
    for first, *others in (group for group in names.values() if len(group) > 1):
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, model.get_parameter(first))
    return model


def _with_blocks(model: nn.Module, native: NativePlan) -> nn.Module:
    """Each projection of ``native`` that the model has, with the file's shape, as a ``QuantLinear``, and
    an untied embedding of ``native`` as a ``QuantEmbedding`` (on the meta device; a tied one stays float:
    the head multiplies by it); the others stay, to be filled (or refused) as floats."""
    shared = shared_parameters(model)
    for name, (fmt, shape) in native.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:  # a tensor the model has no place for: load_state names it
            continue
        owner, _, attr = name.rpartition(".")
        if isinstance(module, nn.Linear) and (module.out_features, module.in_features) == shape:
            setattr(model.get_submodule(owner) if owner else model, attr,
                    QuantLinear(fmt, module.in_features, module.out_features, module.bias is not None, "meta"))
        elif keeps_embedding(module, fmt, shared) and (module.num_embeddings, module.embedding_dim) == shape:
            setattr(model.get_submodule(owner) if owner else model, attr,
                    QuantEmbedding(fmt, module.num_embeddings, module.embedding_dim, "meta", module.weight.dtype))
    return model


def _check_fits(cls: type[nn.Module], cfg: Any, device: Device, dtype: torch.dtype,
                native: NativePlan | None = None) -> None:
    with torch.device("meta"):  # shapes only: nothing allocated
        meta = _with_blocks(cls(cfg), native or {})
    blocks = sum(m.nbytes for m in meta.modules() if isinstance(m, (QuantLinear, QuantEmbedding)))
    need = sum(p.numel() for p in meta.parameters()) * torch.empty((), dtype=dtype).element_size() + blocks
    free = free_memory(torch.device(device))
    if free is not None and need > free:
        raise EngineInputError(f"{cls.__name__} with this config needs {need / 2**30:,.1f} GiB for its weights "
                               f"in {dtype}, but {device} has {free / 2**30:,.1f} GiB free (hidden_size "
                               f"{getattr(cfg, 'hidden_size', '?')}, {getattr(cfg, 'num_hidden_layers', '?')} "
                               f"layers, vocabulary {getattr(cfg, 'vocab_size', '?')})")


def free_memory(device: torch.device) -> int | None:
    """Bytes free on ``device`` (a GPU's, or the host's available memory), None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":  # Linux's MemAvailable: free memory plus what the page cache would give back
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
    return None


def finish_model(model: nn.Module) -> Any:
    """``model`` in eval mode with no gradients: how every loader hands a model back."""
    model.eval()
    model.requires_grad_(False)
    return model
