"""Indexing (first part; issue 4 extends it): gather, scatter (src / value, and in-place),
scatter_add, index_select.

Invariants: batched operands get the batch first and unbatched ones are expanded (a view) to
the batch, so one physical gather/scatter runs along the logical dim + 1; in-place forms write
into a view of the physical self.  Logically 0-d operands get a temporary size-1 dim.
"""
from __future__ import annotations

import torch

from ..helpers import ensure_bdim_front, logical_rank, move_bdim_to_front, normalize_dim
from ..registry import register_batch_rule

aten = torch.ops.aten


@register_batch_rule(aten.gather.default)
def gather_rule(info, in_dims, x, dim, index, *, sparse_grad=False):
    B = info.batch_size
    r = logical_rank(x, in_dims[0])
    X, I = ensure_bdim_front(x, in_dims[0], B), ensure_bdim_front(index, in_dims[2], B)
    if r == 0:
        normalize_dim(dim, 0)
        return X.unsqueeze(1).gather(1, I.reshape(B, 1)).reshape(I.shape), 0
    return X.gather(normalize_dim(dim, r) + 1, I), 0


def _scatter_rule_for(op):
    inplace = op._schema.arguments[0].alias_info is not None

    def rule(info, in_dims, x, dim, index, src, *args, **kwargs):
        B = info.batch_size
        r = logical_rank(x, in_dims[0])
        I = ensure_bdim_front(index, in_dims[2], B)
        S = ensure_bdim_front(src, in_dims[3], B) if isinstance(src, torch.Tensor) else src
        X = move_bdim_to_front(x, in_dims[0]) if inplace else ensure_bdim_front(x, in_dims[0], B)
        d = normalize_dim(dim, r) + 1
        if r == 0:
            X1, I1 = X.unsqueeze(1), I.reshape(B, 1)
            S1 = S.reshape(B, 1) if isinstance(S, torch.Tensor) else S
            out = op(X1, 1, I1, S1, *args, **kwargs)
            return (x, in_dims[0]) if inplace else (out.reshape(B), 0)
        out = op(X, d, I, S, *args, **kwargs)
        return (x, in_dims[0]) if inplace else (out, 0)
    rule.__name__ = f"scatter_rule[{op}]"
    return rule


for _op in (aten.scatter.src, aten.scatter.value, aten.scatter_.src, aten.scatter_.value,
            aten.scatter_add.default, aten.scatter_add_.default):
    register_batch_rule(_op, _scatter_rule_for(_op))


@register_batch_rule(aten.index_select.default)
def index_select_rule(info, in_dims, x, dim, index):
    B = info.batch_size
    r = logical_rank(x, in_dims[0])
    d = normalize_dim(dim, r)
    if in_dims[2] is None:
        if r == 0:
            return x.unsqueeze(-1).index_select(-1, index).reshape(x.shape), in_dims[0]
        pd = d + (d >= in_dims[0])
        return x.index_select(pd, index), in_dims[0]
    X = ensure_bdim_front(x, in_dims[0], B)
    I = move_bdim_to_front(index, in_dims[2]).reshape(B, -1)
    if r == 0:
        return X.unsqueeze(1).gather(1, I).reshape(B), 0  # a 0-d self stays 0-d, as in eager
    shape = list(X.shape)
    shape[d + 1] = I.shape[1]
    view = [B] + [1] * r
    view[d + 1] = I.shape[1]
    return X.gather(d + 1, I.view(view).expand(shape)), 0
