"""Switches, each per thread and each also usable as a context manager.

* ``strict_fallback()``: the per-example loop fallback raises instead of running.  Rule tests
  run strict, so a passing test proves that a batching rule (or decomposition) ran.
* ``warn_on_fallback``: whether the fallback emits its once-per-op ``PerformanceWarning``
  (default True).  Read and set it as an attribute (``functrans.config.warn_on_fallback =
  False``), or for a block with ``fallback_warnings(False)``.

Both are thread-local: a setting made in one thread does not change another thread's (a new
thread starts with the defaults), so concurrent tests or servers cannot switch each other's
behaviour.  The attribute works through a property of this module's class (``_ConfigModule``).

Imports: nothing (the standard library only).
"""
from __future__ import annotations

import contextlib
import sys
import threading
import types
from typing import ContextManager, Iterator

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


class _ConfigModule(types.ModuleType):
    """This module's class: ``warn_on_fallback`` is a property over the thread-local state."""

    @property
    def warn_on_fallback(self) -> bool:
        return warns_on_fallback()

    @warn_on_fallback.setter
    def warn_on_fallback(self, value: bool) -> None:
        set_warn_on_fallback(value)


sys.modules[__name__].__class__ = _ConfigModule
