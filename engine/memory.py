"""Device memory of a loaded pair decoding one config, per part: planned from shapes and dtypes
(any device, the meta device included: a 27B shape's plan allocates nothing) and measured on CUDA.

The parts (``MEMORY_PARTS``) are what a generation holds at its longest: the target's and the
draft's weights, the workspace sized for ``prompt_tokens + new_tokens`` (``decode.workspace_length``:
the target's K/V, a hybrid target's recurrent state and per-node tree records, the target features
the draft reads, the draft's context K/V), a prefix cache's copies of committed positions (a server's
and a session sweep's, ``engine.decoding.prefix_cache``), the captured CUDA graphs' pool, and the
largest transient (``activations``: a prefill of the whole prompt and the draft's context K/V of it, or a
verify step and its proposal).

Planned static parts are the bytes of the tensors the engine allocates (the caches are built on the
meta device to be counted); ``reserve_memory`` allocates the workspace at exactly that length, so
that no generation of a workload grows it (growth doubles it) and the measured buffers equal the
plan. The prefix cache is planned as what it keeps of the planned generation (its committed
positions at the cache's per-position cost, and a hybrid's two state checkpoints), at most its
budget. The transients are an estimate from the layers' widths (``_forward_bytes``): the loosest part
of a plan. Measured (``measure_memory``): the same static parts from the tensors the pair holds, the
prefix cache's bytes as the cache counts them, the graphs' pool from the CUDA allocator's snapshot,
and the rest of the measured peak as activations.
"""

from __future__ import annotations

import gc
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from engine.config import MAX_BUDGET, EngineConfig, EngineInputError
from engine.decoding import graphs, runtime
from engine.decoding import prefix_cache as prefix_cache_mod
from engine.decoding.decode import feature_rows, verify_shape, workspace_length
from engine.decoding.drafters import CONTEXT_ROWS, DFlashDrafter, OracleDrafter
from engine.models.attention import SMALL_QUERIES, step_split
from engine.models.common import FusedLinear
from engine.models.dense import KVCache
from engine.models.hybrid import HybridModel
from engine.models.hybrid_cache import HybridCache
from engine.models.quant import QuantLinear

MEMORY_PARTS = {
    "target_weights": "the target's parameters and buffers (quantized blocks at their size in bytes)",
    "draft_weights": "the draft's (a DFlash draft borrows the target's embedding and head)",
    "kv_cache": "the target's attention K/V for every workspace slot",
    "recurrent_state": "a hybrid target's Gated DeltaNet recurrent and conv state",
    "tree_state": "a hybrid target's per-node records of a verify at the config's tree",
    "features": "the target features the draft reads, one row per workspace slot",
    "draft_context": "the draft's context K/V per slot (an oracle draft: its own target cache)",
    "prefix_cache": "committed positions a prefix cache keeps across requests (K/V, draft features, a hybrid's "
                    "state checkpoints), up to the cache's budget",
    "graph_pools": "the captured CUDA graphs' memory pool (the runtime's steps, on CUDA)",
    "activations": "the largest transient: the prompt's prefill (then the draft's context of it, a chunk at a "
                   "time), or a step and its proposal",
}
KINDS = ("planned", "measured")
_OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "down_proj")  # a layer's projections that read its mixer's output


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per part (``MEMORY_PARTS``, every part present) of one config on one pair, for a
    generation of ``prompt_tokens`` + ``new_tokens``; ``kind``: ``planned`` or ``measured``; ``loop``:
    the decode loop it was planned or measured for (``graphs``, ``runtime`` or ``generic``)."""

    kind: str
    parts: dict[str, int] = field(hash=False)
    prompt_tokens: int
    new_tokens: int
    loop: str

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def dominant(self) -> str:
        """The largest part (the first in ``MEMORY_PARTS`` order on a tie)."""
        return max(self.parts, key=lambda k: self.parts[k])

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "total": self.total, "dominant": self.dominant, "parts": dict(self.parts),
                "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "loop": self.loop}


def plan_memory(pair, config: EngineConfig, prompt_tokens: int, new_tokens: int, *, device: str | None = None,
                dtype: torch.dtype | None = None, constrained: bool = False,
                prefix_cache_bytes: int = 0, prefix_cache_tokens: int | None = None,
                prefix_cache_generations: int = 1) -> MemoryBreakdown:
    """What ``config`` needs on ``pair`` for a generation of ``prompt_tokens + new_tokens``, from
    shapes and dtypes alone (nothing is allocated). ``device`` / ``dtype``: plan as if the pair were
    loaded there, in that dtype (``autotune plan`` of a CUDA experiment on a CPU; the quantized
    blocks keep their size); ``constrained``: a prompt has a grammar (a hybrid keeps the state a
    grammar cut restores); ``prefix_cache_bytes``: the budget of the prefix cache the generation
    commits into (``PrefixCache.budget_bytes``; 0: none): part ``prefix_cache`` is what the cache
    keeps of this generation, at most the budget; ``prefix_cache_tokens`` and ``prefix_cache_generations``:
    what it keeps over a whole workload instead (a session sweep replays every session through one
    cache: the positions of all their requests and answers, and a hybrid's two state checkpoints per
    generation), at most the budget."""
    _check_lengths(prompt_tokens, new_tokens)
    if not isinstance(prefix_cache_bytes, int) or prefix_cache_bytes < 0:
        raise EngineInputError(f"prefix_cache_bytes must be a whole number of bytes >= 0 (0: no prefix cache), "
                               f"but got {prefix_cache_bytes!r}")
    counts = [("prefix_cache_generations", prefix_cache_generations, 1)]
    if prefix_cache_tokens is not None:  # (None: this generation's positions)
        counts.append(("prefix_cache_tokens", prefix_cache_tokens, 0))
    for key, value, least in counts:
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise EngineInputError(f"{key} must be a whole number >= {least}, but got {value!r}")
    dev = torch.device(device or pair.target.device)
    dt = dtype or pair.target.dtype
    size = torch.empty((), dtype=dt, device="meta").element_size()
    speculative = _speculative(pair, config)
    length = workspace_length(pair, config, prompt_tokens, new_tokens)
    n_verify = verify_shape(pair, config)[1] if speculative else 1
    cache = _meta_cache(pair.target, length, n_verify if speculative else 0, dt)
    if constrained and speculative and isinstance(cache, HybridCache):
        cache.rec_prev = torch.empty_like(cache.rec)  # kept for a grammar's cut (``keep_previous``)
    parts = dict.fromkeys(MEMORY_PARTS, 0)
    parts["target_weights"] = _module_bytes(pair.target, pair.target.dtype, dt)
    parts["draft_weights"] = _draft_bytes(pair, dt)
    parts.update(_cache_parts(cache))
    feature_width = _feature_width(pair) if speculative else 0
    loop = _loop(pair, config, dev, constrained)
    rows = _feature_rows(pair, config, length, loop, prefix_cache_bytes > 0) if speculative else 0
    parts["features"] = rows * feature_width * size
    parts["draft_context"] = _planned_draft_context(pair, length, dt) if speculative else 0
    positions = prompt_tokens + new_tokens - 1 if prefix_cache_tokens is None else prefix_cache_tokens
    parts["prefix_cache"] = _planned_prefix_cache(pair.target, positions, prompt_tokens >= 2, feature_width, dt,
                                                  prefix_cache_bytes, prefix_cache_generations)
    # a weight in blocks is read in place by the few-row kernel on CUDA in half precision (every row count a
    # decode forwards: steps, verifies, prefill chunks); elsewhere it is dequantized whole for each call
    in_place = dev.type == "cuda" and size == 2 and config.kernels == "fused"
    prefill = _prefill_bytes(pair.target, prompt_tokens, size, feature_width, dev.type == "cuda",
                             prefix_cache_bytes > 0, in_place)
    # a product through cuBLAS (a DFlash draft's, ``_uses_blas``) has PyTorch keep a workspace for its stream: the
    # eager one's is made by the context fill, which runs inside the prefill (at each ``CONTEXT_ROWS`` boundary), and
    # held from there on; a captured step's lives in its graph pool
    blas = blas_workspace_bytes(dev) if _uses_blas(pair, config, speculative) else 0
    # and a whole prompt's forward past SMALL_QUERIES rows attends through SDPA's math path, whose products are
    # cuBLAS's too, on the prefill's stream (AR's as well)
    sdpa = _prefill_sdpa_rows(prompt_tokens, dev.type == "cuda", prefix_cache_bytes > 0) > 0
    prefill_blas = blas_workspace_bytes(dev) if blas or sdpa else 0
    if speculative:  # the draft's context K/V of the prompt, a chunk at a time, as the prefill reaches it
        prefill = max(prefill, _context_fill_bytes(pair, prompt_tokens, size, in_place))
    step = _step_bytes(pair, config, prompt_tokens + new_tokens, length, n_verify, size, feature_width, speculative,
                       in_place)
    if loop == "graphs":  # the steps' transients live in the pool; the prefill runs eagerly beside it
        parts["graph_pools"], parts["activations"] = step + blas, prefill + prefill_blas
    else:  # (the eager steps reuse the prefill's workspace: one stream)
        parts["activations"] = max(prefill, step) + prefill_blas
    return MemoryBreakdown("planned", parts, prompt_tokens, new_tokens, loop)


def measure_memory(pair, config: EngineConfig, prompt_tokens: int, new_tokens: int, peak_bytes: int,
                   constrained: bool = False, prefix_cache_held: int = 0) -> MemoryBreakdown:
    """The measured breakdown after ``config`` decoded on ``pair`` (on CUDA: ``peak_bytes`` is
    ``torch.cuda.max_memory_allocated`` over the passes): the static parts from the tensors the pair
    holds now (``held_memory``), the prefix cache's ``prefix_cache_held`` bytes (the most a prefix
    cache held in the passes, ``BenchResult.prefix_cache_bytes``: its tensors were in the peak, and
    the cache may be gone by now), the graphs' pool from the allocator, and the rest of the peak as
    activations (with whatever small buffers no part names).

    The pool counts whole: what a capture freed stays the graph's (its replays write there), yet the
    allocator counts only what is still allocated; so the total is the allocated peak plus the pool's
    freed part, which no other allocation can take."""
    parts = held_memory(pair)
    parts["prefix_cache"] = int(prefix_cache_held)
    pool_allocated = _pool(pair)[1]
    held = sum(parts.values()) - parts["graph_pools"] + pool_allocated  # allocated, in the peak
    parts["activations"] = max(int(peak_bytes) - held, 0)
    return MemoryBreakdown("measured", parts, prompt_tokens, new_tokens,
                           _loop(pair, config, pair.target.device, constrained))


def held_memory(pair, prefix_cache: prefix_cache_mod.PrefixCache | None = None) -> dict[str, int]:
    """Bytes of the tensors ``pair`` holds now, per part (``activations`` 0: nothing transient is
    held between generations); ``prefix_cache``: the cache the pair's generations commit into (its
    ``bytes``: what it holds; None: part ``prefix_cache`` 0)."""
    parts = dict.fromkeys(MEMORY_PARTS, 0)
    parts["prefix_cache"] = prefix_cache.bytes if prefix_cache is not None else 0
    parts["target_weights"] = _module_bytes(pair.target)
    parts["draft_weights"] = _draft_bytes(pair)
    ws = pair._workspace
    if ws is not None:
        parts.update(_cache_parts(ws.cache))
        parts["features"] = _bytes([ws.features])
    decoder = getattr(pair, "_runtime_decoder", None)
    if decoder is not None and decoder.ws is ws:
        parts["draft_context"] += _bytes(decoder._draft_kv or ())
        parts["graph_pools"] = _pool(pair)[0]
    drafter = pair.drafter
    if isinstance(drafter, DFlashDrafter):  # the generic loop's context K/V
        parts["draft_context"] += _bytes([drafter._ctx_k, drafter._ctx_v])
    elif isinstance(drafter, OracleDrafter) and drafter._cache is not None:
        parts["draft_context"] += _bytes(_tensors(vars(drafter._cache).values()))
    return parts


def release_memory(pair) -> None:
    """Drop the decode buffers and captured graphs ``pair`` keeps between generations (the next one
    allocates and captures anew): what a config's memory is measured from, so that no other config's
    graphs or larger workspace count in it. On CUDA the freed memory goes back to the device."""
    pair._workspace = None
    if hasattr(pair, "_runtime_decoder"):
        del pair._runtime_decoder
    drafter = pair.drafter
    if isinstance(drafter, DFlashDrafter):
        drafter._ctx_k = drafter._ctx_v = None
        drafter.reset()
        drafter._constants.clear()
    elif isinstance(drafter, OracleDrafter):
        drafter._cache, drafter._cache_len = None, 0
    # the rotary tables and step constants made per workspace length (``rope_rows``): another config's length
    # made others, which stayed on the modules (~0.5 MiB a config on SmolLM2's shape, 2026-12-07)
    for model in (pair.target, getattr(drafter, "draft", None)):
        if model is not None:
            for module in model.modules():
                if isinstance(getattr(module, "_rope_tables", None), dict):
                    module._rope_tables.clear()
    if pair.target.device.type == "cuda":
        # a captured graph's pool is given back only once the graph object is gone (no graphs off CUDA,
        # where a collection per config would only widen the window in which a Ctrl-C lands in a
        # finalizer and is dropped)
        gc.collect()
        graphs.clear_blas_workspaces()  # the streams' cuBLAS workspaces, which empty_cache leaves
        torch.cuda.empty_cache()


def reserve_memory(pair, config: EngineConfig, prompt_tokens: int, new_tokens: int,
                   constrained: bool = False, prefix_cache: bool = False) -> None:
    """``release_memory``, then the workspace for generations of up to ``prompt_tokens + new_tokens``
    under ``config`` allocated once at ``plan_memory``'s length (and a hybrid's per-node records at
    its tree, and with ``constrained`` the state a grammar's cut restores; its target features as the
    generations will hold them, a ring unless ``prefix_cache``: ``decode.feature_rows``): no generation of
    the workload grows it (growing doubles it), and nothing of it is first allocated inside a captured
    graph's pool, where it would count twice."""
    _check_lengths(prompt_tokens, new_tokens)
    speculative = _speculative(pair, config)
    release_memory(pair)
    length = workspace_length(pair, config, prompt_tokens, new_tokens)
    loop = _loop(pair, config, pair.target.device, constrained)
    ws = pair.workspace(length, _feature_width(pair) if speculative else 0,
                        feature_rows(pair, config, loop != "generic", prefix_cache) if speculative else None)
    if speculative and isinstance(ws.cache, HybridCache):
        ws.cache.reserve_tree(verify_shape(pair, config)[1])
        if constrained:  # (``HybridCache.commit_recurrent`` would make it on the first commit that keeps it)
            ws.cache.rec_prev = torch.empty_like(ws.cache.rec)


def largest_budget(pair, config: EngineConfig, prompt_tokens: int, new_tokens: int, limit: int,
                   **plan_kw: Any) -> int | None:
    """The largest DDTree ``budget`` (``config`` otherwise as it is) whose plan fits ``limit`` bytes;
    None when even a budget of 1 does not. The plan grows with the budget until the tree holds every
    node ``top_k`` and the block allow: past that the largest budget is ``MAX_BUDGET``. ``plan_kw``:
    ``plan_memory``'s keywords (``device``, ``dtype``, ``constrained``, ``prefix_cache_bytes``)."""
    if config.verify != "ddtree":
        raise EngineInputError(f"a tree budget applies to verify='ddtree', not {config.verify!r}")
    return _largest(1, MAX_BUDGET, lambda b: plan_memory(pair, config.replace(budget=b), prompt_tokens,
                                                         new_tokens, **plan_kw).total <= limit)


def longest_context(pair, config: EngineConfig, new_tokens: int, limit: int, most: int,
                    **plan_kw: Any) -> int | None:
    """The longest context (a prompt and ``new_tokens``, at most ``most`` tokens) whose plan under
    ``config`` fits ``limit`` bytes; None when not even a one-token prompt does. ``plan_kw``: as
    ``largest_budget``'s."""
    if most <= new_tokens:
        return None
    prompt = _largest(1, most - new_tokens, lambda p: plan_memory(pair, config, p, new_tokens, **plan_kw).total
                      <= limit)
    return None if prompt is None else prompt + new_tokens


# ------------------------------------------------------------------------------------------ helpers
def _check_lengths(prompt_tokens: int, new_tokens: int) -> None:
    if prompt_tokens < 1 or new_tokens < 1:
        raise EngineInputError(f"a memory plan needs a prompt and new tokens (>= 1 each), but got "
                               f"prompt_tokens={prompt_tokens}, new_tokens={new_tokens}")


def _speculative(pair, config: EngineConfig) -> bool:
    """Whether ``config`` drafts; one that would on a pair without a draft is refused, as decoding it is."""
    if config.verify != "ar" and pair.drafter is None:
        raise EngineInputError(f"verify={config.verify!r} needs a draft, but the pair was loaded without one")
    return config.verify != "ar"


def _largest(low: int, high: int, fits) -> int | None:
    """The largest n in [low, high] with ``fits(n)`` (monotone: true up to some n, then false)."""
    if not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _tensors(values: Iterable[Any]) -> list[Tensor]:
    """The tensors among ``values`` and inside the tuples among them (a cache's fields)."""
    out: list[Tensor] = []
    for v in values:
        if isinstance(v, Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            out += _tensors(v)
    return out


def _bytes(tensors: Iterable[Tensor | None]) -> int:
    """Bytes of the distinct tensors given (None skipped)."""
    unique = {id(t): t for t in tensors if t is not None}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _module_bytes(module: nn.Module, loaded: torch.dtype | None = None, priced: torch.dtype | None = None,
                  skip: set[int] | None = None) -> int:
    """Bytes of ``module``'s parameters and buffers (a tied weight once; ``skip``: ids counted elsewhere).
    Tensors in the ``loaded`` dtype are priced in ``priced`` (a plan for another dtype); the RoPE
    frequencies stay float32 and quantized blocks stay bytes, as loading keeps them."""
    named = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers())}
    seen: dict[int, tuple[str, Tensor]] = {}
    for name, t in named.items():
        if skip is None or id(t) not in skip:
            seen.setdefault(id(t), (name, t))
    total = 0
    for name, t in seen.values():
        size = t.element_size()
        if priced is not None and t.dtype == loaded and t.is_floating_point() and not name.endswith("inv_freq"):
            size = torch.empty((), dtype=priced, device="meta").element_size()
        total += t.numel() * size
    return total


def _draft_bytes(pair, priced: torch.dtype | None = None) -> int:
    if not isinstance(pair.drafter, DFlashDrafter):
        return 0  # an oracle draft is the target itself; none: no draft
    shared = {id(t) for t in [*pair.target.parameters(), *pair.target.buffers()]}
    draft = pair.drafter.draft
    return _module_bytes(draft, draft.norm.weight.dtype if priced else None, priced, shared)


def _meta_cache(target: nn.Module, length: int, tree: int, dtype: torch.dtype) -> KVCache:
    """The target's cache of ``length`` slots on the meta device (``new_cache``'s, counted, not allocated)."""
    meta = torch.device("meta")
    if isinstance(target, HybridModel):
        return HybridCache(target.cfg, length, meta, dtype, tree)
    c = target.cfg
    return KVCache(c.num_hidden_layers, length, c.num_key_value_heads, c.dim_per_head, meta, dtype)


def _cache_parts(cache: KVCache) -> dict[str, int]:
    """A target cache's bytes as parts: K/V, a hybrid's recurrent state and its per-node records."""
    parts = {"kv_cache": _bytes([cache.k, cache.v])}
    if isinstance(cache, HybridCache):
        parts["recurrent_state"] = _bytes([cache.rec, cache.conv, cache.conv_prev, cache.rec_prev])
        parts["tree_state"] = _bytes([cache.tree_conv, *cache.tree_inputs])
    return parts


def _pool(pair) -> tuple[int, int]:
    """(reserved, allocated) bytes of the memory pool of the pair's captured graphs, from the CUDA
    allocator's snapshot (its segments name the pool that owns them); (0, 0) without one."""
    decoder = getattr(pair, "_runtime_decoder", None)
    device = pair.target.device
    pool = None if decoder is None or decoder.ws is not pair._workspace else decoder.graphs._pool
    if device.type != "cuda" or pool is None:
        return 0, 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    segments = [seg for seg in torch.cuda.memory_snapshot()
                if seg.get("device") == index and tuple(seg.get("segment_pool_id", ())) == tuple(pool)]
    return sum(int(seg["total_size"]) for seg in segments), sum(int(seg["allocated_size"]) for seg in segments)


def _feature_rows(pair, config: EngineConfig, length: int, loop: str, prefix_cache: bool) -> int:
    """Rows of the target features a speculative generation holds: a ring's (at most ``length``) or a row a
    position (``decode.feature_rows``)."""
    ring = feature_rows(pair, config, loop != "generic", prefix_cache)
    return length if ring is None else min(ring, length)


def _feature_width(pair) -> int:
    drafter = pair.drafter
    return len(drafter.feature_layers) * pair.target.cfg.hidden_size if drafter is not None else 0


def _planned_draft_context(pair, length: int, dtype: torch.dtype) -> int:
    drafter = pair.drafter
    if isinstance(drafter, DFlashDrafter):  # [layers, length, kv_heads, head_dim], K and V (``new_context``)
        c = drafter.draft.cfg
        size = torch.empty((), dtype=dtype, device="meta").element_size()
        return 2 * c.num_hidden_layers * length * c.num_key_value_heads * c.dim_per_head * size
    if isinstance(drafter, OracleDrafter):  # its own target cache, about as long as the workspace
        return sum(_cache_parts(_meta_cache(pair.target, length, 0, dtype)).values())
    return 0


def blas_workspace_bytes(device: torch.device | str) -> int:
    """Bytes of the workspace PyTorch gives cuBLAS for each stream a product runs on, on ``device``: as
    ``CUBLAS_WORKSPACE_CONFIG`` sets it (``:SIZE_KIB:COUNT`` pairs), else PyTorch's default, 32 MiB on compute
    capability 9.x and 10.x (measured on an H100, torch 2.11: 32.0 MiB a stream) and 8 MiB + 128 KiB on others;
    a plan made without the GPU takes 32 MiB. 0 off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    pairs = re.findall(r":(\d+):(\d+)", config)
    if pairs:  # as PyTorch reads it: every ``:SIZE:COUNT`` found, summed (none found: its default, with a warning)
        return sum(int(kib) * int(count) for kib, count in pairs) * 1024
    major = torch.cuda.get_device_capability(device)[0] if torch.cuda.is_available() else 9
    return 32 * 2**20 if major in (9, 10) else 8 * 2**20 + 128 * 2**10


def _uses_blas(pair, config: EngineConfig, speculative: bool) -> bool:
    """Whether a generation under ``config`` runs a product through cuBLAS: every product with the kernels off
    (``kernels: eager``: target and draft take ``F.linear``), else a DFlash draft's plain projections (a fused
    group's parts always, ``nn.Linear`` unless it keeps its rows invariant: ``free_rows_`` turns that off); a draft
    held in blocks takes the few-row kernel at any row count a step forwards."""
    if config.kernels != "fused":
        return True
    drafter = pair.drafter
    return speculative and isinstance(drafter, DFlashDrafter) and any(
        isinstance(m, FusedLinear) or (isinstance(m, nn.Linear) and not getattr(m, "row_invariant", False))
        for m in drafter.draft.modules())


def _context_fill_bytes(pair, prompt_tokens: int, size: int, in_place: bool = False) -> int:
    """The transient of projecting a prompt's context K/V for a DFlash draft (``DFlashDrafter.project_context``,
    ``CONTEXT_ROWS`` positions at a time): a chunk's hidden rows (the features' projection and its norm, in the
    dtype, the norm's float32 copy) and every layer's keys and values, and a draft held in blocks (``@q8_0``)
    the largest weight dequantized for a call unless ``in_place``; 0 for another drafter."""
    drafter = pair.drafter
    if not isinstance(drafter, DFlashDrafter):
        return 0
    c = drafter.draft.cfg
    rows = min(prompt_tokens, CONTEXT_ROWS)
    return rows * c.hidden_size * (2 * size + 4) + 2 * c.num_hidden_layers * rows * c.num_key_value_heads * \
        c.dim_per_head * size + (0 if in_place else _dequantized_bytes(drafter.draft, size))


def _planned_prefix_cache(target: nn.Module, positions: int, prompt_checkpoint: bool, feature_width: int,
                          dtype: torch.dtype, budget: int, generations: int = 1) -> int:
    """What a prefix cache of ``budget`` bytes keeps (``PrefixCache.commit``), at most the budget:
    ``positions`` committed positions (of one generation: the prompt's and every new token's but the
    last, whose K/V the next request computes) at the target's K/V of its attention layers per
    position, plus the draft's features (``feature_width``: 0 unless speculative); on a hybrid target
    also the recurrent and conv state at two checkpoints per generation, the prompt's last token but
    one (``prompt_checkpoint``: a prompt of two tokens or more) and the answer's end."""
    if budget <= 0:
        return 0
    one = _meta_cache(target, 1, 0, dtype)  # one position's K/V; a hybrid's state (its size is per sequence)
    size = torch.empty((), dtype=dtype, device="meta").element_size()
    total = positions * (_bytes([one.k, one.v]) + feature_width * size)
    if isinstance(one, HybridCache):
        total += generations * (1 + prompt_checkpoint) * _bytes([one.rec, one.conv])
    return min(total, budget)


def _loop(pair, config: EngineConfig, device: torch.device, constrained: bool) -> str:
    """The loop ``config`` runs on ``pair`` were it on ``device`` (``runtime.loop_for``'s rule; a
    config the runtime refuses is planned on the generic loop, as ``auto`` would run it; ``auto`` off CUDA
    runs the generic loop too)."""
    if config.draft_path == "generic" or runtime.refusal(pair, config, constrained) is not None:
        return "generic"
    cuda = torch.device(device).type == "cuda"
    if config.draft_path == "auto" and not cuda:
        return "generic"
    return "graphs" if cuda else "runtime"


def _layer_width(layer: nn.Module) -> int:
    """Values per row a layer holds at once beyond the residual stream, at most: its mixer's input
    projections' outputs three times over (the outputs, their normed / rotated or float32 forms, the
    mixer's output), or its MLP's gate and up outputs and their product."""
    mixer = mlp = 0
    for name, m in layer.named_modules():
        width = getattr(m, "out_features", None)
        if width is None and hasattr(m, "sizes"):  # a fused group: its parts stacked
            width = sum(m.sizes)
        if width is None or name.rpartition(".")[2] in _OUTPUT_PROJECTIONS:
            continue
        if name.startswith("mlp."):
            mlp += width
        else:
            mixer += width
    return max(3 * mixer, 3 * mlp // 2)


def _forward_bytes(model: nn.Module, rows: int, keys: int, size: int, logits_rows: int, feature_width: int,
                   prefill: bool, cuda: bool = True, in_place: bool = False) -> int:
    """Transient bytes of a forward of ``rows`` tokens over ``keys`` keys through ``model``'s layers
    (an estimate): the residual stream and the widest layer's temporaries, the target features
    gathered, the logits rows; a prefill's mask and the attention's masked product over every key
    pair (SDPA, whose math path holds every head's float32 scores: off CUDA, and on CUDA past
    ``SMALL_QUERIES`` rows, ``_sdpa_math_bytes``), a decode step's
    split-attention partials (float32, per span of ``step_split`` keys); and a quantized weight
    dequantized for a call (float32, then the dtype), unless ``in_place`` (the few-row kernel reads the
    blocks in registers). The features are one buffer from the first layer on, each feature layer's
    slice written by the next layer's add (``common._stack``): beside the widest layer, their rows once."""
    cfg = model.cfg
    heads, head_dim = cfg.num_attention_heads, getattr(cfg, "dim_per_head", None) or cfg.head_dim
    if prefill:  # the [rows, keys] bool mask (made, then joined) and SDPA's bias in the dtype; K/V per query head
        attend = rows * keys * (2 + size + (0 if cuda else 4 * heads)) + 2 * keys * heads * head_dim * size
        if cuda and rows > SMALL_QUERIES:  # SDPA's math path (``attention_torch``: an unbatched, 3-D call)
            attend += _sdpa_math_bytes(rows, keys, heads, head_dim)
    else:
        attend = math.ceil(keys / step_split(head_dim, size == 4)) * rows * heads * (head_dim + 2) * 4
    features = rows * feature_width * size
    layer = rows * size * max(_layer_width(layer) for layer in model.layers) + attend
    total = 3 * rows * cfg.hidden_size * size + layer + features
    total += logits_rows * getattr(cfg, "vocab_size", 0) * (size + 4)
    return total + (0 if in_place else _dequantized_bytes(model, size))


def _sdpa_math_bytes(rows: int, keys: int, heads: int, head_dim: int) -> int:
    """SDPA's math path on CUDA, which an unbatched (3-D) call takes (its fused kernels want 4-D inputs), for a
    half-precision forward of ``rows`` queries over ``keys`` keys: PyTorch upcasts the inputs to float32 (unless
    ``allow_fp16_bf16_reduction_math_sdp``) and holds the scores and their softmax [heads, rows, keys] in float32
    beside the mask as a float32 bias, then the output in float32; its safe softmax also holds a bool of the
    masked scores and a float32 result at once (13 bytes a score in all: an H100 measured SmolLM2's AR at 384
    tokens 6.9 MiB over 8 bytes a score, 2026-12-07; this adds 6.3)."""
    return 13 * heads * rows * keys + 4 * (rows * keys + (2 * rows + 2 * keys) * heads * head_dim)


def _prefill_sdpa_rows(prompt_tokens: int, cuda: bool, chunked: bool) -> int:
    """The rows of the widest whole-prompt forward (``loop.prefill``: up to ``PREFILL_CHUNK`` tokens, no prefix
    cache) that attends through SDPA on CUDA (past ``SMALL_QUERIES`` rows: ``attention.attention``); 0 if none."""
    rows = min(prompt_tokens, prefix_cache_mod.PREFILL_CHUNK)
    return rows if cuda and not chunked and rows > SMALL_QUERIES else 0


def _dequantized_bytes(model: nn.Module, size: int) -> int:
    """The largest of ``model``'s weights in blocks dequantized for a call: its float32 values, the dtype's
    copy, and a held weight's file-layout copy (``quant.unhold``); 0 without blocks."""
    return max((m.out_features * m.in_features * (4 + size) + (m.nbytes if m.fmt.planes else 0)
                for m in model.modules() if isinstance(m, QuantLinear)), default=0)


def _prefill_bytes(model: nn.Module, prompt_tokens: int, size: int, feature_width: int, cuda: bool,
                   chunked: bool, in_place: bool = False) -> int:
    """The prefill transient of a prompt of at most ``prompt_tokens`` (``loop.prefill``): one masked
    forward of the whole prompt, up to ``PREFILL_CHUNK`` tokens; past that or through a prefix cache
    (``chunked``), ``prefill_rows`` at a time in the decode steps' form, priced at the widest chunk
    any such prompt forwards (``widest_chunks``: a shorter prompt can take twice the rows), on CUDA the
    step kernel's float32 partials, elsewhere the PyTorch form's masked SDPA."""
    chunk = prefix_cache_mod.PREFILL_CHUNK
    whole = _forward_bytes(model, min(prompt_tokens, chunk), min(prompt_tokens, chunk), size, 1, feature_width,
                           True, cuda, in_place)
    if prompt_tokens <= chunk and not chunked:
        return whole
    steps = max(_forward_bytes(model, rows, keys, size, 1, feature_width, not cuda, cuda, in_place)
                for rows, keys in prefix_cache_mod.widest_chunks(model, prompt_tokens, chunk, size == 4))
    return steps if chunked else max(whole, steps)


def _step_bytes(pair, config: EngineConfig, context: int, length: int, n_verify: int, size: int,
                feature_width: int, speculative: bool, in_place: bool = False) -> int:
    """A decode step's transient at the longest key span (the runtime's bucket, within the workspace's
    ``length``): the verify of ``n_verify`` rows (AR: one), and with a draft its proposal (the block's
    rows and as many context rows, its logits and their top-k in float32)."""
    keys = runtime.bucket_for(context + n_verify, length)
    sampled = 16 if config.temperature > 0 else 0  # float64 logits and their noise, per row
    verify = _forward_bytes(pair.target, n_verify, keys, size, n_verify, feature_width, False, in_place=in_place)
    verify += n_verify * pair.target.cfg.vocab_size * sampled
    if not speculative or not isinstance(pair.drafter, DFlashDrafter):
        return verify
    block = verify_shape(pair, config)[0]
    draft = _forward_bytes(pair.drafter.draft, 2 * block, keys, size, 0, feature_width, False, in_place=in_place)
    return verify + draft + (block - 1) * pair.target.cfg.vocab_size * (size + 8)
