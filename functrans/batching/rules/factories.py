"""Ops that create a tensor from a batched one: ``zeros_like``, ``ones_like``, ``empty_like``,
``full_like``, ``new_zeros``, ``new_ones``, ``new_empty``, ``new_full``, ``new_empty_strided``,
and the functional fills ``zero``, ``fill.Scalar``, ``fill.Tensor``.

Invariants:
* the result is BATCHED, one fresh block of memory per example (as PyTorch's own vmap does), so
  an in-place write into it later (``z = torch.zeros_like(x); z.copy_(y)``) works;
* ``dtype``/``device``/``layout``/``pin_memory`` are passed through; defaults come from the
  physical input, which has the logical input's dtype and device;
* ``*_like`` (and the fills) keep the input's bdim and physical layout; ``new_*`` put the batch
  first, with each example contiguous (``new_empty_strided``: with the strides asked for).

Note [memory_format of *_like]
A ``memory_format`` describes ONE example, and a physical tensor with a batch dim cannot carry
it (channels_last is a 4-D format; the physical tensor of a logical 4-D one is 5-D).  So the
batch goes first (outermost in memory) and the logical dims are laid out in the format's order
inside each example: the logical result has exactly the strides, and the values, that eager
gives one example (``z.is_contiguous(memory_format=torch.channels_last)`` holds inside the
function).  The order is read off the strides eager gives an empty example of that shape, so a
format that does not fit the rank raises eager's own error.

Random ``*_like`` ops live in random.py.
"""
from __future__ import annotations

import torch

from ..batched_tensor import BatchedTensor
from ..helpers import ensure_bdim_front, keep_bdim_rule, move_bdim_to_front, pad_to_rank
from ..registry import Decline, registrar

aten = torch.ops.aten
register_batch_rule = registrar("factories")   # the rules below live in this file


def _dim_order(shape, memory_format):
    """Logical dims from outermost to innermost in eager's layout for ``memory_format``."""
    strides = torch.empty(shape, device="meta", memory_format=memory_format).stride()
    return sorted(range(len(shape)), key=lambda d: -strides[d])


def _like_rule_for(op):
    def rule(info, in_dims, x, *args, memory_format=None, **kwargs):
        if memory_format in (None, torch.preserve_format):
            return op(x, *args, **kwargs), in_dims[0]
        x = move_bdim_to_front(x, in_dims[0])  # See Note [memory_format of *_like]
        perm = [0] + [d + 1 for d in _dim_order(x.shape[1:], memory_format)]
        out = op(x.permute(perm), *args, memory_format=torch.contiguous_format, **kwargs)
        return out.permute(sorted(range(len(perm)), key=perm.__getitem__)), 0
    rule.__name__ = f"like_rule[{op}]"
    return rule


for _op in (aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
            aten.full_like.default):
    register_batch_rule(_op, _like_rule_for(_op))


def _new_rule_for(op):
    def rule(info, in_dims, x, size, *args, **kwargs):
        return op(x, (info.batch_size, *size), *args, **kwargs), 0
    rule.__name__ = f"new_rule[{op}]"
    return rule


for _op in (aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default,
            aten.new_full.default):
    register_batch_rule(_op, _new_rule_for(_op))


@register_batch_rule(aten.new_empty_strided.default)
def new_empty_strided_rule(info, in_dims, x, size, stride, **kwargs):
    """Each example gets its own block, as large as the strides of one example reach."""
    extent = 0 if 0 in size else 1 + sum((s - 1) * st for s, st in zip(size, stride))
    return aten.new_empty_strided.default(x, (info.batch_size, *size),
                                          (max(extent, 1), *stride), **kwargs), 0


for _op in (aten.zero.default, aten.fill.Scalar):
    register_batch_rule(_op, keep_bdim_rule(_op))


@register_batch_rule(aten.fill.Tensor)
def fill_tensor_rule(info, in_dims, x, value):
    """``value`` is logically 0-d; a batched one gives each example its own fill value."""
    xd, vd = in_dims
    if vd is None:
        return aten.fill.Tensor(x, value), xd
    shape = x.shape if xd is None else move_bdim_to_front(x, xd).shape[1:]
    value = pad_to_rank(move_bdim_to_front(value, vd), len(shape))
    value = value.to(device=x.device, dtype=x.dtype)
    return value.expand(info.batch_size, *shape).clone(memory_format=torch.contiguous_format), 0


# ---------------------------------------------------------------------------------------------
# linspace / logspace with tensor endpoints: a batched 0-d start or end gives each example its
# own range.  The values follow eager's kernel: start + step * i for the first half of the
# points and end - step * (steps - 1 - i) for the rest (logspace: base to those powers).  Like
# eager, the result is made on ``device`` or else the default device, whatever device the
# endpoints are on (eager reads them as numbers); endpoints on another device are copied there.

def _space(info, in_dims, start, end, steps, base, dtype, device):
    dtype = dtype or torch.get_default_dtype()
    if not dtype.is_floating_point:
        raise Decline()  # integer ranges round per element in eager's own way: the loop
    B = info.batch_size

    def column(v, d):
        if isinstance(v, torch.Tensor):
            v = v.to(dtype=dtype, device=device)
            return (v if d is None else v.movedim(d, 0)).reshape(-1, 1).expand(B, 1)
        return torch.full((B, 1), v, dtype=dtype, device=device)

    lo, hi = column(start, in_dims[0]), column(end, in_dims[1])
    if steps == 1:
        points = lo.clone()
    else:
        i = torch.arange(steps, device=lo.device, dtype=dtype).expand(B, steps)
        step = (hi - lo) / (steps - 1)
        points = torch.where(i < steps // 2, lo + step * i, hi - step * (steps - 1 - i))
    return (points if base is None else torch.pow(base, points)), 0


def _space_rule(base_arg: bool):
    def rule(info, in_dims, start, end, steps, *rest, dtype=None, layout=None, device=None,
             pin_memory=None):
        base = rest[0] if base_arg and rest else (10.0 if base_arg else None)
        dev = torch.device(device) if device is not None else torch.get_default_device()
        return _space(info, in_dims, start, end, steps, base, dtype, dev)
    return rule


for _name in ("Tensor_Tensor", "Tensor_Scalar", "Scalar_Tensor"):
    register_batch_rule(getattr(torch.ops.aten.linspace, _name), _space_rule(False))
    register_batch_rule(getattr(torch.ops.aten.logspace, _name), _space_rule(True))


def _symbolic(t: torch.Tensor) -> bool:
    """Whether ``t``'s sizes, strides or storage offset are traced as SymInts."""
    if any(isinstance(s, torch.SymInt) for s in t.shape):
        return True
    return t.layout is torch.strided and (
        isinstance(t.storage_offset(), torch.SymInt)
        or any(isinstance(s, torch.SymInt) for s in t.stride()))


def _new_zeros_with_same_feature_meta(self, other, *, self_num_batch_dims=0):
    """ATen's ``_new_zeros_with_same_feature_meta``; on plain tensors with symbolic sizes, its
    formula in Python: the ATen kernel reads ``other``'s storage offset as an int, which
    raises for sizes traced as SymInts (``make_fx(..., tracing_mode="symbolic")``).  A wrapper
    of an outer level goes to the ATen op, so that level's rule sees its physical values."""
    if type(self) is BatchedTensor or type(other) is BatchedTensor or \
            other.layout is not torch.strided or not (_symbolic(self) or _symbolic(other)):
        return aten._new_zeros_with_same_feature_meta.default(
            self, other, self_num_batch_dims=self_num_batch_dims)
    # ``self``'s batch dims go in front, one slice laid out like ``other`` after another.  A
    # slice spans ``other``'s extent, where ATen's kernel spans ``other``'s whole storage
    # (``untyped_storage().nbytes()``): a fake tensor's storage size is a SymInt make_fx never
    # traced, and rebuilt from its formula it loses factors (PyTorch 2.13 rebuilds a product
    # of three symbols wrongly), so the graph allocated too little memory at replay.  A slice
    # smaller than ``other``'s storage costs forward AD at most a copy (``has_same_meta``).
    storage_numel = other.storage_offset() + (1 + sum(
        (n - 1) * st for n, st in zip(other.shape, other.stride())) if other.numel() else 0)
    sizes = list(self.shape[:self_num_batch_dims]) + list(other.shape)
    strides = list(other.stride())
    total = storage_numel
    for size in reversed(self.shape[:self_num_batch_dims]):
        strides.insert(0, total)
        total = total * size
    return other.new_zeros(total).as_strided(sizes, strides, other.storage_offset())


@register_batch_rule(aten._new_zeros_with_same_feature_meta.default)
def new_zeros_with_same_feature_meta_rule(info, in_dims, self, other, *,
                                          self_num_batch_dims=0):
    """Forward AD's tangent buffer: zeros shaped like ``self``'s leading dims + ``other``'s
    (feature) dims, laid out like ``other``.  The vmap batch is one more leading batch dim of
    ``self``; a batched ``other`` carries its batch inside its own layout."""
    op = _new_zeros_with_same_feature_meta
    if in_dims[1] is not None:
        # Laid out like ``other``'s physical value (its batch dim kept where it is), so each
        # example's strides and storage offset are ``other``'s: forward AD compares them
        # (has_same_meta) for every view of a dual tensor.  Only the sizes of ``self``'s
        # leading dims matter, and they are the same for every example.
        if self_num_batch_dims and in_dims[0] is not None:
            self = self.select(in_dims[0], 0)
        return op(self, other, self_num_batch_dims=self_num_batch_dims), \
            in_dims[1] + self_num_batch_dims
    front = ensure_bdim_front(self, in_dims[0], info.batch_size)
    return op(front, other, self_num_batch_dims=self_num_batch_dims + 1), 0
