"""A transform outside a vmap differentiates through the backward of a transform inside it.

Ops like exp, tanh, sigmoid and softmax save their OUTPUT for backward; autograd stores it with
its own ``detach``, which must cut only the inner transform's graph on the wrappers, not the
physical value's place in the outer graph (Note [detach by the autograd engine] in
``functrans/batching/rules/autograd_ops.py``).  Before that, ``grad(vmap(grad(exp)))`` was zero:
the fuzzer found it.  A user's ``detach()`` / ``.data`` still cut every level.  Each result is
checked against torch.func and, for the core cases, a plain-autograd loop.
"""
import pytest
import torch
import torch.func as tf
import torch.nn.functional as F

import functrans as ft
from functrans.errors import UnsupportedUnderVmap

D = torch.float64
W3 = torch.tensor([0.5, -1.0, 2.0], dtype=D)

# Functions whose backward uses the saved output (and two that use the input, for contrast).
SCALAR_FNS = {
    "exp": lambda a: a.exp().sum(),
    "tanh": lambda a: (torch.tanh(a) * W3).sum(),
    "sigmoid": lambda a: (torch.sigmoid(a) * W3).sum(),
    "softmax": lambda a: (F.softmax(a, -1) * W3).sum(),
    "log_softmax": lambda a: (F.log_softmax(a, -1) * W3).sum(),
    "rsqrt": lambda a: (a * a + 1).rsqrt().sum(),
    "sqrt": lambda a: (a * a + 1).sqrt().sum(),
    "elu": lambda a: (F.elu(a) * W3).sum(),
    "exp_then_tanh": lambda a: torch.tanh(a.exp()).sum(),
    "sin": lambda a: a.sin().sum(),
    "mul": lambda a: (a * a * W3).sum(),
}


def _x(*shape, seed=0):
    return torch.randn(*shape, dtype=D, generator=torch.Generator().manual_seed(seed))


def _loop_grad_of_vmap_of_grad(f, x):
    """d/dx sum_i grad(f)(x_i), with plain autograd per example."""
    out = []
    for xi in x:
        xi = xi.detach().requires_grad_()
        (g,) = torch.autograd.grad(f(xi), xi, create_graph=True)
        (h,) = torch.autograd.grad(g.sum(), xi)
        out.append(h)
    return torch.stack(out)


@pytest.mark.parametrize("name", sorted(SCALAR_FNS))
def test_grad_of_vmap_of_grad(name):
    f, x = SCALAR_FNS[name], _x(4, 3)
    outer = lambda M: M.grad(lambda x: M.vmap(M.grad(f))(x).sum())(x)
    actual = outer(ft)
    torch.testing.assert_close(actual, _loop_grad_of_vmap_of_grad(f, x))
    torch.testing.assert_close(actual, outer(tf))


@pytest.mark.parametrize("name", ["exp", "tanh", "softmax", "sin"])
@pytest.mark.parametrize("stack", ["jacrev(vmap(jacrev))", "vjp(vmap(vjp))", "jacrev(vmap(grad))",
                                   "jacrev(vmap(jacrev)) chunked", "grad(vmap(vmap(grad)))",
                                   "vmap(grad(vmap(grad)))"])
def test_reverse_over_vmap_over_reverse(name, stack):
    f, x = SCALAR_FNS[name], _x(2, 2, 3, seed=1)
    vec = lambda a: torch.stack([f(a), f(a * 2)])            # a vector output for jacrev/vjp

    def run(M):
        if stack == "jacrev(vmap(jacrev))":
            return M.jacrev(M.vmap(M.vmap(M.jacrev(vec))))(x)
        if stack == "vjp(vmap(vjp))":
            inner = lambda a: M.vjp(vec, a)[1](torch.ones(2, dtype=D))[0]
            return M.vjp(M.vmap(M.vmap(inner)), x)[1](torch.ones_like(x))[0]
        if stack == "jacrev(vmap(grad))":
            return M.jacrev(M.vmap(M.vmap(M.grad(f))))(x)
        if stack == "jacrev(vmap(jacrev)) chunked":
            return M.jacrev(M.vmap(M.vmap(M.jacrev(vec), chunk_size=1), chunk_size=1))(x)
        if stack == "grad(vmap(vmap(grad)))":
            return M.grad(lambda x: (M.vmap(M.vmap(M.grad(f)))(x) ** 2).sum())(x)
        if stack == "vmap(grad(vmap(grad)))":
            return M.vmap(M.grad(lambda x: (M.vmap(M.grad(f))(x) ** 2).sum()))(x)
        raise AssertionError(stack)
    torch.testing.assert_close(run(ft), run(tf))


def test_closed_over_parameter_through_saved_output():
    X = torch.tensor([[0.5, 1.0, -0.3], [1.0, 2.0, -0.6]], dtype=D)
    w0 = torch.tensor([0.3, -0.2, 0.1], dtype=D)
    outer = lambda M: M.grad(
        lambda w: M.vmap(M.grad(lambda x: (torch.exp(x * w) * x).sum()))(X).sum())(w0)
    torch.testing.assert_close(outer(ft), outer(tf))
    # the same through a plain .backward() of vmap(grad(...)) closing over a leaf
    w = w0.clone().requires_grad_()
    ft.vmap(ft.grad(lambda x: (torch.tanh(x * w) * x).sum()))(X).sum().backward()
    expected = tf.grad(lambda w: tf.vmap(tf.grad(
        lambda x: (torch.tanh(x * w) * x).sum()))(X).sum())(w0)
    torch.testing.assert_close(w.grad, expected)


def test_users_detach_and_data_still_cut_every_level():
    x = _x(2, 3, seed=3)
    for stop in (lambda a: a.detach(), lambda a: a.data):
        f = lambda M: M.grad(lambda x: M.vmap(lambda a: (stop(a).exp() * a).sum())(x).sum())(x)
        torch.testing.assert_close(f(ft), x.exp())           # d/dx (c * x) with c = exp(x)
        g = lambda M: M.grad(lambda x: M.vmap(M.grad(
            lambda a: (stop(a).exp() * a.sin()).sum()))(x).sum())(x)
        torch.testing.assert_close(g(ft), -x.exp() * x.sin())   # d/dx exp(c) cos(x), c fixed


def test_data_of_a_batched_tensor_is_detached_and_cannot_be_assigned():
    x = _x(2, 3, seed=4)
    out = ft.vmap(lambda a: a.data * 2)(x)
    torch.testing.assert_close(out, x * 2)

    def assign(a):
        a.data = a * 2
        return a
    with pytest.raises(UnsupportedUnderVmap, match=r"x\.data = .*copy_"):
        ft.vmap(assign)(x)
