"""The ATen ops that run on the loop fallback ON PURPOSE, each with the reason.

Every other op reached under vmap has a rule, a derived rule, or a decomposition (the full OpInfo
sweep lists any op that falls back and is not here).  The fallback's warning quotes the reason,
so a user who meets one knows it is deliberate.  Keys are ``packet.overload`` names.
"""
from __future__ import annotations

from typing import Dict

NO_RULE: Dict[str, str] = {
    "adaptive_max_pool3d.default": (
        "PyTorch's adaptive_max_pool3d_backward kernel crashed (segfault) on inputs with the "
        "vmap batch folded into N or C; the per-example loop is safe"),
    "adaptive_max_pool3d_backward.default": (
        "PyTorch's adaptive_max_pool3d_backward kernel crashed (segfault) on inputs with the "
        "vmap batch folded into N or C; the per-example loop is safe"),
}


def reason(op) -> str:
    """The reason ``op`` has no rule on purpose, or ''."""
    return NO_RULE.get(f"{op.overloadpacket.__name__}.{op._overloadname}", "") \
        if op.namespace == "aten" else ""
