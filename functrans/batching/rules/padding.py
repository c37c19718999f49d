"""Padding: constant_pad_nd, reflection_pad{1,2,3}d, replication_pad{1,2,3}d and the
reflection/replication backward ops.  (Circular padding is CompositeImplicitAutograd: it
decomposes into slicing and cat.)

Invariants:
* constant_pad_nd: the pad list addresses the LAST logical dims; the bdim stays where it is when
  it lies before them, otherwise it moves to the front first.
* reflection/replication kernels take ``[N, C, *spatial]`` or ``[C, *spatial]`` and pad every
  plane on its own: the batch folds into ``N`` or serves as ``N`` (``spatial.fold_into_n_rule``);
  any other logical rank is declined so the loop fallback raises PyTorch's error.
"""
from __future__ import annotations

import torch

from ..helpers import logical_rank, move_bdim_to_front
from ..registry import registrar
from .spatial import fold_into_n_rule

aten = torch.ops.aten
register_batch_rule = registrar("padding")   # the rules below live in this file


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


# Reflection and replication padding (and their backward ops) accept ``[N, C, *spatial]`` or
# ``[C, *spatial]`` and pad each plane on its own: the batch folds into N (or serves as N).
for _kind in ("reflection", "replication"):
    for _spatial in (1, 2, 3):
        for _suffix in ("", "_backward"):
            _op = getattr(aten, f"{_kind}_pad{_spatial}d{_suffix}").default
            register_batch_rule(_op, fold_into_n_rule(_op, (_spatial + 1, _spatial + 2)))
