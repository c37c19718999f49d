"""functrans.functionalize against the reference transform (values, input write-back, traced
graphs) and composed with every functrans transform, in both orders."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import functrans
from functrans import functionalize
from tests.support.oracles import assert_same, loop_oracle

ref = torch.func


def views_and_writes(a):
    b = a + 1
    c = b.view(-1)
    c.add_(1)
    d = torch.zeros(a.shape[-1])
    d[1] = 2.0
    return b * d.sum() * a


def mutates_input(a):
    b = a.view(-1)
    b.mul_(2)
    return a * a


def pytree_fn(inp):
    x, y = inp["x"], inp["y"]
    x.add_(y)
    z = y.clone()
    z[0].mul_(3)
    return {"sum": (x * z).sum(), "pair": (z, x.sin())}


def _ops(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("remove", ["mutations", "mutations_and_views"])
@pytest.mark.parametrize("fn", [views_and_writes, mutates_input])
def test_values_write_back_and_graph_match_reference(fn, remove):
    x = torch.randn(3)
    x1, x2 = x.clone(), x.clone()
    assert_same(functionalize(fn, remove=remove)(x1), fn(x2.clone()))
    assert_same(functionalize(fn, remove=remove)(x.clone()),
                ref.functionalize(fn, remove=remove)(x.clone()))
    x3 = x.clone()
    ref.functionalize(fn, remove=remove)(x3)
    assert_same(x1, x3)  # the input's mutation is written back as the reference does
    ours = make_fx(functionalize(fn, remove=remove))(x.clone())
    theirs = make_fx(ref.functionalize(fn, remove=remove))(x.clone())
    assert _ops(ours) == _ops(theirs)
    mutating = [o for o in _ops(ours) if o.split(".")[1].endswith("_")]
    assert mutating == (["aten.copy_.default"] if fn is mutates_input else [])
    views = {"aten.view.default", "aten.select.int"}
    if remove == "mutations_and_views":
        assert not views & set(_ops(ours)) and "aten.view_copy.default" in _ops(ours)
    else:
        assert "aten.view.default" in _ops(ours)


def test_pytrees_in_and_out():
    inp = {"x": torch.randn(4), "y": torch.randn(4)}
    a = {k: v.clone() for k, v in inp.items()}
    b = {k: v.clone() for k, v in inp.items()}
    assert_same(functionalize(pytree_fn)(a), ref.functionalize(pytree_fn)(b))
    assert_same(a, b)


def test_vmap_over_functionalize_matches_loop_and_reference():
    X = torch.randn(4, 3)
    assert_same(functrans.vmap(functionalize(views_and_writes))(X),
                loop_oracle(views_and_writes, (0,), 4, X))
    X1, X2 = X.clone(), X.clone()
    out = functrans.vmap(functionalize(mutates_input))(X1)
    assert_same(out, ref.vmap(ref.functionalize(mutates_input))(X2))
    assert_same(X1, X2)


def test_functionalize_over_vmap_matches_reference_and_traces_without_mutations():
    X = torch.randn(4, 3)
    assert_same(functionalize(functrans.vmap(views_and_writes))(X),
                loop_oracle(views_and_writes, (0,), 4, X))
    X1, X2 = X.clone(), X.clone()
    assert_same(functionalize(functrans.vmap(mutates_input))(X1),
                ref.functionalize(ref.vmap(mutates_input))(X2))
    assert_same(X1, X2)
    def batched_writes(a):
        b = a + 1
        b.view(-1)[1:].mul_(a[:2])
        return b * a

    gm = make_fx(functionalize(functrans.vmap(batched_writes)))(X)
    assert not [o for o in _ops(gm) if o.split(".")[1].endswith("_")]
    assert_same(gm(X), loop_oracle(batched_writes, (0,), 4, X))
    gm = make_fx(functionalize(functrans.vmap(mutates_input)))(X.clone())
    assert [o for o in _ops(gm) if o.split(".")[1].endswith("_")] == ["aten.copy_.default"]


def _copying(fn):
    return lambda x: fn(x.clone())


def test_reverse_mode_over_functionalize():
    x = torch.randn(3)
    X = torch.randn(4, 3)
    for fn in (views_and_writes, _copying(mutates_input)):
        loss = lambda x, fn=fn: fn(x).sum()  # noqa: E731
        assert_same(functrans.grad(lambda x: functionalize(fn)(x).sum())(x), ref.grad(loss)(x))
        assert_same(functrans.jacrev(functionalize(fn))(x), ref.jacrev(fn)(x))
        out, pull = functrans.vjp(functionalize(fn), x)
        ref_out, ref_pull = ref.vjp(fn, x)
        v = torch.randn(3)
        assert_same(out, ref_out)
        assert_same(pull(v), ref_pull(v))
        assert_same(functrans.vmap(functrans.grad(lambda x: functionalize(fn)(x).sum()))(X),
                    ref.vmap(ref.grad(loss))(X))
        assert_same(functrans.grad(lambda x: functionalize(functrans.vmap(fn))(x).sum())(X),
                    ref.grad(lambda x: ref.vmap(fn)(x).sum())(X))


def test_jvp_over_functionalize_with_in_place_ops():
    x, t = torch.randn(3), torch.randn(3)
    for fn in (views_and_writes, _copying(mutates_input),
               lambda a: a.clone().mul_(a).view(-1).add_(1)):
        ours = functrans.jvp(functionalize(fn), (x,), (t,))
        assert_same(ours, ref.jvp(fn, (x,), (t,)))


def scaled_sin(x):
    # a Python scalar operand (forward AD makes its zero tangent with _efficientzerotensor)
    return (x.clone().mul_(2).sin() * x).sum(0)


def view_writes(x):
    y = x.clone()
    y.view(-1)[1:].add_(x.reshape(-1)[:-1].sin())  # an in-place op on a view (CopySlices)
    return (y * x).sum(0)


_CT, _T = torch.randn(4), torch.randn(3, 4)


def _vjp(lib, fn):
    def run(x):
        out, pull = lib.vjp(fn, x)
        return out, pull(_CT)
    return run


def _linearize(lib, fn):
    if lib is ref:
        # torch.func.linearize's jvp_fn gives wrong tangents for view_writes (an in-place op
        # on a view; torch 2.13), so the reference is torch.func.jvp on the same inputs
        return lambda x: lib.jvp(fn, (x,), (_T,))

    def run(x):
        out, push = lib.linearize(fn, x)
        return out, push(_T)
    return run


# name -> (build(lib, fn), batched input?): each builds the transform of a function x [3, 4]
# -> [4] (reduced to a scalar where the transform needs one).
TRANSFORMS = {
    "vmap": (lambda lib, fn: lib.vmap(fn), True),
    "grad": (lambda lib, fn: lib.grad(lambda x: fn(x).sum()), False),
    "vjp": (_vjp, False),
    "jvp": (lambda lib, fn: lambda x: lib.jvp(fn, (x,), (_T,)), False),
    "jacrev": (lambda lib, fn: lib.jacrev(fn), False),
    "jacfwd": (lambda lib, fn: lib.jacfwd(fn), False),
    "hessian": (lambda lib, fn: lib.hessian(lambda x: fn(x).sum()), False),
    "linearize": (_linearize, False),
    "vmap_grad": (lambda lib, fn: lib.vmap(lib.grad(lambda x: fn(x).sum())), True),
    "vmap_jvp": (lambda lib, fn: lambda x: lib.vmap(lambda t: lib.jvp(fn, (x,), (t,)))(
        torch.stack([_T, -2 * _T])), False),
}


@pytest.mark.parametrize("fn", [scaled_sin, view_writes])
@pytest.mark.parametrize("order", ["transform_of_functionalize", "functionalize_of_transform"])
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_every_transform_composes_with_functionalize(name, order, fn):
    build, batched = TRANSFORMS[name]
    x = torch.randn(2, 3, 4) if batched else torch.randn(3, 4)

    def composed(lib):
        if order == "transform_of_functionalize":
            return build(lib, lib.functionalize(fn))
        return lib.functionalize(build(lib, fn))

    ours = composed(functrans)(x.clone())
    try:
        expected = composed(ref)(x.clone())
    except Exception:  # torch.func refuses this composition: its transform of fn itself
        expected = build(ref, fn)(x.clone())
    assert_same(ours, expected, atol=1e-5, rtol=1e-5)
    assert_same(ours, build(ref, fn)(x.clone()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["jacrev", "jacfwd", "hessian", "vmap_grad"])
def test_functionalize_of_jacobians_traces_without_mutations(name):
    build, batched = TRANSFORMS[name]
    x = torch.randn(2, 3, 4) if batched else torch.randn(3, 4)
    for fn in (scaled_sin, view_writes):
        gm = make_fx(functionalize(build(functrans, fn)))(x.clone())
        assert not [o for o in _ops(gm) if o.split(".")[1].endswith("_")], _ops(gm)
        assert_same(gm(x.clone()), build(ref, fn)(x.clone()), atol=1e-5, rtol=1e-5)


def test_forward_ad_of_the_user_over_functionalize_under_vmap_is_refused_clearly():
    import torch.autograd.forward_ad as fwAD
    x = torch.randn(3)

    def push(t):
        with fwAD.dual_level():
            out = functionalize(torch.sin)(fwAD.make_dual(x, t))
            return fwAD.unpack_dual(out).tangent

    with pytest.raises(functrans.FunctransError, match="forward-mode AD.*under vmap"):
        functrans.vmap(push)(torch.eye(3))


def test_bad_remove_and_func():
    with pytest.raises(functrans.TransformArgumentError, match="mutations_and_views"):
        functionalize(views_and_writes, remove="views")
    with pytest.raises(functrans.TransformArgumentError, match="callable"):
        functionalize(3)


def test_input_metadata_mutation_is_refused_clearly():
    with pytest.raises(functrans.FunctransError, match=r"shape or strides.*args\[0\]"):
        functionalize(lambda a: a.transpose_(0, 1))(torch.randn(2, 3))


def test_returning_an_input_gives_an_alias_not_the_callers_tensor():
    x = torch.randn(3, requires_grad=True)
    out = functionalize(lambda a: a)(x)
    assert out is not x and x.grad_fn is None
    assert_same(out, x)


@pytest.mark.parametrize("transform", ["grad", "jacrev", "jacfwd", "hessian"])
def test_writing_into_a_differentiated_input_is_refused_clearly(transform):
    # torch.func.grad raises PyTorch's "a leaf Variable that requires grad is being used in an
    # in-place operation" here; functrans names the input and the fix for every transform
    fn = functionalize(lambda x: x.mul_(2).sin())
    if transform in ("grad", "hessian"):
        t = getattr(functrans, transform)(lambda x: fn(x).sum())
    else:
        t = getattr(functrans, transform)(fn)
    with pytest.raises(functrans.FunctransError, match=r"wrote in place into its input args\[0\]"):
        t(torch.randn(3))


def _per_example_writes(a):
    b = a.clone()
    b.view(-1)[1:].mul_(a[:2])
    return b * a


@pytest.mark.parametrize("compose", ["F(F)", "F(vmap(F))", "vmap(F(vmap(F)))", "F(vmap(vmap))"])
def test_nested_functionalize(compose):
    # a functionalize inside another, directly or across a vmap (this crashed in PyTorch: an
    # internal assert for F(F), a segmentation fault for F(vmap(F)))
    F, vmap = functionalize, functrans.vmap
    X = torch.randn(2, 4, 3)
    fn, x = {"F(F)": (F(F(_per_example_writes)), X[0, 0]),
             "F(vmap(F))": (F(vmap(F(_per_example_writes))), X[0]),
             "vmap(F(vmap(F)))": (vmap(F(vmap(F(_per_example_writes)))), X),
             "F(vmap(vmap))": (F(vmap(vmap(_per_example_writes))), X)}[compose]
    expected = ref.vmap(ref.vmap(_per_example_writes))(X)
    expected = expected[0, 0] if x.dim() == 1 else expected[0] if x.dim() == 2 else expected
    assert_same(fn(x.clone()), expected)
    gm = make_fx(fn)(x.clone())
    assert not [o for o in _ops(gm) if o.split(".")[1].endswith("_")], _ops(gm)


def test_input_write_back_through_nested_functionalize():
    def g(a):
        a.mul_(2)
        return a.sin()

    x1, x2 = torch.randn(3), None
    x2 = x1.clone()
    assert_same(functionalize(functionalize(g))(x1), g(x2))
    assert_same(x1, x2)
