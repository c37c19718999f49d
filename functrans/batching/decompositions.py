"""Ops without a batching rule may be run through a ``torch._decomp`` decomposition.

The decomposition runs on the wrappers themselves, so each of its ops re-dispatches into the
batching rules.  The table is loaded lazily (importing ``torch._decomp`` is slow).  Some
decompositions cannot run under vmap (they call ``.item()`` or write into a fresh unbatched
tensor).  A failure is local to its op: that op's decomposition is disabled, no other, and the
fallback's once-per-op warning says why (``failure(op)``).  A decomposition that raises
something else may have met an invalid input (eager raises too): it is disabled only once the
loop fallback succeeds on the same arguments (``confirming``), so a user's own shape error
disables nothing.  A decomposition can only ever make an op faster, never wrong or broken.

Imports: errors.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..errors import UnsupportedUnderVmap

_table: Optional[Dict[Any, Callable]] = None
_lock = threading.Lock()
_failed: Dict[Any, str] = {}   # op -> why its decomposition cannot run under vmap

# Decompositions known to be unsuitable under vmap (they are slower than the fallback, or
# their semantics differ from the eager kernel).  Add entries with a reason.
DENYLIST: Dict[str, str] = {
    "aten::slice.Tensor": "lowers to as_strided with an absolute storage offset; a rule slices",
}

# Only decompositions written in ATen ops.  The ``torch._refs`` entries lower to ``prims.*`` ops,
# which have neither batching rules nor autograd formulas (a backward through them fails).
_ATEN_LEVEL_MODULES = {"torch._decomp.decompositions"}


def _load() -> Dict[Any, Callable]:
    global _table
    if _table is None:
        with _lock:
            if _table is None:
                from torch._decomp import decomposition_table
                _table = {op: fn for op, fn in decomposition_table.items()
                          if isinstance(op, torch._ops.OpOverload)
                          and getattr(fn, "__module__", "") in _ATEN_LEVEL_MODULES
                          and op.name() not in DENYLIST}
    return _table


def has_decomposition(op) -> bool:
    """Whether a usable decomposition of ``op`` exists (and has not failed under vmap)."""
    return op not in _failed and op in _load()


def failure(op) -> str:
    """Why ``op``'s decomposition was disabled under vmap, or ''."""
    return _failed.get(op, "")


def _describe(error: BaseException) -> str:
    text = str(error).split("\n")[0]
    return f"{type(error).__name__}: {text[:200]}"


class Raised:
    """``run_decomposition``'s second value when the decomposition raised an error that may
    be the input's (see ``confirming``)."""
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def run_decomposition(op, args, kwargs) -> Tuple[bool, Any]:
    """(True, result) if a decomposition of ``op`` ran on the wrappers; else (False, None), or
    (False, Raised(error)) when it raised an error that may be the input's own."""
    if op in _failed:
        return False, None
    fn = _load().get(op)
    if fn is None:
        return False, None
    try:
        result = fn(*args, **kwargs)
    except UnsupportedUnderVmap as e:
        # It cannot run under vmap (e.g. .item() inside, or a write into a fresh unbatched
        # tensor): disabled for this op, so the fallback runs it per example from now on.
        _failed[op] = _describe(e)
        return False, None
    except Exception as e:
        # Anything else may be an error of these arguments (an invalid input: eager raises
        # too) or of the decomposition under vmap.  The fallback decides (``confirming``).
        return False, Raised(e)
    if result is NotImplemented:  # the decomposition declines these inputs (e.g. ceil_mode)
        return False, None
    return True, result


def confirming(op, fallback: Callable, error: BaseException) -> Callable:
    """``fallback``, which disables ``op``'s decomposition when it succeeds on the arguments
    the decomposition failed on (then the failure was the decomposition's, not the input's:
    an invalid input makes the fallback raise eager's own error, and nothing is disabled).
    The fallback is told why (``_undecomposed=``), for its warning."""
    why = _describe(error)

    def run(*args, **kwargs):
        out = fallback(*args, _undecomposed=why, **kwargs)
        _failed[op] = why
        return out
    return run
