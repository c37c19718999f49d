"""Pooling (issue 4, first part): max_pool{2,3}d_with_indices, avg_pool{2,3}d,
_adaptive_avg_pool{2,3}d, adaptive_max_pool2d and their backward ops.

Invariant: the pools accept an input with or without their own batch dim (``[N, C, *spatial]`` or
``[C, *spatial]``).  The vmap batch is folded into that dim — ``[B, N, C, ...] -> [B*N, C, ...]``,
or ``[B, C, ...]`` used as ``[N, C, ...]`` — so ONE pooling kernel runs; every tensor argument
(input, grad_output, indices) is folded the same way, unbatched ones expanded first.  Indices
stay per plane, so they need no adjustment.

adaptive_max_pool3d and its backward are left to the loop fallback: PyTorch's CPU
adaptive_max_pool3d_backward kernel crashed (segfault) on the folded inputs.
"""
from __future__ import annotations

import torch

from ..helpers import ensure_bdim_front, logical_rank
from ..registry import Decline, register_batch_rule

aten = torch.ops.aten


def _fold_rule_for(op, spatial: int):
    tensor_pos = [i for i, a in enumerate(op._schema.arguments)
                  if a.type.isSubtypeOf(torch._C.TensorType.get())]

    def rule(info, in_dims, *args, **kwargs):
        B = info.batch_size
        ranks = {logical_rank(args[p], in_dims[p]) for p in tensor_pos if p < len(args)}
        if len(ranks) != 1 or next(iter(ranks)) not in (spatial + 1, spatial + 2):
            raise Decline()
        has_n = next(iter(ranks)) == spatial + 2
        new, n = list(args), None
        for p in tensor_pos:
            if p >= len(args):
                continue
            t = ensure_bdim_front(args[p], in_dims[p], B)
            if has_n:
                n = t.shape[1]
                t = t.reshape(B * n, *t.shape[2:])
            new[p] = t
        out = op(*new, **kwargs)

        def unfold(o):
            return o.view(B, n, *o.shape[1:]) if has_n else o
        if isinstance(out, tuple):
            return tuple(unfold(o) for o in out), tuple(0 for _ in out)
        return unfold(out), 0
    rule.__name__ = f"pool_fold_rule[{op}]"
    return rule


for _name, _spatial in (
        ("max_pool2d_with_indices", 2), ("max_pool2d_with_indices_backward", 2),
        ("max_pool3d_with_indices", 3), ("max_pool3d_with_indices_backward", 3),
        ("avg_pool2d", 2), ("avg_pool2d_backward", 2), ("avg_pool3d", 3),
        ("avg_pool3d_backward", 3), ("_adaptive_avg_pool2d", 2),
        ("_adaptive_avg_pool2d_backward", 2), ("_adaptive_avg_pool3d", 3),
        ("_adaptive_avg_pool3d_backward", 3), ("adaptive_max_pool2d", 2),
        ("adaptive_max_pool2d_backward", 2)):
    _op = getattr(aten, _name).default
    register_batch_rule(_op, _fold_rule_for(_op, _spatial))
