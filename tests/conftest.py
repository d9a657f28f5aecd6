"""Suite-wide settings.

- The suite runs on every core, up to four (pytest-xdist, ``-n auto`` in pyproject.toml: workers
  take tests one by one, a module marked ``xdist_group`` stays on one worker); tests marked
  ``slow`` are handed out first, so that the workers finish together. ``-n 0`` runs it in one process.
- Tiny models run fastest (and least disturbed by a busy machine) on one thread.
- Without CUDA, Triton kernels run in Triton's interpreter (NumPy on the CPU), so the CPU suite
  checks the kernels' logic; on a GPU machine they compile for the device. Set before any test
  module imports the engine: ``triton.jit`` reads it when a kernel is defined.
"""

import os

import torch

torch.set_num_threads(1)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
MAX_WORKERS = 4  # each worker holds torch, Triton's interpreter and a model or two: ~1.5 GB


def pytest_xdist_auto_num_workers(config):
    """The CPUs this process may use (a container's share, not the host's), at most MAX_WORKERS."""
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    """Slow tests first (a stable sort: the rest keep their order), so that no worker starts a
    minute-long test when the others are done."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _lighter_interpreter() -> None:
    """Triton's interpreter (3.9) re-patches ``triton.language`` on every call of a ``@triton.jit``
    helper inside a kernel, walking the language's modules with ``inspect.getmembers`` each time: a
    quarter of an interpreted kernel's time here. Within one launch, the modules a function sees
    (``triton.language``, ``triton.language.core``) need patching once (the launch restores them
    when it ends); a helper that sees another module still gets its patches. Only the interpreter's
    bookkeeping changes; every kernel instruction runs as before."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang, scope_cls = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or scope_cls is None or executor is None:
        return  # another Triton: leave it alone
    launch = executor.__call__
    state: dict = {"launch": False, "seen": set()}

    def once_per_launch(fn):
        langs = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        if state["launch"] and langs in state["seen"]:
            return scope_cls()  # this launch patched these modules already: nothing to restore
        scope = patch_lang(fn)
        if state["launch"]:
            state["seen"].add(langs)
        return scope

    def launch_once_patched(self, *args, **kwargs):
        state["launch"], state["seen"] = True, set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            state["launch"], state["seen"] = False, set()

    interpreter._patch_lang = once_per_launch
    executor.__call__ = launch_once_patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _lighter_interpreter()
