"""Attention: ``_safe_softmax`` (what the math path of ``F.scaled_dot_product_attention`` reaches
on CPU: ``_scaled_dot_product_attention_math`` is CompositeImplicit and decomposes into matmuls
and this softmax), the fused CPU kernels ``_scaled_dot_product_flash_attention_for_cpu`` and
its backward, and the fused CUDA kernels ``_scaled_dot_product_efficient_attention`` (what
``F.scaled_dot_product_attention`` picks for float32 on CUDA),
``_scaled_dot_product_flash_attention`` (half/bfloat16) and their backwards.

Invariants:
* ``_safe_softmax`` normalizes along a LOGICAL dim, translated to a physical one; bdim kept;
* the fused kernels take [N, H, L, E] tensors: the vmap batch folds into N (every tensor gets
  the batch first, shared ones as expanded views), so each example attends only to itself; an
  attention mask shared by the batch broadcasts as is when its leading dim is 1 or it is 2-D,
  and is expanded per example otherwise; a batched mask (the CPU kernels' ``attn_mask=``
  keyword: T5's position bias in an ensemble, a padding mask per example) is padded to the
  kernel's 4 dims, its N dim expanded to the query's, and folded like q/k/v;
* the CPU kernel gives wrong values for inputs whose last dim is not unit-stride; the rule
  hands it such inputs made contiguous (a batch dim moved last would otherwise trigger it);
* dropout: the CPU kernel refuses ``dropout_p > 0``; the rule declines it, so the random-op
  check and eager's own error stay in charge.  The CUDA kernels' rules decline it too (each
  example would need its own dropout draw), as they decline logical ranks other than 4, a
  debug mask, varlen (``cum_seq_*``) inputs and batched philox seeds/offsets: the loop runs them;
* CUDA kernels' outputs: ``output``/``log_sumexp``/gradients are [N, ...] and unfold by
  splitting the leading dim only (the efficient kernel pads ``log_sumexp``'s last dim to a
  multiple of 32, and may return it with 0 columns: the split never infers a size); the
  philox seed/offset (rng_state/unused) and the empty debug mask do not depend on the examples
  when ``dropout_p == 0`` and are returned unbatched; ``max_q``/``max_k`` are ints;
* the efficient kernel's ``attn_bias`` must be [N, H, L, S] exactly (it is what sdpa passes:
  a padded, expanded mask); the rule folds it like q/k/v (an unbatched bias expanded per
  example) and re-aligns it (strides a multiple of 16 elements, as sdpa's ``pad_bias`` does)
  when folding copied it; its gradient is one per example (the kernel writes a fresh
  [N, H, L, S] gradient whatever the bias's strides), so a shared bias gets a batched gradient,
  which is the op's meaning per example (autograd sums it where a shared bias needs that).
"""
from __future__ import annotations

import torch

from ..helpers import (ensure_bdim_front, fold_bdim_into_dim0, logical_rank,
                       move_bdim_to_front, physical_dim, split_dim0)
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
    T = fold_bdim_into_dim0(t, bdim, size)
    return T if T.dim() < 2 or T.stride(-1) == 1 else T.contiguous()


def _fold_mask(mask, size, bdim=None, n=None):
    """The mask for the folded [B*N, H, L, S] call: a shared one as is when it broadcasts
    over B*N, else expanded per example; a batched one (``bdim``) padded to 4 logical dims,
    its N dim expanded to ``n`` (the query's), folded."""
    if mask is None:
        return mask
    if bdim is None:
        if mask.dim() == 2 or mask.shape[0] == 1:
            return mask
        return fold_bdim_into_dim0(mask, None, size)
    m = move_bdim_to_front(mask, bdim)
    m = m.reshape(size, *([1] * (5 - m.dim())), *m.shape[1:])    # [B, N|1, H|1, L, S]
    return _fold(m.expand(size, n, *m.shape[2:]), 0, size)


def _mask_dim(_kw_dims):
    return (_kw_dims or {}).get("attn_mask")


def _check_fusable(tensors, in_dims, dropout_p):
    if dropout_p > 0:
        raise Decline()
    if any(logical_rank(t, d) != 4 for t, d in zip(tensors, in_dims)):
        raise Decline()   # the kernel's own error for other ranks


@register_batch_rule(aten._scaled_dot_product_flash_attention_for_cpu.default,
                     batched_kwargs=True)
def flash_attention_cpu_rule(info, in_dims, q, k, v, dropout_p=0.0, is_causal=False, *,
                             attn_mask=None, scale=None, _kw_dims=None):
    _check_fusable((q, k, v), in_dims[:3], dropout_p)
    B = info.batch_size
    q, k, v = (_fold(t, d, B) for t, d in zip((q, k, v), in_dims))
    mask = _fold_mask(attn_mask, B, _mask_dim(_kw_dims), q.shape[0] // B)
    kernel = _math_with_lse if mask is not None and mask.requires_grad and \
        torch.is_grad_enabled() else aten._scaled_dot_product_flash_attention_for_cpu.default
    out, lse = kernel(q, k, v, dropout_p, is_causal, attn_mask=mask, scale=scale)
    return (split_dim0(out, B), split_dim0(lse, B)), (0, 0)


# Note [a mask that requires grad]
# The fused CPU kernel has no gradient for attn_mask, so eager sdpa picks its math path when the
# mask requires grad (T5's position bias, computed from a parameter).  Under vmap with autograd
# on the physical values (an ensemble's stacked parameters, grad outside vmap; Note [autograd on
# physical values] in batching/dispatch.py), sdpa chose the kernel on the wrappers, which do not
# require grad, and only the physical mask does: the rule then computes the kernel's outputs
# with the math composition, differentiable in every input (the op's torch._decomp entry does
# the same but returns the attention weights where the kernel returns its logsumexp).
def _math_with_lse(q, k, v, dropout_p, is_causal, *, attn_mask, scale):
    """The CPU kernel's (output [N, H, L, E], logsumexp [N, H, L]) by its math composition."""
    gqa = q.shape[1] != k.shape[1]
    out = aten._scaled_dot_product_attention_math.default(
        q, k, v, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=gqa)[0]
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if attn_mask is not None:   # (a float mask: one that requires grad; the kernel takes no bool)
        scores = scores + attn_mask
    if is_causal:
        upper = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(upper, float("-inf"))
    return out, torch.logsumexp(scores, -1)


@register_batch_rule(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                     batched_kwargs=True)
def flash_attention_cpu_backward_rule(info, in_dims, grad, q, k, v, out, lse, dropout_p,
                                      is_causal, *, attn_mask=None, scale=None, _kw_dims=None):
    _check_fusable((grad, q, k, v, out), in_dims[:5], dropout_p)
    B = info.batch_size
    folded = [_fold(t, d, B) for t, d in zip((grad, q, k, v, out, lse), in_dims)]
    grads = aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        *folded, dropout_p, is_causal,
        attn_mask=_fold_mask(attn_mask, B, _mask_dim(_kw_dims), folded[1].shape[0] // B),
        scale=scale)
    return tuple(split_dim0(t, B) for t in grads), (0, 0, 0)


# ----------------------------------------------------------------------------- CUDA kernels
# (No CPU implementation: tests/batching/rules/test_attention.py registers a CPU reference of each
# for the duration of its tests.)

_BIAS_ALIGN = 16   # elements; sdpa's pad_bias uses 8 for the efficient kernel, its grad 16


def _fold_bias(bias, bdim, size):
    """The efficient kernel's [N, H, L, S] bias with the examples folded into N, with every
    stride but the last a multiple of ``_BIAS_ALIGN`` (padded storage, sliced back)."""
    b = _fold(bias, bdim, size)
    if all(st % _BIAS_ALIGN == 0 for st in b.stride()[:-1]):
        return b
    last = b.shape[-1]
    if last % _BIAS_ALIGN == 0:
        return b.contiguous()
    return aten.constant_pad_nd.default(b, [0, -last % _BIAS_ALIGN]).narrow(-1, 0, last)


def _logical_shape(t, bdim):
    if bdim is None:
        return tuple(t.shape)
    return tuple(t.shape[:bdim % t.dim()]) + tuple(t.shape[bdim % t.dim() + 1:])


def _check_bias(q, qd, bias, bd, k, kd):
    """Decline a bias the kernel would refuse per example: it takes [N, H, L, S] exactly."""
    if bias is None:
        return
    lq, lk = _logical_shape(q, qd), _logical_shape(k, kd)
    if _logical_shape(bias, bd) != lq[:3] + lk[2:3]:
        raise Decline()   # the kernel's own error, from the loop


@register_batch_rule(aten._scaled_dot_product_efficient_attention.default)
def efficient_attention_rule(info, in_dims, q, k, v, attn_bias, compute_log_sumexp,
                             dropout_p=0.0, is_causal=False, *, scale=None):
    _check_fusable((q, k, v), in_dims[:3], dropout_p)
    _check_bias(q, in_dims[0], attn_bias, in_dims[3], k, in_dims[1])
    B = info.batch_size
    bias = None if attn_bias is None else _fold_bias(attn_bias, in_dims[3], B)
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention.default(
        *(_fold(t, d, B) for t, d in zip((q, k, v), in_dims)), bias, compute_log_sumexp,
        dropout_p, is_causal, scale=scale)
    return (split_dim0(out, B), split_dim0(lse, B), seed, offset), (0, 0, None, None)


@register_batch_rule(aten._scaled_dot_product_efficient_attention_backward.default)
def efficient_attention_backward_rule(info, in_dims, grad, q, k, v, attn_bias, out, lse,
                                      philox_seed, philox_offset, dropout_p, grad_input_mask,
                                      is_causal=False, *, scale=None):
    if grad is None or in_dims[7] is not None or in_dims[8] is not None:
        raise Decline()
    _check_fusable((grad, q, k, v, out), in_dims[:4] + in_dims[5:6], dropout_p)
    if logical_rank(lse, in_dims[6]) != 3:
        raise Decline()
    _check_bias(q, in_dims[1], attn_bias, in_dims[4], k, in_dims[2])
    B = info.batch_size
    bias = None if attn_bias is None else _fold_bias(attn_bias, in_dims[4], B)
    gq, gk, gv, gb = aten._scaled_dot_product_efficient_attention_backward.default(
        *(_fold(t, d, B) for t, d in zip((grad, q, k, v), in_dims)), bias,
        _fold(out, in_dims[5], B), _fold(lse, in_dims[6], B).contiguous(), philox_seed,
        philox_offset, dropout_p, grad_input_mask, is_causal, scale=scale)
    if gb is not None:
        gb = split_dim0(gb, B)
    return ((split_dim0(gq, B), split_dim0(gk, B), split_dim0(gv, B), gb),
            (0, 0, 0, None if gb is None else 0))


if hasattr(aten, "_scaled_dot_product_flash_attention"):
    @register_batch_rule(aten._scaled_dot_product_flash_attention.default)
    def flash_attention_rule(info, in_dims, q, k, v, dropout_p=0.0, is_causal=False,
                             return_debug_mask=False, *, scale=None):
        _check_fusable((q, k, v), in_dims[:3], dropout_p)
        if return_debug_mask:
            raise Decline()
        B = info.batch_size
        out, lse, cq, ck, max_q, max_k, rng, unused, debug = \
            aten._scaled_dot_product_flash_attention.default(
                *(_fold(t, d, B) for t, d in zip((q, k, v), in_dims)), dropout_p, is_causal,
                return_debug_mask, scale=scale)
        if cq is not None or ck is not None:
            raise Decline()   # (dense inputs never give cumulative sequence lengths)
        return ((split_dim0(out, B), split_dim0(lse, B), cq, ck, max_q, max_k, rng, unused,
                 debug), (0, 0, None, None, None, None, None, None, None))

if hasattr(aten, "_scaled_dot_product_flash_attention_backward"):
    @register_batch_rule(aten._scaled_dot_product_flash_attention_backward.default)
    def flash_attention_backward_rule(info, in_dims, grad, q, k, v, out, lse, cum_seq_q,
                                      cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                      philox_seed, philox_offset, *, scale=None):
        if cum_seq_q is not None or cum_seq_k is not None or grad is None \
                or in_dims[12] is not None or in_dims[13] is not None:
            raise Decline()   # varlen inputs, or batched seeds: the loop
        _check_fusable((grad, q, k, v, out), in_dims[:5], dropout_p)
        if logical_rank(lse, in_dims[5]) != 3:
            raise Decline()
        B = info.batch_size
        grads = aten._scaled_dot_product_flash_attention_backward.default(
            *(_fold(t, d, B) for t, d in zip((grad, q, k, v, out), in_dims)),
            _fold(lse, in_dims[5], B).contiguous(), cum_seq_q, cum_seq_k, max_q, max_k,
            dropout_p, is_causal, philox_seed, philox_offset, scale=scale)
        return tuple(split_dim0(t, B) for t in grads), (0, 0, 0)


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
