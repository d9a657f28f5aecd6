"""Two trees' ``gpu_bench.py large`` runs, alternated on one machine, as one table (``benchmarks/device/versus.sh``).

    python benchmarks/versus.py --head head_1.json head_2.json --this this_1.json this_2.json --md versus.md

Each file is one ``gpu_bench.py large --out`` of one process (its AR runs and a verify per budget, for each preset). A
tree's row pools its processes: AR ms over every AR run, each budget's verify ms over the processes, min / median /
max; then this tree's medians over the head's. Why a script: a change to a kernel worth 2% reads as "8.7 -> 8.5 ms"
in each run's own table (0.1 ms), and one process a tree cannot tell a gain from the order the two ran in
(2026-12-07, eighteenth session); the JSON keeps every run's full precision, and alternating trees spreads the
machine's drift over both."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


class VersusError(ValueError):
    """A run file that is not a ``gpu_bench.py large --out``, or not of the GPU, presets, weights and budgets the
    others have."""


def load_runs(paths: list[str]) -> dict[str, dict]:
    """Per preset: its AR ms (every run of every file), each budget's verify ms (one a file), its roofline ms (one
    a file), its weights and GPU; from ``gpu_bench.py large --out`` files, each of the same presets, budgets, weights
    and GPU as the first. Raises VersusError naming the file and what it lacks or changes."""
    pooled: dict[str, dict] = {}
    first: tuple | None = None
    for path in paths:
        data = read_json(path, VersusError)
        presets = data.get("presets") if isinstance(data, dict) else None
        if not isinstance(presets, dict) or not presets:
            raise VersusError(f"{path}: no 'presets' (a gpu_bench.py large --out file has one per preset timed)")
        gpu = (data.get("env") or {}).get("gpu", "?")
        shape = []
        for name, run in presets.items():
            try:
                ar = [float(v) for v in run["ar_ms"]]
                roofline = float(run["roofline_ms"])
                verify = {int(b): float(timed["verify_ms"]) for b, timed in (run.get("budgets") or {}).items()}
                weights = str(run.get("weights", "bf16"))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise VersusError(f"{path}: preset {name}: not a gpu_bench.py large run (AR runs 'ar_ms', "
                                  f"'roofline_ms' and each budget's 'verify_ms' as numbers): {exc!r}") from exc
            if not ar:
                raise VersusError(f"{path}: preset {name} has no AR runs ('ar_ms' is empty)")
            into = pooled.setdefault(name, {"ar_ms": [], "verify_ms": {}, "roofline_ms": [], "weights": weights,
                                            "gpu": gpu})
            into["ar_ms"] += ar
            into["roofline_ms"].append(roofline)
            for budget, ms in verify.items():
                into["verify_ms"].setdefault(budget, []).append(ms)
            shape.append((name, weights, tuple(sorted(verify))))
        seen = (gpu, tuple(sorted(shape)))
        if first is None:
            first = (path, *seen)
        elif seen != first[1:]:
            raise VersusError(f"{path}: GPU, presets, weights or budgets {seen} differ from {first[0]}'s {first[1:]}: "
                              f"a tree's runs are pooled only alike")
    return pooled


def _spread(values: list[float], digits: int = 2) -> str:
    return f"{min(values):.{digits}f} / **{statistics.median(values):.{digits}f}** / {max(values):.{digits}f}"


def _ratio(this: list[float], head: list[float]) -> float:
    return statistics.median(this) / statistics.median(head)


def table(head: dict[str, dict], this: dict[str, dict]) -> list[str]:
    """The markdown rows: per preset, each tree's AR ms and verify ms per budget (min / median / max; % of the
    roofline at the median AR, against each tree's median roofline), then this over head by medians. Raises
    VersusError where the trees timed different presets or budgets."""
    if set(head) != set(this):
        raise VersusError(f"the trees timed different presets: head {sorted(head)}, this {sorted(this)}")
    lines = []
    for name in sorted(head):
        for key in ("weights", "gpu"):
            if head[name][key] != this[name][key]:
                raise VersusError(f"{name}: the trees ran with different {key}: head {head[name][key]}, this "
                                  f"{this[name][key]}")
        budgets = sorted(head[name]["verify_ms"])
        if budgets != sorted(this[name]["verify_ms"]):
            raise VersusError(f"{name}: the trees timed different budgets: head {budgets}, this "
                              f"{sorted(this[name]['verify_ms'])}")
        lines += [f"**{name}** ({head[name]['weights']}, {head[name]['gpu']}): ms, min / median / max over the runs",
                  "",
                  "| tree | AR runs | AR ms | % of roofline | "
                  + " | ".join(f"verify at {b} ms | verify at {b} / AR" for b in budgets) + " |",
                  "|---|---|---|---|" + "---|---|" * len(budgets)]
        for label, runs in (("head", head[name]), ("this", this[name])):
            ar = statistics.median(runs["ar_ms"])
            cells = [f"{_spread(runs['verify_ms'][b])} | {statistics.median(runs['verify_ms'][b]) / ar:.3f}x"
                     for b in budgets]
            lines.append(f"| {label} | {len(runs['ar_ms'])} | {_spread(runs['ar_ms'], 3)} | "
                         f"{100 * statistics.median(runs['roofline_ms']) / ar:.1f}% | " + " | ".join(cells) + " |")
        ratios = [f"AR {_ratio(this[name]['ar_ms'], head[name]['ar_ms']):.4f}"]
        ratios += [f"verify at {b} {_ratio(this[name]['verify_ms'][b], head[name]['verify_ms'][b]):.4f}"
                   for b in budgets]
        lines += ["", f"this / head, medians: {', '.join(ratios)}", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", nargs="+", required=True, help="the earlier tree's gpu_bench.py large --out files")
    ap.add_argument("--this", nargs="+", required=True, help="this tree's gpu_bench.py large --out files")
    ap.add_argument("--md", help="the table written here too")
    args = ap.parse_args(argv)
    try:
        lines = table(load_runs(args.head), load_runs(args.this))
    except VersusError as exc:
        print(f"versus: {exc}", file=sys.stderr)
        return 2
    return shown(lines, args.md)


def read_json(path: str, error: type[ValueError]) -> object:
    """``path``'s JSON, or ``error`` naming the file and why it cannot be read or is not JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror})") from exc
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not JSON ({exc.msg}, line {exc.lineno})") from exc


def shown(lines: list[str], md: str | None) -> int:
    """``lines`` printed, and written to ``md`` too where given; 0 (a script's exit status)."""
    print("\n".join(lines))
    if md:
        Path(md).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
