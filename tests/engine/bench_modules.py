"""The benchmark scripts loaded as modules from their files (``benchmarks/`` is not a package), for
their CPU tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module; its sibling modules importable as when it runs as a script."""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def usage_error(capsys, name: str, argv: list[str]) -> str:
    """``benchmarks/<name>.py``'s ``main(argv)`` refusing its command line: asserts it exits 2 and returns what it
    wrote to stderr (the rule and the value, for the test to check)."""
    import pytest

    module = load_benchmark(name)
    with pytest.raises(SystemExit) as exit_:
        module.main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err
