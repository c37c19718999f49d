"""Convolution (first part of issue 4's conv/pool/norm family): convolution (also transposed)
and convolution_backward.

Invariants:
* only the input batched: the batch folds into the conv's own batch dim ``N`` (a view when the
  layout allows) and ONE convolution runs with the unbatched weight;
* a batched weight or bias (ensembles), and the backward's weight and bias gradients: the batch
  goes into the channels and one grouped convolution runs with ``groups * B`` — input
  ``[N, B*C, ...]``, weight ``[B*O, C/g, ...]`` (``[B*C, O/g, ...]`` when transposed), bias
  ``[B*O]``.  Unbatched operands are expanded to the batch, so convolution_backward gives
  per-example weight and bias gradients (what ``vmap(grad)`` asks for);
* the backward's input gradient with an unbatched (shared) weight: the batch folds into ``N``
  and one ordinary convolution backward runs with the shared weight.
Inputs without the conv's own batch dim (``F.conv2d`` on a 3-D input reaches here batchified) and
a batched bias with an unbatched weight in the backward are declined to the loop.
"""
from __future__ import annotations

import torch

from ..helpers import (ensure_bdim_front, fold_bdim_into_dim0, logical_rank,
                       move_bdim_to_front, split_dim0)
from ..registry import Decline, registrar

aten = torch.ops.aten
register_batch_rule = registrar("conv")   # the rules below live in this file


def _channels_batched_input(x, bdim, B):
    """[B, N, C, *s] (or unbatched [N, C, *s]) -> [N, B*C, *s]."""
    X = ensure_bdim_front(x, bdim, B)
    return X.movedim(0, 1).reshape(X.shape[1], B * X.shape[2], *X.shape[3:])


def _grouped_weight(w, bdim, B):
    W = ensure_bdim_front(w, bdim, B)
    return W.reshape(B * W.shape[1], *W.shape[2:])


@register_batch_rule(aten.convolution.default)
def convolution_rule(info, in_dims, x, w, bias, stride, padding, dilation, transposed,
                     output_padding, groups):
    B = info.batch_size
    xb, wb, bb = in_dims[:3]
    if logical_rank(x, xb) != logical_rank(w, wb):
        raise Decline()
    conv = aten.convolution.default
    if wb is None and bb is None:
        X = move_bdim_to_front(x, xb)
        out = conv(X.reshape(-1, *X.shape[2:]), w, bias, stride, padding, dilation, transposed,
                   output_padding, groups)
        return out.view(B, X.shape[1], *out.shape[1:]), 0
    if wb is None and bb is not None:
        X = move_bdim_to_front(x, xb) if xb is not None else x.expand(B, *x.shape)
        out = conv(X.reshape(-1, *X.shape[2:]), w, None, stride, padding, dilation, transposed,
                   output_padding, groups)
        out = out.view(B, X.shape[1], *out.shape[1:])
        b = move_bdim_to_front(bias, bb)
        return out + b.view(B, 1, -1, *([1] * (out.dim() - 3))), 0
    X = _channels_batched_input(x, xb, B)
    W = _grouped_weight(w, wb, B)
    if bias is None:
        bias_g = None
    else:
        bias_g = ensure_bdim_front(bias, bb, B).reshape(-1)
    out = conv(X, W, bias_g, stride, padding, dilation, transposed, output_padding, groups * B)
    return out.view(out.shape[0], B, -1, *out.shape[2:]), 1


@register_batch_rule(aten.convolution_backward.default)
def convolution_backward_rule(info, in_dims, grad, x, w, bias_sizes, stride, padding, dilation,
                              transposed, output_padding, groups, output_mask):
    """With an unbatched weight (per-example gradients), the input's gradient folds the batch into
    ``N`` and runs one ordinary convolution backward with the shared weight; the grouped call
    (``groups * B``) computes only the weight and bias gradients, which differ per example.  A
    grouped call for the input's gradient too ran cuDNN's grouped direct kernel: 3.6 ms of the
    19 ms a per-sample-gradient step of a small CNN took at B=4096 on an H200 (2026-11-27),
    against about 1 ms folded."""
    B = info.batch_size
    gb, xb, wb = in_dims[:3]
    if logical_rank(x, xb) != logical_rank(w, wb):
        raise Decline()
    conv_backward = aten.convolution_backward.default
    mask = list(output_mask)
    folded = None
    if wb is None and mask[0]:
        gi = conv_backward(fold_bdim_into_dim0(grad, gb, B), fold_bdim_into_dim0(x, xb, B), w,
                           None, stride, padding, dilation, transposed, output_padding, groups,
                           [True, False, False])[0]
        folded = split_dim0(gi, B)
        mask[0] = False
    gi = gw = gbias = None
    if any(mask):
        G = _channels_batched_input(grad, gb, B)
        X = _channels_batched_input(x, xb, B)
        W = _grouped_weight(w, wb, B)
        sizes = None if bias_sizes is None else [B * s for s in bias_sizes]
        gi, gw, gbias = conv_backward(G, X, W, sizes, stride, padding, dilation, transposed,
                                      output_padding, groups * B, mask)
    outs, dims = [], []
    if folded is not None:
        outs.append(folded)
        dims.append(0)
    elif gi is not None:
        outs.append(gi.view(gi.shape[0], B, -1, *gi.shape[2:]))
        dims.append(1)
    else:
        outs.append(None)
        dims.append(None)
    if gw is not None:
        outs.append(gw.view(B, -1, *gw.shape[1:]))
        dims.append(0)
    else:
        outs.append(None)
        dims.append(None)
    if gbias is not None:
        outs.append(gbias.view(B, -1))
        dims.append(0)
    else:
        outs.append(None)
        dims.append(None)
    return tuple(outs), tuple(dims)
