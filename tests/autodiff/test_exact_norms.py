"""Higher-order derivatives through layer_norm / batch_norm / instance_norm.

PyTorch's fused kernels treat their saved mean and rstd as constants, so the weight gradient's
derivative w.r.t. the input, and anything that differentiates their graph three times
(jacfwd(jacfwd), jacrev(jacfwd), grad over jvp, third-order reverse), miss terms; torch.func
gets these wrong.  functrans swaps in primitive-op versions in nested transforms
(``functrans.autodiff.exact_norms``).  References: the input-input second derivative by
reverse-over-reverse (right in PyTorch), and finite differences.
"""
import pytest
import torch
import torch.nn.functional as F

import functrans as ft
from functrans.autodiff import exact_norms

D = torch.float64
G = torch.Generator().manual_seed(0)
X = torch.randn(2, 4, dtype=D, generator=G)
W = torch.randn(4, dtype=D, generator=G)
B = torch.randn(4, dtype=D, generator=G)

NORMS = {
    "layer_norm": lambda a: F.layer_norm(a, (4,)),
    "layer_norm_affine": lambda a: F.layer_norm(a, (4,), W, B),
    "layer_norm_2d": lambda a: F.layer_norm(a, (2, 4)),
    "batch_norm": lambda a: F.batch_norm(a, None, None, W, B, training=True),
    "instance_norm": lambda a: F.instance_norm(a.reshape(1, 2, 4)),
    "module": lambda a: torch.nn.LayerNorm(4).double()(a),
}


def _second(f, x):
    """The exact second derivative (reverse over reverse), flattened to (out, in, in)."""
    return ft.jacrev(ft.jacrev(f))(x)


@pytest.mark.parametrize("name", sorted(NORMS))
@pytest.mark.parametrize("stack", ["jacfwd(jacfwd)", "jacrev(jacfwd)", "jacfwd(jacrev)"])
def test_second_derivatives(name, stack):
    f = NORMS[name]
    outer, inner = stack[:-1].split("(")
    got = getattr(ft, outer)(getattr(ft, inner)(f))(X)
    torch.testing.assert_close(got, _second(f, X))


@pytest.mark.parametrize("name", ["layer_norm", "layer_norm_affine", "batch_norm"])
def test_third_derivative_against_finite_differences(name):
    f = lambda a: NORMS[name](a).pow(3).sum()
    h = 1e-5
    fd = torch.stack([(ft.hessian(f)(X + h * e) - ft.hessian(f)(X - h * e)) / (2 * h)
                      for e in torch.eye(8, dtype=D).reshape(8, 2, 4)]).reshape(2, 4, 2, 4, 2, 4)
    fd = fd.permute(2, 3, 4, 5, 0, 1)   # (d2 d3 d1): the last pair is the differentiated one
    for third in (ft.jacrev(ft.jacrev(ft.grad(f))), ft.jacfwd(ft.jacrev(ft.grad(f))),
                  ft.jacrev(ft.hessian(f))):
        torch.testing.assert_close(third(X), fd, atol=1e-5, rtol=1e-5)


def test_grad_of_jvp_of_layer_norm():
    f, t = NORMS["layer_norm_affine"], torch.randn(2, 4, dtype=D, generator=G)
    w = torch.randn(2, 4, dtype=D, generator=G)
    got = ft.grad(lambda a: (ft.jvp(f, (a,), (t,))[1] * w).sum())(X)
    # d/dx <w, J(x) t> = (d/dx J(x) t)^T w: the second derivative contracted twice
    expected = torch.einsum("ij,ijklmn,mn->kl", w, _second(f, X), t)
    torch.testing.assert_close(got, expected)


def test_mixed_weight_input_second_derivative():
    """d/dx of the Jacobian w.r.t. the weight: plain autograd and torch.func are off by O(1)."""
    wt = torch.randn(2, 4, 4, dtype=D, generator=G)

    def g(x, w):
        return (ft.jacrev(lambda w_: F.layer_norm(x, (4,), w_, B))(w) * wt).sum()
    got = ft.grad(g)(X, W)
    h = 1e-6
    fd = torch.stack([(g(X + h * e, W) - g(X - h * e, W)) / (2 * h)
                      for e in torch.eye(8, dtype=D).reshape(8, 2, 4)]).reshape(2, 4)
    torch.testing.assert_close(got, fd, atol=1e-6, rtol=1e-6)


def test_only_used_in_nested_transforms():
    seen = []
    real = exact_norms._EXACT[F.layer_norm]

    def spy(*a, **k):
        seen.append(exact_norms.graph_order())
        return real(*a, **k)
    exact_norms._EXACT[F.layer_norm] = spy
    try:
        f = NORMS["layer_norm"]
        ft.grad(lambda a: f(a).sum())(X)
        ft.vmap(ft.jacrev(f))(X)
        ft.vmap(ft.grad(lambda a: f(a).sum()))(X)
        assert seen == []                       # first order: the fused kernel
        ft.jacrev(ft.jacrev(f))(X)
        assert seen and min(seen) >= 2
    finally:
        exact_norms._EXACT[F.layer_norm] = real


def test_running_statistics_are_updated_as_by_the_fused_kernel():
    x = torch.randn(5, 3, 2, dtype=D, generator=G)
    rm1, rv1 = torch.zeros(3, dtype=D), torch.ones(3, dtype=D)
    rm2, rv2 = rm1.clone(), rv1.clone()
    out = exact_norms.batch_norm(x, rm1, rv1, training=True, momentum=0.3)
    expected = F.batch_norm(x, rm2, rv2, training=True, momentum=0.3)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close((rm1, rv1), (rm2, rv2))
    eval_out = exact_norms.batch_norm(x, rm1, rv1, training=False)
    torch.testing.assert_close(eval_out, F.batch_norm(x, rm2, rv2, training=False))
    y = torch.randn(2, 3, 4, dtype=D, generator=G)
    torch.testing.assert_close(exact_norms.instance_norm(y), F.instance_norm(y))
    torch.testing.assert_close(exact_norms.layer_norm(y, (4,), eps=1e-3),
                               F.layer_norm(y, (4,), eps=1e-3))
