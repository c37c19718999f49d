"""Spatial rearrangements and sampling: im2col / col2im (``F.unfold`` / ``F.fold``),
grid_sampler_2d / grid_sampler_3d and their backward ops, pixel_shuffle, pixel_unshuffle and
channel_shuffle.  Also home of ``fold_into_n_rule``, the rule factory the padding and upsample
families share.

Invariants:
* these kernels compute every ``[C, *spatial]`` plane (or, for the grid sampler, every example
  of their own batch dim ``N``) independently, so the vmap batch folds into ``N``:
  ``[B, N, ...] -> [B*N, ...]``, or — for kernels that also accept inputs without ``N`` —
  ``[B, C, ...]`` is used as ``[N, C, ...]``.  Every tensor argument is folded the same way
  (unbatched ones expanded first) and ONE kernel runs; outputs are split back to ``[B, N, ...]``.
  The logical rank decides whether the input has its own ``N``: a rank the kernel does not
  accept is declined, so the loop fallback raises PyTorch's own error.
* grid sampling forward with only one operand batched avoids the expansion: a batched grid with
  an unbatched input folds the batch into the grid's first output dim (``[N, B*D_out, ...]``), a
  batched input with an unbatched grid folds it into the channels (``[N, B*C, ...]``).  Output
  locations and channels are sampled independently, so both are exact.
* pixel_shuffle / pixel_unshuffle accept any number of leading dims: the batch just goes first.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..helpers import ensure_bdim_front, logical_rank, move_bdim_to_front
from ..registry import Decline, registrar

aten = torch.ops.aten
register_batch_rule = registrar("spatial")   # the rules below live in this file


def _tensor_positions(op):
    return [i for i, a in enumerate(op._schema.arguments)
            if a.type.isSubtypeOf(torch._C.TensorType.get()) and not a.kwarg_only]


def _times_batch(size, B):
    size = list(size)
    return [B * size[0]] + size[1:]


def fold_into_n_rule(op, ranks, *, size_arg: Optional[str] = None, contiguous: bool = False):
    """A rule for ``op`` whose tensor arguments all share one logical rank, out of ``ranks``
    (``(r,)`` or ``(r - 1, r)``, the larger one meaning "has its own batch dim ``N``").

    ``size_arg`` names an ``int[]`` argument that spells the full input shape ``[N, C, ...]``
    (``input_size`` of the upsample backward ops): its ``N`` is multiplied by the batch size.
    ``contiguous``: the kernel reads its tensors as if contiguous (fractional_max_pool*_backward
    does), so the folded tensors are made contiguous.
    """
    tensor_pos = _tensor_positions(op)
    full_rank = max(ranks)
    names = [a.name for a in op._schema.arguments]
    size_pos = None if size_arg is None else names.index(size_arg)

    def rule(info, in_dims, *args, **kwargs):
        B = info.batch_size
        present = [p for p in tensor_pos if p < len(args) and args[p] is not None]
        found = {logical_rank(args[p], in_dims[p]) for p in present}
        if len(found) != 1 or next(iter(found)) not in ranks:
            raise Decline()
        has_n = next(iter(found)) == full_rank
        new, ns = list(args), set()
        for p in present:
            t = ensure_bdim_front(args[p], in_dims[p], B)
            if has_n:
                ns.add(t.shape[1])
                t = t.reshape(B * t.shape[1], *t.shape[2:])
            new[p] = t.contiguous() if contiguous else t
        if len(ns) > 1:  # mismatched N: let the fallback raise PyTorch's error
            raise Decline()
        n = ns.pop() if ns else None
        if size_pos is not None:
            if not has_n:
                raise Decline()
            if size_pos < len(args):
                new[size_pos] = _times_batch(args[size_pos], B)
            else:
                kwargs = dict(kwargs, **{size_arg: _times_batch(kwargs[size_arg], B)})
        out = op(*new, **kwargs)

        def split(o):
            if o is None:
                return None, None
            return (o.unflatten(0, (B, n)) if has_n else o), 0
        if isinstance(out, (tuple, list)):
            pairs = [split(o) for o in out]
            return tuple(o for o, _ in pairs), tuple(d for _, d in pairs)
        return split(out)
    rule.__name__ = f"fold_into_n_rule[{op}]"
    return rule


for _op, _ranks in (
        # im2col: [N, C, H, W] or [C, H, W] -> [N, C*k, L] or [C*k, L]; col2im the reverse.
        (aten.im2col.default, (3, 4)), (aten.col2im.default, (2, 3)),
        # The grid sampler needs N; its backward returns (grad_input or None, grad_grid or None).
        (aten.grid_sampler_2d_backward.default, (4,)),
        (aten.grid_sampler_3d_backward.default, (5,))):
    register_batch_rule(_op, fold_into_n_rule(_op, _ranks))

_fold_grid_sampler = {op: fold_into_n_rule(op, (rank,))
                      for op, rank in ((aten.grid_sampler_2d.default, 4),
                                       (aten.grid_sampler_3d.default, 5))}


def _grid_sampler_rule(op, rank):
    def rule(info, in_dims, x, grid, interpolation_mode, padding_mode, align_corners):
        B = info.batch_size
        xb, gb = in_dims[0], in_dims[1]
        if logical_rank(x, xb) != rank or logical_rank(grid, gb) != rank:
            raise Decline()
        if xb is not None and gb is not None:
            return _fold_grid_sampler[op](info, in_dims, x, grid, interpolation_mode,
                                          padding_mode, align_corners)
        if xb is None:
            # grid [B, N, D_out, ...] -> [N, B*D_out, ...]; output [N, C, B*D_out, ...]
            G = move_bdim_to_front(grid, gb).movedim(0, 1)
            d_out = G.shape[2]
            G = G.reshape(G.shape[0], B * d_out, *G.shape[3:])
            out = op(x, G, interpolation_mode, padding_mode, align_corners)
            return out.unflatten(2, (B, d_out)), 2
        # input [B, N, C, ...] -> [N, B*C, ...]; output [N, B*C, *out_spatial]
        X = move_bdim_to_front(x, xb).movedim(0, 1)
        c = X.shape[2]
        X = X.reshape(X.shape[0], B * c, *X.shape[3:])
        out = op(X, grid, interpolation_mode, padding_mode, align_corners)
        return out.unflatten(1, (B, c)), 1
    rule.__name__ = f"grid_sampler_rule[{op}]"
    return rule


for _op, _rank in ((aten.grid_sampler_2d.default, 4), (aten.grid_sampler_3d.default, 5)):
    register_batch_rule(_op, _grid_sampler_rule(_op, _rank))


def _leading_dims_rule(op):
    def rule(info, in_dims, x, factor):
        if logical_rank(x, in_dims[0]) < 3:
            raise Decline()
        return op(move_bdim_to_front(x, in_dims[0]), factor), 0
    rule.__name__ = f"leading_dims_rule[{op}]"
    return rule


for _op in (aten.pixel_shuffle.default, aten.pixel_unshuffle.default):
    register_batch_rule(_op, _leading_dims_rule(_op))


@register_batch_rule(aten.channel_shuffle.default)
def channel_shuffle_rule(info, in_dims, x, groups):
    """channel_shuffle permutes dim 1 of an ``[N, C, *]`` input (more than two dims)."""
    if logical_rank(x, in_dims[0]) < 3:
        raise Decline()
    X = move_bdim_to_front(x, in_dims[0])
    out = aten.channel_shuffle.default(X.flatten(0, 1), groups)
    return out.unflatten(0, X.shape[:2]), 0
