"""The import graph of ``engine`` and ``autotune``: acyclic, every import counted (a function-level
import that breaks a cycle at run time is still a cycle in the design), and every module importable
first, on its own, in a fresh interpreter (issue #22)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "autotune")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports: ``from a import b`` is ``a.b`` where that is a module
    (a submodule: importing it runs ``a``'s __init__ too, which is an edge of ``a``'s own), else
    ``a``; relative imports resolved against ``name``'s package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_only(node):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_is_acyclic():
    modules = _modules()
    assert {"engine", "engine.api", "autotune.sweep"} <= set(modules)
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    assert "engine.decoding.loop" in graph["engine.decoding.runtime"]
    assert "engine.decoding.runtime" in graph["engine.decoding.decode"]
    assert _cycles(graph) == [], "import cycles (each a group of modules that import each other)"


def test_autotune_uses_only_the_engines_front_door():
    """``autotune`` imports ``engine`` (its ``__init__``: the front door) and nothing deeper, so the
    engine's insides can move without breaking the orchestrator."""
    modules = _modules()
    deeper = {name: sorted(m for m in _imports(path, name, modules) if m.startswith("engine."))
              for name, path in modules.items() if name.startswith("autotune")}
    assert {name: found for name, found in deeper.items() if found} == {}
    import engine

    assert set(engine.__all__) <= set(dir(engine)) | {"serve"} and callable(engine.serve)


@pytest.mark.slow
def test_every_module_imports_first_on_its_own():
    """Each module imported first in a fresh interpreter's view of the project (the project's modules
    forgotten between imports, the third-party ones kept: torch loads once); ``__main__`` modules
    run their CLI when imported, so they are left out."""
    script = (
        "import importlib, sys, traceback\n"
        f"names = {sorted(m for m in _modules() if not m.endswith('__main__'))!r}\n"
        "bad = []\n"
        "for name in names:\n"
        "    for loaded in [m for m in sys.modules if m.split('.')[0] in ('engine', 'autotune')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        bad.append(name + ': ' + traceback.format_exc(limit=3))\n"
        "print('\\n'.join(bad) or 'ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-4000:] + proc.stderr[-4000:]
