"""``F.scaled_dot_product_attention`` on its math composition, for forward mode and for
derivatives of order two and more.

On CPU, ``F.scaled_dot_product_attention`` picks the fused kernel
``_scaled_dot_product_flash_attention_for_cpu`` (float32/float64, no dropout).  That kernel has
no forward-AD formula, and its backward ``_scaled_dot_product_flash_attention_for_cpu_backward``
has no derivative, so ``jvp``, ``jacfwd``, ``hessian`` and reverse-over-reverse of any attention
model fail in plain PyTorch and in torch.func ("Trying to use forward AD with
_scaled_dot_product_flash_attention_for_cpu that does not support it", "derivative for
aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented").  The CUDA fused
kernels are in the same position for forward mode.

While a functrans transform differentiates in forward mode (a ``jvp`` level: ``jvp``, ``jacfwd``,
``hessian``) or differentiates the function's graph twice or more (the double-vjp route of a
jvp, ``linearize``, ``jacrev(jacrev(f))``), ``ComposedKernelsMode`` (``exact_norms.py``) sends the
call to ``scaled_dot_product_attention()`` below: ``aten._scaled_dot_product_attention_math``,
PyTorch's own reference composition ``softmax(Q K^T * scale + mask) V``, which the fused kernels
are checked against and which sdpa itself runs when no fused kernel applies.  Every op in it has
forward and backward formulas at every order.  It takes the same arguments with the same
meaning: a boolean ``attn_mask`` (True = attend) or an additive float one, broadcast to
[..., L, S]; ``is_causal`` (the upper triangle masked; refused together with a mask, as sdpa
refuses it); ``scale`` (default 1/sqrt(E)); ``enable_gqa`` (key/value heads repeated to the
query's); ``dropout_p`` (drawn as sdpa's math path draws it, which is what sdpa runs on CPU for
``dropout_p > 0`` anyway).  First-order reverse transforms (``grad``, ``vjp``, ``jacrev``,
per-sample gradients) keep the fused kernel.

Imports: nothing (torch).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

_math = torch.ops.aten._scaled_dot_product_attention_math.default


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` through its math composition (same signature)."""
    if query.is_nested or key.is_nested or value.is_nested:
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p,
                                              is_causal, scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # sdpa's front end converts a boolean mask before any kernel sees it (True: attend)
        attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
    return _math(query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale,
                 enable_gqa=enable_gqa)[0]
