"""numba's on-disk kernel cache, keyed by everything a kernel was compiled from.

numba keys a cached kernel by its own file's contents only (numba's docs, "Cache
invalidation"): a kernel that inlines or calls a kernel of another file, or reads a
constant imported from one, keeps its old machine code after that file changes. After a
`git pull` that touched only the callee, the caller would silently compute the old values.
`njit` here is `numba.njit(cache=True)` whose cache entry is also keyed, at decoration
time, by the kernels, the user modules and the constants its module's globals hold (their
files' contents, recursively, and the constants' values). Globals a module binds after the
kernel's decoration are not seen; the project's kernel modules import at the top.

Written here because numba offers no dependency tracking; it plugs into numba's own cache
locators (`numba.core.caching`), changing only the stamp they compare. A user's own
NUMBA_CACHE_LOCATOR_CLASSES replaces numba's locators and these with them.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
import types
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numba
import numpy as np
from numba.core import caching
from numba.core.dispatcher import Dispatcher

_DIGESTS: dict[Any, str] = {}  # py_func of a kernel decorated here -> its dependency digest
_SCALARS = (bool, int, float, complex, str, bytes, type(None))
_LIBRARY_ROOTS = tuple({Path(p).resolve() for p in (sys.prefix, sys.base_prefix)})


@cache
def _file_hash(path: str, mtime_ns: int, size: int) -> str:
    """sha256 of a source file (keyed by mtime and size, so an edit is re-read)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _source_hash(path: str) -> str:
    st = Path(path).stat()
    return _file_hash(path, st.st_mtime_ns, st.st_size)


def _user_module(value: types.ModuleType) -> str | None:
    """The file of a module outside the interpreter's and its environment's libraries."""
    file = getattr(value, "__file__", None)
    if file is None or not file.endswith(".py"):
        return None
    path = Path(file).resolve()
    return None if any(path.is_relative_to(r) for r in _LIBRARY_ROOTS) else str(path)


def _part(value: Any) -> str | None:
    """What of a global a kernel may have compiled in, or None for what it cannot read."""
    if isinstance(value, _SCALARS):
        return repr(value)
    if isinstance(value, np.generic):
        return f"{value.dtype.str}:{value!r}"
    if isinstance(value, np.ndarray):
        return f"{value.dtype.str}{value.shape}:{hashlib.sha256(value.tobytes()).hexdigest()}"
    if isinstance(value, tuple):
        parts = [_part(v) for v in value]
        return None if None in parts else "(" + ",".join(parts) + ")"  # type: ignore[arg-type]
    if isinstance(value, Dispatcher):
        func = value.py_func
        return _source_hash(inspect.getfile(func)) + _DIGESTS.get(func, "")
    if isinstance(value, types.ModuleType):
        kernels = sorted(_DIGESTS[v.py_func] for v in vars(value).values()
                         if isinstance(v, Dispatcher) and v.py_func in _DIGESTS)  # fmt: skip
        file = _user_module(value)
        if file is None and not kernels:
            return None
        return (_source_hash(file) if file else "") + "".join(kernels)
    return None


def dependency_digest(func: Callable[..., Any]) -> str:
    """A digest of what `func`'s module's globals give a kernel compiled from it: the
    kernels (their files and, for kernels decorated here, their own digests), the user
    modules (their files and their kernels' digests) and the constants (their values)."""
    h = hashlib.sha256()
    for name in sorted(func.__globals__):
        part = _part(func.__globals__[name])
        if part is not None:
            h.update(f"{name}={part};".encode())
    return h.hexdigest()


class _DependencyStamp:
    """A locator mixin: numba's source stamp (the kernel's own file) plus its dependencies."""

    _dependencies = ""

    @classmethod
    def from_function(cls, py_func, py_file):
        locator = super().from_function(py_func, py_file)  # type: ignore[misc]
        if locator is not None:
            locator._dependencies = _DIGESTS[py_func]
        return locator

    def get_source_stamp(self) -> tuple[Any, str]:
        return super().get_source_stamp(), self._dependencies  # type: ignore[misc]


class _UserProvidedLocator(_DependencyStamp, caching.UserProvidedCacheLocator):
    pass


class _InTreeLocator(_DependencyStamp, caching.InTreeCacheLocator):
    pass


class _UserWideLocator(_DependencyStamp, caching.UserWideCacheLocator):
    pass


class _CacheImpl(caching.CompileResultCacheImpl):
    # numba's order (NUMBA_CACHE_DIR first, then __pycache__, then the user's cache folder)
    _locator_classes = [_UserProvidedLocator, _InTreeLocator, _UserWideLocator]  # noqa: RUF012


class _FunctionCache(caching.FunctionCache):
    _impl_class = _CacheImpl


def njit(**options: Any) -> Callable[[Callable[..., Any]], Dispatcher]:
    """`numba.njit(**options, cache=True)`, its cache entry keyed by its dependencies too."""
    if "cache" in options:
        raise TypeError("specrank.runtime.jit.njit always caches; drop cache=")

    def decorate(func: Callable[..., Any]) -> Dispatcher:
        _DIGESTS[func] = dependency_digest(func)
        kernel = numba.njit(**options)(func)
        kernel._cache = _FunctionCache(func)  # what Dispatcher.enable_caching does
        return kernel

    return decorate
