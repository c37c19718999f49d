"""Forward-mode AD over batched values whose layouts differ between primal and tangent.

Forward AD checks that the tangent of every view of a dual tensor has its primal's layout
(strides, storage offset: ``has_same_meta``) and makes a tangent that does not match its primal
at ``make_dual`` with ``_new_zeros_with_same_feature_meta``.  Under vmap the primal is often a
BatchedTensor whose examples sit at a non-zero storage offset (a chunk, a slice) or whose batch
dim is not the first, while the tangent is a fresh basis block batched at another level.  These
tests run view ops, broadcasting and closed-over operands through jvp / jacfwd / hessian under
vmap, with batch dims in several places, and compare with torch.func and a plain loop.
"""
import subprocess
import sys

import pytest
import torch
import torch.func as tf

import functrans as ft

D = torch.float64


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _r(*shape, seed=0):
    return torch.randn(*shape, dtype=D, generator=_g(seed))


# Functions of one example whose bodies are mostly view ops (plus something non-linear, so
# Hessians are not all zero).  Each takes a tensor of shape (2, 3) per example.
VIEW_FUNCS = {
    "transpose": lambda a: a.t().sin(),
    "select": lambda a: a[1].exp() * a[0],
    "slice": lambda a: a[:, 1:].sin() * a[:, :2],
    "unsqueeze_expand": lambda a: a.unsqueeze(0).expand(4, 2, 3).sin() * 2,
    "view": lambda a: a.reshape(6).sin() * a[0].view(3, 1).expand(3, 2).flatten(),
    "diagonal": lambda a: a.diagonal().exp() + a.diagonal(1).sin(),
    "permute_unbind": lambda a: torch.stack(a.permute(1, 0).unbind(0)).sin(),
    "narrow_view_as": lambda a: a.narrow(1, 1, 2).view_as(a[:, :2]).cos() * a[:, :2],
    "as_real_chain": lambda a: a.movedim(0, 1).contiguous().view(6).sin(),
    "split": lambda a: sum(p.sin() * p for p in a.split(1, dim=1)),
}


def _loop_jacfwd(f, x, bdim):
    return torch.stack([tf.jacfwd(f)(xi) for xi in x.unbind(bdim)])


def _loop_hessian(f, x, bdim):
    return torch.stack([tf.hessian(lambda a: f(a).sum())(xi) for xi in x.unbind(bdim)])


@pytest.mark.parametrize("name", sorted(VIEW_FUNCS))
@pytest.mark.parametrize("bdim", [0, 1, 2])
def test_vmap_jacfwd_of_views(name, bdim):
    f = VIEW_FUNCS[name]
    shape = [2, 3]
    shape.insert(bdim, 3)
    x = _r(*shape, seed=bdim)
    actual = ft.vmap(ft.jacfwd(f), in_dims=bdim)(x)
    torch.testing.assert_close(actual, _loop_jacfwd(f, x, bdim))


@pytest.mark.parametrize("name", sorted(VIEW_FUNCS))
@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_vmap_hessian_of_views_in_dims_and_chunks(name, chunk_size):
    f = VIEW_FUNCS[name]
    x = _r(2, 3, 3, seed=3)        # batch of 3 along dim 2
    actual = ft.vmap(ft.hessian(lambda a: f(a).sum()), in_dims=2, chunk_size=chunk_size)(x)
    torch.testing.assert_close(actual, _loop_hessian(f, x, 2))


@pytest.mark.parametrize("name", sorted(VIEW_FUNCS))
def test_hessian_and_jacfwd_of_views_on_sliced_input(name):
    f = VIEW_FUNCS[name]
    base = _r(4, 5, seed=4)
    x = base[1:3, 2:]               # a view with a storage offset and a non-dense layout
    torch.testing.assert_close(ft.jacfwd(f)(x), tf.jacfwd(f)(x))
    g = lambda a: f(a).sum()  # noqa: E731
    torch.testing.assert_close(ft.hessian(g)(x), tf.hessian(g)(x))


@pytest.mark.parametrize("name", sorted(VIEW_FUNCS))
def test_vmap_jvp_of_views_with_tangents_batched_elsewhere(name):
    f = VIEW_FUNCS[name]
    x = _r(3, 2, 3, seed=5)
    t = _r(2, 3, 3, seed=6)         # tangents batched along their last dim
    p_out, t_out = ft.vmap(lambda a, b: ft.jvp(f, (a,), (b,)), in_dims=(0, 2))(x, t)
    loop = [tf.jvp(f, (x[i],), (t[..., i],)) for i in range(3)]
    torch.testing.assert_close(p_out, torch.stack([p for p, _ in loop]))
    torch.testing.assert_close(t_out, torch.stack([d for _, d in loop]))


@pytest.mark.parametrize("chunk_size", [None, 1])
@pytest.mark.parametrize("f", [torch.sin, lambda a: a * a.exp(), lambda a: a.unsqueeze(0).sin()],
                         ids=["sin", "mul_exp", "unsqueeze"])
def test_vmap_hessian_of_0d_examples(f, chunk_size):
    x = _r(3, seed=7)
    g = lambda a: f(a).sum()  # noqa: E731
    actual = ft.vmap(ft.hessian(g), chunk_size=chunk_size)(x)
    torch.testing.assert_close(actual, torch.stack([tf.hessian(g)(xi) for xi in x]))
    torch.testing.assert_close(ft.vmap(ft.jacfwd(f), chunk_size=chunk_size)(x),
                               tf.vmap(tf.jacfwd(f))(x))


@pytest.mark.parametrize("in_dims", [(0, 0), (2, 1), (1, None), (None, 2)])
def test_vmap_hessian_of_matmul(in_dims):
    x0 = _r(2, 2, 2, seed=8)
    x1 = _r(2, 2, 3, seed=9) if in_dims[1] is not None else _r(2, 3, seed=9)
    if in_dims[0] is None:
        x0 = _r(2, 2, seed=8)

    def f(a, b):
        return (a @ b).sin().sum()

    actual = ft.vmap(ft.hessian(f, argnums=(0, 1)), in_dims=in_dims)(x0, x1)
    expected = tf.vmap(tf.hessian(f, argnums=(0, 1)), in_dims=in_dims)(x0, x1)
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("op", ["addcmul", "addcdiv", "mul", "add", "where", "lerp"])
def test_jacfwd_with_broadcast_closed_over_operands(op):
    c = torch.tensor([0.5], dtype=D)
    c2 = _r(1, 1, seed=10).abs() + 0.5
    fs = {
        "addcmul": lambda a: torch.addcmul(c, c, a, value=0.5),
        "addcdiv": lambda a: torch.addcdiv(c, a, c2, value=0.5),
        "mul": lambda a: c * a * c2,
        "add": lambda a: torch.add(c, a, alpha=2.0) + c2,
        "where": lambda a: torch.where(a > 0, c, a * c2),
        "lerp": lambda a: torch.lerp(c.expand(3, 1), a, 0.25),
    }
    f = fs[op]
    x = _r(3, 1, seed=11)
    torch.testing.assert_close(ft.jacfwd(f)(x), tf.jacfwd(f)(x))
    g = lambda a: f(a).sin().sum()  # noqa: E731
    torch.testing.assert_close(ft.hessian(g)(x), tf.hessian(g)(x))
    xb = _r(4, 3, 1, seed=12)
    torch.testing.assert_close(ft.vmap(ft.jacfwd(f))(xb), tf.vmap(tf.jacfwd(f))(xb))


def test_jvp_with_closed_over_operand_scaled_tangent_runs_in_process():
    # The tangent of a closed-over operand is an efficient zero tensor; forward AD scaled it
    # with mul.Scalar under vmap's dispatch mode, which crashed the interpreter.  Run it in a
    # subprocess so a regression shows as a failure rather than taking pytest down.
    code = ("import torch, functrans as ft\n"
            "c = torch.tensor([0.5], dtype=torch.float64)\n"
            "x = torch.rand(4, 3, 1, dtype=torch.float64)\n"
            "t = torch.rand(4, 3, 1, dtype=torch.float64)\n"
            "f = lambda a: torch.addcmul(c, c, a, value=0.5)\n"
            "_, o = ft.vmap(lambda a, b: ft.jvp(f, (a,), (b,)))(x, t)\n"
            "torch.testing.assert_close(o, 0.25 * t)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300)
    assert res.returncode == 0, (res.returncode, res.stderr.decode()[-2000:])


def test_vmap_of_vmap_jvp_with_views_in_inner_dims():
    x = _r(2, 3, 4, seed=13)
    t = _r(4, 2, 3, seed=14)

    def f(a):
        return a.t().unsqueeze(1).expand(2, 2).sin()    # a: scalar-pair of shape (2,)

    def inner(a, b):
        return ft.jvp(f, (a,), (b,))[1]

    actual = ft.vmap(ft.vmap(inner, in_dims=(1, 1)), in_dims=(2, 0))(x, t)
    expected = tf.vmap(tf.vmap(lambda a, b: tf.jvp(f, (a,), (b,))[1], in_dims=(1, 1)),
                       in_dims=(2, 0))(x, t)
    torch.testing.assert_close(actual, expected)
