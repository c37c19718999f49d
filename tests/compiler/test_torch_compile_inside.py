"""torch.compile INSIDE functrans's transforms (functrans/batching/compile_boundary.py).

Under a vmap (vmap, vmap of vmap, vmap of grad, grad of vmap, jacfwd...) a torch.compile'd
function runs eagerly through functrans's rules, after exactly one ``CompileWarning`` per vmap
call, and dynamo converts none of the engine's frames (no graph break, no graph).  Under grad,
vjp and jvp without a vmap it is compiled (one graph, no break).  jacrev retries eagerly, with a
warning, when the compiled backward refuses its batched cotangents.  Every result is compared
with the eager function under the same functrans transform and, where torch.func has the
transform, with torch.func on the uncompiled function (torch.func does not compile inside its
transforms either)."""
import warnings

import pytest
import torch
import torch._dynamo
import torch.func
from torch._dynamo.utils import counters

import functrans
from functrans import CompileWarning
from functrans.errors import UnsupportedUnderVmap

BACKEND = "aot_eager"   # dynamo + AOTAutograd, as inductor, without the C++ compile time


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _f(x):
    y = x.sin() * 2
    return y.sum(0) + x.cos().mean()


def _compile_warnings(record):
    return [w for w in record if issubclass(w.category, CompileWarning)]


def _run(fn, *args):
    """fn(*args), the CompileWarnings it raised, and what dynamo did meanwhile."""
    counters.clear()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = fn(*args)
    graphs = counters["stats"].get("unique_graphs", 0)
    breaks = sum(counters["graph_break"].values()) + sum(counters["unimplemented"].values())
    return out, _compile_warnings(record), graphs, breaks


def _assert_eager_once(warned, graphs, breaks):
    assert len(warned) == 1, [str(w.message) for w in warned]
    assert "runs eagerly" in str(warned[0].message)
    assert graphs == 0 and breaks == 0, (graphs, breaks)   # no fragment of the engine compiled


def _assert_compiled(warned, graphs, breaks):
    assert not warned, [str(w.message) for w in warned]
    assert graphs == 1 and breaks == 0, (graphs, breaks)


# ------------------------------------------------------------------------------------- vmap
def test_vmap_of_compiled_runs_eagerly_with_one_warning_and_no_graph_break():
    x = torch.randn(4, 3, 5)
    out, warned, graphs, breaks = _run(functrans.vmap(torch.compile(_f, backend=BACKEND)), x)
    _assert_eager_once(warned, graphs, breaks)
    torch.testing.assert_close(out, functrans.vmap(_f)(x))
    torch.testing.assert_close(out, torch.func.vmap(_f)(x))


def test_vmap_of_a_function_calling_a_compiled_module():
    lin = torch.nn.Linear(5, 2)
    compiled = torch.compile(lin, backend=BACKEND)
    x = torch.randn(4, 3, 5)
    out, warned, graphs, breaks = _run(functrans.vmap(lambda t: compiled(t).relu()), x)
    _assert_eager_once(warned, graphs, breaks)
    torch.testing.assert_close(out, torch.func.vmap(lambda t: lin(t).relu())(x))


def test_each_vmap_call_warns_once():
    compiled = torch.compile(_f, backend=BACKEND)
    batched = functrans.vmap(lambda t: compiled(t) + compiled(t * 2))
    x = torch.randn(4, 3, 5)
    for _ in range(2):
        out, warned, graphs, breaks = _run(batched, x)
        _assert_eager_once(warned, graphs, breaks)
    torch.testing.assert_close(out, functrans.vmap(lambda t: _f(t) + _f(t * 2))(x))


def test_warning_names_the_compiled_function_and_points_at_it():
    x = torch.randn(4, 3, 5)
    _, warned, _, _ = _run(functrans.vmap(torch.compile(_f, backend=BACKEND)), x)
    assert "(_f)" in str(warned[0].message)
    assert warned[0].filename == __file__ and warned[0].lineno == _f.__code__.co_firstlineno


def test_compiled_again_outside_after_a_call_under_vmap():
    """Dynamo marks a frame skipped for a dispatch mode as skipped for good; the mark is undone
    when the vmap exits, so the function compiles outside the vmap afterwards."""
    compiled = torch.compile(_f, backend=BACKEND)
    x = torch.randn(4, 3, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompileWarning)
        functrans.vmap(compiled)(x)
    out, warned, graphs, breaks = _run(compiled, x[0])
    _assert_compiled(warned, graphs, breaks)
    torch.testing.assert_close(out, _f(x[0]))
    out, warned, graphs, breaks = _run(functrans.vmap(compiled), x)   # and eager again inside
    _assert_eager_once(warned, graphs, breaks)
    torch.testing.assert_close(out, functrans.vmap(_f)(x))


# ------------------------------------------------------------------- autodiff without vmap
def test_grad_of_compiled_is_compiled():
    x = torch.randn(3, 5)
    compiled = torch.compile(_f, backend=BACKEND)
    out, warned, graphs, breaks = _run(functrans.grad(lambda t: compiled(t).sum()), x)
    _assert_compiled(warned, graphs, breaks)
    torch.testing.assert_close(out, torch.func.grad(lambda t: _f(t).sum())(x))


def test_vjp_and_jvp_of_compiled_are_compiled():
    x, t = torch.randn(3, 5), torch.randn(3, 5)
    out, warned, graphs, breaks = _run(
        lambda: functrans.jvp(torch.compile(_f, backend=BACKEND), (x,), (t,)))
    _assert_compiled(warned, graphs, breaks)
    ref = torch.func.jvp(_f, (x,), (t,))
    torch.testing.assert_close(out, ref)
    torch._dynamo.reset()
    ct = torch.randn(5)
    (out, fn), warned, graphs, breaks = _run(
        lambda: functrans.vjp(torch.compile(_f, backend=BACKEND), x))
    _assert_compiled(warned, graphs, breaks)
    torch.testing.assert_close(fn(ct), torch.func.vjp(_f, x)[1](ct))


def test_jacrev_of_compiled_retries_eagerly_with_one_warning():
    x = torch.randn(5)
    compiled = torch.compile(lambda t: t.sin() * t.sum(), backend=BACKEND)
    out, warned, _, _ = _run(functrans.jacrev(compiled), x)
    assert len(warned) == 1 and "run again" in str(warned[0].message)
    torch.testing.assert_close(out, torch.func.jacrev(lambda t: t.sin() * t.sum())(x))
    # a scalar output takes one vjp, no vmap: compiled, no retry
    torch._dynamo.reset()
    out, warned, graphs, breaks = _run(functrans.jacrev(lambda t: compiled(t).sum()), x)
    _assert_compiled(warned, graphs, breaks)
    torch.testing.assert_close(out, torch.func.jacrev(lambda t: (t.sin() * t.sum()).sum())(x))


def test_vmap_of_vjp_fn_of_compiled_retries_eagerly_with_one_warning():
    # The PyTorch release-notes Jacobian: vjp once, then vmap of vjp_fn over the basis.
    w, b, x = torch.randn(6, 6), torch.randn(6), torch.randn(6)
    predict = lambda t: torch.nn.functional.linear(t, w, b).tanh()   # noqa: E731
    compiled = torch.compile(predict, backend=BACKEND)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _, vjp_fn = functrans.vjp(compiled, x)
        (jac,) = functrans.vmap(vjp_fn)(torch.eye(6))
        (row,) = vjp_fn(torch.ones(6))   # one cotangent: the compiled backward, no retry
    warned = _compile_warnings(record)
    assert len(warned) == 1 and "run again" in str(warned[0].message)
    _, ref_vjp = torch.func.vjp(predict, x)
    torch.testing.assert_close(jac, torch.func.vmap(ref_vjp)(torch.eye(6))[0])
    torch.testing.assert_close(row, ref_vjp(torch.ones(6))[0])


def test_jacfwd_and_hessian_of_compiled():
    x = torch.randn(4)
    g = lambda t: (t.sin() * t.sum()).sum()   # noqa: E731
    compiled = torch.compile(g, backend=BACKEND)
    sin = lambda t: t.sin()   # noqa: E731
    out, warned, graphs, breaks = _run(functrans.jacfwd(torch.compile(sin, backend=BACKEND)), x)
    _assert_eager_once(warned, graphs, breaks)   # jacfwd is a vmap of jvp
    torch.testing.assert_close(out, torch.func.jacfwd(sin)(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompileWarning)
        out = functrans.hessian(compiled)(x)
    torch.testing.assert_close(out, torch.func.hessian(g)(x))


# ------------------------------------------------------------------------------------ nested
@pytest.mark.parametrize("nest", ["vmap_vmap", "vmap_grad", "grad_vmap", "vmap_jvp"])
def test_nested(nest):
    x = torch.randn(4, 3, 5)
    compiled = torch.compile(_f, backend=BACKEND)
    V, G = functrans.vmap, functrans.grad
    tv, tg = torch.func.vmap, torch.func.grad
    build = {
        "vmap_vmap": lambda vm, gr, fn: vm(vm(fn)),
        "vmap_grad": lambda vm, gr, fn: vm(gr(lambda t: fn(t).sum())),
        "grad_vmap": lambda vm, gr, fn: gr(lambda t: vm(fn)(t).sum()),
        "vmap_jvp": lambda vm, gr, fn: vm(
            lambda t: (functrans.jvp if vm is V else torch.func.jvp)(fn, (t,), (t.cos(),))[1]),
    }[nest]
    out, warned, graphs, breaks = _run(build(V, G, compiled), x)
    _assert_eager_once(warned, graphs, breaks)
    torch.testing.assert_close(out, build(V, G, _f)(x))
    torch.testing.assert_close(out, build(tv, tg, _f)(x))


# -------------------------------------------------------------------------------- randomness
def _noisy(x):
    return x + torch.randn(5) + torch.rand_like(x)


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_randomness_matches_eager_with_the_same_seed(randomness):
    x = torch.randn(4, 5)
    torch.manual_seed(3)
    out, warned, graphs, breaks = _run(
        functrans.vmap(torch.compile(_noisy, backend=BACKEND), randomness=randomness), x)
    _assert_eager_once(warned, graphs, breaks)
    torch.manual_seed(3)
    ref = functrans.vmap(_noisy, randomness=randomness)(x)
    torch.testing.assert_close(out, ref)
    noise = out - x
    differs = not torch.allclose(noise[0], noise[1])
    assert differs == (randomness == "different")


def _assert_same_error_as_eager(fn, x, error=Exception):
    """functrans.vmap of the compiled ``fn`` raises eager's error, with eager's message."""
    with pytest.raises(error) as eager:
        functrans.vmap(fn)(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompileWarning)
        with pytest.raises(type(eager.value)) as compiled:
            functrans.vmap(torch.compile(fn, backend=BACKEND))(x)
    assert str(compiled.value) == str(eager.value)


def test_randomness_error_raises_as_in_eager():
    _assert_same_error_as_eager(_noisy, torch.randn(4, 5))


# ---------------------------------------------------------------------------------- in place
def test_in_place_ops_inside_the_compiled_function():
    def scaled(x):
        y = x.clone()
        y.mul_(2).add_(1)
        return y

    def writes_input(x):
        x.mul_(2)
        return x.sum()

    x = torch.randn(4, 3)
    out, warned, _, _ = _run(functrans.vmap(torch.compile(scaled, backend=BACKEND)), x)
    assert len(warned) == 1
    torch.testing.assert_close(out, x * 2 + 1)
    a, b = x.clone(), x.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompileWarning)
        out = functrans.vmap(torch.compile(writes_input, backend=BACKEND))(a)
    ref = torch.func.vmap(writes_input)(b)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(a, b)   # the input was written as in eager


# ------------------------------------------------------------------------------------ .item()
def _scaled_by_total(x):
    return x * x.sum().item()


def test_item_under_vmap_gives_the_eager_error():
    _assert_same_error_as_eager(_scaled_by_total, torch.randn(4, 3), UnsupportedUnderVmap)


def test_item_under_grad_works():
    x = torch.randn(4, 3)
    compiled = torch.compile(_scaled_by_total, backend=BACKEND)
    out, warned, graphs, breaks = _run(functrans.grad(lambda t: compiled(t).sum()), x)
    assert not warned
    # dynamo's own graph break at .item() (capture_scalar_outputs is off): two graphs
    assert graphs == 2 and breaks == 1, (graphs, breaks)
    torch.testing.assert_close(out, functrans.grad(lambda t: _scaled_by_total(t).sum())(x))
    # torch.func: the gradient does not flow through the Python number, as here
    torch.testing.assert_close(out, torch.func.grad(lambda t: _scaled_by_total(t).sum())(x))
