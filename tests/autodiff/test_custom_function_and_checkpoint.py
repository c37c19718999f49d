"""Custom autograd.Functions and torch.utils.checkpoint inside grad, vjp, jvp and vmap."""
import pytest
import torch
import torch.func as tf
from torch.utils.checkpoint import checkpoint

import functrans as ft
from tests.support.oracles import assert_same



pytestmark = pytest.mark.usefixtures("float64")


class CubeSetupContext(torch.autograd.Function):
    """New-style Function (setup_context) with a hand-written vmap staticmethod and jvp."""

    @staticmethod
    def forward(x):
        return x ** 3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x ** 2 * g

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return 3 * x ** 2 * t

    @staticmethod
    def vmap(info, in_dims, x):
        return x ** 3, in_dims[0]


class SinGenerated(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x.sin()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos()


class OldStyleScale(torch.autograd.Function):
    """Old-style Function (forward takes ctx): runs under functrans (torch.func refuses it)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2 + x.exp()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (2 + x.exp())


def reference(f, x):
    return (lambda a: (a ** 3), lambda a: a.sin(), lambda a: a * 2 + a.exp())[f](x)


FUNCS = [CubeSetupContext.apply, SinGenerated.apply, OldStyleScale.apply]


@pytest.mark.parametrize("k", range(3))
def test_custom_function_inside_every_transform(k):
    fn, ref = FUNCS[k], lambda a: reference(k, a)
    x, X, t = torch.randn(4), torch.randn(5, 4), torch.randn(4)
    assert_same(ft.grad(lambda a: fn(a).sum())(x), tf.grad(lambda a: ref(a).sum())(x))
    assert_same(ft.vjp(fn, x)[1](t), tf.vjp(ref, x)[1](t))
    assert_same(ft.vmap(fn)(X), ref(X))
    assert_same(ft.vmap(ft.grad(lambda a: fn(a).sum()))(X), tf.vmap(tf.grad(lambda a: ref(a).sum()))(X))
    assert_same(ft.jacrev(fn)(x), tf.jacrev(ref)(x))
    if k == 0:  # has a jvp staticmethod
        assert_same(ft.jvp(fn, (x,), (t,)), tf.jvp(ref, (x,), (t,)))
        assert_same(ft.jacfwd(fn)(x), tf.jacfwd(ref)(x))


def test_checkpoint_inside_grad_and_vmap_grad():
    w = torch.randn(4, 4)

    def block(a):
        return torch.tanh(w @ a).sin()

    def loss(a):
        return checkpoint(block, a, use_reentrant=False).pow(2).sum()

    def loss_ref(a):
        return block(a).pow(2).sum()

    x, X = torch.randn(4), torch.randn(6, 4)
    assert_same(ft.grad(loss)(x), tf.grad(loss_ref)(x))
    assert_same(ft.vmap(ft.grad(loss))(X), tf.vmap(tf.grad(loss_ref))(X))
    with pytest.raises(Exception):  # torch.func refuses it; functrans supports it
        tf.grad(loss)(x)


def test_jvp_without_a_forward_formula_takes_the_double_vjp_route():
    # SinGenerated has no jvp staticmethod
    x, t = torch.randn(4), torch.randn(4)
    with pytest.raises(NotImplementedError):  # plain forward AD cannot do it
        import torch.autograd.forward_ad as fwAD
        with fwAD.dual_level():
            SinGenerated.apply(fwAD.make_dual(x, t))
    primal, tangent = ft.jvp(SinGenerated.apply, (x,), (t,))
    assert_same(primal, x.sin())
    assert_same(tangent, x.cos() * t)
    assert_same(ft.jacfwd(SinGenerated.apply)(x), torch.diag(x.cos()))
    assert_same(ft.hessian(lambda a: SinGenerated.apply(a).sum())(x), torch.diag(-x.sin()))
