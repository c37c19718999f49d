"""Indexing: gather, scatter (src / value / reduce, scatter_reduce, scatter_add), index_select,
advanced indexing (index.Tensor, _unsafe_index, index_put, _index_put_impl, _unsafe_index_put,
_unsafe_masked_index, _unsafe_masked_index_put_accumulate), index_add / index_copy /
index_reduce / index_fill, take / put, select/slice/diagonal_scatter, masked_fill with a tensor
value, masked_scatter (+ its backward) and isin.  In-place and out= variants come from
``registry.py`` (Note [derived rules]).

Invariants: one physical call per op, and an example's indices only ever address that
example: batched operands get the batch first and unbatched ones are expanded (a view) to the
batch, so ops along a dim run along the logical dim + 1; a batched index either indexes the
batch dim too (advanced indexing: ``arange(B)``) or addresses a folded [B*N] dim with example
b's indices offset by b*N, where an index out of range stays out of range so the physical op
raises as eager does.  Logically 0-d operands get a temporary size-1 dim.  Boolean masks are
batched only where the output shape cannot depend on them (an unbatched mask, or
``x[mask] = value``); a batched mask in ``x[mask]`` raises the data-dependent error.
"""
from __future__ import annotations

import torch

from ..batched_tensor import BatchedTensor
from ..helpers import (ensure_bdim_front, logical_rank, move_bdim_to_front, normalize_dim,
                       pad_to_rank)
from ..op_schema import writes_self
from ..registry import Decline, registrar

aten = torch.ops.aten
register_batch_rule = registrar("indexing")   # the rules below live in this file


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
    inplace = writes_self(op)

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
            aten.scatter_add.default, aten.scatter_add_.default, aten.scatter.reduce,
            aten.scatter.value_reduce, aten.scatter_reduce.two):
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


# ---------------------------------------------------------------------------------------------
# Advanced (integer) indexing: index.Tensor, _unsafe_index, index_put and friends.
#
# A logical call ``x[i1, ..., ik]`` (entries None or integer tensors) becomes one physical call:
# * no index batched: a leading None (a full slice) keeps the batch dim;
# * some index batched: ``arange(B)`` indexes the batch dim itself, so each example's indices
#   pick only from that example (PyTorch's own bounds checks and negative wrap-around apply);
# * (forward only) self unbatched: the batched indices index it directly.
# PyTorch puts the broadcast index dims where the first index was when the indexed dims are
# adjacent, and in front otherwise; ``_Plan`` knows where they land and moves them back.
# ---------------------------------------------------------------------------------------------

def _is_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


class _Plan:
    """Where a logical advanced-indexing call's dims land physically."""

    def __init__(self, info, x, x_bdim, indices, index_dims, need_batched_self):
        B = info.batch_size
        indices = list(indices)
        dims = list(index_dims) if isinstance(index_dims, (list, tuple)) else \
            [None] * len(indices)
        pos = [j for j, t in enumerate(indices) if t is not None]
        if not pos:
            raise Decline()
        self.B, self.p = B, pos[0]
        self.adjacent = pos == list(range(pos[0], pos[-1] + 1))
        # A boolean mask over m dims acts as m integer indices of rank 1 (its nonzero()).
        ranks = [1 if _is_mask(t) else logical_rank(t, d)
                 for t, d in zip(indices, dims) if t is not None]
        self.k = k = max(ranks)
        self.consumed = sum(t.dim() if _is_mask(t) else 1 for t in indices if t is not None)
        batched = any(d is not None for d in dims)
        if batched and any(_is_mask(t) for t in indices):
            raise Decline()  # masks only with unbatched indices
        if not batched:
            self.mode = "plain"
            self.X = ensure_bdim_front(x, x_bdim, B)
            self.indices = [None] + indices
            return
        padded = []
        for t, d in zip(indices, dims):
            if t is None or d is None:
                padded.append(t)
            else:
                T = move_bdim_to_front(t, d)
                padded.append(T.reshape((B,) + (1,) * (k - (T.dim() - 1)) + T.shape[1:]))
        if x_bdim is None and not need_batched_self:
            self.mode, self.X, self.indices = "direct", x, padded
            return
        self.mode = "arange"
        self.X = ensure_bdim_front(x, x_bdim, B)
        batch = torch.arange(B, device=x.device).view((B,) + (1,) * k)
        self.indices = [batch] + padded

    def _moved_block(self) -> bool:
        return self.mode == "arange" and self.adjacent and self.p > 0

    def result(self, out):
        """(logical-layout result, bdim) from the physical result."""
        k, p = self.k, self.p
        if self.mode == "plain":
            return out, (0 if self.adjacent else k)
        if self.mode == "direct":
            return out, (p if self.adjacent else 0)
        if self._moved_block():
            out = out.movedim(list(range(1, 1 + k)), list(range(1 + p, 1 + p + k)))
        return out, 0

    def values(self, v, v_bdim, indexed_rank):
        """Values (broadcastable to the logical indexed shape) laid out physically."""
        V = ensure_bdim_front(v, v_bdim, self.B)
        if V.dim() - 1 > indexed_rank:
            raise Decline()
        V = pad_to_rank(V, indexed_rank)
        k, p = self.k, self.p
        if self.mode == "plain" and not self.adjacent:
            return V.movedim(0, k)
        if self._moved_block():
            return V.movedim(list(range(1 + p, 1 + p + k)), list(range(1, 1 + k)))
        return V


def _indexed_rank(plan, x_rank) -> int:
    """The logical rank of ``x[indices]``."""
    return x_rank - plan.consumed + plan.k


def _index_rule_for(op):
    def rule(info, in_dims, x, indices):
        dims = in_dims[1] if isinstance(in_dims[1], (list, tuple)) else [None] * len(indices)
        if any(_is_mask(t) and d is not None for t, d in zip(indices, dims)):
            # A batched mask may select a different number per example: the loop runs each
            # example and stacks the results when their shapes agree, else raises the clear
            # ragged-results error (as masked_select; rules/data_dependent.py).
            raise Decline()
        plan = _Plan(info, x, in_dims[0], indices, in_dims[1], need_batched_self=False)
        return plan.result(op(plan.X, plan.indices))
    rule.__name__ = f"index_rule[{op}]"
    return rule


for _op in (aten.index.Tensor, aten._unsafe_index.Tensor):
    register_batch_rule(_op, _index_rule_for(_op))


def _mask_put(info, in_dims, x, indices, values, accumulate):
    """``x[..., mask, ...] = v`` (or ``+=``) with ONE boolean mask and values that do not vary
    along the selected elements: a ``torch.where``.  None when that does not apply."""
    pos = [j for j, t in enumerate(indices) if t is not None]
    dims = in_dims[1] if isinstance(in_dims[1], (list, tuple)) else [None] * len(indices)
    if len(pos) != 1 or indices[pos[0]].dtype != torch.bool or values.dtype != x.dtype:
        return None
    B, p = info.batch_size, pos[0]
    X = ensure_bdim_front(x, in_dims[0], B)
    M = ensure_bdim_front(indices[p], dims[p], B)
    m = M.dim() - 1
    after = X.dim() - 1 - p - m
    if after < 0 or M.shape[1:] != X.shape[1 + p:1 + p + m]:
        raise Decline()  # eager raises
    rank = p + 1 + after                       # rank of x[..., mask, ...]
    V = ensure_bdim_front(values, in_dims[2], B)
    if V.dim() - 1 > rank:
        raise Decline()
    V = pad_to_rank(V, rank)
    if V.shape[1 + p] != 1:
        return None  # values differ along the selected elements: shapes depend on the mask
    V = V.reshape(V.shape[:1 + p] + (1,) * m + V.shape[2 + p:])
    M = M.reshape((B,) + (1,) * p + M.shape[1:] + (1,) * after)
    return torch.where(M, X + V if accumulate else V, X), 0


def _index_put_rule_for(op):
    def rule(info, in_dims, x, indices, values, *args, **kwargs):
        if any(_is_mask(t) for t in indices):
            accumulate = bool(args[0]) if args else bool(kwargs.get("accumulate", False))
            done = _mask_put(info, in_dims, x, indices, values, accumulate)
            if done is not None:
                return done
        plan = _Plan(info, x, in_dims[0], indices, in_dims[1], need_batched_self=True)
        rank = _indexed_rank(plan, logical_rank(x, in_dims[0]))
        V = plan.values(values, in_dims[2], rank)
        return op(plan.X, plan.indices, V, *args, **kwargs), 0
    rule.__name__ = f"index_put_rule[{op}]"
    return rule


for _op in (aten.index_put.default, aten._index_put_impl.default,
            aten._unsafe_index_put.default):
    register_batch_rule(_op, _index_put_rule_for(_op))


def _clamped(indices, x, x_bdim, low_negative: bool):
    """The indices clamped into range of ``x``'s logical dims (as the decompositions do)."""
    shape = x.shape if x_bdim is None else x.shape[:x_bdim] + x.shape[x_bdim + 1:]
    return [None if t is None else t.clamp(min=-shape[j] if low_negative else 0,
                                            max=shape[j] - 1)
            for j, t in enumerate(indices)]


@register_batch_rule(aten._unsafe_masked_index.default)
def unsafe_masked_index_rule(info, in_dims, x, mask, indices, fill):
    if mask.dtype != torch.bool or any(_is_mask(t) for t in indices) or x.numel() == 0:
        raise Decline()
    plan = _Plan(info, x, in_dims[0], _clamped(indices, x, in_dims[0], False), in_dims[2],
                 need_batched_self=False)
    out, bdim = plan.result(aten._unsafe_index.Tensor(plan.X, plan.indices))
    B = info.batch_size
    out = ensure_bdim_front(out, bdim, B)
    M = pad_to_rank(ensure_bdim_front(mask, in_dims[1], B), out.dim() - 1)
    return out.masked_fill(~M, fill), 0


@register_batch_rule(aten._unsafe_masked_index_put_accumulate.default)
def unsafe_masked_index_put_accumulate_rule(info, in_dims, x, mask, indices, values):
    if mask.dtype != torch.bool or any(_is_mask(t) for t in indices) or x.numel() == 0:
        raise Decline()
    B = info.batch_size
    plan = _Plan(info, x, in_dims[0], _clamped(indices, x, in_dims[0], True), in_dims[2],
                 need_batched_self=True)
    rank = _indexed_rank(plan, logical_rank(x, in_dims[0]))
    V = ensure_bdim_front(values, in_dims[3], B)
    M = ensure_bdim_front(mask, in_dims[1], B)
    if V.dim() - 1 > rank or M.dim() - 1 > rank:
        raise Decline()
    masked = pad_to_rank(V, rank).masked_fill(~pad_to_rank(M, rank), 0)
    V = plan.values(masked, 0, rank)
    return aten._unsafe_index_put(plan.X, plan.indices, V, True), 0


# ---------------------------------------------------------------------------------------------
# Ops along one dim with a 1-D index: index_add, index_copy, index_reduce, index_fill.
# An unbatched index runs the op along the logical dim + 1.  A batched index folds the batch
# into the indexed dim ([B, N, ...] -> [B*N, ...]) and offsets example b's indices by b*N;
# indices out of range stay out of range (mapped to B*N), so the op raises as eager would.
# ---------------------------------------------------------------------------------------------

def _fold(X, d):
    """[B, ..., N (at d), ...] -> [B*N, ...rest]."""
    Xm = X.movedim(d, 1)
    return Xm.reshape((-1,) + Xm.shape[2:])


def _unfold(Y, B, d):
    return Y.reshape((B, -1) + Y.shape[1:]).movedim(1, d)


def _offset_index(I, n, wrap_negative):
    """Flat indices of [B, K] per-example indices into the folded [B*n] dim."""
    B = I.shape[0]
    if wrap_negative:
        I = torch.where(I < 0, I + n, I)
    valid = (I >= 0) & (I < n)
    offsets = torch.arange(B, device=I.device, dtype=I.dtype).view(B, 1) * n
    return torch.where(valid, I + offsets, torch.full_like(I, B * n)).reshape(-1)


def _along_dim(info, op, x, x_bdim, dim, index, i_bdim, source, s_bdim, rest, kwargs,
               wrap_negative):
    B = info.batch_size
    r = logical_rank(x, x_bdim)
    d = normalize_dim(dim, r) + 1
    X = ensure_bdim_front(x, x_bdim, B)
    S = None
    if source is not None:
        S = ensure_bdim_front(source, s_bdim, B)
        if S.dim() - 1 != r and not (r == 0 and S.dim() <= 2):
            raise Decline()
    if r == 0:
        X = X.unsqueeze(1)
        S = None if S is None else S.reshape(B, -1)
    src = () if S is None else (S,)
    if i_bdim is None:
        out = op(X, d, index, *src, *rest, **kwargs)
    else:
        I = move_bdim_to_front(index, i_bdim).reshape(B, -1)
        flat = _offset_index(I, X.shape[d], wrap_negative)
        src = () if S is None else (_fold(S, d),)
        out = _unfold(op(_fold(X, d), 0, flat, *src, *rest, **kwargs), B, d)
    return (out.reshape(B) if r == 0 else out), 0


def _index_source_rule_for(op):
    def rule(info, in_dims, x, dim, index, source, *rest, **kwargs):
        return _along_dim(info, op, x, in_dims[0], dim, index, in_dims[2], source, in_dims[3],
                          rest, kwargs, wrap_negative=False)
    rule.__name__ = f"index_source_rule[{op}]"
    return rule


for _op in (aten.index_add.default, aten.index_copy.default, aten.index_reduce.default):
    register_batch_rule(_op, _index_source_rule_for(_op))


@register_batch_rule(aten.index_fill.int_Scalar)
def index_fill_scalar_rule(info, in_dims, x, dim, index, value):
    return _along_dim(info, aten.index_fill.int_Scalar, x, in_dims[0], dim, index, in_dims[2],
                      None, None, (value,), {}, wrap_negative=True)


@register_batch_rule(aten.index_fill.int_Tensor)
def index_fill_tensor_rule(info, in_dims, x, dim, index, value):
    if in_dims[3] is None:
        return _along_dim(info, aten.index_fill.int_Tensor, x, in_dims[0], dim, index,
                          in_dims[2], None, None, (value,), {}, wrap_negative=True)
    if value.dim() != 1:
        raise Decline()  # eager requires a 0-d value
    B = info.batch_size
    X = ensure_bdim_front(x, in_dims[0], B)
    where, _ = _along_dim(info, aten.index_fill.int_Scalar,
                          torch.zeros(X.shape, dtype=torch.bool, device=X.device), 0, dim,
                          index, in_dims[2], None, None, (True,), {}, wrap_negative=True)
    V = move_bdim_to_front(value, in_dims[3]).to(X.dtype)
    return torch.where(where, pad_to_rank(V, X.dim() - 1), X), 0


# ---------------------------------------------------------------------------------------------
# take / put address self as if flattened: the batch stays a separate (first) dim, and the
# flattened self is indexed with [arange(B), index] (negative indices and bounds as eager).
# ---------------------------------------------------------------------------------------------

def _flat_batched_index(B, index, i_bdim):
    I = ensure_bdim_front(index, i_bdim, B).reshape(B, -1)
    return [torch.arange(B, device=I.device).view(B, 1), I]


@register_batch_rule(aten.take.default)
def take_rule(info, in_dims, x, index):
    # aten.index, not Python indexing: a 0-d index tensor in ``t[:, index]`` is read back to
    # the host as an int (``.item()``, a device sync eager's take does not make).
    B = info.batch_size
    if in_dims[0] is None:
        return aten.index.Tensor(x.reshape(-1), [index]), in_dims[1]
    Xf = move_bdim_to_front(x, in_dims[0]).reshape(B, -1)
    if in_dims[1] is None:
        return aten.index.Tensor(Xf, [None, index]), 0
    I = move_bdim_to_front(index, in_dims[1])
    return aten.index.Tensor(Xf, _flat_batched_index(B, I, 0)).reshape(I.shape), 0


@register_batch_rule(aten.put.default)
def put_rule(info, in_dims, x, index, source, accumulate=False):
    B = info.batch_size
    n_index = index.numel() // (B if in_dims[1] is not None else 1)
    n_source = source.numel() // (B if in_dims[2] is not None else 1)
    if n_index != n_source:
        raise Decline()  # eager raises
    X = ensure_bdim_front(x, in_dims[0], B)
    S = ensure_bdim_front(source, in_dims[2], B).reshape(B, -1)
    out = aten.index_put(X.reshape(B, -1), _flat_batched_index(B, index, in_dims[1]), S,
                         accumulate)
    return out.reshape(X.shape), 0


# ---------------------------------------------------------------------------------------------
# *_scatter of a view's values back into self: batch first on both, dims + 1.
# ---------------------------------------------------------------------------------------------

def _both_front(info, in_dims, x, src):
    B = info.batch_size
    return (ensure_bdim_front(x, in_dims[0], B), ensure_bdim_front(src, in_dims[1], B),
            logical_rank(x, in_dims[0]))


@register_batch_rule(aten.select_scatter.default)
def select_scatter_rule(info, in_dims, x, src, dim, index):
    X, S, r = _both_front(info, in_dims, x, src)
    return aten.select_scatter(X, S, normalize_dim(dim, r) + 1, index), 0


@register_batch_rule(aten.slice_scatter.default)
def slice_scatter_rule(info, in_dims, x, src, dim=0, start=None, end=None, step=1):
    X, S, r = _both_front(info, in_dims, x, src)
    return aten.slice_scatter(X, S, normalize_dim(dim, r) + 1, start, end, step), 0


@register_batch_rule(aten.diagonal_scatter.default)
def diagonal_scatter_rule(info, in_dims, x, src, offset=0, dim1=0, dim2=1):
    X, S, r = _both_front(info, in_dims, x, src)
    return aten.diagonal_scatter(X, S, offset, normalize_dim(dim1, r) + 1,
                                 normalize_dim(dim2, r) + 1), 0


# ---------------------------------------------------------------------------------------------
# Masks: masked_fill with a (batched) tensor value, masked_scatter and its backward.
# masked_scatter consumes source elements in the row-major order of each example's mask: the
# running count of the mask (a cumsum per example) is the source position of each element.
# ---------------------------------------------------------------------------------------------

def _front_broadcast(info, tensors, dims):
    B = info.batch_size
    rank = max(logical_rank(t, d) for t, d in zip(tensors, dims))
    return [pad_to_rank(ensure_bdim_front(t, d, B), rank) for t, d in zip(tensors, dims)]


@register_batch_rule(aten.masked_fill.Tensor)
def masked_fill_tensor_rule(info, in_dims, x, mask, value):
    X, M = _front_broadcast(info, [x, mask], in_dims[:2])
    if in_dims[2] is None:
        return aten.masked_fill.Tensor(X, M, value), 0
    if value.dim() != 1 or mask.dtype != torch.bool:
        raise Decline()  # eager requires a 0-d value
    if value.dtype != X.dtype and torch.promote_types(value.dtype, X.dtype) != X.dtype:
        # Eager converts each value with an overflow check (a complex value with an imaginary
        # part, or an out-of-range one, into an integer tensor raises); .to() would drop the
        # imaginary part or wrap silently.  The loop runs eager's conversion per example.
        raise Decline()
    V = move_bdim_to_front(value, in_dims[2]).to(X.dtype)
    out = torch.where(M, pad_to_rank(V, X.dim() - 1), X)
    return out, 0


@register_batch_rule(aten.masked_scatter.default)
def masked_scatter_rule(info, in_dims, x, mask, source):
    if mask.dtype != torch.bool or source.dtype != x.dtype:
        raise Decline()
    B = info.batch_size
    X, M = torch.broadcast_tensors(*_front_broadcast(info, [x, mask], in_dims[:2]))
    Mf = M.reshape(B, -1)
    S = ensure_bdim_front(source, in_dims[2], B).reshape(B, -1)
    if S.shape[1] < Mf.shape[1]:
        # A shorter source is fine while it covers each example's mask: check that here
        # (concrete values only; otherwise the loop checks and raises eager's error).
        if type(Mf) is BatchedTensor or bool((Mf.sum(1) > S.shape[1]).any()):
            raise Decline()
        if S.shape[1] == 0:
            return X.clone(), 0  # nothing is selected in any example
    pos = (Mf.cumsum(1) - 1).clamp(min=0, max=max(S.shape[1] - 1, 0))
    out = torch.where(Mf, S.gather(1, pos), X.reshape(B, -1))
    return out.reshape(X.shape), 0


@register_batch_rule(aten.masked_scatter_backward.default)
def masked_scatter_backward_rule(info, in_dims, grad, mask, sizes):
    if mask.dtype != torch.bool:
        raise Decline()
    B = info.batch_size
    G, M = torch.broadcast_tensors(*_front_broadcast(info, [grad, mask], in_dims[:2]))
    Mf, Gf = M.reshape(B, -1), G.reshape(B, -1)
    n = 1
    for s in sizes:
        n *= s
    dest = torch.where(Mf, Mf.cumsum(1) - 1, n).clamp(max=n)   # n: a dump slot
    out = Gf.new_zeros(B, n + 1).scatter(1, dest, Gf)
    return out[:, :n].reshape((B,) + tuple(sizes)), 0


# ---------------------------------------------------------------------------------------------
# isin: a batched test set is compared with every element (one broadcast ==, any over the set).
# ---------------------------------------------------------------------------------------------

def _isin_batched_set(info, elements, e_bdim, test, t_bdim, invert):
    B = info.batch_size
    T = move_bdim_to_front(test, t_bdim).reshape(B, -1)
    if isinstance(elements, torch.Tensor):
        E = ensure_bdim_front(elements, e_bdim, B)
        dtype = torch.promote_types(E.dtype, T.dtype)
        hits = E.to(dtype).unsqueeze(-1) == T.to(dtype).view((B,) + (1,) * (E.dim() - 1) + (-1,))
        out = hits.any(-1)
    else:
        out = (T == elements).any(-1)
    return (~out if invert else out), 0


@register_batch_rule(aten.isin.Tensor_Tensor)
def isin_rule(info, in_dims, elements, test, *, assume_unique=False, invert=False):
    if in_dims[1] is None:
        return aten.isin.Tensor_Tensor(elements, test, assume_unique=assume_unique,
                                       invert=invert), in_dims[0]
    if elements.is_complex() or test.is_complex():
        raise Decline()
    return _isin_batched_set(info, elements, in_dims[0], test, in_dims[1], invert)


@register_batch_rule(aten.isin.Tensor_Scalar)
def isin_scalar_rule(info, in_dims, elements, test, *, assume_unique=False, invert=False):
    return aten.isin.Tensor_Scalar(elements, test, assume_unique=assume_unique,
                                   invert=invert), in_dims[0]


@register_batch_rule(aten.isin.Scalar_Tensor)
def isin_scalar_tensor_rule(info, in_dims, element, test, *, assume_unique=False,
                            invert=False):
    return _isin_batched_set(info, element, None, test, in_dims[1], invert)
