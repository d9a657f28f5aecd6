"""Two ``gpu_bench.py graphs`` runs of one model, launch by launch: where a step's time moved between two settings
(``benchmarks/device/quant.sh GRAPHS=1 GRAPHS_VS="k8"``).

    python benchmarks/graphs_versus.py --a graphs_engine.json --b graphs_k8.json --md graphs_versus.md

Each file is one ``gpu_bench.py graphs --out`` (every captured step graph replayed alone: its wall time and each
kernel's GPU us and end-to-end us in launch order, ``kernel_timing.graph_breakdown``). For each graph both files have:
the wall and the kernels' sum, A then B; the kernels by name (calls, GPU us, the change); and the launches matched one
by one in launch order (where the two sequences of names differ, by ``difflib``'s matching), grouped by the kernel name
and the name of the kernel before it (a product after a norm, after an attention merge...: a weight's place in its
layer), the groups that moved most first, by end-to-end us where both files have them (a launch's GPU time under
programmatic dependent launch counts its wait for the launch before). Why: on 2026-12-07 (nineteenth session) the
27B's 1-row launches at 8 programs an SM were faster alone, its AR step slower; a step's sum cannot say which
launches lost."""

from __future__ import annotations

import argparse
import difflib
import sys

from versus import read_json, shown  # (benchmarks/ on the path: run as a script, or tests.engine.bench_modules)


class GraphsError(ValueError):
    """A file that is not a ``gpu_bench.py graphs --out``, or two with no graph in common."""


def load(path: str) -> dict[str, dict]:
    """The graphs of one ``gpu_bench.py graphs --out`` file by name: each with ``wall_us``, ``kernel_us``,
    ``order`` ([name, us] in launch order) and ``ends`` (each launch's end-to-end us, ``kernel_timing.end_to_end``;
    None in a file from before 2026-12-07's twentieth session, whose entries are [name, us]). Raises GraphsError
    naming the file and what it lacks."""
    data = read_json(path, GraphsError)
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, dict) or not runs:
        raise GraphsError(f"{path}: no 'runs' (a gpu_bench.py graphs --out file has one per step graph)")
    graphs = {}
    for name, run in runs.items():
        try:
            entries = [list(entry) for entry in run["order"]]
            if any(len(e) not in (2, 3) for e in entries) or len({len(e) for e in entries}) > 1:
                raise ValueError("each launch [kernel, us] or [kernel, us, end-to-end us], all alike")
            order = [(str(e[0]), float(e[1])) for e in entries]
            ends = [float(e[2]) for e in entries] if entries and len(entries[0]) == 3 else None
            graphs[name] = {"wall_us": float(run["wall_us"]), "kernel_us": float(run["kernel_us"]), "order": order,
                            "ends": ends}
        except (KeyError, TypeError, ValueError) as exc:
            raise GraphsError(f"{path}: graph {name}: not a gpu_bench.py graphs run ('wall_us', 'kernel_us' and "
                              f"'order' as [kernel, us] or [kernel, us, end-to-end us]): {exc!r}") from exc
    return graphs


def matched(a: list[tuple[str, float]], b: list[tuple[str, float]]) -> list[tuple[int, int]]:
    """Index pairs of the launches of ``a`` and ``b`` with the same kernel name, in launch order: all of them where
    the names are the same sequence, else ``difflib``'s longest matching blocks (a launch one side lacks: unmatched)."""
    names_a, names_b = [n for n, _ in a], [n for n, _ in b]
    if names_a == names_b:
        return [(i, i) for i in range(len(a))]
    blocks = difflib.SequenceMatcher(a=names_a, b=names_b, autojunk=False).get_matching_blocks()
    return [(blk.a + k, blk.b + k) for blk in blocks for k in range(blk.size)]


def compare(a: dict[str, dict], b: dict[str, dict], top: int = 12) -> list[str]:
    """The markdown lines: for each graph both have, its wall and kernel sum, its kernels by name and its matched
    launches grouped by (kernel, the kernel before it), the ``top`` groups that moved most."""
    common = [name for name in a if name in b]
    if not common:
        raise GraphsError(f"no graph in common: A has {sorted(a)}, B {sorted(b)}")
    lines = []
    for name in common:
        ga, gb = a[name], b[name]
        lines += [f"**{name}**: wall {ga['wall_us']:.1f} -> {gb['wall_us']:.1f} us "
                  f"({gb['wall_us'] - ga['wall_us']:+.1f}); kernels {len(ga['order'])} -> {len(gb['order'])}, "
                  f"their sum {ga['kernel_us']:.1f} -> {gb['kernel_us']:.1f} us", ""]
        by_name: dict[str, list[float]] = {}
        for side, graph in ((0, ga), (1, gb)):
            for kernel, us in graph["order"]:
                row = by_name.setdefault(kernel, [0, 0, 0.0, 0.0])
                row[side] += 1
                row[2 + side] += us
        lines += ["| kernel | calls A / B | us A | us B | change |", "|---|---|---|---|---|"]
        for kernel, (na, nb, ua, ub) in sorted(by_name.items(), key=lambda kv: -abs(kv[1][3] - kv[1][2]))[:top]:
            lines.append(f"| `{kernel}` | {na} / {nb} | {ua:.1f} | {ub:.1f} | {ub - ua:+.1f} |")
        pairs = matched(ga["order"], gb["order"])
        # end-to-end where both files have it (a launch's share of the span, its wait for the one before left out)
        ends = ga["ends"] is not None and gb["ends"] is not None
        ua_of = ga["ends"] if ends else [us for _, us in ga["order"]]
        ub_of = gb["ends"] if ends else [us for _, us in gb["order"]]
        groups: dict[tuple[str, str], list[float]] = {}
        for i, j in pairs:
            kernel = ga["order"][i][0]
            before = ga["order"][i - 1][0] if i else "(first)"
            row = groups.setdefault((kernel, before), [0, 0.0, 0.0])
            row[0] += 1
            row[1] += ua_of[i]
            row[2] += ub_of[j]
        what = ("end-to-end us (from the latest end of the launches before)" if ends else
                "GPU us (a launch's own: under programmatic dependent launch its wait for the one before too)")
        lines += ["", f"{len(pairs)} of {len(ga['order'])} / {len(gb['order'])} launches matched; by kernel and the "
                  f"kernel before it, {what}:", "",
                  "| kernel | after | launches | us A | us B | change | us a launch A -> B |",
                  "|---|---|---|---|---|---|---|"]
        for (kernel, before), (n, ua, ub) in sorted(groups.items(), key=lambda kv: -abs(kv[1][2] - kv[1][1]))[:top]:
            lines.append(f"| `{kernel}` | `{before}` | {n} | {ua:.1f} | {ub:.1f} | {ub - ua:+.1f} | "
                         f"{ua / n:.2f} -> {ub / n:.2f} |")
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="the first gpu_bench.py graphs --out file (the baseline)")
    ap.add_argument("--b", required=True, help="the second, compared with it")
    ap.add_argument("--top", type=int, default=12, help="the groups shown a table (the largest changes)")
    ap.add_argument("--md", help="write the tables here too")
    args = ap.parse_args(argv)
    if args.top < 1:
        ap.error(f"--top {args.top}: at least 1")
    try:
        lines = compare(load(args.a), load(args.b), args.top)
    except GraphsError as exc:
        print(f"graphs_versus: {exc}", file=sys.stderr)
        return 2
    return shown(lines, args.md)


if __name__ == "__main__":
    raise SystemExit(main())
