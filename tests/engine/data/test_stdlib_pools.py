"""The standard-library training pools (engine.data.datasets): ``stdlib`` (functions posed like HumanEval)
and ``stdlib-rest`` (the functions it leaves out), cut from a synthetic library and from the
running interpreter's."""

import ast
import base64
import inspect
import json
import sys
import sysconfig
import textwrap
from asyncio import BaseEventLoop
from pathlib import Path

from engine.data.datasets import HUMANEVAL_TEMPLATE, STDLIB_MAX_CHARS, named_pool, stdlib_prompts, stdlib_rest_prompts
from engine.data.prompts import Prompt, split_of
from engine.data.workloads import TRAINING_MIX, training_pool

TEMPLATE_HEAD, TEMPLATE_TAIL = HUMANEVAL_TEMPLATE.split("{prompt}")


def _code(p: Prompt) -> str:
    """The function text of a HumanEval-style prompt (asserting its shape)."""
    assert p.text is None and p.tools is None and len(p.messages) == 1 and p.messages[0]["role"] == "user"
    content = p.messages[0]["content"]
    assert content.startswith(TEMPLATE_HEAD) and content.endswith(TEMPLATE_TAIL)
    return content[len(TEMPLATE_HEAD):-len(TEMPLATE_TAIL)]


def _check_stub(code: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """``code`` is one public def at column 0 with a docstring of >= 2 non-empty lines and no body."""
    tree = ast.parse(code)
    assert len(tree.body) == 1 and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)), code
    fn = tree.body[0]
    assert not fn.decorator_list and not fn.name.startswith("_") and code.startswith(("def ", "async def "))
    assert len(fn.body) == 1 and ast.get_docstring(fn, clean=False) is not None, code
    assert sum(1 for line in ast.get_docstring(fn).splitlines() if line.strip()) >= 2
    assert ast.parse(code + "    pass\n").body[0].body[-1].__class__ is ast.Pass  # a body goes right after
    assert code.endswith("\n") and len(code) <= STDLIB_MAX_CHARS
    return fn


STDLIB_TREE = {
    "mod.py": textwrap.dedent('''\
        import functools


        @functools.cache
        def multi(a,
                  b=1):  # trailing comment
            # a comment before the docstring
            """Add.

            Twice.
            """
            return a + b


        def one_line(x):
            """Only one line."""
            return x


        def _private(x):
            """Private.

            Skipped.
            """
            return x


        def stub_pass(x):
            """Stub.

            Body is pass.
            """
            pass


        def stub_ellipsis(x):
            """Stub.

            Body is ellipsis.
            """
            ...


        def stub_raise(x):
            """Stub.

            Body raises.
            """
            raise NotImplementedError("later")


        def no_body():
            """Only a docstring.

            Nothing else.
            """


        def too_long():
            """Long.

            {filler}
            """
            return 1


        def bare(x, y):
            # a comment before the body
            return x * y


        def oneliner(x): return x


        class Public:
            """A class."""

            def __init__(self):
                """Dunder.

                Skipped.
                """
                self.x = 1

            def method(self, y):
                """Method doc.
            Less indented line.
                """
                def inner():
                    """Nested.

                    Not a method of a module-level class.
                    """
                    return 1
                return inner() + y

            async def amethod(self):
                """Async.

                Method.
                """
                await self.method(1)


        class _Hidden:
            def shown(self):
                """Of a private class.

                Skipped.
                """
                return 1
        ''').replace("{filler}", "x" * STDLIB_MAX_CHARS),
    "dup.py": 'def add(a, b):\n    """Add a and b.\n\n    Return the sum.\n    """\n    return a + b\n',
    "zz.py": 'def add(a, b):\n    """Add a and b.\n\n    Return the sum.\n    """\n    return a - b\n',  # dup prompt
    "bad.py": "def broken(:\n",
    "pkg/__init__.py": "",
    "pkg/sub.py": 'async def fetch(url):\n    """Fetch.\n\n    A url.\n    """\n    return url\n',
    "pkg/tests/test_sub.py": 'def check(x):\n    """Test.\n\n    Skipped.\n    """\n    return x\n',
    "encodings/__init__.py": 'def search(x):\n    """Codec.\n\n    Skipped.\n    """\n    return x\n',
    "test/__init__.py": 'def main(x):\n    """Tests.\n\n    Skipped.\n    """\n    return x\n',
    "notpkg/mod.py": 'def loose(x):\n    """Not in a package.\n\n    Skipped.\n    """\n    return x\n',
}


def test_stdlib_prompts_cut_signature_and_docstring_from_the_source(tmp_path):
    for rel, text in STDLIB_TREE.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "latin.py").write_bytes(
        b'# -*- coding: latin-1 -*-\ndef caf(x):\n    """Caf\xe9.\n\n    Two.\n    """\n    return x\n')
    (tmp_path / "undecodable.py").write_bytes(b'def f(x):\n    """\xff.\n\n    Two.\n    """\n    return x\n')
    codes = [_code(p) for p in stdlib_prompts(tmp_path)]
    assert codes == [
        'def add(a, b):\n    """Add a and b.\n\n    Return the sum.\n    """\n',  # dup.py; zz.py's copy dropped
        'def caf(x):\n    """Caf\u00e9.\n\n    Two.\n    """\n',  # latin.py, decoded by its coding cookie
        'def multi(a,\n          b=1):  # trailing comment\n    """Add.\n\n    Twice.\n    """\n',
        'def method(self, y):\n    """Method doc.\nLess indented line.\n    """\n',  # dedented by its def
        'async def amethod(self):\n    """Async.\n\n    Method.\n    """\n',
        'async def fetch(url):\n    """Fetch.\n\n    A url.\n    """\n',  # pkg/sub.py
    ]
    for code in codes:
        _check_stub(code)
    assert [_code(p) for p in stdlib_prompts(tmp_path)] == codes


def test_stdlib_pool_is_the_interpreters_functions_posed_like_humaneval():
    pool = named_pool("stdlib")
    assert len(pool) > (1000 if sys.version_info[:2] == (3, 11) else 0)
    codes = [_code(p) for p in pool]
    for code in codes:
        _check_stub(code)
    assert len(set(codes)) == len(codes)
    # a function, a method (dedented) and a multi-line async def, as their own source begins
    for fn in (base64.b85decode, json.JSONDecoder.decode, BaseEventLoop.create_server):
        source = textwrap.dedent(inspect.getsource(fn))
        assert any(source.startswith(c) and len(c) < len(source) for c in codes), fn
    assert list(pool) == stdlib_prompts(Path(sysconfig.get_paths()["stdlib"]))  # built again: the same
    train = training_pool("stdlib")
    assert all(split_of(p) == "train" for p in train) and 0.7 * len(pool) < len(train) < 0.9 * len(pool)


def test_stdlib_rest_prompts_are_the_functions_stdlib_leaves_out(tmp_path):
    for rel, text in STDLIB_TREE.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    codes = [_code(p) for p in stdlib_rest_prompts(tmp_path)]
    assert codes == [
        'def one_line(x):\n    """Only one line."""\n',  # a docstring of one line
        'def _private(x):\n    """Private.\n\n    Skipped.\n    """\n',  # a private name
        'def bare(x, y):\n',  # no docstring: the signature alone, the comment after it dropped
        'def __init__(self):\n    """Dunder.\n\n    Skipped.\n    """\n',  # a dunder method, dedented
        'def shown(self):\n    """Of a private class.\n\n    Skipped.\n    """\n',
    ]  # stubs, a one-line def, the nested def, the too long one and everything stdlib takes: left out
    for code in codes:
        fn = ast.parse(code + "    pass\n").body[0]
        assert isinstance(fn, ast.FunctionDef) and not fn.decorator_list and code.startswith("def ")
    assert not set(codes) & {_code(p) for p in stdlib_prompts(tmp_path)}


def test_stdlib_rest_pool_is_disjoint_from_stdlib_and_split():
    pool, stdlib = named_pool("stdlib-rest"), {_code(p) for p in named_pool("stdlib")}
    codes = {_code(p) for p in pool}
    assert len(pool) > (5000 if sys.version_info[:2] == (3, 11) else 0) and not stdlib & codes
    assert len(codes) == len(pool)
    train = training_pool("stdlib-rest")
    assert all(split_of(p) == "train" for p in train) and 0.7 * len(pool) < len(train) < 0.9 * len(pool)
    assert "stdlib-rest" in TRAINING_MIX
