"""functrans transforms inside torch.compile (functrans/compiler/dynamo_entry.py): one opaque
nonstrict_trace call per transform, no graph break (fullgraph=True), no recompilation across
calls of the same shapes, results equal to functrans eager and to torch.func (the reference)."""
import pytest
import torch
import torch.func as tf
from torch._dynamo.testing import CompileCounterWithBackend

import functrans as ft


def _loss(p, x, y):
    return ((torch.tanh(x @ p) - y) ** 2).sum()


def _mlp(p, x):
    return torch.tanh(x @ p)


P, X, Y = torch.randn(4, 3), torch.randn(8, 4), torch.randn(8, 3)

CASES = {
    "vmap_grad": (lambda M: lambda p, x, y: M.vmap(M.grad(_loss), in_dims=(None, 0, 0))(p, x, y),
                  (P, X, Y)),
    "grad": (lambda M: lambda p, x, y: M.grad(_loss)(p, x, y), (P, X, Y)),
    "grad_and_value": (lambda M: lambda p, x, y: M.grad_and_value(_loss, argnums=(0, 1))(p, x, y),
                       (P, X, Y)),
    "vjp": (lambda M: lambda p, x: (lambda o, f: (o, f(torch.ones_like(o))))(*M.vjp(_mlp, p, x)),
            (P, X)),
    "jvp": (lambda M: lambda p, x: M.jvp(_mlp, (p, x), (torch.ones_like(p), torch.zeros_like(x))),
            (P, X)),
    "jacrev": (lambda M: lambda p, x: M.jacrev(_mlp)(p, x[0]), (P, X)),
    "jacfwd": (lambda M: lambda p, x: M.jacfwd(_mlp, argnums=1)(p, x[0]), (P, X)),
    "hessian": (lambda M: lambda p, x, y: M.hessian(_loss)(p, x, y), (P, X, Y)),
    "vmap_jacrev": (lambda M: lambda p, x: M.vmap(M.jacrev(_mlp), in_dims=(None, 0))(p, x), (P, X)),
    "jacfwd_jacrev": (lambda M: lambda p, x: M.jacfwd(M.jacrev(_mlp, argnums=1), argnums=1)(p, x[0]),
                      (P, X)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiles_in_one_graph_without_recompiling(name):
    make, args = CASES[name]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(make(ft), backend=counter, fullgraph=True)
    outs = [compiled(*args) for _ in range(3)]
    assert counter.frame_count == 1            # compiled once, then reused: no recompilation
    for out in outs:
        torch.testing.assert_close(out, make(ft)(*args))    # functrans eager
        torch.testing.assert_close(out, make(tf)(*args))    # the reference


def test_inductor_per_sample_grads():
    make, args = CASES["vmap_grad"]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(make(ft), backend=counter, fullgraph=True)
    for _ in range(2):
        torch.testing.assert_close(compiled(*args), make(tf)(*args))
    assert counter.frame_count == 1


def test_outer_backward_through_compiled_grad():
    torch._dynamo.reset()
    p = P.clone().requires_grad_()
    compiled = torch.compile(lambda p, x: ft.grad(_loss)(p, x, Y), backend="aot_eager",
                             fullgraph=True)
    compiled(p, X).sum().backward()
    ref = P.clone().requires_grad_()
    tf.grad(_loss)(ref, X, Y).sum().backward()
    torch.testing.assert_close(p.grad, ref.grad)


def test_randomness_different_and_same():
    torch._dynamo.reset()
    diff = torch.compile(lambda x: ft.vmap(lambda r: r + torch.randn(()),
                                           randomness="different")(x),
                         backend="aot_eager", fullgraph=True)
    a, b = diff(torch.zeros(4000)), diff(torch.zeros(4000))
    assert abs(a.mean().item()) < 0.1 and abs(a.std().item() - 1) < 0.1   # N(0, 1) per example
    assert not torch.equal(a, b)                                             # fresh per call
    same = torch.compile(lambda x: ft.vmap(lambda r: r + torch.randn(()), randomness="same")(x),
                         backend="aot_eager", fullgraph=True)
    c, d = same(torch.zeros(50)), same(torch.zeros(50))
    assert torch.all(c == c[0]) and torch.all(d == d[0])     # one draw shared by the batch
    assert c[0] != d[0]                                      # drawn afresh on each call


_W = torch.ones(3)


def _reads_global(x):
    return (x * _W).sum()


def test_a_global_tensor_is_read_afresh_not_baked_in():
    """A tensor read from a global is not a graph constant: Dynamo graph-breaks there and the
    transform runs eagerly, so rebinding the global is seen (never a stale result)."""
    global _W
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: ft.grad(_reads_global)(x) * 1, backend="aot_eager")
    x = torch.randn(3)
    saved = _W
    try:
        torch.testing.assert_close(compiled(x), torch.ones(3))
        _W.mul_(2)
        torch.testing.assert_close(compiled(x), torch.full((3,), 2.))
        _W = torch.full((3,), 5.)
        torch.testing.assert_close(compiled(x), torch.full((3,), 5.))
    finally:
        _W = saved
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch._dynamo.reset()
        torch.compile(lambda x: ft.grad(_reads_global)(x), backend="aot_eager",
                      fullgraph=True)(x)


def test_vjp_fn_called_outside_the_compiled_region():
    torch._dynamo.reset()
    out, vjp_fn = torch.compile(lambda p, x: ft.vjp(_mlp, p, x), backend="aot_eager")(P, X)
    ct = torch.randn_like(out)
    ref_out, ref_fn = tf.vjp(_mlp, P, X)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(vjp_fn(ct), ref_fn(ct))


def test_eager_mode_does_not_route():
    from functrans.compiler import dynamo_entry
    assert not dynamo_entry.active()
    torch.testing.assert_close(ft.vmap(torch.sin)(X), torch.sin(X))


# A function made inside the compiled region that closes over tensors of the region: the tensors
# are lifted into inputs of the opaque call (dynamo_entry._lift), so it compiles in one graph.
W3, X3, XS3 = torch.randn(3), torch.randn(3), torch.randn(5, 3)
_LIN = torch.nn.Linear(3, 2)

CLOSURES = {
    "grad": lambda M: lambda w, x, xs: M.grad(lambda y: (torch.sin(y) * w).sum())(x),
    "in_region_tensor": lambda M: lambda w, x, xs: (
        lambda w2: M.grad(lambda y: (torch.sin(y) * w2).sum())(x))(w * 2),
    "int_and_function": lambda M: lambda w, x, xs: (
        lambda k, g: M.grad(lambda y: (g(y) * w * k).sum())(x))(3, torch.cos),
    "list_of_tensors": lambda M: lambda w, x, xs: (
        lambda ws: M.grad(lambda y: (y * ws[0] * ws[1]).sum())(x))([w, w + 1]),
    "has_aux": lambda M: lambda w, x, xs: M.grad(
        lambda y: ((torch.sin(y) * w).sum(), y * w), has_aux=True)(x),
    "vmap_grad": lambda M: lambda w, x, xs: M.vmap(
        M.grad(lambda p, xi: (torch.sin(p * xi) * w).sum()), in_dims=(None, 0))(x, xs),
    "closures_at_both_levels": lambda M: lambda w, x, xs: M.vmap(
        lambda xi: M.grad(lambda p: (torch.sin(p * xi) * w).sum())(x))(xs),
    "jacrev": lambda M: lambda w, x, xs: M.jacrev(lambda y: torch.sin(y * w))(x),
    "jvp": lambda M: lambda w, x, xs: M.jvp(lambda y: torch.sin(y * w), (x,),
                                            (torch.ones_like(x),)),
    "vjp": lambda M: lambda w, x, xs: (lambda o, f: (o, f(torch.ones_like(o))))(
        *M.vjp(lambda y: torch.sin(y * w), x)),
    "hessian": lambda M: lambda w, x, xs: M.hessian(lambda y: (torch.sin(y) * w).sum())(x),
}


@pytest.mark.parametrize("name", sorted(CLOSURES))
def test_closure_over_region_tensors_compiles_in_one_graph(name):
    make = CLOSURES[name]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(make(ft), backend=counter, fullgraph=True)
    for _ in range(2):
        w = torch.randn(3)      # fresh values each call: read as inputs, never baked in
        out = compiled(w, X3, XS3)
        torch.testing.assert_close(out, make(ft)(w, X3, XS3))    # functrans eager
        torch.testing.assert_close(out, make(tf)(w, X3, XS3))    # the reference
    assert counter.frame_count == 1


def test_closure_over_region_tensor_with_inductor_and_outer_backward():
    make = CLOSURES["closures_at_both_levels"]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(make(ft), backend=counter, fullgraph=True)
    w, ref_w = W3.clone().requires_grad_(), W3.clone().requires_grad_()
    (compiled(w, X3, XS3) ** 2).sum().backward()
    (make(tf)(ref_w, X3, XS3) ** 2).sum().backward()
    torch.testing.assert_close(w.grad, ref_w.grad)
    assert counter.frame_count == 1


def test_outer_backward_through_a_non_differentiated_argument():
    """The result of grad depends on a closed-over tensor (or an argument outside argnums) that
    requires grad: it stays differentiable inside torch.compile, as in eager and torch.func."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda w, x: ft.grad(lambda y, v: (torch.sin(y) * v).sum())(x, w),
                             backend="aot_eager", fullgraph=True)
    w, ref_w = W3.clone().requires_grad_(), W3.clone().requires_grad_()
    (compiled(w, X3) + w).sum().backward()
    (tf.grad(lambda y, v: (torch.sin(y) * v).sum())(X3, ref_w) + ref_w).sum().backward()
    torch.testing.assert_close(w.grad, ref_w.grad)


def test_closure_also_reading_a_module_graph_breaks_to_eager():
    """The closed-over in-region tensor is lifted, but the module's parameters (read through
    a global) are real tensors: Dynamo graph-breaks and the transform runs eagerly."""
    make = lambda M: lambda w, x: M.grad(lambda y: _LIN(y * w).sum())(x)  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(make(ft), backend="aot_eager")
    torch.testing.assert_close(compiled(W3, X3), make(tf)(W3, X3))
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch._dynamo.reset()
        torch.compile(make(ft), backend="aot_eager", fullgraph=True)(W3, X3)


def test_closure_that_cannot_be_lifted_graph_breaks_cleanly():
    """A function of the region that closes over itself (recursion) and a tensor: not liftable,
    so an ordinary graph break (the transform runs eagerly); fullgraph raises Unsupported."""
    def fn(w, x):
        def f(y, n=1):
            return (torch.sin(y) * w).sum() if n == 0 else f(y, n - 1)
        return ft.grad(f)(x)
    torch._dynamo.reset()
    ref = tf.grad(lambda y: (torch.sin(y) * W3).sum())(X3)
    torch.testing.assert_close(torch.compile(fn, backend="aot_eager")(W3, X3), ref)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="closes over itself"):
        torch.compile(fn, backend="aot_eager", fullgraph=True)(W3, X3)
