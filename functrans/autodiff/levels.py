"""Autodiff's level bookkeeping: ``AutodiffLevel`` (a transform level that knows how many times
it differentiates the function's graph) and the ownership of PyTorch's process-wide forward-AD
level (``claim_forward_ad`` / ``release_forward_ad``, used by ``jvp``).

The shared stack, ``Level`` and ``forward_ad_state`` live in ``functrans/_levels.py`` (vmap and
functionalize use them too); this module records the owning thread there.

Imports: _levels (and torch).
"""
from __future__ import annotations

import threading

from .. import _levels


class AutodiffLevel(_levels.Level):
    """A grad/vjp/jacrev (``kind='grad'``) or forward-mode (``kind='jvp'``) level.

    ``order``: how many times the function's graph is differentiated at this level: 2 for the
    double-vjp route of a jvp (J^T u, then its derivative), else 1 (see ``exact_norms``).
    ``forward``: a forward-mode level computed in reverse mode (jvp's double-vjp route,
    linearize); ``entry_fwd`` and ``frozen`` are its records of forward-disabled regions
    (Note [forward-disabled regions on the double-vjp route] in ``forward_regions``)."""

    __slots__ = ("order", "forward", "entry_fwd", "frozen")

    def __init__(self, kind: str, order: int = 1, forward: bool = False):
        super().__init__(kind)
        self.order = order
        self.forward = forward
        self.entry_fwd = True
        self.frozen: frozenset = frozenset()


# One dual level at a time for the whole process: held by the jvp that opened it.
_forward_ad_lock = threading.Lock()


def claim_forward_ad() -> bool:
    """Take the right to open a dual level (False: another thread holds it)."""
    if not _forward_ad_lock.acquire(blocking=False):
        return False
    _levels.set_forward_ad_owner(threading.get_ident())
    return True


def release_forward_ad() -> None:
    _levels.set_forward_ad_owner(None)
    _forward_ad_lock.release()
