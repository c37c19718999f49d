"""The matmul family: mm, bmm, mv, dot, vdot, addmm, addmv, baddbmm, addbmm, addr (what
``torch.matmul``, ``F.linear``, ``einsum``, ``tensordot`` and their backward formulas reach).

Invariants: every product is ONE call of PyTorch's batched kernels through ``torch.matmul`` on
the physical tensors: batched operands get the batch dim first, unbatched ones are passed as they
are and broadcast (a batched input against an unbatched weight folds into a single mm; two
batched operands become a bmm).  Vectors are treated as one-column / one-row matrices so
broadcasting cannot pair the batch dim with a logical dim.  Outputs have the bdim first.
``beta == 0`` ignores ``self`` entirely (NaNs in it do not propagate), as in eager.
"""
from __future__ import annotations

import torch

from ..helpers import logical_rank, move_bdim_to_front, pad_to_rank
from ..registry import register_batch_rule

aten = torch.ops.aten


def _front(x, bdim):
    return x if bdim is None else move_bdim_to_front(x, bdim)


def _check_rank(op, name, x, bdim, rank):
    r = logical_rank(x, bdim)
    if r != rank:
        raise RuntimeError(f"{op}: {name} must be a {rank}-D tensor, got {r}-D")


def _mm(a, ad, b, bd):
    return torch.matmul(_front(a, ad), _front(b, bd))


def _mv(m, md, v, vd):
    return torch.matmul(_front(m, md), _front(v, vd).unsqueeze(-1)).squeeze(-1)


def _bmm(a, ad, b, bd):
    return torch.matmul(_front(a, ad), _front(b, bd))


@register_batch_rule(aten.mm.default)
def mm_rule(info, in_dims, a, b):
    _check_rank("mm", "self", a, in_dims[0], 2)
    _check_rank("mm", "mat2", b, in_dims[1], 2)
    return _mm(a, in_dims[0], b, in_dims[1]), 0


@register_batch_rule(aten.bmm.default)
def bmm_rule(info, in_dims, a, b):
    _check_rank("bmm", "self", a, in_dims[0], 3)
    _check_rank("bmm", "mat2", b, in_dims[1], 3)
    return _bmm(a, in_dims[0], b, in_dims[1]), 0


@register_batch_rule(aten.mv.default)
def mv_rule(info, in_dims, m, v):
    _check_rank("mv", "self", m, in_dims[0], 2)
    _check_rank("mv", "vec", v, in_dims[1], 1)
    return _mv(m, in_dims[0], v, in_dims[1]), 0


def _dot(a, ad, b, bd):
    return torch.matmul(_front(a, ad).unsqueeze(-2), _front(b, bd).unsqueeze(-1))[..., 0, 0]


@register_batch_rule(aten.dot.default)
def dot_rule(info, in_dims, a, b):
    _check_rank("dot", "self", a, in_dims[0], 1)
    _check_rank("dot", "tensor", b, in_dims[1], 1)
    return _dot(a, in_dims[0], b, in_dims[1]), 0


@register_batch_rule(aten.vdot.default)
def vdot_rule(info, in_dims, a, b):
    _check_rank("vdot", "self", a, in_dims[0], 1)
    _check_rank("vdot", "other", b, in_dims[1], 1)
    return _dot(a.conj(), in_dims[0], b, in_dims[1]), 0


def _scale_add(product, self_, self_bdim, beta, alpha):
    """``beta * self + alpha * product`` with ``product`` batched first."""
    out = product if alpha == 1 else product * alpha
    if beta == 0:
        return out
    s = self_ if self_bdim is None else pad_to_rank(move_bdim_to_front(self_, self_bdim),
                                                   product.dim() - 1)
    return torch.add(out, s, alpha=beta) if beta != 1 else out + s


@register_batch_rule(aten.addmm.default)
def addmm_rule(info, in_dims, self_, m1, m2, *, beta=1, alpha=1):
    _check_rank("addmm", "mat1", m1, in_dims[1], 2)
    _check_rank("addmm", "mat2", m2, in_dims[2], 2)
    if in_dims[1] is None and in_dims[2] is None:
        product = torch.mm(m1, m2).expand(info.batch_size, m1.shape[0], m2.shape[1])
    else:
        product = _mm(m1, in_dims[1], m2, in_dims[2])
    return _scale_add(product, self_, in_dims[0], beta, alpha), 0


@register_batch_rule(aten.addmv.default)
def addmv_rule(info, in_dims, self_, mat, vec, *, beta=1, alpha=1):
    _check_rank("addmv", "mat", mat, in_dims[1], 2)
    _check_rank("addmv", "vec", vec, in_dims[2], 1)
    if in_dims[1] is None and in_dims[2] is None:
        product = torch.mv(mat, vec).expand(info.batch_size, mat.shape[0])
    else:
        product = _mv(mat, in_dims[1], vec, in_dims[2])
    return _scale_add(product, self_, in_dims[0], beta, alpha), 0


@register_batch_rule(aten.baddbmm.default)
def baddbmm_rule(info, in_dims, self_, b1, b2, *, beta=1, alpha=1):
    _check_rank("baddbmm", "batch1", b1, in_dims[1], 3)
    _check_rank("baddbmm", "batch2", b2, in_dims[2], 3)
    if in_dims[1] is None and in_dims[2] is None:
        p = torch.bmm(b1, b2)
        product = p.expand(info.batch_size, *p.shape)
    else:
        product = _bmm(b1, in_dims[1], b2, in_dims[2])
    return _scale_add(product, self_, in_dims[0], beta, alpha), 0


@register_batch_rule(aten.addbmm.default)
def addbmm_rule(info, in_dims, self_, b1, b2, *, beta=1, alpha=1):
    _check_rank("addbmm", "batch1", b1, in_dims[1], 3)
    _check_rank("addbmm", "batch2", b2, in_dims[2], 3)
    if in_dims[1] is None and in_dims[2] is None:
        p = torch.bmm(b1, b2).sum(0)
        product = p.expand(info.batch_size, *p.shape)
    else:
        product = _bmm(b1, in_dims[1], b2, in_dims[2]).sum(1)
    return _scale_add(product, self_, in_dims[0], beta, alpha), 0


@register_batch_rule(aten.addr.default)
def addr_rule(info, in_dims, self_, v1, v2, *, beta=1, alpha=1):
    _check_rank("addr", "vec1", v1, in_dims[1], 1)
    _check_rank("addr", "vec2", v2, in_dims[2], 1)
    product = _front(v1, in_dims[1]).unsqueeze(-1) * _front(v2, in_dims[2]).unsqueeze(-2)
    if product.dim() == 2:
        product = product.expand(info.batch_size, *product.shape)
    return _scale_add(product, self_, in_dims[0], beta, alpha), 0
