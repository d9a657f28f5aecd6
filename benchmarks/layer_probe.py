"""SmolLM2's 30 layers' four projections launched in order in one CUDA graph, Q4_1 planes against their bf16 twins
on the dense kernel: wall per layer, each launch's GPU time by position and the idle time before it (the profiler's
start less the end of the kernel before: a launch's own start-up), with and without an RMSNorm launch before each
projection. Every variant reads the 30 layers' weights from HBM (~60 MB of Q4_1 planes, ~210 MB of bf16: past an
H100's 50 MB L2); a graph of one weight's 30 launches would not (its planes stay in L2 across replays)."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_timing import graph_kernels  # noqa: E402

from engine.models import fused, quant  # noqa: E402
from engine.models import linear as rows_linear  # noqa: E402
from engine.models import quant_gluon as qg  # noqa: E402
from engine.models.quantize import quantize  # noqa: E402

SHAPES = (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536))
LAYERS = 30


def _graph_times(launches) -> tuple[float, list]:
    """``launches`` captured in one graph: its wall (median of 20 replays, the launch hidden behind a sleep) and
    its kernels in launch order (the profiler's events: name, GPU us, start and end)."""
    for fn in launches:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in launches:
            fn()
    for _ in range(3):
        graph.replay()
    walls = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        walls.append(1000 * a.elapsed_time(b))
    return statistics.median(walls), graph_kernels(graph.replay)


def main() -> None:  # noqa: C901
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--md", default=None, help="write the table here too")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("layer_probe.py needs CUDA", file=sys.stderr)
        raise SystemExit(2)
    gen = torch.Generator(device="cuda").manual_seed(0)
    fmt = qg.Q4_1
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    weights = []  # per layer: {name: (planes, twin, n, k, split)}
    for _ in range(LAYERS):
        layer = {}
        for name, n, k in SHAPES:
            blocks = quantize(torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02, fmt)
            planes = qg.repack_q4_1(blocks, k)
            twin = quant.dequantize(blocks, fmt, k).to(torch.bfloat16)
            layer[name] = (planes, twin, n, k, qg.split_for(n, k, sms))
        weights.append(layer)
    xs = {k: torch.randn(1, k, generator=gen, device="cuda", dtype=torch.bfloat16) for k in (576, 1536)}
    norm_w = {k: torch.ones(k, device="cuda", dtype=torch.bfloat16) for k in (576, 1536)}

    def with_pdl(module, on, fn):
        """``fn`` launched with ``module.PDL`` set to ``on`` (whatever the engine's), then put back."""
        def launch():
            before, module.PDL = module.PDL, on
            try:
                return fn()
            finally:
                module.PDL = before
        return launch

    def proj(form, w):
        planes, twin, n, k, s = w
        pdl = form.endswith(" pdl")
        if form.startswith("dense"):  # "dense pdl": linear.PDL (its weight's first blocks into L2 before the wait)
            return with_pdl(rows_linear, pdl, lambda: rows_linear.linear(xs[k], twin))
        if form == "native split":  # K in as many parts as tiles (the engine's rule: 2 stages at 1 row)
            s = qg.padded_cols(k) // qg.TILE_K
        # "native": the engine's stages rule, without PDL; "native sN": N stages (0: the register path); "pdl": with
        # programmatic dependent launch (the engine's: the prologue asks for the weight's tiles before it waits for x)
        digits = [word[1:] for word in form.split() if word[0] == "s" and word[1:].isdigit()]
        stages = int(digits[0]) if digits else None
        ahead = "x_ahead" in form
        return with_pdl(qg, pdl, lambda: qg.linear_q4_1(xs[k], planes, n, k, s, x_ahead=ahead,
                                                         stages=0 if ahead else stages))

    def norm(k):  # (its output unread: the kernel before a projection, as in a layer, with no copy between)
        return lambda: fused.rms_norm(xs[k], norm_w[k], 1e-5)

    rows = ["| variant | wall us | per layer us | kernel us (sum) | proj us by position (qkv / o / gate_up / down) "
            "| idle us before each (qkv / o / gate_up / down) | norm us |", "|---|---|---|---|---|---|---|"]
    variants = {}
    for name, n, k in SHAPES:  # the staged tiles' bits against the register path's
        planes, _, _, _, split = weights[0][name]
        x = torch.randn(49, k, generator=gen, device="cuda", dtype=torch.bfloat16)
        ref = qg.linear_q4_1(x, planes, n, k, split, stages=0)
        for st in (2, 3, 6):
            for m in (1, 8, 49):
                got = qg.linear_q4_1(x[:m], planes, n, k, split, stages=st)
                if not torch.equal(got, ref[:m]):
                    raise SystemExit(f"{name}: {st} stages at {m} rows differ from the register path's bits")
    for form in ("dense", "dense pdl", "native", "native pdl", "native s0", "native s0 pdl", "native split",
                 "native x_ahead", "native s3", "native s3 pdl"):
        for normed in (False, True):
            seq, kinds = [], []
            for layer in weights:
                for name, _, k in SHAPES:
                    if normed:
                        seq.append(norm(k))
                        kinds.append("norm")
                    seq.append(proj(form, layer[name]))
                    kinds.append(name)
            variants[f"{form}{' +norm' if normed else ''}"] = (seq, kinds)
    for label, (seq, kinds) in variants.items():
        wall, evs = _graph_times(seq)
        # the projections' kernels in launch order, matched to the projections asked for (any other kernel, a
        # norm's copy, left out), each with the idle time since the kernel before it ended
        proj, idle = [], []
        for i, ev in enumerate(evs):
            if "_q4_1_kernel" in ev.name or "_linear_kernel" in ev.name:
                proj.append(ev.device_time)
                idle.append(ev.time_range.start - evs[i - 1].time_range.end if i else None)
        asked = [kind for kind in kinds if kind != "norm"]
        if len(proj) != len(asked):
            raise SystemExit(f"{label}: {len(proj)} projection kernels for {len(asked)} projections")
        by, gaps = {}, {}
        for kind, us, gap in zip(asked, proj, idle, strict=True):
            by.setdefault(kind, []).append(us)
            if gap is not None:
                gaps.setdefault(kind, []).append(gap)
        norms = [ev.device_time for ev in evs if "_rms_norm" in ev.name]

        def cols(d):
            return " / ".join(f"{statistics.mean(d[s[0]]):.2f}" if d.get(s[0]) else "-" for s in SHAPES)
        nrm = f"{statistics.mean(norms):.2f}" if norms else "-"
        total = sum(ev.device_time for ev in evs)
        rows.append(f"| {label} | {wall:.1f} | {wall / LAYERS:.2f} | {total:.1f} | {cols(by)} | {cols(gaps)} | "
                    f"{nrm} |")
        print(rows[-1], flush=True)
    if args.md:
        Path(args.md).write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
