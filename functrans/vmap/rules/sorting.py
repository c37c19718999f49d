"""Sorting (issue 4): sort (default and stable) and topk; argsort and msort are
CompositeImplicit and reach these.  Invariant: the sorted dim is the logical dim translated to
a physical one and the bdim stays put; returned indices are logical (per example).  A logically
0-d example gets a temporary size-1 dim."""
from __future__ import annotations

import torch

from ..helpers import logical_rank, normalize_dim, physical_dim
from ..registry import register_batch_rule

aten = torch.ops.aten


def _along(x, bdim, dim, fn):
    r = logical_rank(x, bdim)
    if r == 0:
        normalize_dim(dim, 0)
        values, indices = fn(x.unsqueeze(-1), -1)
        return (values.squeeze(-1), indices.squeeze(-1)), (bdim, bdim)
    return fn(x, physical_dim(dim, bdim, r)), (bdim, bdim)


@register_batch_rule(aten.sort.default)
def sort_rule(info, in_dims, x, dim=-1, descending=False):
    return _along(x, in_dims[0], dim, lambda t, d: aten.sort.default(t, d, descending))


@register_batch_rule(aten.sort.stable)
def sort_stable_rule(info, in_dims, x, *, stable=None, dim=-1, descending=False):
    return _along(x, in_dims[0], dim,
                  lambda t, d: aten.sort.stable(t, stable=stable, dim=d, descending=descending))


@register_batch_rule(aten.topk.default)
def topk_rule(info, in_dims, x, k, dim=-1, largest=True, sorted=True):
    return _along(x, in_dims[0], dim, lambda t, d: aten.topk.default(t, k, d, largest, sorted))
