"""What functrans reads from an ATen op itself: its schema, its kernels, its name.

One copy each of the facts several modules need:

* ``overload_named('aten.index_add.default')`` (or ``'aten::index_add'``): a name to its
  ``OpOverload``;
* ``written_arguments(op)``: which arguments the op writes (from the schema's alias info);
* ``decomposes_above_dispatch(op)``: CompositeImplicitAutograd ops, which never reach
  ``__torch_dispatch__`` as themselves (an op outside the dispatcher, ``prim.device``, is not
  one);
* ``all_overloads()``: every overload of a namespace the C++ dispatcher knows.

The listing comes from the dispatcher's registry of op names
(``torch._C._dispatch_get_all_op_names()``), not from ``dir(torch.ops.aten)``: the latter names
only the op packets Python has already loaded, so a listing built on it depended on what ran
earlier in the process.  TorchScript-only overloads such as ``aten::mul.left_t``, which
``packet.overloads()`` also lists, are not dispatcher ops and never reach ``__torch_dispatch__``;
they are left out.  Resolving all ~3100 ATen overloads takes ~0.2 s, so resolutions are cached
per name; each call re-reads the dispatcher's names (a few ms), so an op registered later (a
``torch.library`` fragment of ``aten``) still appears.

Imports: nothing (torch only).
"""
from __future__ import annotations

import threading
from typing import Dict, List, Optional, Tuple

import torch

_resolved: Dict[str, Optional[torch._ops.OpOverload]] = {}
# per namespace: (the dispatcher names last seen, their overloads)
_last: Dict[str, Tuple[Tuple[str, ...], List[torch._ops.OpOverload]]] = {}
_lock = threading.Lock()


def overload_named(name: str) -> Optional[torch._ops.OpOverload]:
    """``'ns::name.overload'``, ``'ns::name'`` (the default overload), ``'ns.name.overload'``
    (``str(op)``) or ``'name.overload'`` (aten) -> its OpOverload; None if there is none."""
    if "::" in name:
        namespace, _, rest = name.partition("::")
    else:
        parts = name.split(".")
        namespace, rest = ("aten", name) if len(parts) < 3 else (parts[0], ".".join(parts[1:]))
    packet_name, _, overload = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet_name), overload or "default")
    except Exception:  # unknown names (AttributeError, or RuntimeError from torch.ops)
        return None


def written_arguments(op: torch._ops.OpOverload) -> Tuple[List[int], List[str]]:
    """(positions of the positional arguments ``op`` writes, names of its keyword-only
    written arguments): ``self`` of ``add_``, ``out`` of ``add.out``."""
    positional, keyword = [], []
    for i, a in enumerate(op._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            if a.kwarg_only:
                keyword.append(a.name)
            else:
                positional.append(i)
    return positional, keyword


def writes_self(op: torch._ops.OpOverload) -> bool:
    """Whether ``op`` writes its first argument in place (``add_``, ``triu_``, ``scatter_``)."""
    return 0 in written_arguments(op)[0]


def decomposes_above_dispatch(op: torch._ops.OpOverload) -> bool:
    """True for CompositeImplicitAutograd ops: they never reach ``__torch_dispatch__``.

    False for an op the C++ dispatcher does not know: ``prim.device`` reaches a dispatch mode
    when a tensor's device is read through Python (a ``FakeTensor`` under ``make_fx``'s fake
    and symbolic modes); asked about such an op, the kernel query raises."""
    return torch._C._dispatch_has_kernel(op.name()) and \
        torch._C._dispatch_has_kernel_for_dispatch_key(
            op.name(), torch._C.DispatchKey.CompositeImplicitAutograd)


def all_overloads(namespace: str = "aten") -> List[torch._ops.OpOverload]:
    """Every overload of ``namespace`` registered with the dispatcher, sorted by name.

    The same answer whatever ran before in the process (see the module docstring)."""
    prefix = namespace + "::"
    names = tuple(sorted(n for n in torch._C._dispatch_get_all_op_names()
                         if n.startswith(prefix)))
    with _lock:
        seen = _last.get(namespace)
        if seen is not None and seen[0] == names:
            return list(seen[1])
        out = []
        for name in names:
            if name not in _resolved:
                _resolved[name] = overload_named(name)
            ov = _resolved[name]
            if ov is not None:
                out.append(ov)
        _last[namespace] = (names, out)
        return list(out)
