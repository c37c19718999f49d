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

_state = threading.local()


def is_strict() -> bool:
    return getattr(_state, "strict", False)


def set_strict(value: bool) -> None:
    _state.strict = bool(value)


@contextlib.contextmanager
def strict_fallback(enabled: bool = True):
    """Within the block, hitting the loop fallback raises ``UnsupportedUnderVmap``."""
    old = is_strict()
    set_strict(enabled)
    try:
        yield
    finally:
        set_strict(old)


def warns_on_fallback() -> bool:
    return getattr(_state, "warn_on_fallback", True)


def set_warn_on_fallback(value: bool) -> None:
    _state.warn_on_fallback = bool(value)


@contextlib.contextmanager
def fallback_warnings(enabled: bool = True):
    """Within the block (in this thread), the loop fallback warns (``enabled``) or not."""
    old = warns_on_fallback()
    set_warn_on_fallback(enabled)
    try:
        yield
    finally:
        set_warn_on_fallback(old)


class _ConfigModule(types.ModuleType):
    """This module's class: ``warn_on_fallback`` is a property over the thread-local state."""

    @property
    def warn_on_fallback(self) -> bool:
        return warns_on_fallback()

    @warn_on_fallback.setter
    def warn_on_fallback(self, value: bool) -> None:
        set_warn_on_fallback(value)


sys.modules[__name__].__class__ = _ConfigModule
