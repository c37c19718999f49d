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
