"""The vmap level's dispatch mode: where every ATen op under a vmap enters functrans.

Each batched call of ``vmap`` pushes a ``VmapLevelMode`` for its level (``api._run``).  A
``TorchDispatchMode`` sees every ATen op before any tensor subclass, so this is the entry of
every op under the vmap, in this order:

1. metadata queries forward AD issues around every view of a dual tensor (``is_same_size``,
   ``_has_same_storage_numel``) are answered from the wrappers' own metadata;
2. a random op that sees no batched argument of this level or an inner one (``torch.randn(3)``
   inside the function has no tensor argument, so no wrapper would ever see it) gets the
   level's randomness (``randomness.unbatched_random``); so does ``empty_like`` of an unbatched
   tensor under ``'different'`` (``randomness.batched_empty``);
3. an op on wrappers goes straight to ``dispatch.dispatch``: going back through
   ``func(*args)`` would cross the C++ dispatcher and Python a second time, which made every op
   under vmap about a third slower.  The dispatcher runs with this mode popped and the modes of
   outer levels active, so the ops a rule issues reach the outer levels' modes;
4. anything else runs as it is.

Imports: batched_tensor, dispatch, randomness, registry.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import registry
from .batched_tensor import BatchedTensor
from .dispatch import dispatch
from .randomness import batched_empty, draws_random, unbatched_random

_aten = torch.ops.aten
_ONLY_BATCHED = (BatchedTensor,)
_EFFICIENT_ZEROS = _aten._efficientzerotensor.default
_UNINITIALIZED = (_aten.empty_like.default, _aten.new_empty.default)
_entries = registry._entries   # the registry's cache, read directly on the hot path


def _same_size(a, b):
    return a.shape == b.shape  # the shapes the caller sees: logical at every level


def _same_storage_numel(a, b):
    if type(a) is BatchedTensor and type(b) is BatchedTensor and a.level is b.level:
        return None  # both batched at one level: the rule compares the physical storages
    return a.numel() == b.numel()


_IS_SAME_SIZE = _aten.is_same_size.default
_HAS_SAME_STORAGE_NUMEL = _aten._has_same_storage_numel.default
# A None answer means "ask the rule".
METADATA_QUERIES = {_IS_SAME_SIZE: _same_size, _HAS_SAME_STORAGE_NUMEL: _same_storage_numel}


def _batched_at(a, level) -> bool:
    """Does ``a`` carry a wrapper of ``level`` or of an inner level?  Such an op reaches this
    level through the dispatcher (an inner level's rule calls ops on this level's wrappers)."""
    if type(a) is BatchedTensor:
        return a.level.id >= level.id
    if type(a) in (list, tuple):
        return any(type(b) is BatchedTensor and b.level.id >= level.id for b in a)
    return False


class VmapLevelMode(TorchDispatchMode):
    """The dispatch mode of one vmap level (see the module docstring)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps __torch_dispatch__ in torch._disable_dynamo by default, which
        # costs microseconds on every op under vmap (and imports dynamo on the first call); this
        # mode is never traced.
        return False

    def __init__(self, level):
        super().__init__()
        self.level = level

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        entry = _entries.get(id(func)) or registry.entry(func)
        only_batched = types == _ONLY_BATCHED
        if only_batched and (func is _IS_SAME_SIZE or func is _HAS_SAME_STORAGE_NUMEL):
            answer = METADATA_QUERIES[func](*args)
            if answer is not None:
                return answer
        if entry.random and draws_random(func, args, kwargs) \
                and not any(_batched_at(a, self.level) for a in args) \
                and not any(_batched_at(a, self.level) for a in kwargs.values()):
            return unbatched_random(func, args, kwargs, self.level)
        if func in _UNINITIALIZED and self.level.randomness == "different" \
                and not _batched_at(args[0], self.level):
            return batched_empty(func, args, kwargs, self.level)
        if only_batched:
            return dispatch(func, args, kwargs, entry)
        if func is _EFFICIENT_ZEROS:
            # Forward AD makes the tangent of an input that has none (a closed-over tensor)
            # with _efficientzerotensor.  A storage-less ZeroTensor that reaches a Python mode
            # is passed on to kernels with no ZeroTensor handling (aten.mul.Scalar in
            # addcmul's formula): a segmentation fault in PyTorch.  Materialise it.
            return _aten.zeros.default(*args, **kwargs)
        return func(*args, **kwargs)
