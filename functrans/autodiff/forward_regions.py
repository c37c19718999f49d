"""Regions where the user switched forward-mode AD off, for jvp's double-vjp route.

``torch.autograd.forward_ad._set_fwd_grad_enabled(False)`` makes what is computed inside a
constant for forward mode (PyTorch's own forward AD, and the reference library's jvp levels),
never for reverse mode.  jvp's double-vjp route is reverse mode (``J t = d/du <J^T u, t>``), so
on its own it would differentiate its level through such a region: ``jvp(jvp(f))`` of
``f(x) = x**2 - shift``, ``shift = x**2`` computed in a disabled region, gave 0 where the
reference gives 2.  This module makes those values constants for the double-vjp levels, and
only for them: an outer ``grad`` still differentiates through them, as in the reference.

Note [forward-disabled regions on the double-vjp route]
Each double-vjp level (``AutodiffLevel.forward``) records, when it is pushed, PyTorch's
forward-grad switch (``entry_fwd``) and which enclosing double-vjp levels are switched off for
everything run inside it (``frozen``).  The reference's rule, as it behaves: an op run with
forward mode off in the innermost jvp level's function is a constant for every jvp level (a
region deep inside three nested jvps is constant for all three); a jvp entered inside a region
switches forward mode on for its own level only, so the levels around it, off when it was
entered, stay off for everything inside it.  The double-vjp route leaves PyTorch's switch alone
(an outer dual level of PyTorch's must still see the user's setting), so a level entered with
the switch already off counts as on for its own function.  The ``TorchFunctionMode`` active at
graph order 2 and above (``exact_norms.ComposedKernelsMode``, always on during a double-vjp level)
asks ``cut_levels()`` after each torch call: for a non-empty answer, ``make_constant()``
registers a hook on each output (on the physical value under a vmap that runs inside the level)
that gives a zero gradient while one of those levels takes its own derivatives
(``deriving()``), and passes the gradient unchanged in every other backward pass.  An in-place
op's output is its input, partly computed outside the region, and keeps its gradient.

Imports: _levels, levels, batching.batched_tensor (to reach a wrapper's physical value).
"""
from __future__ import annotations

import contextlib
from typing import Any, FrozenSet, Iterator, List, Optional

import torch

from .. import _levels
from ..batching.batched_tensor import BatchedTensor
from .levels import AutodiffLevel

_fwd_enabled = torch._C._is_fwd_grad_enabled
# The double-vjp levels taking their own derivatives now (their autograd.grad calls).  Not
# thread-local: PyTorch runs the backward of CUDA tensors on its device threads.
_deriving: set = set()


def _forward_levels() -> List[AutodiffLevel]:
    """The double-vjp levels on this thread's stack, outermost first."""
    return [level for level in _levels.stack()
            if isinstance(level, AutodiffLevel) and level.forward]


def _switched_on(level: AutodiffLevel, now: bool) -> bool:
    """Whether ``level``'s own function has forward mode on, PyTorch's switch being ``now``
    (see the Note)."""
    return now or not level.entry_fwd


def enter_forward_level(level: AutodiffLevel) -> None:
    """Record on a double-vjp level, before it is pushed, what the Note says it records."""
    now = _fwd_enabled()
    enclosing = _forward_levels()
    frozen: FrozenSet[AutodiffLevel] = frozenset()
    if enclosing:
        frozen = enclosing[-1].frozen
        if not _switched_on(enclosing[-1], now):
            frozen = frozen | frozenset(enclosing)
    level.entry_fwd = now
    level.frozen = frozen


def cut_levels() -> FrozenSet[AutodiffLevel]:
    """The double-vjp levels for which what the current op computes is a constant (asked
    after every torch call in nested transforms: the common answer is quick)."""
    for top in reversed(_levels.stack()):
        if isinstance(top, AutodiffLevel) and top.forward:
            if _switched_on(top, _fwd_enabled()):
                return top.frozen
            return frozenset(_forward_levels())
    return frozenset()


@contextlib.contextmanager
def deriving(level: AutodiffLevel) -> Iterator[None]:
    """Around a double-vjp level's own autograd.grad calls."""
    _deriving.add(level)
    try:
        yield
    finally:
        _deriving.discard(level)


def make_constant(out: Any, args: Any, kwargs: Any, levels: FrozenSet[AutodiffLevel]) -> None:
    """Make the tensors in ``out`` (a torch call's result) constants for ``levels``."""
    inputs = {id(a) for a in _tensors((args, kwargs))}
    for t in _tensors(out):
        if id(t) in inputs:
            continue  # in place: see the Note
        while not t.requires_grad and isinstance(t, BatchedTensor):
            t = t.value
        if t.requires_grad:
            t.register_hook(_zero_while(levels))


def _zero_while(levels: FrozenSet[AutodiffLevel]):
    def hook(grad: torch.Tensor) -> Optional[torch.Tensor]:
        if _deriving and not _deriving.isdisjoint(levels):
            return torch.zeros_like(grad)
        return None
    return hook


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)
