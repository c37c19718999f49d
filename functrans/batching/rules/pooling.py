"""Pooling: max_pool{2,3}d_with_indices, avg_pool{2,3}d, _adaptive_avg_pool{2,3}d,
adaptive_max_pool2d and their backward ops; max_unpool{2,3}d (``F.max_unpool1d`` runs
max_unpool2d; their backward is a gather, batched elsewhere).

Invariant: the pools accept an input with or without their own batch dim (``[N, C, *spatial]``
or ``[C, *spatial]``).  The vmap batch is folded into that dim — ``[B, N, C, ...] ->
[B*N, C, ...]``, or ``[B, C, ...]`` used as ``[N, C, ...]`` — so ONE pooling kernel runs
(``spatial.fold_into_n_rule``); every tensor argument (input, grad_output, indices) is folded
the same way, unbatched ones expanded first.  Indices stay per plane, so they need no
adjustment.  (max_unpool with duplicate indices in one plane carrying different values is
ill-defined: PyTorch's own kernel result then depends on the order it visits them; its
contiguous path keeps each plane in order on one thread, its channels_last path splits a plane
over threads, so max_unpool2d gets folded contiguous tensors: each example's duplicates resolve
as they do for that example alone, made contiguous.)

adaptive_max_pool3d's forward runs by its decomposition (torch 2.13's ``torch._decomp``; on a
torch without one, 2.11, by the same fold rule as adaptive_max_pool2d); its backward is left to
the loop fallback: PyTorch's CPU adaptive_max_pool3d_backward kernel crashed (segfault) on the
folded inputs.
"""
from __future__ import annotations

import torch
from torch._decomp import decomposition_table

from ..registry import registrar
from .spatial import fold_into_n_rule

aten = torch.ops.aten
register_batch_rule = registrar("pooling")   # the rules below live in this file


for _name, _spatial in (
        ("max_pool2d_with_indices", 2), ("max_pool2d_with_indices_backward", 2),
        ("max_pool3d_with_indices", 3), ("max_pool3d_with_indices_backward", 3),
        ("avg_pool2d", 2), ("avg_pool2d_backward", 2), ("avg_pool3d", 3),
        ("avg_pool3d_backward", 3), ("_adaptive_avg_pool2d", 2),
        ("_adaptive_avg_pool2d_backward", 2), ("_adaptive_avg_pool3d", 3),
        ("_adaptive_avg_pool3d_backward", 3), ("adaptive_max_pool2d", 2),
        ("adaptive_max_pool2d_backward", 2), ("max_unpool3d", 3)):
    _op = getattr(aten, _name).default
    register_batch_rule(_op, fold_into_n_rule(_op, (_spatial + 1, _spatial + 2)))

# max_unpool2d's channels_last path resolves duplicate indices (two values for one output
# element) in another order than its contiguous path, from call to call (its threads split a
# plane): folded tensors are made contiguous, so each plane keeps its example's contiguous
# order (See Note [layout-dependent kernels]).  max_unpool3d has no channels_last path.
register_batch_rule(aten.max_unpool2d.default,
                    fold_into_n_rule(aten.max_unpool2d.default, (3, 4), contiguous=True))

# torch 2.11 has no torch._decomp decomposition of adaptive_max_pool3d (2.13 has): fold it there.
if aten.adaptive_max_pool3d.default not in decomposition_table:
    register_batch_rule(aten.adaptive_max_pool3d.default,
                        fold_into_n_rule(aten.adaptive_max_pool3d.default, (4, 5)))

# fractional_max_pool*_backward read grad, input and indices as contiguous memory.
for _name, _spatial in (("fractional_max_pool2d_backward", 2),
                        ("fractional_max_pool3d_backward", 3)):
    _op = getattr(aten, _name).default
    register_batch_rule(_op, fold_into_n_rule(_op, (_spatial + 1, _spatial + 2),
                                              contiguous=True))
