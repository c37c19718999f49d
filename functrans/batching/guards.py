"""Every refusal made before a rule runs, and the bookkeeping of views vmap had to copy.

The dispatcher (``dispatch.py``) calls these once per op, before the rule, decomposition or
fallback runs, so that no rule ever has to think about them:

* ``check_alive``: a wrapper whose vmap already returned (an escaped BatchedTensor) is refused,
  except while the autograd engine runs a backward pass recorded inside that vmap;
* ``check_writes``: an in-place op that would write a batched value into an unbatched tensor
  (each example would need its own copy of it), and an in-place write into a view that vmap
  had to copy, or into its base, while the copy lives (Note [view after moving the bdim]);
* ``check_random``: a random op under ``randomness='error'``;
* ``check_custom_function``: a custom ``autograd.Function`` whose forward runs on values a
  transform outside the vmap differentiates (its backward would never be called).

Imports: errors, batched_tensor, randomness (pure policy).
"""
from __future__ import annotations

import weakref
from typing import List, Tuple

import torch

from ..errors import EscapedBatchedTensorError, InplaceIntoUnbatchedError, UnsupportedUnderVmap
from .batched_tensor import BatchedTensor, innermost
from .randomness import draws_random, random_error

_BT = BatchedTensor


def check_alive(op, level) -> None:
    """Refuse a wrapper of a vmap that has returned (see the module docstring)."""
    if not level.alive and torch._C._current_autograd_node() is None:
        raise _escaped_error(op, level)


def _escaped_error(op, level) -> EscapedBatchedTensorError:
    return EscapedBatchedTensorError(
        f"vmap: {op} was called on a BatchedTensor of vmap level {level.id}, but that vmap has "
        "already returned. The tensor escaped its vmap (through a closure, a global, a list "
        "the function appended to, or a non-output attribute). Return it from the vmapped "
        "function instead, so vmap can turn it into an ordinary tensor with the batch dim.")


def check_writes(op, entry, vals, in_dims, kwargs, level, rule_checks: bool) -> None:
    """The refusals of an op that writes in place: into a copied view (or its base), and of a
    batched value into an unbatched tensor (skipped when the rule checks that itself)."""
    if _copies:
        _check_copied_views(op, entry, vals, kwargs)
    if not rule_checks:
        check_inplace(op, entry, vals, in_dims, kwargs, level)


def check_random(op, args, kwargs, level) -> None:
    """A random op on batched values under ``randomness='error'``."""
    if level.randomness == "error" and draws_random(op, args, kwargs):
        raise random_error(op)


def _batched_any(dims) -> bool:
    if dims is None:
        return False
    if isinstance(dims, int):
        return True
    return any(d is not None for d in dims)


def _check_copied_views(op, entry, args, kwargs) -> None:
    for i in entry.written_pos:
        if i < len(args) and isinstance(args[i], torch.Tensor):
            _check_write(op, args[i])
    for name in entry.written_kw:
        if isinstance(kwargs.get(name), torch.Tensor):
            _check_write(op, kwargs[name])


def check_inplace(op, entry, args, in_dims, kwargs, level) -> None:
    """Refuse a write of batched values into an unbatched tensor (see _inplace_error)."""
    for i in entry.written_pos:
        if i < len(args) and in_dims[i] is None and isinstance(args[i], torch.Tensor):
            if any(_batched_any(d) for j, d in enumerate(in_dims) if j != i) or any(
                    type(v) is _BT and v.level is level for v in kwargs.values()):
                raise _inplace_error(op, i)
    for name in entry.written_kw:
        out = kwargs.get(name)
        if isinstance(out, torch.Tensor) and not (type(out) is _BT and out.level is level):
            if any(_batched_any(d) for d in in_dims):
                raise _inplace_error(op, name)


def _inplace_error(op, which) -> InplaceIntoUnbatchedError:
    arg = f"argument {which}" if isinstance(which, int) else f"the {which}= argument"
    return InplaceIntoUnbatchedError(
        f"vmap: {op} is an in-place operation that would write a batched value into "
        f"{arg}, which is not batched (it was created inside the function with a factory like "
        "torch.zeros(shape), or captured from outside vmap). Each example would need its own "
        "copy of that tensor. Create it from a batched input instead, e.g. "
        "torch.zeros_like(x) or x.new_zeros(shape), or use the out-of-place version of the op"
        + (" (out[i] = v, out[mask] = v and out += v are in-place writes into out; build the "
           "result with torch.stack, torch.cat or torch.where instead)."
           if op.overloadpacket.__name__ in ("copy_", "index_put_", "add_", "masked_fill_",
                                             "fill_", "sub_", "mul_", "div_")
           else "."))


def check_custom_function(args, level) -> None:
    """A custom ``autograd.Function`` runs its forward with both grad modes off.  If a batched
    argument's physical value requires grad, a transform outside this vmap differentiates
    through it (Note [autograd on physical values]); that transform would record none of the
    forward's ops and never call the Function's backward: a silently wrong gradient.  (A
    wrapper that requires grad itself belongs to a transform inside the vmap, which records the
    Function's node on the wrappers: that case is fine.)  New-style Functions with a vmap
    staticmethod or ``generate_vmap_rule`` never get here under an outer transform: see
    batching/custom_function.py."""
    for a in args:
        if type(a) is _BT and a.level is level and a.value.requires_grad and \
                not a.requires_grad:
            raise UnsupportedUnderVmap(
                "vmap: a custom torch.autograd.Function ran on batched values that a "
                "transform outside this vmap differentiates (grad/jacrev/vjp around the vmap, "
                "or .backward() on its result). That transform sees the vmap's physical ops, "
                "and a Function's forward runs without recording them, so its backward would "
                "never be called and the gradient would be silently wrong. Put the gradient "
                "transform inside the vmap (vmap(grad(f)) instead of grad(vmap(f))), write "
                "the function with ordinary torch operations, or make the Function new-style "
                "(forward without ctx, a setup_context staticmethod) with a vmap staticmethod "
                "or generate_vmap_rule = True, which functrans differentiates from outside a "
                "vmap.")


# ----------------------------------------------------------------------------- copied views
# Note [view after moving the bdim]
# ``x.view(shape)`` is an alias in eager.  Under vmap its rule views the physical value, first
# with the batch dim moved to the front, then (if that fails) by computing one example's view and
# laying the batch over it (``as_strided`` with the batch stride), so the result is still an
# alias whenever the per-example view exists.  When neither exists (the physical layout
# interleaves the batch with the example's dims, e.g. ``in_dims=1`` or an op that kept such a
# layout, while eager's per-example tensor would be contiguous), the rule must copy.  The values
# are right, but a later in-place write through the copy would not reach its base (nor a write
# into the base the copy): a silent wrong answer.  So every such copy is recorded here with its
# base's storage, and an in-place write into either storage while the copy is alive raises an
# error that says why and what to do.  Nothing is recorded in the common case, and the check
# costs one ``if`` per in-place op then.
#
# (weakref to the copy's physical value, the copy's storage pointer, the base's storage pointer,
#  what the copy stands for)
_copies: List[Tuple[weakref.ref, int, int, str]] = []

VIEW = "view"      # Note [view after moving the bdim]
LAZY_BIT = "bit"   # Note [conjugate and negative bits] in rules/autograd_ops.py
NARROW = "narrow"  # narrow with a batched start: above_dispatch.py


def _storage_ptr(t: torch.Tensor) -> int:
    """The innermost storage's address; 0 for an empty storage (every empty storage has
    address 0, and a write into one changes nothing, so it is never recorded or checked)."""
    s = innermost(t).untyped_storage()  # a wrapper of an outer level: its innermost memory
    return s.data_ptr() if s.nbytes() else 0


def record_copy(copy: torch.Tensor, base: torch.Tensor, kind: str = VIEW) -> None:
    if not _storage_ptr(copy) or not _storage_ptr(base):
        return  # empty: nothing a write could miss (and address 0 would match any empty one)
    _prune()
    _copies.append((weakref.ref(copy), _storage_ptr(copy), _storage_ptr(base), kind))


def _prune() -> None:
    _copies[:] = [c for c in _copies if c[0]() is not None]


def _check_write(op, target: torch.Tensor) -> None:
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


# Why the copy exists and what to do instead, by the kind ``record_copy`` was given.
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
