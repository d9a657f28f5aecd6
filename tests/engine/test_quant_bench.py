"""benchmarks/quant_bench.py on the CPU: its weights cover every projection launch of the 27B Q4_K_M
shape's AR step, so ``kernel_bench.py quant``'s 1-row times add up to the step's projections."""

from __future__ import annotations

from bench_modules import load_benchmark


def test_the_timed_weights_cover_every_launch_of_the_27b_q4_k_m_step():
    """The preset's step (built on the meta device) launches 273 projections in blocks, Q4_K and Q6_K
    (the head, 32 down and 8 v projections in Q6_K; a mixed q/k/v group as its three parts), every
    one a (format, N, K) that QUANT_SHAPES times; the sum weighs each shape's time by its launches."""
    qb = load_benchmark("quant_bench")
    launches = qb.step_launches()
    assert sum(launches.values()) == 273
    assert launches[("Q6_K", 248320, 5120)] == 1 and launches[("Q6_K", 5120, 17408)] == 32
    assert launches[("Q6_K", 1024, 5120)] == launches[("Q4_K", 12288, 5120)] == 8
    timed = {(f, n, k) for _, n, k, formats in qb.QUANT_SHAPES for f in formats}
    assert set(launches) <= timed
    rows = [{"format": f, "n": n, "k": k, "kernel": {1: 2.0 if f == "Q6_K" else 1.0}} for f, n, k in timed]
    six = sum(c for (f, _, _), c in launches.items() if f == "Q6_K")
    assert f"summed: {(273 + six) / 1000:.2f} ms over 273 of 273 launches" in qb.step_sum(rows)
    partial = qb.step_sum([r for r in rows if r["n"] != 248320])
    assert "over 272 of 273 launches (not timed: Q6_K 248320x5120 x1)" in partial


def test_the_native_plan_search_tries_each_k_partition_once_with_step_and_verify_launches():
    """``native_candidates``: per tile, splits that cut K into the same parts are tried once; every partition a
    verify launch is tried on has step launches too (a plan's two launches share one), and row counts of one kind
    give launches of that kind only."""
    from engine.models import linear as lin

    qb = load_benchmark("quant_bench")
    for _, n, k, _ in [*qb.NATIVE_SHAPES, ("a Q8_0 head", 49152, 576, "Q8_0")]:  # (wide tiles from 16,384 rows)
        both = list(qb.native_candidates(n, k, [1, 49]))
        steps = [c for kind, c in both if kind == "step"]
        assert len({(c.block_n, c.block_k, c.num_warps, lin.k_parts(k, c)) for c in steps}) == len(steps)
        partitions = {(c.split, c.block_k) for c in steps}
        assert {(c.split, c.block_k) for kind, c in both if kind == "verify"} <= partitions
        assert all(k // c.split >= c.block_k or c.split == 1 for c in steps)
        assert [c for kind, c in qb.native_candidates(n, k, [1]) if kind == "step"] == steps
        assert {kind for kind, _ in qb.native_candidates(n, k, [33])} == {"verify"}
    # SmolLM2's 576-wide K at 64-value blocks: 9, 5, 3 and 2 blocks a part (splits 1, 2, 3 and 6; 4 and 8 cut
    # it as 3 and 6 do)
    qkv = [c for kind, c in qb.native_candidates(960, 576, [1]) if c.block_k == 64 and c.block_n == 16]
    assert [c.split for c in qkv] == [1, 2, 3, 6]


def test_the_plans_the_native_search_writes_load_as_the_formats_own(tmp_path, monkeypatch):
    """``kernel_bench.py quant-plans --out``'s rows (format, n, k, step and verify as the config's fields, with
    the timings beside) are a plans file: ``ENGINE_LINEAR_PLANS`` gives the format's weights of that shape
    those launches, and a dense weight of the shape keeps its own."""
    import json

    import torch

    from engine.models import linear as lin

    step = lin.LinearConfig(16, 64, 3, 4, 3)
    verify = lin.LinearConfig(32, 64, 3, 4, 3, 16)
    row = {"shape": "SmolLM2 qkv (960 x 576)", "n": 960, "k": 576, "format": "Q4_1", "now": {"1": 5.5},
           "us": {"1": 3.1, "49": 4.0}, "step": step.__dict__, "verify": verify.__dict__, "tried": []}
    path = tmp_path / "native.json"
    path.write_text(json.dumps([row]))
    monkeypatch.setenv(lin.PLANS_ENV, str(path))
    cpu = torch.device("cpu")
    assert lin.plan_for_shape(960, 576, cpu, "Q4_1") == lin.LinearPlan(step, verify)
    assert lin.plan_for_shape(960, 576, cpu) == lin.default_plan(960, 576)


def test_the_searches_compile_each_variant_once_ahead(monkeypatch):
    """``linear_bench.compile_ahead`` (``plans`` and ``quant-plans``): one launch a compiled variant, each at its
    kind's row counts, handed to ``kernel_timing.precompile`` with the worker given. The split is a runtime argument
    of the few-row kernels, but one part passes its bf16 output where several pass float32 sums: splits collapse
    to 1 and 2."""
    from engine.models import linear as lin

    qb = load_benchmark("quant_bench")
    lb = load_benchmark("linear_bench")
    seen = []
    monkeypatch.setattr(lb, "precompile", lambda launch, launches, workers=0: seen.append((launch, launches)) or 0.0)
    candidates = list(qb.native_candidates(960, 576, [1, 49]))
    lb.compile_ahead("qkv", 576, candidates, [1, 49], "worker")
    (launch, launches), = seen
    assert launch == "worker" and len(launches) == len(set(launches))
    variants = {(c.block_n, c.block_k, min(lin.k_parts(576, c)[1], 2), c.num_warps, c.num_stages, c.row_block,
                 1 if kind == "step" else 49) for kind, c in candidates}
    assert {(*cfg, m) for cfg, m in launches} == variants
    assert {cfg[2] for cfg, _ in launches} == {1, 2} and len(launches) < len(candidates)
    assert {m for cfg, m in launches if cfg[5] == lin.ROW_BLOCK and cfg[0] == 16} == {1}  # 16-wide: steps only


def _dies(arg) -> None:
    """A launch whose worker process dies (a CUDA fault ends a process so)."""
    import os

    os._exit(3)


def test_compiling_ahead_survives_a_lost_worker(capsys):
    """``kernel_timing.precompile``: a worker lost mid-way is said and left to the timing loop (which compiles what
    is left as it times it), not raised; the call still returns the seconds it took."""
    load_benchmark("kernel_timing")  # (benchmarks/ on the path)
    import kernel_timing  # as the benchmarks import it: the module its workers unpickle

    seconds = kernel_timing.precompile(_dies, [1, 2], workers=2)
    assert seconds >= 0 and "precompile: BrokenProcessPool" in capsys.readouterr().out
