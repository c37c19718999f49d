"""Every transform and composition against torch.func on the same inputs (CPU; CUDA if present)."""
import pytest
import torch
import torch.func as tf
import torch.nn.functional as F

import functrans as ft
from tests.support.oracles import assert_same



pytestmark = pytest.mark.usefixtures("float64")


def f_scalar(x):
    return (x.sin() * x).sum() + (x ** 2).prod() * 0.1


def f_vec(x):
    return x.sin() * x.cumsum(0)


def f_two(x, w):
    return torch.tanh(w @ x).sum() * x.norm()


@pytest.fixture
def inputs(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, generator=g).to(device)
    w = torch.randn(3, 4, generator=g).to(device)
    X = torch.randn(5, 4, generator=g).to(device)
    t = torch.randn(4, generator=g).to(device)
    return x, w, X, t


CASES = {
    "grad": lambda m, x, w, X, t: m.grad(f_scalar)(x),
    "grad_argnums_tuple": lambda m, x, w, X, t: m.grad(f_two, argnums=(0, 1))(x, w),
    "grad_and_value": lambda m, x, w, X, t: m.grad_and_value(f_two, argnums=1)(x, w),
    "grad_has_aux": lambda m, x, w, X, t: m.grad(lambda a: (f_scalar(a), a.cos()), has_aux=True)(x),
    "vjp": lambda m, x, w, X, t: m.vjp(f_vec, x)[1](t),
    "vmap_vjp_fn": lambda m, x, w, X, t: m.vmap(m.vjp(f_vec, x)[1])(X),
    "jvp": lambda m, x, w, X, t: m.jvp(f_vec, (x,), (t,)),
    "jacrev": lambda m, x, w, X, t: m.jacrev(f_vec)(x),
    "jacrev_argnums": lambda m, x, w, X, t: m.jacrev(lambda a, b: torch.tanh(b @ a), argnums=(0, 1))(x, w),
    "jacfwd": lambda m, x, w, X, t: m.jacfwd(f_vec)(x),
    "jacfwd_argnums": lambda m, x, w, X, t: m.jacfwd(lambda a, b: torch.tanh(b @ a), argnums=(0, 1))(x, w),
    "hessian": lambda m, x, w, X, t: m.hessian(f_scalar)(x),
    "vmap_grad_per_sample": lambda m, x, w, X, t: m.vmap(m.grad(lambda ww, xx: torch.tanh(ww @ xx).sum()), in_dims=(None, 0))(w, X),
    "grad_vmap": lambda m, x, w, X, t: m.grad(lambda a: m.vmap(f_vec)(a).sum())(X),
    "vmap_jvp": lambda m, x, w, X, t: m.vmap(lambda a, b: m.jvp(f_vec, (a,), (b,)))(X, X.flip(0)),
    "jacrev_jacrev": lambda m, x, w, X, t: m.jacrev(m.jacrev(f_vec))(x),
    "jacfwd_jacrev": lambda m, x, w, X, t: m.jacfwd(m.jacrev(f_vec))(x),
    "jacrev_jacfwd": lambda m, x, w, X, t: m.jacrev(m.jacfwd(f_vec))(x),
    "jacfwd_jacfwd": lambda m, x, w, X, t: m.jacfwd(m.jacfwd(f_vec))(x),
    "vmap_jacrev": lambda m, x, w, X, t: m.vmap(m.jacrev(f_vec))(X),
    "vmap_hessian": lambda m, x, w, X, t: m.vmap(m.hessian(f_scalar))(X),
    "grad_grad": lambda m, x, w, X, t: m.grad(lambda a: m.grad(f_scalar)(a).sum())(x),
    "vmap_grad_grad_maml": lambda m, x, w, X, t: m.vmap(
        m.grad(lambda a, xx: f_scalar(a - 0.1 * m.grad(lambda b: (b * xx).sin().sum())(a))),
        in_dims=(None, 0))(x, X),
    "jvp_vjp": lambda m, x, w, X, t: m.jvp(lambda a: m.vjp(f_vec, a)[1](t)[0], (x,), (t,)),
    "vjp_jvp": lambda m, x, w, X, t: m.vjp(lambda a: m.jvp(f_vec, (a,), (t,))[1], x)[1](t),
    "jvp_jvp": lambda m, x, w, X, t: m.jvp(lambda a: m.jvp(f_vec, (a,), (t,))[1], (x,), (t.flip(0),)),
    "vmap_jvp_jacrev": lambda m, x, w, X, t: m.vmap(lambda tt: m.jvp(m.jacrev(f_vec), (x,), (tt,))[1])(X),
    "linearize": lambda m, x, w, X, t: (lambda o: (o[0], o[1](t)))(m.linearize(f_vec, x)),
    "release_notes_jacobian": lambda m, x, w, X, t: m.vmap(
        m.vjp(lambda a: F.linear(a, w, w[:, 0]).tanh(), x)[1])(torch.eye(3, device=x.device)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_against_torch_func(name, inputs):
    assert_same(CASES[name](ft, *inputs), CASES[name](tf, *inputs), rtol=1e-9, atol=1e-10)


def test_results_differentiable_by_ordinary_autograd(device):
    x = torch.randn(4, device=device, requires_grad=True)
    g = ft.grad(f_scalar)(x)
    assert g.requires_grad
    (gg,) = torch.autograd.grad(g.sum(), x)
    assert_same(gg, torch.func.hessian(f_scalar)(x.detach()).sum(0))


def test_no_double_backward_graph_when_nothing_needs_it():
    x = torch.randn(4)
    g = ft.grad(f_scalar)(x)
    assert not g.requires_grad and g.grad_fn is None
    out, fn = ft.vjp(f_vec, x)
    assert not out.requires_grad


def test_outer_no_grad_is_overridden_inner_is_respected():
    x = torch.randn(4)
    with torch.no_grad():
        assert_same(ft.grad(f_scalar)(x), tf.grad(f_scalar)(x))

    def f(a):
        with torch.no_grad():
            c = a.sin()
        return (c * a).sum()
    assert_same(ft.grad(f)(x), tf.grad(f)(x))


def test_unused_input_gets_zero_gradient():
    x, y = torch.randn(3), torch.randn(3)
    gx, gy = ft.grad(lambda a, b: a.sum() * 2, argnums=(0, 1))(x, y)
    assert_same(gy, torch.zeros(3))


def test_pytree_arguments():
    params = {"w": torch.randn(3, 4), "b": torch.randn(3)}
    x = torch.randn(4)
    loss = lambda p, xx: torch.tanh(p["w"] @ xx + p["b"]).sum()
    assert_same(ft.grad(loss)(params, x), tf.grad(loss)(params, x))
    assert_same(ft.jacrev(lambda p, xx: torch.tanh(p["w"] @ xx + p["b"]))(params, x),
                tf.jacrev(lambda p, xx: torch.tanh(p["w"] @ xx + p["b"]))(params, x))


def test_vjp_fn_called_many_times():
    x = torch.randn(4)
    out, fn = ft.vjp(f_vec, x)
    a = fn(torch.ones(4))
    b = fn(torch.ones(4))
    assert_same(a, b)


def test_nested_grads_differentiate_only_their_own_inputs():
    # d/dx [ x * d/dy (x * y) ] = d/dx [x * x] = 2x  (perturbation confusion would give 3x or x)
    x = torch.tensor(3.0)
    r = ft.grad(lambda a: a * ft.grad(lambda b: a * b)(a))(x)
    assert_same(r, torch.tensor(6.0))


@pytest.mark.parametrize("chunk_size", [1, 3])
def test_chunk_size_for_all_jacobians(chunk_size):
    x = torch.randn(4)
    assert_same(ft.jacrev(f_vec, chunk_size=chunk_size)(x), tf.jacrev(f_vec)(x))
    assert_same(ft.jacfwd(f_vec, chunk_size=chunk_size)(x), tf.jacfwd(f_vec)(x))
    assert_same(ft.hessian(f_scalar, chunk_size=chunk_size)(x), tf.hessian(f_scalar)(x))


def test_hessian_has_aux():
    x = torch.randn(4)
    h, aux = ft.hessian(lambda a: (f_scalar(a), a.cos()), has_aux=True)(x)
    assert_same(h, tf.hessian(f_scalar)(x))
    assert_same(aux, x.cos())


def test_linearize_evaluates_func_once():
    calls = []
    x, t = torch.randn(4), torch.randn(4)

    def f(a):
        calls.append(1)
        return f_vec(a)
    out, jvp_fn = ft.linearize(f, x)
    jvp_fn(t)
    jvp_fn(t * 2)
    assert len(calls) == 1
    assert_same(jvp_fn(t), tf.jvp(f_vec, (x,), (t,))[1])


def test_jacobians_of_pytree_outputs_wrt_pytree_inputs():
    x = torch.randn(3)
    p = {"w": torch.randn(2, 3), "b": torch.randn(2)}

    def f(params, v):
        h = params["w"] @ v + params["b"]
        return {"h": h.tanh(), "pair": (h.sum(), v * 2)}

    for argnums in (0, 1, (0, 1)):
        assert_same(ft.jacrev(f, argnums=argnums)(p, x), tf.jacrev(f, argnums=argnums)(p, x))
        assert_same(ft.jacfwd(f, argnums=argnums)(p, x), tf.jacfwd(f, argnums=argnums)(p, x))
    g = lambda params, v: f(params, v)["h"].sum()
    assert_same(ft.hessian(g, argnums=(0, 1))(p, x), tf.hessian(g, argnums=(0, 1))(p, x))


def test_inputs_that_already_require_grad_like_nn_parameters():
    lin = torch.nn.Linear(4, 3)
    params = dict(lin.named_parameters())
    x = torch.randn(4)
    loss = lambda ps, v: torch.tanh(ps["weight"] @ v + ps["bias"]).sum()
    ours, ref = ft.grad(loss)(params, x), tf.grad(loss)(params, x)
    assert_same({k: v.detach() for k, v in ours.items()}, {k: v.detach() for k, v in ref.items()})
    assert ours["weight"].requires_grad == ref["weight"].requires_grad
    per_sample = ft.vmap(ft.grad(loss), in_dims=(None, 0))(params, torch.randn(5, 4))
    assert per_sample["weight"].shape == (5, 3, 4)


def test_has_aux_for_every_transform():
    x, t = torch.randn(4), torch.randn(4)
    f = lambda a: (f_vec(a), {"aux": a.cos()})
    assert_same(ft.vjp(f, x, has_aux=True)[2], tf.vjp(f, x, has_aux=True)[2])
    assert_same(ft.jvp(f, (x,), (t,), has_aux=True), tf.jvp(f, (x,), (t,), has_aux=True))
    assert_same(ft.jacrev(f, has_aux=True)(x), tf.jacrev(f, has_aux=True)(x))
    assert_same(ft.jacfwd(f, has_aux=True)(x), tf.jacfwd(f, has_aux=True)(x))
    g = lambda a: (f_scalar(a), a.cos())
    assert_same(ft.grad_and_value(g, has_aux=True)(x), tf.grad_and_value(g, has_aux=True)(x))


@pytest.mark.parametrize("fn", [
    lambda x: F.linear(x, torch.ones(3, x.shape[-1], dtype=x.dtype, device=x.device)),
    lambda x: x.view(-1, 1).sin(),
    lambda x: x[1:].view(2, -1).sum(0),
    lambda x: x.unsqueeze(0).mT.squeeze(-1)[1:] * 2,
], ids=["linear", "view", "slice_then_view", "view_chain"])
def test_forward_mode_on_primals_that_are_views(device, fn):
    """Regression: a primal that is a view (a row of a batch, as in a loop over examples), or a
    view of a view inside ``f``, crashed forward AD with PyTorch's internal assert "the tangent
    [must] have the same layout as primal": the BatchedTensor tangent reported storage offset 0."""
    X = torch.randn(3, 5, dtype=torch.float64, device=device)
    row = X[1]
    assert row._is_view() and row.storage_offset() == 5
    assert_same(ft.jacfwd(fn)(row), tf.jacfwd(fn)(row))
    assert_same(ft.jvp(fn, (row,), (torch.ones_like(row),)),
                tf.jvp(fn, (row,), (torch.ones_like(row),)))
    assert_same(ft.vmap(ft.jacfwd(fn))(X), tf.vmap(tf.jacfwd(fn))(X))
    assert_same(ft.hessian(lambda x: fn(x).sum() ** 2)(row),
                tf.hessian(lambda x: fn(x).sum() ** 2)(row))
