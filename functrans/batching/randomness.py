"""Randomness policy under vmap: which ops draw, and what a draw means per example.

A vmap's ``randomness`` argument decides what a random op means for the examples of a batch:

* ``'error'``: raise, as PyTorch's own vmap does;
* ``'same'``: run the op once; every example sees the same values (an unbatched result);
* ``'different'``: give each example its own draw: factories with a ``size`` get the batch
  size prepended; ops with tensor inputs run on inputs expanded along a new batch dim; anything
  else is drawn once per example and stacked.  In-place random fills of an unbatched tensor
  raise, since each example would need its own copy; so that dropout of an unbatched input
  (``empty_like(x).bernoulli_(1 - p)`` in ATen) works, ``empty_like``/``new_empty`` of an
  unbatched tensor give a batched one under 'different' (uninitialised values either way).

This module is policy only: the level's dispatch mode (``mode.py``) calls ``unbatched_random``
and ``batched_empty`` for random ops that see no batched argument of its level (``torch.randn(3)``
inside a vmapped function has no tensor argument, so no wrapper would ever see it); the guards
(``guards.py``) call ``draws_random`` / ``random_error`` for random ops on batched tensors, whose
rules are in ``rules/random.py``.

Imports: errors, batched_tensor, op_schema.  Never the dispatcher.
"""
from __future__ import annotations

from typing import Dict

import torch

from ..errors import UnsupportedUnderVmap
from .batched_tensor import BatchedTensor
from .op_schema import written_arguments

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
    if "dropout_state" in names:
        # _cudnn_rnn: tagged random for its dropout state, which it reads only for dropout
        # between layers in training.  nn.LSTM/nn.GRU under vmap do not reach it (Note [RNN
        # initial state] in above_dispatch.py); a direct call with dropout=0 is not a draw.
        return bool(_arg(op, args, kwargs, "train", True)) \
            and _arg(op, args, kwargs, "dropout", 0.0) > 0
    return True


def random_error(op) -> UnsupportedUnderVmap:
    what = ""
    schema = getattr(op, "_schema", None)
    if schema is not None and any(a.name == "dropout_state" for a in schema.arguments):
        what = " (cuDNN's RNN kernel: it draws a dropout mask between layers, dropout > 0 in " \
               "training mode)"
    return UnsupportedUnderVmap(
        f"vmap: called the random operation {op}{what} while randomness='error' (the default). "
        "vmap cannot know whether each example should get its own random values. Pass "
        "randomness='different' (independent values per example, e.g. for dropout in "
        "per-sample training) or randomness='same' (one draw shared by the whole batch) to vmap.")


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
    if any(written_arguments(op)):
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

