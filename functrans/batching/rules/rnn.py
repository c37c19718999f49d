"""Recurrent layers: the fused RNN kernels that reach the dispatcher.

``aten.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` and the ``*_cell`` ops are
CompositeImplicitAutograd: they decompose before dispatch into ordinary ops (``addmm``,
``unsafe_split``, ``sigmoid_``...), except where a fused kernel is picked:

* ``mkldnn_rnn_layer`` (+ ``mkldnn_rnn_layer_backward``): one direction of one LSTM layer on CPU
  (float32 / bfloat16, no ``proj_size``).  The input is always time-major ``[T, N, F]`` (the
  ``batch_first`` flag is informational; the caller has transposed already), ``hx``/``cx`` are
  ``[N, H]``.
* ``_thnn_fused_lstm_cell`` / ``_thnn_fused_gru_cell`` (+ ``_thnn_fused_lstm_cell_backward_impl``,
  ``_thnn_fused_gru_cell_backward``): the CUDA cell kernels, row-wise over ``N`` (workspace
  included), so inputs, states and workspace fold; batched biases are declined.

The mkldnn kernel reads its input / hx / cx as if contiguous (it ignores strides), so the folded
physical values are made contiguous.

Invariants.  The vmap batch is folded into the RNN batch ``N`` (examples never interact along
``N``), so one kernel call serves the whole batch.  Weight gradients are never taken from a
folded kernel (it sums them over every row of every example): they are rebuilt per example from
the gate gradients.  ``mkldnn_rnn_layer``'s workspace is opaque and its size is not linear in
``N``, so the backward rule never trusts it: it recomputes the forward on the folded inputs.
Batched weights (an ensemble) cannot be folded: both rules then run the layer as a batched
decomposition (``bmm`` over the examples' weights, a Python loop over time steps only) and
the backward does its own back-propagation through time.  Forward and backward decline under
the same conditions (packed sequences, modes other than LSTM), so a workspace made by a rule is
only ever read by a rule.

``_cudnn_rnn`` has no rule: under vmap the ``torch._VF`` entry points run on CUDA with cuDNN
disabled, so the native path (the cell kernels above) runs instead; a direct call is left to
the loop fallback (untestable here).  An unbatched initial hidden state
is batched before the entry point decomposes: see Note [RNN initial state].
"""
from __future__ import annotations

import torch

from ..helpers import ensure_bdim_front
from ..registry import Decline, registrar

aten = torch.ops.aten
register_batch_rule = registrar("rnn")   # the rules below live in this file
_LSTM_MODE = 2


# --------------------------------------------------------------------------- folding helpers

def _fold_time_major(x, bdim, size):
    """Logical ``[T, N, ...]`` -> physical ``[T, B*N, ...]`` (example-major inside dim 1)."""
    X = ensure_bdim_front(x, bdim, size).movedim(0, 1)
    return X.reshape(X.shape[0], size * X.shape[2], *X.shape[3:]).contiguous()


def _unfold_time_major(y, size):
    """Physical ``[T, B*N, ...]`` -> ``[T, B, N, ...]`` (batch dim 1)."""
    return y.view(y.shape[0], size, y.shape[1] // size, *y.shape[2:])


def _fold_rows(x, bdim, size):
    """Logical ``[N, ...]`` -> physical ``[B*N, ...]``."""
    X = ensure_bdim_front(x, bdim, size)
    return X.reshape(size * X.shape[1], *X.shape[2:]).contiguous()


def _unfold_rows(y, size):
    """Physical ``[B*N, ...]`` -> ``[B, N, ...]`` (batch dim 0)."""
    return y.view(size, y.shape[0] // size, *y.shape[1:])


def _maybe_fold_rows(x, bdim, size):
    return None if x is None else _fold_rows(x, bdim, size)


# --------------------------------------------------------------------------- mkldnn_rnn_layer

def _check_layer(in_dims, x, batch_sizes, mode):
    """True when the weights are batched (an ensemble); declines what no rule here handles."""
    if len(batch_sizes) or mode != _LSTM_MODE or x.dim() - (in_dims[0] is not None) != 3:
        raise Decline()  # packed sequences / other modes
    return any(d is not None for d in in_dims[1:5])


def _ensemble_weights(in_dims, size, w_ih, w_hh, b_ih, b_hh, has_biases):
    """Batch-first weights ``[B, 4H, F]``, ``[B, 4H, H]`` and the summed bias ``[B, 4H]``."""
    W_ih = ensure_bdim_front(w_ih, in_dims[1], size)
    W_hh = ensure_bdim_front(w_hh, in_dims[2], size)
    bias = None
    if has_biases:
        bias = ensure_bdim_front(b_ih, in_dims[3], size) + \
            ensure_bdim_front(b_hh, in_dims[4], size)
    return W_ih, W_hh, bias


def _zeros_per_example(t, bdim, size):
    return t.new_zeros(ensure_bdim_front(t, bdim, size).shape)


def _time_steps(T, reverse):
    return range(T - 1, -1, -1) if reverse else range(T)


def _ensemble_forward(X, W_ih, W_hh, bias, h, c, reverse):
    """An LSTM layer with one weight set per example, batched over examples.

    ``X`` is ``[T, B, N, F]``, ``h``/``c`` ``[B, N, H]``.  Returns the output ``[T, B, N, H]``,
    the final ``h``, ``c`` and, per time step, the gate activations and cell states that the
    backward needs.  The loop runs over time, never over examples."""
    gx = torch.einsum("tbnf,bgf->tbng", X, W_ih)
    if bias is not None:
        gx = gx + bias[:, None, :]
    W_hh_t = W_hh.transpose(1, 2)
    outs, saved = [None] * X.shape[0], [None] * X.shape[0]
    for t in _time_steps(X.shape[0], reverse):
        i, f, g, o = (gx[t] + torch.bmm(h, W_hh_t)).chunk(4, -1)
        i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
        c_prev, c = c, f * c + i * g
        h = o * c.tanh()
        outs[t], saved[t] = h, (i, f, g, o, c_prev, c)
    return torch.stack(outs), h, c, saved


def _ensemble_gate_grads(saved, W_hh, gO, dh, dc, reverse):
    """Back-propagation through time: the gate pre-activation gradients ``[T, B, N, 4H]`` and
    the gradients of the initial ``h``, ``c``."""
    d_gates = [None] * len(saved)
    for t in reversed(_time_steps(len(saved), reverse)):
        i, f, g, o, c_prev, c = saved[t]
        if gO is not None:
            dh = dh + gO[t]
        tc = c.tanh()
        dc = dc + dh * o * (1 - tc * tc)
        d = torch.cat([dc * g * i * (1 - i), dc * c_prev * f * (1 - f), dc * i * (1 - g * g),
                       dh * tc * o * (1 - o)], -1)
        d_gates[t] = d
        dh, dc = torch.bmm(d, W_hh), dc * f
    return torch.stack(d_gates), dh, dc


@register_batch_rule(aten.mkldnn_rnn_layer.default)
def mkldnn_rnn_layer_rule(info, in_dims, x, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse,
                          batch_sizes, mode, hidden_size, num_layers, has_biases,
                          bidirectional, batch_first, train):
    ensemble = _check_layer(in_dims, x, batch_sizes, mode)
    B = info.batch_size
    if ensemble:
        X = ensure_bdim_front(x, in_dims[0], B).movedim(0, 1)
        out, hy, cy, _ = _ensemble_forward(
            X, *_ensemble_weights(in_dims, B, w_ih, w_hh, b_ih, b_hh, has_biases),
            ensure_bdim_front(hx, in_dims[5], B), ensure_bdim_front(cx, in_dims[6], B), reverse)
        # No kernel workspace: the backward rule recomputes (a fallback would fail loudly).
        ws = torch.zeros(B, 0, dtype=torch.uint8, device=x.device)
        return (out, hy, cy, ws), (1, 0, 0, 0)
    out, hy, cy, ws = aten.mkldnn_rnn_layer(
        _fold_time_major(x, in_dims[0], B), w_ih, w_hh, b_ih, b_hh,
        _fold_rows(hx, in_dims[5], B), _fold_rows(cx, in_dims[6], B), reverse, batch_sizes,
        mode, hidden_size, num_layers, has_biases, bidirectional, batch_first, train)
    # The workspace (for B*N rows) is opaque; the backward rule recomputes its own.
    return ((_unfold_time_major(out, B), _unfold_rows(hy, B), _unfold_rows(cy, B),
             ws.expand(B, *ws.shape)), (1, 0, 0, 0))


def _previous_hidden(h0, out, reverse):
    """``[T, ...]``: the hidden state each time step consumed."""
    if reverse:
        return torch.cat([out[1:], h0.unsqueeze(0)])
    return torch.cat([h0.unsqueeze(0), out[:-1]])


def _folded_gate_grads(B, X, w_ih, w_hh, b_ih, b_hh, h0, c0, gO, ghy, gcy, reverse, mode,
                       hidden_size, num_layers, has_biases, train, bidirectional, batch_sizes,
                       batch_first):
    """Gate gradients of the fused kernel on folded ``[T, B*N, ...]`` inputs.

    The layer runs on the projected input with an identity input weight: its input gradient is
    then the gate gradient, from which every per-example weight gradient follows."""
    Xp = X @ w_ih.t()
    eye = torch.eye(Xp.shape[-1], dtype=Xp.dtype, device=Xp.device)
    with torch.enable_grad():  # the kernel only fills its workspace when grad mode is on
        out, hy, cy, ws = aten.mkldnn_rnn_layer(
            Xp, eye, w_hh, b_ih, b_hh, h0, c0, reverse, batch_sizes, mode, hidden_size,
            num_layers, has_biases, bidirectional, batch_first, True)
    grads = aten.mkldnn_rnn_layer_backward(
        Xp, eye, w_hh, b_ih, b_hh, h0, c0, out, hy, cy, gO, ghy, gcy, reverse, mode,
        hidden_size, num_layers, has_biases, train, bidirectional, batch_sizes, batch_first, ws)
    return (_unfold_time_major(grads[0], B), _unfold_time_major(out, B),
            _unfold_rows(grads[5], B), _unfold_rows(grads[6], B))


@register_batch_rule(aten.mkldnn_rnn_layer_backward.default)
def mkldnn_rnn_layer_backward_rule(info, in_dims, x, w_ih, w_hh, b_ih, b_hh, hx, cx, output,
                                   hy, cy, grad_output, grad_hy, grad_cy, reverse, mode,
                                   hidden_size, num_layers, has_biases, train, bidirectional,
                                   batch_sizes, batch_first, workspace):
    ensemble = _check_layer(in_dims, x, batch_sizes, mode)
    B = info.batch_size
    X = _unfold_time_major(_fold_time_major(x, in_dims[0], B), B)  # [T, B, N, F]
    h0, c0 = ensure_bdim_front(hx, in_dims[5], B), ensure_bdim_front(cx, in_dims[6], B)
    gO = None if grad_output is None else \
        _unfold_time_major(_fold_time_major(grad_output, in_dims[10], B), B)
    if ensemble:
        W_ih, W_hh, bias = _ensemble_weights(in_dims, B, w_ih, w_hh, b_ih, b_hh, has_biases)
        out, _, _, saved = _ensemble_forward(X, W_ih, W_hh, bias, h0, c0, reverse)
        dh = h0.new_zeros(h0.shape) if grad_hy is None else \
            ensure_bdim_front(grad_hy, in_dims[11], B)
        dc = c0.new_zeros(c0.shape) if grad_cy is None else \
            ensure_bdim_front(grad_cy, in_dims[12], B)
        d_gates, d_hx, d_cx = _ensemble_gate_grads(saved, W_hh, gO, dh, dc, reverse)
        d_x = torch.einsum("tbng,bgf->tbnf", d_gates, W_ih)
    else:
        fold = lambda t: None if t is None else t.reshape(t.shape[0], -1, *t.shape[3:])
        d_gates, out, d_hx, d_cx = _folded_gate_grads(
            B, fold(X), w_ih, w_hh, b_ih, b_hh, _fold_rows(hx, in_dims[5], B),
            _fold_rows(cx, in_dims[6], B), fold(gO),
            _maybe_fold_rows(grad_hy, in_dims[11], B), _maybe_fold_rows(grad_cy, in_dims[12], B),
            reverse, mode, hidden_size, num_layers, has_biases, train, bidirectional,
            batch_sizes, batch_first)
        d_x = d_gates @ w_ih
    h_prev = _previous_hidden(h0, out, reverse)                    # [T, B, N, H]
    d_w_ih = torch.einsum("tbng,tbnf->bgf", d_gates, X)
    d_w_hh = torch.einsum("tbng,tbnh->bgh", d_gates, h_prev)
    # Without biases the kernel reports zero bias gradients; they are materialized per example
    # (not unbatched) because nn.LSTM(bias=False) passes the weights again in the bias slots and
    # autograd accumulates those gradients in place into whichever arrives first.
    if has_biases:
        d_b_ih = d_gates.sum((0, 2))
        d_b_hh = d_b_ih.clone()
    else:  # zeros shaped like whatever sits in the bias slots
        d_b_ih = _zeros_per_example(b_ih, in_dims[3], B)
        d_b_hh = _zeros_per_example(b_hh, in_dims[4], B)
    return (d_x, d_w_ih, d_w_hh, d_b_ih, d_b_hh, d_hx, d_cx), (1, 0, 0, 0, 0, 0, 0)


# --------------------------------------------------------------------------- fused CUDA cells

def _check_cell(in_dims, bias_dims, *tensors):
    if any(d is not None for d in bias_dims):
        raise Decline()  # batched biases: the kernel takes one bias for every row
    for t, d in zip(tensors, in_dims):
        if t is not None and t.dim() - (d is not None) != 2:
            raise Decline()


def _per_example_bias_grad(grad_gates, size, has_bias, kernel_grad):
    """The bias gradient of each example: its gate gradients summed over its own rows."""
    if not has_bias:
        return kernel_grad, None
    return _unfold_rows(grad_gates, size).sum(1), 0


@register_batch_rule(aten._thnn_fused_lstm_cell.default)
def thnn_fused_lstm_cell_rule(info, in_dims, input_gates, hidden_gates, cx, input_bias=None,
                              hidden_bias=None):
    _check_cell(in_dims, in_dims[3:], input_gates, hidden_gates, cx)
    B = info.batch_size
    hy, cy, ws = aten._thnn_fused_lstm_cell(
        _fold_rows(input_gates, in_dims[0], B), _fold_rows(hidden_gates, in_dims[1], B),
        _fold_rows(cx, in_dims[2], B), input_bias, hidden_bias)
    return (_unfold_rows(hy, B), _unfold_rows(cy, B), _unfold_rows(ws, B)), (0, 0, 0)


@register_batch_rule(aten._thnn_fused_lstm_cell_backward_impl.default)
def thnn_fused_lstm_cell_backward_rule(info, in_dims, grad_hy, grad_cy, cx, cy, workspace,
                                       has_bias):
    _check_cell(in_dims, (), grad_hy, grad_cy, cx, cy, workspace)
    B = info.batch_size
    d_gates, d_cx, d_bias = aten._thnn_fused_lstm_cell_backward_impl(
        _maybe_fold_rows(grad_hy, in_dims[0], B), _maybe_fold_rows(grad_cy, in_dims[1], B),
        _fold_rows(cx, in_dims[2], B), _fold_rows(cy, in_dims[3], B),
        _fold_rows(workspace, in_dims[4], B), has_bias)
    d_bias, bias_dim = _per_example_bias_grad(d_gates, B, has_bias, d_bias)
    return (_unfold_rows(d_gates, B), _unfold_rows(d_cx, B), d_bias), (0, 0, bias_dim)


@register_batch_rule(aten._thnn_fused_gru_cell.default)
def thnn_fused_gru_cell_rule(info, in_dims, input_gates, hidden_gates, hx, input_bias=None,
                             hidden_bias=None):
    _check_cell(in_dims, in_dims[3:], input_gates, hidden_gates, hx)
    B = info.batch_size
    hy, ws = aten._thnn_fused_gru_cell(
        _fold_rows(input_gates, in_dims[0], B), _fold_rows(hidden_gates, in_dims[1], B),
        _fold_rows(hx, in_dims[2], B), input_bias, hidden_bias)
    return (_unfold_rows(hy, B), _unfold_rows(ws, B)), (0, 0)


@register_batch_rule(aten._thnn_fused_gru_cell_backward.default)
def thnn_fused_gru_cell_backward_rule(info, in_dims, grad_hy, workspace, has_bias):
    _check_cell(in_dims, (), grad_hy, workspace)
    B = info.batch_size
    d_ig, d_hg, d_hx, d_ib, d_hb = aten._thnn_fused_gru_cell_backward(
        _fold_rows(grad_hy, in_dims[0], B), _fold_rows(workspace, in_dims[1], B), has_bias)
    d_ib, ib_dim = _per_example_bias_grad(d_ig, B, has_bias, d_ib)
    d_hb, hb_dim = _per_example_bias_grad(d_hg, B, has_bias, d_hb)
    return ((_unfold_rows(d_ig, B), _unfold_rows(d_hg, B), _unfold_rows(d_hx, B), d_ib, d_hb),
            (0, 0, 0, ib_dim, hb_dim))


# --------------------------------------------------------------------------- initial hidden state
