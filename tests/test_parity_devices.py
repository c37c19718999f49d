"""Issue 13's parity fixes on every device (CPU always; CUDA when a GPU is present, skipped
cleanly otherwise), each against torch.func or a for-loop on the same inputs.

The CPU-only regression tests of each fix live beside the code they test (tests/autodiff/
test_parity_autodiff.py, tests/batching/test_parity_vmap.py, tests/batching/rules/test_losses_parity.py,
tests/batching/test_data_dependent_parity.py, tests/autodiff/test_custom_function_vmap.py, ...);
this file runs one representative of each on the device, where kernels, dtypes of index tensors
and the autograd engine's device paths differ.
"""
from __future__ import annotations

import torch
import torch.func as tf
import torch.nn.functional as F

import functrans as ft
from tests.autodiff.test_custom_function_vmap import NumpySin  # a vmap staticmethod


def _loop(f, *batches):
    return torch.stack([f(*xs) for xs in zip(*batches)])


def test_vmap_grad_under_anomaly_mode(device):
    x = torch.randn(4, 3, device=device)
    f = lambda a: (a.sin() ** 2).sum()  # noqa: E731
    with torch.autograd.set_detect_anomaly(True):
        torch.testing.assert_close(ft.vmap(ft.grad(f))(x), tf.vmap(tf.grad(f))(x))


def test_jvp_under_disabled_forward_grad(device):
    x = torch.randn(5, device=device)
    with torch.autograd.forward_ad._set_fwd_grad_enabled(False):
        _, t = ft.jvp(torch.sin, (x,), (torch.ones_like(x),))
    torch.testing.assert_close(t, x.cos())


def test_vmap_jvp_with_float64_tangents(device):
    x = torch.randn(3, 4, device=device)
    t = torch.randn(3, 4, device=device, dtype=torch.float64)
    got = ft.vmap(lambda a, b: ft.jvp(torch.tanh, (a,), (b,)))(x, t)
    ref = tf.vmap(lambda a, b: tf.jvp(torch.tanh, (a,), (b,)))(x, t)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype
        torch.testing.assert_close(g, r)


def test_autograd_function_vmap_staticmethod(device):
    x = torch.randn(4, 3, device=device)
    f = lambda a: NumpySin.apply(a).sum()  # noqa: E731
    torch.testing.assert_close(ft.vmap(NumpySin.apply)(x), tf.vmap(NumpySin.apply)(x))
    torch.testing.assert_close(ft.vmap(ft.grad(f))(x), tf.vmap(tf.grad(f))(x))


def test_same_shape_data_dependent_results_are_stacked(device):
    x = torch.tensor([[1., 0., 2.], [0., 3., 4.]], device=device)
    torch.testing.assert_close(ft.vmap(torch.nonzero)(x), _loop(torch.nonzero, x))
    torch.testing.assert_close(ft.vmap(lambda a: a[a > 0])(x), _loop(lambda a: a[a > 0], x))


def test_losses_and_refused_ops(device):
    x, t = torch.randn(3, 5, device=device), torch.randint(0, 5, (3, 1), device=device)
    f = lambda a, b: F.multi_margin_loss(a, b, reduction="none")  # noqa: E731
    assert ft.vmap(f)(x, t).shape == (3, 1)
    torch.testing.assert_close(ft.vmap(f)(x, t), _loop(f, x, t))
    v = torch.rand(3, 5, device=device) + 0.5
    g = F.gaussian_nll_loss
    torch.testing.assert_close(ft.vmap(g)(x, x.flip(0), v), _loop(g, x, x.flip(0), v))
    starts = torch.tensor([0, 2, 1], device=device)
    n = lambda a, s: torch.narrow(a, 0, s, 2)  # noqa: E731
    torch.testing.assert_close(ft.vmap(n)(x, starts), _loop(n, x, starts))
    c = lambda a: torch.cov(a.view(1, 5))  # noqa: E731
    torch.testing.assert_close(ft.vmap(c)(x), _loop(c, x))


def test_vmap_surface(device):
    x = torch.randn(3, 4, device=device)
    torch.testing.assert_close(ft.vmap(torch.sin, out_dims=(1,))(x), x.sin().T)
    out = ft.vmap(lambda a: a.view(2, 2))(x)
    assert out._base is x
    assert type(ft.vmap(lambda a: ft.debug_unwrap(a) * 1)(x)) is torch.Tensor


def test_functionalize_under_vmap(device):
    def f(a):
        b = a.clone()
        b.view(-1)[0].add_(1.0)
        return b * 2

    x = torch.randn(3, 4, device=device)
    torch.testing.assert_close(ft.vmap(ft.functionalize(f))(x),
                               tf.vmap(tf.functionalize(f))(x))
