"""Attention rules vs the loop oracle (every in_dims choice, vmap∘vmap, strict):
F.scaled_dot_product_attention (math path: _safe_softmax), the fused CPU flash kernel and its
backward called directly, dropout refused under randomness='error', per-sample gradients of
a tiny attention block vs torch.func, and the fused CUDA kernels (efficient, flash, their
backwards) through CPU reference kernels registered for the duration of each test."""
import pytest
import torch
import torch.nn.functional as F

import functrans as ft
from functrans.errors import UnsupportedUnderVmap
from tests.support.oracles import (assert_same, check_vmap, check_vmap_all_bdims, loop_oracle,
                                   make_batch)

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


@pytest.fixture
def no_decomposition(monkeypatch):
    """Any op that reaches a torch._decomp decomposition fails the test (the rule must run)."""
    from functrans.batching import dispatch

    def refuse(op, args, kwargs):
        raise AssertionError(f"{op} ran its decomposition: its rule was bypassed or declined")
    monkeypatch.setattr(dispatch.decompositions, "run_decomposition", refuse)


@pytest.mark.parametrize("mask_shape", [(5, 6), (1, 1, 5, 6), (1, 2, 5, 6), (2, 2, 5, 6)],
                         ids=lambda s: "x".join(map(str, s)))   # (the kernel takes 2-D or 4-D)
def test_flash_attention_cpu_kernel_with_a_batched_mask(mask_shape, no_decomposition):
    """A mask batched at the vmap level (T5's position bias in an ensemble, a padding mask per
    example) is folded like q/k/v; forward and backward kernels, every bdim choice."""
    n = mask_shape[0] if len(mask_shape) == 4 else 1
    q, k, v = (t.expand(n, 2, *t.shape[2:]).clone() for t in (FQ, FK, FV))
    mask = torch.randn(mask_shape, generator=g)
    fused = lambda a, b, c, m: aten._scaled_dot_product_flash_attention_for_cpu(
        a.contiguous(), b.contiguous(), c.contiguous(), 0.0, False, attn_mask=m.contiguous(),
        scale=0.4)
    for in_dims in [(None, None, None, 0), (0, 0, 0, 0), (0, None, None, -1), (None, -1, 0, 0),
                    (-1, -1, -1, -1)]:
        check_vmap(fused, [q, k, v, mask], in_dims)
    inner = lambda *a: ft.vmap(fused, in_dims=(0, None, None, 0))(*a)   # vmap∘vmap
    check_vmap(inner, [make_batch(q, 0, 2), k, v, make_batch(mask, 0, 2)], (0, None, None, -1))
    out, lse = fused(q, k, v, mask)
    gout = torch.randn(out.shape, generator=g)
    backward = lambda gr, a, b, c, o, l, m: \
        aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(t.contiguous() for t in (gr, a, b, c, o, l)), 0.0, False,
            attn_mask=m.contiguous(), scale=0.4)
    for in_dims in [(None,) * 6 + (0,), (0, 0, 0, 0, 0, 0, -1), (0, None, -1, 0, 0, 0, 0)]:
        check_vmap(backward, [gout, q, k, v, out, lse, mask], in_dims, rtol=1e-4, atol=1e-5)


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


# ------------------------------------------------------------------ fused CUDA kernels, on CPU
# _scaled_dot_product_efficient_attention / _scaled_dot_product_flash_attention (and their
# backwards) have no CPU kernel.  The fixture below registers a CPU reference of each for the
# duration of a test (torch.library, removed afterwards): plain-op attention with the real
# kernels' output shapes and layouts (torch/_meta_registrations.py, aten/src/ATen/native/
# transformers/cuda): outputs [N, L, H, E] memory viewed as [N, H, L, E]; the efficient kernel's
# log_sumexp padded to a multiple of 32 columns (0 columns without compute_log_sumexp), its
# gradients permuted likewise, its bias gradient with padded storage; scalar philox seed/offset.
# The references also assert what the kernels require (4-D [N, H, L, S] bias with 16-byte
# aligned strides, unit-stride last dims), so a rule that passed anything else fails here.

def _scores(q, k, bias, is_causal, scale):
    s = scale if scale is not None else q.shape[-1] ** -0.5
    att = (q @ k.transpose(-2, -1)) * s
    if bias is not None:
        att = att + bias
    if is_causal:
        L, S = att.shape[-2:]
        att = att.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
    return att, s


def _kernel_layout(t):   # [N, H, L, E] values in [N, L, H, E] memory, as the kernels write them
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _check_inputs(*ts, bias=None):
    assert all(t.dim() == 4 and t.stride(-1) == 1 for t in ts), [t.shape for t in ts]
    if bias is not None:
        q, k = ts[-3], ts[-2]
        assert tuple(bias.shape) == (*q.shape[:3], k.shape[2]), (bias.shape, q.shape)
        align = 16 // bias.element_size()
        assert bias.stride(-1) == 1 and all(s % align == 0 for s in bias.stride()[:-1]), \
            bias.stride()


def _math_backward(grad, q, k, v, bias, is_causal, scale):
    att, s = _scores(q, k, bias, is_causal, scale)
    p = torch.softmax(att, -1)
    dv = p.transpose(-2, -1) @ grad
    dp = grad @ v.transpose(-2, -1)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    return ds @ k * s, ds.transpose(-2, -1) @ q * s, dv, ds


CALLS = {"efficient": 0, "efficient_backward": 0}


def efficient_ref(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *,
                  scale=None):
    CALLS["efficient"] += 1
    assert dropout_p == 0.0
    _check_inputs(q, k, v, bias=attn_bias)
    att, _ = _scores(q, k, attn_bias, is_causal, scale)
    out = _kernel_layout(torch.softmax(att, -1) @ v)
    N, H, L = att.shape[:3]
    lse = torch.zeros(N, H, -(-L // 32) * 32 if compute_log_sumexp else 0)
    if compute_log_sumexp:
        lse[..., :L] = att.logsumexp(-1)
    return out, lse, torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)


def efficient_backward_ref(grad, q, k, v, attn_bias, out, lse, seed, offset, dropout_p,
                           grad_input_mask, is_causal=False, *, scale=None):
    CALLS["efficient_backward"] += 1
    assert dropout_p == 0.0 and seed.dim() == 0 and offset.dim() == 0
    _check_inputs(grad, out, q, k, v, bias=attn_bias)
    L = q.shape[2]
    assert lse.shape == (*q.shape[:2], -(-L // 32) * 32), lse.shape
    gq, gk, gv, gb = _math_backward(grad, q, k, v, attn_bias, is_causal, scale)
    if attn_bias is not None and grad_input_mask[3]:
        S = gb.shape[-1]
        padded = gb.new_zeros(*gb.shape[:-1], -(-S // 16) * 16)[..., :S]
        gb = padded.copy_(gb)
    else:
        gb = None
    return _kernel_layout(gq), _kernel_layout(gk), _kernel_layout(gv), gb


def flash_ref(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    assert dropout_p == 0.0 and not return_debug_mask
    _check_inputs(q, k, v)
    att, _ = _scores(q, k, None, is_causal, scale)
    out = _kernel_layout(torch.softmax(att, -1) @ v)
    return (out, att.logsumexp(-1).float(), None, None, q.shape[2], k.shape[2],
            torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64),
            torch.empty(0, dtype=q.dtype))


def flash_backward_ref(grad, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                       is_causal, philox_seed, philox_offset, *, scale=None):
    assert dropout_p == 0.0 and cum_seq_q is None and cum_seq_k is None
    assert (max_q, max_k) == (q.shape[2], k.shape[2]) and lse.shape == q.shape[:3]
    _check_inputs(grad, out, q, k, v)
    gq, gk, gv, _ = _math_backward(grad, q, k, v, None, is_causal, scale)
    return gq, gk, gv


@pytest.fixture
def cuda_kernels_on_cpu():
    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("_scaled_dot_product_efficient_attention", efficient_ref, "CPU")
        lib.impl("_scaled_dot_product_efficient_attention_backward", efficient_backward_ref,
                 "CPU")
        lib.impl("_scaled_dot_product_flash_attention", flash_ref, "CPU")
        lib.impl("_scaled_dot_product_flash_attention_backward", flash_backward_ref, "CPU")
        yield
    finally:
        lib._destroy()
    with pytest.raises(NotImplementedError):   # gone again: no other test sees them
        _EFF(FQ, FQ, FQ, None, False)


_EFF = aten._scaled_dot_product_efficient_attention
_EFF_BW = aten._scaled_dot_product_efficient_attention_backward
_FLASH = aten._scaled_dot_product_flash_attention
_FLASH_BW = aten._scaled_dot_product_flash_attention_backward


def _contiguous_tensors(op, n):
    """``op`` with its first ``n`` arguments made contiguous, as sdpa hands them to the kernels
    (the loop oracle's slices of a batch stacked last have a strided last dim, which the kernels
    refuse).  Under vmap this is logical contiguity: the rules still see any physical layout."""
    def call(*args, **kwargs):
        return op(*(a.contiguous() for a in args[:n]), *args[n:], **kwargs)
    return call


EFF = _contiguous_tensors(_EFF, 3)
EFF_BW = _contiguous_tensors(_EFF_BW, 4)
FLASH = _contiguous_tensors(_FLASH, 3)
FLASH_BW = _contiguous_tensors(_FLASH_BW, 5)

# [N=2, H=2, L=5, E=8] queries, S=6 keys: N > 1 so that folding a shared tensor copies
EQ, EK, EV = (torch.randn(2, 2, 5, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g),
              torch.randn(2, 2, 6, 8, generator=g))
EBIAS = torch.randn(2, 2, 5, 6, generator=g)


def _aligned(b):
    """What sdpa does to a mask before the efficient kernel (pad_bias): padded storage."""
    return F.pad(b, (0, 10))[..., :b.shape[-1]]


def _sdpa_like_bias(b):
    """A shared mask as sdpa passes it: an expanded view of one padded [L, S] mask."""
    return _aligned(b[:1, :1]).expand(b.shape)


def test_reference_kernels_match_autograd_of_the_math_form(cuda_kernels_on_cpu):
    q, k, v, b = (t.clone().requires_grad_() for t in (EQ, EK, EV, EBIAS))
    out = EFF(q, k, v, _aligned(b), True, 0.0, True, scale=0.3)[0]
    gout = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, (q, k, v, b), gout)
    math = lambda q, k, v, b: torch.softmax(_scores(q, k, b, True, 0.3)[0], -1) @ v
    assert_same(out, math(q, k, v, b))
    assert_same(got, torch.autograd.grad(math(q, k, v, b), (q, k, v, b), gout))
    out = FLASH(q, k, v, 0.0, True, scale=0.3)[0]
    assert_same(torch.autograd.grad(out, (q, k, v), gout),
                torch.autograd.grad(math(q, k, v, None), (q, k, v), gout), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lse", [True, False])
def test_efficient_attention_without_bias(cuda_kernels_on_cpu, causal, lse):
    f = lambda q, k, v: EFF(q, k, v, None, lse, 0.0, causal, scale=0.4)
    check_vmap_all_bdims(f, [EQ, EK, EV])


BIAS_DIMS = [(0, 0, 0, 0), (None, None, None, 0), (0, None, -1, None), (-1, 0, 0, -1),
             (0, 0, 0, None), (None, 0, None, 2)]


@pytest.mark.parametrize("causal", [False, True])
def test_efficient_attention_with_bias(cuda_kernels_on_cpu, causal):
    f = lambda q, k, v, b: EFF(q, k, v, _aligned(b), True, 0.0, causal)
    for in_dims in BIAS_DIMS:
        check_vmap(f, [EQ, EK, EV, EBIAS], in_dims)
    # a shared mask as sdpa passes it (an expanded view of one padded mask)
    shared = _sdpa_like_bias(EBIAS)
    check_vmap(lambda q, k, v: EFF(q, k, v, shared, True, 0.0, causal), [EQ, EK, EV],
               (0, None, -1))
    # a bias the kernel refuses per example (not [N, H, L, S]): declined, the loop is in charge
    _assert_declined(lambda q, b: EFF(q, EK, EV, b, True), EQ, EBIAS[:1])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_efficient_attention_backward_called_directly(cuda_kernels_on_cpu, causal, with_bias):
    bias = _aligned(EBIAS) if with_bias else None
    out, lse, seed, offset = EFF(EQ, EK, EV, bias, True, 0.0, causal)
    gout = torch.randn(out.shape, generator=g)
    for mask in ([True] * 4, [True, True, True, False]):
        bw = lambda gr, q, k, v, b, o, l: _tensors(EFF_BW(
            gr, q, k, v, None if b is None else _aligned(b), o.contiguous(), l, seed, offset,
            0.0, mask, causal, scale=0.5))
        for in_dims in [(0, 0, 0, 0, 0, 0, 0), (0, None, None, None, None, None, None),
                        (None, -1, 0, None, -1, 0, 0), (-1, 0, 0, 0, None, None, None),
                        (None, None, None, None, 0, None, None)]:
            if not with_bias and in_dims[4] is not None:
                continue
            check_vmap(bw, [gout, EQ, EK, EV, EBIAS if with_bias else None, out, lse],
                       in_dims, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_efficient_attention_vmap_of_grad_and_grad_of_vmap(cuda_kernels_on_cpu, causal):
    def loss(q, k, v, b):
        return (EFF(q, k, v, None if b is None else _aligned(b), True, 0.0, causal)[0] ** 2).sum()

    per_example = ft.grad(loss, argnums=(0, 1, 2, 3))
    for in_dims in BIAS_DIMS:   # a shared bias gets a gradient per example
        check_vmap(per_example, [EQ, EK, EV, EBIAS], in_dims, rtol=1e-4, atol=1e-5)
    no_bias = ft.grad(lambda q, k, v: loss(q, k, v, None), argnums=(0, 1, 2))
    check_vmap_all_bdims(no_bias, [EQ, EK, EV], nested=False, rtol=1e-4, atol=1e-5)
    # vmap(vmap(grad)): the rules under a second level
    inner = ft.vmap(per_example, in_dims=(0, None, 0, None))
    qs, vs = make_batch(EQ, 0, 2), make_batch(EV, 0, 2)
    check_vmap(inner, [qs, EK, vs, EBIAS], (1, 0, None, 0), rtol=1e-4, atol=1e-5)
    # grad of vmap: the forward rule's physical ops are differentiated (a shared bias's
    # gradient is the sum over the batch)
    for in_dims in [(0, None, 0, None), (0, 0, 0, 0), (None, -1, None, 0)]:
        args = [a if d is None else make_batch(a, d, 3) for a, d in
                zip([EQ, EK, EV, EBIAS], in_dims)]
        total = lambda *a: ft.vmap(loss, in_dims=in_dims)(*a).sum()
        with ft.config.strict_fallback():
            got = ft.grad(total, argnums=(0, 1, 2, 3))(*args)
        leaves = [a.detach().requires_grad_() for a in args]
        expected = torch.autograd.grad(loop_oracle(loss, in_dims, 3, *leaves).sum(), leaves)
        assert_same(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_kernel_and_backward(cuda_kernels_on_cpu, causal):
    def f(q, k, v):
        outs = FLASH(q, k, v, 0.0, causal, scale=0.4)
        assert outs[2] is None and outs[3] is None and outs[4:6] == (5, 6)
        return _tensors(outs)

    check_vmap_all_bdims(f, [EQ, EK, EV])
    out, lse, cq, ck, mq, mk, rng, unused, _ = FLASH(EQ, EK, EV, 0.0, causal, scale=0.4)
    gout = torch.randn(out.shape, generator=g)
    bw = lambda *a: FLASH_BW(*a, cq, ck, mq, mk, 0.0, causal, rng, unused, scale=0.4)
    for in_dims in [(0, 0, 0, 0, 0, 0), (0, None, None, None, None, None),
                    (None, -1, 0, None, -1, 0), (-1, 0, 0, 0, None, None)]:
        check_vmap(bw, [gout, EQ, EK, EV, out, lse], in_dims, rtol=1e-4, atol=1e-5)
    check_vmap_all_bdims(ft.grad(lambda q, k, v: (f(q, k, v)[0] ** 2).sum(), argnums=(0, 1, 2)),
                         [EQ, EK, EV], nested=False, rtol=1e-4, atol=1e-5)


def _tensors(outs):
    """The tensor outputs (vmap returns tensors only: None outputs and ints left out); a rule
    that returned a tensor where eager returns None changes the structure."""
    return tuple(o for o in outs if isinstance(o, torch.Tensor))


def _assert_declined(f, *examples):
    """Strict vmap of ``f`` over batches of ``examples`` says that the rule declined."""
    with pytest.raises(UnsupportedUnderVmap, match="declined"), ft.config.strict_fallback():
        ft.vmap(f)(*(make_batch(e, 0, 3) for e in examples))


def test_cuda_kernel_rules_decline(cuda_kernels_on_cpu):
    _assert_declined(lambda q: EFF(q, q, q, None, True), EQ[0])     # rank 3
    _assert_declined(lambda q: FLASH(q, q, q), EQ[0])
    _assert_declined(lambda q: FLASH(q, q, q, return_debug_mask=True), EQ)
    # dropout: the random-op check speaks first (each example would need its own draw)
    for f in [lambda q: EFF(q, q, q, None, True, 0.5), lambda q: FLASH(q, q, q, 0.5)]:
        with pytest.raises(UnsupportedUnderVmap, match="random"):
            ft.vmap(f)(make_batch(EQ, 0, 3))
        with pytest.raises(UnsupportedUnderVmap, match="declined"), \
                ft.config.strict_fallback():
            ft.vmap(f, randomness="different")(make_batch(EQ, 0, 3))
    # batched philox seeds in the backward: declined
    out, lse, seed, offset = EFF(EQ, EK, EV, None, True)
    _assert_declined(lambda s: EFF_BW(out, EQ, EK, EV, None, out.contiguous(), lse, s, offset,
                                      0.0, [True] * 4, False), seed)


def _sdpa_as_on_cuda(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
    """F.scaled_dot_product_attention's memory-efficient branch (float32 on CUDA), as
    aten/src/ATen/native/transformers/attention.cpp takes it: a boolean mask made additive,
    padded storage (pad_bias), expanded to [N, H, L, S]; log_sumexp when autograd needs it."""
    assert not enable_gqa
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype).masked_fill(
                ~attn_mask, float("-inf"))
        attn_mask = _aligned(attn_mask).expand(*q.shape[:3], k.shape[2])
    lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return _EFF(q, k, v, attn_mask, lse, dropout_p, is_causal, scale=scale)[0]


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("mode", ["eval", "train_no_dropout", "eval_norm_first"])
def test_transformer_encoder_layer_per_sample_grads_through_the_efficient_kernel(
        cuda_kernels_on_cpu, monkeypatch, batch_first, mode):
    """tests/models/test_per_sample_grads.py::test_transformer_encoder_layer[cuda-*] on CPU:
    sdpa replaced by its CUDA float32 branch, so the layer reaches the efficient kernel and its
    backward (strict: the rules run)."""
    from torch.func import functional_call
    monkeypatch.setattr(F, "scaled_dot_product_attention", _sdpa_as_on_cuda)
    torch.manual_seed(5)
    layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0,
                                             batch_first=batch_first,
                                             norm_first=mode == "eval_norm_first")
    layer.train(mode == "train_no_dropout")
    params = {n: p.detach() for n, p in layer.named_parameters()}
    seq_dim = 1 if batch_first else 0

    def loss(params, x, y):
        out = functional_call(layer, params, (x.unsqueeze(1 - seq_dim),))
        return ((out.squeeze(1 - seq_dim) - y) ** 2).mean()

    xs, ys = torch.randn(3, 5, 8, generator=g), torch.randn(3, 5, 8, generator=g)
    before = dict(CALLS)
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    assert all(CALLS[k] == before[k] + 1 for k in CALLS)   # one folded call each
    expected = {n: [] for n in params}
    for x, y in zip(xs, ys):
        p = {n: t.clone().requires_grad_() for n, t in params.items()}
        for n, gr in zip(p, torch.autograd.grad(loss(p, x, y), list(p.values()))):
            expected[n].append(gr)
    assert_same(got, {n: torch.stack(v) for n, v in expected.items()}, rtol=1e-4, atol=1e-5)


def test_a_mask_that_requires_grad_under_vmap_with_grad_outside(no_decomposition):
    """Note [a mask that requires grad]: grad outside vmap differentiates the physical values;
    the mask's gradient (eager sdpa takes its math path for it) per example, and summed."""
    q = make_batch(FQ, 0, 3)
    masks = torch.randn(3, 5, 5, generator=g)
    shared = torch.randn(5, 5, generator=g)

    def f(q, m):
        return (F.scaled_dot_product_attention(q, q, q, attn_mask=m) ** 2).sum()
    for mask, in_dims in [(masks, (0, 0)), (shared, (0, None))]:
        got = ft.grad(lambda q, m: ft.vmap(f, in_dims=in_dims)(q, m).sum(), argnums=(0, 1))(
            q, mask)
        qq, mm = q.detach().requires_grad_(), mask.detach().requires_grad_()
        loop = sum(f(qq[i], mm[i] if in_dims[1] == 0 else mm) for i in range(3))
        assert_same(got, torch.autograd.grad(loop, (qq, mm)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["float", "causal", "gqa"])   # (the kernel takes no bool mask)
def test_math_with_lse_gives_the_cpu_kernels_outputs(case):
    from functrans.batching.rules.attention import _math_with_lse
    q, k, v = (torch.randn(2, 2, 5, 4, generator=g), torch.randn(2, 2, 6, 4, generator=g),
               torch.randn(2, 2, 6, 4, generator=g))
    mask, causal = None, case == "causal"
    if case == "float":
        mask = torch.randn(2, 1, 5, 6, generator=g)
    elif case == "gqa":
        k, v = k[:, :1], v[:, :1]
    fused = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                             attn_mask=mask, scale=0.4)
    assert_same(_math_with_lse(q, k, v, 0.0, causal, attn_mask=mask, scale=0.4), fused,
                rtol=1e-5, atol=1e-6)
