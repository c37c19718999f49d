"""Switches, each per thread and each also usable as a context manager.

* ``strict_fallback()``: the per-example loop fallback raises instead of running.  Rule tests
  run strict, so a passing test proves that a batching rule (or decomposition) ran.
* ``warn_on_fallback``: whether the fallback emits its once-per-op ``PerformanceWarning``
  (default True).  Read and set it as an attribute (``functrans.config.warn_on_fallback =
  False``), or for a block with ``fallback_warnings(False)``.

* ``max_memory(limit)``: the memory budget that ``chunk_size="auto"`` (vmap, jacrev, jacfwd,
  hessian) fits a chunk into, for a block.  Outside blocks, the process-wide attribute
  ``functrans.config.memory_limit`` holds it: ``None`` (the default: ``memory_fraction``, 0.5,
  of the free memory of the device the inputs live on, read at each call), a number of bytes,
  or a float in (0, 1], a fraction of that free memory.

The two fallback switches are thread-local: a setting made in one thread does not change another
thread's (a new thread starts with the defaults), so concurrent tests or servers cannot switch
each other's behaviour.  ``memory_limit`` is one process-wide value (a budget belongs to the
process); ``max_memory()`` overrides it in its own thread for its block.  The attributes work
through properties of this module's class (``_ConfigModule``).

Imports: errors (the standard library otherwise).
"""
from __future__ import annotations

import contextlib
import sys
import threading
import types
from typing import Any, ContextManager, Iterator, Union, cast

from .errors import TransformArgumentError

_state = threading.local()


class _Switch:
    """One per-thread boolean: read, set, and set for a block."""

    def __init__(self, name: str, default: bool):
        self.name, self.default = name, default

    def get(self) -> bool:
        return getattr(_state, self.name, self.default)

    def set(self, value: bool) -> None:
        setattr(_state, self.name, bool(value))

    @contextlib.contextmanager
    def within(self, enabled: bool) -> Iterator[None]:
        old = self.get()
        self.set(enabled)
        try:
            yield
        finally:
            self.set(old)


_strict = _Switch("strict", False)
_warn = _Switch("warn_on_fallback", True)
is_strict, set_strict = _strict.get, _strict.set
warns_on_fallback, set_warn_on_fallback = _warn.get, _warn.set


def strict_fallback(enabled: bool = True) -> ContextManager[None]:
    """Within the block (in this thread), an op with no batching rule raises
    ``UnsupportedUnderVmap`` instead of running on the per-example loop fallback.

    Args:
        enabled: ``True`` raises; ``False`` restores the fallback for the block.

    Returns:
        A context manager; the previous setting is restored on exit.

    Example:
        >>> import torch, functrans
        >>> f = functrans.vmap(lambda r: torch.ops.aten._add_relu(r, r))   # no batching rule
        >>> with functrans.config.strict_fallback():
        ...     f(torch.ones(2, 3))
        Traceback (most recent call last):
        ...
        functrans.errors.UnsupportedUnderVmap: vmap: there is no batching rule for ...
    """
    return _strict.within(enabled)


def fallback_warnings(enabled: bool = True) -> ContextManager[None]:
    """Within the block (in this thread), the loop fallback's once-per-op
    ``PerformanceWarning`` is emitted (``enabled``) or not.  The thread's setting outside
    blocks is the attribute ``functrans.config.warn_on_fallback`` (default True).

    Args:
        enabled: whether the fallback warns inside the block.

    Returns:
        A context manager; the previous setting is restored on exit.

    Example:
        >>> import torch, functrans
        >>> with functrans.config.fallback_warnings(False):
        ...     y = functrans.vmap(lambda r: torch.ops.aten._add_relu(r, r))(torch.ones(2, 3))
        >>> y.shape, functrans.config.warn_on_fallback
        (torch.Size([2, 3]), True)
    """
    return _warn.within(enabled)


# The memory budget of chunk_size="auto": bytes (int), a fraction of the free memory (float in
# (0, 1]) or None (memory_fraction of it).  Process-wide; max_memory() overrides it per thread.
_memory_limit: Union[int, float, None] = None
_UNSET = object()
memory_fraction = 0.5


def _check_limit(limit: Any, name: str) -> Union[int, float, None]:
    if limit is None or (isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1):
        return limit
    if isinstance(limit, float) and 0.0 < limit <= 1.0:
        return limit
    raise TransformArgumentError(
        f"{name}: the memory limit must be None (the default: {memory_fraction:g} of the free "
        "memory of the inputs' device), a positive int (bytes, e.g. 512 * 2**20) or a float in "
        f"(0, 1] (a fraction of the free memory); got {limit!r} ({type(limit).__name__}).")


def memory_limit_setting() -> Union[int, float, None]:
    """The limit in effect in this thread: a ``max_memory()`` block's, else ``memory_limit``."""
    block: Any = getattr(_state, "max_memory", _UNSET)
    return _memory_limit if block is _UNSET else cast(Union[int, float, None], block)


@contextlib.contextmanager
def _max_memory_block(limit: Union[int, float, None]) -> Iterator[None]:
    old = getattr(_state, "max_memory", _UNSET)
    _state.max_memory = limit
    try:
        yield
    finally:
        if old is _UNSET:
            del _state.max_memory
        else:
            _state.max_memory = old


def max_memory(limit: Union[int, float, None]) -> ContextManager[None]:
    """Within the block (in this thread), ``chunk_size="auto"`` fits its chunk into ``limit``.

    Args:
        limit: bytes (a positive int), a fraction of the free memory of the inputs' device (a
            float in (0, 1]), or ``None`` for the default (``memory_fraction`` of it).

    Returns:
        A context manager; the previous setting is restored on exit, also on an exception.

    Raises:
        TransformArgumentError: any other ``limit``.

    Example:
        >>> import torch, functrans
        >>> with functrans.config.max_memory(512 * 2**20):
        ...     functrans.config.memory_limit_setting()
        536870912
        >>> functrans.config.memory_limit_setting() is None
        True
    """
    return _max_memory_block(_check_limit(limit, f"functrans.config.max_memory({limit!r})"))


class _ConfigModule(types.ModuleType):
    """This module's class: ``warn_on_fallback`` is a property over the thread-local state,
    ``memory_limit`` one over the process-wide budget (checked when set)."""

    @property
    def memory_limit(self) -> Union[int, float, None]:
        return _memory_limit

    @memory_limit.setter
    def memory_limit(self, value: Union[int, float, None]) -> None:
        global _memory_limit
        _memory_limit = _check_limit(value, "functrans.config.memory_limit")

    @property
    def warn_on_fallback(self) -> bool:
        return warns_on_fallback()

    @warn_on_fallback.setter
    def warn_on_fallback(self, value: bool) -> None:
        set_warn_on_fallback(value)


sys.modules[__name__].__class__ = _ConfigModule
