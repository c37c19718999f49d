"""Forward mode and second order through ``F.scaled_dot_product_attention``
(``functrans/autodiff/math_attention.py``).

On CPU sdpa runs the fused ``_scaled_dot_product_flash_attention_for_cpu``, which has no
forward formula (its backward no derivative): jvp / jacfwd / hessian fail in plain PyTorch and
in torch.func.  functrans runs the math composition in forward mode and at graph order >= 2.
References: central finite differences in float64, and first-order reverse mode (``jacrev``,
which keeps the fused kernel and its own backward: an independent computation).
"""
import pytest
import torch
import torch.nn.functional as F

import functrans as ft
from functrans.autodiff import exact_norms
from functrans.autodiff.math_attention import scaled_dot_product_attention as math_sdpa

D = torch.float64


def _qkv(L=3, S=4, E=4, H=2, Hkv=None, batch=(2,), dtype=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, H, L, E, generator=g, dtype=dtype)
    k = torch.randn(*batch, Hkv or H, S, E, generator=g, dtype=dtype)
    v = torch.randn(*batch, Hkv or H, S, E, generator=g, dtype=dtype)
    return q, k, v


def _bool_mask(L=3, S=4, seed=1):
    m = torch.rand(L, S, generator=torch.Generator().manual_seed(seed)) > 0.4
    m[:, 0] = True   # no fully masked row (finite differences of a constant row are 0 anyway)
    return m


OPTIONS = {
    "plain": {},
    "causal": {"is_causal": True},
    "scale": {"scale": 0.37},
    "bool_mask": {"attn_mask": _bool_mask()},
    "float_mask": {"attn_mask": torch.randn(2, 1, 3, 4, dtype=D)},
    "gqa": {"enable_gqa": True},
}


def _inputs(name):
    return _qkv(Hkv=1 if name == "gqa" else None)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_math_composition_gives_sdpa_values(name):
    for dtype in (torch.float32, D):
        q, k, v = (t.to(dtype) for t in _inputs(name))
        kw = {k_: (v_.to(dtype) if isinstance(v_, torch.Tensor) and v_.is_floating_point()
                   else v_) for k_, v_ in OPTIONS[name].items()}
        torch.testing.assert_close(math_sdpa(q, k, v, **kw),
                                   F.scaled_dot_product_attention(q, k, v, **kw))


def test_fully_masked_row_and_mask_with_causal_as_sdpa():
    q, k, v = _qkv()
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[1] = False                              # sdpa gives zeros for a fully masked row
    torch.testing.assert_close(math_sdpa(q, k, v, mask),
                               F.scaled_dot_product_attention(q, k, v, mask))
    with pytest.raises(RuntimeError, match="is_causal"):
        math_sdpa(q, k, v, mask, is_causal=True)


def _fd_jvp(f, primals, tangents, h=1e-6):
    plus = f(*[p + h * t for p, t in zip(primals, tangents)])
    minus = f(*[p - h * t for p, t in zip(primals, tangents)])
    return (plus - minus) / (2 * h)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_jvp_matches_finite_differences(name):
    q, k, v = _inputs(name)
    kw = dict(OPTIONS[name])
    mask = kw.pop("attn_mask", None)
    float_mask = mask is not None and mask.is_floating_point()

    if float_mask:   # the additive mask is differentiated too
        def f(q, k, v, m):
            return F.scaled_dot_product_attention(q, k, v, m, **kw)
        primals = (q, k, v, mask)
    else:
        def f(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, mask, **kw)
        primals = (q, k, v)
    g = torch.Generator().manual_seed(5)
    tangents = tuple(torch.randn(p.shape, generator=g, dtype=D) for p in primals)
    out, tan = ft.jvp(f, primals, tangents)
    torch.testing.assert_close(out, f(*primals))
    torch.testing.assert_close(tan, _fd_jvp(f, primals, tangents), atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("name", ["plain", "causal", "bool_mask", "gqa"])
def test_jacfwd_matches_jacrev_and_finite_differences(name):
    q, k, v = (t[:1] for t in _inputs(name))
    kw = OPTIONS[name]

    def f(q):
        return F.scaled_dot_product_attention(q, k, v, **kw)
    fwd = ft.jacfwd(f)(q)
    torch.testing.assert_close(fwd, ft.jacrev(f)(q))
    e = torch.zeros_like(q)
    e.view(-1)[3] = 1.0
    torch.testing.assert_close(fwd.reshape(*f(q).shape, -1)[..., 3], _fd_jvp(f, (q,), (e,)),
                               atol=1e-7, rtol=1e-6)


def test_vmap_of_jvp_per_example_with_a_batched_mask():
    q, k, v = _qkv(batch=(3,))
    masks = torch.stack([_bool_mask(seed=s) for s in range(3)])
    t = torch.randn(q.shape, generator=torch.Generator().manual_seed(2), dtype=D)

    def f(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, m)
    got = ft.vmap(lambda q, k, v, m, t: ft.jvp(lambda q: f(q, k, v, m), (q,), (t,)))(
        q, k, v, masks, t)
    for i in range(3):
        one = lambda q_: f(q_, k[i], v[i], masks[i])   # noqa: E731
        torch.testing.assert_close(got[0][i], one(q[i]))
        torch.testing.assert_close(got[1][i], _fd_jvp(one, (q[i],), (t[i],)),
                                   atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("name", ["plain", "causal", "float_mask"])
def test_hessian_matches_finite_differences_of_the_gradient(name):
    q, k, v = (t[:1, :1, :2, :2] for t in _qkv())
    kw = dict(OPTIONS[name])
    if "attn_mask" in kw:
        kw["attn_mask"] = kw["attn_mask"][:1, :1, :2, :2]

    def g(q):
        return (F.scaled_dot_product_attention(q, k, v, **kw) ** 2 * torch.arange(
            1., 5., dtype=D).reshape(2, 2)).sum()
    H = ft.hessian(g)(q).reshape(q.numel(), q.numel())
    h = 1e-6
    cols = []
    for i in range(q.numel()):
        e = torch.zeros_like(q)
        e.view(-1)[i] = h
        cols.append(((ft.grad(g)(q + e) - ft.grad(g)(q - e)) / (2 * h)).reshape(-1))
    torch.testing.assert_close(H, torch.stack(cols, 1), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(H, ft.jacrev(ft.jacrev(g))(q).reshape(H.shape))


def test_first_order_reverse_keeps_the_fused_kernel():
    seen = []
    real = exact_norms._ATTENTION[F.scaled_dot_product_attention]

    def spy(*a, **k):
        seen.append(exact_norms.graph_order())
        return real(*a, **k)
    exact_norms._ATTENTION[F.scaled_dot_product_attention] = spy
    q, k, v = _qkv()

    def f(q):
        return F.scaled_dot_product_attention(q, k, v)
    try:
        ft.grad(lambda q: f(q).sum())(q)
        ft.vmap(ft.grad(lambda q: f(q).sum()))(q)
        ft.jacrev(f)(q[0])
        assert seen == []
        ft.jvp(f, (q,), (q,))
        assert len(seen) == 1
        ft.jacrev(ft.jacrev(lambda q: f(q).sum()))(q)
        assert len(seen) == 2 and seen[-1] >= 2
    finally:
        exact_norms._ATTENTION[F.scaled_dot_product_attention] = real
