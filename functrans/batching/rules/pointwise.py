"""Pointwise ops: every op tagged ``torch.Tag.pointwise`` (unary, binary, ternary).

One rule factory covers the tag.  Invariants:
* all tensor arguments batched at the same bdim with the same rank: the op runs as is and the
  output keeps that bdim (no copy, no movedim);
* otherwise batched arguments get their bdim moved to the front and are padded with size-1 dims
  to the largest logical rank, so broadcasting against unbatched tensors and Python scalars
  lines up logically; the output bdim is 0;
* in-place variants write into the physical ``self`` (a view of it when the bdim moves), so the
  caller's tensor changes, and keep ``self``'s bdim;
* type promotion follows the LOGICAL shapes: a batched 0-d tensor is physically 1-d, which would
  otherwise promote like a dimensioned tensor (``float32[3] + float64 0-d`` is float32).
  See Note [0-d promotion].

Random ops (``bernoulli``...) carry the tag too but are owned by ``random.py``; ``out=``
variants are left to the fallback.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..helpers import move_bdim_to_front, pad_to_rank
from ..op_schema import writes_self, written_arguments
from ..registry import register_tag_rule, registrar

# Note [0-d promotion]
# ATen promotes in three categories: dimensioned tensors, 0-d tensors, wrapped Python scalars;
# a lower category only lifts the result's dtype if it is of a higher *kind* (bool < int <
# float < complex).  Under vmap a logically 0-d batched tensor is physically dimensioned.  When
# such an argument is mixed with logically dimensioned tensors and its dtype would win
# physically but not logically, it is cast to the logical common dtype first; the kernel would
# have computed in that dtype anyway.


def _kind(dt: torch.dtype) -> int:
    if dt == torch.bool:
        return 0
    if dt.is_complex:
        return 3
    if dt.is_floating_point:
        return 2
    return 1


def _promote(a: Optional[torch.dtype], b: Optional[torch.dtype]) -> Optional[torch.dtype]:
    if a is None:
        return b
    if b is None:
        return a
    return torch.promote_types(a, b)


def _combine(higher: Optional[torch.dtype], lower: Optional[torch.dtype]):
    if higher is None:
        return lower
    if lower is None:
        return higher
    if higher.is_complex:
        return higher
    if lower.is_complex:
        if higher.is_floating_point:
            return torch.promote_types(higher, torch.complex64) if higher != torch.float64 \
                else torch.complex128
        return lower
    if higher.is_floating_point:
        return higher
    if higher == torch.bool or lower.is_floating_point:
        return torch.promote_types(higher, lower)
    return higher


def _scalar_dtype(v) -> Optional[torch.dtype]:
    if isinstance(v, bool):
        return torch.bool
    if isinstance(v, int):
        return torch.int64
    if isinstance(v, float):
        return torch.get_default_dtype()
    if isinstance(v, complex):
        return torch.complex128 if torch.get_default_dtype() == torch.float64 \
            else torch.complex64
    return None


def logical_result_type(args, in_dims) -> Optional[torch.dtype]:
    """ATen's result type of ``args`` computed from their logical (per-example) ranks."""
    dim = zero = wrapped = None
    for a, d in zip(args, in_dims):
        if isinstance(a, torch.Tensor):
            if a.dim() - (d is not None) > 0:
                dim = _promote(dim, a.dtype)
            else:
                zero = _promote(zero, a.dtype)
        else:
            wrapped = _promote(wrapped, _scalar_dtype(a))
    return _combine(dim, _combine(zero, wrapped))


def _fix_zero_dim_promotion(args, in_dims, ranks):
    common = logical_result_type(args, in_dims)
    if common is None:
        return args
    devices = {a.device for a, r in zip(args, ranks)
               if isinstance(a, torch.Tensor) and r > 0}
    out = list(args)
    for i, (a, d, r) in enumerate(zip(args, in_dims, ranks)):
        if d is None or r != 0 or a.dtype == torch.bool:
            continue
        if a.dtype != common:  # above eager's result type (outranking) or below (outranked)
            out[i] = a.to(common)
        if len(devices) == 1 and a.device not in devices:
            out[i] = out[i].to(next(iter(devices)))
    return out


def _broadcast_shapes(shapes):
    """``torch.broadcast_shapes`` (about 10 us of Python in torch._refs), answered directly for
    shapes of plain ints; anything else (SymInts, an error to raise) goes to it."""
    out = [1] * max(len(s) for s in shapes)
    n = len(out)
    for s in shapes:
        for i, d in enumerate(s, n - len(s)):
            o = out[i]
            if type(d) is not int or type(o) is not int:
                return torch.broadcast_shapes(*shapes)
            if d != o:
                if o == 1:
                    out[i] = d
                elif d != 1:
                    return torch.broadcast_shapes(*shapes)
    return torch.Size(out)


def pointwise_rule_for(op: torch._ops.OpOverload):
    schema = op._schema
    if written_arguments(op)[1]:
        return None  # out= variants: the derived out rule wraps this op's functional rule
    if torch.Tag.nondeterministic_seeded in op.tags:
        return None  # random ops: rules/random.py
    inplace = writes_self(op)
    # Backward kernels (gelu_backward...) always see equal shapes in eager, and some CPU kernels
    # cannot broadcast: give their unbatched tensors the full batched shape (a stride-0 view).
    is_prim = op.namespace == "prims"
    same_shapes = op.overloadpacket.__name__.endswith("_backward") or is_prim
    call = getattr(op, "_op", op)  # the C++ callable, without OpOverload.__call__'s frame

    def rule(info, in_dims, *args, **kwargs):
        # Fast path: every batched tensor has the same rank and bdim, and every unbatched
        # tensor is 0-d (a wrapped Python scalar, as in ``x * 0.5``): the op broadcasts and
        # promotes physically exactly as it does logically, except when the examples are 0-d
        # themselves (then eager promotes two 0-d tensors as equals), which needs equal dtypes.
        bdim = None
        uniform = True
        ndim = None
        scalars = None
        for a, d in zip(args, in_dims):
            if isinstance(a, torch.Tensor):
                if d is None:
                    if a.dim() == 0 and not same_shapes:
                        scalars = a if scalars is None else scalars
                        continue
                    uniform = False
                    break
                if (bdim is not None and d != bdim) or (ndim is not None and a.dim() != ndim):
                    uniform = False
                    break
                bdim, ndim = d, a.dim()
        if uniform and scalars is not None:
            uniform = bdim is not None and (not inplace or in_dims[0] is not None) and (
                ndim > 1 or all(a.dtype == args[in_dims.index(bdim)].dtype
                                for a, d in zip(args, in_dims)
                                if d is None and isinstance(a, torch.Tensor)))
        if uniform:
            out = call(*args, **kwargs)
            return out, (bdim if not isinstance(out, (tuple, list))
                         else type(out)(bdim for _ in out))

        ranks = [a.dim() - (d is not None) if isinstance(a, torch.Tensor) else -1
                 for a, d in zip(args, in_dims)]
        top = max(ranks)
        if any(r == 0 and d is not None for r, d in zip(ranks, in_dims)):
            # A 0-d example is a dim-1 tensor physically, which would outrank the 0-d and
            # higher-rank operands it ranks with (or equals) in eager's type promotion.
            args = _fix_zero_dim_promotion(args, in_dims, ranks)
        new_args = []
        for a, d in zip(args, in_dims):
            if d is not None and isinstance(a, torch.Tensor):
                a = pad_to_rank(move_bdim_to_front(a, d), top)
            new_args.append(a)
        if same_shapes:
            # (prims want even 0-d tensors expanded, except CPU scalars beside other devices)
            device = next(a.device for a, d in zip(new_args, in_dims) if d is not None
                          and isinstance(a, torch.Tensor))
            grow = [isinstance(a, torch.Tensor) and (a.dim() > 0 or (
                is_prim and a.device == device)) for a in new_args]
            shape = _broadcast_shapes([a.shape for a, g in zip(new_args, grow) if g])
            new_args = [a.expand(shape) if g and a.shape != shape else a
                        for a, g in zip(new_args, grow)]
        out = op(*new_args, **kwargs)
        if inplace:
            return args[0], in_dims[0]
        if isinstance(out, (tuple, list)):
            return out, type(out)(0 for _ in out)
        return out, 0

    rule.__name__ = f"pointwise_rule[{op}]"
    return rule


register_tag_rule(torch.Tag.pointwise, pointwise_rule_for, family="pointwise")

# Elementwise ops that PyTorch does not tag pointwise: the same broadcasting rule serves them.

aten = torch.ops.aten
register_batch_rule = registrar("pointwise")   # the rules below live in this file

for _op in (aten.rsub.Tensor, aten.rsub.Scalar, aten.complex.default, aten.polar.default):
    register_batch_rule(_op, pointwise_rule_for(_op))

# Elementwise ops that torch 2.13 tags pointwise and torch 2.11 does not: the same rule, given
# by registration only where this torch lacks the tag (elsewhere the tag reaches them).
for _op in (aten.leaky_relu.default, aten.leaky_relu_.default, aten.elu_.default,
            aten.celu_.default, aten.hardsigmoid_.default,
            aten.hardtanh_.default, aten._conj_physical.default):
    if torch.Tag.pointwise not in _op.tags:
        register_batch_rule(_op, pointwise_rule_for(_op))

# Elementwise prims (the ``_make_elementwise_*_prim`` ones of torch._prims, plus where and
# convert_element_type) reach vmap when a Python reference implementation runs on
# BatchedTensors (e.g. the meta path of some forward-AD formulas).  Prims never broadcast, so
# their rule gives every tensor the full batched shape (``same_shapes`` above).
ELEMENTWISE_PRIMS = (
    "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "bessel_j0",
    "bessel_j1", "bessel_i0", "bessel_i0e", "bessel_i1", "bessel_i1e", "bitwise_not", "cbrt",
    "ceil", "digamma", "erf", "erf_inv", "erfc", "erfcx", "exp", "expm1", "exp2", "floor",
    "isfinite", "lgamma", "log", "log1p", "log2", "log10", "reciprocal", "ndtri", "neg", "round",
    "rsqrt", "sign", "signbit", "sin", "sinh", "spherical_bessel_j0", "sqrt", "tan", "tanh",
    "trunc", "add", "atan2", "bitwise_and", "bitwise_or", "bitwise_xor", "div", "eq", "fmax",
    "fmin", "fmod", "gcd", "ge", "gt", "hypot", "igamma", "igammac", "le", "lt", "maximum",
    "minimum", "mul", "ne", "nextafter", "pow", "remainder", "shift_left",
    "shift_right_arithmetic", "sub", "zeta", "where", "convert_element_type")

for _name in ELEMENTWISE_PRIMS:
    _op = getattr(torch.ops.prims, _name).default
    register_batch_rule(_op, pointwise_rule_for(_op))
