"""Global switches, each also usable as a context manager.

* ``strict_fallback()``: the per-example loop fallback raises instead of running.  Rule tests
  run strict, so a passing test proves that a batching rule (or decomposition) ran.
* ``warn_on_fallback``: whether the fallback emits its once-per-op ``PerformanceWarning``.
"""
from __future__ import annotations

import contextlib
import threading

_state = threading.local()

warn_on_fallback = True


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
