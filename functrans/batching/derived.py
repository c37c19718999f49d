"""Rules derived from a functional op's rule: in-place (``foo_``), ``out=`` and ``*_copy`` variants.

Many ATen ops come in three or four flavours that compute the same values: ``index_add``,
``index_add_``, ``index_add.out``; ``permute`` and ``permute_copy``.  A rule written for the
functional op serves the others:

* ``foo_copy``: run ``foo``'s rule, then clone its outputs (a copy owns its memory).
* ``foo_`` (in-place on argument 0): run ``foo``'s rule on the same arguments, move the result
  to ``self``'s batch dim and ``copy_`` it into ``self``'s physical value.  The values are
  computed before anything is written, so ``x.index_add_(0, i, x)`` is safe.  Like eager, a
  result whose dtype cannot be cast to ``self``'s raises.
* ``foo.out`` (``out=`` keyword arguments): run ``foo``'s rule and ``copy_`` each result into the
  physical value of its ``out`` tensor.  An ``out`` of the wrong shape would have to be resized,
  which a batched tensor cannot do per example: that raises an error saying so.

The counterpart is found by schema, never by guessing: its arguments must be the variant's
arguments minus the written ones, with the same names and types.  The dispatcher resolves
these only for ops with no rule of their own (see ``registry.find_rule``).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch.utils._pytree import tree_map_only

from ..errors import UnsupportedUnderVmap
from .helpers import match_bdim

aten = torch.ops.aten


def _is_written(a) -> bool:
    return a.alias_info is not None and a.alias_info.is_write


def _signature(args) -> List[Tuple[str, str]]:
    return [(a.name, str(a.type)) for a in args]


def _overload(packet_name: str, overload: str) -> Optional[torch._ops.OpOverload]:
    packet = getattr(aten, packet_name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return None
    try:
        return getattr(packet, overload)
    except AttributeError:
        return None


def counterpart(op: torch._ops.OpOverload) -> Tuple[str, Optional[torch._ops.OpOverload]]:
    """``(kind, functional op)`` with kind 'copy', 'inplace' or 'out'; ``('', None)`` if none."""
    if op.namespace != "aten":
        return "", None
    name, overload = op.overloadpacket.__name__, op._overloadname
    args = op._schema.arguments
    written = [a for a in args if _is_written(a)]
    if name.endswith("_copy") and not written:
        base = _overload(name[:-len("_copy")], overload)
        if base is not None and _signature(base._schema.arguments) == _signature(args):
            return "copy", base
        return "", None
    if len(written) == 1 and args and args[0] is written[0] and name.endswith("_") \
            and not name.endswith("__"):
        base = _overload(name[:-1], overload)
        if base is not None and _signature(base._schema.arguments) == _signature(args) \
                and len(base._schema.returns) == 1:
            return "inplace", base
        return "", None
    if written and all(a.kwarg_only for a in written):
        wanted = _signature([a for a in args if not _is_written(a)])
        packet = op.overloadpacket
        for ov in packet.overloads():
            base = getattr(packet, ov)
            if base is not op and _signature(base._schema.arguments) == wanted \
                    and len(base._schema.returns) == len(written):
                return "out", base
    return "", None


def derive_rule(op: torch._ops.OpOverload, find_rule):
    """A rule for ``op`` built from its functional counterpart's rule, or None."""
    kind, base = counterpart(op)
    if base is None:
        return None
    base_rule = find_rule(base)[1]
    if base_rule is None:
        return None
    make = {"copy": _copy_rule, "inplace": _inplace_rule, "out": _out_rule}[kind]
    rule = make(op, base, base_rule)
    rule.__name__ = f"{kind}_rule[{op}] from {getattr(base_rule, '__name__', base)}"
    return rule


def _copy_rule(op, base, base_rule):
    def rule(info, in_dims, /, *args, **kwargs):
        out, dims = base_rule(info, in_dims, *args, **kwargs)
        return tree_map_only(torch.Tensor, torch.clone, out), dims
    return rule


def _check_cast(op, result: torch.Tensor, target: torch.Tensor) -> None:
    if not torch.can_cast(result.dtype, target.dtype):
        raise RuntimeError(f"{op}: result type {result.dtype} can't be cast to the desired "
                           f"output type {target.dtype}")


def _write(op, info, results, result_dims, targets, target_dims, *, is_out: bool) -> None:
    """Check every (result, target) pair first, then write: nothing is ever half-written."""
    from .registry import Decline
    values = [match_bdim(r, rd, td, info.batch_size)
              for r, rd, td in zip(results, result_dims, target_dims)]
    for v, t, td in zip(values, targets, target_dims):
        if v.shape != t.shape:
            if not is_out:
                raise Decline()  # eager raises its own error for this self: the loop does
            shape = lambda x: tuple(x.shape[:td]) + tuple(x.shape[td + 1:])  # noqa: E731
            raise UnsupportedUnderVmap(
                f"vmap: {op} got an out= tensor of shape {shape(t)} per example for a result "
                f"of shape {shape(v)}. Eager PyTorch would resize it, but a batched out= "
                "tensor cannot be resized per example. Allocate it with the result's shape "
                "(e.g. torch.empty_like of an input of that shape), or drop out=.")
        _check_cast(op, v, t)
    for v, t in zip(values, targets):
        t.copy_(v)


def _inplace_rule(op, base, base_rule):
    def rule(info, in_dims, /, *args, **kwargs):
        from .registry import Decline
        if in_dims[0] is None:
            raise Decline()
        out, dim = base_rule(info, in_dims, *args, **kwargs)
        _write(op, info, [out], [dim], [args[0]], [in_dims[0]], is_out=False)
        return args[0], in_dims[0]
    return rule


def _out_rule(op, base, base_rule):
    names = [a.name for a in op._schema.arguments if _is_written(a)]

    # (info, in_dims positional-only: ``info=`` is also an out argument of linalg_inv_ex.inverse)
    def rule(info, in_dims, /, *args, _kw_dims, **kwargs):
        from .registry import Decline
        targets = [kwargs.pop(n) for n in names]
        dims = [_kw_dims.get(n) for n in names]
        if any(d is None for d in dims) or any(
                d is not None for k, d in _kw_dims.items() if k not in names):
            raise Decline()  # an unbatched out=, or a batched non-out keyword argument
        if any(d is not None for d in in_dims):
            out, out_dims = base_rule(info, in_dims, *args, **kwargs)
        else:  # only the out= tensors are batched: compute once, broadcast into them
            out = base(*args, **kwargs)
            out_dims = None if isinstance(out, torch.Tensor) else type(out)(None for _ in out)
        outs = [out] if isinstance(out, torch.Tensor) else list(out)
        odims = [out_dims] if isinstance(out, torch.Tensor) else list(out_dims)
        if len(outs) != len(targets) or any(
                isinstance(o, torch.Tensor) and o.dtype != t.dtype
                for o, t in zip(outs, targets)):
            # An out= of another dtype: eager's rules differ by op (a cast for some, an error
            # for others, e.g. gather, aminmax, complex): the loop runs eager's per example.
            raise Decline()
        _write(op, info, outs, odims, targets, dims, is_out=True)
        if len(targets) == 1:
            return targets[0], dims[0]
        return tuple(targets), tuple(dims)

    rule.batched_kwargs = True
    return rule
