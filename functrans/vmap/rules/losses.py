"""Losses: nll_loss_forward and nll_loss_backward (what ``F.nll_loss`` and ``F.cross_entropy``
reach for 1-D and 2-D inputs).

Invariants: the batch goes first and each example's targets are gathered in one physical call;
per-example reductions ('sum', 'mean' with its total weight) happen after the gather, so an
example's loss never mixes with another's.  Ignored targets (``ignore_index``) weigh zero.  A
batched class-weight tensor is declined (the loop fallback runs it).
"""
from __future__ import annotations

import torch

from ..helpers import ensure_bdim_front
from ..registry import Decline, register_batch_rule

aten = torch.ops.aten
_NONE, _MEAN, _SUM = 0, 1, 2


def _examples(x, x_bdim, target, t_bdim, size):
    """Inputs as [B, N, C] and targets as [B, N] (N = 1 for a 1-D input)."""
    X = ensure_bdim_front(x, x_bdim, size)
    T = ensure_bdim_front(target, t_bdim, size)
    if X.dim() == 2:
        return X.unsqueeze(1), T.unsqueeze(1), True
    if X.dim() != 3:
        raise Decline()
    return X, T, False


def _target_weights(T, weight, ignore_index, dtype):
    ignored = T == ignore_index
    safe = T.masked_fill(ignored, 0)
    w = torch.ones(T.shape, dtype=dtype, device=T.device) if weight is None else \
        weight.index_select(0, safe.reshape(-1)).view(safe.shape)
    return safe, w.masked_fill(ignored, 0)


@register_batch_rule(aten.nll_loss_forward.default)
def nll_loss_forward_rule(info, in_dims, x, target, weight, reduction, ignore_index):
    if in_dims[2] is not None:
        raise Decline()
    X, T, one_d = _examples(x, in_dims[0], target, in_dims[1], info.batch_size)
    safe, w = _target_weights(T, weight, ignore_index, X.dtype)
    losses = -X.gather(2, safe.unsqueeze(2)).squeeze(2) * w          # [B, N]
    total = w.sum(1)
    if reduction == _NONE:
        return (losses.squeeze(1) if one_d else losses, torch.zeros_like(total)), (0, 0)
    summed = losses.sum(1)
    return (summed if reduction == _SUM else summed / total, total), (0, 0)


@register_batch_rule(aten.nll_loss_backward.default)
def nll_loss_backward_rule(info, in_dims, grad, x, target, weight, reduction, ignore_index,
                           total_weight):
    if in_dims[3] is not None:
        raise Decline()
    B = info.batch_size
    X, T, one_d = _examples(x, in_dims[1], target, in_dims[2], B)
    safe, w = _target_weights(T, weight, ignore_index, X.dtype)
    G = ensure_bdim_front(grad, in_dims[0], B)
    if reduction == _NONE:
        g = G.reshape(B, -1)
    else:
        g = G.reshape(B, 1)
        if reduction == _MEAN:
            g = g / ensure_bdim_front(total_weight, in_dims[6], B).reshape(B, 1)
    values = (-w * g).unsqueeze(2).to(X.dtype)
    out = torch.zeros(X.shape, dtype=X.dtype, device=X.device).scatter(2, safe.unsqueeze(2),
                                                                         values)
    return (out.squeeze(1) if one_d else out), 0
