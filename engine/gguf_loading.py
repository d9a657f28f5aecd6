"""llama.cpp GGUF targets (llama, qwen2, qwen3 dense; qwen35, the Qwen3.5 hybrid): the file's metadata
into one of our model configs and its tensors into our parameters (``engine.gguf_archs`` says how
for each architecture), each tensor dequantized, or with ``weights="native"`` each quantized
projection kept in its blocks (``engine.models.quant``).

Built on ``engine.loading``'s shared steps (``build_model``, ``load_state``, ``finish_model``), so
a GGUF is refused as a safetensors checkpoint is: a file cut short or corrupt, a weight holding NaN
or inf, a config too large for the device's free memory, each named; and an architecture or a
tensor type it cannot read is named with the ones it can. Only GGUF users pay for importing the
``gguf`` package.
"""

from __future__ import annotations

import functools
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from engine.config import EngineInputError
from engine.files import preview
from engine.gguf_archs import GGUF_ARCHS, Metadata, TensorMap
from engine.loading import Device, NativePlan, TensorSource, build_model, finish_model, load_state
from engine.models.quant import (
    FLOAT_TYPES,
    FORMATS,
    WEIGHTS,
    BlockFormat,
    QuantEmbedding,
    QuantLinear,
    bad_scales,
    hold,
)

__all__ = ["GGUF_ARCHS", "load_target_gguf", "readable_types"]


def load_target_gguf(path: Path, device: Device, dtype: torch.dtype,
                     weights: str = "dequantized") -> tuple[torch.nn.Module, dict]:
    """A llama / qwen2 / qwen3 / qwen35 `.gguf` file; returns the model (``DenseModel``, or
    ``HybridModel`` for qwen35) and its metadata as plain data.

    ``weights="dequantized"`` (the default) dequantises every tensor into ``dtype``. ``"native"`` keeps
    each projection weight (attention q/k/v/o, MLP gate/up/down, the Gated DeltaNet in/out
    projections, an untied output head) whose type has a native form (``quant.FORMATS``: Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) in its blocks, as a ``quant.QuantLinear``, and an untied embedding
    of such a type as a ``quant.QuantEmbedding`` (a lookup dequantizes only its rows). Everything else is
    dequantised as with ``"dequantized"``: a tied embedding (the head multiplies by it), the
    norms, biases, conv and decay parameters (F32 in every file), F32/F16/BF16 tensors, and
    projections of a type with no native form (Q2_K, Q3_K, the IQ types, ...): such a file still
    loads, and ``quant.weights_summary`` lists those under ``fallback``, since llama.cpp mixes types
    within one file and refusing all of it for one tensor would help no one. A type that cannot be
    read at all (``readable_types``) is refused, naming the tensor.

    On the meta device (``engine.load(device="meta")``) the file's header alone is read: names,
    shapes and types give the model, its blocks at the bytes a load holds and its ``weight_types``;
    no tensor's data is read (nor checked: a corrupt weight is found by a real load)."""
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
    target = GGUF_ARCHS[arch](Metadata(meta, arch, path), tensors)
    maps = {name: m for name, t in tensors.items() if (m := target.tensor(name)) is not None}
    _check_types({name: tensors[name] for name in maps}, path)
    native, shapes_only = weights == "native", torch.device(device).type == "meta"
    model = build_model(target.model, target.config, device, dtype, _native_plan(tensors, maps) if native else None)
    kept = {name for name, m in model.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))}
    source: TensorSource = {}
    orders: dict[str, Tensor] = {}  # block layers whose input the model permutes (their columns stay the file's)
    for name, m in maps.items():
        t, owner = tensors[name], m.name.removesuffix(".weight")
        if m.name.endswith(".weight") and owner in kept:
            fmt = FORMATS[t.tensor_type.name]
            cols = m.cols
            if cols is not None and _block_order(cols, fmt) is None:
                orders[owner], cols = torch.argsort(cols), None
            source[f"{owner}.blocks"] = partial(_gguf_blocks, t, m.rows, cols, fmt, path, shapes_only)
        else:
            source[m.name] = partial(_gguf_tensor, t, m, path, shapes_only)
    load_state(model, source, str(path))
    for owner, order in orders.items():
        # ours[:, j] = file[:, cols[j]], so W_ours @ x = W_file @ x[argsort(cols)]
        _input_order(model, owner, order.to(model.device))
    # Llama 3 rope scaling travels as per-frequency divisors (a tensor its architecture leaves to us;
    # on the meta device unread: they divide the frequencies, whose shape is all that is made there).
    factors = None if shapes_only or "rope_freqs.weight" in maps or "rope_freqs.weight" not in tensors else \
        _gguf_tensor(tensors["rope_freqs.weight"], TensorMap("rope_freqs"), path).flatten()
    if native or factors is not None:  # native: built on the meta device, the RoPE frequencies made again
        model.inv_freq = target.inv_freq(factors).to(model.device)
    model.weight_types = {m.name: tensors[name].tensor_type.name for name, m in maps.items()}
    return finish_model(model), meta


def _input_order(model: torch.nn.Module, owner: str, order: Tensor) -> None:
    layer = model.get_submodule(owner.rpartition(".")[0])
    assert hasattr(layer, "out_order") and owner.endswith(".out_proj"), \
        f"{owner}: only GatedDeltaNet.out_proj reads its input in another order"
    layer.out_order = order


@functools.cache
def readable_types() -> tuple[str, ...]:
    """The GGUF tensor types a load can read: the float types, and every quantized type the ``gguf``
    package dequantizes (those of ``quant.FORMATS`` can also stay in their blocks)."""
    import gguf

    readable = []
    for kind in gguf.GGMLQuantizationType:
        _, nbytes = gguf.GGML_QUANT_SIZES[kind]
        try:  # one zero block: the package says which types it has no dequantizer for
            gguf.quants.dequantize(np.zeros((1, nbytes), np.uint8), kind)
        except NotImplementedError:
            continue
        readable.append(kind.name)
    return tuple(readable)


def _check_types(tensors: dict, where: Path) -> None:
    """Refuse a tensor of a type no load can read before building anything, naming it and the rest."""
    unread = {name: t.tensor_type.name for name, t in tensors.items() if t.tensor_type.name not in readable_types()}
    if unread:
        name, kind = next(iter(unread.items()))
        more = f" (and {len(unread) - 1} more tensors of types {sorted(set(unread.values()))})" if len(unread) > 1 \
            else ""
        raise EngineInputError(
            f"{where}: tensor {name!r} has type {kind}, which is not supported{more}; supported types: "
            f"{list(readable_types())} (kept in blocks with weights='native': {list(FORMATS)}; "
            f"{list(FLOAT_TYPES)} are floats)")


def _native_plan(tensors: dict, maps: dict[str, TensorMap]) -> NativePlan:
    """The weights a native load keeps in their blocks: our module name -> (format, the [out, in]
    shape the file gives), for every matrix of a native format whose values need no rewriting.
    ``build_model`` swaps in a block layer only where the model has a linear projection or an untied
    embedding (not a tied one, not the conv) of that shape, so a misshapen tensor is refused as in a
    dequantized load."""
    plan: NativePlan = {}
    for name, m in maps.items():
        t = tensors[name]
        if m.name.endswith(".weight") and m.value is None and t.tensor_type.name in FORMATS and len(t.shape) == 2:
            cols, rows = (int(n) for n in t.shape)  # GGUF shapes are [in, out]
            plan[m.name.removesuffix(".weight")] = (FORMATS[t.tensor_type.name], (rows, cols))
    return plan


def _block_order(cols: Tensor, fmt: BlockFormat) -> Tensor | None:
    """The order of a row's blocks that moves its columns as ``cols`` does, or None where a block's
    columns would not stay together (a permutation of heads narrower than the block)."""
    if cols.numel() % fmt.values:
        return None
    runs = cols.view(-1, fmt.values)
    starts = runs[:, :1]
    if bool((starts % fmt.values != 0).any()) or not torch.equal(runs, starts + torch.arange(fmt.values)):
        return None
    return starts.flatten() // fmt.values


def _gguf_tensor(t: Any, m: TensorMap, where: Path, shapes_only: bool = False) -> Tensor:
    """A tensor dequantized to float32, in our layout; ``shapes_only``: its shape on the meta device,
    from the header (the rows and columns move within it; ``value`` may reshape it)."""
    from gguf.quants import dequantize

    if shapes_only:
        w = torch.empty([int(n) for n in reversed(t.shape)], device="meta")  # GGUF shapes are [in, out]
        return w if m.value is None else m.value(w)
    try:
        # The reader's numpy arrays already have PyTorch's row-major shape ([out, in]).
        array = dequantize(t.data, t.tensor_type)
    except Exception as exc:  # data cut short or of a size its type cannot hold: a corrupt file
        raise EngineInputError(f"{where}: tensor {t.name!r} cannot be read ({type(exc).__name__}: "
                               f"{preview(str(exc))}): the file is corrupt") from None
    w = torch.from_numpy(np.require(array, np.float32, ["C", "W"]))
    # A tensor of another size than its order is the wrong shape for the model: left as it is for
    # ``load_state`` to name.
    if m.rows is not None and m.rows.numel() == w.shape[0]:
        w = w[m.rows]
    if m.cols is not None and w.ndim == 2 and m.cols.numel() == w.shape[1]:
        w = w[:, m.cols]
    return w if m.value is None else m.value(w)


def _gguf_blocks(t: Any, rows: Tensor | None, cols: Tensor | None, fmt: BlockFormat, where: Path,
                 shapes_only: bool = False) -> Tensor:
    """A quantized tensor's blocks, uint8 [out, row_bytes], with rows (and whole blocks of columns)
    reordered as the architecture's map says (quantisation is per row, in blocks of consecutive columns,
    so whole rows and whole blocks move), its scales checked finite, then held as a ``QuantLinear`` holds
    them (``quant.hold``);
    ``shapes_only``: empty blocks of that shape on the meta device, from the header."""
    n_rows, n_cols = int(t.shape[1]), int(t.shape[0])
    expect = (n_rows, fmt.row_bytes(n_cols))
    if shapes_only:
        if n_cols % fmt.values:
            raise EngineInputError(f"{where}: tensor {t.name!r} ({fmt.name}, [{n_rows}, {n_cols}]) is not whole "
                                   f"{fmt.values}-value blocks: the file is corrupt")
        return torch.empty(expect, dtype=torch.uint8, device="meta")
    try:
        data = np.array(t.data, dtype=np.uint8, copy=True)  # the reader's arrays are read-only file maps
    except Exception as exc:  # data cut short: a corrupt file
        raise EngineInputError(f"{where}: tensor {t.name!r} cannot be read ({type(exc).__name__}: "
                               f"{preview(str(exc))}): the file is corrupt") from None
    if n_cols % fmt.values or tuple(data.shape) != expect:
        raise EngineInputError(f"{where}: tensor {t.name!r} ({fmt.name}, [{n_rows}, {n_cols}]) holds bytes "
                               f"{list(data.shape)}, not {list(expect)}: the file is corrupt")
    blocks = torch.from_numpy(data)
    bad = bad_scales(blocks, fmt)
    if bad:
        raise EngineInputError(f"{where}: tensor {t.name!r} ({fmt.name}) holds {bad:,} NaN or inf block scales "
                               f"in {blocks.numel() // fmt.nbytes:,} blocks: the weights are corrupt")
    if rows is not None and rows.numel() == n_rows:
        blocks = blocks[rows]
    if cols is not None and cols.numel() == n_cols:
        per_row = n_cols // fmt.values
        blocks = blocks.view(n_rows, per_row, fmt.nbytes)[:, _block_order(cols, fmt)].reshape(expect)
    return hold(blocks, fmt).contiguous()
