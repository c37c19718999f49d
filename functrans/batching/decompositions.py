"""Ops without a batching rule may be run through a ``torch._decomp`` decomposition.

The decomposition runs on the wrappers themselves, so each of its ops re-dispatches into the
batching rules.  The table is loaded lazily (importing ``torch._decomp`` is slow).  Some
decompositions cannot run under vmap (they call ``.item()`` or write into a fresh unbatched
tensor): when one raises, the op is remembered and sent to the loop fallback from then on, so a
decomposition can only ever make an op faster, never wrong or broken.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Optional, Set, Tuple

import torch

from ..errors import UnsupportedUnderVmap

_table: Optional[Dict[Any, Callable]] = None
_lock = threading.Lock()
_failed: Set[Any] = set()

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


def run_decomposition(op, args, kwargs) -> Tuple[bool, Any]:
    """(True, result) if a decomposition of ``op`` ran on the wrappers, else (False, None)."""
    if op in _failed:
        return False, None
    fn = _load().get(op)
    if fn is None:
        return False, None
    try:
        result = fn(*args, **kwargs)
    except UnsupportedUnderVmap:
        # It cannot run under vmap (e.g. .item() inside, or a write into a fresh unbatched
        # tensor): remembered, so the fallback runs the op per example from now on.
        _failed.add(op)
        return False, None
    except Exception:
        # Anything else may be an error of these arguments (an invalid input: eager raises
        # too) or of the decomposition under vmap.  The fallback decides: it re-raises an
        # invalid input's error with the eager kernel's own message (the next valid call still
        # gets the decomposition), and when it succeeds the decomposition is remembered as
        # unusable (see ``confirming``).
        return False, RAISED
    if result is NotImplemented:  # the decomposition declines these inputs (e.g. ceil_mode)
        return False, None
    return True, result


RAISED = object()   # run_decomposition's second value when the decomposition raised


def confirming(op, fallback: Callable) -> Callable:
    """``fallback``, which also remembers ``op``'s decomposition as unusable under vmap once
    the fallback succeeds on the arguments the decomposition failed on."""
    def run(*args, **kwargs):
        out = fallback(*args, **kwargs)
        _failed.add(op)
        return out
    return run
