"""Enumerate ATen operator overloads (for coverage listings and tests).

The listing comes from the C++ dispatcher's registry of op names
(``torch._C._dispatch_get_all_op_names()``), not from ``dir(torch.ops.aten)``: the latter names
only the op packets Python has already loaded, so a listing built on it depended on what ran
earlier in the process.  Every ``aten::name.overload`` the dispatcher knows is resolved to its
``OpOverload`` (TorchScript-only overloads such as ``aten::mul.left_t``, which ``packet.overloads()``
also lists, are not dispatcher ops and never reach ``__torch_dispatch__``; they are left out).

Resolving all ~3100 ATen overloads loads every packet and takes ~0.2 s, so resolutions are cached
per name; each call re-reads the dispatcher's names (a few ms), so an op registered later (a
``torch.library`` fragment of ``aten``) still appears.
"""
from __future__ import annotations

import threading
from typing import Dict, List, Optional, Tuple

import torch

_resolved: Dict[str, Optional[torch._ops.OpOverload]] = {}
# per namespace: (the dispatcher names last seen, their overloads)
_last: Dict[str, Tuple[Tuple[str, ...], List[torch._ops.OpOverload]]] = {}
_lock = threading.Lock()


def _resolve(qualified: str) -> Optional[torch._ops.OpOverload]:
    """``'ns::name.overload'`` (or ``'ns::name'`` for the default overload) -> its OpOverload."""
    namespace, _, rest = qualified.partition("::")
    packet_name, _, overload = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet_name), overload or "default")
    except Exception:  # not resolvable from Python (none in torch 2.13, but be safe)
        return None


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
                _resolved[name] = _resolve(name)
            ov = _resolved[name]
            if ov is not None:
                out.append(ov)
        _last[namespace] = (names, out)
        return list(out)


def decomposes_above_dispatch(op: torch._ops.OpOverload) -> bool:
    """True for CompositeImplicitAutograd ops: they never reach ``__torch_dispatch__``."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(
        op.name(), torch._C.DispatchKey.CompositeImplicitAutograd)
