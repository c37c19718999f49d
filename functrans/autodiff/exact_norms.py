"""Exact higher-order derivatives of layer_norm, batch_norm and instance_norm.

PyTorch's ``native_layer_norm`` and ``native_batch_norm`` return their mean and inverse standard
deviation as outputs that autograd treats as constants, and their backward formulas take them as
inputs.  First derivatives are right, and so is the input-input second derivative; but the
weight gradient's derivative w.r.t. the input is not (``grad(lambda x: jacrev(f_w)(w) ...)``,
reverse over reverse: off by 0.4-3.0 for normalised sizes 2-8 against finite differences, with
the reference library agreeing with plain autograd), nor is anything that differentiates the
graph three times: ``jacfwd(jacfwd(f))``, ``jacrev(jacfwd(f))``, ``grad`` over ``jvp`` (a jvp
under a reverse transform takes the double-vjp route, which differentiates the graph twice), and
third-order reverse mode (off by 2.1 for a 4-vector's layer_norm).  The fuzzer found them.

So while the graph is differentiated twice or more (``graph_order() >= 2``: each autodiff level
counts its ``AutodiffLevel.order``), functrans runs these functions as compositions of primitive ops
(mean, subtraction, rsqrt, multiplication), whose derivatives are exact at every order.  A
``TorchFunctionMode`` makes the swap; it costs about 1.4 µs per torch call, so it is active only
in nested autodiff transforms.  First-order transforms (grad, vjp, jacrev, vmap(grad) for
per-sample gradients) keep the fused kernels.  Running statistics are still updated by the fused
kernel (under no_grad), so their semantics under vmap do not change.

The same mode runs ``F.scaled_dot_product_attention`` on its math composition in forward mode
too (a ``jvp`` level on the stack, whatever the graph order): the fused CPU kernel has no
forward formula, and its backward no derivative (``math_attention.py``).  The mode is therefore
active under every jvp as well; the norms are swapped only at graph order 2 and above.  It also
makes the values computed where the user switched forward mode off constants for jvp's
double-vjp levels (``forward_regions``).

Imports: _levels, levels, forward_regions, math_attention.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import _levels
from .forward_regions import cut_levels, enter_forward_level, make_constant
from .levels import AutodiffLevel
from .math_attention import scaled_dot_product_attention

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_tls = threading.local()


def graph_order() -> int:
    """How many times the current function's graph will be differentiated by the active
    functrans autodiff transforms."""
    return sum(level.order for level in _levels.stack() if isinstance(level, AutodiffLevel))


def _normalize(x: torch.Tensor, dims: Sequence[int], eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(biased var + eps) over ``dims``, in float32 for half types (as the
    fused kernels compute)."""
    orig = x.dtype
    if orig in _LOW_PRECISION:
        x = x.float()
    centred = x - x.mean(dims, keepdim=True)
    out = centred * torch.rsqrt((centred * centred).mean(dims, keepdim=True) + eps)
    return out.to(orig)


def _affine(out, weight, bias, shape):
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    k = len(normalized_shape) if isinstance(normalized_shape, (tuple, list, torch.Size)) else 1
    if k == 0:
        return F.layer_norm(input, normalized_shape, weight, bias, eps)
    out = _normalize(input, tuple(range(-k, 0)), eps)
    return _affine(out, weight, bias, input.shape[input.dim() - k:])


def _channel_shape(input):
    return (1, input.shape[1]) + (1,) * (input.dim() - 2)


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
               momentum=0.1, eps=1e-5):
    if not training and running_mean is not None and running_var is not None:
        # normalised by constants: the fused kernel's derivatives are exact at every order
        return F.batch_norm(input, running_mean, running_var, weight, bias, training,
                            momentum, eps)
    if running_mean is not None or running_var is not None:
        with torch.no_grad():   # the running statistics, exactly as the fused kernel updates
            F.batch_norm(input.detach(), running_mean, running_var, None, None, True,
                         momentum, eps)
    dims = (0,) + tuple(range(2, input.dim()))
    return _affine(_normalize(input, dims, eps), weight, bias, _channel_shape(input))


def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None,
                  use_input_stats=True, momentum=0.1, eps=1e-5):
    if not use_input_stats:
        return F.instance_norm(input, running_mean, running_var, weight, bias,
                               use_input_stats, momentum, eps)
    if running_mean is not None or running_var is not None:
        with torch.no_grad():
            F.instance_norm(input.detach(), running_mean, running_var, None, None, True,
                            momentum, eps)
    dims = tuple(range(2, input.dim()))
    return _affine(_normalize(input, dims, eps), weight, bias, _channel_shape(input))


_EXACT = {F.layer_norm: layer_norm, torch.layer_norm: layer_norm,
          F.batch_norm: batch_norm, F.instance_norm: instance_norm}


_ATTENTION = {F.scaled_dot_product_attention: scaled_dot_product_attention}


class ComposedKernelsMode(TorchFunctionMode):
    """Runs layer_norm / batch_norm / instance_norm as primitive ops at graph order 2 and
    above, scaled_dot_product_attention on its math composition (see the module doc), and
    makes what is computed with forward mode switched off a constant for the double-vjp levels
    (Note [forward-disabled regions on the double-vjp route] in forward_regions.py)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        impl = _ATTENTION.get(func)
        if impl is None:
            exact = _EXACT.get(func)
            impl = exact if exact is not None and graph_order() >= 2 else func
        out = impl(*args, **(kwargs or {}))
        cut = cut_levels()
        if cut:
            make_constant(out, args, kwargs, cut)
        return out


@contextlib.contextmanager
def autodiff_level(kind: str, order: int = 1, forward: bool = False
                   ) -> Iterator[AutodiffLevel]:
    """Push an autodiff level; in forward mode or at graph order 2 and above, also run the
    function with ``ComposedKernelsMode`` (once per thread: inner levels find it active).
    ``forward``: a forward-mode level on the double-vjp route (``AutodiffLevel.forward``)."""
    level = AutodiffLevel(kind, order, forward)
    if forward:
        enter_forward_level(level)
    with _levels.pushed(level):
        if (graph_order() < 2 and kind != "jvp") or getattr(_tls, "active", False):
            yield level
            return
        _tls.active = True
        try:
            with ComposedKernelsMode():
                yield level
        finally:
            _tls.active = False
