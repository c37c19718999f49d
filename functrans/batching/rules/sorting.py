"""Sorting and searching: sort (default and stable) and topk (argsort and msort are
CompositeImplicit and reach these); searchsorted and bucketize (Tensor and Scalar overloads).

Invariants: the sorted dim is the logical dim translated to a physical one and the bdim stays
put; returned indices are logical (per example).  A logically 0-d example gets a temporary
size-1 dim.  Searching never lets one example's values see another's boundaries (see below).
"""
from __future__ import annotations

import torch

from ..helpers import (ensure_bdim_front, logical_rank, normalize_dim, physical_dim,
                       without_internal_overlap)
from ..registry import Decline, registrar

aten = torch.ops.aten
register_batch_rule = registrar("sorting")   # the rules below live in this file


def _along(x, bdim, dim, fn):
    # sort orders ties differently on an expanded input (See Note [layout-dependent kernels]).
    x = without_internal_overlap(x)
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


# ---------------------------------------------------------------------------------------------
# searchsorted / bucketize.  A shared 1-D boundary tensor searches a batched input as is (the
# cheap case); otherwise the boundaries get the batch first and the N-D form runs: each
# example's boundaries are one row, searched by that example's values only.

def _scalar_as_tensor(value, device):
    """What ATen makes of a Scalar argument (a Python float is a double), filled on the
    device (``torch.tensor(value, device=...)`` would copy it from the host: a sync on a GPU)."""
    dtype = torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) \
        else torch.complex128 if isinstance(value, complex) else torch.float64
    return torch.full((), value, dtype=dtype, device=device)


def _search_rows(info, seq, seq_bdim, values, v_bdim, sorter, **flags):
    """searchsorted with per-example boundaries (``seq`` batched or N-D); output bdim 0."""
    B = info.batch_size
    S = ensure_bdim_front(seq, seq_bdim, B)
    V = ensure_bdim_front(values, v_bdim, B)
    if sorter is not None:
        sorter = sorter.expand(S.shape).contiguous()
    if S.dim() == 2:   # 1-D boundaries per example, values of any shape
        out = aten.searchsorted.Tensor(S.contiguous(), V.reshape(B, -1).contiguous(),
                                       sorter=sorter, **flags)
        return out.reshape(V.shape), 0
    return aten.searchsorted.Tensor(S.contiguous(), V.contiguous(), sorter=sorter, **flags), 0


@register_batch_rule(aten.searchsorted.Tensor, batched_kwargs=True)  # sorter= may be batched
def searchsorted_rule(info, in_dims, seq, values, *, out_int32=False, right=False, side=None,
                      sorter=None, _kw_dims=None):
    flags = dict(out_int32=out_int32, right=right, side=side)
    sorter_dim = (_kw_dims or {}).get("sorter")
    if sorter_dim is not None:  # per-example sorters: per-example rows of boundaries
        sorter = ensure_bdim_front(sorter, sorter_dim, info.batch_size)
        seq = ensure_bdim_front(seq, in_dims[0], info.batch_size)
        return _search_rows(info, seq, 0, values, in_dims[1], sorter, **flags)
    if in_dims[0] is None and seq.dim() == 1:
        return aten.searchsorted.Tensor(seq, values, sorter=sorter, **flags), in_dims[1]
    return _search_rows(info, seq, in_dims[0], values, in_dims[1], sorter, **flags)



@register_batch_rule(aten.searchsorted.Scalar)
def searchsorted_scalar_rule(info, in_dims, seq, value, *, out_int32=False, right=False,
                             side=None, sorter=None):
    if seq.dim() != 2:
        raise Decline()   # eager accepts a Scalar only with 1-D boundaries: its error
    out, _ = _search_rows(info, seq, in_dims[0], _scalar_as_tensor(value, seq.device), None,
                          sorter, out_int32=out_int32, right=right, side=side)
    return out, 0


@register_batch_rule(aten.bucketize.Tensor)
def bucketize_rule(info, in_dims, values, boundaries, *, out_int32=False, right=False):
    if in_dims[1] is None:
        return aten.bucketize.Tensor(values, boundaries, out_int32=out_int32, right=right), \
            in_dims[0]
    if boundaries.dim() != 2:
        raise Decline()   # eager's error for boundaries that are not 1-D
    return _search_rows(info, boundaries, in_dims[1], values, in_dims[0], None,
                        out_int32=out_int32, right=right)


@register_batch_rule(aten.bucketize.Scalar)
def bucketize_scalar_rule(info, in_dims, value, boundaries, *, out_int32=False, right=False):
    if boundaries.dim() != 2:
        raise Decline()
    return _search_rows(info, boundaries, in_dims[1],
                        _scalar_as_tensor(value, boundaries.device), None, None,
                        out_int32=out_int32, right=right)
