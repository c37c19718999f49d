"""Activations that the ``torch.Tag.pointwise`` factory does not reach: glu and its backward,
prelu's kernels, and the elementwise activation kernels and backward kernels that ATen does not
tag pointwise (elu_backward, hardswish, log_sigmoid_forward, softshrink_backward, ...).

Invariants:
* the untagged elementwise kernels are elementwise in every tensor argument, so they reuse the
  pointwise rule (bdims aligned, logical broadcasting, backward kernels see equal shapes);
* glu splits a LOGICAL dim: it is translated to a physical one and the bdim stays put;
* ``_prelu_kernel``'s output takes its input's shape, so a shared input is expanded to the
  batch; ``_prelu_kernel_backward`` returns both gradients in the broadcast shape (autograd reduces the
  weight's), so it is elementwise too and no example's gradient mixes with another's.
"""
from __future__ import annotations

import torch

from ..helpers import ensure_bdim_front, front_dim, logical_rank, pad_to_rank, physical_dim
from ..registry import registrar
from .pointwise import pointwise_rule_for

aten = torch.ops.aten
register_batch_rule = registrar("activations")   # the rules below live in this file

# Elementwise in all their tensor arguments, but not tagged pointwise by ATen.
_ELEMENTWISE = (
    aten.elu_backward.default,
    aten.leaky_relu_backward.default,
    aten.hardtanh_backward.default,
    aten.softplus_backward.default,
    aten.hardswish.default,
    aten.hardswish_backward.default,
    aten.hardsigmoid_backward.default,
    aten.softshrink_backward.default,
    aten.hardshrink_backward.default,
    aten.log_sigmoid_forward.default,
    aten.log_sigmoid_backward.default,
    aten.rrelu_with_noise_backward.default,
    aten._prelu_kernel_backward.default,   # both gradients come back in the broadcast shape
)

for _op in _ELEMENTWISE:
    register_batch_rule(_op, pointwise_rule_for(_op))


@register_batch_rule(aten.glu.default)
def glu_rule(info, in_dims, x, dim=-1):
    bdim = in_dims[0]
    return aten.glu.default(x, physical_dim(dim, bdim, logical_rank(x, bdim))), bdim


@register_batch_rule(aten.glu_backward.default)
def glu_backward_rule(info, in_dims, grad, x, dim):
    B = info.batch_size
    rank = x.dim() - (in_dims[1] is not None)
    G = ensure_bdim_front(grad, in_dims[0], B)
    X = ensure_bdim_front(x, in_dims[1], B)
    return aten.glu_backward.default(G, X, front_dim(dim, rank)), 0



@register_batch_rule(aten._prelu_kernel.default)
def prelu_kernel_rule(info, in_dims, x, weight):
    """The weight broadcasts against ``x``; the kernel's output takes ``x``'s shape, so ``x`` is
    given the full broadcast shape (as in eager, where prelu reshaped the weight to fit)."""
    B = info.batch_size
    fronts = [ensure_bdim_front(t, d, B) for t, d in zip((x, weight), in_dims)]
    top = max(t.dim() - 1 for t in fronts)
    X, W = (pad_to_rank(t, top) for t in fronts)
    X = X.expand(torch.broadcast_shapes(X.shape, W.shape))
    return aten._prelu_kernel.default(X, W), 0


@register_batch_rule(aten.glu_jvp.default)
def glu_jvp_rule(info, in_dims, glu, x, dx, dim):
    B = info.batch_size
    rank = x.dim() - (in_dims[1] is not None)
    tensors = (ensure_bdim_front(t, d, B) for t, d in zip((glu, x, dx), in_dims))
    return aten.glu_jvp.default(*tensors, front_dim(dim, rank)), 0
