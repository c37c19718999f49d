"""Whether transform results require grad (keep an autograd graph), compared with torch.func.

A result keeps its graph iff it is connected to something outside the transform: an input that
requires grad, an outer transform, or a closed-over tensor that requires grad (a parameter:
gradient penalties).  Otherwise it does not require grad (no leaked graph)."""
import pytest
import torch
import torch.func as tf

import functrans as ft

D = torch.float64


def _x(rg=False):
    return torch.tensor([0.5, 1.0, -0.3], dtype=D, requires_grad=rg)


def _w():
    return torch.tensor([2.0, 3.0, -1.0], dtype=D, requires_grad=True)


def _cases(M, x, w):
    """name -> result tensor (one per transform / output), for module M (ft or torch.func)."""
    f = (lambda x: torch.sin(x)) if w is None else (lambda x: torch.sin(x * w))
    fs = lambda x: f(x).sum()  # noqa: E731
    ones = torch.ones(3, dtype=D)
    out, vjp_fn = M.vjp(f, x)
    g, v = M.grad_and_value(fs)(x)
    ga, aux = M.grad(lambda x: (fs(x), f(x)), has_aux=True)(x)
    o2, vjp_fn2, aux2 = M.vjp(lambda x: (f(x), f(x) * 2), x, has_aux=True)
    return {
        "vjp.out": out, "vjp_fn": vjp_fn(ones)[0], "vjp.aux": aux2,
        "vjp_fn(ct requires grad)": vjp_fn(ones.clone().requires_grad_())[0],
        "jacrev": M.jacrev(f)(x), "grad": M.grad(fs)(x),
        "grad_and_value.g": g, "grad_and_value.v": v, "grad.aux": aux,
        "vmap(grad)": M.vmap(M.grad(fs))(torch.stack([x, 2 * x])),
        "vmap(jacrev)": M.vmap(M.jacrev(f))(torch.stack([x, 2 * x])),
    }


@pytest.mark.parametrize("setting", ["plain", "input_requires_grad", "closed_over_param"])
def test_requires_grad_matches_torch_func(setting):
    x = _x(setting == "input_requires_grad")
    w = _w() if setting == "closed_over_param" else None
    got = _cases(ft, x, w)
    want = _cases(tf, x, w)
    for k in want:
        assert got[k].requires_grad == want[k].requires_grad, k
        torch.testing.assert_close(got[k].detach(), want[k].detach(), msg=k)


def test_no_graph_leaks_without_outside_connection():
    x = _x()
    _, vjp_fn = ft.vjp(torch.sin, x)
    r = vjp_fn(x)[0]
    assert not r.requires_grad and r.grad_fn is None
    assert not ft.jacrev(torch.sin)(x).requires_grad
    assert not ft.grad(lambda x: torch.sin(x).sum())(x).requires_grad


def test_no_grad_outside_drops_graph_even_with_closed_over_param():
    x, w = _x(), _w()
    with torch.no_grad():
        out, vjp_fn = ft.vjp(lambda x: torch.sin(x * w), x)
        assert not out.requires_grad
        assert not vjp_fn(torch.ones(3, dtype=D))[0].requires_grad
        assert not ft.jacrev(lambda x: torch.sin(x * w))(x).requires_grad
        assert not ft.grad(lambda x: torch.sin(x * w).sum())(x).requires_grad
    out, vjp_fn = ft.vjp(lambda x: torch.sin(x * w), x)
    with torch.no_grad():
        assert not vjp_fn(torch.ones(3, dtype=D))[0].requires_grad


@pytest.mark.parametrize("api", ["jacrev", "grad", "vjp", "vmap_grad", "vmap_jacrev"])
def test_gradient_penalty_populates_closed_over_param(api):
    """``loss = T(f)(x).norm(); loss.backward()`` fills ``w.grad`` as with torch.func."""
    def run(M):
        x = _x()
        w = _w()
        w2 = (w * 1.5).detach().requires_grad_()        # a second leaf, used via a non-leaf
        h = w2 * 2
        f = lambda x: torch.sin(x * w + h) * x  # noqa: E731
        fs = lambda x: f(x).sum()  # noqa: E731
        X = torch.stack([x, 2 * x])
        if api == "jacrev":
            r = M.jacrev(f)(x)
        elif api == "grad":
            r = M.grad(fs)(x)
        elif api == "vjp":
            r = M.vjp(f, x)[1](torch.ones(3, dtype=D))[0]
        elif api == "vmap_grad":
            r = M.vmap(M.grad(fs))(X)
        else:
            r = M.vmap(M.jacrev(f))(X)
        r.norm().backward()
        return w.grad, w2.grad
    got, want = run(ft), run(tf)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_value_backward_reaches_closed_over_param():
    def run(M):
        w = _w()
        g, v = M.grad_and_value(lambda x: torch.sin(x * w).sum())(_x())
        (v + g.sum()).backward()
        return w.grad
    torch.testing.assert_close(run(ft), run(tf))


def test_outer_transforms_still_see_the_graph():
    x = _x()
    f = lambda x: torch.sin(x) * x  # noqa: E731
    fs = lambda x: f(x).sum()  # noqa: E731
    ct = torch.ones(3, dtype=D)
    cases = [
        (lambda M: M.grad(lambda x: M.vjp(f, x)[1](ct)[0].sum())(x)),
        (lambda M: M.grad(lambda x: M.jacrev(f)(x).sum())(x)),
        (lambda M: M.jacrev(M.jacrev(f))(x)),
        (lambda M: M.hessian(fs)(x)),
        (lambda M: M.grad(lambda x: M.vmap(M.grad(fs))(torch.stack([x, x * 2])).sum())(x)),
    ]
    for c in cases:
        torch.testing.assert_close(c(ft), c(tf))


def test_closed_over_batched_tensor_whose_value_requires_grad():
    """The connection is only in the physical values (a closed-over BatchedTensor)."""
    def run(M):
        W = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 2.0]], dtype=D, requires_grad=True)
        x = _x()
        r = M.vmap(lambda w: M.jacrev(lambda x: torch.sin(x * w))(x))(W)
        r2 = M.vmap(lambda w: M.grad(lambda x: torch.sin(x * w).sum())(x))(W)
        assert r.requires_grad and r2.requires_grad
        (r.square().sum() + r2.square().sum()).backward()
        return r.detach(), W.grad
    got, want = run(ft), run(tf)
    torch.testing.assert_close(got, want)


def test_vmap_grad_closed_over_param_through_saved_output():
    X = torch.tensor([[0.5, 1.0, -0.3], [1.0, 2.0, -0.6]], dtype=D)
    w0 = _w().detach()

    def outer(M):
        return lambda w: M.vmap(M.grad(lambda x: (torch.exp(x * w) * x).sum()))(X).sum()
    torch.testing.assert_close(ft.grad(outer(ft))(w0), tf.grad(outer(tf))(w0))


def test_no_graph_leaks_through_the_double_vjp_route():
    """jacfwd/jvp under an outer vjp take the double-vjp route, whose dummy cotangents are leaves
    that require grad; the graph walk must not take them for closed-over tensors."""
    x = torch.tensor([0.3, -0.4], dtype=D)
    out, vjp_fn = ft.vjp(ft.jacfwd(torch.sin), x)
    assert not out.requires_grad
    (g,) = vjp_fn(torch.ones(2, 2, dtype=D))
    assert not g.requires_grad
    torch.testing.assert_close(g, tf.vjp(tf.jacfwd(torch.sin), x)[1](torch.ones(2, 2, dtype=D))[0])


@pytest.mark.parametrize("name", ["hessian", "jacfwd(jacrev)", "linearize", "jvp(vmap)"])
def test_double_vjp_route_results_follow_the_reference(name):
    """These run the double-vjp route (a vmap inside a jvp, or linearize).  It used to decide
    "keep the graph" after pushing its own grad level, so the answer was always yes."""
    x = torch.tensor([0.3, -0.4], dtype=D)
    w = torch.tensor([1.5, 0.5], dtype=D, requires_grad=True)

    def run(M, closed_over):
        f = (lambda a: torch.sin(a * w)) if closed_over else torch.sin
        if name == "hessian":
            return M.hessian(lambda a: f(a).sum())(x)
        if name == "jacfwd(jacrev)":
            return M.jacfwd(M.jacrev(f))(x)
        if name == "linearize":
            return M.linearize(f, x)[1](torch.ones(2, dtype=D))
        return M.jvp(M.vmap(f), (x[None],), (torch.ones(1, 2, dtype=D),))[1]
    for closed_over in (False, True):
        got, want = run(ft, closed_over), run(tf, closed_over)
        torch.testing.assert_close(got, want)
        assert got.requires_grad == want.requires_grad == closed_over, (closed_over, name)
