"""The thread-local stack of active transforms.

A level is a small record: its id (ids grow, so an inner transform always has the larger id),
its kind, and for vmap its batch size and randomness mode.  ``pushed(level)`` pushes it and
pops it in ``finally``; a popped level is marked dead so a ``BatchedTensor`` that escaped its
``vmap`` is recognised instead of silently computing garbage.

The dispatcher does not need the stack to batch an op: every ``BatchedTensor`` carries its
level.  The stack tells transforms what surrounds them (does an outer transform need a graph?
is a vmap active for a tensor-less random op?) and lets tests check that nothing leaked.

What this module owns: what vmap, functionalize and autodiff all use: the stack, ``Level``,
``VmapLevel``, ``pushed``, ``forward_ad_state``, ``compiling`` (is torch.compile tracing?) and
``compile_trace`` (the mark of a ``functrans.compile`` trace).  Autodiff's own bookkeeping (its
levels' differentiation order, the ownership of the process-wide forward-AD level) lives in
``functrans/autodiff/levels.py``, which records the owner here (``set_forward_ad_owner``).

Imports: nothing (torch only; never functrans.autodiff or functrans.batching).
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Iterator, List

import torch
import torch._guards
import torch.autograd.forward_ad as fwAD

_ids = itertools.count(1)
_tls = threading.local()


class Level:
    __slots__ = ("id", "kind", "alive", "compiling")
    # kinds: "vmap" (VmapLevel), "grad" (grad/vjp/jacrev), "jvp" (forward mode): the last two
    # are autodiff.levels.AutodiffLevel; "functionalize" only takes an id (never pushed).
    # compiling: made while torch.compile traced (the transform runs inside a compiled
    # region), as opposed to a transform running eagerly around a torch.compile'd call.

    def __init__(self, kind: str):
        self.id = next(_ids)
        self.kind = kind
        self.alive = True
        self.compiling = compiling()

    def __repr__(self) -> str:
        state = "" if self.alive else ", dead"
        return f"{type(self).__name__}(id={self.id}{state})"


class VmapLevel(Level):
    """A vmap level.  Rules receive it as ``info``: ``info.batch_size``, ``info.randomness``."""

    __slots__ = ("batch_size", "randomness")

    def __init__(self, batch_size: int, randomness: str):
        super().__init__("vmap")
        self.batch_size = batch_size
        self.randomness = randomness

    def __repr__(self) -> str:
        state = "" if self.alive else ", dead"
        return (f"VmapLevel(id={self.id}, batch_size={self.batch_size}, "
                f"randomness={self.randomness!r}{state})")


def compiling() -> bool:
    """Is torch.compile tracing (dynamo, or AOTAutograd behind it)?  ``is_compiling()`` alone
    is False during dynamo's fake-tensor runs of a higher-order operator on torch 2.11; the
    tracing context is set then (not the one ``functrans.compile``'s own real-mode trace sets for
    its shape metadata, marked ``functrans_metadata_only``)."""
    if torch.compiler.is_compiling():
        return True
    context = torch._guards.TracingContext.try_get()
    return context is not None and not getattr(context, "functrans_metadata_only", False)


def compile_trace() -> contextlib.AbstractContextManager:
    """Marks the thread while ``functrans.compile`` traces a function (``compiler/tracer.py``):
    the engine then runs torch's control-flow operators as Python control flow, so that the
    trace records them as it records functrans's transforms."""
    return _counted("compile_traces")


def in_compile_trace() -> bool:
    return getattr(_tls, "compile_traces", 0) > 0


@contextlib.contextmanager
def _counted(name: str) -> Iterator[None]:
    setattr(_tls, name, getattr(_tls, name, 0) + 1)
    try:
        yield
    finally:
        setattr(_tls, name, getattr(_tls, name) - 1)


def stack() -> List[Level]:
    s = getattr(_tls, "stack", None)
    if s is None:
        s = _tls.stack = []
    return s


@contextlib.contextmanager
def pushed(level: Level) -> Iterator[Level]:
    s = stack()
    s.append(level)
    try:
        yield level
    finally:
        popped = s.pop()
        popped.alive = False
        if popped is not level:  # pragma: no cover - would be a functrans bug
            s.clear()
            raise AssertionError(f"functrans level stack corrupted: popped {popped}, "
                                 f"expected {level}")


# Forward-mode AD levels are process-global in PyTorch (one dual level at a time, for every
# thread), unlike the transform stack above.  functrans.jvp claims the right to open one
# (autodiff/levels.py: claim_forward_ad) and records its thread here, so that other threads know
# the open level is not theirs: their vmaps run normally and their jvps take the double-vjp route
# instead of opening a second level.
_forward_ad_owner: "int | None" = None


def set_forward_ad_owner(thread_ident: "int | None") -> None:
    """Record which thread's functrans.jvp holds the dual level (None: none does).  Called
    only by ``functrans.autodiff.levels``, which owns the lock around it."""
    global _forward_ad_owner
    _forward_ad_owner = thread_ident


def forward_ad_state() -> str:
    """'none' (no dual level is open), 'mine' (functrans opened it in this thread), 'other'
    (functrans opened it in another thread) or 'user' (someone's own ``dual_level()``)."""
    if getattr(fwAD, "_current_level", -1) < 0:
        return "none"
    owner = _forward_ad_owner
    if owner is None:
        return "user"
    return "mine" if owner == threading.get_ident() else "other"
