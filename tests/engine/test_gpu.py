"""GPU checks (skipped without CUDA): float32 stays exact on the device; bf16 runs every path."""

import itertools

import pytest
import torch

import engine
from engine import EngineConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PATHS = list(itertools.product(["chain", "ddtree"], ["replay", "fast"], ["generic", "runtime"]))


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_float32_on_cuda_equals_ar_on_every_path(target):
    pair = engine.load(target, "oracle:0.3", device="cuda", dtype="float32")
    ids = pair.encode("Hello there, how are you today?")
    ar = engine.generate(pair, ids, EngineConfig(verify="ar"), 48, ignore_eos=True).tokens
    for verify, rollback, path in PATHS:
        cfg = EngineConfig(verify=verify, rollback=rollback, draft_path=path, budget=16, top_k=4, block_size=8)
        gen = engine.generate(pair, ids, cfg, 48, ignore_eos=True)
        assert gen.tokens == ar, (verify, rollback, path)
        assert gen.stats.acceptance_length > 1.0


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_bfloat16_runs_every_path_and_reports_divergence(target):
    pair = engine.load(target, "random", device="cuda", dtype="bfloat16")
    prompts = [pair.encode("Hello there"), pair.encode("def f(x):")]
    ref = engine.bench(pair, EngineConfig(verify="ar"), prompts, 32, ignore_eos=True)
    for verify, rollback, path in PATHS:
        res = engine.bench(pair, EngineConfig(verify=verify, rollback=rollback, draft_path=path), prompts, 32,
                           reference=ref.outputs, ignore_eos=True)
        assert res.exact_match is not None and res.new_tokens == 64
        for p in res.prompts:
            assert p.exact == (p.first_divergence is None)
