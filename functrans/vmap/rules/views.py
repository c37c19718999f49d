"""Views and shape ops: view, _unsafe_view, permute, transpose, t, expand, unsqueeze, squeeze
(every overload), select, slice, unbind, split, split_with_sizes, unsafe_split*, diagonal,
unfold, view_as_real/complex, flip, roll, tril/triu (and in-place), repeat, cat, stack, and the
view backward ops autograd issues (select_backward, slice_backward, diagonal_backward).

Invariants:
* view ops return views of the physical input (an in-place op on the result writes through);
  ops that copy in eager (repeat, flip, roll, cat, stack) copy here too;
* the bdim stays where it is whenever the op can address the logical dims around it
  (transpose, permute, select, slice, unbind, split, diagonal, unfold, flip, squeeze,
  unsqueeze); ops that need it first (view, expand, repeat, cat, stack) move it to the front.

Note [view after moving the bdim]
``view`` needs the batch dim at the front.  A logical view that is legal may become physically
impossible once a non-leading bdim is moved to the front (the strides no longer compose); then
the rule reshapes, which copies.  The values are right, but an in-place write through that
result no longer reaches the input.  The dispatcher never hits this for tensors vmap created
with the default in_dims=0.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..helpers import (ensure_bdim_front, logical_rank, move_bdim_to_front, normalize_dim,
                       pad_to_rank, physical_dim)
from ..registry import register_batch_rule

aten = torch.ops.aten


def _after_removing(bdim: int, removed: Sequence[int]) -> int:
    """The bdim once the physical dims ``removed`` are gone."""
    return bdim - sum(1 for d in removed if d < bdim)


@register_batch_rule([aten.view.default, aten._unsafe_view.default])
def view_rule(info, in_dims, x, shape):
    y = move_bdim_to_front(x, in_dims[0])
    new_shape = (y.shape[0], *shape)
    try:
        return y.view(new_shape), 0
    except RuntimeError:
        return y.reshape(new_shape), 0  # See Note [view after moving the bdim]


@register_batch_rule(aten.permute.default)
def permute_rule(info, in_dims, x, dims):
    b, r = in_dims[0], logical_rank(x, in_dims[0])
    perm = [physical_dim(d, b, r) for d in dims]
    perm.insert(b, b)
    return x.permute(perm), b


@register_batch_rule(aten.transpose.int)
def transpose_rule(info, in_dims, x, dim0, dim1):
    b, r = in_dims[0], logical_rank(x, in_dims[0])
    if r == 0:
        normalize_dim(dim0, r), normalize_dim(dim1, r)
        return x, b
    return x.transpose(physical_dim(dim0, b, r), physical_dim(dim1, b, r)), b


@register_batch_rule(aten.t.default)
def t_rule(info, in_dims, x):
    b, r = in_dims[0], logical_rank(x, in_dims[0])
    if r > 2:
        raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, but self is {r}D")
    return (transpose_rule(info, in_dims, x, 0, 1) if r == 2 else (x.view_as(x), b))


@register_batch_rule(aten.expand.default)
def expand_rule(info, in_dims, x, size, implicit=False):
    y = pad_to_rank(move_bdim_to_front(x, in_dims[0]), len(size))
    return y.expand(y.shape[0], *size), 0


@register_batch_rule(aten.unsqueeze.default)
def unsqueeze_rule(info, in_dims, x, dim):
    b, r = in_dims[0], logical_rank(x, in_dims[0])
    d = normalize_dim(dim, r + 1)
    return (x.unsqueeze(d), b + 1) if d < b else (x.unsqueeze(d + 1), b)


def _squeeze(x, b, logical_dims):
    r = logical_rank(x, b)
    pdims = [physical_dim(d, b, r) for d in logical_dims] if r else []
    removed = sorted({d for d in pdims if x.shape[d] == 1})
    if not removed:
        return x.view_as(x) if x.dim() else x, b
    return x.squeeze(removed), _after_removing(b, removed)


@register_batch_rule(aten.squeeze.default)
def squeeze_rule(info, in_dims, x):
    b = in_dims[0]
    return _squeeze(x, b, range(logical_rank(x, b)))


@register_batch_rule(aten.squeeze.dim)
def squeeze_dim_rule(info, in_dims, x, dim):
    return _squeeze(x, in_dims[0], [dim])


@register_batch_rule(aten.squeeze.dims)
def squeeze_dims_rule(info, in_dims, x, dims):
    return _squeeze(x, in_dims[0], list(dims))


@register_batch_rule(aten.select.int)
def select_rule(info, in_dims, x, dim, index):
    b, r = in_dims[0], logical_rank(x, in_dims[0])
    d = physical_dim(dim, b, r)
    return x.select(d, index), _after_removing(b, [d])


@register_batch_rule(aten.slice.Tensor)
def slice_rule(info, in_dims, x, dim=0, start=None, end=None, step=1):
    b, r = in_dims[0], logical_rank(x, in_dims[0])
    return aten.slice.Tensor(x, physical_dim(dim, b, r), start, end, step), b


@register_batch_rule(aten.unbind.int)
def unbind_rule(info, in_dims, x, dim=0):
    b, r = in_dims[0], logical_rank(x, in_dims[0])
    d = physical_dim(dim, b, r)
    outs = x.unbind(d)
    return outs, [_after_removing(b, [d])] * len(outs)


def _split_rule_for(op):
    def rule(info, in_dims, x, split, dim=0):
        b, r = in_dims[0], logical_rank(x, in_dims[0])
        outs = op(x, split, physical_dim(dim, b, r))
        return outs, [b] * len(outs)
    rule.__name__ = f"split_rule[{op}]"
    return rule


for _op in (aten.split.Tensor, aten.split_with_sizes.default, aten.unsafe_split.Tensor,
            aten.unsafe_split_with_sizes.default):
    register_batch_rule(_op, _split_rule_for(_op))


@register_batch_rule(aten.diagonal.default)
def diagonal_rule(info, in_dims, x, offset=0, dim1=0, dim2=1):
    b, r = in_dims[0], logical_rank(x, in_dims[0])
    d1, d2 = physical_dim(dim1, b, r), physical_dim(dim2, b, r)
    return x.diagonal(offset, d1, d2), _after_removing(b, [d1, d2])


@register_batch_rule(aten.unfold.default)
def unfold_rule(info, in_dims, x, dimension, size, step):
    b, r = in_dims[0], logical_rank(x, in_dims[0])
    if r == 0:
        normalize_dim(dimension, r)
        return x.unsqueeze(-1).expand(*x.shape, size) if size == 1 else x.unfold(b, size, step), b
    return x.unfold(physical_dim(dimension, b, r), size, step), b


@register_batch_rule(aten.view_as_real.default)
def view_as_real_rule(info, in_dims, x):
    return torch.view_as_real(x), in_dims[0]


@register_batch_rule(aten.view_as_complex.default)
def view_as_complex_rule(info, in_dims, x):
    b = in_dims[0]
    if b == x.dim() - 1:
        x, b = move_bdim_to_front(x, b), 0
    return torch.view_as_complex(x), b


@register_batch_rule(aten.flip.default)
def flip_rule(info, in_dims, x, dims):
    b, r = in_dims[0], logical_rank(x, in_dims[0])
    return x.flip([physical_dim(d, b, r) for d in dims]), b


@register_batch_rule(aten.roll.default)
def roll_rule(info, in_dims, x, shifts, dims=()):
    b, r = in_dims[0], logical_rank(x, in_dims[0])
    if len(dims) == 0:  # roll the flattened example
        y = move_bdim_to_front(x, b)
        return y.reshape(y.shape[0], -1).roll(shifts, 1).view(y.shape), 0
    return x.roll(shifts, [physical_dim(d, b, r) for d in dims]), b


def _triangle_rule_for(op):
    inplace = op._schema.arguments[0].alias_info is not None

    def rule(info, in_dims, x, diagonal=0):
        b, r = in_dims[0], logical_rank(x, in_dims[0])
        if r < 2:
            raise RuntimeError(f"{op}: input tensor must have at least 2 dimensions")
        if b < x.dim() - 2:
            return op(x, diagonal), b
        out = op(move_bdim_to_front(x, b), diagonal)
        return (x, b) if inplace else (out, 0)
    rule.__name__ = f"triangle_rule[{op}]"
    return rule


for _op in (aten.tril.default, aten.triu.default, aten.tril_.default, aten.triu_.default):
    register_batch_rule(_op, _triangle_rule_for(_op))


@register_batch_rule(aten.repeat.default)
def repeat_rule(info, in_dims, x, repeats):
    y = pad_to_rank(move_bdim_to_front(x, in_dims[0]), len(repeats))
    return y.repeat(1, *repeats), 0


def _is_legacy_empty(t, d) -> bool:
    shape = t.shape if d is None else t.shape[:d] + t.shape[d + 1:]
    return tuple(shape) == (0,)


@register_batch_rule(aten.cat.default)
def cat_rule(info, in_dims, tensors, dim=0):
    dims = in_dims[0]
    kept = [(t, d) for t, d in zip(tensors, dims) if not _is_legacy_empty(t, d)]
    if not kept:  # every input is a legacy empty 1-D tensor
        kept = list(zip(tensors, dims))
    rank = logical_rank(kept[0][0], kept[0][1])
    parts = [ensure_bdim_front(t, d, info.batch_size) for t, d in kept]
    return torch.cat(parts, normalize_dim(dim, rank) + 1), 0


@register_batch_rule(aten.stack.default)
def stack_rule(info, in_dims, tensors, dim=0):
    rank = logical_rank(tensors[0], in_dims[0][0])
    parts = [ensure_bdim_front(t, d, info.batch_size) for t, d in zip(tensors, in_dims[0])]
    return torch.stack(parts, normalize_dim(dim, rank + 1) + 1), 0


def _zeros_batched(grad, bdim, input_sizes):
    g = move_bdim_to_front(grad, bdim)
    return g, g.new_zeros((g.shape[0], *input_sizes))


@register_batch_rule(aten.select_backward.default)
def select_backward_rule(info, in_dims, grad, input_sizes, dim, index):
    g, out = _zeros_batched(grad, in_dims[0], input_sizes)
    out.select(normalize_dim(dim, len(input_sizes)) + 1, index).copy_(g)
    return out, 0


@register_batch_rule(aten.slice_backward.default)
def slice_backward_rule(info, in_dims, grad, input_sizes, dim, start, end, step):
    g, out = _zeros_batched(grad, in_dims[0], input_sizes)
    aten.slice.Tensor(out, normalize_dim(dim, len(input_sizes)) + 1, start, end, step).copy_(g)
    return out, 0


@register_batch_rule(aten.diagonal_backward.default)
def diagonal_backward_rule(info, in_dims, grad, input_sizes, offset, dim1, dim2):
    g, out = _zeros_batched(grad, in_dims[0], input_sizes)
    r = len(input_sizes)
    out.diagonal(offset, normalize_dim(dim1, r) + 1, normalize_dim(dim2, r) + 1).copy_(g)
    return out, 0
