"""Differentiable wrapping into and out of a ``BatchedTensor``.

``add_batch_dim`` and ``remove_batch_dim`` are the only ways values cross a vmap boundary.  When
autograd or forward AD is watching the value they go through ``torch.autograd.Function``s, so
``grad(lambda x: vmap(f)(x).sum())`` and ``jvp`` over ``vmap`` work: the backward of adding a
batch dim turns the cotangent back into a physical tensor (expanding one that is not batched at
this level), and the backward of removing one wraps the physical cotangent again.
"""
from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD

from .batched_tensor import BatchedTensor
from .helpers import match_bdim


def _forward_ad_active() -> bool:
    return getattr(fwAD, "_current_level", -1) >= 0


def _needs_autograd(x: torch.Tensor) -> bool:
    if x.requires_grad and torch.is_grad_enabled():
        return True
    if _forward_ad_active():
        return fwAD.unpack_dual(x).tangent is not None
    return False


def to_physical(grad: torch.Tensor, level, bdim: int) -> torch.Tensor:
    """A cotangent/tangent for a logical value of ``level`` as a physical tensor with ``bdim``."""
    if isinstance(grad, BatchedTensor) and grad.level is level:
        return match_bdim(grad.value, grad.bdim, bdim, level.batch_size)
    return match_bdim(grad, None, bdim, level.batch_size)


class _AddBatchDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, bdim, level):
        ctx.bdim, ctx.level = bdim, level
        return BatchedTensor(value.detach(), bdim, level)

    @staticmethod
    def backward(ctx, grad):
        return to_physical(grad, ctx.level, ctx.bdim), None, None

    @staticmethod
    def jvp(ctx, tangent, _bdim, _level):
        return BatchedTensor(tangent, ctx.bdim, ctx.level)


class _RemoveBatchDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, batched, out_dim):
        ctx.level, ctx.out_dim = batched.level, out_dim
        return match_bdim(batched.value, batched.bdim, out_dim, batched.level.batch_size)

    @staticmethod
    def backward(ctx, grad):
        return BatchedTensor(grad, ctx.out_dim, ctx.level), None

    @staticmethod
    def jvp(ctx, tangent, _out_dim):
        return to_physical(tangent, ctx.level, ctx.out_dim)


def add_batch_dim(value: torch.Tensor, bdim: int, level) -> BatchedTensor:
    if _needs_autograd(value):
        return _AddBatchDim.apply(value, bdim, level)
    if value.requires_grad:
        value = value.detach()
    return BatchedTensor(value, bdim, level)


def remove_batch_dim(batched: BatchedTensor, out_dim: int) -> torch.Tensor:
    if _needs_autograd(batched):
        return _RemoveBatchDim.apply(batched, out_dim)
    return match_bdim(batched.value, batched.bdim, out_dim, batched.level.batch_size)
