"""A DFlash draft held in GGUF blocks (``DRAFT@RECIPE``: ``engine.registry.draft_recipe``): its projections
quantized as it loads, its proposals near the float draft's, and every output still AR's (the target
verifies every token); the plan counts its blocks' bytes; bad specs are refused with the rule."""

from __future__ import annotations

import pytest
import torch

import engine
from engine import EngineConfig, EngineInputError
from engine.memory import blas_workspace_bytes, held_memory, plan_memory
from engine.models.common import FusedLinear, Linear
from engine.models.quant import QuantFusedLinear, QuantLinear
from engine.registry import check_draft_spec, draft_recipe

PROMPT = [5, 17, 42, 9, 33, 8, 21, 64, 3]
CONFIGS = [EngineConfig(verify="ar"), EngineConfig(budget=8, top_k=4), EngineConfig(verify="chain"),
           EngineConfig(verify="chain", draft_path="generic"), EngineConfig(budget=6, top_k=3, rollback="replay")]


def _formats(draft) -> set[str]:
    return {m.fmt.name for m in draft.modules() if isinstance(m, QuantLinear)}


@pytest.mark.parametrize("target,recipe,formats", [("tiny-dense", "q8_0", {"Q8_0"}),
                                                   ("tiny-hybrid", "q4_k_m", {"Q5_0", "Q8_0"})])
def test_a_quantized_draft_holds_blocks_and_every_output_stays_ars(target, recipe, formats):
    """``random@q8_0`` on the dense target: every projection Q8_0 (gate/up fused in blocks); on the
    hybrid, ``@q4_k_m``'s mix at widths that are not whole 256-value blocks (its fallbacks). No float
    projection is left; the draft holds fewer bytes; DDTree and chain on both paths equal AR, as the float
    draft's do; the proposals differ from the float draft's but stay near them."""
    quant = engine.load(target, f"random@{recipe}", device="cpu", dtype="float32")
    floats = engine.load(target, "random", device="cpu", dtype="float32")
    draft = quant.drafter.draft
    assert _formats(draft) == formats
    assert not any(type(m) in (torch.nn.Linear, Linear, FusedLinear) for m in draft.modules())
    assert isinstance(draft.layers[0].mlp.gate_up_proj, QuantFusedLinear)  # (a mixed q/k/v group stays as parts)
    assert held_memory(quant)["draft_weights"] < held_memory(floats)["draft_weights"] / 2
    assert held_memory(quant)["target_weights"] == held_memory(floats)["target_weights"]
    ar = engine.generate(floats, PROMPT, CONFIGS[0], 20, ignore_eos=True).tokens
    for cfg in CONFIGS:
        assert engine.generate(quant, PROMPT, cfg, 20, ignore_eos=True).tokens == ar, cfg
    features = torch.randn(len(PROMPT), draft.fc.in_features, generator=torch.Generator().manual_seed(0))
    seq = torch.tensor(PROMPT + [0] * 16)
    a, b = (p.drafter.propose(seq, len(PROMPT) - 1, 4, 0, features) for p in (quant, floats))
    assert not torch.equal(a, b)
    assert (a - b).norm() < 0.2 * b.norm()


def test_a_quantized_draft_is_planned_at_its_blocks_bytes():
    """On the meta device (``autotune plan``) the draft's blocks are empty but of a real load's bytes; off
    CUDA's in-place kernel, the context fill's transient adds the largest weight dequantized for a call."""
    from engine import memory

    real = engine.load("tiny-dense", "random@q8_0", device="cpu", dtype="float32")
    meta = engine.load("tiny-dense", "random@q8_0", device="meta", dtype="float32")
    cfg = EngineConfig(budget=8)
    assert plan_memory(meta, cfg, 100, 20).parts["draft_weights"] == held_memory(real)["draft_weights"]
    largest = max(m.out_features * m.in_features * (4 + 4) + m.nbytes  # float32 twice, Q8_0's file-layout copy
                  for m in real.drafter.draft.modules() if isinstance(m, QuantLinear))
    assert memory._context_fill_bytes(real, 100, 4) - memory._context_fill_bytes(real, 100, 4, True) == largest


def test_draft_specs_with_a_recipe():
    assert draft_recipe("smollm2-135m-dflash@q8_0") == ("smollm2-135m-dflash", "q8_0")
    assert draft_recipe("random") == ("random", None)
    check_draft_spec("random@q4_k_m")
    check_draft_spec("smollm2-135m-dflash@q8_0")
    with pytest.raises(EngineInputError, match=r"'q3' after '@' is no quantization recipe: expected one of "
                                               r"\['q4_k_m', 'q8_0'\]"):
        check_draft_spec("random@q3")
    for spec in ("none@q8_0", "oracle:0.5@q8_0"):
        with pytest.raises(EngineInputError, match="only a DFlash draft .* has weights to quantize"):
            check_draft_spec(spec)
    with pytest.raises(EngineInputError, match="is not a known preset"):
        check_draft_spec("no-such-draft@q8_0")


def test_a_folder_named_with_an_at_is_a_folder(tmp_path):
    folder = tmp_path / "draft@q8_0"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert draft_recipe(str(folder)) == (str(folder), None)
    check_draft_spec(str(folder))



def test_on_cuda_in_half_precision_a_draft_in_blocks_adds_no_transient(monkeypatch):
    """Planned for CUDA in bf16 (the few-row kernel reads the blocks in place: the draft's step, and its
    context fill of ``CONTEXT_ROWS`` rows) a quantized draft changes only ``draft_weights``, and runs no product
    through cuBLAS, so it needs none of the float draft's two cuBLAS workspaces; in float32 a step's draft
    forward dequantizes a weight whole."""
    cfg, at = EngineConfig(budget=8, top_k=4), (6, 64)  # (a short prompt: the fill's transient above the prefill's)
    floats = engine.load("tiny-dense", "random", device="cpu", dtype="float32")
    quant = engine.load("tiny-dense", "random@q8_0", device="cpu", dtype="float32")
    gpu = {"device": "cuda", "dtype": torch.bfloat16}
    a, b = plan_memory(floats, cfg, *at, **gpu), plan_memory(quant, cfg, *at, **gpu)
    workspace = blas_workspace_bytes("cuda")
    assert a.parts["activations"] - b.parts["activations"] == a.parts["graph_pools"] - b.parts["graph_pools"] \
        == workspace
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")  # no workspace: the rest the same
    a, b = plan_memory(floats, cfg, *at, **gpu), plan_memory(quant, cfg, *at, **gpu)
    assert {k: v for k, v in a.parts.items() if k != "draft_weights"} == \
        {k: v for k, v in b.parts.items() if k != "draft_weights"}
    assert b.parts["draft_weights"] < 0.6 * a.parts["draft_weights"]  # (34 bytes a 32 values against bf16)
    f32 = {"device": "cuda", "dtype": torch.float32}  # (the step's draft forward, in the graphs' pool)
    assert plan_memory(quant, cfg, *at, **f32).parts["graph_pools"] > plan_memory(floats, cfg, *at, **f32).parts[
        "graph_pools"]


def test_draft_in_blocks_loads_the_pairs_draft_again_in_blocks():
    """``engine.draft_in_blocks``: the same target, the draft in a recipe's blocks (what ``autotune plan``
    prints beside the reference); None for a pair with no DFlash draft or one in blocks already."""
    floats = engine.load("tiny-dense", "random", device="meta", dtype="bfloat16")
    held = engine.draft_in_blocks(floats, "q8_0")
    assert held.target is floats.target and held.draft_name == "random@q8_0"
    assert _formats(held.drafter.draft) == {"Q8_0"}
    assert engine.draft_in_blocks(held, "q4_k_m") is None
    assert engine.draft_in_blocks(engine.load("tiny-dense", "oracle:0.5", device="meta", dtype="bfloat16"),
                                  "q8_0") is None
