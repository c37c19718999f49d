"""Randomness under vmap for random ops that see no batched argument of this level.

``torch.randn(3)`` inside a vmapped function has no tensor argument, so it never reaches
``BatchedTensor.__torch_dispatch__``.  While a vmap runs, a ``TorchDispatchMode`` of its level is
active; it looks only at ops tagged ``torch.Tag.nondeterministic_seeded`` whose arguments carry
nothing batched at its level, and applies the level's randomness:

* ``'error'``: raise, as PyTorch's own vmap does;
* ``'same'``: run the op once; every example sees the same values (an unbatched result);
* ``'different'``: give each example its own draw: factories with a ``size`` get the batch
  size prepended; ops with tensor inputs run on inputs expanded along a new batch dim; anything
  else is drawn once per example and stacked.  In-place random fills of an unbatched tensor
  raise, since each example would need its own copy; so that dropout of an unbatched input
  (``empty_like(x).bernoulli_(1 - p)`` in ATen) works, ``empty_like``/``new_empty`` of an
  unbatched tensor give a batched one under 'different' (uninitialised values either way).

Random ops on batched tensors are handled by the rules in ``rules/random.py``.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import UnsupportedUnderVmap
from .batched_tensor import BatchedTensor
from .dispatch import _op_meta, dispatch, op_meta

_is_random: Dict[object, bool] = {}
# Random ops that lack the nondeterministic_seeded tag.
_UNTAGGED_RANDOM = {"random_", "random"}


def is_random_op(op) -> bool:
    r = _is_random.get(op)
    if r is None:
        r = _is_random[op] = (torch.Tag.nondeterministic_seeded in op.tags
                              or op.overloadpacket.__name__ in _UNTAGGED_RANDOM)
    return r


def _arg(op, args, kwargs, name, default):
    for i, a in enumerate(op._schema.arguments):
        if a.name == name:
            if i < len(args) and not a.kwarg_only:
                return args[i]
            return kwargs.get(name, default)
    return default


def draws_random(op, args, kwargs) -> bool:
    """Whether this call of a random op actually draws: attention and dropout with
    ``dropout_p == 0`` or ``train=False`` are deterministic."""
    if not is_random_op(op):
        return False
    names = {a.name for a in op._schema.arguments}
    if "dropout_p" in names:
        return _arg(op, args, kwargs, "dropout_p", 0.0) > 0
    if op.overloadpacket.__name__ == "native_dropout":
        return bool(_arg(op, args, kwargs, "train", True)) and _arg(op, args, kwargs, "p", 0) > 0
    if "training" in names:
        return bool(_arg(op, args, kwargs, "training", False))
    return True


def random_error(op) -> UnsupportedUnderVmap:
    return UnsupportedUnderVmap(
        f"vmap: called the random operation {op} while randomness='error' (the default). "
        "vmap cannot know whether each example should get its own random values. Pass "
        "randomness='different' (independent values per example, e.g. for dropout in "
        "per-sample training) or randomness='same' (one draw shared by the whole batch) to vmap.")


def _batched_at(a, level) -> bool:
    """Does ``a`` carry a wrapper of ``level`` or of an inner level?  Such an op reaches this
    level through the dispatcher (an inner level's rule calls ops on this level's wrappers)."""
    if type(a) is BatchedTensor:
        return a.level.id >= level.id
    if type(a) in (list, tuple):
        return any(type(b) is BatchedTensor and b.level.id >= level.id for b in a)
    return False


class VmapRandomMode(TorchDispatchMode):
    """Pushed by each vmap call.  Because a mode sees every op before any tensor subclass, it
    also forwards the ops on BatchedTensors straight to the dispatcher: going back through
    ``func(*args)`` would cross the C++ dispatcher and Python a second time, which made every op
    under vmap about a third slower.  The dispatcher then runs with this mode popped and the
    modes of outer levels active, so the ops a rule issues reach the outer levels' modes."""

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
        meta = _op_meta.get(id(func)) or op_meta(func)
        if meta.query is not None and types == _ONLY_BATCHED:
            answer = meta.query(*args)
            if answer is not None:
                return answer
        if meta.random and draws_random(func, args, kwargs) \
                and not any(_batched_at(a, self.level) for a in args) \
                and not any(_batched_at(a, self.level) for a in kwargs.values()):
            return unbatched_random(func, args, kwargs, self.level)
        if meta.uninitialized and self.level.randomness == "different" \
                and not _batched_at(args[0], self.level):
            return batched_empty(func, args, kwargs, self.level)
        if types == _ONLY_BATCHED:
            return dispatch(func, args, kwargs, meta)
        if func is _EFFICIENT_ZEROS:
            # Forward AD makes the tangent of an input that has none (a closed-over tensor)
            # with _efficientzerotensor.  A storage-less ZeroTensor that reaches a Python mode
            # is passed on to kernels with no ZeroTensor handling (aten.mul.Scalar in
            # addcmul's formula): a segmentation fault in PyTorch.  Materialise it.
            return _aten.zeros.default(*args, **kwargs)
        return func(*args, **kwargs)


_ONLY_BATCHED = (BatchedTensor,)
_EFFICIENT_ZEROS = torch.ops.aten._efficientzerotensor.default


def batched_empty(op, args, kwargs, level):
    """``empty_like(x)`` / ``x.new_empty(size)`` of an unbatched ``x`` under 'different': a
    batched tensor (its values are arbitrary either way), so that a random fill that follows,
    as in dropout's ``empty_like(x).bernoulli_(1 - p)``, can draw per example."""
    size = level.batch_size
    if op is _aten.empty_like.default:
        value = op(args[0].expand(size, *args[0].shape), *args[1:], **kwargs)
    else:
        value = op(args[0], [size, *args[1]], *args[2:], **kwargs)
    return BatchedTensor(value, 0, level)


def unbatched_random(op, args, kwargs, level):
    mode = level.randomness
    if mode == "error":
        raise random_error(op)
    if mode == "same":
        return op(*args, **kwargs)
    schema = op._schema
    for a in schema.arguments:
        if a.alias_info is not None and a.alias_info.is_write:
            raise UnsupportedUnderVmap(
                f"vmap: {op} fills a tensor that is not batched with random values in place, "
                "but randomness='different' asks for different values per example. Create the "
                "tensor from a batched input (e.g. torch.empty_like(x).uniform_()) or draw "
                "out-of-place with the batch in mind (torch.rand_like(x)).")
    size = level.batch_size
    names = [a.name for a in schema.arguments]
    if "size" in names:
        i = names.index("size")
        args = list(args)
        if i < len(args):
            args[i] = [size, *args[i]]
        else:
            kwargs = dict(kwargs, size=[size, *kwargs["size"]])
        return BatchedTensor(op(*args, **kwargs), 0, level)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if tensors and op.overloadpacket not in _LOOP_ONLY:
        shape = torch.broadcast_shapes(*[t.shape for t in tensors])
        new_args = [a.expand(size, *shape) if isinstance(a, torch.Tensor) else a for a in args]
        out = op(*new_args, **kwargs)
        if isinstance(out, tuple):
            return tuple(BatchedTensor(o, 0, level) for o in out)
        return BatchedTensor(out, 0, level)
    outs = [op(*args, **kwargs) for _ in range(size)]
    if isinstance(outs[0], tuple):
        return tuple(BatchedTensor(torch.stack(o), 0, level) for o in zip(*outs))
    return BatchedTensor(torch.stack(outs), 0, level)


_aten = torch.ops.aten
# Random ops that are not elementwise in their tensor inputs: draw per example instead.
_LOOP_ONLY = {_aten.multinomial, _aten.randperm, _aten.rrelu_with_noise}

