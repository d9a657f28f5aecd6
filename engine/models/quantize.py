"""Float weights into GGUF blocks, in PyTorch on any device: a quantizer per format of ``quant.FORMATS``
and ``quantize_model_``, which swaps a model's projections for ``QuantLinear``s in a llama.cpp-like mix
(``RECIPES``), so that a timing preset of random weights (the 27B and 8B shapes) runs quantized as a
GGUF file would, with no file.

The 32-value formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) follow ggml's reference quantizers as the gguf
package writes them (bit for bit: ``tests/engine/models/test_quantize.py``). The K formats follow
llama.cpp's reference algorithms (``quantize_row_q{4,5,6}_K_ref``): per sub-block a weighted search for
the scale (and min) with the least squared error, the sub-block scales then quantized to 6 or 8 bits
under one fp16 super-block scale, and the values requantized with the scales as stored. Not bit for bit
llama.cpp's (float sums in another order), and never needed to be: what a model decodes depends on the
blocks it holds, which ``quant.dequantize`` reads exactly.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor, nn

from engine.models.common import FusedLinear
from engine.models.quant import (
    FORMATS,
    QK_K,
    BlockFormat,
    QuantEmbedding,
    QuantFusedLinear,
    QuantLinear,
    fusable,
    hold,
    shared_parameters,
)

GROUP_MAX_EPS = 1e-15  # a group whose largest magnitude is below this is stored as zeros (llama.cpp's)
CHUNK_VALUES = 1 << 25  # values quantized at once: bounds the temporaries (a 27B-shape lm_head has 1.3e9)


def _f16_bytes(v: Tensor) -> Tensor:
    """float32 [n] -> its fp16 bytes [n, 2] (rounded to nearest, as ggml's fp32 -> fp16)."""
    return v.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def _f16(v: Tensor) -> Tensor:
    """float32 -> the value its fp16 holds, as float32 (scales are used as stored)."""
    return v.to(torch.float16).float()


def _nibbles(lo: Tensor, hi: Tensor) -> Tensor:
    return (lo & 15) | ((hi & 15) << 4)


def _round_away(v: Tensor) -> Tensor:
    """Round half away from zero (C's roundf, gguf's np_roundf)."""
    a = v.abs()
    floored = a.floor()
    return v.sign() * (floored + (2 * (a - floored)).floor())


def _inverse(d: Tensor) -> Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


def _q8_0(x: Tensor) -> Tensor:
    d = x.abs().amax(-1, keepdim=True) / 127
    q = _round_away(x * _inverse(d)).to(torch.int8).view(torch.uint8)
    return torch.cat([_f16_bytes(d), q], -1)


def _signed_max(x: Tensor) -> Tensor:
    """The value of largest magnitude of each block, with its sign (the first of equals)."""
    return x.gather(-1, x.abs().argmax(-1, keepdim=True))


def _q4_0(x: Tensor) -> Tensor:
    d = _signed_max(x) / -8
    q = torch.trunc(x * _inverse(d) + 8.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_f16_bytes(d), _nibbles(q[:, :16], q[:, 16:])], -1)


def _q4_1(x: Tensor) -> Tensor:
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    q = torch.trunc((x - lo) * _inverse(d) + 0.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_f16_bytes(d), _f16_bytes(lo), _nibbles(q[:, :16], q[:, 16:])], -1)


def _fifth_bits(q: Tensor) -> Tensor:
    """Bit 4 of each of 32 values as a little-endian uint32 (bit j: value j) -> 4 bytes."""
    bits = ((q >> 4) & 1).reshape(-1, 4, 8).to(torch.int32)
    return (bits << torch.arange(8, device=q.device, dtype=torch.int32)).sum(-1).to(torch.uint8)


def _q5_0(x: Tensor) -> Tensor:
    d = _signed_max(x) / -16
    q = torch.trunc(x * _inverse(d) + 16.5).clamp(0, 31).to(torch.uint8)
    return torch.cat([_f16_bytes(d), _fifth_bits(q), _nibbles(q[:, :16], q[:, 16:])], -1)


def _q5_1(x: Tensor) -> Tensor:
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    d = (hi - lo) / 31
    q = torch.trunc((x - lo) * _inverse(d) + 0.5).clamp(0, 31).to(torch.uint8)
    return torch.cat([_f16_bytes(d), _f16_bytes(lo), _fifth_bits(q), _nibbles(q[:, :16], q[:, 16:])], -1)


def _scale_min_search(x: Tensor, w: Tensor, nmax: int, rmin: float, rdelta: float, nstep: int
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """llama.cpp's ``make_qkx2_quants`` for every group at once: x, w [n, g] -> (scale [n], min [n] (<= 0:
    subtracted), L [n, g] in 0..nmax) minimising sum w (scale * L + min - x)^2 over the candidate
    inverse scales (rmin + rdelta * i + nmax) / (max - min), i = 0..nstep, each refined by weighted
    least squares (the min clamped to <= 0)."""
    lo = x.amin(-1).clamp(max=0)
    hi = x.amax(-1)
    flat = hi == lo
    span = torch.where(flat, torch.ones_like(hi), hi - lo)
    sum_w, sum_x = w.sum(-1), (w * x).sum(-1)

    def levels(iscale: Tensor, low: Tensor) -> Tensor:
        return torch.round(iscale[:, None] * (x - low[:, None])).clamp(0, nmax)

    def error(scale: Tensor, low: Tensor, q: Tensor) -> Tensor:
        return (w * (scale[:, None] * q + low[:, None] - x) ** 2).sum(-1)

    iscale = nmax / span
    scale, low = 1 / iscale, lo
    best_q = levels(iscale, lo)
    best = error(scale, low, best_q)
    for i in range(nstep + 1):
        q = levels((rmin + rdelta * i + nmax) / span, lo)
        sum_l, sum_l2, sum_xl = (w * q).sum(-1), (w * q * q).sum(-1), (w * q * x).sum(-1)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = torch.where(ok, det, torch.ones_like(det))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        clamp = this_min > 0  # a positive min would be added: solve for the scale alone with min 0
        this_scale = torch.where(clamp, sum_xl / torch.where(sum_l2 > 0, sum_l2, torch.ones_like(sum_l2)), this_scale)
        this_min = torch.where(clamp, torch.zeros_like(this_min), this_min)
        cur = error(this_scale, this_min, q)
        better = ok & (cur < best)
        best = torch.where(better, cur, best)
        scale = torch.where(better, this_scale, scale)
        low = torch.where(better, this_min, low)
        best_q = torch.where(better[:, None], q, best_q)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    return scale, torch.where(flat, -lo, -low), torch.where(flat[:, None], torch.zeros_like(best_q), best_q)


def _k_affine(x: Tensor, nmax: int, rmin: float, nstep: int) -> tuple[Tensor, Tensor]:
    """Q4_K / Q5_K super-blocks x [n, 256] -> (the 16 header bytes [n, 16]: d, dmin, the 6-bit scales and
    mins packed; the levels [n, 8, 32] in 0..nmax under the stored scales)."""
    sub = x.reshape(-1, 8, 32)
    av = (sub.pow(2).sum(-1, keepdim=True) / 32).sqrt()
    scales, mins, levels = _scale_min_search(sub.reshape(-1, 32), (av + sub.abs()).reshape(-1, 32), nmax, rmin,
                                             0.1, nstep)
    scales, mins, levels = scales.reshape(-1, 8), mins.reshape(-1, 8), levels.reshape(-1, 8, 32)
    max_scale, max_min = scales.amax(-1, keepdim=True), mins.amax(-1, keepdim=True)
    # the 6-bit scales and mins: 63 / max (0 where the max is 0), as llama.cpp's inv_scale and inv_min
    ls = torch.round(torch.where(max_scale > 0, 63 / torch.where(max_scale > 0, max_scale, 1), 0) * scales).clamp(0, 63)
    lm = torch.round(torch.where(max_min > 0, 63 / torch.where(max_min > 0, max_min, 1), 0) * mins).clamp(0, 63)
    d, dmin = _f16(max_scale / 63), _f16(max_min / 63)
    step, shift = d * ls, dmin * lm  # as the decoder forms them
    q = torch.round((sub + shift[..., None]) / torch.where(step > 0, step, 1)[..., None]).clamp(0, nmax)
    levels = torch.where((step > 0)[..., None], q, levels).to(torch.uint8)
    sc, mn = ls.to(torch.uint8), lm.to(torch.uint8)
    packed = torch.cat([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
                        (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], -1)
    return torch.cat([_f16_bytes(d), _f16_bytes(dmin), packed], -1), levels


def _low_nibbles(levels: Tensor) -> Tensor:
    """levels [n, 8, 32] -> 128 bytes: chunk c holds sub-block 2c in its low nibbles, 2c + 1 in its high."""
    return _nibbles(levels[:, 0::2], levels[:, 1::2]).reshape(-1, 128)


def _q4_k(x: Tensor) -> Tensor:
    head, levels = _k_affine(x, 15, -1.0, 20)
    return torch.cat([head, _low_nibbles(levels)], -1)


def _q5_k(x: Tensor) -> Tensor:
    head, levels = _k_affine(x, 31, -0.5, 15)
    shifts = torch.arange(8, device=x.device, dtype=torch.int32)[None, :, None]
    high = (((levels >> 4) & 1).to(torch.int32) << shifts).sum(1).to(torch.uint8)  # bit j: sub-block j
    return torch.cat([head, high, _low_nibbles(levels)], -1)


def _scale_search(x: Tensor, nmax: int) -> Tensor:
    """llama.cpp's ``make_qx_quants`` (rmse_type 1) for every group x [n, g]: the signed scale whose levels
    in -nmax..nmax-1 give the most x^2-weighted agreement, over inverse scales -(nmax + 0.1 i) / max for
    i = -9..9 (max: the value of largest magnitude). 0 for a group of (near) zeros."""
    top = _signed_max(x).squeeze(-1)
    tiny = top.abs() < GROUP_MAX_EPS
    top = torch.where(tiny, torch.ones_like(top), top)
    w = x * x
    best_scale, best = None, None
    for i in [0] + [i for i in range(-9, 10) if i]:
        q = torch.round(-(nmax + 0.1 * i) / top[:, None] * x).clamp(-nmax, nmax - 1)
        sum_lx, sum_l2 = (w * x * q).sum(-1), (w * q * q).sum(-1)
        scale = torch.where(sum_l2 > 0, sum_lx / torch.where(sum_l2 > 0, sum_l2, 1), 0)
        if best is None:
            best_scale, best = scale, scale * sum_lx
            continue
        better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
        best_scale = torch.where(better, scale, best_scale)
        best = torch.where(better, scale * sum_lx, best)
    return torch.where(tiny, torch.zeros_like(best_scale), best_scale)


def _q6_k(x: Tensor) -> Tensor:
    groups = x.reshape(-1, 16, 16)
    scales = _scale_search(groups.reshape(-1, 16), 32).reshape(-1, 16)
    top = _signed_max(scales)  # the scale of largest magnitude, with its sign
    zero = top.abs() < GROUP_MAX_EPS
    iscale = -128 / torch.where(zero, 1, top)
    d = torch.where(zero, 0, _f16(1 / iscale))
    sc = torch.round(iscale * scales).clamp(-128, 127).to(torch.int8)
    step = d * sc.float()
    q = torch.round(groups / torch.where(step != 0, step, 1)[..., None]).clamp(-32, 31)
    u = (torch.where((step != 0)[..., None], q, 0) + 32).to(torch.uint8).reshape(-1, 2, 4, 32)  # halves, groups
    low = torch.cat([_nibbles(u[:, :, 0], u[:, :, 2]), _nibbles(u[:, :, 1], u[:, :, 3])], -1)  # [n, 2, 64]
    high = sum(((u[:, :, g] >> 4) & 3) << (2 * g) for g in range(4)).to(torch.uint8)  # [n, 2, 32]
    return torch.cat([low.reshape(-1, 128), high.reshape(-1, 64), sc.view(torch.uint8), _f16_bytes(d)], -1)


_ENCODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k,
             "Q5_K": _q5_k, "Q6_K": _q6_k}


@torch.no_grad()
def quantize(weight: Tensor, fmt: BlockFormat) -> Tensor:
    """``weight`` [N, K] (any float dtype, any device; K a multiple of ``fmt.values``) as ``fmt``'s blocks
    [N, row_bytes] (uint8, on its device): what a GGUF file of that type holds (``quant.hold`` gives the rows
    a ``QuantLinear`` reads).
    Computed in float32, a chunk of rows at a time."""
    rows, cols = weight.shape
    if cols % fmt.values:
        raise ValueError(f"{fmt.name} quantizes rows of whole {fmt.values}-value blocks, but the weight has {cols} "
                         "columns")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError(f"cannot quantize a weight with NaN or inf values to {fmt.name}")
    out = torch.empty(rows, fmt.row_bytes(cols), dtype=torch.uint8, device=weight.device)
    step = max(1, CHUNK_VALUES // cols)
    for lo in range(0, rows, step):
        x = weight[lo : lo + step].float().reshape(-1, fmt.values)
        out[lo : lo + step] = _ENCODERS[fmt.name](x).reshape(-1, out.shape[1])
    return out


# ------------------------------------------------------------------------------ a model's mix

# A recipe: the format of each projection by role, and the format a K format falls back to for rows that
# are not whole 256-value blocks (llama.cpp's). q4_k_m as llama.cpp's file type of that name (lm_head,
# down_proj, v_proj, the rest: ``q4_k_m_format``); q8_0 every projection Q8_0, as llama.cpp's Q8_0 file type
# (a DFlash draft's ``@q8_0``: ``registry.load_drafter``).
RECIPES = ("q4_k_m", "q8_0")
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of ``n`` layers and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_format(name: str, layer: int | None, n_layers: int, v_index: int | None, n_v: int) -> str:
    """The format llama.cpp's Q4_K_M gives projection ``name``: Q6_K for the output head, and for
    ``down_proj`` and ``v_proj`` on the layers ``more_bits`` picks (counted among the layers that have
    one); Q4_K for the rest, an untied token embedding included (the file type's own format, which
    llama.cpp gives ``token_embd``). (llama.cpp also gives a fused ``attn_qkv`` Q5_K; our projections are
    quantized part by part.)"""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "lm_head":
        return "Q6_K"
    if leaf == "down_proj" and layer is not None and more_bits(layer, n_layers):
        return "Q6_K"
    if leaf == "v_proj" and v_index is not None and more_bits(v_index, n_v):
        return "Q6_K"
    return "Q4_K"


def _parts(module: nn.Module, child_name: str, child: nn.Module) -> list[tuple[str, Tensor, Tensor | None]] | None:
    """(name, weight, bias) of each float projection ``child`` holds (a ``FusedLinear``: each part, its
    rows as views), or None where it holds none."""
    if isinstance(child, FusedLinear):
        parts = module.FUSED[child_name]
        biases = child.bias.split(child.sizes) if child.bias is not None else [None] * len(parts)
        return [(p, w, b if biased else None) for p, w, b, biased in
                zip(parts, child.weight.split(child.sizes), biases, child.biased, strict=True)]
    if isinstance(child, nn.Linear):
        return [(child_name, child.weight, child.bias)]
    return None


def _projections(model: nn.Module) -> list[tuple[nn.Module, str, str, list]]:
    """(owner, child name, owner's name prefix, parts) of every float projection of ``model``."""
    out = []
    for owner, module in model.named_modules():
        for child_name, child in module.named_children():
            parts = _parts(module, child_name, child)
            if parts is not None:
                out.append((module, child_name, f"{owner}." if owner else "", parts))
    return out


def _embeddings(model: nn.Module) -> list[tuple[nn.Module, str, str, list]]:
    """(owner, child name, owner's name prefix, [(child name, weight, None)]) of each float embedding of
    ``model`` no other module shares: a tied one stays float, since the head multiplies by it."""
    tied = shared_parameters(model)
    out = []
    for owner, module in model.named_modules():
        for child_name, child in module.named_children():
            if isinstance(child, nn.Embedding) and id(child.weight) not in tied:
                out.append((module, child_name, f"{owner}." if owner else "", [(child_name, child.weight, None)]))
    return out


def recipe_formats(model: nn.Module, recipe: str = "q4_k_m") -> dict[str, str]:
    """Checkpoint name -> format of each projection weight (and untied embedding) ``quantize_model_``
    quantizes in ``recipe``'s mix (``RECIPES``; ``q4_k_m``: ``q4_k_m_format``; a width that is not whole 256-value
    blocks takes the K format's ``FALLBACK``; a weight not whole 32-value blocks is left out: it stays
    float). Reads names and shapes only, so it plans a model on the meta device as ``quantize_model_``
    quantizes a real one (fused groups by their parts' names, as unfused)."""
    return _formats(_projections(model) + _embeddings(model), recipe)


def _formats(found: list[tuple[nn.Module, str, str, list]], recipe: str) -> dict[str, str]:
    if recipe not in RECIPES:
        raise ValueError(f"unknown quantization recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    weights = {prefix + part: weight for _, _, prefix, parts in found for part, weight, _ in parts}
    layer_of = {n: int(m.group(1)) if (m := _LAYER.search(n)) else None for n in weights}
    n_layers = 1 + max((i for i in layer_of.values() if i is not None), default=-1)
    v_names = [n for n in weights if n.rsplit(".", 1)[-1] == "v_proj"]
    out: dict[str, str] = {}
    for name, weight in weights.items():
        kind = "Q8_0" if recipe == "q8_0" else q4_k_m_format(
            name, layer_of[name], n_layers, v_names.index(name) if name in v_names else None, len(v_names))
        cols = weight.shape[1]
        kind = FALLBACK.get(kind, kind) if cols % QK_K else kind
        if cols % FORMATS[kind].values == 0:  # else not whole blocks of any format: stays float
            out[f"{name}.weight"] = kind
    return out


def _held(weight: Tensor, fmt: BlockFormat) -> Tensor:
    """``weight``'s blocks in ``fmt``, held (``quant.hold``); on the meta device, empty ones of the bytes they
    would take (a plan: ``engine.load(device="meta")``)."""
    if weight.is_meta:
        return torch.empty((weight.shape[0], fmt.row_bytes(weight.shape[1])), dtype=torch.uint8, device="meta")
    return hold(quantize(weight, fmt), fmt)


@torch.no_grad()
def quantize_model_(model: nn.Module, recipe: str = "q4_k_m") -> dict[str, str]:
    """Replace ``model``'s float projections by ``QuantLinear``s holding them quantized in ``recipe``'s
    mix (``recipe_formats``), on the weights' device, in place, one projection at a time (its floats
    freed before the next is quantized, unless shared): a fused group whose parts share a format
    becomes one ``QuantFusedLinear``, a mixed one its parts (``quant.fusable``). A projection whose width
    is not whole 256-value blocks takes the K format's ``FALLBACK``; one not whole 32-value blocks stays
    float. An untied embedding becomes a ``QuantEmbedding``; a tied one and the norms stay float (a tied
    ``lm_head`` gets its own blocks). Returns checkpoint name -> format of each weight quantized
    (``quant.weights_summary`` then reads the model as it reads a native GGUF load). On the meta device the
    blocks are empty, of the bytes they would take."""
    found, embeddings = _projections(model), _embeddings(model)  # (untied: before the head is swapped)
    kinds = _formats(found + embeddings, recipe)
    formats: dict[str, str] = {}
    for module, child_name, prefix, parts in embeddings:
        (_, weight, _), = parts
        if (kind := kinds.get(f"{prefix}{child_name}.weight")) is not None:
            fmt = FORMATS[kind]
            setattr(module, child_name, QuantEmbedding(fmt, weight.shape[0], weight.shape[1], dtype=weight.dtype,
                                                       blocks=_held(weight, fmt)))
            formats[f"{prefix}{child_name}.weight"] = kind
        parts.clear()  # (the float table freed now, as a projection's is)
        del weight
    for module, child_name, prefix, parts in found:
        # (the parts of a group share their width: all quantized, or the group stays float)
        if all(f"{prefix}{part}.weight" in kinds for part, _, _ in parts):
            layers = []
            for part, weight, bias in parts:
                kind = kinds[f"{prefix}{part}.weight"]
                layer = QuantLinear(FORMATS[kind], weight.shape[1], weight.shape[0], bias=bias is not None,
                                    blocks=_held(weight, FORMATS[kind]))
                if bias is not None:
                    layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
                layers.append((part, layer, kind))
            quant_parts = [layer for _, layer, _ in layers]
            if len(layers) > 1 and fusable(quant_parts):
                setattr(module, child_name, QuantFusedLinear(quant_parts))
            else:  # one projection, or a group of mixed formats: its parts, each in its own blocks
                delattr(module, child_name)
                for part, layer, _ in layers:
                    setattr(module, part, layer)
            formats.update({f"{prefix}{part}.weight": kind for part, _, kind in layers})
        parts.clear()  # drop the views of the float weight: freed with the module it belonged to
    return formats
