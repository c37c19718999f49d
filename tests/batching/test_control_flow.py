"""torch.cond, while_loop, scan, associative_scan and map under functrans's transforms
(functrans/batching/control_flow.py).

Every check compares against a per-example oracle written as plain Python control flow (the
semantics each operator's documentation gives: ``if pred: true_fn(...)``, ``while cond(...)``,
a loop over the scanned dim), on batches of DIFFERENT examples: predicates true for some and
false for others, loops with different trip counts.  Derivatives are compared with
``torch.func`` applied to the plain-Python oracle one example at a time, and one gradient with
central finite differences; ``vmap`` of ``cond`` also with ``torch.func.vmap`` of the operator
itself (torch batches that one).
"""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.func
from torch._higher_order_ops.associative_scan import associative_scan, associative_scan_op
from torch._higher_order_ops.map import map as hop_map
from torch._higher_order_ops.scan import scan
from torch._higher_order_ops.while_loop import while_loop

import functrans
from functrans.batching import control_flow
from functrans.errors import CompileWarning, FunctransError, UnsupportedUnderVmap
from tests.support.oracles import assert_same, loop_oracle



@pytest.fixture(autouse=True)
def _float64():
    """Compare tightly, in float64."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


# ------------------------------------------------------------------ the functions and oracles

def cond_f(x, w):
    return torch.cond(x.sum() > 0, lambda x, w: (x * w).sin(), lambda x, w: (x - w).cos() * 2,
                      (x, w))


def cond_ref(x, w):
    return (x * w).sin() if x.sum() > 0 else (x - w).cos() * 2


def cond_closure_f(x, w):
    """Branches that close over ``w`` (a batched tensor under vmap) and return a pytree."""
    return torch.cond(x[0] > x[1], lambda x: {"a": x * w, "b": (x.exp(),)},
                      lambda x: {"a": x / (1 + w * w), "b": (x.tanh(),)}, (x,))


def cond_closure_ref(x, w):
    if x[0] > x[1]:
        return {"a": x * w, "b": (x.exp(),)}
    return {"a": x / (1 + w * w), "b": (x.tanh(),)}


def while_f(x):
    i, y = while_loop(lambda i, y: (y.abs().sum() < 8.0) & (i < 20),
                      lambda i, y: (i + 1, y * 1.5 + 0.1), (torch.tensor(0), x))
    return y, i


def while_ref(x):
    i, y = 0, x
    while y.abs().sum() < 8.0 and i < 20:
        i, y = i + 1, y * 1.5 + 0.1
    return y, torch.tensor(i)


def _scan_step(w):
    def step(c, x):
        h = torch.tanh(c["h"] * w + x)
        return {"h": h, "s": c["s"] + h.sum()}, (h * 2).clone()
    return step


def scan_f(xs, w, **kw):
    c, ys = scan(_scan_step(w), {"h": torch.zeros(3), "s": torch.zeros(())}, xs, **kw)
    return c["h"], c["s"], ys


@functools.lru_cache(maxsize=None)
def _scan_stacks_at_dim() -> bool:
    """Does this torch's scan stack the outputs at ``dim`` (2.13) or at 0 (2.11)?  Asked of
    torch's own eager operator on one tiny call (one carry, one output)."""
    with torch.compiler.set_stance("force_eager"):
        _, ys = scan(lambda c, x: (c + x, (c * 1).clone()), torch.zeros(2), torch.zeros(2, 3),
                     dim=1)
    return ys.shape == (2, 3)


def scan_ref(xs, w, dim=0, reverse=False):
    step, c, ys = _scan_step(w), {"h": torch.zeros(3), "s": torch.zeros(())}, []
    order = range(xs.shape[dim])
    for t in (reversed(order) if reverse else order):
        c, y = step(c, xs.select(dim, t))
        ys.append(y)
    ys = torch.stack(ys[::-1] if reverse else ys, dim if dim and _scan_stacks_at_dim() else 0)
    return c["h"], c["s"], ys


def map_f(xs, w):
    return hop_map(lambda x, w: {"a": (x * w).sin(), "b": x.cos() + w}, xs, w)


def map_ref(xs, w):
    outs = [{"a": (x * w).sin(), "b": x.cos() + w} for x in xs]
    return {k: torch.stack([o[k] for o in outs]) for k in ("a", "b")}


def _linear_combine(a, b):
    """(a1, b1) then (a2, b2) of h -> a*h + b: associative."""
    return a[0] * b[0], a[1] * b[0] + b[1]


def ascan_ref(a, b):
    outs_a, outs_b, acc = [], [], None
    for t in range(a.shape[0]):
        acc = (a[t], b[t]) if acc is None else _linear_combine(acc, (a[t], b[t]))
        outs_a.append(acc[0])
        outs_b.append(acc[1])
    return torch.stack(outs_a), torch.stack(outs_b)


def ascan_generic_f(a, b):
    return associative_scan(_linear_combine, (a, b), 0, combine_mode="generic")


def ascan_op_f(a, b):
    """The operator itself (what combine_mode='pointwise' reaches, on CUDA): its flat form."""
    out = associative_scan_op(lambda a0, a1, b0, b1: [a0 * b0, a1 * b0 + b1], [a, b], ())
    return tuple(out)


# ---------------------------------------------------------------------------- the batches

def _mixed_x(batch=4, n=4):
    """Examples whose sums alternate in sign (and whose first two entries alternate in order),
    so a predicate on them is true for some examples and false for others."""
    x = torch.randn(batch, n)
    sign = torch.tensor([1.0, -1.0] * (batch // 2) + [1.0] * (batch % 2))
    x = x.abs() * sign[:, None] + 0.1 * sign[:, None]
    x[::2, 0], x[::2, 1] = 1.0, -1.0
    x[1::2, 0], x[1::2, 1] = -1.0, 1.0
    return x


def _loop(f, in_dims, *args):
    size = next(a.shape[d] for a, d in zip(args, in_dims) if d is not None)
    return loop_oracle(f, in_dims, size, *args)


def _per_example(transform, f, *args):
    """``torch.func`` applied to the plain-Python oracle, one example at a time."""
    return loop_oracle(transform(f), (0,) * len(args), args[0].shape[0], *args)


# ------------------------------------------------------------------------------- vmap

@pytest.mark.parametrize("in_dims", [(0, 0), (0, None), (1, 0)])
def test_cond_vmap_matches_loop(in_dims):
    x, w = _mixed_x(), torch.randn(4, 4)
    x = x.t().contiguous() if in_dims[0] == 1 else x
    w = w[0] if in_dims[1] is None else w
    expected = _loop(cond_ref, in_dims, x, w)
    with functrans.config.strict_fallback():
        got = functrans.vmap(cond_f, in_dims=in_dims)(x, w)
    assert_same(got, expected)
    preds = (x if in_dims[0] == 0 else x.t()).sum(1) > 0
    assert preds.any() and not preds.all()     # the batch really disagrees


def test_cond_vmap_matches_torch_func():
    x, w = _mixed_x(), torch.randn(4, 4)
    assert_same(functrans.vmap(cond_f)(x, w), torch.func.vmap(cond_f)(x, w))


def test_cond_closure_pytree_and_nested_vmap():
    x, w = _mixed_x(), torch.randn(4, 4)
    assert_same(functrans.vmap(cond_closure_f)(x, w), _loop(cond_closure_ref, (0, 0), x, w))
    # vmap of vmap: examples (2, 4) whose predicates differ along both levels; the inner
    # vmap's w is unbatched at the inner level and batched at the outer one.
    xx, ww = torch.stack([x, x.flip(0)]), torch.randn(2, 4)
    inner = functrans.vmap(cond_closure_f, in_dims=(0, None))
    expected = _loop(lambda xb, wb: _loop(cond_closure_ref, (0, None), xb, wb), (0, 0), xx, ww)
    assert_same(functrans.vmap(inner)(xx, ww), expected)
    # a predicate batched only at the OUTER level (x is shared by the inner examples)
    inner2 = functrans.vmap(cond_f, in_dims=(None, 0))
    x2, w2 = _mixed_x(3), torch.randn(3, 5, 4)
    expected = _loop(lambda xa, wb: _loop(cond_ref, (None, 0), xa, wb), (0, 0), x2, w2)
    assert_same(functrans.vmap(inner2)(x2, w2), expected)


def test_cond_unbatched_predicate_runs_one_branch():
    calls = []

    def f(x, p):
        def yes(x):
            calls.append("true")
            return x + 1

        def no(x):
            calls.append("false")
            return x - 1
        return torch.cond(p.sum() > 0, yes, no, (x,))

    x = torch.randn(3, 4)
    out = functrans.vmap(f, in_dims=(0, None))(x, torch.ones(2))
    assert_same(out, x + 1)
    assert calls == ["true"]


def test_operators_nested_in_branches():
    def f(x):
        return torch.cond(
            x.sum() > 0,
            lambda x: torch.cond(x[0] > 0.5, lambda x: x * 2, lambda x: x * 3, (x,)),
            lambda x: scan(lambda c, xi: (c + xi, (c * xi).clone()), torch.zeros(()), x)[1],
            (x,))

    def ref(x):
        if x.sum() > 0:
            return x * 2 if x[0] > 0.5 else x * 3
        c, ys = torch.zeros(()), []
        for xi in x:
            ys.append(c * xi)
            c = c + xi
        return torch.stack(ys)

    x = torch.tensor([[1.0, 2.0, 0.1], [0.2, 2.0, 0.1], [-1.0, -2.0, 0.5], [-3.0, 0.5, 0.5]])
    assert_same(functrans.vmap(f)(x), _loop(ref, (0,), x))
    assert_same(functrans.vmap(functrans.grad(lambda x: f(x).sum()))(x),
                _per_example(torch.func.grad, lambda x: ref(x).sum(), x))


def test_while_loop_vmap_different_trip_counts():
    x = torch.stack([torch.full((3,), v) for v in (0.05, 0.5, 2.0, 4.0, -1.0)])
    expected = _loop(while_ref, (0,), x)
    assert len(set(expected[1].tolist())) >= 3       # trip counts really differ
    with functrans.config.strict_fallback():
        assert_same(functrans.vmap(while_f)(x), expected)
    # nested: the innermost examples of one outer example stop at different times too
    xx = torch.stack([x, x * 0.5])
    expected = _loop(lambda xb: _loop(while_ref, (0,), xb), (0,), xx)
    assert_same(functrans.vmap(functrans.vmap(while_f))(xx), expected)


def test_while_loop_pytree_carry_closure_and_unbatched_predicate():
    def f(x, limit):
        return while_loop(lambda c: c["i"] < limit,
                          lambda c: {"i": c["i"] + 1, "v": (c["v"][0] * x, c["v"][1] + 1)},
                          ({"i": torch.tensor(0), "v": (torch.ones(2), torch.zeros(()))},))

    def ref(x, limit):
        c = {"i": torch.tensor(0), "v": (torch.ones(2), torch.zeros(()))}
        while c["i"] < limit:
            c = {"i": c["i"] + 1, "v": (c["v"][0] * x, c["v"][1] + 1)}
        return (c,)

    x, limits = torch.randn(3, 2), torch.tensor([0, 2, 5])
    assert_same(functrans.vmap(f)(x, limits), _loop(ref, (0, 0), x, limits))
    # unbatched predicate: every example runs the same number of steps (and a Python int
    # carry is fine then)
    g = lambda x: while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y.sin()), (0, x))
    out = functrans.vmap(g, out_dims=(None, 0))(x)
    assert out[0] == 3
    assert_same(out[1], x.sin().sin().sin())


@pytest.mark.parametrize("kw", [{}, {"dim": 1, "reverse": True}])
def test_scan_vmap_matches_loop(kw):
    xs, w = torch.randn(3, 5, 3), torch.randn(3, 3)
    if kw:
        xs = xs.transpose(1, 2).contiguous()        # scan over dim 1 of each example
    ref = lambda xs, w: scan_ref(xs, w, **kw)
    f = lambda xs, w: scan_f(xs, w, **kw)
    with functrans.config.strict_fallback():
        for in_dims in [(0, 0), (0, None), (None, 0)]:
            args = (xs if in_dims[0] == 0 else xs[0], w if in_dims[1] == 0 else w[0])
            assert_same(functrans.vmap(f, in_dims=in_dims)(*args), _loop(ref, in_dims, *args))
    xx = torch.stack([xs, xs * 2])
    expected = _loop(lambda xb: _loop(ref, (0, None), xb, w[0]), (0,), xx)
    assert_same(functrans.vmap(functrans.vmap(f, in_dims=(0, None)), in_dims=(0, None))(
        xx, w[0]), expected)


def test_map_vmap_matches_loop():
    xs, w = torch.randn(3, 5, 2), torch.randn(3, 2)
    for in_dims in [(0, 0), (0, None), (None, 0)]:
        args = (xs if in_dims[0] == 0 else xs[0], w if in_dims[1] == 0 else w[0])
        assert_same(functrans.vmap(map_f, in_dims=in_dims)(*args), _loop(map_ref, in_dims, *args))
    xx, ww = torch.stack([xs, -xs]), torch.stack([w, w * 3])
    expected = _loop(lambda xb, wb: _loop(map_ref, (0, 0), xb, wb), (0, 0), xx, ww)
    assert_same(functrans.vmap(functrans.vmap(map_f))(xx, ww), expected)


@pytest.mark.parametrize("length", [1, 2, 3, 4, 5, 8, 9])
def test_associative_scan_operator_vmap(length):
    a, b = torch.rand(3, length) + 0.5, torch.randn(3, length)
    expected = _loop(ascan_ref, (0, 0), a, b)
    assert_same(functrans.vmap(ascan_op_f)(a, b), expected)
    assert_same(functrans.vmap(ascan_op_f, in_dims=(None, 0))(a[0], b),
                _loop(ascan_ref, (None, 0), a[0], b))
    if length == 5:
        aa, bb = torch.stack([a, a * 0.5]), torch.stack([b, -b])
        expected = _loop(lambda x, y: _loop(ascan_ref, (0, 0), x, y), (0, 0), aa, bb)
        assert_same(functrans.vmap(functrans.vmap(ascan_op_f))(aa, bb), expected)


def test_associative_scan_generic_vmap():
    a, b = torch.rand(3, 6) + 0.5, torch.randn(3, 6)
    assert_same(functrans.vmap(ascan_generic_f)(a, b), _loop(ascan_ref, (0, 0), a, b))


def test_no_compile_warning_for_torchs_internal_compile():
    x, w = _mixed_x(), torch.randn(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileWarning)
        functrans.vmap(cond_f)(x, w)
        functrans.vmap(while_f)(x)


def test_inference_mode_reaches_the_mode_kernel():
    x, w = _mixed_x(), torch.randn(4, 4)
    with torch.inference_mode():
        got = functrans.vmap(cond_f)(x, w)
    assert_same(got, _loop(cond_ref, (0, 0), x, w))


# --------------------------------------------------------------------------- autodiff

# (function, oracle, per-example arguments): each function's first argument is differentiated;
# the output is reduced to one tensor for grad.
CASES = {
    "cond": (cond_f, cond_ref, lambda: (_mixed_x(), torch.randn(4, 4))),
    "while_loop": (lambda x: while_f(x)[0], lambda x: while_ref(x)[0],
                   lambda: (torch.stack([torch.full((3,), v) + 0.01 * torch.arange(3.)
                                         for v in (0.05, 0.5, 2.0, -1.0)]),)),
    "scan": (lambda xs, w: scan_f(xs, w)[2], lambda xs, w: scan_ref(xs, w)[2],
             lambda: (torch.randn(3, 4, 3), torch.randn(3, 3))),
    "map": (lambda xs, w: map_f(xs, w)["a"], lambda xs, w: map_ref(xs, w)["a"],
            lambda: (torch.randn(3, 4, 2), torch.randn(3, 2))),
    "associative_scan": (lambda a, b: ascan_op_f(a, b)[1], lambda a, b: ascan_ref(a, b)[1],
                         lambda: (torch.rand(3, 5) + 0.5, torch.randn(3, 5))),
    "associative_scan_generic": (lambda a, b: ascan_generic_f(a, b)[1],
                                 lambda a, b: ascan_ref(a, b)[1],
                                 lambda: (torch.rand(3, 5) + 0.5, torch.randn(3, 5))),
}


def _scalar(f):
    return lambda *a: (f(*a) ** 2).sum()


# Outside a vmap, torch's front-ends run their operator through dynamo, which hands it traced
# graphs (flat inputs and outputs); under a vmap dynamo skips them and the operator gets the
# front-end's own callables.  Each dynamo compile costs seconds, so the full set of transforms
# runs under set_stance("force_eager") (the vmap route, for grad/jvp too), and the dynamo route
# is checked once per operator (DYNAMO_ROUTE).
DYNAMO_ROUTE = {"cond": "grad", "while_loop": "jvp", "scan": "grad", "map": "jvp"}


def _check_transforms(f, ref, ex, only=None):
    rest = ex[1:]
    checks = {
        "grad": lambda: assert_same(functrans.grad(_scalar(f))(*ex),
                                    torch.func.grad(_scalar(ref))(*ex), msg="grad"),
        "jvp": lambda: assert_same(
            functrans.jvp(lambda x: f(x, *rest), (ex[0],), (torch.ones_like(ex[0]),)),
            torch.func.jvp(lambda x: ref(x, *rest), (ex[0],), (torch.ones_like(ex[0]),)),
            msg="jvp"),
        "vjp": lambda: _check_vjp(f, ref, ex),
        "jacrev": lambda: assert_same(functrans.jacrev(f)(*ex), torch.func.jacrev(ref)(*ex),
                                      msg="jacrev"),
        "jacfwd": lambda: assert_same(functrans.jacfwd(f)(*ex), torch.func.jacfwd(ref)(*ex),
                                      msg="jacfwd"),
        "hessian": lambda: assert_same(functrans.hessian(_scalar(f))(*ex),
                                       torch.func.hessian(_scalar(ref))(*ex), msg="hessian"),
    }
    for name, check in checks.items():
        if only is None or name == only:
            check()


def _check_vjp(f, ref, ex):
    out, vjp_fn = functrans.vjp(f, *ex)
    ref_out, ref_vjp = torch.func.vjp(ref, *ex)
    ct = torch.randn_like(ref_out)
    assert_same((out, vjp_fn(ct)), (ref_out, ref_vjp(ct)), msg="vjp")


@pytest.mark.parametrize("name", list(CASES))
def test_autodiff_transforms(name):
    f, ref, make = CASES[name]
    torch.manual_seed(0)
    args = make()
    with torch.compiler.set_stance("force_eager"):
        # one example at a time, against torch.func of the plain-Python oracle
        for i in range(2):
            _check_transforms(f, ref, tuple(a[i] for a in args))
        # per-example gradients and Jacobians over the batch of different examples
        assert_same(functrans.vmap(functrans.grad(_scalar(f)))(*args),
                    _per_example(torch.func.grad, _scalar(ref), *args), msg="vmap(grad)")
        assert_same(functrans.vmap(functrans.jacrev(f))(*args),
                    _per_example(torch.func.jacrev, ref, *args), msg="vmap(jacrev)")
    if name in DYNAMO_ROUTE:
        _check_transforms(f, ref, tuple(a[-1] for a in args), only=DYNAMO_ROUTE[name])


def test_cond_and_while_gradients_match_finite_differences():
    for f, x in [(lambda x: _scalar(cond_f)(x, torch.linspace(-1, 1, 4)), _mixed_x(1)[0]),
                 (lambda x: _scalar(lambda x: while_f(x)[0])(x), torch.tensor([0.3, 0.2, 0.1]))]:
        g = functrans.grad(f)(x)
        eps = 1e-6
        fd = torch.stack([(f(x + eps * e) - f(x - eps * e)) / (2 * eps)
                          for e in torch.eye(x.numel())])
        torch.testing.assert_close(g, fd, rtol=1e-6, atol=1e-7)


def test_vmap_of_hessian_with_batched_predicate():
    x, w = _mixed_x(), torch.randn(4, 4)
    got = functrans.vmap(functrans.hessian(_scalar(cond_f)))(x, w)
    assert_same(got, _per_example(torch.func.hessian, _scalar(cond_ref), x, w))


def test_grad_of_vmap_and_vmap_of_grad_with_batched_predicate():
    x, w = _mixed_x(), torch.randn(4)
    # grad outside a vmap of a batched cond: autograd over the physical batch
    got = functrans.grad(lambda w: (functrans.vmap(cond_f, in_dims=(0, None))(x, w) ** 2).sum())(w)
    expected = torch.func.grad(lambda w: sum((cond_ref(xi, w) ** 2).sum() for xi in x))(w)
    assert_same(got, expected)
    # per-example gradient w.r.t. a SHARED weight through the batched while_loop freeze
    f = lambda w, x: (while_f(x * w)[0] ** 2).sum()
    xs = torch.stack([torch.full((3,), v) for v in (0.05, 0.5, 2.0)])
    w3 = torch.tensor([1.0, 1.1, 0.9])
    got = functrans.vmap(functrans.grad(f), in_dims=(None, 0))(w3, xs)
    ref = lambda w, x: (while_ref(x * w)[0] ** 2).sum()
    assert_same(got, torch.stack([torch.func.grad(ref)(w3, xi) for xi in xs]))


def test_more_compositions():
    x, w, t = _mixed_x(), torch.randn(4, 4), torch.randn(4, 4)
    batched = lambda x: functrans.vmap(cond_f)(x, w)
    ref = lambda x: torch.stack([cond_ref(a, b) for a, b in zip(x, w)])
    assert_same(functrans.jvp(batched, (x,), (t,)), torch.func.jvp(ref, (x,), (t,)))
    assert_same(functrans.jacfwd(batched)(x), torch.func.jacfwd(ref)(x))
    assert_same(functrans.linearize(batched, x)[1](t), torch.func.jvp(ref, (x,), (t,))[1])
    assert_same(functrans.vmap(cond_f, chunk_size=3)(x, w), ref(x))
    assert_same(functrans.functionalize(functrans.vmap(cond_f))(x, w), ref(x))
    # under vmap(functionalize(f)) the predicate is a functional wrapper of a batched tensor
    assert_same(functrans.vmap(functrans.functionalize(cond_f))(x, w), ref(x))
    xs = torch.stack([torch.full((3,), v) for v in (0.05, 0.5, 2.0)])
    assert_same(functrans.vmap(functrans.functionalize(while_f))(xs), _loop(while_ref, (0,), xs))


# ------------------------------------------------------------------------------ errors

def test_cond_branches_of_different_shapes_under_a_batched_predicate():
    f = lambda x: torch.cond(x.sum() > 0, lambda x: x * 2, lambda x: x[:2], (x,))
    with pytest.raises(UnsupportedUnderVmap, match=r"torch.cond under functrans.vmap: the "
                       r"predicate differs per example(.|\n)*output 0(.|\n)*shape \(4,\)"
                       r"(.|\n)*shape \(2,\)(.|\n)*their shapes differ"):
        functrans.vmap(f)(_mixed_x())
    g = lambda x: torch.cond(x.sum() > 0, lambda x: x * 2, lambda x: x.int(), (x,))
    with pytest.raises(UnsupportedUnderVmap, match="their dtypes differ"):
        functrans.vmap(g)(_mixed_x())
    h = lambda x: torch.cond(x.sum() > 0, lambda x: (x, x), lambda x: [x, x], (x,))
    with pytest.raises(UnsupportedUnderVmap, match="outputs of the same structure"):
        functrans.vmap(h)(_mixed_x())
    # the same branches under an unbatched predicate run one branch, as eager does
    p_f = lambda x, p: torch.cond(p.sum() > 0, lambda x: x * 2, lambda x: x[:2], (x,))
    x = _mixed_x()
    assert_same(functrans.vmap(p_f, in_dims=(0, None))(x, torch.ones(1)), x * 2)


def test_cond_branch_writing_into_an_operand_under_a_batched_predicate():
    def f(x):
        def grow(x):
            x.mul_(2)
            return x.clone()
        return torch.cond(x.sum() > 0, grow, lambda x: x - 1, (x.clone(),))
    with pytest.raises(UnsupportedUnderVmap, match=r"true_fn wrote into operand 0 in place"
                       r"(.|\n)*Return the new value"):
        functrans.vmap(f)(_mixed_x())
    # one branch per call when the predicate is shared: the write is the eager one
    g = lambda x, p: torch.cond(p.sum() > 0, lambda x: x.mul_(2).clone(), lambda x: x - 1,
                                (x.clone(),))
    x = _mixed_x()
    assert_same(functrans.vmap(g, in_dims=(0, None))(x, torch.ones(1)), x * 2)


def test_while_loop_python_int_carry_that_differs_per_example():
    f = lambda x: while_loop(lambda i, y: y.sum() < 4, lambda i, y: (i + 1, y * 2), (0, x))
    with pytest.raises(UnsupportedUnderVmap, match=r"while_loop under functrans.vmap(.|\n)*"
                       r"carried value 0(.|\n)*Python ints"):
        functrans.vmap(f)(torch.tensor([[1.0], [3.0]]))


def test_while_loop_predicate_must_be_a_boolean_scalar():
    f = lambda x: while_loop(lambda y: y < 4, lambda y: (y * 2,), (x,))
    with pytest.raises(FunctransError, match="cond_fn must return a boolean scalar"):
        functrans.vmap(f)(torch.ones(2, 3))


# ----------------------------------------------------------------------------- compile

def test_compiled_vmap_of_cond_replays_for_other_predicates():
    g = functrans.compile(functrans.vmap(cond_f))
    x, w = _mixed_x(), torch.randn(4, 4)
    assert_same(g(x, w), _loop(cond_ref, (0, 0), x, w))
    x2 = -x                                     # every predicate flipped
    assert_same(g(x2, w), _loop(cond_ref, (0, 0), x2, w))
    info = g.cache_info()
    assert info.hits == 1 and info.eager_calls == 0


def test_compiled_vmap_of_grad_of_scan_and_map():
    for f, ref, make in (CASES["scan"], CASES["map"], CASES["associative_scan"]):
        g = functrans.compile(functrans.vmap(functrans.grad(_scalar(f))))
        for k in range(2):
            args = tuple(a * (1 + k) for a in make())
            assert_same(g(*args), _per_example(torch.func.grad, _scalar(ref), *args))
        assert g.cache_info().hits == 1 and g.cache_info().eager_calls == 0


def test_compiled_while_loop_breaks_the_graph_never_a_stale_graph():
    """Each while_loop test reads an unbatched value (bool of `any example still active`): a
    graph break per trip, guarded, so other trip counts run a graph traced for them."""
    g = functrans.compile(functrans.vmap(while_f))
    x = torch.stack([torch.full((3,), v) for v in (0.05, 0.5, 2.0)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileWarning)
        assert_same(g(x), _loop(while_ref, (0,), x))
        x2 = x * 3                                   # other trip counts
        assert_same(g(x2), _loop(while_ref, (0,), x2))
        assert_same(g(x), _loop(while_ref, (0,), x))
    info = g.cache_info()
    assert info.eager_calls == 0 and info.misses == 2 and info.hits == 1, info
    assert all(e.breaks for e in info.entries), info
    strict = functrans.compile(functrans.vmap(while_f), strict=True)     # breaks are allowed
    assert_same(strict(x), _loop(while_ref, (0,), x))
    # compiled vmap(grad) of the while loop: graph breaks too, and right
    h = functrans.compile(functrans.vmap(functrans.grad(_scalar(CASES["while_loop"][0]))))
    for xi in (x, x2, x):
        assert_same(h(xi), _per_example(torch.func.grad, _scalar(CASES["while_loop"][1]), xi))
    assert h.cache_info().eager_calls == 0


def test_compiled_without_a_transform():
    """functrans.compile of the operators alone: scan/map unroll into the graph; a cond on an
    unbatched predicate reads it (bool): a graph break, each branch a graph of its own."""
    f, ref, make = CASES["scan"]
    g = functrans.compile(f)
    for k in range(2):
        args = tuple(a[k] for a in make())
        assert_same(g(*args), ref(*args))
    assert g.cache_info().hits == 1 and g.cache_info().eager_calls == 0
    c = functrans.compile(cond_f)
    x, w = _mixed_x(2), torch.randn(4)
    for xi in (x[0], x[1], x[0]):                    # both branches, each its own graph
        assert_same(c(xi, w), cond_ref(xi, w))
    info = c.cache_info()
    assert info.eager_calls == 0 and all(e.segments == 2 for e in info.entries), info


# ---------------------------------------------------------------- torch outside functrans

def test_torch_alone_is_unchanged(monkeypatch):
    """Outside functrans's transforms each operator takes torch's own implementation."""
    runs = []
    real_run = control_flow._run
    monkeypatch.setattr(control_flow, "_run", lambda *a: runs.append(a) or real_run(*a))
    x = torch.randn(4, requires_grad=True)
    y = torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (x,))
    (gx,) = torch.autograd.grad(y.sum(), x)
    expected = x.cos() if x.sum() > 0 else -x.sin()
    assert_same(gx, expected.detach())
    assert not runs
    functrans.grad(lambda x: torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(),
                                        (x,)).sum())(x.detach())
    assert len(runs) == 1
