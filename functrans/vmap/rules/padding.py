"""Padding (first part; issue 4 extends it): constant_pad_nd.

Invariant: the pad list addresses the LAST logical dims; the bdim stays where it is when it lies
before them, otherwise it moves to the front first.
"""
from __future__ import annotations

import torch

from ..helpers import logical_rank, move_bdim_to_front
from ..registry import register_batch_rule

aten = torch.ops.aten


@register_batch_rule(aten.constant_pad_nd.default)
def constant_pad_nd_rule(info, in_dims, x, pad, value=0):
    b = in_dims[0]
    padded_dims = len(pad) // 2
    if padded_dims > logical_rank(x, b):
        raise RuntimeError(
            f"Length of pad should be no more than twice the number of dimensions of the input. "
            f"Pad length is {len(pad)} while the input has {logical_rank(x, b)} dimensions.")
    if b < x.dim() - padded_dims:
        return aten.constant_pad_nd.default(x, pad, value), b
    return aten.constant_pad_nd.default(move_bdim_to_front(x, b), pad, value), 0
