"""Ops that create a tensor from a batched one: zeros_like, ones_like, empty_like, full_like,
new_zeros, new_ones, new_empty, new_full, new_empty_strided.

Invariant: the result is BATCHED, one fresh tensor per example (as PyTorch's own vmap does), so
that an in-place write into it later (``z = torch.zeros_like(x); z.copy_(y)``) works.
``*_like`` keep the input's bdim and physical layout; ``new_*`` put the batch first.  A
``memory_format`` other than preserve applies to each example: the batch goes first and the
logical dims get the format's order where the physical rank allows (channels_last on a logical
4-D tensor cannot be a physical 5-D format, so those examples are contiguous; values are equal).
Random ``*_like`` ops live in random.py.
"""
from __future__ import annotations

import torch

from ..helpers import move_bdim_to_front
from ..registry import register_batch_rule

aten = torch.ops.aten


def _like_rule_for(op):
    def rule(info, in_dims, x, *args, **kwargs):
        fmt = kwargs.get("memory_format")
        if fmt is None or fmt == torch.preserve_format:
            return op(x, *args, **kwargs), in_dims[0]
        kwargs["memory_format"] = torch.contiguous_format
        return op(move_bdim_to_front(x, in_dims[0]), *args, **kwargs), 0
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
    # Strides describe one example; each example gets its own contiguous block after them.
    block = max([1] + [(s - 1) * st + 1 for s, st in zip(size, stride) if s > 0]) \
        if all(s > 0 for s in size) else 0
    return aten.new_empty_strided.default(x, (info.batch_size, *size), (block, *stride),
                                          **kwargs), 0
