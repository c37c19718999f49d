"""Ops that autograd and forward-mode AD issue by themselves on batched values.

``detach``, ``alias``, ``_to_copy``, ``clone``, ``copy_``, ``fill_``, ``zero_``,
``is_same_size``, ``_has_same_storage_numel``, ``_make_dual`` (forward AD; ``_unpack_dual`` is
composite and decomposes before vmap sees it),
``_conj`` / ``_neg_view`` (materialised: see Note [conjugate and negative bits]).
Invariants: outputs keep the input's bdim (no movedim, no copy beyond what the op itself does);
in-place ops write into the physical ``self``.
"""
from __future__ import annotations

import torch

from ..helpers import move_bdim_to_front, pad_to_rank
from ..registry import register_batch_rule

aten = torch.ops.aten


def _same_bdim(op):
    def rule(info, in_dims, x, *args, **kwargs):
        return op(x, *args, **kwargs), in_dims[0]
    rule.__name__ = f"same_bdim[{op}]"
    return rule


for _op in (aten.detach.default, aten.alias.default, aten.zero_.default,
            aten.fill_.Scalar, aten.lift_fresh.default):
    register_batch_rule(_op, _same_bdim(_op))


# Note [conjugate and negative bits]
# ``x.conj()`` is a lazy view: PyTorch marks the result's TensorImpl with a conj bit.  The bit of
# a wrapper is set by the kernel we replace, so it would sit on the physical value while the
# BatchedTensor that users and autograd inspect (``is_conj()``, ``resolve_conj()``,
# ``view_as_real``) says "not conjugated".  So these rules materialise the result instead, and
# vmap resolves the bits of its inputs when it wraps them: a physical value never carries one.
@register_batch_rule(aten._conj.default)
def conj_rule(info, in_dims, x):
    return torch.conj_physical(x), in_dims[0]


@register_batch_rule(aten._neg_view.default)
def neg_view_rule(info, in_dims, x):
    return torch.neg(x), in_dims[0]


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
    return aten._to_copy.default(x, **kwargs), in_dims[0]


@register_batch_rule(aten.clone.default)
def clone_rule(info, in_dims, x, *, memory_format=None):
    if memory_format in (None, torch.preserve_format):
        return x.clone(), in_dims[0]
    # A contiguous logical tensor needs the batch dim first; other formats are layouts only.
    return move_bdim_to_front(x, in_dims[0]).contiguous(), 0


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


@register_batch_rule(aten._make_dual.default)
def make_dual_rule(info, in_dims, primal, tangent, level):
    # Below autograd, _make_dual is a view of the primal; autograd attaches the tangent.
    return aten.alias.default(primal), in_dims[0]
