"""Matrix products: ``mm``, ``bmm``, ``mv``, ``dot``, ``vdot``, ``addmm``, ``addmv``, ``addbmm``,
``baddbmm``, ``addr``.

``torch.matmul``, ``F.linear``, ``torch.outer``, ``torch.inner``, ``torch.einsum`` and
``torch.tensordot`` are CompositeImplicitAutograd: they reach the dispatcher as these ops plus
views (views.py) and pointwise ops, and so do the backward formulas of all of them.

Every op is treated as a product of logical matrices ``[..., n, k] @ [..., k, m]`` (a vector is a
matrix with a size-1 dim), with at most one leading logical batch dim (``bmm``).  Invariants:
* one operand batched: its batch dim is folded into its free dim (``n`` for the left operand,
  ``m`` for the right one) and ONE unbatched kernel runs (``mm``/``addmm`` for matrices, ``bmm``
  for ``bmm``).  The unbatched operand is used as it is, never expanded.  The fold is a view
  whenever the batch dim can sit next to the free dim in memory (the batch right before or
  right after it: ``x`` of shape ``[B, n, k]``, ``[n, B, k]``, ``[k, m, B]``...); otherwise it
  copies the batched operand once.  See Note [folding the batch].
* both operands batched: one ``bmm``/``baddbmm`` over the batch moved to the front (for ``bmm``
  the batch and the op's own batch dim are flattened together).
* the add-variants keep eager semantics: ``out = beta * self + alpha * product``, and
  ``beta == 0`` ignores ``self`` (NaNs in it do not propagate).  ``self`` is passed to the fused
  kernel whenever it broadcasts over the folded layout (a bias of ``F.linear``), otherwise the
  product is computed first and ``self`` is added to it.

The ``out_dtype`` (``.dtype``) and ``out=`` overloads are left to the fallback.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..helpers import move_bdim_to_front, pad_to_rank
from ..registry import registrar

aten = torch.ops.aten
register_batch_rule = registrar("linalg")   # the rules below live in this file

# Note [folding the batch]
# With only ``a`` batched, ``a @ b`` for a batch of ``a``s is one matrix product of the batch
# stacked along ``a``'s rows: ``[B, n, k] -> [B*n, k]``, then ``@ b`` and split the rows again.
# With only ``b`` batched the batch goes into ``b``'s columns: ``[k, B, m] -> [k, B*m]``.  The
# batch may be placed right before or right after the free dim; either order is fine because
# the result is split back in the same order, and the output's bdim records which one was used.
# When neither placement is a view (e.g. ``bmm`` with the batch outside the op's own batch dim,
# ``[B, b, n, k]``), the batched operand is copied: that costs no more than the product itself,
# whereas broadcasting would materialise ``B`` copies of the unbatched operand.


def _front(x: torch.Tensor, bdim: Optional[int]) -> torch.Tensor:
    return x if bdim is None else move_bdim_to_front(x, bdim)


def _mergeable(x: torch.Tensor, d: int) -> bool:
    """Whether dims ``d`` and ``d + 1`` of ``x`` flatten into one without a copy."""
    return x.size(d) == 1 or x.size(d + 1) == 1 or \
        x.stride(d) == x.stride(d + 1) * x.size(d + 1)


def _fold(x: torch.Tensor, free: int) -> Tuple[torch.Tensor, bool]:
    """Fold the leading batch dim of ``x`` into its logical dim ``free``.

    Returns the folded tensor and whether the batch comes first within the folded dim.
    A view when the layout allows (see Note [folding the batch]), else a copy of ``x``.
    """
    before = x.movedim(0, free)
    if _mergeable(before, free):
        return before.flatten(free, free + 1), True
    after = x.movedim(0, free + 1)
    if _mergeable(after, free):
        return after.flatten(free, free + 1), False
    return before.flatten(free, free + 1), True


def _unfold(out: torch.Tensor, dim: int, batch_first: bool, size: int) -> Tuple[torch.Tensor, int]:
    """Split the folded dim ``dim`` of ``out`` back into (batch, free); returns (out, bdim)."""
    if batch_first:
        return out.unflatten(dim, (size, -1)), dim
    return out.unflatten(dim, (-1, size)), dim + 1


def _fold_product(kernel, a, ad, b, bd, rank: int, size: int):
    """``kernel(a, b)`` of logical rank-``rank`` matrices with exactly one operand batched."""
    if bd is None:
        folded, batch_first = _fold(move_bdim_to_front(a, ad), rank - 2)
        return _unfold(kernel(folded, b), rank - 2, batch_first, size)
    folded, batch_first = _fold(move_bdim_to_front(b, bd), rank - 1)
    return _unfold(kernel(a, folded), rank - 1, batch_first, size)


def _product(a, ad, b, bd, rank: int, size: int):
    """``a @ b`` for logical matrices (``rank`` 2) or stacks of matrices (``rank`` 3)."""
    mm = torch.mm if rank == 2 else torch.bmm
    if ad is None and bd is None:
        return mm(a, b), None
    if ad is None or bd is None:
        return _fold_product(mm, a, ad, b, bd, rank, size)
    a, b = move_bdim_to_front(a, ad), move_bdim_to_front(b, bd)
    if rank == 2:
        return torch.bmm(a, b), 0
    out = torch.bmm(a.flatten(0, 1), b.flatten(0, 1))
    return out.unflatten(0, (size, -1)), 0


def _scale_add(prod, pd, self, sd, beta, alpha, rank: int):
    """``beta * self + alpha * prod`` with eager's ``beta == 0`` rule; bdim 0 (or None)."""
    prod = _front(prod, pd)
    if alpha != 1:
        prod = prod * alpha
    if beta == 0:
        return prod, _bdim_front(pd)
    if sd is not None:
        self = pad_to_rank(move_bdim_to_front(self, sd), rank)
    return torch.add(prod, self, alpha=beta), 0


def _broadcasts_over_fold(shape, rows: bool) -> bool:
    """Whether an unbatched ``self`` of ``shape`` broadcasts over a product whose rows
    (``rows``) or columns hold the folded batch."""
    k = 2 if rows else 1
    return len(shape) < k or shape[-k] == 1


def _add_product(self, sd, a, ad, b, bd, beta, alpha, rank: int, size: int):
    """``beta * self + alpha * (a @ b)`` for logical matrices or stacks of matrices."""
    fused = torch.addmm if rank == 2 else torch.baddbmm
    if sd is None and (ad is None) != (bd is None) and \
            _broadcasts_over_fold(self.shape, rows=ad is not None):
        return _fold_product(lambda x, y: fused(self, x, y, beta=beta, alpha=alpha),
                             a, ad, b, bd, rank, size)
    if rank == 2 and ad is not None and bd is not None:
        s = self if sd is None else pad_to_rank(move_bdim_to_front(self, sd), 2)
        return torch.baddbmm(s, move_bdim_to_front(a, ad), move_bdim_to_front(b, bd),
                             beta=beta, alpha=alpha), 0
    prod, pd = _product(a, ad, b, bd, rank, size)
    return _scale_add(prod, pd, self, sd, beta, alpha, rank)


def _unsqueeze(x, bdim, dim: int):
    """Logical ``x.unsqueeze(dim)`` (``dim`` 0 or -1) with the batch dim moved to the front."""
    x = _front(x, bdim)
    return x.unsqueeze(dim if dim < 0 or bdim is None else dim + 1)


def _squeeze_last(out, bdim):
    """Logical ``out.squeeze(-1)``."""
    if bdim is not None and bdim == out.dim() - 1:
        return out.squeeze(-2), bdim - 1
    return out.squeeze(-1), bdim


def _bdim_front(bdim):
    return None if bdim is None else 0


@register_batch_rule(aten.mm.default)
def mm_rule(info, in_dims, a, b):
    return _product(a, in_dims[0], b, in_dims[1], 2, info.batch_size)


@register_batch_rule(aten.bmm.default)
def bmm_rule(info, in_dims, a, b):
    return _product(a, in_dims[0], b, in_dims[1], 3, info.batch_size)


@register_batch_rule(aten.mv.default)
def mv_rule(info, in_dims, a, v):
    ad, vd = in_dims
    out, od = _product(a, ad, _unsqueeze(v, vd, -1), _bdim_front(vd), 2, info.batch_size)
    return _squeeze_last(out, od)


def _dot(a, ad, b, bd, size):
    row, col = _unsqueeze(a, ad, 0), _unsqueeze(b, bd, -1)
    out, od = _product(row, _bdim_front(ad), col, _bdim_front(bd), 2, size)
    return _front(out, od).flatten(), 0


@register_batch_rule(aten.dot.default)
def dot_rule(info, in_dims, a, b):
    return _dot(a, in_dims[0], b, in_dims[1], info.batch_size)


@register_batch_rule(aten.vdot.default)
def vdot_rule(info, in_dims, a, b):
    return _dot(a.conj(), in_dims[0], b, in_dims[1], info.batch_size)


@register_batch_rule(aten.addmm.default)
def addmm_rule(info, in_dims, self, a, b, *, beta=1, alpha=1):
    sd, ad, bd = in_dims
    return _add_product(self, sd, a, ad, b, bd, beta, alpha, 2, info.batch_size)


@register_batch_rule(aten.baddbmm.default)
def baddbmm_rule(info, in_dims, self, a, b, *, beta=1, alpha=1):
    sd, ad, bd = in_dims
    return _add_product(self, sd, a, ad, b, bd, beta, alpha, 3, info.batch_size)


@register_batch_rule(aten.addmv.default)
def addmv_rule(info, in_dims, self, a, v, *, beta=1, alpha=1):
    sd, ad, vd = in_dims
    if self.dim() - (sd is not None) >= 1:
        self, sd = _unsqueeze(self, sd, -1), _bdim_front(sd)
    out, od = _add_product(self, sd, a, ad, _unsqueeze(v, vd, -1), _bdim_front(vd),
                           beta, alpha, 2, info.batch_size)
    return _squeeze_last(out, od)


@register_batch_rule(aten.addbmm.default)
def addbmm_rule(info, in_dims, self, a, b, *, beta=1, alpha=1):
    """``sum_i a[i] @ b[i]`` is one product ``[n, (i k)] @ [(i k), m]``."""
    sd, ad, bd = in_dims
    a = _front(a, ad).movedim(-3, -2).flatten(-2)
    b = _front(b, bd).flatten(-3, -2)
    return _add_product(self, sd, a, _bdim_front(ad), b, _bdim_front(bd), beta, alpha, 2,
                        info.batch_size)


@register_batch_rule(aten.addr.default)
def addr_rule(info, in_dims, self, v1, v2, *, beta=1, alpha=1):
    """An outer product is a broadcasting multiply (as in eager); bool inputs work too."""
    sd, d1, d2 = in_dims
    prod = _unsqueeze(v1, d1, -1) * _unsqueeze(v2, d2, 0)
    pd = None if d1 is None and d2 is None else 0
    return _scale_add(prod, pd, self, sd, beta, alpha, 2)


# ---------------------------------------------------------------------------------------------
# _trilinear (F.bilinear and its backward): sum over ``sumdim`` of the product of three inputs,
# each unsqueezed at its ``expand`` dims to a common rank.

def _is_bilinear_forward(in_dims, i1, i2, i3, expand1, expand2, expand3, sumdim) -> bool:
    """F.bilinear's own call (rows of i1 and i3 against a shared weight i2): the batch can
    join the rows."""
    return (in_dims[1] is None and i2.dim() == 3 and list(expand2) == [0]
            and 0 not in expand1 and 0 not in expand3 and 0 not in sumdim
            and i1.dim() - (in_dims[0] is not None) == 2
            and i3.dim() - (in_dims[2] is not None) == 2)


@register_batch_rule(torch.ops.aten._trilinear.default)
def trilinear_rule(info, in_dims, i1, i2, i3, expand1, expand2, expand3, sumdim,
                   unroll_dim=1):
    B = info.batch_size
    op = torch.ops.aten._trilinear.default
    front = [t if d is None else move_bdim_to_front(t, d) for t, d in zip((i1, i2, i3), in_dims)]
    if _is_bilinear_forward(in_dims, i1, i2, i3, expand1, expand2, expand3, sumdim):
        rows = [t.expand(B, *t.shape) if d is None else t for t, d in zip(front, in_dims)]
        n = rows[0].shape[1]
        out = op(rows[0].reshape(B * n, rows[0].shape[2]), i2,
                 rows[2].reshape(B * n, rows[2].shape[2]),
                 expand1, expand2, expand3, sumdim, unroll_dim)
        return out.view(B, n, *out.shape[1:]), 0
    # In general the batch is one more leading dim of all three (expanded where unbatched).
    full = [t.expand(B, *t.shape) if d is None else t for t, d in zip(front, in_dims)]
    shift = lambda dims: [d + 1 for d in dims]  # noqa: E731
    return op(full[0], full[1], full[2], shift(expand1), shift(expand2), shift(expand3),
              shift(sumdim), unroll_dim + 1), 0
