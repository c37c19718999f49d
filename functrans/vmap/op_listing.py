"""Enumerate ATen operator overloads (for coverage listings and tests)."""
from __future__ import annotations

import functools
from typing import List

import torch


@functools.lru_cache(maxsize=None)
def all_overloads() -> List[torch._ops.OpOverload]:
    aten = torch.ops.aten
    out = []
    for name in dir(aten):
        try:
            packet = getattr(aten, name)
        except Exception:
            continue
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for ov in packet.overloads():
            try:
                out.append(getattr(packet, ov))
            except Exception:
                continue
    return out


def decomposes_above_dispatch(op: torch._ops.OpOverload) -> bool:
    """True for CompositeImplicitAutograd ops: they never reach ``__torch_dispatch__``."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(
        op.name(), torch._C.DispatchKey.CompositeImplicitAutograd)
