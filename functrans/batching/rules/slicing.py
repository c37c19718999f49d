"""Slicing with per-example tensor arguments: ``narrow`` with a batched 0-d ``start`` and
``tensor_split`` with batched split points.

Both ops are CompositeImplicitAutograd: ATen turns the tensor argument into a Python integer
(``start.item()``, or a raw read of the index tensor's data) before anything reaches
``__torch_dispatch__``, so no batching rule can see them.  A logically 0-d integer
BatchedTensor answers ``__torch_function__`` (see ``batched_tensor.py``), and sends these two
calls here first (a 1-D tensor of split points has no such hook, which would slow every op on
batched integer vectors: ATen's raw read of its memory fails, and ``vmap`` turns that failure
into a clear error, see ``api._raw_data_error``):

* ``torch.narrow(x, dim, start, length)`` with a batched 0-d ``start``: every example keeps
  ``length`` elements, so the result has one shape; it is ``index_select`` of
  ``start + arange(length)`` (after wrapping a negative start), batched by the indexing rules.
  Each example starts at its own offset, so the result cannot be a view of ``x``: it is a copy,
  recorded in ``copied_views`` so that an in-place write into it (or into ``x``) while it lives
  raises instead of silently not reaching the other tensor.  Out-of-range starts raise eager's
  error (checked once on all the examples' starts).
* ``torch.tensor_split(x, sections)`` with a batched 0-d ``sections``: the pieces' shapes
  depend on each example's values, so they cannot be stacked: a clear error says so and what to
  do (an unbatched tensor or a Python list of split points batches fine).
"""
from __future__ import annotations

import torch

from ...errors import UnsupportedUnderVmap
from .. import copied_views
from ..helpers import normalize_dim

_NARROW = (torch.narrow, torch.Tensor.narrow)
_TENSOR_SPLIT = (torch.tensor_split, torch.Tensor.tensor_split)
_INT_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


def _is_batched(t) -> bool:
    from ..batched_tensor import BatchedTensor
    return type(t) is BatchedTensor


def _innermost(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under every level of wrappers: all the examples' values at once."""
    while _is_batched(t):
        t = t.value
    return t


def _bind(params, args, kwargs):
    """The call's arguments by name (positional first, then keywords), or None if the call's
    shape is not one we know (then the default path runs and reports its own error)."""
    bound = dict(zip(params, args))
    for k, v in kwargs.items():
        if k in bound or k not in params:
            return None
        bound[k] = v
    return bound


def handle(func, args, kwargs):
    """Called from a logically 0-d / 1-D integer wrapper's ``__torch_function__``; returns
    NotImplemented for every call that is not one of ours."""
    if func in _NARROW:
        b = _bind(("input", "dim", "start", "length"), args, kwargs)
        if b is not None and len(b) == 4 and _is_batched(b["start"]) and \
                b["start"].dim() == 0 and b["start"].dtype in _INT_DTYPES:
            return narrow_with_batched_start(b["input"], b["dim"], b["start"], b["length"])
    elif func in _TENSOR_SPLIT:
        b = _bind(("input", "indices_or_sections", "dim"), args, kwargs)
        if b is None:
            b = _bind(("input", "tensor_indices_or_sections", "dim"), args, kwargs)
        if b is not None:
            split = b.get("indices_or_sections", b.get("tensor_indices_or_sections"))
            if _is_batched(split):
                raise _tensor_split_error(split)
    return NotImplemented


def narrow_with_batched_start(x: torch.Tensor, dim: int, start: torch.Tensor,
                              length: int) -> torch.Tensor:
    if x.dim() == 0:
        raise RuntimeError("narrow() cannot be applied to a 0-dim tensor.")
    d = normalize_dim(dim, x.dim())
    size = x.shape[d]
    length = int(length)
    if length < 0:
        raise RuntimeError("narrow(): length must be non-negative.")
    # One check over every example's start (eager reads start.item() too: a host sync).
    starts = _innermost(start)
    bad = (starts < -size) | (starts > size) | (torch.where(starts < 0, starts + size, starts)
                                                 + length > size)
    if bool(bad.any()):
        raise IndexError(
            f"narrow(): for some example of the vmapped start tensor, start (in "
            f"[{int(starts.min())}, {int(starts.max())}] over the batch) + length ({length}) "
            f"exceeds dimension size ({size}), or start is out of range [{-size}, {size}].")
    begin = torch.where(start < 0, start + size, start).to(torch.long)
    index = begin.unsqueeze(0) + torch.arange(length, device=x.device)
    out = torch.index_select(x, d, index)
    copied_views.record(out, x, copied_views.NARROW)
    return out


def _tensor_split_error(split: torch.Tensor) -> UnsupportedUnderVmap:
    what = "number of sections" if split.dim() == 0 else "split indices"
    return UnsupportedUnderVmap(
        f"vmap: torch.tensor_split was given its {what} as a tensor that is batched (it "
        "differs per example), so the pieces' shapes would differ per example and could not "
        "be stacked into batched tensors. Pass the split points as a Python list/int or as a "
        "tensor that is not mapped over (in_dims=None for it, or created inside the "
        "function), or use a fixed-shape formulation (e.g. masks built with torch.arange).")
