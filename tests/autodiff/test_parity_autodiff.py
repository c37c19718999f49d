"""Parity with the reference library (torch.func) on autodiff corner cases: forward AD switched
off around a jvp, vjp_fn's retain_graph/create_graph and a vjp built under no_grad, anomaly
mode under vmap(grad), jvp(strict=True), and tangents of another floating dtype.

Every test runs functrans and the reference on the same inputs and compares."""
import copy
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.func as TF

import functrans
from functrans.errors import TransformArgumentError
from tests.support.oracles import loop_oracle, perturb_like


def _fwd_enabled():
    return torch._C._is_fwd_grad_enabled()


def _x(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), torch.randn(n, generator=g), torch.randn(n, generator=g)


# ---- item 2: forward AD switched off around a jvp ------------------------------------------

def test_jvp_under_disabled_forward_grad_turns_it_on_for_its_level():
    x, t, _ = _x()
    with fwAD._set_fwd_grad_enabled(False):
        ours = functrans.jvp(torch.sin, (x,), (t,))
        ref = TF.jvp(torch.sin, (x,), (t,))
        assert not _fwd_enabled()  # restored
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(ours[1], x.cos() * t)
    assert _fwd_enabled()


def test_jvp_restores_the_forward_grad_flag_on_exceptions():
    x, t, _ = _x()
    seen = []

    def boom(y):
        seen.append(_fwd_enabled())
        raise KeyError("inside f")

    for outer in (False, True):
        with fwAD._set_fwd_grad_enabled(outer):
            with pytest.raises(KeyError):
                functrans.jvp(boom, (x,), (t,))
            assert _fwd_enabled() is outer
    assert seen == [True, True]  # on for jvp's own level, as in the reference


def test_jvp_inside_autograd_function_forward():
    x, t, _ = _x()

    def make(jvp):
        class Inner(torch.autograd.Function):
            @staticmethod
            def forward(ctx, y):  # PyTorch runs this with forward AD switched off
                return jvp(torch.sin, (y,), (t,))[1]

            @staticmethod
            def backward(ctx, g):
                return g
        return Inner

    torch.testing.assert_close(make(functrans.jvp).apply(x), make(TF.jvp).apply(x))
    torch.testing.assert_close(make(functrans.jvp).apply(x), x.cos() * t)


def test_nested_jvp_and_jacobians_under_disabled_forward_grad():
    x, t, t2 = _x()
    f = lambda y: torch.sin(y) * y  # noqa: E731
    with fwAD._set_fwd_grad_enabled(False):
        inner_ft = lambda z: functrans.jvp(f, (z,), (t2,))  # noqa: E731
        inner_tf = lambda z: TF.jvp(f, (z,), (t2,))  # noqa: E731
        torch.testing.assert_close(functrans.jvp(inner_ft, (x,), (t,)),
                                   TF.jvp(inner_tf, (x,), (t,)))
        torch.testing.assert_close(functrans.jacfwd(f)(x), TF.jacfwd(f)(x))
        g = lambda y: (torch.sin(y) * y).sum()  # noqa: E731
        torch.testing.assert_close(functrans.hessian(g)(x), TF.hessian(g)(x))
        torch.testing.assert_close(functrans.jacfwd(functrans.jacfwd(f))(x),
                                   TF.jacfwd(TF.jacfwd(f))(x))
        # linearize: compared with the reference's jvp (its linearize returns a zero tangent
        # here, a reference bug), computed with forward AD on.
        out, jvp_fn = functrans.linearize(f, x)
        lin = jvp_fn(t)
        assert not _fwd_enabled()
    torch.testing.assert_close((out, lin), TF.jvp(f, (x,), (t,)))


def test_outer_jvp_still_stops_in_a_disabled_region_around_an_inner_jvp():
    """The inner jvp turns forward AD on for ITS level only: the outer level's tangent stays
    zero through the user's disabled region, as in the reference."""
    x, t, t2 = _x()

    def region(jvp):
        def f(y):
            with fwAD._set_fwd_grad_enabled(False):
                return jvp(torch.sin, (y,), (t2,))[1]
        return f

    ours = functrans.jvp(region(functrans.jvp), (x,), (t,))
    ref = TF.jvp(region(TF.jvp), (x,), (t,))
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(ours[1], torch.zeros(3))


def _shifted(x):
    """PyTorch's test_disable_fwd_grad_inside: ``shift`` is a constant for forward mode only."""
    with fwAD._set_fwd_grad_enabled(False):
        shift = x ** 2
    return x ** 2 - shift


def _region_compositions(M, t):
    """Compositions of module M's transforms over _shifted; some take functrans's double-vjp
    route (nested jvp, jvp under vmap or under grad), which is reverse mode."""
    f = _shifted
    jvp_t = lambda g: (lambda y: M.jvp(g, (y,), (t,))[1])  # noqa: E731

    def around_inner(y):  # the region around an inner jvp
        with fwAD._set_fwd_grad_enabled(False):
            return M.jvp(torch.sin, (y,), (t,))[1] * y
    return {
        "jvp": jvp_t(f),
        "jvp(jvp)": jvp_t(jvp_t(f)),
        "jvp(jvp(jvp))": jvp_t(jvp_t(jvp_t(lambda y: y * _shifted(y)))),
        "jacfwd(jacfwd)": M.jacfwd(M.jacfwd(f)),
        "hessian": M.hessian(f),
        "jacrev(jacfwd)": M.jacrev(M.jacfwd(f)),
        "grad(jvp tangent)": M.grad(jvp_t(f)),
        "grad(jvp primal)": M.grad(lambda y: M.jvp(f, (y,), (t,))[0]),
        "jvp(grad)": jvp_t(M.grad(f)),
        "vmap(jvp(jvp))": lambda y: M.vmap(jvp_t(jvp_t(f)))(y.expand(3)),
        "jvp(vmap(jvp))": jvp_t(lambda y: M.vmap(jvp_t(f))(y.expand(3))),
        "jvp(around inner jvp)": jvp_t(around_inner),
        "vmap(jvp(around inner jvp))": lambda y: M.vmap(jvp_t(around_inner))(y.expand(3)),
        "grad(jvp(around inner jvp))": M.grad(jvp_t(around_inner)),
    }


def test_disable_fwd_grad_inside_nested_forward_mode_matches_the_reference():
    """A value computed with forward AD switched off is a constant for every forward-mode
    level, on jvp's double-vjp route too (it gave 0 for the nested jvp, where the reference
    gives 2), and for no reverse-mode level (grad of the jvp's primal output stays 0)."""
    x = torch.tensor(0.7)
    t = torch.ones_like(x)
    assert functrans.jvp(lambda y: functrans.jvp(_shifted, (y,), (t,))[1], (x,), (t,))[1] == 2
    ours, ref = _region_compositions(functrans, t), _region_compositions(TF, t)
    for name in ours:
        torch.testing.assert_close(ours[name](x), ref[name](x), msg=name)
    # finite differences of the forward-mode tangent 2y: d/dy = 2
    eps = 1e-3
    tangent = lambda y: functrans.jvp(_shifted, (y,), (t,))[1]  # noqa: E731
    fd = (tangent(x.double() + eps) - tangent(x.double() - eps)) / (2 * eps)
    torch.testing.assert_close(ours["jvp(jvp)"](x), fd.float())


def test_disable_fwd_grad_outside_and_mixed_match_the_reference():
    """PyTorch's test_disable_fwd_grad_outside / _mixed, and nested variants."""
    x = torch.tensor(0.7)
    t = torch.ones_like(x)
    for enabled in (False, True):
        with fwAD._set_fwd_grad_enabled(enabled):
            for f in (torch.sin, _shifted):
                torch.testing.assert_close(functrans.jvp(f, (x,), (t,)), TF.jvp(f, (x,), (t,)))
                nested = [M.jvp(lambda y: M.jvp(f, (y,), (t,))[1], (x,), (t,))
                          for M in (functrans, TF)]
                torch.testing.assert_close(nested[0], nested[1])
            assert _fwd_enabled() is enabled
    torch.testing.assert_close(functrans.jvp(_shifted, (x,), (t,))[1], 2 * x)


def test_linearize_of_a_function_with_a_disabled_region():
    x, t, _ = _x()
    out, jvp_fn = functrans.linearize(_shifted, x)
    torch.testing.assert_close(jvp_fn(t), TF.jvp(_shifted, (x,), (t,))[1])
    torch.testing.assert_close(jvp_fn(t), 2 * x * t)


# ---- item 11: vjp_fn(cotangents, retain_graph, create_graph) ------------------------------

def _both_vjp(x, f=torch.sin):
    return functrans.vjp(f, x), TF.vjp(f, x)


def test_vjp_fn_accepts_retain_and_create_graph_positionally():
    x, ct, _ = _x()
    xr = x.clone().requires_grad_()
    for create in (None, True, False):
        (o1, fn1), (o2, fn2) = _both_vjp(xr)
        g1, g2 = fn1(ct, True, create)[0], fn2(ct, True, create)[0]
        torch.testing.assert_close(g1, g2)
        assert g1.requires_grad == g2.requires_grad, create
    # retain_graph=False frees the graph: a second call fails in both
    (o1, fn1), (o2, fn2) = _both_vjp(x)
    fn1(ct, False)
    fn2(ct, False)
    for fn in (fn1, fn2):
        with pytest.raises(RuntimeError, match="second time"):
            fn(ct)
    # retain_graph=None follows create_graph, which defaults to grad mode: kept with grad
    # mode on, freed under no_grad
    for fn in _both_vjp(x):
        fn = fn[1]
        fn(ct, None, None)
        with torch.no_grad():
            fn(ct, None, None)
        with pytest.raises(RuntimeError, match="second time"):
            fn(ct)


def test_vjp_fn_create_graph_has_an_effect_and_matches_reference():
    x, ct, _ = _x()
    xr = x.clone().requires_grad_()
    # plain input: nothing outside can differentiate the result, whatever create_graph says
    (_, fn1), (_, fn2) = _both_vjp(x)
    assert fn1(ct, create_graph=True)[0].requires_grad == \
        fn2(ct, create_graph=True)[0].requires_grad
    # an input that requires grad: create_graph decides, even under no_grad
    (_, fn1), (_, fn2) = _both_vjp(xr)
    with torch.no_grad():
        for create in (True, False, None):
            a, b = fn1(ct, create_graph=create)[0], fn2(ct, create_graph=create)[0]
            assert a.requires_grad == b.requires_grad, create
    assert fn1(ct, create_graph=True)[0].requires_grad
    assert not fn1(ct, create_graph=False)[0].requires_grad


def test_vjp_fn_validates_its_flags():
    x, ct, _ = _x()
    _, fn = functrans.vjp(torch.sin, x)
    with pytest.raises(TransformArgumentError, match="create_graph"):
        fn(ct, create_graph="yes")
    with pytest.raises(TransformArgumentError, match="retain_graph"):
        fn(ct, 1)


def test_vjp_built_under_no_grad_gives_a_differentiable_vjp_fn_result():
    x, ct, _ = _x()
    grads = []
    for vjp in (functrans.vjp, TF.vjp):
        xr = x.clone().requires_grad_()
        with torch.no_grad():
            out, fn = vjp(torch.sin, xr)
        assert not out.requires_grad
        g = fn(ct)[0]
        assert g.requires_grad
        g.sum().backward()
        grads.append(xr.grad)
    torch.testing.assert_close(grads[0], grads[1])
    torch.testing.assert_close(grads[0], -x.sin() * ct)


def test_grad_of_vjp_built_under_no_grad():
    x, ct, _ = _x()

    def h(M):
        def f(z):
            with torch.no_grad():
                _, fn = M.vjp(torch.sin, z)
            return (fn(ct)[0] ** 2).sum()
        return f

    torch.testing.assert_close(functrans.grad(h(functrans))(x), TF.grad(h(TF))(x))
    # and w.r.t. the cotangent, with the vjp built under no_grad outside the grad
    with torch.no_grad():
        _, fn1 = functrans.vjp(torch.sin, x)
        _, fn2 = TF.vjp(torch.sin, x)
    torch.testing.assert_close(functrans.grad(lambda c: (fn1(c)[0] ** 2).sum())(ct),
                               TF.grad(lambda c: (fn2(c)[0] ** 2).sum())(ct))


# ---- item 12: anomaly mode under vmap(grad) -------------------------------------------------

def test_vmap_grad_under_detect_anomaly_matches_reference():
    x = torch.stack([perturb_like(torch.rand(3) + 0.5, i) for i in range(4)])
    f = lambda z: (z.sin() * z.sqrt()).sum()  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anomaly mode's own warning
        with torch.autograd.set_detect_anomaly(True):
            ours = functrans.vmap(functrans.grad(f))(x)
            ref = TF.vmap(TF.grad(f))(x)
    torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("bad", [0, 2])
def test_anomaly_mode_reports_a_nan_in_any_example(bad):
    x = torch.rand(4, 3) + 0.5
    x[bad, 1] = 0.0  # sqrt's backward at 0: 0 / 0 = nan in that example only
    g = lambda z: (z.sqrt() * 0).sum()  # noqa: E731
    assert functrans.vmap(functrans.grad(g))(x).isnan().sum() == 1  # no anomaly mode: nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.set_detect_anomaly(True):
            for M in (functrans, TF):
                with pytest.raises(RuntimeError, match="SqrtBackward0.*nan"):
                    M.vmap(M.grad(g))(x)
            # no nan anywhere: no report
            functrans.vmap(functrans.grad(g))(x + 1)


@pytest.mark.parametrize("op", [torch._is_any_true, torch._is_all_true])
def test_is_any_all_true_reduce_over_the_batch(op):
    """Not a per-example op under vmap: the reference reduces over the batch too, so the
    oracle is the loop's per-example results reduced the same way (and expanded)."""
    reduce = any if op is torch._is_any_true else all
    cases = [torch.tensor([[False, False], [False, True], [False, False]]),
             torch.tensor([[True, True], [True, False], [True, True]]),
             torch.tensor([[True, True], [True, True], [True, True]]),
             torch.zeros(3, 2, dtype=torch.bool)]
    for b in cases:
        for bdim, xb in ((0, b), (1, b.t().contiguous())):
            per_example = loop_oracle(op, (bdim,), 3, xb)
            expected = torch.full((3,), reduce(per_example.tolist()))
            ours = functrans.vmap(op, in_dims=bdim)(xb)
            torch.testing.assert_close(ours, expected)
            torch.testing.assert_close(ours, TF.vmap(op, in_dims=bdim)(xb))
        nested = torch.stack([b, ~b])  # [2, 3, 2]
        torch.testing.assert_close(functrans.vmap(functrans.vmap(op))(nested),
                                   TF.vmap(TF.vmap(op))(nested))


# ---- item 14: jvp(strict=True) ---------------------------------------------------------------

def _independent(y):
    return y.sin(), torch.ones(3) * 2.0, y.detach() * 3


@pytest.mark.parametrize("route", ["forward_ad", "double_vjp"])
def test_jvp_strict_refuses_an_output_independent_of_the_primals(route):
    x, t, _ = _x()
    if route == "double_vjp":  # an input that requires grad takes the double-vjp route
        x = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="strict=True"):
        TF.jvp(_independent, (x,), (t,), strict=True)
    with pytest.raises(TransformArgumentError, match=r"output\[1\].*does not depend"):
        functrans.jvp(_independent, (x,), (t,), strict=True)
    with pytest.raises(TransformArgumentError, match="does not depend"):
        functrans.jvp(lambda y: y.detach() * 3, (x,), (t,), strict=True)
    with pytest.raises(TransformArgumentError, match="does not depend"):
        functrans.jvp(lambda y: y.argmax(), (x,), (t,), strict=True)
    # strict=False: zero tangents, as the reference
    ours = functrans.jvp(_independent, (x,), (t,))
    ref = TF.jvp(_independent, (x,), (t,))
    torch.testing.assert_close(ours[1], ref[1])
    # dependent outputs (the identity included) pass under strict
    for f in (lambda y: (y.sin(), y), lambda y: y * 0):
        torch.testing.assert_close(functrans.jvp(f, (x,), (t,), strict=True),
                                   TF.jvp(f, (x,), (t,), strict=True))


def test_jvp_strict_in_a_nested_jvp_and_under_vmap():
    x, t, t2 = _x()
    # inner jvp takes the double-vjp route inside the outer jvp
    with pytest.raises(TransformArgumentError, match="does not depend"):
        functrans.jvp(lambda z: functrans.jvp(lambda y: torch.ones(3) + y.detach(), (z,),
                                              (t2,), strict=True)[1], (x,), (t,))
    f = lambda y: y.sin() * 2  # noqa: E731
    torch.testing.assert_close(
        functrans.jvp(lambda z: functrans.jvp(f, (z,), (t2,), strict=True)[1], (x,), (t,)),
        TF.jvp(lambda z: TF.jvp(f, (z,), (t2,), strict=True)[1], (x,), (t,)))
    xs = torch.stack([perturb_like(x, i) for i in range(3)])
    ts = torch.stack([perturb_like(t, i) for i in range(3)])
    with pytest.raises(TransformArgumentError, match="does not depend"):
        functrans.vmap(lambda a, b: functrans.jvp(_independent, (a,), (b,), strict=True))(
            xs, ts)
    torch.testing.assert_close(
        functrans.vmap(lambda a, b: functrans.jvp(f, (a,), (b,), strict=True))(xs, ts),
        TF.vmap(lambda a, b: TF.jvp(f, (a,), (b,), strict=True))(xs, ts))


# ---- item 15: tangents of another floating dtype ---------------------------------------------

def _mixed(y, w):
    return (y * w).tanh(), y.exp().sum()


@pytest.mark.parametrize("in_dims", [(0, 0), (None, 0), (0, None)])
def test_vmap_jvp_accepts_float64_tangents_for_float32_primals(in_dims):
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(4, 3, generator=g)
    ts = torch.randn(4, 3, generator=g, dtype=torch.float64)
    w = torch.randn(3, generator=g)
    args = (xs if in_dims[0] == 0 else xs[0], ts if in_dims[1] == 0 else ts[0])
    ours = functrans.vmap(lambda p, t: functrans.jvp(lambda y: _mixed(y, w), (p,), (t,)),
                          in_dims=in_dims)(*args)
    ref = TF.vmap(lambda p, t: TF.jvp(lambda y: _mixed(y, w), (p,), (t,)),
                  in_dims=in_dims)(*args)
    # the tangent is used in the primal's precision: float32 tolerances
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(ours[1], ref[1]):
        assert a.dtype == b.dtype == torch.float64


def test_jvp_tangent_dtypes_under_vmap_match_reference():
    x, _, _ = _x()
    xs = torch.stack([perturb_like(x, i) for i in range(3)])
    for tdtype in (torch.float64, torch.float16):
        ts = torch.stack([torch.linspace(-1, 1, 3) * (i + 1) for i in range(3)]).to(tdtype)
        ours = functrans.vmap(lambda p, t: functrans.jvp(torch.sin, (p,), (t,)))(xs, ts)
        ref = TF.vmap(lambda p, t: TF.jvp(torch.sin, (p,), (t,)))(xs, ts)
        assert ours[1].dtype == ref[1].dtype
        torch.testing.assert_close(ours, ref, rtol=1e-3, atol=1e-3)
    # a float32 tangent for a float64 primal, on the double-vjp route too
    xd = xs.double().requires_grad_()
    ours = functrans.vmap(lambda p, t: functrans.jvp(torch.sin, (p,), (t,)))(xd, xs)
    ref = TF.vmap(lambda p, t: TF.jvp(torch.sin, (p,), (t,)))(xd, xs)
    assert ours[1].dtype == ref[1].dtype == torch.float64
    torch.testing.assert_close(ours, ref)
    # an integer tangent is refused clearly (the reference refuses it too)
    ints = torch.ones(3, 3, dtype=torch.int64)
    with pytest.raises(TransformArgumentError, match="tangent for primals\\[0\\]"):
        functrans.vmap(lambda p, t: functrans.jvp(torch.sin, (p,), (t,)))(xs, ints)
    with pytest.raises(ValueError):
        TF.vmap(lambda p, t: TF.jvp(torch.sin, (p,), (t,)))(xs, ints)
    # a complex tangent for a real primal: refused (the reference silently drops or keeps
    # the imaginary part depending on the op)
    with pytest.raises(TransformArgumentError, match="complex64"):
        functrans.vmap(lambda p, t: functrans.jvp(torch.sin, (p,), (t,)))(
            xs, torch.ones(3, 3, dtype=torch.complex64))


def _f64(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


# (name, primal, tangent): forward AD keeps a float64 tangent as given only when it has its
# float32 primal's layout (then sin's output tangent is float64), else copies it into the
# primal's layout and dtype (float32)
_LAYOUTS = [
    ("contiguous", lambda: torch.randn(2, 3), lambda: _f64(2, 3)),
    ("strided", lambda: torch.randn(2, 3), lambda: _f64(2, 3, 5)[..., 0]),
    ("transposed", lambda: torch.randn(2, 3), lambda: _f64(3, 2).t()),
    ("expanded", lambda: torch.randn(2, 3), lambda: _f64(1, 3).expand(2, 3)),
    ("slice of a bigger storage", lambda: torch.randn(2, 3), lambda: _f64(4, 3)[:2]),
    ("storage offset", lambda: torch.randn(2, 3), lambda: _f64(12)[6:].view(2, 3)),
    ("size-1 dim restrided", lambda: torch.randn(1, 3),
     lambda: _f64(1, 3).as_strided((1, 3), (7, 1))),
    ("transposed primal", lambda: torch.randn(3, 2).t(), lambda: _f64(2, 3)),
]


@pytest.mark.parametrize("name,primal,tangent", _LAYOUTS, ids=[c[0] for c in _LAYOUTS])
def test_jvp_tangent_of_another_dtype_outside_vmap_follows_the_reference(name, primal, tangent):
    """Outside vmap the reference accepts a float64 tangent for a float32 primal; its output
    tangent's dtype follows forward AD's make_dual (see jvp's module docstring)."""
    x, t = primal(), tangent()
    ours = functrans.jvp(torch.sin, (x,), (t,))
    ref = TF.jvp(torch.sin, (x,), (t,))
    assert ours[1].dtype == ref[1].dtype
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


_BATCHED_LAYOUTS = [  # (name, primal, batched float64 tangents, in_dim): the reference's dtype
    ("bdim 0", lambda: torch.randn(2, 3), lambda: _f64(5, 2, 3), 0),
    ("bdim 0, slice of a bigger storage", lambda: torch.randn(2, 3), lambda: _f64(7, 2, 3)[:5], 0),
    ("bdim 0, storage offset", lambda: torch.randn(2, 3), lambda: _f64(7, 2, 3)[2:], 0),
    ("bdim 0, expanded", lambda: torch.randn(2, 3), lambda: _f64(1, 2, 3).expand(5, 2, 3), 0),
    ("bdim 0, transposed primal", lambda: torch.randn(3, 2).t(), lambda: _f64(5, 2, 3), 0),
    ("bdim 0, primal sliced", lambda: torch.randn(4, 3)[:2], lambda: _f64(5, 2, 3), 0),
    ("bdim 1", lambda: torch.randn(2, 3), lambda: _f64(2, 5, 3), 1),
    ("bdim -1", lambda: torch.randn(2, 3), lambda: _f64(2, 3, 5), -1),
]


@pytest.mark.parametrize("name,primal,tangents,in_dim", _BATCHED_LAYOUTS,
                         ids=[c[0] for c in _BATCHED_LAYOUTS])
def test_jvp_tangent_of_another_dtype_under_vmap_follows_the_reference(name, primal, tangents,
                                                                       in_dim):
    x, ts = primal(), tangents()
    ours = functrans.vmap(lambda t: functrans.jvp(torch.sin, (x,), (t,))[1], in_dims=in_dim)(ts)
    ref = TF.vmap(lambda t: TF.jvp(torch.sin, (x,), (t,))[1], in_dims=in_dim)(ts)
    assert ours.dtype == ref.dtype
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    loop = torch.stack([TF.jvp(torch.sin, (x,), (t.to(ref.dtype),))[1]
                        for t in ts.movedim(in_dim, 0)])
    torch.testing.assert_close(ours, loop.to(ours.dtype), rtol=1e-6, atol=1e-6)


def test_ggn_product_with_tangents_batched_last_gives_float32_as_the_reference():
    """curvlinops' GGN matrix-vector product under a float64 default dtype: float64 tangents
    batched on their last dim for a float32 nn.Linear.  Each example's tangent is strided, so
    forward AD copies it into the float32 parameter's layout and dtype: float32 tangents out
    (functrans gave float64).  Outside vmap, one strided example gives float32 as well."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    params = tuple(model.parameters())
    x = torch.randn(4, 3)
    vw, vb = _f64(2, 3, 5), _f64(2, 5, seed=1)
    f = lambda w, b: torch.nn.functional.linear(x, w, b)  # noqa: E731
    outs = [M.vmap(lambda a, b: M.jvp(f, params, (a, b))[1], in_dims=(2, 1), out_dims=2)(vw, vb)
            for M in (functrans, TF)]
    assert outs[0].dtype == outs[1].dtype == torch.float32
    torch.testing.assert_close(outs[0], outs[1])
    loop = torch.stack([x @ vw[..., i].float().t() + vb[:, i].float() for i in range(5)], 2)
    torch.testing.assert_close(outs[0], loop)
    one = functrans.jvp(f, params, (vw[..., 0], vb[:, 0]))[1]
    assert one.dtype == TF.jvp(f, params, (vw[..., 0], vb[:, 0]))[1].dtype == torch.float32
    torch.testing.assert_close(one, loop[..., 0])


def test_linearize_jvp_fn_refuses_another_dtype_outside_vmap_as_the_reference():
    x, _, _ = _x()
    t = torch.linspace(-1, 1, 3, dtype=torch.float64)
    _, ref_fn = TF.linearize(torch.sin, x)
    with pytest.raises(RuntimeError, match="dtype"):
        ref_fn(t)
    _, jvp_fn = functrans.linearize(torch.sin, x)
    with pytest.raises(TransformArgumentError,
                       match=r"tangent for primals\[0\] has dtype torch.float64.*"
                             r"\.to\(torch.float32\)"):
        jvp_fn(t)


def test_linearize_jvp_fn_with_float64_tangents_under_vmap():
    x, _, _ = _x()
    ts = torch.stack([torch.linspace(-1, 1, 3) * (i + 1) for i in range(4)]).double()
    _, jvp_fn = functrans.linearize(torch.sin, x)
    ours = functrans.vmap(jvp_fn)(ts)
    ref = TF.vmap(lambda t: TF.jvp(torch.sin, (x,), (t,))[1])(ts)
    assert ours.dtype == ref.dtype == torch.float64
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


def test_ggn_vector_products_under_float64_default_dtype():
    """laplace-torch's FullLaplace with curvlinops' GGN: a float32 model, tangents made under
    torch.set_default_dtype(torch.float64), pushed with vmap(jvp).  The reference raises
    inside F.linear's forward formula here ('expected scalar type Float but found Double'), so
    the oracles are the reference with the tangents cast to float32, promoted back, and the
    reference on a float64 copy of the model.  Both within float32 tolerances: PyTorch defines
    no precision for a float64 tangent of a float32 primal (its own forward AD refuses one),
    and the float32 oracle's rounding differs from ours by a float32 ulp, which the default
    float64 tolerances of the comparison rejected on some CPUs."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    params = dict(model.named_parameters())
    x = torch.randn(5, 3)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        vs = {k: torch.randn(4, *p.shape) for k, p in params.items()}  # float64 tangents

        def push(M, vs):
            def one(v):
                f = lambda p: M.functional_call(model, p, (x,))  # noqa: E731
                return M.jvp(f, (params,), (v,))[1]
            return M.vmap(one)(vs)
        ours = push(functrans, vs)
        with pytest.raises(RuntimeError, match="Float but found Double"):
            push(TF, vs)
        ref = push(TF, {k: v.float() for k, v in vs.items()}).double()
        model64 = copy.deepcopy(model).double()
        params64 = dict(model64.named_parameters())
        ref64 = TF.vmap(lambda v: TF.jvp(lambda p: TF.functional_call(model64, p, (x.double(),)),
                                         (params64,), (v,))[1])(vs)
    finally:
        torch.set_default_dtype(old)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, ref, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(ours, ref64, rtol=1.3e-6, atol=1e-5)
