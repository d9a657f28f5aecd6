"""The device memory planner (``engine.memory``) on the CPU: each planned part against the tensors a
pair really allocates once it decoded (the workspace reserved at the planned length never grows), a
27B shape planned on the meta device (nothing allocated), another dtype priced, the largest budget
and longest context that fit a limit, and a native GGUF target's blocks."""

from __future__ import annotations

import math

import pytest
import torch

import engine
from engine import EngineConfig, EngineInputError
from engine.api import Pair
from engine.decoding.decode import workspace_length
from engine.decoding.drafters import DFlashDrafter
from engine.memory import blas_workspace_bytes, held_memory, plan_memory, release_memory, reserve_memory
from engine.models.common import fuse_projections_
from engine.models.draft import DFlashConfig, DFlashDraft, default_target_layer_ids
from engine.models.hybrid import HybridModel
from engine.models.hybrid_config import HybridConfig
from engine.models.quant import QuantLinear
from tests.engine.engine_pairs import pair_for

STATIC = ("target_weights", "draft_weights", "kv_cache", "recurrent_state", "tree_state", "features", "draft_context")
CONFIGS = {
    "ar": EngineConfig(verify="ar"),
    "chain-generic": EngineConfig(verify="chain", draft_path="generic", block_size=6),
    "ddtree-runtime": EngineConfig(verify="ddtree", draft_path="runtime", budget=9, top_k=3),
    "ddtree-grammar": EngineConfig(verify="ddtree", draft_path="runtime", budget=5, top_k=2, grammar="commit"),
}


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(n)
    return [torch.randint(3, 260, (k,), generator=gen).tolist() for k in (n // 2, n, 3)]


def _weight_bytes(module: torch.nn.Module) -> int:
    """Every parameter and buffer once (tied weights once), as ``numel * element_size``."""
    unique = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in unique.values())


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
@pytest.mark.parametrize("name", CONFIGS)
def test_plan_equals_what_the_pair_allocates(target, name):
    pair = pair_for(target, "random")
    cfg, new = CONFIGS[name], 10
    if cfg.rollback == "fast" and target == "tiny-hybrid" and name == "chain-generic":
        cfg = cfg.replace(rollback="replay")  # the generic loop's other rollback, on the hybrid
    prompts = _prompts(24)
    longest = max(map(len, prompts))
    plan = plan_memory(pair, cfg, longest, new)  # (no prompt has tools: no grammar)
    reserve_memory(pair, cfg, longest, new)
    for prompt in prompts:  # shorter prompts after the longest: nothing grows
        engine.generate(pair, prompt, cfg, new, ignore_eos=True)
    held = held_memory(pair)
    assert {k: held[k] for k in STATIC} == {k: plan.parts[k] for k in STATIC}
    if cfg.grammar != "off":  # prompts with tools: a hybrid keeps the state a grammar's cut restores
        kept = plan_memory(pair, cfg, longest, new, constrained=True).parts["recurrent_state"]
        recurrent = pair._workspace.cache.rec.numel() * 4 if target == "tiny-hybrid" else 0
        assert kept - plan.parts["recurrent_state"] == recurrent
        reserve_memory(pair, cfg, longest, new, constrained=True)  # made up front, not inside a captured step
        assert held_memory(pair)["recurrent_state"] == kept
    assert pair._workspace.max_len == workspace_length(pair, cfg, longest, new)
    # the parts, by other arithmetic: every parameter once; K/V [layers, slots, kv_heads, head_dim] twice
    assert plan.parts["target_weights"] == _weight_bytes(pair.target)
    assert plan.parts["draft_weights"] == _weight_bytes(pair.drafter.draft)
    c = pair.target.cfg
    layers = c.layer_types.count("full_attention") if target == "tiny-hybrid" else c.num_hidden_layers
    assert plan.parts["kv_cache"] == 2 * layers * pair._workspace.max_len * c.num_key_value_heads * 16 * 4
    speculative = cfg.verify != "ar"
    assert (plan.parts["features"] > 0) == (plan.parts["draft_context"] > 0) == speculative
    assert (plan.parts["tree_state"] > 0) == (speculative and target == "tiny-hybrid")
    assert plan.parts["activations"] > 0 and plan.parts["graph_pools"] == 0  # no graphs off CUDA
    assert plan.kind == "planned" and plan.total == sum(plan.parts.values())
    assert plan.loop == ("runtime" if cfg.draft_path == "runtime" else "generic")  # (auto off CUDA: generic)


def test_release_drops_every_buffer_and_the_plan_grows_with_the_tree_and_the_context():
    pair = pair_for("tiny-dense", "random")
    cfg = EngineConfig(verify="ddtree", draft_path="runtime", budget=4, top_k=3)
    engine.generate(pair, _prompts(12)[1], cfg, 6, ignore_eos=True)
    assert held_memory(pair)["kv_cache"] > 0
    models = [pair.target, pair.drafter.draft]
    assert all(m._rope_tables for m in models) and pair.drafter._constants  # made for this workspace's length
    release_memory(pair)
    held = held_memory(pair)
    assert held["kv_cache"] == held["features"] == held["draft_context"] == 0
    # the length's rotary tables and step constants too: another config's length would make its own beside them
    assert not any(m._rope_tables for m in models) and not pair.drafter._constants
    assert held["target_weights"] == _weight_bytes(pair.target)
    totals = [plan_memory(pair, cfg.replace(budget=b), 50, 10).total for b in (2, 4, 8, 16)]
    assert totals == sorted(set(totals))  # strictly more with every budget
    lengths = [plan_memory(pair, cfg, p, 10).total for p in (10, 20, 40)]
    assert lengths == sorted(set(lengths))


def test_largest_budget_and_longest_context_fit_the_limit_exactly():
    pair = pair_for("tiny-dense", "random")
    cfg = EngineConfig(verify="ddtree", budget=22, top_k=3)
    limit = plan_memory(pair, cfg.replace(budget=12), 40, 8).total
    assert engine.largest_budget(pair, cfg, 40, 8, limit) == 12
    assert engine.largest_budget(pair, cfg, 40, 8, limit - 1) == 11
    assert engine.largest_budget(pair, cfg, 40, 8, 1000) is None  # not even one node fits 1000 bytes
    limit = plan_memory(pair, cfg, 100, 8).total
    assert engine.longest_context(pair, cfg, 8, limit, most=4096) == 108
    assert engine.longest_context(pair, cfg, 8, 10**12, most=4096) == 4096  # the target's context bounds it
    with pytest.raises(EngineInputError, match="verify='ddtree'"):
        engine.largest_budget(pair, cfg.replace(verify="chain"), 40, 8, limit)


def test_another_dtype_and_device_are_priced_not_loaded():
    pair = pair_for("tiny-hybrid", "random")
    cfg = EngineConfig(budget=6, top_k=2)
    f32 = plan_memory(pair, cfg, 30, 8)
    bf16 = plan_memory(pair, cfg, 30, 8, device="cuda", dtype=torch.bfloat16)
    freqs = pair.target.inv_freq.numel() * 4  # the RoPE frequencies stay float32
    assert bf16.parts["target_weights"] - freqs == (f32.parts["target_weights"] - freqs) // 2
    assert bf16.parts["kv_cache"] == f32.parts["kv_cache"] // 2
    assert bf16.parts["recurrent_state"] < f32.parts["recurrent_state"]  # conv halves; the recurrence stays float32
    assert bf16.loop == "graphs" and bf16.parts["graph_pools"] > 0  # on CUDA the steps are captured


def test_a_cuda_plan_counts_the_cublas_workspace_of_a_drafts_free_row_products(monkeypatch):
    """On CUDA a DFlash draft's products run through cuBLAS (``free_rows_``), whose workspace PyTorch keeps per
    stream: the eager one's from the context fill inside the prefill on, and a captured step's in its graph pool.
    AR runs no draft, and a draft in blocks takes the few-row kernel: none; with the kernels off every product
    is cuBLAS's, AR's too."""
    floats = pair_for("tiny-dense", "random")
    blocks = engine.load("tiny-dense", "random@q8_0", device="cpu", dtype="float32")
    configs = {"ar": EngineConfig(verify="ar"), "ddtree": EngineConfig(budget=6, top_k=2),
               "ar-eager": EngineConfig(verify="ar", kernels="eager")}
    plans = {}
    for setting in (":4096:8", ":0:0"):  # PyTorch's Hopper default, and no workspace
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", setting)
        plans[setting] = {(n, p): plan_memory(pair, c, 30, 8, device="cuda", dtype=torch.bfloat16)
                          for n, c in configs.items() for p, pair in (("floats", floats), ("blocks", blocks))}
    ws, none = plans[":4096:8"], plans[":0:0"]

    def grew(key: tuple[str, str]) -> tuple[int, int]:
        return tuple(ws[key].parts[k] - none[key].parts[k] for k in ("activations", "graph_pools"))

    assert ws["ddtree", "floats"].loop == ws["ar-eager", "floats"].loop == "graphs"
    assert grew(("ddtree", "floats")) == (32 * 2**20, 32 * 2**20)
    assert grew(("ar-eager", "floats")) == grew(("ar-eager", "blocks")) == (32 * 2**20, 32 * 2**20)
    assert grew(("ar", "floats")) == grew(("ar", "blocks")) == grew(("ddtree", "blocks")) == (0, 0)
    assert plan_memory(floats, configs["ddtree"], 30, 8).to_dict() == \
        plan_memory(floats, configs["ddtree"], 30, 8, device="cpu").to_dict()  # (none off CUDA)
    assert blas_workspace_bytes("cpu") == 0


def test_the_cublas_workspace_is_pytorchs_setting_or_its_default(monkeypatch):
    """PyTorch's reading of ``CUBLAS_WORKSPACE_CONFIG``: every ``:SIZE_KIB:COUNT`` found, summed; none found, its
    default by the GPU's compute capability (32 MiB on 9.x/10.x; without a GPU the plan assumes that)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")  # PyTorch's default before Hopper
    assert blas_workspace_bytes("cuda") == (4096 * 2 + 16 * 8) * 1024
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8,junk:16:8")  # what matches counts, as PyTorch reads it
    assert blas_workspace_bytes("cuda") == (4096 * 8 + 16 * 8) * 1024
    if torch.cuda.is_available():
        major = torch.cuda.get_device_capability()[0]
        default = 32 * 2**20 if major in (9, 10) else 8 * 2**20 + 128 * 2**10
    else:
        default = 32 * 2**20
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "4096:8")  # nothing matches (no leading colon): the default
    assert blas_workspace_bytes("cuda") == default
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    assert blas_workspace_bytes("cuda") == default


def test_a_pair_without_a_draft_plans_ar_and_refuses_speculation():
    pair = pair_for("tiny-dense", "none")
    assert plan_memory(pair, EngineConfig(verify="ar"), 20, 5).parts["draft_weights"] == 0
    with pytest.raises(EngineInputError, match="needs a draft"):
        plan_memory(pair, EngineConfig(), 20, 5)
    with pytest.raises(EngineInputError, match="prompt_tokens=0"):
        plan_memory(pair, EngineConfig(verify="ar"), 0, 5)


def _meta_pair_27b() -> Pair:
    """Qwen3.5-27B's shapes (the registry's qwen35-27b-shape) and a 5-layer draft, on the meta device."""
    cfg = HybridConfig(vocab_size=248320, hidden_size=5120, num_hidden_layers=64, num_attention_heads=24,
                       num_key_value_heads=4, head_dim=256, intermediate_size=17408, linear_num_key_heads=16,
                       linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                       full_attention_interval=4)
    draft_cfg = DFlashConfig(hidden_size=5120, num_hidden_layers=5, num_attention_heads=24, num_key_value_heads=4,
                             intermediate_size=17408, vocab_size=248320, target_layer_ids=default_target_layer_ids(64),
                             num_target_layers=64, head_dim=256)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            target = fuse_projections_(HybridModel(cfg))
            draft = DFlashDraft(draft_cfg)
    finally:
        torch.set_default_dtype(before)
    return Pair(target, DFlashDrafter(draft, target), None, "qwen35-27b-shape", "draft", "meta", "bfloat16")


def test_a_27b_shape_plan_costs_nothing():
    pair = _meta_pair_27b()
    cfg = EngineConfig(budget=22)
    plan = plan_memory(pair, cfg, 32768 - 256, 256, device="cuda")
    assert all(p.is_meta for p in pair.target.parameters())
    params = sum(p.numel() for p in pair.target.parameters())
    assert plan.parts["target_weights"] == 2 * params + pair.target.inv_freq.numel() * 4
    assert 26e9 < params < 28e9
    slots = workspace_length(pair, cfg, 32768 - 256, 256)
    assert plan.parts["kv_cache"] == 2 * 16 * slots * 4 * 256 * 2  # 16 attention layers of 64, bf16
    # five target layers feed the draft: on the graphs without a prefix cache a ring of FEATURE_RING_ROWS
    assert plan.parts["features"] == 1024 * 5 * 5120 * 2
    assert plan_memory(pair, cfg, 32768 - 256, 256, device="cuda", prefix_cache_bytes=1 << 30
                       ).parts["features"] == slots * 5 * 5120 * 2  # (a row a position: 1.57 GiB)
    assert plan.dominant == "target_weights" and plan.loop == "graphs"
    assert plan.parts["activations"] < 2**30  # the prompt prefilled a chunk at a time (loop.prefill)
    assert 55 * 2**30 < plan.total < 65 * 2**30
    assert engine.longest_context(pair, cfg, 256, plan.total, most=262144, device="cuda") == 32768


def test_the_drafts_context_fill_is_planned_a_chunk_at_a_time(monkeypatch):
    """After a speculative config's prefill the draft's context K/V of the prompt are projected
    ``CONTEXT_ROWS`` positions at a time (``DFlashDrafter.project_context``): the plan's transient is the
    larger of the prefill's and one chunk's (its hidden rows in bf16 twice and in float32, every layer's
    K/V), not the prompt's (on the 27B shape's draft at 32k positions ~2 GiB); AR projects none."""
    from engine import memory

    pair = _meta_pair_27b()
    chunk = 1024 * 5120 * (2 * 2 + 4) + 2 * 5 * 1024 * 4 * 256 * 2  # CONTEXT_ROWS rows of the 5-layer draft
    assert memory._context_fill_bytes(pair, 32768 - 256, 2) == chunk
    assert memory._context_fill_bytes(pair, 1000, 2) == chunk * 1000 // 1024
    monkeypatch.setattr(memory, "_prefill_bytes", lambda *a, **k: 0)  # the fill alone
    on_gpu = {"device": "cuda"}
    # (with the cuBLAS workspace the draft's products keep for the fill's stream)
    assert plan_memory(pair, EngineConfig(budget=22), 32768 - 256, 256, **on_gpu).parts["activations"] == \
        chunk + memory.blas_workspace_bytes("cuda")
    # AR fills none; a prompt of at most 32k tokens may be one of 257-512, forwarded whole through SDPA (below)
    assert plan_memory(pair, EngineConfig(verify="ar"), 32768 - 256, 256, **on_gpu).parts["activations"] == \
        memory.blas_workspace_bytes("cuda")


def test_a_whole_prompts_forward_through_sdpa_is_planned_with_its_math_path_and_workspace(monkeypatch):
    """A prompt of SMALL_QUERIES + 1 to PREFILL_CHUNK tokens is forwarded whole (``loop.prefill``) and its
    attention takes SDPA (``attention.attention``), on CUDA by its math path (an unbatched 3-D call): float32
    scores and weights per head and a cuBLAS workspace on the prefill's stream, AR's too. A shorter prompt takes
    the mask kernel, a prefix cache forwards in chunks, the CPU keeps no workspace: none of it there (2026-12-07:
    SmolLM2's sweep measured its AR 10% over its plan, 78 MiB of activations against 39)."""
    from engine import memory
    from engine.models.attention import SMALL_QUERIES

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    pair = pair_for("tiny-dense", "random")
    ar = EngineConfig(verify="ar")
    cfg = pair.target.cfg
    heads, head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or head_dim

    def acts(prompt: int, **kw) -> int:
        return plan_memory(pair, ar, prompt, 8, dtype=torch.bfloat16, **kw).parts["activations"]

    short, whole = SMALL_QUERIES, SMALL_QUERIES + 64
    assert acts(short, device="cuda") < 2**20  # the mask kernel: no SDPA, no workspace (a tiny model's rows)
    math = memory._sdpa_math_bytes(whole, whole, heads, head_dim)
    assert math >= 2 * 4 * heads * whole * whole  # float32 scores and weights
    assert acts(whole, device="cuda") >= acts(short, device="cuda") + 32 * 2**20 + math
    # a prefix cache forwards every prompt in chunks: no SDPA, no workspace for AR
    assert acts(whole, device="cuda", prefix_cache_bytes=2**30) < acts(whole, device="cuda") - 32 * 2**20
    # the eager loop (the generic path) holds the same workspace on its one stream
    generic = plan_memory(pair, EngineConfig(verify="chain", draft_path="generic"), whole, 8, device="cuda",
                          dtype=torch.bfloat16)
    assert generic.loop == "generic" and generic.parts["activations"] >= 32 * 2**20 + math
    assert memory._prefill_sdpa_rows(whole, True, False) == whole
    assert memory._prefill_sdpa_rows(5000, True, False) == memory.prefix_cache_mod.PREFILL_CHUNK
    assert memory._prefill_sdpa_rows(whole, False, False) == memory._prefill_sdpa_rows(whole, True, True) == 0


def test_native_blocks_are_planned_at_their_bytes(tmp_path):
    pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")
    from tests.engine.gguf_files import bpe_tokenizer, tiny_hf, write_gguf

    path = tmp_path / "q8.gguf"
    write_gguf(path, tiny_hf("qwen3"), "qwen3", gguf.GGMLQuantizationType.Q8_0, tokenizer=bpe_tokenizer())
    native, twin = (engine.load(str(path), "random", device="cpu", dtype="float32", weights=w)
                    for w in ("native", "dequantized"))
    cfg = EngineConfig(verify="ar")
    plan, twin_plan = plan_memory(native, cfg, 20, 8), plan_memory(twin, cfg, 20, 8)
    summary = native.weight_summary()
    freqs = native.target.inv_freq.numel() * 4  # not a stored weight
    assert plan.parts["target_weights"] == summary["weight_bytes"] + freqs < twin_plan.parts["target_weights"]
    held = [m for m in native.target.modules() if isinstance(m, QuantLinear)]  # (the embedding: its rows only)
    widest = max(held, key=lambda m: m.out_features * m.in_features)
    blocks = widest.out_features * widest.in_features
    # dequantized per call: float32 values, the dtype's copy, and Q8_0's held rows back in the file's layout
    assert widest.fmt.planes
    assert plan.parts["activations"] - twin_plan.parts["activations"] == blocks * (4 + 4) + widest.nbytes
    # planned for CUDA in bf16 the few-row kernel reads the blocks in place: no weight dequantized whole;
    # with kernels: eager (PyTorch forms) it is, per call
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    on_gpu, twin_gpu = plan_memory(native, cfg, 20, 8, **bf16), plan_memory(twin, cfg, 20, 8, **bf16)
    assert on_gpu.parts["activations"] == twin_gpu.parts["activations"]
    assert on_gpu.parts["graph_pools"] == twin_gpu.parts["graph_pools"]
    eager = EngineConfig(verify="ar", kernels="eager")
    assert plan_memory(native, eager, 20, 8, **bf16).parts["activations"] - \
        plan_memory(twin, eager, 20, 8, **bf16).parts["activations"] >= blocks * (4 + 2)
    reserve_memory(native, cfg, 20, 8)
    engine.generate(native, list(range(5, 25)), cfg, 8, ignore_eos=True)
    assert held_memory(native)["target_weights"] == plan.parts["target_weights"]
    assert math.isclose(plan.total, sum(plan.parts.values()))


PREFIX_CONFIGS = {k: CONFIGS[k] for k in ("ar", "chain-generic", "ddtree-runtime")}


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
@pytest.mark.parametrize("name", PREFIX_CONFIGS)
def test_the_prefix_cache_part_is_what_the_cache_holds_after_a_generation(target, name):
    pair = pair_for(target, "random")
    cfg, new, prompt = PREFIX_CONFIGS[name], 10, _prompts(40)[1]
    if target == "tiny-hybrid" and name == "chain-generic":
        cfg = cfg.replace(rollback="replay")
    budget = 1 << 24
    cache = engine.PrefixCache(budget)
    engine.generate(pair, prompt, cfg, new, ignore_eos=True, prefix_cache=cache)
    plan = plan_memory(pair, cfg, len(prompt), new, prefix_cache_bytes=budget)
    assert plan.parts["prefix_cache"] == held_memory(pair, cache)["prefix_cache"] == cache.bytes > 0
    # by other arithmetic: every committed position (the last new token has no K/V yet) at K/V, plus the
    # draft's features where it drafted, plus a hybrid's recurrent and conv state at two checkpoints
    c, ws = pair.target.cfg, pair._workspace
    layers = c.layer_types.count("full_attention") if target == "tiny-hybrid" else c.num_hidden_layers
    per_position = 2 * layers * c.num_key_value_heads * 16 * 4 + (ws.features.shape[1] * 4 if cfg.verify != "ar" else 0)
    states = 2 * (ws.cache.rec.numel() * 4 + ws.cache.conv.numel() * 4) if target == "tiny-hybrid" else 0
    assert plan.parts["prefix_cache"] == (len(prompt) + new - 1) * per_position + states
    assert plan.total == plan_memory(pair, cfg, len(prompt), new).total + plan.parts["prefix_cache"]
    # a budget below that: the plan is the budget, and the cache keeps no more
    small = plan.parts["prefix_cache"] // 3
    cache = engine.PrefixCache(small)
    engine.generate(pair, prompt, cfg, new, ignore_eos=True, prefix_cache=cache)
    assert plan_memory(pair, cfg, len(prompt), new, prefix_cache_bytes=small).parts["prefix_cache"] == small
    assert held_memory(pair, cache)["prefix_cache"] == cache.bytes <= small
    # no cache: nothing planned or held
    assert plan_memory(pair, cfg, len(prompt), new).parts["prefix_cache"] == held_memory(pair)["prefix_cache"] == 0


def test_the_prefix_cache_s_bytes_leave_the_activations_residue_of_a_measured_peak():
    pair = pair_for("tiny-dense", "random")
    cfg = EngineConfig(verify="ar")
    cache = engine.PrefixCache(1 << 24)
    res = engine.bench(pair, cfg, _prompts(30), 6, ignore_eos=True, prefix_cache=cache)
    assert res.prefix_cache_bytes == cache.bytes > 0  # the most it held: it only grew in this pass
    assert engine.bench(pair, cfg, _prompts(30), 6, ignore_eos=True).prefix_cache_bytes == 0
    peak = sum(held_memory(pair).values()) + 10**6
    without = engine.measure_memory(pair, cfg, 30, 6, peak)
    got = engine.measure_memory(pair, cfg, 30, 6, peak, prefix_cache_held=res.prefix_cache_bytes)
    assert without.parts["prefix_cache"] == 0 and without.parts["activations"] == 10**6
    assert got.parts["prefix_cache"] == res.prefix_cache_bytes
    assert got.parts["activations"] == 10**6 - res.prefix_cache_bytes and got.total == without.total == peak


def test_largest_budget_and_longest_context_count_the_prefix_cache():
    pair = pair_for("tiny-dense", "random")
    cfg = EngineConfig(verify="ddtree", budget=22, top_k=3)
    limit = plan_memory(pair, cfg, 100, 8).total
    assert engine.longest_context(pair, cfg, 8, limit, most=4096, prefix_cache_bytes=1 << 24) < 108
    assert engine.longest_context(pair, cfg, 8, limit, most=4096, prefix_cache_bytes=0) == 108
    with pytest.raises(EngineInputError, match="prefix_cache_bytes must be a whole number of bytes >= 0"):
        plan_memory(pair, cfg, 100, 8, prefix_cache_bytes=-1)


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_the_prefix_cache_part_of_a_whole_workload(target):
    """``prefix_cache_tokens`` / ``prefix_cache_generations``: what one cache keeps over many generations (a
    session sweep's), at the same bytes a position and a hybrid's two checkpoints a generation as one
    generation's plan, within the budget; bad counts are refused by name."""
    pair = pair_for(target, "random")
    cfg, budget = EngineConfig(verify="ddtree", budget=8, top_k=2), 1 << 30
    one = plan_memory(pair, cfg, 30, 6, prefix_cache_bytes=budget).parts["prefix_cache"]
    same = plan_memory(pair, cfg, 30, 6, prefix_cache_bytes=budget, prefix_cache_tokens=35).parts["prefix_cache"]
    assert same == one > 0
    many = plan_memory(pair, cfg, 30, 6, prefix_cache_bytes=budget, prefix_cache_tokens=35 * 4,
                       prefix_cache_generations=4).parts["prefix_cache"]
    assert many == 4 * one
    capped = plan_memory(pair, cfg, 30, 6, prefix_cache_bytes=one, prefix_cache_tokens=35 * 4,
                         prefix_cache_generations=4).parts["prefix_cache"]
    assert capped == one
    for key, bad in (("prefix_cache_tokens", -1), ("prefix_cache_generations", 0), ("prefix_cache_tokens", 2.5),
                     ("prefix_cache_generations", None)):
        with pytest.raises(EngineInputError, match=f"{key} must be a whole number"):
            plan_memory(pair, cfg, 30, 6, prefix_cache_bytes=budget, **{key: bad})
