"""Normalisation: layer norm, group norm and batch norm (every ATen entry point that
``F.layer_norm``, ``F.group_norm``, ``F.batch_norm`` and ``F.instance_norm`` reach, forward and
backward).  ``F.rms_norm`` decomposes above dispatch into ops with rules of their own.

Invariants:
* each example is its own mini-batch, as in PyTorch's own vmap: statistics never mix examples.
* batch norm and group norm fold the vmap batch into the channels: a logical ``[N, C, *s]``
  becomes one physical ``[N, B*C, *s]`` call (``B*groups`` groups for group norm), with
  per-channel operands (weight, bias, running stats, saved statistics) laid out as ``[B*C]``.
  Per-channel outputs (saved statistics, weight and bias gradients) come back as ``[B, C]``.
* when only the affine operands are batched (an ensemble over one input), the statistics are
  computed once on the unbatched input with no affine, and the batched affine is applied after.
* layer norm normalises the trailing dims, so the batch simply goes first; a batched weight or
  bias is applied after an affine-free kernel call, and weight/bias gradients are summed per
  example in the backward (the kernel would sum them over the whole batch).
* running statistics in training mode: batched buffers get each example's update written back
  into their own slice with ``copy_``; unbatched buffers with a batched input raise
  ``UnsupportedUnderVmap`` (each example would update the same buffer differently); unbatched
  buffers with an unbatched input are updated once, as any unbatched computation under vmap.
  The ``*_functional`` variants return new statistics instead, so they need no such check.
* kernels that read an operand as contiguous memory without checking (group norm's weight,
  bias, grad, mean, rstd; layer norm backward's mean, rstd) get contiguous physical operands
  made from the operands' LOGICAL values: the answer never depends on how a batched operand
  is laid out in memory.  (Eager ``native_group_norm`` on a non-contiguous weight reads the
  wrong memory, a layout-dependent value no layout-free program can ask for; the rule gives
  what the op computes on contiguous examples, as torch.func does.  ``F.group_norm`` passes
  contiguous operands, so it and the op agree.)  Layer norm backward with a non-contiguous
  mean/rstd is declined (the loop reproduces eager).
  Statistics are returned contiguous per example.
* an opaque cuDNN ``reserve`` output is passed through unbatched; a non-empty one reaching
  ``batch_norm_backward`` is declined (it describes a call this rule did not make).
* not covered: the ``.out`` overloads, cudnn/miopen batch norm (CUDA), ``_fused_rms_norm_backward``.
"""
from __future__ import annotations

import torch

from ...errors import UnsupportedUnderVmap
from ..helpers import ensure_bdim_front, move_bdim_to_front
from ..registry import Decline, registrar

aten = torch.ops.aten
register_batch_rule = registrar("norms")   # the rules below live in this file

# Output kinds of the batch-norm family: the normalised tensor, a per-channel tensor, an opaque
# reserve (cuDNN workspace; empty on CPU).
_OUT, _CHAN, _OPAQUE = "out", "chan", "opaque"


# ----------------------------------------------------------------------------- layouts

def _fold_channels(x, bdim, B):
    """[B, N, C, *s] (or unbatched [N, C, *s]) -> contiguous [N, B*C, *s]."""
    X = ensure_bdim_front(x, bdim, B)
    return X.movedim(0, 1).reshape(X.shape[1], B * X.shape[2], *X.shape[3:]).contiguous()


def _unfold_channels(y, B):
    """[N, B*C, *s] -> ([N, B, C, *s], bdim 1)."""
    return y.reshape(y.shape[0], B, y.shape[1] // B, *y.shape[2:])


def _fold_per_channel(v, bdim, B):
    """Per-channel [C] (batched or not) -> contiguous [B*C]; None stays None."""
    if v is None:
        return None
    return ensure_bdim_front(v, bdim, B).reshape(-1).contiguous()


def _split_per_channel(v, B):
    """[B*C] -> [B, C] (an empty placeholder becomes [B, 0])."""
    return v.reshape(B, v.numel() // B)


def _channel_affine(y, w, wb, b, bb, B):
    """``y * w + b`` over the channel dim of an unbatched logical ``y`` ([N, C, *s]) with w/b
    batched or not (at least one batched): the result is batch-first [B, N, C, *s]."""
    rank = y.dim()

    def per_channel(v, bdim):
        if bdim is None:
            return v.reshape(v.shape[0], *([1] * (rank - 2)))
        V = move_bdim_to_front(v, bdim)
        return V.reshape(B, 1, V.shape[1], *([1] * (rank - 2)))

    out = y
    if w is not None:
        out = out * per_channel(w, wb)
    if b is not None:
        out = out + per_channel(b, bb)
    return out.to(y.dtype)


def _trailing_affine(y, y_batched, w, wb, b, bb, k, B):
    """``y * w + b`` where w/b cover the last ``k`` dims of a logical ``y``; batch first."""
    prefix = y.dim() - y_batched - k

    def lift(v, bdim):
        if bdim is None:
            return v
        V = move_bdim_to_front(v, bdim)
        return V.reshape(B, *([1] * prefix), *V.shape[1:])

    out = y
    if w is not None:
        out = out * lift(w, wb)
    if b is not None:
        out = out + lift(b, bb)
    out = out.to(y.dtype)
    return out if out.dim() == y.dim() + (not y_batched) else out.expand(B, *out.shape)


# ----------------------------------------------------------------------------- layer norm

@register_batch_rule(aten.native_layer_norm.default)
def native_layer_norm_rule(info, in_dims, x, normalized_shape, w, b, eps):
    B = info.batch_size
    xb, _, wb, bb = in_dims[:4]
    X = x if xb is None else move_bdim_to_front(x, xb)
    stat_dim = None if xb is None else 0
    if wb is None and bb is None:
        out, mean, rstd = aten.native_layer_norm.default(X, normalized_shape, w, b, eps)
        return (out, mean, rstd), (0, stat_dim, stat_dim)
    y, mean, rstd = aten.native_layer_norm.default(X, normalized_shape, None, None, eps)
    out = _trailing_affine(y, xb is not None, w, wb, b, bb, len(normalized_shape), B)
    return (out, mean, rstd), (0, stat_dim, stat_dim)


def _sum_per_example(t, k):
    """Sum a batch-first [B, *prefix, *normalized] over its prefix dims."""
    dims = list(range(1, t.dim() - k))
    return t.sum(dims) if dims else t


@register_batch_rule(aten.native_layer_norm_backward.default)
def native_layer_norm_backward_rule(info, in_dims, grad, x, normalized_shape, mean, rstd, w,
                                    b, output_mask):
    B = info.batch_size
    gb_, xb, _, mb, rb, wb, bb = in_dims[:7]
    _decline_noncontiguous((mean, mb), (rstd, rb))
    k = len(normalized_shape)
    # The kernel reads mean and rstd as contiguous memory: expanded or moved ones are copied.
    G, X, M, R = (ensure_bdim_front(t, d, B).contiguous()
                  for t, d in ((grad, gb_), (x, xb), (mean, mb), (rstd, rb)))
    gi = gw = gbias = None
    if output_mask[0]:
        if wb is None:
            gi = aten.native_layer_norm_backward.default(
                G, X, normalized_shape, M, R, w, None, [True, False, False])[0]
        else:
            # d(xhat) = grad * w: the kernel with no weight turns it into d(x).
            Gw = _trailing_affine(G, True, w, wb, None, None, k, B).contiguous()
            gi = aten.native_layer_norm_backward.default(
                Gw, X, normalized_shape, M, R, None, None, [True, False, False])[0]
    if output_mask[1] and w is not None:
        xhat = (X - M) * R
        gw = _sum_per_example(G * xhat, k).to(w.dtype)
    if output_mask[2] and b is not None:
        gbias = _sum_per_example(G, k).to(b.dtype)
    outs = (gi, gw, gbias)
    return outs, tuple(None if o is None else 0 for o in outs)


# ----------------------------------------------------------------------------- group norm

def _decline_noncontiguous(*operands):
    """Layer norm backward reads mean and rstd as contiguous memory without checking, so a
    non-contiguous one gives values that are not the op's.  The autograd formulas always pass
    contiguous ones; a direct call that does not is declined, so the loop fallback reproduces
    exactly what the eager op computes."""
    for v, bdim in operands:
        if v is not None and not (v if bdim is None else v.select(bdim, 0)).is_contiguous():
            raise Decline()


@register_batch_rule(aten.native_group_norm.default)
def native_group_norm_rule(info, in_dims, x, w, b, N, C, HxW, group, eps):
    B = info.batch_size
    xb = in_dims[0]
    wb, bb = in_dims[1], in_dims[2]
    if xb is None:
        # Only the affine is batched: one affine-free call, then the batched affine.
        y, mean, rstd = aten.native_group_norm.default(x.contiguous(), None, None, N, C, HxW,
                                                       group, eps)
        return (_channel_affine(y, w, wb, b, bb, B), mean, rstd), (0, None, None)
    X = _fold_channels(x, xb, B)
    out, mean, rstd = aten.native_group_norm.default(
        X, _fold_per_channel(w, wb, B), _fold_per_channel(b, bb, B), N, B * C, HxW, B * group,
        eps)
    # Statistics batch-first and contiguous per example, as the backward kernel reads them.
    stats = [_unfold_channels(t, B).movedim(1, 0).contiguous() for t in (mean, rstd)]
    return (_unfold_channels(out, B), *stats), (1, 0, 0)


@register_batch_rule(aten.native_group_norm_backward.default)
def native_group_norm_backward_rule(info, in_dims, grad, x, mean, rstd, w, N, C, HxW, group,
                                    output_mask):
    B = info.batch_size
    xb = in_dims[1]
    gb_, mb, rb, wb = in_dims[0], in_dims[2], in_dims[3], in_dims[4]
    gi, gw, gbias = aten.native_group_norm_backward.default(
        _fold_channels(grad, gb_, B), _fold_channels(x, xb, B), _fold_channels(mean, mb, B),
        _fold_channels(rstd, rb, B), _fold_per_channel(w, wb, B), N, B * C, HxW, B * group,
        output_mask)
    outs = (None if gi is None else _unfold_channels(gi, B),
            None if gw is None else _split_per_channel(gw, B),
            None if gbias is None else _split_per_channel(gbias, B))
    dims = (None if gi is None else 1, None if gw is None else 0, None if gbias is None else 0)
    return outs, dims


# ----------------------------------------------------------------------------- batch norm

def _running_stats_error(op, which):
    return UnsupportedUnderVmap(
        f"vmap: {op} in training mode updates {which} in place, but {which} is not batched "
        "while the input is: every example would write its own statistics into the same "
        "buffer. Under vmap each example is its own mini-batch. Either use the module in eval "
        "mode (module.eval()), or stop tracking running stats "
        "(functrans.replace_all_batch_norm_modules_(model) does it for every batch norm of a "
        "model), or give every example its own buffers by batching running_mean/running_var "
        "(functrans.stack_module_state / functrans.Ensemble stack them per member).")


def _batch_norm(op, info, in_dims, x, w, b, rm, rv, training, kinds, kernel, writes_stats):
    """Shared body: ``kernel(x, w, b, rm, rv)`` runs the op itself on physical operands and
    returns outputs of the given ``kinds``; ``writes_stats``: training updates rm/rv in place."""
    B = info.batch_size
    xb, wb, bb, rmb, rvb = in_dims
    stats = [(rm, rmb, "running_mean"), (rv, rvb, "running_var")]
    if writes_stats:
        for t, d, name in stats:
            if t is not None and d is None and xb is not None:
                raise _running_stats_error(op, name)
    if xb is None and rmb is None and rvb is None:
        # Only the affine is batched: statistics (and any running-stat update) happen once,
        # with a unit affine where the op has one (the same values as none): the kernel then
        # picks the backend each example's call picks (cuDNN, and so its reserve, needs a
        # weight and a bias), and PyTorch's decompositions of the ops that return a reserve
        # (used under FakeTensorMode and torch.compile) cannot take a missing weight or bias.
        C = x.shape[1]
        unit_w = None if w is None else torch.ones(C, dtype=w.dtype, device=w.device)
        unit_b = None if b is None else torch.zeros(C, dtype=b.dtype, device=b.device)
        outs = kernel(x, unit_w, unit_b, rm, rv)
        results = [_channel_affine(o, w, wb, b, bb, B) if kind == _OUT else o
                   for o, kind in zip(outs, kinds)]
        return tuple(results), tuple(0 if kind == _OUT else None for kind in kinds)
    flat_stats = [_fold_per_channel(t, d, B) for t, d, _ in stats]
    if writes_stats:  # the kernel updates private copies; they are written back below
        flat_stats = [None if f is None else f.clone() for f in flat_stats]
    outs = kernel(_fold_channels(x, xb, B), _fold_per_channel(w, wb, B),
                  _fold_per_channel(b, bb, B), *flat_stats)
    if writes_stats:
        for (t, d, _), flat in zip(stats, flat_stats):
            if t is None:
                continue
            if d is not None:
                move_bdim_to_front(t, d).copy_(flat.view(B, -1))
            else:  # unbatched buffers with an unbatched input: every slice is the same update
                t.copy_(flat.view(B, -1)[0])
    results, dims = [], []
    for o, kind in zip(outs, kinds):
        if kind == _OUT:
            results.append(_unfold_channels(o, B))
            dims.append(1)
        elif kind == _CHAN:
            results.append(_split_per_channel(o, B))
            dims.append(0)
        else:
            results.append(o)
            dims.append(None)
    return tuple(results), tuple(dims)


_THREE = (_OUT, _CHAN, _CHAN)


@register_batch_rule(aten.native_batch_norm.default)
def native_batch_norm_rule(info, in_dims, x, w, b, rm, rv, training, momentum, eps):
    def kernel(*t):
        return aten.native_batch_norm.default(*t, training, momentum, eps)
    return _batch_norm("aten.native_batch_norm", info, in_dims[:5], x, w, b, rm, rv, training,
                       _THREE, kernel, writes_stats=training)


@register_batch_rule(aten._native_batch_norm_legit.default, checks_inplace=True)
def native_batch_norm_legit_rule(info, in_dims, x, w, b, rm, rv, training, momentum, eps):
    def kernel(*t):
        return aten._native_batch_norm_legit.default(*t, training, momentum, eps)
    return _batch_norm("aten._native_batch_norm_legit", info, in_dims[:5], x, w, b, rm, rv,
                       training, _THREE, kernel, writes_stats=training)


@register_batch_rule(aten._native_batch_norm_legit.no_stats)
def native_batch_norm_legit_no_stats_rule(info, in_dims, x, w, b, training, momentum, eps):
    def kernel(x_, w_, b_, _rm, _rv):
        return aten._native_batch_norm_legit.no_stats(x_, w_, b_, training, momentum, eps)
    return _batch_norm("aten._native_batch_norm_legit.no_stats", info,
                       (*in_dims[:3], None, None), x, w, b, None, None, training, _THREE,
                       kernel, writes_stats=False)


@register_batch_rule(aten._native_batch_norm_legit_no_training.default)
def native_batch_norm_legit_no_training_rule(info, in_dims, x, w, b, rm, rv, momentum, eps):
    def kernel(*t):
        return aten._native_batch_norm_legit_no_training.default(*t, momentum, eps)
    return _batch_norm("aten._native_batch_norm_legit_no_training", info, in_dims[:5], x, w, b,
                       rm, rv, False, _THREE, kernel, writes_stats=False)


@register_batch_rule(aten._native_batch_norm_legit_functional.default)
def native_batch_norm_legit_functional_rule(info, in_dims, x, w, b, rm, rv, training, momentum,
                                            eps):
    def kernel(*t):
        return aten._native_batch_norm_legit_functional.default(*t, training, momentum, eps)
    return _batch_norm("aten._native_batch_norm_legit_functional", info, in_dims[:5], x, w, b,
                       rm, rv, training, _THREE + (_CHAN, _CHAN), kernel, writes_stats=False)


@register_batch_rule(aten._batch_norm_with_update.default, checks_inplace=True)
def batch_norm_with_update_rule(info, in_dims, x, w, b, rm, rv, momentum, eps):
    def kernel(*t):
        return aten._batch_norm_with_update.default(*t, momentum, eps)
    return _batch_norm("aten._batch_norm_with_update", info, in_dims[:5], x, w, b, rm, rv,
                       True, _THREE + (_OPAQUE,), kernel, writes_stats=True)


@register_batch_rule(aten._batch_norm_with_update_functional.default)
def batch_norm_with_update_functional_rule(info, in_dims, x, w, b, rm, rv, momentum, eps):
    def kernel(*t):
        return aten._batch_norm_with_update_functional.default(*t, momentum, eps)
    return _batch_norm("aten._batch_norm_with_update_functional", info, in_dims[:5], x, w, b,
                       rm, rv, True, _THREE + (_OPAQUE, _CHAN, _CHAN), kernel,
                       writes_stats=False)


@register_batch_rule(aten._batch_norm_no_update.default)
def batch_norm_no_update_rule(info, in_dims, x, w, b, rm, rv, momentum, eps):
    def kernel(*t):
        return aten._batch_norm_no_update.default(*t, momentum, eps)
    return _batch_norm("aten._batch_norm_no_update", info, in_dims[:5], x, w, b, rm, rv, False,
                       _THREE + (_OPAQUE,), kernel, writes_stats=False)


def _batch_norm_backward(B, in_dims, grad, x, w, rm, rv, save_mean, save_invstd, call):
    """Fold every operand into the channels, run ``call`` once, split the gradients."""
    gi, gw, gbias = call(
        _fold_channels(grad, in_dims[0], B), _fold_channels(x, in_dims[1], B),
        *(_fold_per_channel(t, d, B) for t, d in zip((w, rm, rv, save_mean, save_invstd),
                                                     in_dims[2:7])))
    outs = (None if gi is None else _unfold_channels(gi, B),
            None if gw is None else _split_per_channel(gw, B),
            None if gbias is None else _split_per_channel(gbias, B))
    dims = (None if gi is None else 1, None if gw is None else 0, None if gbias is None else 0)
    return outs, dims


@register_batch_rule(aten.native_batch_norm_backward.default)
def native_batch_norm_backward_rule(info, in_dims, grad, x, w, rm, rv, save_mean, save_invstd,
                                    train, eps, output_mask):
    def call(*t):
        return aten.native_batch_norm_backward.default(*t, train, eps, output_mask)
    return _batch_norm_backward(info.batch_size, in_dims, grad, x, w, rm, rv, save_mean,
                                save_invstd, call)


@register_batch_rule(aten.batch_norm_backward.default)
def batch_norm_backward_rule(info, in_dims, grad, x, w, rm, rv, save_mean, save_var, update,
                             eps, output_mask, reserve):
    if reserve.numel() != 0:
        raise Decline()  # a cuDNN workspace of some other call: it cannot be folded
    empty = reserve if in_dims[10] is None else reserve.reshape(-1)

    def call(*t):
        return aten.batch_norm_backward.default(*t, update, eps, output_mask, empty)
    return _batch_norm_backward(info.batch_size, in_dims, grad, x, w, rm, rv, save_mean,
                                save_var, call)
