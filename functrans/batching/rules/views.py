"""Views and shape ops: view (and view.dtype), _unsafe_view, _reshape_alias, permute, transpose,
t, expand, unsqueeze, squeeze (every overload), select, slice, unbind, split, split_with_sizes,
unsafe_split*, diagonal, unfold, view_as_real/complex, flip, roll, tril/triu (and in-place),
repeat, cat, stack, as_strided and as_strided_scatter, and the view backward ops autograd issues
(select_backward, slice_backward, diagonal_backward, unfold_backward).

Invariants:
* view ops return views of the physical input (an in-place op on the result writes through);
  ops that copy in eager (repeat, flip, roll, cat, stack, the backward ops) copy here too;
* the bdim stays where it is whenever the op can address the logical dims around it
  (transpose, permute, select, slice, unbind, split, diagonal, unfold, flip, squeeze,
  unsqueeze, view_as_real); ops that need it first (view, expand, repeat, cat, stack and the
  backward ops) move it to the front;
* an op that addresses a dim of a logically 0-d tensor must not reach the batch dim: such calls
  are checked on a meta tensor of the logical shape first, which raises eager PyTorch's own error
  (see ``_check_logical``).

Note [as_strided under vmap]
``as_strided`` (and ``as_strided_copy``) address storage by absolute offsets.  Inside vmap a
batched ``x`` shows example 0's view: its sizes, strides and storage offset (the physical
tensor's).  ``x.as_strided(size, stride, offset)`` means, for example ``i``, the window
``(size, stride)`` at ``offset + (start of example i - start of example 0)``: each example is
viewed as example 0 is, at its own place in the storage (the reference library's rule; a loop
over ``x[i].as_strided(size, stride, offset + x[i].storage_offset() - x.storage_offset())``
gives the same).  So the result is one view, ``x.as_strided((B, *size), (x.stride(bdim),
*stride), offset)``, under nested vmap too (the outer level lays its own batch over it).  The
window must stay within the memory example 0's view spans (``[x.storage_offset(),
x.storage_offset() + extent)``), as the reference checks: otherwise it would reach other
examples' memory or none, and is refused.  Strides taken from ``x.stride()`` are those of the
example's view; literal strides meant for a fresh example read other elements when the batch
is interleaved with the example's dims (in_dims other than 0 on a tensor stacked there), as in
the reference library.  ``as_strided_scatter`` writes into a fresh clone in eager, so it writes
into a fresh block per example (``_fresh_examples``), whenever the example's strides are a fresh
tensor's.

``view`` aliases whenever one example's view exists, and copies otherwise: see Note [view after
moving the bdim] in ``batching/guards.py``, which also guards in-place writes into such copies.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from ..helpers import (ensure_bdim_front, logical_rank, move_bdim_to_front, normalize_dim,
                       pad_to_rank, physical_dim)
from ..op_schema import writes_self
from .. import guards
from ..batched_tensor import BatchedTensor
from ..registry import Decline, registrar
from ...errors import FunctransError, UnsupportedUnderVmap

aten = torch.ops.aten
register_batch_rule = registrar("views")   # the rules below live in this file


def _after_removing(bdim: int, removed: Sequence[int]) -> int:
    """The bdim once the physical dims ``removed`` are gone."""
    return bdim - sum(1 for d in removed if d < bdim)


def _check_logical(op, x, bdim, *args):
    """Run ``op`` on a meta tensor shaped like one example of ``x``: raises eager's error for
    a call that is illegal per example, else returns the (meta) per-example result."""
    shape, stride = list(x.shape), list(x.stride())
    del shape[bdim], stride[bdim]
    example = torch.empty_strided(shape, stride, dtype=x.dtype, device="meta")
    return op(example, *args)


def _check_numel(x, bdim, shape):
    """Raise eager's error when ``shape`` does not fit one example's number of elements."""
    example = list(x.shape)
    del example[bdim]
    torch.empty(example, device="meta").view(shape)


def _alias(x, bdim):
    return aten.alias.default(x), bdim


# What ``t.view(shape)`` raises when the strides do not allow that view: RuntimeError from
# the kernels, ValueError from PyTorch's Python reference (under FakeTensorMode / torch.compile
# tracing, where the meta kernel is ``torch._refs._reshape_view_helper``).
_VIEW_ERRORS = (RuntimeError, ValueError)


def _example_view_strides(x, b, shape):
    """The strides of one example's ``view(shape)``, or None when it cannot be a view (or x is
    a lower level's wrapper, whose memory as_strided cannot address)."""
    if type(x) is BatchedTensor or x.shape[b] == 0:
        return None
    try:
        return x.select(b, 0).view(shape).stride()
    except _VIEW_ERRORS:
        return None


@register_batch_rule([aten.view.default, aten._unsafe_view.default])
def view_rule(info, in_dims, x, shape):
    b = in_dims[0]
    y = move_bdim_to_front(x, b)
    new_shape = (y.shape[0], *shape)
    try:
        return y.view(new_shape), 0
    except _VIEW_ERRORS:
        pass
    # See Note [view after moving the bdim] (guards.py).
    _check_numel(x, b, shape)
    strides = _example_view_strides(x, b, shape)
    if strides is not None:  # each example's view, laid over the batch: still an alias
        return x.as_strided(new_shape, (x.stride(b), *strides), x.storage_offset()), 0
    out = y.reshape(new_shape)
    guards.record_copy(out, x)
    return out, 0


@register_batch_rule(aten._reshape_alias.default)
def reshape_alias_rule(info, in_dims, x, size, stride):
    # A view of ``size`` with exactly the strides asked for; anything else is an as_strided
    # (see the module docstring), which the fallback refuses with an explanation.
    y = move_bdim_to_front(x, in_dims[0])
    try:
        out = y.view(y.shape[0], *size)
    except _VIEW_ERRORS:
        raise Decline from None
    if any(n > 1 and s != t for n, s, t in zip(size, out.stride()[1:], stride)):
        raise Decline
    return out, 0


@register_batch_rule(aten.view.dtype)
def view_dtype_rule(info, in_dims, x, dtype):
    b = in_dims[0]
    if b == x.dim() - 1 and logical_rank(x, b) > 0:
        x, b = move_bdim_to_front(x, b), 0  # the logical last dim must be the physical last
    elif logical_rank(x, b) == 0:
        _check_logical(aten.view.dtype, x, b, dtype)
    return x.view(dtype), b


@register_batch_rule(aten.permute.default)
def permute_rule(info, in_dims, x, dims):
    b, r = in_dims[0], logical_rank(x, in_dims[0])
    if r == 0:
        _check_logical(aten.permute.default, x, b, dims)
        return _alias(x, b)
    perm = [physical_dim(d, b, r) for d in dims]
    perm.insert(b, b)
    return x.permute(perm), b


@register_batch_rule(aten.transpose.int)
def transpose_rule(info, in_dims, x, dim0, dim1):
    b, r = in_dims[0], logical_rank(x, in_dims[0])
    if r == 0:
        normalize_dim(dim0, r), normalize_dim(dim1, r)
        return _alias(x, b)
    return x.transpose(physical_dim(dim0, b, r), physical_dim(dim1, b, r)), b


@register_batch_rule(aten.t.default)
def t_rule(info, in_dims, x):
    b, r = in_dims[0], logical_rank(x, in_dims[0])
    if r > 2:
        raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, but self is {r}D")
    return transpose_rule(info, in_dims, x, 0, 1) if r == 2 else _alias(x, b)


@register_batch_rule(aten.expand.default)
def expand_rule(info, in_dims, x, size, implicit=False):
    new = len(size) - logical_rank(x, in_dims[0])
    for i in range(new):
        if size[i] == -1:
            raise RuntimeError(f"The expanded size of the tensor (-1) isn't allowed in a "
                               f"leading, non-existing dimension {i}")
    y = pad_to_rank(move_bdim_to_front(x, in_dims[0]), len(size))
    return y.expand(y.shape[0], *size), 0


@register_batch_rule(aten.unsqueeze.default)
def unsqueeze_rule(info, in_dims, x, dim):
    b, r = in_dims[0], logical_rank(x, in_dims[0])
    d = normalize_dim(dim, r + 1)
    return (x.unsqueeze(d), b + 1) if d < b else (x.unsqueeze(d + 1), b)


def _squeeze(x, b, logical_dims):
    r = logical_rank(x, b)
    logical = [normalize_dim(d, r) for d in logical_dims]
    if r == 0:
        return _alias(x, b)
    removed = sorted({d + (d >= b) for d in logical if x.shape[d + (d >= b)] == 1})
    if not removed:
        return _alias(x, b)
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
    if logical_rank(x, in_dims[0]) == 0:
        _check_logical(aten.squeeze.dims, x, in_dims[0], dims)
    return _squeeze(x, in_dims[0], list(dims))


def _dim_op_rule(op, *, out_bdim, dim_pos=0, rank0=None):
    """Rule for an op whose argument number ``dim_pos`` (after self) is one logical dim:
    it runs on the physical dim; ``out_bdim(b, d)`` is the output's bdim (b: the input's,
    d: the physical dim).  On a 0-d example the call is checked by ``_check_logical``, then
    ``rank0(x, b, *args)`` computes it (None: the check always raises)."""

    def rule(info, in_dims, x, *args):
        b, r = in_dims[0], logical_rank(x, in_dims[0])
        if r == 0:
            _check_logical(op, x, b, *args)
            return rank0(x, b, *args)
        args = list(args)
        d = args[dim_pos] = physical_dim(args[dim_pos], b, r)
        out = op(x, *args)
        ob = out_bdim(b, d)
        return out, ([ob] * len(out) if isinstance(out, (list, tuple)) else ob)
    rule.__name__ = f"dim_op_rule[{op}]"
    return rule


def _defaults(op):
    """``op``'s positional defaults after self, so rules can receive every argument."""
    return [a.default_value for a in op._schema.arguments[1:]]


def _with_defaults(rule, op):
    defaults = _defaults(op)

    @functools.wraps(rule)
    def wrapped(info, in_dims, x, *args):
        return rule(info, in_dims, x, *args, *defaults[len(args):])
    return wrapped


def _keep(b, d):
    return b


def _removed(b, d):
    return _after_removing(b, [d])


register_batch_rule(aten.select.int, _dim_op_rule(aten.select.int, out_bdim=_removed))
register_batch_rule(aten.unbind.int, _with_defaults(
    _dim_op_rule(aten.unbind.int, out_bdim=_removed), aten.unbind.int))
register_batch_rule(aten.slice.Tensor, _with_defaults(
    _dim_op_rule(aten.slice.Tensor, out_bdim=_keep), aten.slice.Tensor))
for _op in (aten.split.Tensor, aten.split_with_sizes.default, aten.unsafe_split.Tensor,
            aten.unsafe_split_with_sizes.default):
    register_batch_rule(_op, _with_defaults(_dim_op_rule(_op, out_bdim=_keep, dim_pos=1), _op))
register_batch_rule(aten.unfold.default, _dim_op_rule(
    aten.unfold.default, out_bdim=_keep,
    rank0=lambda x, b, dim, size, step: (x.unsqueeze(-1).narrow(-1, 0, size), b)))


@register_batch_rule(aten.diagonal.default)
def diagonal_rule(info, in_dims, x, offset=0, dim1=0, dim2=1):
    b, r = in_dims[0], logical_rank(x, in_dims[0])
    if r < 2:
        _check_logical(aten.diagonal.default, x, b, offset, dim1, dim2)
    d1, d2 = physical_dim(dim1, b, r), physical_dim(dim2, b, r)
    return x.diagonal(offset, d1, d2), _after_removing(b, [d1, d2])


@register_batch_rule(aten.view_as_real.default)
def view_as_real_rule(info, in_dims, x):
    return torch.view_as_real(x), in_dims[0]


@register_batch_rule(aten.view_as_complex.default)
def view_as_complex_rule(info, in_dims, x):
    b = in_dims[0]
    if logical_rank(x, b) == 0:
        _check_logical(aten.view_as_complex.default, x, b)
    if b == x.dim() - 1:
        x, b = move_bdim_to_front(x, b), 0
    return torch.view_as_complex(x), b


@register_batch_rule(aten.flip.default)
def flip_rule(info, in_dims, x, dims):
    b, r = in_dims[0], logical_rank(x, in_dims[0])
    if r == 0:
        _check_logical(aten.flip.default, x, b, dims)
        return x.clone(), b
    return x.flip([physical_dim(d, b, r) for d in dims]), b


@register_batch_rule(aten.roll.default)
def roll_rule(info, in_dims, x, shifts, dims=()):
    b, r = in_dims[0], logical_rank(x, in_dims[0])
    if len(dims) == 0:  # roll the flattened example
        y = move_bdim_to_front(x, b)
        return y.reshape(y.shape[0], -1).roll(shifts, 1).view(y.shape), 0
    if r == 0:
        _check_logical(aten.roll.default, x, b, shifts, dims)
    return x.roll(shifts, [physical_dim(d, b, r) for d in dims]), b


def _triangle_rule_for(op):
    inplace = writes_self(op)

    def rule(info, in_dims, x, diagonal=0):
        b, r = in_dims[0], logical_rank(x, in_dims[0])
        if r < 2:
            _check_logical(op, x, b, diagonal)
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
    if len(repeats) < logical_rank(x, in_dims[0]):
        _check_logical(aten.repeat.default, x, in_dims[0], repeats)
    y = pad_to_rank(move_bdim_to_front(x, in_dims[0]), len(repeats))
    return y.repeat(1, *repeats), 0


def _is_legacy_empty(t, d) -> bool:
    """cat skips 1-d tensors of size 0 whatever the other inputs' ranks."""
    shape = t.shape if d is None else t.shape[:d] + t.shape[d + 1:]
    return tuple(shape) == (0,)


@register_batch_rule(aten.cat.default)
def cat_rule(info, in_dims, tensors, dim=0):
    dims = in_dims[0]
    legacy = [_is_legacy_empty(t, d) for t, d in zip(tensors, dims)]
    if all(legacy):  # every input is a legacy empty 1-D tensor: concatenate them all
        legacy = [False] * len(legacy)
    first = legacy.index(False)
    rank = logical_rank(tensors[first], dims[first])
    if rank == 0:
        raise RuntimeError("zero-dimensional tensor (at position 0) cannot be concatenated")
    # A legacy empty input is passed on as a physical (0,) tensor, which cat skips too: it
    # still takes part in type promotion and in autograd's graph (eager's output requires grad
    # when only such an input does).
    parts = [(t if d is None else t.reshape(0)) if skip
             else ensure_bdim_front(t, d, info.batch_size)
             for t, d, skip in zip(tensors, dims, legacy)]
    return torch.cat(parts, normalize_dim(dim, rank) + 1), 0


@register_batch_rule(aten.stack.default)
def stack_rule(info, in_dims, tensors, dim=0):
    rank = logical_rank(tensors[0], in_dims[0][0])
    parts = [ensure_bdim_front(t, d, info.batch_size) for t, d in zip(tensors, in_dims[0])]
    return torch.stack(parts, normalize_dim(dim, rank + 1) + 1), 0


def _backward_rule_for(op, dim_args):
    """``op(grad, input_sizes, *args)`` with the logical dims ``args[i]`` for i in
    ``dim_args``: the batch goes first in grad and in the sizes, the dims shift by one."""

    def rule(info, in_dims, grad, input_sizes, *args):
        g = move_bdim_to_front(grad, in_dims[0])
        args = [normalize_dim(a, len(input_sizes)) + 1 if i in dim_args else a
                for i, a in enumerate(args)]
        return op(g, [g.shape[0], *input_sizes], *args), 0
    rule.__name__ = f"backward_rule[{op}]"
    return rule


for _op, _dims in ((aten.select_backward.default, (0,)), (aten.slice_backward.default, (0,)),
                   (aten.diagonal_backward.default, (1, 2))):
    register_batch_rule(_op, _backward_rule_for(_op, _dims))


@register_batch_rule(aten.unfold_backward.default)
def unfold_backward_rule(info, in_dims, grad, input_sizes, dim, size, step):
    if len(input_sizes) == 0:  # a 0-d example unfolds to (size,), size 0 or 1: sum it back
        normalize_dim(dim, 0)
        return grad.sum(1 - in_dims[0]), 0
    return _backward_rule_for(aten.unfold_backward.default, (0,))(
        info, in_dims, grad, input_sizes, dim, size, step)


# ---------------------------------------------------------------------------------------------
# Shape ops that copy: diag_embed (diag, diagflat), rot90, narrow_copy, block_diag.

@register_batch_rule(aten.diag_embed.default)
def diag_embed_rule(info, in_dims, x, offset=0, dim1=-2, dim2=-1):
    y = move_bdim_to_front(x, in_dims[0])
    out_rank = y.dim()  # the logical output has one dim more than the logical input
    d1, d2 = normalize_dim(dim1, out_rank) + 1, normalize_dim(dim2, out_rank) + 1
    if d1 == d2:
        _check_logical(aten.diag_embed.default, x, in_dims[0], offset, dim1, dim2)
    return torch.diag_embed(y, offset, d1, d2), 0


@register_batch_rule(aten.rot90.default)
def rot90_rule(info, in_dims, x, k=1, dims=(0, 1)):
    b = in_dims[0]
    rank = logical_rank(x, b)
    if len(dims) != 2 or rank < 2:
        _check_logical(aten.rot90.default, x, b, k, dims)
    return torch.rot90(x, k, [physical_dim(d, b, rank) for d in dims]), b


@register_batch_rule(aten.narrow_copy.default)
def narrow_copy_rule(info, in_dims, x, dim, start, length):
    b = in_dims[0]
    rank = logical_rank(x, b)
    if not -rank <= dim < rank:
        # eager's own error (a RuntimeError from the CPU kernel; the meta kernel's differs):
        # the dim check does not depend on the sizes, so a tiny example of the same rank will do
        torch.narrow_copy(torch.empty((1,) * rank, dtype=x.dtype), dim, start, length)
    if rank == 0:
        _check_logical(aten.narrow_copy.default, x, b, dim, start, length)
    return torch.narrow_copy(x, physical_dim(dim, b, rank), start, length), b


@register_batch_rule(aten.block_diag.default)
def block_diag_rule(info, in_dims, tensors):
    """Each example's blocks go on the diagonal of its own matrix: each block row is the block
    padded with zeros left and right, and the rows are concatenated (no in-place writes, so
    blocks batched at an outer level mix freely).  0-d blocks are [1, 1], 1-d ones [1, n]."""
    B = info.batch_size
    blocks = []
    for t, d in zip(tensors, in_dims[0]):
        t = ensure_bdim_front(t, d, B)
        if t.dim() > 3:
            raise RuntimeError(f"torch.block_diag: Input tensors must have 2 or fewer "
                               f"dimensions. Input has {t.dim() - 1} dimensions")
        blocks.append(t.reshape(B, 1, 1) if t.dim() == 1 else
                      t.unsqueeze(1) if t.dim() == 2 else t)
    dtype = functools.reduce(torch.promote_types, [t.dtype for t in blocks])
    cols = sum(t.shape[2] for t in blocks)
    rows, c = [], 0
    for t in blocks:
        h, w = t.shape[1], t.shape[2]
        rows.append(torch.cat([t.new_zeros((B, h, c), dtype=dtype), t.to(dtype),
                               t.new_zeros((B, h, cols - c - w), dtype=dtype)], 2))
        c += w
    return torch.cat(rows, 1), 0


def _dense_strides(shape, strides):
    """The strides of a dense tensor of ``shape`` whose dims are laid out in the memory order of
    ``strides`` (largest stride outermost; ties keep the dims' order)."""
    order = sorted(range(len(shape)), key=lambda d: (strides[d], -d) if shape[d] > 1
                   else (-1, -d), reverse=True)
    out, step = [0] * len(shape), 1
    for d in reversed(order):
        out[d] = step
        step *= max(shape[d], 1)
    return tuple(out)


def _fresh_layout(x, b) -> bool:
    """Whether one example's strides, as the wrapper reports them to the function, are those of
    a fresh tensor of its own (dense in its own memory order).  Only then do strides computed
    from ``x.stride()`` (stft, autograd's as_strided views) and strides meant for a fresh
    example (a user's literal ones) address the same elements: for an interleaved batch
    (``in_dims=-1``) they would not, and guessing would be a silent wrong answer."""
    shape, strides = list(x.shape), list(x.stride())
    del shape[b], strides[b]
    return all(n <= 1 or s == d for n, s, d in zip(shape, strides,
                                                   _dense_strides(shape, strides)))


def _fresh_examples(x, b):
    """``(P, numel)``: the batch with each example copied into a fresh block of its own (batch
    first), laid out in the example's memory order, i.e. what eager's ``example.clone()`` is."""
    shape, strides = list(x.shape), list(x.stride())
    B = shape.pop(b)
    del strides[b]
    n = 1
    for s in shape:
        n *= s
    dense = _dense_strides(shape, strides)
    P = x.new_empty_strided((B, *shape), (max(n, 1), *dense))
    P.copy_(move_bdim_to_front(x, b))
    return P, max(n, 1)


def _check_window(size, stride, offset, n):
    end = offset + sum((k - 1) * st for k, st in zip(size, stride) if k > 0)
    if offset < 0 or (0 not in size and end >= n):
        # eager's own error for one example (a fresh tensor of n elements)
        torch.empty(n, device="meta").as_strided(size, stride, offset)
        raise RuntimeError(
            f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset {offset} "
            f"are out of bounds for storage of size {n} (one example's storage)")


def _window_overlaps(size, stride, offset, n) -> bool:
    """Whether two positions of the ``as_strided`` window fall on the same element.  Decided
    on the host from the integers (a device tensor's ``unique()`` would make the host wait for
    the GPU): the window cannot overlap when, dims taken by increasing stride, each stride
    exceeds the span of the dims before it; otherwise the positions are counted on the CPU."""
    dims = sorted((st, k) for k, st in zip(size, stride) if k > 1)
    span = 0
    for st, k in dims:
        if st <= span:
            where = torch.arange(n).as_strided(size, stride, offset).reshape(-1)  # CPU only
            return where.numel() != where.unique().numel()
        span += st * (k - 1)
    return False


def _footprint(size, stride) -> int:
    """How many storage elements a view of ``size`` and ``stride`` spans from its offset
    (ATen's ``storage_size_for``): 0 for an empty view."""
    if any(n == 0 for n in size):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(size, stride))


@register_batch_rule(aten.as_strided.default)
def as_strided_rule(info, in_dims, x, size, stride, storage_offset=None):
    """See Note [as_strided under vmap]: each example's window, at the storage offset asked
    for relative to where example 0's view starts, laid over every example by the batch
    stride; refused when the window leaves example 0's memory."""
    b = in_dims[0]
    if len(size) != len(stride):
        raise FunctransError(
            f"Tensor.as_strided(size={list(size)}, stride={list(stride)}): size and stride "
            f"must have the same length (one stride per dim), got {len(size)} and "
            f"{len(stride)}.")
    base = x.storage_offset()
    offset = base if storage_offset is None else storage_offset
    shape, strides = list(x.shape), list(x.stride())
    del shape[b], strides[b]
    window, example = _footprint(size, stride), _footprint(shape, strides)
    if window and (offset < base or offset + window > base + example):
        call = f"x.as_strided({list(size)}, {list(stride)}, {offset})"
        if not example:
            where = "each example of x has no elements"
        else:
            where = (f"each example of x spans storage elements [{base}, "
                     f"{base + example - 1}] (example 0; the others lie at multiples of the "
                     f"batch stride {x.stride(b)} from it)")
        raise UnsupportedUnderVmap(
            f"vmap: {call} reads storage elements [{offset}, {offset + window - 1}], but "
            f"{where}: the window would reach memory outside the example, which has no "
            "per-example meaning. Keep size, stride and storage_offset within the example "
            "(storage_offset counts from x.storage_offset(), as in eager), or express the "
            "view with view/reshape/select/slice/unfold/diagonal/expand.")
    return x.as_strided((x.shape[b], *size), (x.stride(b), *stride), offset), 0


@register_batch_rule(aten.as_strided_scatter.default)
def as_strided_scatter_rule(info, in_dims, x, src, size, stride, storage_offset=None):
    """Eager writes ``src`` into ``as_strided`` of a fresh clone of ``x``: here, into a fresh
    block per example (see ``_fresh_examples``), out of place (an index_copy into each block's
    storage order), so that a ``src`` batched only at a lower level needs no in-place write."""
    B = info.batch_size
    offset = 0 if storage_offset is None else storage_offset
    b = in_dims[0]
    X = x if b is not None else x.unsqueeze(0).expand(B, *x.shape)
    b = 0 if b is None else b
    if not _fresh_layout(X, b):
        raise Decline()
    P, n = _fresh_examples(X, b)
    _check_window(size, stride, offset, n)
    if _window_overlaps(size, stride, offset, n):
        raise Decline()   # overlapping windows: eager's result depends on the write order
    where = torch.arange(n, device=P.device).as_strided(size, stride, offset).reshape(-1)
    flat = P.as_strided((B, n), (n, 1), 0)
    S = ensure_bdim_front(src, in_dims[1], B).reshape(B, -1).to(P.dtype)
    out = flat.index_copy(1, where, S)
    return out.as_strided(P.shape, P.stride(), 0), 0
