"""Reductions, scans and softmax.

Ops owned (every overload below that is not CompositeImplicitAutograd):

* reductions over a list of dims: ``sum.dim_IntList``, ``mean.dim``, ``amax``, ``amin``,
  ``var``/``std``/``var_mean``/``std_mean`` ``.correction``, ``norm.ScalarOpt_dim[_dtype]``,
  ``linalg_vector_norm``, ``logsumexp``, ``nansum``, ``any.dims``, ``all.dims``,
  ``count_nonzero.dim_IntList``;
* reductions over one dim (``None`` = all): ``prod.dim_int``, ``max.dim``, ``min.dim``,
  ``any.dim``, ``all.dim``, ``argmax``, ``argmin``, ``aminmax``, ``count_nonzero.default``,
  ``median.dim``, ``nanmedian.dim``, ``mode``, ``kthvalue``;
* full reductions: ``sum``, ``mean``, ``prod``, ``max``, ``min``, ``any``, ``all``,
  ``median``, ``nanmedian`` ``.default`` and ``norm.Scalar`` / ``norm.ScalarOpt_dtype`` (run
  as their dim sibling over every logical dim);
* scans (the output keeps the input's shape): ``cumsum``, ``cumprod`` (and in place),
  ``cummax``, ``cummin``, ``logcumsumexp``, ``_logcumsumexp``, ``_softmax``, ``_log_softmax``;
* ``_softmax_backward_data``, ``_log_softmax_backward_data``;
* ``_is_any_true``, ``_is_all_true``: reduced over the batch too (an UNBATCHED result), as in
  the reference library, so that ``.item()`` on them works under vmap: autograd's anomaly mode
  checks every gradient with ``isnan(grad)._is_any_true().item()``, and a NaN in any example
  must be reported.

Invariants:
* logical dims are translated to physical ones with ``physical_dim``; the batch dim stays where
  it is, and the output bdim is the input bdim minus the reduced dims before it (keepdim=False);
* ``dim=None`` (and ``dim=[]`` where the op reads it as "all", i.e. everywhere but ``any.dims``
  and ``all.dims``) means every LOGICAL dim, never the batch dim;
* a logically 0-d example accepts dim 0 / -1 and reduces nothing: it gets a trailing size-1
  dim to reduce (so dtype promotion, ``correction`` and friends behave as in eager);
* reductions over one dim with ``dim=None`` (``argmax``, ``aminmax``, ``prod``, ``median``)
  flatten each example in logical order, so the indices they return are LOGICAL indices; with
  a dim, the physical index along the reduced dim is the logical one;
* in-place scans write into the physical ``self`` and keep its bdim.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from ..helpers import (ensure_bdim_front, move_bdim_to_front, normalize_dim, physical_dim,
                       without_internal_overlap)
from ..registry import Decline, registrar

aten = torch.ops.aten
register_batch_rule = registrar("reductions")   # the rules below live in this file

# Reductions that eager refuses over an empty dim (no identity: "Expected reduction dim to be
# specified for input.numel() == 0", "cannot compute aminmax over an empty dimension", ...).
# The physical call over a batch of empty examples checks other dims and raises a different
# error (an IndexError where eager raises a RuntimeError, or none at all), so an empty example
# goes to the loop, which gives eager's answer: its error or its (empty) result.
_REFUSES_EMPTY = frozenset({aten.amax.default, aten.amin.default, aten.aminmax.default,
                            aten.max.dim, aten.min.dim, aten.argmax.default,
                            aten.argmin.default, aten.median.dim, aten.nanmedian.dim,
                            aten.mode.default, aten.kthvalue.default})


def _empty_example(op, x: torch.Tensor, bdim: int, args, kwargs) -> bool:
    """Whether one example is empty AND eager refuses this call on it (asked of a meta example:
    reducing an empty example over a non-empty dim is legal and stays batched)."""
    if x.numel() != 0 or x.shape[bdim] == 0:
        return False
    shape = list(x.shape)
    del shape[bdim]
    try:
        op(torch.empty(shape, dtype=x.dtype, device="meta"), *args, **kwargs)
    except Exception:
        return True
    return False


_signatures: Dict[Any, Tuple[List[str], Dict[str, Any], bool]] = {}


def _signature(op):
    """(positional names after ``self``, defaults, whether the op takes ``keepdim``)."""
    sig = _signatures.get(op)
    if sig is None:
        rest = op._schema.arguments[1:]
        sig = _signatures[op] = ([a.name for a in rest if not a.kwarg_only],
                                 {a.name: a.default_value for a in rest
                                  if a.has_default_value()},
                                 any(a.name == "keepdim" for a in rest))
    return sig


def _params(op, args, kwargs) -> Dict[str, Any]:
    """The op's arguments after ``self`` by name, defaults filled in."""
    names, defaults, _ = _signature(op)
    params = dict(defaults)
    params.update(zip(names, args))
    params.update(kwargs)
    return params


def _call(op, x, params, dim, keepdim):
    """``op(x, **params)`` with ``dim`` (and ``keepdim``, where the op takes it) replaced."""
    params = dict(params, dim=dim)
    if _signature(op)[2]:
        params["keepdim"] = keepdim
    return op(x, **params)


def _dims_like(out, bdim):
    return tuple(bdim for _ in out) if isinstance(out, (tuple, list)) else bdim


def _plan(x: torch.Tensor, bdim: int, dims: List[int], keepdim: bool):
    """(physical x, physical dims, keepdim, out bdim) to reduce the logical ``dims`` of x."""
    rank = x.dim() - 1
    if rank == 0:
        # A 0-d example accepts dim 0 / -1 and reduces nothing: give it a size-1 dim to reduce.
        for d in dims:
            normalize_dim(d, 0)
        return x.unsqueeze(-1), [1] * len(dims), False, 0
    phys = [physical_dim(d, bdim, rank) for d in dims]
    if keepdim:
        return x, phys, True, bdim
    return x, phys, False, bdim - sum(p < bdim for p in set(phys))


def _flatten_examples(x: torch.Tensor, bdim: int) -> torch.Tensor:
    """(B, numel) with each example flattened in logical (row-major) order."""
    x = move_bdim_to_front(x, bdim)
    return x.unsqueeze(-1) if x.dim() == 1 else x.flatten(1)


# ---- reductions over a list of dims ------------------------------------------------------

def _reduce_dims(op, x, bdim, params, empty_means_all: bool):
    dim = params.get("dim")
    if isinstance(dim, int):
        dim = [dim]
    if dim is not None and len(dim) == 0 and not empty_means_all:
        return op(x, **params), bdim  # any.dims / all.dims: dim=[] reduces nothing
    if dim is None or len(dim) == 0:
        dim = list(range(max(x.dim() - 1, 1)))
    keepdim = params.get("keepdim", False)
    x, phys, keepdim, out_bdim = _plan(x, bdim, dim, keepdim)
    out = _call(op, x, params, phys, keepdim)
    return out, _dims_like(out, out_bdim)


def _dims_rule(op, empty_means_all: bool = True):
    names = _signature(op)[0]
    # Ops called as op(x, dim, keepdim, ...) (sum, mean, amax, logsumexp...) take a fast path
    # for the common call: a non-empty dim list, positional arguments, examples of rank >= 1.
    positional = names[:2] == ["dim", "keepdim"]
    call = getattr(op, "_op", op)
    refuses_empty = op in _REFUSES_EMPTY

    def rule(info, in_dims, x, *args, **kwargs):
        if refuses_empty and _empty_example(op, x, in_dims[0], args, kwargs):
            raise Decline()
        if positional and args and not kwargs and x.dim() > 1:
            dim = args[0]
            if isinstance(dim, int):
                dim = (dim,)
            if dim:
                x, phys, _, out_bdim = _plan(x, in_dims[0], dim, len(args) > 1 and args[1])
                out = call(x, phys, *args[1:])
                return out, _dims_like(out, out_bdim)
        return _reduce_dims(op, x, in_dims[0], _params(op, args, kwargs), empty_means_all)
    rule.__name__ = f"reduce_dims_rule[{op}]"
    return rule


for _op in (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
            aten.var.correction, aten.std.correction, aten.var_mean.correction,
            aten.std_mean.correction, aten.norm.ScalarOpt_dim, aten.norm.ScalarOpt_dim_dtype,
            aten.linalg_vector_norm.default, aten.logsumexp.default, aten.nansum.default,
            aten.count_nonzero.dim_IntList):
    register_batch_rule(_op, _dims_rule(_op))
for _op in (aten.any.dims, aten.all.dims):
    register_batch_rule(_op, _dims_rule(_op, empty_means_all=False))


def _full_rule(op, sibling):
    """``op`` reduces everything: run ``sibling`` (a dim-list reduction taking ``op``'s
    arguments by the same names) over every logical dim."""
    def rule(info, in_dims, x, *args, **kwargs):
        params = _params(op, args, kwargs)
        params["dim"] = None
        return _reduce_dims(sibling, x, in_dims[0], params, True)
    rule.__name__ = f"full_reduction_rule[{op}]"
    return rule


for _op, _sibling in ((aten.sum.default, aten.sum.dim_IntList),
                      (aten.mean.default, aten.mean.dim),
                      (aten.max.default, aten.amax.default),
                      (aten.min.default, aten.amin.default),
                      (aten.any.default, aten.any.dims),
                      (aten.all.default, aten.all.dims),
                      (aten.norm.Scalar, aten.norm.ScalarOpt_dim),
                      (aten.norm.ScalarOpt_dtype, aten.norm.ScalarOpt_dim_dtype)):
    register_batch_rule(_op, _full_rule(_op, _sibling))


# ---- reductions over one dim -------------------------------------------------------------

# median.dim / nanmedian.dim return uninitialised memory over a stride-0 (expanded) dim (See
# Note [layout-dependent kernels]): they get a contiguous copy of such an input.
_OVERLAP_SENSITIVE = frozenset({aten.median.dim, aten.nanmedian.dim})


def _reduce_one(op, x, bdim, params):
    if op in _OVERLAP_SENSITIVE:
        x = without_internal_overlap(x)
    dim = params.get("dim")
    keepdim = params.get("keepdim", False)
    if dim is None:
        # Every logical dim: flatten each example, reduce its one dim, restore keepdim's shape.
        rank = x.dim() - 1
        out = _call(op, _flatten_examples(x, bdim), params, 1, False)
        if keepdim:
            shape = (x.shape[bdim],) + (1,) * rank
            out = tuple(o.reshape(shape) for o in out) if isinstance(out, tuple) \
                else out.reshape(shape)
        return out, _dims_like(out, 0)
    x, phys, keepdim, out_bdim = _plan(x, bdim, [dim], keepdim)
    out = _call(op, x, params, phys[0], keepdim)
    return out, _dims_like(out, out_bdim)


def _one_dim_rule(op):
    refuses_empty = op in _REFUSES_EMPTY

    def rule(info, in_dims, x, *args, **kwargs):
        if refuses_empty and _empty_example(op, x, in_dims[0], args, kwargs):
            raise Decline()
        return _reduce_one(op, x, in_dims[0], _params(op, args, kwargs))
    rule.__name__ = f"reduce_one_dim_rule[{op}]"
    return rule


for _op in (aten.prod.dim_int, aten.max.dim, aten.min.dim, aten.any.dim, aten.all.dim,
            aten.argmax.default, aten.argmin.default, aten.aminmax.default, aten.median.dim,
            aten.nanmedian.dim, aten.mode.default, aten.kthvalue.default):
    register_batch_rule(_op, _one_dim_rule(_op))


@register_batch_rule(aten.prod.default)
def prod_rule(info, in_dims, x, *, dtype=None):
    return _reduce_one(aten.prod.dim_int, x, in_dims[0], {"dim": None, "dtype": dtype})


def _median_rule(sibling):
    """``median`` / ``nanmedian`` of every element: the values of ``sibling`` over each
    flattened example."""
    def rule(info, in_dims, x):
        (values, _), (bdim, _) = _reduce_one(sibling, x, in_dims[0], {"dim": None})
        return values, bdim
    rule.__name__ = f"full_median_rule[{sibling}]"
    return rule


register_batch_rule(aten.median.default, _median_rule(aten.median.dim))
register_batch_rule(aten.nanmedian.default, _median_rule(aten.nanmedian.dim))


def _over_the_batch_rule(op):
    def rule(info, in_dims, x):
        """Whether any (all) element of ANY (EVERY) example is true: the op on the whole
        physical tensor, one unbatched 0-d bool (see the module docstring)."""
        return op(x), None
    rule.__name__ = f"over_the_batch_rule[{op}]"
    return rule


register_batch_rule(aten._is_any_true.default, _over_the_batch_rule(aten._is_any_true.default))
register_batch_rule(aten._is_all_true.default, _over_the_batch_rule(aten._is_all_true.default))


@register_batch_rule(aten.count_nonzero.default)
def count_nonzero_rule(info, in_dims, x, dim=None):
    if dim is None:
        return _reduce_dims(aten.count_nonzero.dim_IntList, x, in_dims[0], {"dim": None}, True)
    return _reduce_one(aten.count_nonzero.default, x, in_dims[0], {"dim": dim})


# ---- scans and softmax: the output has the input's shape ---------------------------------

def _scan_rule(op, inplace: bool = False):
    def rule(info, in_dims, x, dim, *args, **kwargs):
        bdim = in_dims[0]
        rank = x.dim() - 1
        if rank == 0:
            # A 0-d example: scan over a trailing size-1 dim, then drop it.
            normalize_dim(dim, 0)
            out = op(x.unsqueeze(-1), 1, *args, **kwargs)
            if inplace:
                return x, bdim
            out = tuple(o.squeeze(-1) for o in out) if isinstance(out, tuple) \
                else out.squeeze(-1)
            return out, _dims_like(out, 0)
        out = op(x, physical_dim(dim, bdim, rank), *args, **kwargs)
        if inplace:
            return x, bdim
        return out, _dims_like(out, bdim)
    rule.__name__ = f"scan_rule[{op}]"
    return rule


for _op in (aten.cumsum.default, aten.cumprod.default, aten.cummax.default,
            aten.cummin.default, aten.logcumsumexp.default, aten._logcumsumexp.default,
            aten._softmax.default, aten._log_softmax.default):
    register_batch_rule(_op, _scan_rule(_op))
for _op in (aten.cumsum_.default, aten.cumprod_.default):
    register_batch_rule(_op, _scan_rule(_op, inplace=True))


def _softmax_backward_rule(op):
    def rule(info, in_dims, grad_output, output, dim, input_dtype):
        g_bdim, o_bdim = in_dims[:2]
        if g_bdim is not None and g_bdim == o_bdim and grad_output.dim() == output.dim():
            bdim = g_bdim
        else:
            grad_output = ensure_bdim_front(grad_output, g_bdim, info.batch_size)
            output = ensure_bdim_front(output, o_bdim, info.batch_size)
            bdim = 0
        rank = output.dim() - 1
        if rank == 0:
            normalize_dim(dim, 0)
            out = op(grad_output.unsqueeze(-1), output.unsqueeze(-1), 1, input_dtype)
            return out.squeeze(-1), 0
        return op(grad_output, output, physical_dim(dim, bdim, rank), input_dtype), bdim
    rule.__name__ = f"softmax_backward_rule[{op}]"
    return rule


for _op in (aten._softmax_backward_data.default, aten._log_softmax_backward_data.default):
    register_batch_rule(_op, _softmax_backward_rule(_op))


# hash_tensor (mode 0: an xor of the elements' bits, so the order of reduction is immaterial)
register_batch_rule(aten.hash_tensor.default, _dims_rule(aten.hash_tensor.default))
