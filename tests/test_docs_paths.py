"""README, docs/ and benchmarks/DEVICE.md name only paths that exist (issue #22): a file or folder
of this repository written in them (engine/..., autotune/..., benchmarks/..., docs/..., tests/...,
experiments/..., search_spaces/..., .ci/...) is there. Globs and home-folder paths are not checked."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("engine", "autotune", "benchmarks", "docs", "tests", "experiments", "search_spaces", ".ci")
# a repository path: one of ROOTS at the start of a word (not inside another path, ~/... or a URL)
PATH = re.compile(rf"(?<![\w/.~-])((?:{'|'.join(re.escape(r) for r in ROOTS)})/[A-Za-z0-9_./\-]*)")


def _named(text: str) -> set[str]:
    return {m.group(1).rstrip(".,;:)/") for m in PATH.finditer(text)}


def test_every_path_the_docs_name_exists():
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "DEVICE.md"]
    missing = {doc.relative_to(REPO).as_posix(): sorted(p for p in _named(doc.read_text(encoding="utf-8"))
                                                        if not (REPO / p).exists())
               for doc in docs}
    assert {doc: paths for doc, paths in missing.items() if paths} == {}


def test_the_path_pattern_finds_paths_and_skips_the_rest():
    text = ("see `engine/decoding/runtime.py`, docs/measurement.md. and ~/.cache/autotune/ray or "
            "https://x.org/engine/a.py or /root/engine/b.py; benchmarks/device/")
    assert _named(text) == {"engine/decoding/runtime.py", "docs/measurement.md", "benchmarks/device"}
