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
