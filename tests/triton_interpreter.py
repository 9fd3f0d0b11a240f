"""A shortcut in Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets without a GPU)
that leaves what the kernels compute as it is.

A launch (GridExecutor.__call__) maps triton.language's builtins to the interpreter's versions for
its duration (_patch_lang) and puts them back at its end. Each call of a device function (a
@triton.jit function called from a kernel: InterpretedFunction.__call__) calls _patch_lang again,
which walks every member of triton.language, triton.language.core and their tensor classes with
inspect.getmembers only to find them mapped already: the kernels' device functions (triton_sums.py,
triton_rules.py) are called thousands of times a step, and that walk is about half of the
interpreter's time in tests/test_triton_kernels.py and test_triton_engine.py. `install` skips a device function's re-mapping
when the running launch has already mapped the language modules its globals see; a module it has
not mapped is mapped as before. Nothing is changed outside the interpreter, nor where Triton's
interpreter lacks the functions it wraps (another Triton version runs as it is, only slower).
"""

from __future__ import annotations

import inspect
import threading


def install() -> bool:
    """Wrap the interpreter's _patch_lang and GridExecutor.__call__ (once); False where it cannot."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    executor = getattr(interpreter, "GridExecutor", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    empty_scope = getattr(interpreter, "_LangPatchScope", None)
    if executor is None or patch_lang is None or empty_scope is None:
        return False
    if getattr(patch_lang, "skips_repeats", False):
        return True
    run_launch = executor.__call__
    launch = threading.local()  # .mapped: ids of the language modules the running launch has mapped
    langs: dict[int, frozenset[int]] = {}  # the language modules each function's globals see

    def langs_of(fn) -> frozenset[int]:
        key = id(fn.__globals__)
        if key not in langs:
            langs[key] = frozenset(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)
            )
        return langs[key]

    def _patch_lang(fn):
        mapped = getattr(launch, "mapped", None)
        if mapped is None:  # outside a launch: as Triton does
            return patch_lang(fn)
        seen = langs_of(fn)
        if seen and seen <= mapped:
            return empty_scope()  # nothing to map, nothing to put back
        mapped.update(seen)
        return patch_lang(fn)

    def __call__(self, *args, **kwargs):
        outer = getattr(launch, "mapped", None)
        launch.mapped = set()
        try:
            return run_launch(self, *args, **kwargs)
        finally:
            launch.mapped = outer

    _patch_lang.skips_repeats = True
    interpreter._patch_lang = _patch_lang
    executor.__call__ = __call__
    return True
