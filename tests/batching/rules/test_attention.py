"""Attention rules vs the loop oracle (every in_dims choice, vmap∘vmap, strict):
F.scaled_dot_product_attention (math path: _safe_softmax), the fused CPU flash kernel and its
backward called directly, dropout refused under randomness='error', and per-sample gradients of
a tiny attention block vs torch.func."""
import pytest
import torch
import torch.nn.functional as F

import functrans as ft
from functrans.errors import UnsupportedUnderVmap
from tests.support.oracles import assert_same, check_vmap, check_vmap_all_bdims

aten = torch.ops.aten
g = torch.Generator().manual_seed(0)
Q, K, V = (torch.randn(2, 5, 4, generator=g), torch.randn(2, 6, 4, generator=g),
           torch.randn(2, 6, 4, generator=g))
MASK = torch.randn(5, 6, generator=g)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa(causal):
    f = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3)
    check_vmap_all_bdims(f, [Q, K, V])
    check_vmap_all_bdims(ft.grad(lambda q, k, v: (f(q, k, v) ** 2).sum(), argnums=(0, 1, 2)),
                         [Q, K, V], nested=False)


@pytest.mark.parametrize("boolean", [False, True])
def test_sdpa_with_a_mask(boolean):
    mask = MASK > -0.5 if boolean else MASK
    f = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    for in_dims in [(0, 0, 0, 0), (None, None, None, 0), (0, None, -1, None), (-1, 0, 0, -1)]:
        check_vmap(f, [Q, K, V, mask], in_dims)
    check_vmap(ft.grad(lambda q, m: f(q, K, V, m).sum()), [Q, mask], (0, 0))


def test_sdpa_dropout_is_refused_under_randomness_error():
    f = lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    with pytest.raises(UnsupportedUnderVmap, match="random"):
        ft.vmap(f)(torch.randn(3, 2, 5, 4))


FQ, FK, FV = (torch.randn(1, 2, 5, 4, generator=g), torch.randn(1, 2, 6, 4, generator=g),
              torch.randn(1, 2, 6, 4, generator=g))


@pytest.mark.parametrize("mask", [None, MASK, MASK.expand(2, 5, 6).reshape(1, 2, 5, 6),
                                  torch.randn(2, 2, 5, 6, generator=g)],
                         ids=["none", "2d", "4d-shared", "4d-per-n"])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_cpu_kernel_and_backward(mask, causal):
    q, k, v = (FQ.expand(2, 2, 5, 4).clone(), FK.expand(2, 2, 6, 4).clone(),
               FV.expand(2, 2, 6, 4).clone()) if mask is not None and mask.shape[0] == 2 \
        else (FQ, FK, FV)
    # (contiguous: the eager kernel misreads inputs whose last dim is strided, and the loop
    # oracle's slices of a batch stacked last are such inputs)
    fused = lambda a, b, c: aten._scaled_dot_product_flash_attention_for_cpu(
        a.contiguous(), b.contiguous(), c.contiguous(), 0.0, causal, attn_mask=mask, scale=0.4)
    check_vmap_all_bdims(fused, [q, k, v], nested=mask is None)
    out, lse = fused(q, k, v)
    gout = torch.randn(out.shape, generator=g)
    backward = lambda *a: aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *(t.contiguous() for t in a), 0.0, causal, attn_mask=mask, scale=0.4)
    for in_dims in [(0, 0, 0, 0, 0, 0), (0, None, None, None, None, None),
                    (None, -1, 0, None, -1, 0), (-1, 0, 0, 0, None, None)]:
        check_vmap(backward, [gout, q, k, v, out, lse], in_dims, rtol=1e-4, atol=1e-5)
    check_vmap_all_bdims(ft.grad(lambda a, b, c: fused(a, b, c)[0].sum(), argnums=(0, 1, 2)),
                         [q, k, v], nested=False, rtol=1e-4, atol=1e-5)


def test_per_sample_gradients_of_an_attention_block_vs_torch_func():
    d = 8
    params = {n: torch.randn(d, d, generator=g) / d ** 0.5 for n in ("q", "k", "v", "o")}

    def loss(p, x, y):
        h = x.unflatten(-1, (2, 4)).transpose(0, 1)          # [heads, tokens, 4]
        q, k, v = (x @ p[n] for n in "qkv")
        q, k, v = (t.unflatten(-1, (2, 4)).transpose(0, 1) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True) + h
        return F.mse_loss(a.transpose(0, 1).flatten(-2) @ p["o"], y)

    xs, ys = torch.randn(3, 5, d, generator=g), torch.randn(3, 5, d, generator=g)
    with ft.config.strict_fallback():
        ours = ft.vmap(ft.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    ref = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    assert_same(ours, ref, rtol=1e-5, atol=1e-5)
