"""Views that vmap had to copy, and the in-place writes that would expose the copy.

Note [view after moving the bdim]
``x.view(shape)`` is an alias in eager.  Under vmap its rule views the physical value, first
with the batch dim moved to the front, then (if that fails) by computing one example's view and
laying the batch over it (``as_strided`` with the batch stride), so the result is still an
alias whenever the per-example view exists.  When neither exists (the physical layout
interleaves the batch with the example's dims, e.g. ``in_dims=1`` or an op that kept such a
layout, while eager's per-example tensor would be contiguous), the rule must copy.  The values
are right, but a later in-place write through the copy would not reach its base (nor a write
into the base the copy): a silent wrong answer.  So every such copy is recorded here with its
base's storage, and an in-place write into either storage while the copy is alive raises an
error that says why and what to do.  Nothing is recorded in the common case, and the check
costs one ``if`` per in-place op then.
"""
from __future__ import annotations

import weakref
from typing import List, Tuple

import torch

from ..errors import UnsupportedUnderVmap

# (weakref to the copy's physical value, the copy's storage pointer, the base's storage pointer,
#  what the copy stands for)
_copies: List[Tuple[weakref.ref, int, int, str]] = []

VIEW = "view"      # Note [view after moving the bdim]
LAZY_BIT = "bit"   # Note [conjugate and negative bits] in rules/autograd_ops.py
NARROW = "narrow"  # narrow with a batched start: rules/slicing.py


def _storage_ptr(t: torch.Tensor) -> int:
    """The innermost storage's address; 0 for an empty storage (every empty storage has
    address 0, and a write into one changes nothing, so it is never recorded or checked)."""
    from .batched_tensor import BatchedTensor
    while type(t) is BatchedTensor:  # a wrapper of an outer level: its innermost memory
        t = t.value
    s = t.untyped_storage()
    return s.data_ptr() if s.nbytes() else 0


def record(copy: torch.Tensor, base: torch.Tensor, kind: str = VIEW) -> None:
    if not _storage_ptr(copy) or not _storage_ptr(base):
        return  # empty: nothing a write could miss (and address 0 would match any empty one)
    _prune()
    _copies.append((weakref.ref(copy), _storage_ptr(copy), _storage_ptr(base), kind))


def _prune() -> None:
    _copies[:] = [c for c in _copies if c[0]() is not None]


def check_write(op, target: torch.Tensor) -> None:
    """Raise if ``op`` writes in place into a copied view or its base while the copy lives."""
    if not _copies:
        return
    _prune()
    ptr = _storage_ptr(target)
    if not ptr:
        return
    for _, copy_ptr, base_ptr, kind in _copies:
        if ptr in (copy_ptr, base_ptr):
            raise UnsupportedUnderVmap(
                f"vmap: {op} writes in place into a tensor that shares memory with "
                + _WHY[kind])


# Why the copy exists and what to do instead, by the kind ``record`` was given.
_WHY = {
    VIEW: "the result of .view(), but under vmap that view had to be a copy: the tensor's "
          "batch dim is not its first dim (in_dims other than 0, or an op that kept such a "
          "layout), so its memory layout differs from eager's and the view could not alias it. "
          "The write would not reach the other tensor. Call .contiguous() before .view(), pass "
          "in_dims=0, or write out of place (torch.where, index_put without the trailing "
          "underscore).",
    LAZY_BIT: "the result of .conj() (or torch._neg_view). In eager that result is a lazy view "
              "with a conjugate (negative) bit; under vmap it is a materialised copy, because "
              "the bit cannot be carried on a batched tensor, so the write would not reach the "
              "other tensor. Write into the original tensor and take .conj() afterwards, or "
              "compute out of place (e.g. y = x.conj() * 2).",
    NARROW: "the result of torch.narrow with a batched (per-example) start. In eager that "
            "result is a view; under vmap every example starts at its own offset, so it is a "
            "copy, and the write would not reach the other tensor. Write into the original "
            "tensor out of place (e.g. with torch.where and a mask built from torch.arange), "
            "or narrow with an unbatched start.",
}
