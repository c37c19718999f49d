"""Attention: ``_safe_softmax`` (what the math path of ``F.scaled_dot_product_attention`` reaches
on CPU: ``_scaled_dot_product_attention_math`` is CompositeImplicit and decomposes into matmuls
and this softmax) and the fused CPU kernels ``_scaled_dot_product_flash_attention_for_cpu`` and
its backward.

Invariants:
* ``_safe_softmax`` normalizes along a LOGICAL dim, translated to a physical one; bdim kept;
* the fused kernels take [N, H, L, E] tensors: the vmap batch folds into N (every tensor gets
  the batch first, shared ones as expanded views), so each example attends only to itself; an
  attention mask shared by the batch broadcasts as is when its leading dim is 1 or it is 2-D,
  and is expanded per example otherwise;
* the CPU kernel gives wrong values for inputs whose last dim is not unit-stride; the rule
  hands it such inputs made contiguous (a batch dim moved last would otherwise trigger it);
* dropout: the CPU kernel refuses ``dropout_p > 0``; the rule declines it, so the random-op
  check and eager's own error stay in charge.
"""
from __future__ import annotations

import torch

from ..helpers import ensure_bdim_front, logical_rank, physical_dim
from ..registry import Decline, registrar

aten = torch.ops.aten
register_batch_rule = registrar("attention")   # the rules below live in this file


@register_batch_rule(aten._safe_softmax.default)
def safe_softmax_rule(info, in_dims, x, dim, dtype=None):
    bdim = in_dims[0]
    return aten._safe_softmax.default(x, physical_dim(dim, bdim, logical_rank(x, bdim)),
                                      dtype), bdim


def _fold(t, bdim, size):
    """[B, N, ...] -> [B*N, ...] (an unbatched ``t`` is expanded first), with a unit stride in
    the last dim: the CPU kernel misreads tensors whose last dim is strided (torch 2.13)."""
    T = ensure_bdim_front(t, bdim, size)
    T = T.reshape((-1,) + T.shape[2:])
    return T if T.dim() < 2 or T.stride(-1) == 1 else T.contiguous()


def _fold_mask(mask, size):
    if mask is None or mask.dim() == 2 or mask.shape[0] == 1:
        return mask
    return mask.expand((size,) + mask.shape).reshape((-1,) + mask.shape[1:])


def _unfold(t, size):
    return t.reshape((size, -1) + t.shape[1:])


def _check_fusable(tensors, in_dims, dropout_p):
    if dropout_p > 0:
        raise Decline()
    if any(logical_rank(t, d) != 4 for t, d in zip(tensors, in_dims)):
        raise Decline()   # the kernel's own error for other ranks


@register_batch_rule(aten._scaled_dot_product_flash_attention_for_cpu.default)
def flash_attention_cpu_rule(info, in_dims, q, k, v, dropout_p=0.0, is_causal=False, *,
                             attn_mask=None, scale=None):
    _check_fusable((q, k, v), in_dims[:3], dropout_p)
    B = info.batch_size
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(
        *(_fold(t, d, B) for t, d in zip((q, k, v), in_dims)), dropout_p, is_causal,
        attn_mask=_fold_mask(attn_mask, B), scale=scale)
    return (_unfold(out, B), _unfold(lse, B)), (0, 0)


@register_batch_rule(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def flash_attention_cpu_backward_rule(info, in_dims, grad, q, k, v, out, lse, dropout_p,
                                      is_causal, *, attn_mask=None, scale=None):
    _check_fusable((grad, q, k, v, out), in_dims[:5], dropout_p)
    B = info.batch_size
    folded = [_fold(t, d, B) for t, d in zip((grad, q, k, v, out, lse), in_dims)]
    grads = aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        *folded, dropout_p, is_causal, attn_mask=_fold_mask(attn_mask, B), scale=scale)
    return tuple(_unfold(t, B) for t in grads), (0, 0, 0)


# nn.TransformerEncoderLayer's inference fast path: one fused kernel over [N, S, E].  With shared
# weights the vmap batch joins N (an example without its own N is [S, E], and the batch is N).
_FFN_LAST = 17  # in_dims index of ffn_bias_2; mask and mask_type follow


@register_batch_rule(aten._transformer_encoder_layer_fwd.default)
def transformer_encoder_layer_fwd_rule(info, in_dims, src, embed_dim, num_heads, *rest,
                                       mask=None, mask_type=None):
    B = info.batch_size
    if len(rest) > 15:
        mask = rest[15]
    if len(rest) > 16:
        mask_type = rest[16]
    weights = rest[:15]
    batched_rest = any(d is not None for d in in_dims[1:])
    if in_dims[0] is None or batched_rest:
        raise Decline()  # batched weights or a batched mask: the loop
    x = ensure_bdim_front(src, in_dims[0], B)
    if x.dim() == 3:      # examples are [S, E]: the vmap batch is N
        n, folded = None, x
    elif x.dim() == 4:
        n = x.shape[1]
        folded = x.reshape(B * n, *x.shape[2:])
        if mask is not None and mask_type == 1:   # a key padding mask [N, S], one per sequence
            mask = mask.repeat(B, 1)
        elif mask is not None and mask_type not in (0,):
            raise Decline()
    else:
        raise Decline()
    out = aten._transformer_encoder_layer_fwd.default(folded, embed_dim, num_heads, *weights,
                                                      mask, mask_type)
    return (out, 0) if n is None else (out.view(B, n, *out.shape[1:]), 0)
