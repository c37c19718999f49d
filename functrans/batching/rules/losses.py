"""Losses: the nll family (nll_loss_forward/backward, nll_loss2d_forward/backward: what
``F.nll_loss`` and ``F.cross_entropy`` reach), the elementwise losses (mse, huber, smooth_l1,
soft_margin, binary_cross_entropy, binary_cross_entropy_with_logits) with their backward
kernels, the margin losses (multi_margin, multilabel_margin) with theirs, and the chunked path
of ``F.linear_cross_entropy`` (the torch_nn custom ops of torch >= 2.13).

Invariants:
* a loss's reduction is per example: every kernel runs with reduction='none' on the whole
  batch (the batch first, folded into the rows of the row-wise kernels), then each example's
  losses are summed or averaged on their own, so an example's loss never mixes with another's;
* a backward kernel with a reduced loss gets each example's scalar gradient expanded to the
  example's elements (divided by the example's element or row count for 'mean'), and runs with
  reduction='none';
* nll: each example's targets are gathered in one physical call; ignored targets
  (``ignore_index``) weigh zero; a batched class weight is gathered per example;
* multi_margin: a class weight only scales a row's loss by w[target], so a batched one is
  gathered per row and the kernels run unweighted;
* with reduction='none' each example's loss has exactly eager's shape, which follows the
  TARGET's rank, not the input's: multi_margin gives ``[N]`` when the target has a dim (so a
  ``[C]`` input with a ``(1,)`` target gives ``(1,)``) and ``()`` for a 0-d target;
  multilabel_margin gives ``[N]`` only for a 2-D target; nll of a ``[C]`` input gives ``()``
  for a 0-d or a ``(1,)`` target (tests/batching/rules/test_losses_parity.py checks every loss);
* chunked linear_cross_entropy: each row's loss and input gradient depend on its row only, so
  the batch folds into the rows when everything per class (linear weight, bias, class weight)
  is shared; per-example weight/bias gradients or batched per-class operands go to the loop.
"""
from __future__ import annotations

import math

import torch

from ..helpers import ensure_bdim_front, move_bdim_to_front, pad_to_rank
from ..registry import Decline, registrar

aten = torch.ops.aten
register_batch_rule = registrar("losses")   # the rules below live in this file
_NONE, _MEAN, _SUM = 0, 1, 2


def _bind(op, args, kwargs, in_dims):
    """The op's arguments by name (defaults filled in) and their bdims by name."""
    values, dims = {}, {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(args):
            values[a.name], dims[a.name] = args[i], in_dims[i]
        else:
            values[a.name] = kwargs[a.name] if a.name in kwargs else a.default_value
            dims[a.name] = None
    return values, dims


def _per_example(losses, reduction):
    """Reduce ``[B, ...]`` losses of reduction='none' to what ``reduction`` gives each example."""
    if reduction == _NONE:
        return losses
    flat = losses.flatten(1) if losses.dim() > 1 else losses.unsqueeze(1)
    return flat.sum(1) if reduction == _SUM else flat.mean(1)


# ---------------------------------------------------------------------------------------------
# nll_loss / nll_loss2d

def _rows(x, x_bdim, target, t_bdim, size):
    """Inputs as [B, M, C] and targets as [B, M], with the per-example shape of 'none' losses
    and a function taking [B, M, C] back to the input's physical layout (batch first)."""
    X = ensure_bdim_front(x, x_bdim, size)
    T = ensure_bdim_front(target, t_bdim, size)
    if X.dim() == 2:    # one row: [C], with a 0-d or a (1,) target; the loss is 0-d
        return X.unsqueeze(1), T.reshape(size, 1), (), lambda r: r.squeeze(1)
    if X.dim() == 3:    # [N, C]
        return X, T, T.shape[1:], lambda r: r
    if X.dim() == 5:    # nll_loss2d: [N, C, H, W]
        shape = X.shape
        rows = X.movedim(2, -1).reshape(size, -1, shape[2])
        return rows, T.reshape(size, -1), T.shape[1:], \
            lambda r: r.reshape(shape[:2] + shape[3:] + shape[2:3]).movedim(-1, 2)
    raise Decline()


def _target_weights(T, weight, w_bdim, ignore_index, dtype, size):
    ignored = T == ignore_index
    safe = T.masked_fill(ignored, 0)
    if weight is None:
        w = torch.ones(T.shape, dtype=dtype, device=T.device)
    elif w_bdim is None:
        w = weight.index_select(0, safe.reshape(-1)).view(safe.shape)
    else:
        w = move_bdim_to_front(weight, w_bdim).gather(1, safe.reshape(size, -1)).view(safe.shape)
    return safe, w.masked_fill(ignored, 0)


def _nll_forward(info, in_dims, x, target, weight, reduction, ignore_index):
    B = info.batch_size
    X, T, loss_shape, _ = _rows(x, in_dims[0], target, in_dims[1], B)
    safe, w = _target_weights(T, weight, in_dims[2], ignore_index, X.dtype, B)
    losses = -X.gather(2, safe.unsqueeze(2)).squeeze(2) * w          # [B, M]
    total = w.sum(1)
    if reduction == _NONE:
        # Eager gives a [C] input's 'none' loss its total weight (the kernel takes the
        # reducing path for one row), and 0 for any other input.
        total = total if len(loss_shape) == 0 else torch.zeros_like(total)
        return (losses.reshape((B,) + tuple(loss_shape)), total), (0, 0)
    summed = losses.sum(1)
    return (summed if reduction == _SUM else summed / total, total), (0, 0)


def _nll_backward(info, in_dims, grad, x, target, weight, reduction, ignore_index,
                  total_weight):
    B = info.batch_size
    X, T, _, unrows = _rows(x, in_dims[1], target, in_dims[2], B)
    safe, w = _target_weights(T, weight, in_dims[3], ignore_index, X.dtype, B)
    G = ensure_bdim_front(grad, in_dims[0], B)
    if reduction == _NONE:
        g = G.reshape(B, -1)
    else:
        g = G.reshape(B, 1)
        if reduction == _MEAN:
            g = g / ensure_bdim_front(total_weight, in_dims[6], B).reshape(B, 1)
    values = (-w * g).unsqueeze(2).to(X.dtype)
    out = torch.zeros(X.shape, dtype=X.dtype, device=X.device).scatter(2, safe.unsqueeze(2),
                                                                         values)
    return unrows(out), 0


register_batch_rule([aten.nll_loss_forward.default, aten.nll_loss2d_forward.default],
                    _nll_forward)
register_batch_rule([aten.nll_loss_backward.default, aten.nll_loss2d_backward.default],
                    _nll_backward)


# ---------------------------------------------------------------------------------------------
# Elementwise losses: reduction='none' is elementwise in every tensor argument.

def _aligned(values, dims, names, size):
    """The named tensors batch-first, padded to the largest logical rank and expanded to the
    common [B, *logical] shape (the kernels expect equal shapes); None stays None."""
    fronts = {}
    for n in names:
        t, d = values[n], dims[n]
        if t is not None:
            fronts[n] = (t, 0) if d is None else (move_bdim_to_front(t, d), 1)
    top = max(t.dim() - b for t, b in fronts.values())
    padded = {n: pad_to_rank(t, top) if b else t for n, (t, b) in fronts.items()}
    shape = torch.broadcast_shapes((size,) + (1,) * top, *(t.shape for t in padded.values()))
    return {n: padded[n].expand(shape) if n in padded else None for n in names}, shape


def _elementwise_loss(op, tensors):
    def rule(info, in_dims, *args, **kwargs):
        values, dims = _bind(op, args, kwargs, in_dims)
        aligned, _ = _aligned(values, dims, tensors, info.batch_size)
        losses = op(**{**values, **aligned, "reduction": _NONE})
        return _per_example(losses, values["reduction"]), 0
    rule.__name__ = f"elementwise_loss_rule[{op}]"
    return rule


def _elementwise_loss_backward(op, tensors):
    def rule(info, in_dims, *args, **kwargs):
        values, dims = _bind(op, args, kwargs, in_dims)
        B = info.batch_size
        reduction = values["reduction"]
        names = tensors + (("grad_output",) if reduction == _NONE else ())
        aligned, shape = _aligned(values, dims, names, B)
        x, xd = values["self"], dims["self"]
        if tuple(x.shape if xd is None else move_bdim_to_front(x, xd).shape[1:]) != shape[1:]:
            raise Decline()   # the input itself was broadcast: eager's 'mean' count differs
        G = aligned.get("grad_output")
        if reduction != _NONE:
            G = ensure_bdim_front(values["grad_output"], dims["grad_output"], B)
            if reduction == _MEAN:
                G = G / math.prod(shape[1:])
            G = G.reshape((B,) + (1,) * (len(shape) - 1)).expand(shape)
        return op(**{**values, **aligned, "grad_output": G, "reduction": _NONE}), 0
    rule.__name__ = f"elementwise_loss_backward_rule[{op}]"
    return rule


_ELEMENTWISE_LOSSES = {
    "mse_loss": ("self", "target"),
    "huber_loss": ("self", "target"),
    "smooth_l1_loss": ("self", "target"),
    "soft_margin_loss": ("self", "target"),
    "binary_cross_entropy": ("self", "target", "weight"),
}

for _name, _tensors in _ELEMENTWISE_LOSSES.items():
    _fwd = getattr(aten, _name).default
    _bwd = getattr(aten, _name + "_backward").default
    register_batch_rule(_fwd, _elementwise_loss(_fwd, _tensors))
    register_batch_rule(_bwd, _elementwise_loss_backward(_bwd, _tensors))

register_batch_rule(aten.binary_cross_entropy_with_logits.default,
                    _elementwise_loss(aten.binary_cross_entropy_with_logits.default,
                                      ("self", "target", "weight", "pos_weight")))


# ---------------------------------------------------------------------------------------------
# Margin losses: row-wise kernels over [N, C] (or one [C] row); the batch folds into the rows.

def _margin_rows(info, x, x_bdim):
    """The input batch-first, its rows [B*N, C] (a [C] or 0-d example is one row), N."""
    X = ensure_bdim_front(x, x_bdim, info.batch_size)
    if X.dim() == 1:     # 0-d examples: one row of one class
        return X, X.reshape(-1, 1), 1
    if X.dim() not in (2, 3):
        raise Decline()   # eager raises its own error for other ranks
    n_rows = X.shape[1] if X.dim() == 3 else 1
    return X, X.reshape(-1, X.shape[-1]), n_rows


def _per_row_losses(losses, X, reduction, rows_shape):
    """Row losses ([B*N]) as each example's: reduced, or with reduction='none' shaped
    ``rows_shape`` per example (the kernels' own rule: multi_margin gives ``[N]`` whenever the
    target has a dim, even for a ``[C]`` or 0-d input with a ``(1,)`` target, and ``()`` for a
    0-d target, even for a ``[1, C]`` input; multilabel_margin gives ``[N]`` for a 2-D target
    and ``()`` otherwise)."""
    B = X.shape[0]
    if reduction == _NONE:
        return losses.reshape((B,) + tuple(rows_shape))
    return _per_example(losses.reshape(B, -1), reduction)


def _logical_dim(t, bdim):
    return t.dim() - (bdim is not None)


def _row_grads(info, grad, g_bdim, X, n_rows, reduction):
    """Each row's gradient of a 'none' loss, as a [B*N] tensor."""
    B = info.batch_size
    G = ensure_bdim_front(grad, g_bdim, B)
    if reduction == _NONE:
        return G.reshape(-1)
    if reduction == _MEAN:
        G = G / n_rows
    return G.reshape(B, 1).expand(B, n_rows).reshape(-1)


def _class_weights(info, weight, w_bdim, T, n_rows):
    """A batched class weight as each row's own weight w[target] ([B*N]); the kernels then run
    unweighted, since the weight only scales each row's loss (and gradient)."""
    W = move_bdim_to_front(weight, w_bdim)
    return W.gather(1, T.reshape(info.batch_size, n_rows)).reshape(-1)


@register_batch_rule(aten.multi_margin_loss.default)
def multi_margin_loss_rule(info, in_dims, x, target, p=1, margin=1, weight=None,
                           reduction=_MEAN):
    X, rows, n_rows = _margin_rows(info, x, in_dims[0])
    T = ensure_bdim_front(target, in_dims[1], info.batch_size).reshape(-1)
    w_bdim = in_dims[4] if len(in_dims) > 4 else None
    losses = aten.multi_margin_loss.default(rows, T, p, margin,
                                            weight if w_bdim is None else None, _NONE)
    if w_bdim is not None:
        losses = losses * _class_weights(info, weight, w_bdim, T, n_rows)
    rows_shape = (n_rows,) if _logical_dim(target, in_dims[1]) > 0 else ()
    return _per_row_losses(losses, X, reduction, rows_shape), 0


@register_batch_rule(aten.multi_margin_loss_backward.default)
def multi_margin_loss_backward_rule(info, in_dims, grad, x, target, p, margin, weight=None,
                                    reduction=_MEAN):
    X, rows, n_rows = _margin_rows(info, x, in_dims[1])
    T = ensure_bdim_front(target, in_dims[2], info.batch_size).reshape(-1)
    G = _row_grads(info, grad, in_dims[0], X, n_rows, reduction)
    w_bdim = in_dims[5] if len(in_dims) > 5 else None
    if w_bdim is not None:
        G = G * _class_weights(info, weight, w_bdim, T, n_rows)
        weight = None
    out = aten.multi_margin_loss_backward.default(G, rows, T, p, margin, weight, _NONE)
    return out.reshape(X.shape), 0


@register_batch_rule(aten.multilabel_margin_loss_forward.default)
def multilabel_margin_loss_forward_rule(info, in_dims, x, target, reduction):
    X, rows, n_rows = _margin_rows(info, x, in_dims[0])
    T = ensure_bdim_front(target, in_dims[1], info.batch_size).reshape(rows.shape)
    losses, is_target = aten.multilabel_margin_loss_forward.default(rows, T, _NONE)
    t_shape = ensure_bdim_front(target, in_dims[1], info.batch_size).shape
    rows_shape = (n_rows,) if len(t_shape) > 2 else ()
    return (_per_row_losses(losses, X, reduction, rows_shape), is_target.reshape(t_shape)), \
        (0, 0)


@register_batch_rule(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward_rule(info, in_dims, grad, x, target, reduction, is_target):
    B = info.batch_size
    X, rows, n_rows = _margin_rows(info, x, in_dims[1])
    T = ensure_bdim_front(target, in_dims[2], B).reshape(rows.shape)
    is_t = ensure_bdim_front(is_target, in_dims[4], B).reshape(rows.shape)
    G = _row_grads(info, grad, in_dims[0], X, n_rows, reduction)
    out = aten.multilabel_margin_loss_backward.default(G, rows, T, _NONE, is_t)
    return out.reshape(X.shape), 0


# ---------------------------------------------------------------------------------------------
# The chunked path of F.linear_cross_entropy (torch >= 2.13: custom ops in the torch_nn
# namespace, defined when torch.nn.modules.linear_cross_entropy is imported).  Each row's loss
# (and, for a reduced loss, each row's input gradient) depends on its own row only, so with
# the linear weight, bias and class weight unbatched the batch folds into the rows: one call
# on [B*N, D] rows.  A batched linear weight / bias / class weight, or a requested gradient of
# the linear weight or bias (the op sums it over all rows, mixing examples), is declined: the
# loop runs the op per example, which keeps the chunked path's point (the [N, C] logits are
# never materialised), where a vectorised form would build [B, N, C] logits.

def _torch_nn_op(name):
    """``torch.ops.torch_nn.<name>.default``, or None where this torch has no such op."""
    try:
        import torch.nn.modules.linear_cross_entropy  # noqa: F401  (defines the torch_nn ops)
        return getattr(torch.ops.torch_nn, name).default
    except (ImportError, AttributeError):
        return None


def _lce_rows(info, in_dims, x, target):
    """Input rows [B*N, D] and targets [B*N] of a [N, D] input per example, and B, N."""
    B = info.batch_size
    X = ensure_bdim_front(x, in_dims[0], B)
    T = ensure_bdim_front(target, in_dims[2], B)
    if X.dim() != 3 or T.dim() != 2:
        raise Decline()
    return X.reshape(-1, X.shape[-1]), T.reshape(-1), B, X.shape[1]


_LCE_NONE = _torch_nn_op("_linear_cross_entropy_batch_chunked_no_reduction")
_LCE = _torch_nn_op("_linear_cross_entropy_batch_chunked")


def _lce_no_reduction_rule(info, in_dims, x, linear_weight, target, linear_bias, weight,
                           ignore_index, batch_chunk_size, acc_policy, acc_dtype):
    if any(d is not None for d in (in_dims[1], in_dims[3], in_dims[4])):
        raise Decline()
    rows, T, B, N = _lce_rows(info, in_dims, x, target)
    losses = _LCE_NONE(rows, linear_weight, T, linear_bias, weight, ignore_index,
                       batch_chunk_size, acc_policy, acc_dtype)
    return losses.reshape(B, N), 0


def _lce_reduced_rule(info, in_dims, x, linear_weight, target, linear_bias, weight, reduction,
                      ignore_index, label_smoothing, batch_chunk_size, acc_policy, acc_dtype,
                      allow_retain_graph, compute_input_grad, compute_linear_weight_grad,
                      compute_linear_bias_grad):
    if any(d is not None for d in (in_dims[1], in_dims[3], in_dims[4])) or \
            compute_linear_weight_grad or compute_linear_bias_grad or label_smoothing != 0 or \
            reduction not in ("sum", "mean"):
        raise Decline()
    rows, T, B, N = _lce_rows(info, in_dims, x, target)
    # The physical operands are detached: this call only computes values (autograd above the
    # dispatcher owns the derivative), and the op refuses a requires_grad input whose
    # gradient it was not asked to compute.
    rows, lw = rows.detach(), linear_weight.detach()
    lb = None if linear_bias is None else linear_bias.detach()
    losses = _LCE_NONE(rows, lw, T, lb, weight, ignore_index, batch_chunk_size, acc_policy,
                       acc_dtype).reshape(B, N)
    loss = losses.sum(1)
    if reduction == "mean":   # each example's own total weight of its non-ignored targets
        ignored = T == ignore_index
        w = torch.ones(T.shape, dtype=losses.dtype, device=T.device) if weight is None else \
            weight.index_select(0, T.masked_fill(ignored, 0)).to(losses.dtype)
        total = w.masked_fill(ignored, 0).reshape(B, N).sum(1)
        loss = loss / total
    loss = loss.to(x.dtype)
    empty = lambda *shape: torch.empty(shape, dtype=x.dtype, device=x.device)  # noqa: E731
    if compute_input_grad:
        grads = _LCE(rows, lw, T, lb, weight, "sum", ignore_index, 0.0, batch_chunk_size,
                     acc_policy, acc_dtype, True, True, False, False)[1].reshape(B, N, -1)
        if reduction == "mean":
            grads = grads / total.reshape(B, 1, 1).to(grads.dtype)
        gi = grads
    else:
        gi = empty(B, 0, 0)
    gw = empty(0, 0)
    gb = empty(0)
    return (loss, gi, gw, gb), (0, 0, None, None)


if _LCE_NONE is not None:
    register_batch_rule(_LCE_NONE, _lce_no_reduction_rule)
if _LCE is not None:
    register_batch_rule(_LCE, _lce_reduced_rule)
