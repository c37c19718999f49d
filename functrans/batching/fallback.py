"""The per-example loop fallback: correct for any op, slow, and loud about it.

For an op with no rule and no usable decomposition, slice every batched argument at each batch
index, call the op on the slices, and stack the results.  In-place and ``out=`` ops write into
slices (views) of their batched target, so the target is updated in place.  Non-tensor outputs
must agree across the batch, and so must the shapes of tensor outputs (ops whose output shape
depends on the data, ``nonzero``/``unique``..., run here and stack when every example agrees; when
they differ, ``rules.data_dependent.ragged_results_error`` says so).  The fallback warns once per op with a ``PerformanceWarning`` that
names the rules file where a rule belongs, and ``functrans.config.strict_fallback()`` turns it
into an error.  ``record_fallbacks()`` observers see every call with its time.
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Callable, List, Set

import torch

from .. import config
from ..errors import PerformanceWarning, UnsupportedUnderVmap
from .batched_tensor import BatchedTensor
from .registry import rules_file

_warned: Set[Any] = set()
observers: List[Callable[[Any, float], None]] = []


def _slice(a, d, i):
    if d is None:
        return a
    if isinstance(d, int):
        return a.select(d, i)
    return type(a)(_slice(x, dd, i) for x, dd in zip(a, d))


def _stack(outs: List[Any], op, output: int = 0):
    first = outs[0]
    if isinstance(first, torch.Tensor):
        if any(o.shape != first.shape for o in outs[1:]):
            # the op's output shape depends on the data (nonzero, unique...): say so
            from .rules.data_dependent import ragged_results_error
            raise ragged_results_error(op, [o.shape for o in outs], output)
        return torch.stack(outs), 0
    if isinstance(first, (tuple, list)):
        parts = [_stack([o[k] for o in outs], op, k) for k in range(len(first))]
        return type(first)(p[0] for p in parts), type(first)(p[1] for p in parts)
    if first is None or all(o == first for o in outs[1:]):
        return first, None
    raise UnsupportedUnderVmap(
        f"vmap: {op} returned a Python value ({type(first).__name__}) that differs between "
        "examples of the batch, so it cannot be returned as one value. Avoid data-dependent "
        "Python values inside vmap; keep the computation in tensors (e.g. torch.where).")


def _fallback_error(op, declined: bool = False) -> UnsupportedUnderVmap:
    from .known_fallbacks import reason
    what = f"the batching rule for {op} declined these arguments" if declined else \
        f"there is no batching rule for {op}"
    why = reason(op)
    where = f"It has no batching rule on purpose: {why}." if why else \
        f"A rule for it belongs in {rules_file(op)}."
    return UnsupportedUnderVmap(
        f"vmap: {what}, and the loop fallback is disabled "
        f"(functrans.config.strict_fallback). {where}")


def _user_stacklevel() -> int:
    """The stacklevel of the first frame outside functrans and torch (the user's line)."""
    import os
    import sys
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None:
        fn = os.path.abspath(frame.f_code.co_filename)
        if not fn.startswith(pkg) and not fn.startswith(torch_dir):
            return level
        frame, level = frame.f_back, level + 1
    return 2


# Ops whose meaning depends on the storage layout (absolute offsets and strides): run per
# example on slices of the batch they would read the wrong example's memory.
STORAGE_DEPENDENT = {"as_strided", "as_strided_", "as_strided_copy", "as_strided_scatter",
                     "set_", "_reshape_alias", "_reshape_alias_copy"}


# Kernels that read some tensor arguments as if contiguous, ignoring their strides (found for
# mkldnn_rnn_layer and fractional_max_pool*_backward): a slice of a batch is rarely
# contiguous, so they get contiguous copies.
STRIDE_BLIND = {"mkldnn_rnn_layer", "mkldnn_rnn_layer_backward", "fractional_max_pool2d_backward",
                "fractional_max_pool3d_backward"}


def loop_fallback(op, level, in_dims, *vals, _declined: bool = False, **kwargs):
    """Run ``op`` per example; called like a rule (``rule(level, in_dims, *vals, **kwargs)``)."""
    if op.overloadpacket.__name__ in STORAGE_DEPENDENT:
        raise UnsupportedUnderVmap(
            f"vmap: {op} addresses memory by absolute storage offsets and strides, which has a "
            "per-example meaning only when each example stands for a fresh tensor: it owns an "
            "equal block of its storage (a fresh tensor with the batch dim first), or the "
            "batch's memory holds nothing but its examples, each laid out as a fresh tensor. "
            "Here the tensor shares its storage with elements outside the batch (a slice or an "
            "offset view of a larger tensor), or its batch dim is interleaved with the "
            "example's dims (in_dims other than 0), where strides taken from x.stride() and "
            "strides meant for a fresh example would address different elements. Express the "
            "view with view/reshape/select/slice/unfold/diagonal instead, or pass the tensor "
            "with in_dims=0 (x.movedim(d, 0).contiguous()) and call .clone() on it first.")
    if config.is_strict():
        raise _fallback_error(op, _declined)
    from .randomness import draws_random
    if level.randomness == "same" and draws_random(op, vals, kwargs):
        raise UnsupportedUnderVmap(
            f"vmap: {op} has no batching rule, and running it per example would give each "
            "example different random values, but randomness='same' was asked for. Use "
            "randomness='different', or draw the random values outside vmap and pass them in.")
    if config.warn_on_fallback and op not in _warned:
        _warned.add(op)
        from .known_fallbacks import reason
        why = reason(op)
        where = f"no batching rule on purpose: {why}" if why else \
            f"a rule for it belongs in {rules_file(op)}"
        what = f"the batching rule for {op} does not handle these arguments" if _declined \
            else f"no batching rule for {op}"
        warnings.warn(
            f"vmap: {what}; running a per-example loop over the batch, "
            f"which is correct but slow ({where}).", PerformanceWarning,
            stacklevel=_user_stacklevel())
    start = time.perf_counter() if observers else 0.0
    size = level.batch_size
    if size == 0:
        raise UnsupportedUnderVmap(
            f"vmap: {op} has no batching rule and the batch is empty (size 0), so the "
            "per-example fallback cannot infer the output shape.")
    kw_items = list(kwargs.items())
    kw_vals, kw_dims = [], []
    for _, v in kw_items:
        if type(v) is BatchedTensor and v.level is level:
            kw_vals.append(v.value)
            kw_dims.append(v.bdim)
        else:
            kw_vals.append(v)
            kw_dims.append(None)
    outs = []
    blind = op.overloadpacket.__name__ in STRIDE_BLIND
    for i in range(size):
        a_i = [_slice(a, d, i) for a, d in zip(vals, in_dims)]
        if blind:
            a_i = [a.contiguous() if isinstance(a, torch.Tensor) else a for a in a_i]
        k_i = {k: _slice(v, d, i) for (k, _), v, d in zip(kw_items, kw_vals, kw_dims)}
        outs.append(op(*a_i, **k_i))

    mutated = _mutated_targets(op, vals, in_dims, kw_items, kw_vals, kw_dims)
    if mutated is not None:
        result = mutated
    else:
        result = _stack(outs, op)
    for obs in observers:
        obs(op, time.perf_counter() - start)
    return result


def _mutated_targets(op, vals, in_dims, kw_items, kw_vals, kw_dims):
    """For in-place / out= ops: the written (physical value, bdim) pairs, else None."""
    schema = op._schema
    written = []
    pos_args = [a for a in schema.arguments if not a.kwarg_only]
    for i, a in enumerate(pos_args):
        if a.alias_info is not None and a.alias_info.is_write and i < len(vals):
            written.append((vals[i], in_dims[i]))
    for (name, _), v, d in zip(kw_items, kw_vals, kw_dims):
        a = next((x for x in schema.arguments if x.name == name), None)
        if a is not None and a.alias_info is not None and a.alias_info.is_write:
            written.append((v, d))
    if not written:
        return None
    if not schema.returns:
        return None, None
    if len(schema.returns) == 1 and len(written) >= 1:
        return written[0]
    return tuple(w[0] for w in written), tuple(w[1] for w in written)
