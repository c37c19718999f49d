"""Embeddings: embedding and embedding_dense_backward (what ``F.embedding`` and per-example
gradients of it reach).

Invariants: per-example indices only ever address their own example's table.  A batched table
[B, V, D] is folded to [B*V, D] with example b's indices offset by b*V (an index out of range
stays out of range, so the physical op raises as eager would); unbatched indices with a batched
gradient fold the batch into the feature dim instead.  ``padding_idx`` and
``scale_grad_by_freq`` only change gradients: they are applied per example in the backward rule;
when the physical forward is itself differentiated (a transform outside the vmap) the padding
positions are detached, and ``scale_grad_by_freq`` with a table that requires grad declines
(counts would mix examples).
"""
from __future__ import annotations

import torch

from ..batched_tensor import BatchedTensor
from ..helpers import ensure_bdim_front, move_bdim_to_front
from ..registry import Decline, registrar

aten = torch.ops.aten
register_batch_rule = registrar("embedding")   # the rules below live in this file
_MAX = 2  # embedding_bag's mode numbers: 0 sum, 1 mean, 2 max


def _offset(I, n):
    """Per-example indices [B, ...] into a table folded to [B*n, ...]."""
    B = I.shape[0]
    valid = (I >= 0) & (I < n)
    offsets = torch.arange(B, device=I.device, dtype=I.dtype).view((B,) + (1,) * (I.dim() - 1))
    return torch.where(valid, I + offsets * n, torch.full_like(I, B * n))


@register_batch_rule(aten.embedding.default)
def embedding_rule(info, in_dims, weight, indices, padding_idx=-1, scale_grad_by_freq=False,
                   sparse=False):
    if sparse:
        raise Decline()
    if in_dims[0] is None:
        if scale_grad_by_freq and weight.requires_grad:
            raise Decline()  # a physical backward would count indices over the whole batch
        return aten.embedding(weight, indices, padding_idx, scale_grad_by_freq), in_dims[1]
    if scale_grad_by_freq and weight.requires_grad:
        raise Decline()  # a physical backward through the folded table would not count
    B = info.batch_size
    W = move_bdim_to_front(weight, in_dims[0])
    if W.dim() != 3:
        raise Decline()
    I = ensure_bdim_front(indices, in_dims[1], B)
    flat = W.reshape(-1, W.shape[-1])
    out = flat.index_select(0, _offset(I, W.shape[1]).reshape(-1)).view(I.shape + (W.shape[-1],))
    if padding_idx != -1 and out.requires_grad:
        # the padding row gets no gradient: same values, detached at the padding positions
        out = torch.where((I == padding_idx).unsqueeze(-1), out.detach(), out)
    return out, 0


@register_batch_rule(aten.embedding_dense_backward.default)
def embedding_dense_backward_rule(info, in_dims, grad, indices, num_weights, padding_idx,
                                  scale_grad_by_freq):
    B = info.batch_size
    G = ensure_bdim_front(grad, in_dims[0], B)
    if in_dims[1] is None:
        # The same indices for every example: the batch rides along the feature dim.
        D = G.shape[-1]
        Gm = G.movedim(0, -2).reshape(G.shape[1:-1] + (B * D,))
        out = aten.embedding_dense_backward(Gm, indices, num_weights, padding_idx,
                                            scale_grad_by_freq)
        return out.view(num_weights, B, D), 1
    I = move_bdim_to_front(indices, in_dims[1])
    G = torch.where((I == padding_idx).unsqueeze(-1), torch.zeros_like(G), G)
    out = aten.embedding_dense_backward(G, _offset(I, num_weights), B * num_weights, -1,
                                        scale_grad_by_freq)
    return out.view(B, num_weights, G.shape[-1]), 0


# ---------------------------------------------------------------------------------------------
# embedding_bag.  Two batched cases, each one physical call:
# * only the table is batched: its batch rides along the feature dim ([V, B*D]); rows, and so
#   offsets, padding_idx and counts, are untouched;
# * the indices (and per_sample_weights) are batched, the table and offsets are not: the
#   examples' bags are concatenated (example b's offsets shifted by b*N, see _folded_offsets)
#   and the bag-indexed outputs split back.  The offsets are never read on the host (on a GPU
#   that is a sync the loop does not make): offsets the kernel rejects make the folded call
#   raise too, and the rule then declines, so that the loop raises eager's own error.
#   Batched offsets run on the loop, which reproduces eager exactly.
# ---------------------------------------------------------------------------------------------

def _plain_offsets(offsets) -> bool:
    """1-D offsets of this level (a lower level's wrapper, or unusual offsets, take the loop).
    Only the metadata is looked at: the values stay on the device (so fake tensors do too)."""
    return type(offsets) is not BatchedTensor and offsets.dim() == 1 and offsets.numel() > 0


def _folded_offsets(offsets, B, n, include_last_offset):
    """(offsets, bags per example) of one call over the B examples' indices laid end to end
    ([B*n]), computed on the device: example b's offsets shifted by b*n, so that each
    example's bags are the bags eager makes of its own indices:
    * an example's first bag starts at its first index: the CUDA kernels start bag 0 at 0
      whatever offsets[0] says, so example b > 0 starts at b*n; example 0 keeps offsets[0],
      which the CPU kernel requires to be 0 (the folded call raises where eager does);
    * an example's last bag ends at its last index, as eager's does; offsets[-1] > n puts the
      folded last offset past B*n, which the CPU kernel rejects, as eager does;
    * include_last_offset: the CUDA kernels end the last bag at the last index whatever
      offsets[-1] says; the CPU kernels read offsets[-1] for some outputs (the sum) and not
      for others (mean's bag size, max), so they agree with the folding only when
      offsets[-1] == n.  The folded last offset is B*n + |offsets[-1] - n|: B*n when
      offsets[-1] == n, past the end otherwise, which the CPU kernel rejects (the rule then
      declines and the loop reproduces eager)."""
    bags = offsets[:-1] if include_last_offset else offsets
    nb = bags.shape[0]
    starts = torch.arange(B, dtype=offsets.dtype, device=offsets.device) * n
    shifted = bags.unsqueeze(0) + starts.unsqueeze(1)
    if nb > 0:
        first = torch.cat([bags[:1], starts[1:]]).unsqueeze(1)
        shifted = torch.cat([first, shifted[:, 1:]], 1)
    folded = shifted.reshape(-1)
    if include_last_offset:
        folded = torch.cat([folded, B * n + (offsets[-1:] - n).abs()])
    return folded, nb


def _bag_table_batched(op, B, W, indices, offsets, rest):
    V, D = W.shape[1], W.shape[2]
    flat = W.permute(1, 0, 2).reshape(V, B * D)
    out, offset2bag, bag_size, max_indices = op(flat, indices, offsets, *rest)
    nb = out.shape[0]
    out = out.view(nb, B, D)
    if max_indices.dim() == 2:
        return (out, offset2bag, bag_size, max_indices.view(nb, B, D)), (1, None, None, 1)
    return (out, offset2bag, bag_size, max_indices), (1, None, None, None)


def _bag_rows(B, weight, w_dim, I, padding_idx):
    """(table, rows, padding_idx, V) for one physical call: a batched table [B, V, D] is folded to
    [B*V + 1, D]; example b's indices address rows b*V.., padding goes to the extra last row
    (which the call's padding_idx names) and indices out of range stay out of range."""
    if w_dim is None:
        return weight, I, padding_idx, weight.shape[0]
    W = move_bdim_to_front(weight, w_dim)
    V, D = W.shape[1], W.shape[2]
    dump = B * V
    table = torch.cat([W.reshape(B * V, D), W.new_zeros(1, D)])
    rows = _offset(I, V)
    rows = torch.where(rows == dump, torch.full_like(rows, dump + 1), rows)  # out of range
    if padding_idx < 0:
        return table, rows, padding_idx, V   # (no padding: the kernel's fast path, as eager)
    rows = torch.where(I == padding_idx, torch.full_like(rows, dump), rows)
    return table, rows, dump, V


def _own_rows(M, B, V):
    """Max indices of the folded table back to each example's rows (0 elsewhere, as eager
    reports for bags with nothing to take the maximum of)."""
    start = (torch.arange(B, dtype=M.dtype, device=M.device) * V).view((B,) + (1,) * (M.dim() - 1))
    mine = (M >= start) & (M < start + V)
    return torch.where(mine, M - start, torch.zeros_like(M))


def _per_bag(t, B, nb):
    """A per-bag output of the folded call, [B*nb, ...] -> [B, nb, ...].  Kernels differ in
    what they return for the outputs a mode does not use: empty (CUDA's max_indices outside
    mode max) -> [B, 0]; one entry per offset (CUDA's bag_size, CPU's forward-only sum with
    include_last_offset) [B*nb + 1] -> [B, nb + 1], the last entry repeated."""
    if t.dim() == 1 and t.numel() == 0:
        return t.new_empty((B, 0))
    if t.dim() == 1 and t.numel() == B * nb + 1:
        return torch.cat([t[:-1].view(B, nb), t[-1:].expand(B, 1)], 1)
    return t.view((B, nb) + t.shape[1:])


def _bag_indices_batched(op, B, weight, w_dim, I, offsets, include_last_offset, psw, mode,
                         rest_before, padding_idx):
    n = I.shape[1]
    folded, nb = _folded_offsets(offsets, B, n, include_last_offset)
    table, rows, pad, V = _bag_rows(B, weight, w_dim, I, padding_idx)
    try:
        out, offset2bag, bag_size, max_indices = op(
            table, rows.reshape(-1), folded, *rest_before, mode, False, psw,
            include_last_offset, pad)
    except (RuntimeError, IndexError):
        raise Decline() from None  # offsets or indices the kernel rejects: the loop's error
    out = out.view((B, nb) + out.shape[1:])
    if offset2bag.numel() == 0:
        offset2bag = offset2bag.new_empty((B, 0))
    else:
        starts = torch.arange(B, dtype=offset2bag.dtype, device=offset2bag.device) * nb
        offset2bag = offset2bag.view(B, n) - starts.unsqueeze(1)
    bag_size = _per_bag(bag_size, B, nb)
    max_indices = _per_bag(max_indices, B, nb)
    if w_dim is not None and mode == _MAX:
        max_indices = _own_rows(max_indices, B, V)
    return (out, offset2bag, bag_size, max_indices), (0, 0, 0, 0)


def _embedding_bag_rule_for(op):
    def rule(info, in_dims, weight, indices, offsets, scale_grad_by_freq=False, mode=0,
             sparse=False, per_sample_weights=None, include_last_offset=False,
             padding_idx=-1):
        B = info.batch_size
        w_d, i_d, o_d, p_d = in_dims[0], in_dims[1], in_dims[2], \
            (in_dims[6] if len(in_dims) > 6 else None)
        call = op
        if weight.requires_grad or getattr(per_sample_weights, "requires_grad", False):
            call = aten._embedding_bag.default  # the physical call is differentiated
        if sparse or o_d is not None:
            raise Decline()
        if weight.dim() != 2 + (w_d is not None):
            raise Decline()
        if w_d is not None and i_d is None and p_d is None:
            W = move_bdim_to_front(weight, w_d)
            return _bag_table_batched(call, B, W, indices, offsets, (
                scale_grad_by_freq, mode, sparse, per_sample_weights, include_last_offset,
                padding_idx))
        if scale_grad_by_freq and weight.requires_grad:
            raise Decline()  # a physical backward would count indices over the whole batch
        I = ensure_bdim_front(indices, i_d, B)
        if I.dim() != 2 or not _plain_offsets(offsets):
            raise Decline()
        psw = None if per_sample_weights is None else \
            ensure_bdim_front(per_sample_weights, p_d, B).reshape(-1)
        return _bag_indices_batched(call, B, weight, w_d, I, offsets, include_last_offset, psw,
                                    mode, (scale_grad_by_freq,), padding_idx)
    rule.__name__ = f"embedding_bag_rule[{op}]"
    return rule


for _op in (aten._embedding_bag.default, aten._embedding_bag_forward_only.default):
    register_batch_rule(_op, _embedding_bag_rule_for(_op))


# The backward (what vmap(grad) of embedding_bag reaches) mirrors the two forward cases: a
# batched gradient with shared indices rides along the feature dim; batched indices get their
# own rows of a [B*V (+1 dump row for padding), D] gradient, their bags their own bag ids.

def _bag_backward_shared_indices(B, grad, g_dim, maximum_indices, m_dim, mode, call):
    G = ensure_bdim_front(grad, g_dim, B)
    if G.dim() != 3:
        raise Decline()
    nb, D = G.shape[1], G.shape[2]
    fold = lambda t: t.permute(1, 0, 2).reshape(nb, B * D)
    M = maximum_indices
    if mode == _MAX:
        M = fold(ensure_bdim_front(M, m_dim, B))
    elif m_dim is not None:
        raise Decline()
    out = call(fold(G), M)
    return out.view(out.shape[0], B, D), 1


def _offset2bag(offsets, n):
    """Each input position's bag, computed as eager's CPU backward computes it when the forward
    skipped it (``make_offset2bag``: a 1 at every offset, a cumulative sum, minus one), so that
    offsets the forward accepted without checking (unsorted ones) give eager's bags too; on
    the device, without reading the offsets."""
    marks = torch.zeros(n + 1, dtype=offsets.dtype, device=offsets.device)
    marks = marks.index_add(0, offsets, torch.ones_like(offsets))
    return (marks.cumsum(0, dtype=offsets.dtype) - 1)[:n]


@register_batch_rule(aten._embedding_bag_backward.default)
def embedding_bag_backward_rule(info, in_dims, grad, indices, offsets, offset2bag, bag_size,
                                maximum_indices, num_weights, scale_grad_by_freq, mode, sparse,
                                per_sample_weights, padding_idx=-1):
    B = info.batch_size
    g_d, i_d, o_d, ob_d, bs_d, m_d = in_dims[:6]
    p_d = in_dims[10]
    if sparse or o_d is not None:
        raise Decline()
    if i_d is None and ob_d is None and bs_d is None and p_d is None:
        def call(G, M):
            return aten._embedding_bag_backward(G, indices, offsets, offset2bag, bag_size, M,
                                                num_weights, scale_grad_by_freq, mode, False,
                                                per_sample_weights, padding_idx)
        return _bag_backward_shared_indices(B, grad, g_d, maximum_indices, m_d, mode, call)
    if scale_grad_by_freq:
        raise Decline()  # the CPU kernel's counts do not survive the folding of the rows
    G = ensure_bdim_front(grad, g_d, B)
    I = ensure_bdim_front(indices, i_d, B)
    if G.dim() != 3 or I.dim() != 2:
        raise Decline()
    nb, n, V = G.shape[1], I.shape[1], num_weights
    if offset2bag.numel() == 0:   # the forward skipped it: rebuild it from the offsets
        if not _plain_offsets(offsets):
            raise Decline()
        O2B = _offset2bag(offsets, n).expand(B, n)
    else:
        O2B = ensure_bdim_front(offset2bag, ob_d, B)
    examples = torch.arange(B, device=I.device).unsqueeze(1)
    dump = B * V                  # padding positions go to an extra row, dropped at the end
    pad = (I == padding_idx) if padding_idx >= 0 else torch.zeros_like(I, dtype=torch.bool)
    rows = torch.where(pad, torch.full_like(I, dump), I + examples.to(I.dtype) * V)
    bags = O2B + examples.to(O2B.dtype) * nb
    M = ensure_bdim_front(maximum_indices, m_d, B)
    if mode == _MAX:
        shift = examples.to(M.dtype).view(B, 1, 1) * V
        M = torch.where(M == padding_idx, torch.full_like(M, dump),
                        torch.where(M >= 0, M + shift, M))
    psw = None if per_sample_weights is None else \
        ensure_bdim_front(per_sample_weights, p_d, B).reshape(-1)
    out = aten._embedding_bag_dense_backward(
        G.reshape(B * nb, -1), rows.reshape(-1), bags.reshape(-1),
        ensure_bdim_front(bag_size, bs_d, B).reshape(-1), M.reshape((B * nb,) + M.shape[2:]),
        dump + 1, scale_grad_by_freq, mode, psw, dump)
    return out[:dump].view(B, V, -1), 0


@register_batch_rule(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_per_sample_weights_backward_rule(info, in_dims, grad, weight, indices,
                                                   offsets, offset2bag, mode, padding_idx=-1):
    """The gradient of each index's weight: its bag's gradient . its table row (0 for padding),
    gathered per example."""
    B = info.batch_size
    if mode != 0 or in_dims[3] is not None:
        raise Decline()  # eager supports per_sample_weights in mode 'sum' only
    G = ensure_bdim_front(grad, in_dims[0], B)
    I = ensure_bdim_front(indices, in_dims[2], B)
    if G.dim() != 3 or I.dim() != 2:
        raise Decline()
    n, D = I.shape[1], G.shape[2]
    if offset2bag.numel() == 0:
        if not _plain_offsets(offsets):
            raise Decline()
        O2B = _offset2bag(offsets, n).expand(B, n)
    else:
        O2B = ensure_bdim_front(offset2bag, in_dims[4], B)
    bag_grads = G.gather(1, O2B.unsqueeze(-1).expand(B, n, D))
    if in_dims[1] is None:
        rows = weight[I]
    else:
        W = move_bdim_to_front(weight, in_dims[1])
        rows = W.gather(1, I.unsqueeze(-1).expand(B, n, W.shape[2]))
    out = (bag_grads * rows.to(G.dtype)).sum(-1)
    if padding_idx >= 0:
        out = out.masked_fill(I == padding_idx, 0)
    return out, 0
