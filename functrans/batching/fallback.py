"""The per-example loop fallback: correct for any op, slow, and loud about it.

For an op with no rule and no usable decomposition, slice every batched argument at each batch
index, call the op on the slices, and stack the results.  In-place and ``out=`` ops write into
slices (views) of their batched target, so the target is updated in place.  Non-tensor outputs
must agree across the batch, and so must the shapes of tensor outputs (ops whose output shape
depends on the data, ``nonzero``/``unique``..., run here and stack when every example agrees; when
they differ, ``ragged_results_error`` says so and how to get a fixed shape).  The fallback warns
once per op with a ``PerformanceWarning`` that names the rules file where a rule belongs (or why
the op has none on purpose, ``known_fallbacks``, and why its decomposition could not run), and
``functrans.config.strict_fallback()`` turns it into an error.  ``record_fallbacks()``
observers see every call with its time.

Imports: config, errors, batched_tensor, decompositions, known_fallbacks, op_schema, randomness,
registry.
"""
from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any, Callable, List, Set

import torch

from .. import config
from ..errors import PerformanceWarning, UnsupportedUnderVmap
from . import decompositions
from .batched_tensor import BatchedTensor, at_level
from .known_fallbacks import reason
from .op_schema import written_arguments
from .randomness import draws_random
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


# How to get a fixed shape, per op (the overload packet's name).
_FIXES = {
    "nonzero": "torch.nonzero_static(x, size=n, fill_value=-1) pads every example to n rows "
               "and batches without a loop",
    "argwhere": "torch.nonzero_static(x, size=n, fill_value=-1) pads every example to n rows",
    "masked_select": "torch.where(mask, x, 0) (or x * mask) keeps the shape fixed",
    "index": "torch.where(mask, x, 0) instead of x[mask] keeps the shape fixed (the gradient of "
             "x[mask] = v with respect to v reads v[mask] too: write with torch.where(mask, v, "
             "x), v broadcast to x's shape, instead)",
    "bincount": "pass minlength= larger than every value (all examples then have that length), "
                "or count with torch.zeros(n).index_add_(0, x, weights)",
    "repeat_interleave": "make the repeats sum to the same total in every example (pad with a "
                         "dummy element repeated the difference)",
    "linalg_lstsq": "the residuals are empty for a rank-deficient example: pass "
                    "driver='gelsy' (no residuals) or compute them as ((A @ X - B) ** 2).sum(-2)",
}
_UNIQUE_FIX = ("unique has no fixed-size form: sort instead (torch.sort, then a mask of first "
               "occurrences, x[1:] != x[:-1]) and keep the mask")


def ragged_results_error(op, shapes, output: int = 0) -> UnsupportedUnderVmap:
    """The error for per-example results of different shapes (the loop fallback's)."""
    name = op.overloadpacket.__name__
    fix = _FIXES.get(name) or (_UNIQUE_FIX if "unique" in name else
                               "pad the results to one size (and carry a mask)")
    shown = ", ".join(f"example {i}: {list(s)}" for i, s in enumerate(shapes[:4]))
    if len(shapes) > 4:
        shown += ", ..."
    return UnsupportedUnderVmap(
        f"vmap: {op} returns a tensor whose shape depends on the values of its input, and the "
        f"examples of this batch gave different shapes (output {output}: {shown}), so they "
        "cannot be stacked into one batched tensor. Use a fixed-shape formulation: "
        f"{fix}; in general torch.where(mask, x, 0) instead of x[mask], or pad to a known "
        "size and carry a mask. To keep ragged results, call the function per example outside "
        "vmap and collect them with torch.nested.nested_tensor([...]).")


def _fallback_error(op, declined: bool = False) -> UnsupportedUnderVmap:
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
# mkldnn_rnn_layer and fractional_max_pool*_backward), or whose values follow the memory order
# (resize keeps the storage and restrides it contiguously: on a transposed example it reads
# the elements in memory order): a slice of a batch is rarely contiguous, so they get
# contiguous copies, and give each example's answer as if it were contiguous (See Note
# [layout-dependent kernels] in helpers.py).
STRIDE_BLIND = {"mkldnn_rnn_layer", "mkldnn_rnn_layer_backward", "fractional_max_pool2d_backward",
                "fractional_max_pool3d_backward", "resize"}


def loop_fallback(op, level, in_dims, *vals, _declined: bool = False, _undecomposed: str = "",
                  **kwargs):
    """Run ``op`` per example; called like a rule (``rule(level, in_dims, *vals, **kwargs)``).
    ``_declined``: the op's rule declined these arguments; ``_undecomposed``: why its
    decomposition could not run (when it has just failed; later calls read it from
    ``decompositions.failure``)."""
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
    if level.randomness == "same" and draws_random(op, vals, kwargs):
        raise UnsupportedUnderVmap(
            f"vmap: {op} has no batching rule, and running it per example would give each "
            "example different random values, but randomness='same' was asked for. Use "
            "randomness='different', or draw the random values outside vmap and pass them in.")
    if config.warns_on_fallback() and op not in _warned:
        _warned.add(op)
        why = reason(op)
        where = f"no batching rule on purpose: {why}" if why else \
            f"a rule for it belongs in {rules_file(op)}"
        failed = _undecomposed or decompositions.failure(op)
        if failed:
            where += f"; its torch._decomp decomposition cannot run under vmap ({failed})"
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
    kw_pairs = [at_level(v, level) for _, v in kw_items]
    kw_vals, kw_dims = [v for v, _ in kw_pairs], [d for _, d in kw_pairs]
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
    positions, names = written_arguments(op)
    written = [(vals[i], in_dims[i]) for i in positions if i < len(vals)]
    written += [(v, d) for (name, _), v, d in zip(kw_items, kw_vals, kw_dims) if name in names]
    if not written:
        return None
    returns = op._schema.returns
    if not returns:
        return None, None
    if len(returns) == 1:
        return written[0]
    return tuple(w[0] for w in written), tuple(w[1] for w in written)
