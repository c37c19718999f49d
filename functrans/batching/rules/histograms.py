"""Histograms: histc, histogram (bins_tensor, bin_ct), histogramdd's kernels
(_histogramdd_bin_edges, _histogramdd_from_bin_cts, _histogramdd_from_bin_tensors) and
segment_reduce with its backward.

Every example's histogram is independent: each example's elements are flattened into one row,
each element's bin is computed exactly as the CPU kernel computes it, and one ``scatter_add``
per batch adds the elements (or their weights) into their own example's row of bins.

Invariants (exactness):
* histc: the bin is ``trunc((x - lo) * bins / (hi - lo))`` in the input's dtype with ``lo`` and
  ``hi`` rounded to that dtype (what the kernel reads off its linspace edges); the last edge
  belongs to the last bin; elements outside [lo, hi] and NaN are skipped.  With min == max the
  range is each example's own [min, max] (widened by 1 when empty of width), computed per row;
* histogram with a bins tensor: the bin is ``searchsorted(edges, x, right=True) - 1`` (the
  kernel's binary search); batched edges search per example;
* histogram with a bin count and a range: the edges are the kernel's own linspace, the bin is
  the interpolated guess corrected by the kernel's local search over the neighbouring edges;
* density divides by each example's own total and the bin widths.

Declined (the loop fallback runs them, and eager raises its own errors): dtypes other than
float32/float64 (the kernel's half-precision arithmetic is not replicated), invalid or
non-finite ranges, histogram.bin_ct / histogramdd without a range (their edges depend on each
example's data and the kernel's vectorized linspace is not replicated),
and a data-dependent histc range whose finiteness cannot be checked (nested vmap).
"""
from __future__ import annotations

import math
import struct

import torch

from ..batched_tensor import BatchedTensor
from ..helpers import ensure_bdim_front
from ..registry import Decline, registrar

aten = torch.ops.aten
register_batch_rule = registrar("histograms")   # the rules below live in this file
_EXACT_DTYPES = (torch.float32, torch.float64)


def _rows(x, bdim, size):
    X = ensure_bdim_front(x, bdim, size)
    if X.dtype not in _EXACT_DTYPES:
        raise Decline()
    return X.reshape(size, -1)


def _accumulate(X, pos, in_range, n_bins, weight=None):
    """Per-example sums of ones (or weights) into ``n_bins`` bins: [B, n_bins]."""
    src = torch.ones_like(X) if weight is None else weight
    src = torch.where(in_range, src, torch.zeros_like(src))
    idx = pos.clamp(0, n_bins - 1).masked_fill(~in_range, 0)
    return X.new_zeros((X.shape[0], n_bins)).scatter_add(1, idx, src)


def _linear_bins(X, lo, hi, n_bins):
    """The kernel's interpolated bin of every element (``lo``/``hi`` in X's dtype)."""
    guess = (X - lo) * n_bins / (hi - lo)
    return guess.nan_to_num(0.0, 0.0, 0.0).clamp(0, n_bins).to(torch.int64)


def _data_range(X, widen):
    """Each row's own [min, max] as [B, 1] tensors, widened when a row's range is empty."""
    if isinstance(X, BatchedTensor):
        raise Decline()   # finiteness below needs concrete values
    lo, hi = X.aminmax(dim=1)
    empty = lo == hi
    lo, hi = torch.where(empty, lo - widen, lo), torch.where(empty, hi + widen, hi)
    if not bool(torch.isfinite(lo).all() & torch.isfinite(hi).all()):
        raise Decline()
    return lo.unsqueeze(1), hi.unsqueeze(1)


def _rounded(v: float, dtype: torch.dtype) -> float:
    """``v`` rounded to ``dtype`` (float32 or float64) on the host, as the kernel's cast rounds
    it (C's conversion, which struct's "f" format uses): infinite when it overflows."""
    if dtype == torch.float64:
        return v
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def _shared_range(X, lo, hi, widen):
    """The range given as numbers, rounded to X's dtype and checked on the host, as numbers
    (tensors are filled on X's device from them: neither a value read nor a host-to-device
    copy, so nothing makes the host wait for a GPU)."""
    if lo == hi:
        lo, hi = lo - widen, hi + widen
    lo, hi = _rounded(lo, X.dtype), _rounded(hi, X.dtype)
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi
            and math.isfinite(_rounded(hi - lo, X.dtype))):
        raise Decline()   # eager's error, or a width that overflows the dtype: the loop
    return lo, hi


@register_batch_rule(aten.histc.default)
def histc_rule(info, in_dims, x, bins=100, min=0, max=0):
    X = _rows(x, in_dims[0], info.batch_size)
    if min == max and X.shape[1] > 0:
        lo, hi = _data_range(X, 1)
    else:
        lo, hi = (torch.full((), v, dtype=X.dtype, device=X.device)
                  for v in _shared_range(X, float(min), float(max), 1))
    in_range = (X >= lo) & (X <= hi)
    return _accumulate(X, _linear_bins(X, lo, hi, bins), in_range, bins), 0


def _finish(hist, edges, density):
    """``hist`` [B, n] of every example; edges [B, n + 1] or shared [n + 1]."""
    if density:
        hist = hist / hist.sum(1, keepdim=True) / edges.diff(dim=-1)
    return hist


def _weights(weight, w_bdim, size, X):
    if weight is None:
        return None
    W = ensure_bdim_front(weight, w_bdim, size)
    if W.dtype != X.dtype:
        raise Decline()
    return W.reshape(X.shape)


@register_batch_rule(aten.histogram.bins_tensor)
def histogram_bins_tensor_rule(info, in_dims, x, bins, *, weight=None, density=False):
    B = info.batch_size
    X = _rows(x, in_dims[0], B)
    edges = bins if in_dims[1] is None else ensure_bdim_front(bins, in_dims[1], B)
    if bins.dtype != X.dtype or edges.dim() != 1 + (in_dims[1] is not None) \
            or edges.shape[-1] == 0:
        raise Decline()   # eager's errors
    E = edges.expand(B, -1).contiguous()
    n_bins = E.shape[1] - 1
    pos = torch.searchsorted(E, X.contiguous(), right=True) - 1
    in_range = (X >= E[:, :1]) & (X <= E[:, -1:])
    pos = torch.where(pos == n_bins, pos - 1, pos)
    hist = _finish(_accumulate(X, pos, in_range, n_bins, _weights(weight, None, B, X)), edges,
                   density)
    if in_dims[1] is None:
        return (hist, bins.clone()), (0, None)
    return (hist, edges.clone()), (0, 0)


def _local_search(X, edges, bins):
    """The kernel's bin for linspace ``edges``: the interpolated guess, corrected by a search
    for the last edge <= x among edges[guess - 1 : guess + 2]; and which elements count."""
    lo, hi = edges[0], edges[-1]
    guess = _linear_bins(X, lo, hi, bins)
    first = (guess - 1).clamp(min=0)
    stop = (guess + 2).clamp(max=bins + 1)
    below = torch.zeros_like(guess)
    for step in (0, 1, 2):
        k = first + step
        below = below + ((k < stop) & (edges[k.clamp(max=bins)] <= X)).to(torch.int64)
    pos = first + below - 1
    return torch.where(pos == bins, pos - 1, pos), (X >= lo) & (X <= hi)


@register_batch_rule(aten.histogram.bin_ct)
def histogram_bin_ct_rule(info, in_dims, x, bins=100, *, range=None, weight=None,
                          density=False):
    B = info.batch_size
    X = _rows(x, in_dims[0], B)
    if range is None or len(range) != 2 or bins <= 0:
        raise Decline()
    lo, hi = _shared_range(X, float(range[0]), float(range[1]), 0.5)
    edges = torch.linspace(lo, hi, bins + 1, dtype=X.dtype, device=X.device)
    pos, in_range = _local_search(X, edges, bins)
    hist = _finish(_accumulate(X, pos, in_range, bins, _weights(weight, None, B, X)), edges,
                   density)
    return (hist, edges), (0, None)


# ---------------------------------------------------------------------------------------------
# histogramdd: rows of D coordinates; each coordinate's bin as above, combined into one flat bin.

def _points(x, bdim, size):
    X = ensure_bdim_front(x, bdim, size)
    if X.dtype not in _EXACT_DTYPES or X.dim() < 3:
        raise Decline()   # eager's error for 0-d / 1-d examples
    return X.reshape(size, -1, X.shape[-1])


def _histogram_dd(X, positions, in_range, sizes, weight, edges, density):
    """[B, *sizes] histograms from per-dim bins ([B, M] each) of [B, M, D] points."""
    B, M = X.shape[:2]
    flat = torch.zeros((B, M), dtype=torch.int64, device=X.device)
    for pos, n in zip(positions, sizes):
        flat = flat * n + pos.clamp(0, n - 1)
    W = None if weight is None else ensure_bdim_front(weight, None, B).reshape(B, M)
    if W is not None and W.dtype != X.dtype:
        raise Decline()
    n_total = 1
    for n in sizes:
        n_total *= n
    hist = _accumulate(X[..., 0], flat, in_range, n_total, W).reshape((B,) + tuple(sizes))
    if density:
        hist = hist / hist.flatten(1).sum(1).reshape((B,) + (1,) * len(sizes))
        for d, e in enumerate(edges):
            shape = [1] * len(sizes)
            shape[d] = -1
            widths = e.diff(dim=-1)
            hist = hist / widths.reshape(([widths.shape[0]] if widths.dim() == 2 else [1])
                                         + shape)
    return hist


def _shared_edges(x, bdim, bins, range, density):
    """The edges for a given range do not depend on the data: one example's edges are all's."""
    if range is None:
        raise Decline()   # per-example edges from each example's own data
    return aten._histogramdd_bin_edges.default(x.select(bdim, 0), bins, range=range,
                                               density=density)


@register_batch_rule(aten._histogramdd_bin_edges.default)
def histogramdd_bin_edges_rule(info, in_dims, x, bins, *, range=None, weight=None,
                               density=False):
    edges = _shared_edges(x, in_dims[0], bins, range, density)
    return edges, [None] * len(edges)


@register_batch_rule(aten._histogramdd_from_bin_cts.default)
def histogramdd_from_bin_cts_rule(info, in_dims, x, bins, *, range=None, weight=None,
                                  density=False):
    X = _points(x, in_dims[0], info.batch_size)
    edges = _shared_edges(x, in_dims[0], bins, range, density)
    if len(edges) != X.shape[-1]:
        raise Decline()
    positions, in_range = [], torch.ones(X.shape[:2], dtype=torch.bool, device=X.device)
    for d, (e, n) in enumerate(zip(edges, bins)):
        pos, ok = _local_search(X[..., d], e, n)
        positions.append(pos)
        in_range = in_range & ok
    return _histogram_dd(X, positions, in_range, list(bins), weight, edges, density), 0


@register_batch_rule(aten._histogramdd_from_bin_tensors.default)
def histogramdd_from_bin_tensors_rule(info, in_dims, x, bins, *, weight=None, density=False):
    B = info.batch_size
    X = _points(x, in_dims[0], B)
    bdims = in_dims[1] if isinstance(in_dims[1], list) else [None] * len(bins)
    if len(bins) != X.shape[-1] or any(b.dtype != X.dtype for b in bins):
        raise Decline()
    edges = [b if d is None else ensure_bdim_front(b, d, B) for b, d in zip(bins, bdims)]
    if any(e.dim() != 1 + (d is not None) or e.shape[-1] == 0 for e, d in zip(edges, bdims)):
        raise Decline()
    positions, in_range = [], torch.ones(X.shape[:2], dtype=torch.bool, device=X.device)
    for d, e in enumerate(edges):
        E = e.expand(B, -1).contiguous()
        coord = X[..., d].contiguous()
        pos = torch.searchsorted(E, coord, right=True) - 1
        positions.append(torch.where(pos == E.shape[1] - 1, pos - 1, pos))
        in_range = in_range & (coord >= E[:, :1]) & (coord <= E[:, -1:])
    sizes = [e.shape[-1] - 1 for e in edges]
    return _histogram_dd(X, positions, in_range, sizes, weight, edges, density), 0


# ---------------------------------------------------------------------------------------------
# segment_reduce: the segments run along a logical axis; with the batch dim moved LAST the axis
# and the (shared) lengths / offsets describe every example unchanged.  Batched lengths or
# offsets are keyword arguments, which the dispatcher sends to the loop fallback.

def _batch_last(t, bdim, size):
    return ensure_bdim_front(t, bdim, size).movedim(0, -1)


@register_batch_rule(aten.segment_reduce.default)
def segment_reduce_rule(info, in_dims, data, reduce, **kwargs):
    rank = data.dim() - 1
    axis = kwargs.get("axis", 0)
    if not -rank <= axis < rank:
        raise Decline()
    kwargs["axis"] = axis % rank
    out = aten.segment_reduce.default(_batch_last(data, in_dims[0], info.batch_size), reduce,
                                      **kwargs)
    return out, out.dim() - 1


@register_batch_rule(aten._segment_reduce_backward.default)
def segment_reduce_backward_rule(info, in_dims, grad, output, data, reduce, **kwargs):
    B = info.batch_size
    rank = data.dim() - (in_dims[2] is not None)
    axis = kwargs.get("axis", 0)
    if not -rank <= axis < rank:
        raise Decline()
    kwargs["axis"] = axis % rank
    out = aten._segment_reduce_backward.default(
        *(_batch_last(t, d, B) for t, d in zip((grad, output, data), in_dims[:3])), reduce,
        **kwargs)
    return out, out.dim() - 1
