"""Ops that autograd and forward-mode AD issue by themselves on batched values.

``detach``, ``alias``, ``_to_copy``, ``clone``, ``copy_``, ``fill_``, ``zero_``,
``is_same_size``, ``_has_same_storage_numel`` (forward AD's ``_make_dual`` / ``_unpack_dual``
never reach vmap: a jvp inside vmap records on the wrappers, one around it is refused),
``_conj`` / ``_neg_view`` (materialised: see Note [conjugate and negative bits]).
Invariants: outputs keep the input's bdim (no movedim, no copy beyond what the op itself does);
in-place ops write into the physical ``self``.
"""
from __future__ import annotations

import torch

from ..helpers import keep_bdim_rule, move_bdim_to_front, pad_to_rank
from .. import guards
from ..registry import registrar

aten = torch.ops.aten
register_batch_rule = registrar("autograd_ops")   # the rules below live in this file


for _op in (aten.alias.default, aten.zero_.default, aten.fill_.Scalar):
    register_batch_rule(_op, keep_bdim_rule(_op))


# Note [detach by the autograd engine]
# Autograd detaches tensors itself: a saved OUTPUT (exp, tanh, sigmoid, softmax... save their
# result) is stored as a shallow copy made with ``detach``, and unpacked the same way.  That
# detach must cut only the wrappers' own graph (the level of the transform inside the vmap that
# saved the output): the physical value stays an alias in the graph of a transform outside the
# vmap (Note [autograd on physical values]), or ``grad(vmap(grad(exp)))`` loses every term
# through a saved output.  A user's ``x.detach()`` cuts every level, as the reference library's and
# JAX's stop_gradient do.  The two are told apart by where the call comes from: a user's reaches
# ``__torch_dispatch__`` from below the Autograd dispatch key, which excludes the autograd keys;
# the engine calls the wrapper's detach directly, with none excluded.  AutogradOther is the key
# to test: ``autograd_on_physical_values`` re-enables AutogradFunctionality around the rule, and
# leaves AutogradOther excluded.
_AUTOGRAD_OTHER = torch._C.DispatchKey.AutogradOther


@register_batch_rule(aten.detach.default)
def detach_rule(info, in_dims, x):
    if torch._C._dispatch_tls_local_exclude_set().has(_AUTOGRAD_OTHER):
        return x.detach(), in_dims[0]          # the user's detach: every level
    return aten.alias(x), in_dims[0]           # the engine's: this level only


# Note [conjugate and negative bits]
# ``x.conj()`` is a lazy view: PyTorch marks the result's TensorImpl with a conj bit.  The bit of
# a wrapper is set by the kernel we replace, so it would sit on the physical value while the
# BatchedTensor that users and autograd inspect (``is_conj()``, ``resolve_conj()``,
# ``view_as_real``) says "not conjugated".  So these rules materialise the result instead, and
# vmap resolves the bits of its inputs when it wraps them: a physical value never carries one.
# A materialised result no longer aliases its input, so it is recorded (guards.record_copy): an
# in-place write into either while the copy lives raises instead of silently missing the other.
@register_batch_rule(aten._conj.default)
def conj_rule(info, in_dims, x):
    out = torch.conj_physical(x)
    guards.record_copy(out, x, guards.LAZY_BIT)
    return out, in_dims[0]


@register_batch_rule(aten._neg_view.default)
def neg_view_rule(info, in_dims, x):
    out = torch.neg(x)
    guards.record_copy(out, x, guards.LAZY_BIT)
    return out, in_dims[0]


def example_is_dense(x: torch.Tensor, bdim: int) -> bool:
    """Whether one example of ``x`` is non-overlapping and dense (eager's copies preserve such
    a tensor's strides, and make any other tensor contiguous)."""
    dims = sorted(((st, n) for d, (n, st) in enumerate(zip(x.shape, x.stride()))
                   if d != bdim and n != 1))
    expected = 1
    for st, n in dims:
        if st != expected:
            return False
        expected *= n
    return True


def _copy_layout(x: torch.Tensor, bdim: int):
    """(x, bdim, copied) laid out as eager's preserve_format copy lays out each example: kept
    when an example is dense, else copied with the batch first and each example dense, its
    dims in the order of their strides (as ``empty_like`` infers dense strides)."""
    if bdim == 0 or example_is_dense(x, bdim):
        return x, bdim, False
    y = move_bdim_to_front(x, bdim)
    shape, strides = y.shape[1:], y.stride()[1:]
    order = sorted(range(len(shape)), key=lambda d: (strides[d], -d))  # fastest first
    dense, step = [0] * len(shape), 1
    for d in order:
        dense[d] = step
        step *= max(shape[d], 1)
    out = y.new_empty_strided(y.shape, (step, *dense))  # batched too, if y is of a lower level
    out.copy_(y)
    return out, 0, True


@register_batch_rule(aten._to_copy.default)
def to_copy_rule(info, in_dims, x, **kwargs):
    if kwargs.get("memory_format") not in (None, torch.preserve_format):
        # Physical layouts with a batch dim cannot be e.g. channels_last: put the batch first
        # and lay the logical dims out as asked, on the per-example view.
        fmt = kwargs.pop("memory_format")
        x = move_bdim_to_front(x, in_dims[0])
        out = aten._to_copy.default(x, **kwargs)
        if fmt == torch.contiguous_format:
            out = out.contiguous()
        return out, 0
    y, bdim, copied = _copy_layout(x, in_dims[0])
    if copied and (kwargs.get("dtype") in (None, x.dtype)) and (
            kwargs.get("device") in (None, x.device)):
        return y, bdim  # already a fresh copy with the right layout
    return aten._to_copy.default(y, **kwargs), bdim


@register_batch_rule(aten.clone.default)
def clone_rule(info, in_dims, x, *, memory_format=None):
    if memory_format in (None, torch.preserve_format):
        y, bdim, copied = _copy_layout(x, in_dims[0])
        return (y if copied else y.clone()), bdim
    # A contiguous logical tensor needs the batch dim first; other formats are layouts only.
    # Always a copy: ``.contiguous()`` would return the input itself when it already is
    # (autograd's CopySlices clones a grad slice this way and then writes into the slice).
    return move_bdim_to_front(x, in_dims[0]).clone(memory_format=torch.contiguous_format), 0


@register_batch_rule(aten.copy_.default)
def copy__rule(info, in_dims, dst, src, non_blocking=False):
    dst_bdim, src_bdim = in_dims
    target = move_bdim_to_front(dst, dst_bdim)
    if src_bdim is not None:
        src = pad_to_rank(move_bdim_to_front(src, src_bdim), dst.dim() - 1)
    target.copy_(src, non_blocking)
    return dst, dst_bdim


@register_batch_rule(aten.fill_.Tensor)
def fill__tensor_rule(info, in_dims, x, value):
    x_bdim, v_bdim = in_dims
    if v_bdim is None:
        return x.fill_(value), x_bdim
    target = move_bdim_to_front(x, x_bdim)
    target.copy_(pad_to_rank(move_bdim_to_front(value, v_bdim), x.dim() - 1).expand_as(target))
    return x, x_bdim


@register_batch_rule(aten.is_same_size.default)
def is_same_size_rule(info, in_dims, a, b):
    def logical(t, d):
        return t.shape if d is None else t.shape[:d] + t.shape[d + 1:]
    return logical(a, in_dims[0]) == logical(b, in_dims[1]), None


@register_batch_rule(aten._has_same_storage_numel.default)
def has_same_storage_numel_rule(info, in_dims, a, b):
    if in_dims[0] is not None and in_dims[1] is not None:
        return aten._has_same_storage_numel.default(a, b), None
    # One side is per-example, the other is not: compare the logical numels.
    def numel(t, d):
        return t.numel() // (t.shape[d] if d is not None and t.shape[d] else 1)
    return numel(a, in_dims[0]) == numel(b, in_dims[1]), None
