"""``quant_gluon.py --bench``: the prototype's launches beside the engine kernel's on the 27B's weights, on a GPU
(issue #28; ``benchmarks/device/quant.sh GLUON=1``). Timings of captured launches (``kernel_timing.time_us``),
weights cycled through 256 MB so each call reads from HBM; each decode's row invariance and error too."""

from __future__ import annotations

from math import nan

import torch

from engine.models import quant
from engine.models.quant_gluon import (
    Q4_1,
    Q4_K,
    linear,
    linear_q4_1,
    linear_q6_k,
    padded_cols,
    padded_rows,
    reference_q4_1,
    reference_q6_k,
    repack,
    repack_q4_1,
    repack_q6_k,
    split_for,
)

STAGES = (3, 4)  # the staged columns' stages (``quant_gluon.STAGES``: shared-memory tiles a program)
SHAPES = [("27B gate_up", 34816, 5120), ("27B down", 5120, 17408), ("27B GDN in_proj", 16480, 5120),
          ("27B o_proj", 5120, 6144)]


def bench(rows: tuple[int, ...] = (1, 33)) -> list[str]:
    """GPU us a call of the engine's Q4_K kernel (the weight's plan) and of this one (``split_for``), its float decode
    and its bf16 pair decode (on 4 and on 8 warps: 64- and 128-row tiles; and with x read an iteration ahead, the
    warps ``_warps`` picks; on 4 warps with a program's fewest rows at 16; staged in shared memory; where the engine
    takes a verify's rows as 32 and a tail, without it and on ptxas' registers: the other columns run the engine's
    settings, a tail at 128 registers at 33 rows since 2026-12-07), on each 27B Q4_K weight, weights
    cycled through 256 MB; each decode's row invariance and error against the product of ``quant.dequantize``'s
    weight; then the same for Q6_K's pair decode on two 27B shapes."""
    from kernel_timing import time_us
    from quant_bench import _rotated

    from engine.models import quant_kernel
    from engine.models.quantize import quantize

    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lines = ["| weight | MB | split | "
             + " | ".join(f"{m} rows: engine / gluon / pairs, 4 warps / 8 warps / x ahead / BLOCK_M >= 16 / "
                          f"{' / '.join(f'{s} stages' for s in STAGES)} / no tail / tail, ptxas' registers us"
                          for m in rows)
             + " | rows invariant: gluon, pairs | error: engine / gluon / pairs |",
             "|---|---|---|" + "---|" * (len(rows) + 2)]
    for label, n, k in SHAPES:
        blocks = quantize(torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02, Q4_K)
        pick_blocks = _rotated(blocks)
        split = split_for(n, k, sms)
        xs = {m: torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16) for m in rows}
        times = {m: [time_us(lambda x=xs[m], b=pick_blocks, k=k: quant_kernel.linear(x, b(), Q4_K, k))] for m in rows}
        x = xs[max(rows)]
        exact = x.double() @ quant.dequantize(blocks, Q4_K, k).to(torch.bfloat16).double().T
        got = [quant_kernel.linear(x, blocks, Q4_K, k)]
        invariant = []
        for pairs in (False, True):
            packed = repack(blocks, k, pairs)
            pick = _rotating_planes(packed, blocks.numel())
            for m in rows:
                for ahead, warps in ((False, 4), (False, 8), (True, None)) if pairs else ((False, 4),):
                    times[m].append(time_us(lambda x=xs[m], p=pick, n=n, k=k, s=split, pr=pairs, xa=ahead, w=warps:
                                            linear(x, *p(), n, k, s, pr, xa, w)))
                if pairs:  # and a program's fewest rows at 16 (the engine's at 8), 4 warps (nan: past 8 rows, the
                    # 4-warp launch's own BLOCK_M)
                    times[m].append(_with(lambda x=xs[m], p=pick, n=n, k=k, s=split:
                                          linear(x, *p(), n, k, s, True, False, 4), MIN_BLOCK_M=16) if m <= 8 else nan)
                    # and the planes and x staged in shared memory (the warps ``_warps`` picks); and where the
                    # engine takes 32 rows and a tail, without it and on ptxas' registers (nan: no tail here)
                    times[m] += [time_us(lambda x=xs[m], p=pick, n=n, k=k, s=split, st=st:
                                         linear(x, *p(), n, k, s, True, False, None, st)) for st in STAGES]
                    times[m] += _tails(lambda x=xs[m], p=pick, n=n, k=k, s=split: linear(x, *p(), n, k, s, True), m)
            many = linear(x, *packed, n, k, split, pairs)
            invariant.append("y" if torch.equal(linear(x[:1], *packed, n, k, split, pairs), many[:1]) else "n")
            got.append(many)
            del packed, pick
        errors = [float((g.double() - exact).norm() / exact.norm()) for g in got]
        lines.append(f"| {label} ({n} x {k}) | {blocks.numel() / 1e6:.1f} | {split} | "
                     + " | ".join(" / ".join(f"{t:.1f}" for t in times[m]) for m in rows)
                     + f" | {', '.join(invariant)} | {' / '.join(f'{e:.1e}' for e in errors)} |")
        print(lines[-1], flush=True)
        del blocks, pick_blocks
        torch.cuda.empty_cache()
    lines += ["", *_split_sweep(gen, sms)]
    lines += ["", "| Q6_K weight | MB | split | "
              + " | ".join(f"{m} rows: engine / gluon, 4 warps / 8 warps / x ahead / BLOCK_M >= 16 / "
                           f"{' / '.join(f'{s} stages' for s in STAGES)} / no tail / tail, ptxas' registers us"
                           for m in rows)
              + " | rows invariant | error against its own weight: engine / gluon |", "|---|---|---|"
              + "---|" * (len(rows) + 2)]
    q6 = quant.FORMATS["Q6_K"]
    for label, n, k in [("27B down", 5120, 17408), ("27B o_proj", 5120, 6144)]:
        held = quant.hold(quantize(torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02, q6),
                          q6)
        pick_held = _rotated(held)
        planes = repack_q6_k(held, k)
        pick = _rotating_planes(planes, held.numel())
        split = split_for(n, k, sms, fmt="Q6_K")
        xs = {m: torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16) for m in rows}
        times = {m: [time_us(lambda x=xs[m], b=pick_held, k=k: quant_kernel.linear(x, b(), q6, k))]
                 + [time_us(lambda x=xs[m], p=pick, n=n, k=k, s=split, xa=ahead, w=warps:
                            linear_q6_k(x, p(), n, k, s, xa, w))
                    for ahead, warps in ((False, 4), (False, 8), (True, None))]
                 + [_with(lambda x=xs[m], p=pick, n=n, k=k, s=split: linear_q6_k(x, p(), n, k, s, False, 4),
                          MIN_BLOCK_M=16) if m <= 8 else nan]
                 + [time_us(lambda x=xs[m], p=pick, n=n, k=k, s=split, st=st: linear_q6_k(x, p(), n, k, s, False, None,
                                                                                         st)) for st in STAGES]
                 + _tails(lambda x=xs[m], p=pick, n=n, k=k, s=split: linear_q6_k(x, p(), n, k, s), m)
                 for m in rows}
        x = xs[max(rows)]
        many = linear_q6_k(x, planes, n, k, split)
        invariant = torch.equal(linear_q6_k(x[:1], planes, n, k, split), many[:1])
        own = [quant.held_values(held, q6, k).to(torch.bfloat16), reference_q6_k(*planes, n, k)]
        errors = [float((got.double() - x.double() @ w.double().T).norm() / (x.double() @ w.double().T).norm())
                  for got, w in zip((quant_kernel.linear(x, held, q6, k), many), own, strict=True)]
        lines.append(f"| {label} ({n} x {k}) | {held.numel() / 1e6:.1f} | {split} | "
                     + " | ".join(" / ".join(f"{t:.1f}" for t in times[m]) for m in rows)
                     + f" | {'y' if invariant else 'n'} | {errors[0]:.1e} / {errors[1]:.1e} |")
        print(lines[-1], flush=True)
        del held, pick_held, planes, pick
        torch.cuda.empty_cache()
    return lines


def _with(call, **flags) -> float:
    """``call``'s GPU us with ``quant_gluon``'s module settings ``flags`` (``MIN_BLOCK_M`` 16: the engine's until
    2026-12-06's tenth session, 8 since; ``TAILS``, ``MAXNREG``), then back to the engine's."""
    from kernel_timing import time_us

    from engine.models import quant_gluon

    kept = {name: getattr(quant_gluon, name) for name in flags}
    for name, value in flags.items():
        setattr(quant_gluon, name, value)
    try:
        return time_us(call)
    finally:
        for name, value in kept.items():
            setattr(quant_gluon, name, value)


def _tails(call, rows: int) -> list[float]:
    """``call`` where the engine takes ``rows`` as a power of two and a tail (``TAILS``): without the tail, and with
    it on ptxas' registers (no ``MAXNREG``); nan where ``rows`` takes no tail."""
    from engine.models import quant_gluon

    if not quant_gluon._rows_a_program(rows)[1]:
        return [nan, nan]
    return [_with(call, TAILS=False), _with(call, MAXNREG=None)]


def _split_sweep(gen: torch.Generator, sms: int) -> list[str]:
    """The pair decode at 1 row on 4 warps, each 27B Q4_K weight (and the Q6_K down and o_proj) at every split of K
    up to 8 (whole 128-column tiles): programs an SM are tiles x split / SMs; ``split_for``'s choice marked."""
    from kernel_timing import time_us

    from engine.models.quantize import quantize

    q6 = quant.FORMATS["Q6_K"]
    lines = ["| 1 row, pairs, 4 warps | " + " | ".join(f"split {s}: programs / SM, us" for s in range(1, 9)) + " |",
             "|---|" + "---|" * 8]
    for label, n, k, fmt in [(*shape, Q4_K) for shape in SHAPES] + [("27B down Q6_K", 5120, 17408, q6),
                                                                    ("27B o_proj Q6_K", 5120, 6144, q6)]:
        blocks = quantize(torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02, fmt)
        if fmt is q6:
            planes = repack_q6_k(quant.hold(blocks, q6), k)
            launch = lambda x, p, s, n=n, k=k: linear_q6_k(x, p, n, k, s, False, 4)  # noqa: E731
        else:
            planes = repack(blocks, k, True)
            launch = lambda x, p, s, n=n, k=k: linear(x, *p, n, k, s, True, False, 4)  # noqa: E731
        pick = _rotating_planes(planes, blocks.numel())
        x = torch.randn(1, k, generator=gen, device="cuda", dtype=torch.bfloat16)
        tiles, chosen, cells = -(-n // 64), split_for(n, k, sms, fmt=fmt.name), []
        for split in range(1, 9):
            if (k // 128) % split:
                cells.append("-")
                continue
            us = time_us(lambda x=x, p=pick, s=split, f=launch: f(x, p(), s))
            mark = "**" if split == chosen else ""
            cells.append(f"{mark}{tiles * split / sms:.2f}, {us:.1f}{mark}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
        del blocks, planes, pick
        torch.cuda.empty_cache()
    return lines


# (the attention layers' q and fused qkv too: 8 of each in the 27B Q4_K_M preset, whose split the aim changes)
LAUNCH_SHAPES = [(*shape, "Q4_K") for shape in SHAPES] + [("27B attention qkv", 14336, 5120, "Q4_K"),
                                                          ("27B attention q", 12288, 5120, "Q4_K"),
                                                          ("27B down", 5120, 17408, "Q6_K"),
                                                          ("27B o_proj", 5120, 6144, "Q6_K")]


def bench_launches(rows: tuple[int, ...] = (1, 33), most_split: int = 17) -> list[str]:
    """Where a launch's programs fall on the SMs: each 27B Q4_K / Q6_K weight at every split of K (whole parts of
    at least two 128-column tiles, up to ``most_split``) and, at each row count, on the warps the engine picks and
    on every other warp count whose tiles the padded rows hold whole (4, 8, 16: 64-, 128-, 256-row tiles), unfolded,
    and for an even split from 16 rows a program folded too (``fold``: two parts a program, on the engine's warps),
    GPU us a call (weights cycled through 256 MB), with the launch's programs an SM. A split is the weight's for
    every row count (a row's bits depend on it), the warps and the fold are a launch's own (the same bits); the
    engine's launch marked *, ``split_for``'s split **."""
    from kernel_timing import time_us

    from engine.models import quant_gluon
    from engine.models.quantize import quantize

    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lines = ["| weight | split | " + " | ".join(f"{m} rows: warps (programs / SM) us" for m in rows) + " |",
             "|---|---|" + "---|" * len(rows)]
    for label, n, k, fmt_name in LAUNCH_SHAPES:
        fmt = quant.FORMATS[fmt_name]
        blocks = quantize(torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02, fmt)
        if fmt_name == "Q6_K":
            planes = repack_q6_k(quant.hold(blocks, fmt), k)
            launch = lambda x, p, s, w, f, n=n, k=k: linear_q6_k(x, p, n, k, s, False, w, fold=f)  # noqa: E731
        else:
            planes = repack(blocks, k, True)
            launch = lambda x, p, s, w, f, n=n, k=k: linear(x, *p, n, k, s, True, False, w, fold=f)  # noqa: E731
        pick = _rotating_planes(planes, blocks.numel())
        n_pad, k_tiles = padded_rows(n), padded_cols(k) // 128
        xs = {m: torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16) for m in rows}
        chosen, fold_pairs = quant_gluon.split_and_fold(n, k, sms, fmt=fmt_name)
        for split in (s for s in range(1, most_split + 1) if k_tiles % s == 0 and k_tiles // s >= 2):
            cells = []
            for m in rows:
                block_m, _ = quant_gluon._rows_a_program(m)
                engine = quant_gluon._warps(quant_gluon._block_m(m), n_pad, None, wide=quant_gluon.wide_warps(
                    block_m, 0, n_pad, split, sms))
                engine_fold = fmt_name in quant_gluon.FOLD_FORMATS and quant_gluon.folds(
                    block_m, 0, n_pad // (16 * engine), split, sms, engine)
                if fold_pairs and split == chosen:  # (a split doubled for the verify: VERIFY_SLIVER)
                    engine_fold = not quant_gluon.verify_launch(m)
                launches = [(w, False) for w in sorted({engine} | {w for w in (4, 8, 16)
                                                                    if block_m >= 16 and n_pad % (16 * w) == 0})]
                launches += [(engine, True)] if (block_m >= 16 or engine_fold) and split % 2 == 0 else []
                timed = []
                for w, f in launches:
                    us = time_us(lambda x=xs[m], s=split, w=w, f=f, go=launch, p=pick: go(x, p(), s, w, f))
                    mark = "*" if (w, f) == (engine, engine_fold) else ""
                    programs = n_pad // (16 * w) * (split // 2 if f else split) / sms
                    timed.append(f"{mark}{w}{' folded' if f else ''} ({programs:.2f}) {us:.1f}{mark}")
                cells.append(", ".join(timed))
            mark = "**" if split == chosen else ""
            lines.append(f"| {label} {fmt_name} ({blocks.numel() / 1e6:.1f} MB) | {mark}{split}{mark} | "
                         + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
        del blocks, planes, pick
        torch.cuda.empty_cache()
    return lines


Q4_1_SHAPES = [("SmolLM2 gate_up", 3072, 576), ("SmolLM2 qkv", 960, 576), ("SmolLM2 o_proj", 576, 576),
               ("SmolLM2 down", 576, 1536)]


def bench_q4_1(rows: tuple[int, ...] = (1, 49)) -> list[str]:
    """SmolLM2's Q4_1 weights (a layer's four launches; ``Q4_1_SHAPES``): GPU us a call of the operand-register
    decode (the split the engine takes, ``split_for``'s), of ``quant_kernel`` on the weight's plan (what a native load
    took before it) and of its dequantized twin on the dense kernel (a dequantized load's), weights cycled through
    256 MB; rows invariant and the error against the product of its own values; then each split of K at 1 row
    and at the most rows (on the warps the engine picks, and on 4)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lines = ["| Q4_1 weight | MB | split | " + " | ".join(f"{m} rows: gluon / quant_kernel / dense bf16 us"
                                                         for m in rows)
             + f" | rows invariant | error: gluon / quant_kernel | gluon by split: split: 1 / {max(rows)} rows / "
             f"{max(rows)} rows on 4 warps us |",
             "|---|---|---|" + "---|" * (len(rows) + 3)]
    for label, n, k in Q4_1_SHAPES:
        lines.append(_q4_1_weight(label, n, k, rows, gen, sms))
        print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    return lines


def _q4_1_weight(label: str, n: int, k: int, rows: tuple[int, ...], gen: torch.Generator, sms: int) -> str:
    """``bench_q4_1``'s row for one random weight [n, k] quantized to Q4_1."""
    from kernel_timing import time_us
    from quant_bench import _rotated

    from engine.models import linear as rows_linear
    from engine.models import quant_kernel
    from engine.models.quantize import quantize

    blocks = quantize(torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02, Q4_1)
    planes = repack_q4_1(blocks, k)
    weight = reference_q4_1(*planes, n, k)
    twin = quant.dequantize(blocks, Q4_1, k).to(torch.bfloat16)
    pick_planes, pick_blocks, pick_twin = _rotating_planes(planes, blocks.numel()), _rotated(blocks), _rotated(twin)
    split = split_for(n, k, sms)
    xs = {m: torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16) for m in (1, *rows)}
    times = {m: [time_us(lambda x=xs[m]: linear_q4_1(x, pick_planes(), n, k, split)),
                 time_us(lambda x=xs[m]: quant_kernel.linear(x, pick_blocks(), Q4_1, k)),
                 time_us(lambda x=xs[m]: rows_linear.linear(x, pick_twin()))] for m in rows}
    x = xs[max(rows)]
    many = linear_q4_1(x, planes, n, k, split)
    invariant = torch.equal(linear_q4_1(x[:1], planes, n, k, split), many[:1])
    errors = [float((got.double() - x.double() @ w.double().T).norm() / (x.double() @ w.double().T).norm())
              for got, w in ((many, weight), (quant_kernel.linear(x, blocks, Q4_1, k), twin))]
    k_tiles, by_split = padded_cols(k) // 128, []
    for s in (s for s in range(1, k_tiles + 1) if k_tiles % s == 0):
        # at 1 row, at the most rows (the warps ``_warps`` picks: 8 from 32 rows where the rows are whole 128-row
        # tiles), and at the most rows on 4 warps (twice the programs: SmolLM2's weights have 5-48 tiles)
        us = [time_us(lambda s=s, m=m, w=w: linear_q4_1(xs[m], pick_planes(), n, k, s, False, w))
              for m, w in ((1, None), (max(rows), None), (max(rows), 4))]
        mark = "**" if s == split else ""
        by_split.append(f"{mark}{s}: {' / '.join(f'{t:.1f}' for t in us)}{mark}")
    return (f"| {label} ({n} x {k}) | {blocks.numel() / 1e6:.2f} | {split} | "
            + " | ".join(" / ".join(f"{t:.1f}" for t in times[m]) for m in rows)
            + f" | {'y' if invariant else 'n'} | {errors[0]:.1e} / {errors[1]:.1e} | {', '.join(by_split)} |")


def _rotating_planes(planes: tuple[torch.Tensor, ...], nbytes: int):
    """``quant_bench._rotating`` over ``planes`` and as many clones as 256 MB of the weight's bytes take."""
    from quant_bench import _copies, _rotating

    return _rotating([planes] + [tuple(t.clone() for t in planes) for _ in range(_copies(nbytes) - 1)])
