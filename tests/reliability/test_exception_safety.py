"""Exception safety (issue 7, item 2).

After an exception raised anywhere inside a transform (user code, a batching rule, the loop
fallback, a backward pass / vjp_fn / linearize's jvp_fn, a chunk other than the first, nested
transforms), check that:
* the thread's level stack is empty;
* every BatchedTensor created by the failed call is unusable (EscapedBatchedTensorError);
* no forward-AD dual level is left entered (a fresh one gets index 0);
* torch.is_grad_enabled() is what it was;
* the next call of the same transform gives correct results (vs torch.func / a loop).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

import functrans as ft
from functrans import _levels
from functrans.errors import EscapedBatchedTensorError, UnsupportedUnderVmap
from functrans.batching.batched_tensor import BatchedTensor
from tests.support.oracles import assert_same

LIB = "functrans_reliability"


@torch.library.custom_op(f"{LIB}::picky", mutates_args=())
def picky(x: torch.Tensor) -> torch.Tensor:
    """A custom op without a batching rule (runs on the loop fallback) that raises for an
    example with a large value."""
    if bool((x.abs() > 100).any()):
        raise ValueError("picky: example out of range")
    return x * 3


picky.register_autograd(lambda ctx, g: g * 3)

B, D = 6, 3          # batch size, example size
POISON = 1000.0      # makes `picky` raise for the example that holds it


class Boom(Exception):
    pass


class Ctx:
    """A per-example function R^3 -> R^3 (``3 * (tanh(a) * a + sin(a))``) with a failure
    injected at the ``fail_at``-th call of ``kind``:

    * ``user``: the function raises;
    * ``rule``: a shape error inside a batching rule (a matmul with a wrong-sized matrix);
    * ``fallback``: the custom op ``picky`` (loop fallback under vmap) raises for the
      poisoned example (inputs are poisoned by ``data``);
    * ``backward``: a custom autograd.Function's backward raises.
    Every input and intermediate is appended to ``cap``.
    """

    def __init__(self, kind: str, fail_at: int = 1):
        self.kind, self.fail_at = kind, fail_at
        self.fail = False
        self.calls = 0
        self.bwd_calls = 0
        self.cap = []
        ctx = self

        class Triple(torch.autograd.Function):
            @staticmethod
            def forward(c, a):
                return a * 3

            @staticmethod
            def backward(c, g):
                ctx.bwd_calls += 1
                ctx.cap.append(g)
                if ctx.fail and ctx.bwd_calls >= ctx.fail_at:
                    raise Boom("backward failed")
                return g * 3

        self.Triple = Triple

    def arm(self, fail: bool):
        self.fail = fail
        self.calls = self.bwd_calls = 0
        self.cap.clear()

    def f(self, a):
        self.calls += 1
        self.cap.append(a)
        h = torch.tanh(a) * a + torch.sin(a)
        self.cap.append(h)
        hit = self.fail and self.calls >= self.fail_at
        if self.kind == "fallback":
            return torch.ops.functrans_reliability.picky(h)
        if self.kind == "backward":
            return self.Triple.apply(h)
        if hit and self.kind == "user":
            raise Boom("user code failed")
        if hit and self.kind == "rule":
            return (h @ torch.ones(D + 1, D)) * 3          # size mismatch
        return h * 3

    def data(self, shape, seed=0):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        if self.fail and self.kind == "fallback":
            x = x.clone()
            x.view(-1)[-1] = POISON  # the last example (in the last chunk)
        return x


def ref_f(a):
    return (torch.tanh(a) * a + torch.sin(a)) * 3


def loop(f, *xs):
    return torch.stack([f(*[x[i] for x in xs]) for i in range(xs[0].shape[0])])


# --- the transforms: run(ctx) -> result, ref() -> expected -------------------------------------

class Net(nn.Module):
    def __init__(self, ctx):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.ctx = ctx

    def forward(self, x):
        return self.ctx.f(self.lin(x)) if self.ctx is not None else ref_f(self.lin(x))


def _net(ctx, seed=0):
    torch.manual_seed(seed)
    return Net(ctx)


def t_vmap(c):
    return ft.vmap(c.f)(c.data((B, D)))


def r_vmap():
    return loop(ref_f, Ctx("user").data((B, D)))


def t_vmap_chunked(c):
    return ft.vmap(c.f, chunk_size=2)(c.data((B, D)))


def t_grad(c):
    return ft.grad(lambda a: c.f(a).sum())(c.data(D))


def r_grad():
    return torch.func.grad(lambda a: ref_f(a).sum())(Ctx("user").data(D))


def t_grad_and_value(c):
    return ft.grad_and_value(lambda a: c.f(a).sum())(c.data(D))


def r_grad_and_value():
    return torch.func.grad_and_value(lambda a: ref_f(a).sum())(Ctx("user").data(D))


def t_vjp(c):
    out, fn = ft.vjp(c.f, c.data(D))
    return out, fn(torch.arange(1.0, D + 1))


def r_vjp():
    out, fn = torch.func.vjp(ref_f, Ctx("user").data(D))
    return out, fn(torch.arange(1.0, D + 1))


def t_vmap_vjp_fn(c, chunk_size=None):
    out, fn = ft.vjp(c.f, c.data(D))
    return ft.vmap(fn, chunk_size=chunk_size)(torch.eye(D) * torch.arange(1.0, D + 1)[:, None])


def r_vmap_vjp_fn():
    out, fn = torch.func.vjp(ref_f, Ctx("user").data(D))
    return torch.func.vmap(fn)(torch.eye(D) * torch.arange(1.0, D + 1)[:, None])


def t_jvp(c):
    return ft.jvp(c.f, (c.data(D),), (torch.arange(1.0, D + 1),))


def r_jvp():
    return torch.func.jvp(ref_f, (Ctx("user").data(D),), (torch.arange(1.0, D + 1),))


def t_linearize(c):
    out, fn = ft.linearize(c.f, c.data(D))
    return out, fn(torch.arange(1.0, D + 1))


def t_jacrev(c, chunk_size=None):
    return ft.jacrev(c.f, chunk_size=chunk_size)(c.data(D))


def r_jac():
    return torch.func.jacrev(ref_f)(Ctx("user").data(D))


def t_jacfwd(c, chunk_size=None):
    return ft.jacfwd(c.f, chunk_size=chunk_size)(c.data(D))


def t_hessian(c, chunk_size=None):
    return ft.hessian(lambda a: c.f(a).sum(), chunk_size=chunk_size)(c.data(D))


def r_hessian():
    return torch.func.hessian(lambda a: ref_f(a).sum())(Ctx("user").data(D))


def _loss_fc(model):
    def loss(params, x, y):
        return ((ft.functional_call(model, params, (x,)) - y) ** 2).sum()
    return loss


def t_functional_call(c):
    model = _net(c)
    before = dict(model.named_parameters())
    params = {k: v.detach() for k, v in model.named_parameters()}
    try:
        return ft.vmap(ft.grad(_loss_fc(model)), in_dims=(None, 0, 0))(
            params, c.data((B, D)), torch.ones(B, D))
    finally:
        after = dict(model.named_parameters())
        assert after.keys() == before.keys() and all(after[k] is before[k] for k in before), \
            "functional_call did not restore the module's parameters"


def r_functional_call():
    model = _net(None)
    params = {k: v.detach() for k, v in model.named_parameters()}
    loss = lambda p, x, y: ((torch.func.functional_call(model, p, (x,)) - y) ** 2).sum()
    return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(
        params, Ctx("user").data((B, D)), torch.ones(B, D))


def _ensemble(ctx):
    models = [_net(ctx, seed=i) for i in range(4)]
    params, buffers = ft.stack_module_state(models)
    return models[0], params, buffers


def t_stack_module_state(c):
    base, params, buffers = _ensemble(c)
    return ft.vmap(lambda p, b, x: ft.functional_call(base, (p, b), (x,)),
                   in_dims=(0, 0, None))(params, buffers, c.data((B, D)))


def r_stack_module_state():
    models = [_net(None, seed=i) for i in range(4)]
    return torch.stack([m(Ctx("user").data((B, D))) for m in models]).detach()


# nested transforms
def t_vmap_grad(c):
    return ft.vmap(ft.grad(lambda a: c.f(a).sum()))(c.data((B, D)))


def r_vmap_grad():
    return loop(torch.func.grad(lambda a: ref_f(a).sum()), Ctx("user").data((B, D)))


def t_grad_vmap(c):
    return ft.grad(lambda a: ft.vmap(c.f)(a).sum())(c.data((B, D)))


def r_grad_vmap():
    return torch.func.grad(lambda a: ref_f(a).sum())(Ctx("user").data((B, D)))


def t_vmap_vmap(c):
    return ft.vmap(ft.vmap(c.f))(c.data((2, B, D)))


def r_vmap_vmap():
    return ref_f(Ctx("user").data((2, B, D)))


def t_jacrev_vmap(c):
    return ft.jacrev(ft.vmap(c.f))(c.data((2, D)))


def r_jacrev_vmap():
    return torch.func.jacrev(torch.func.vmap(ref_f))(Ctx("user").data((2, D)))


def t_jacfwd_vmap(c):
    return ft.jacfwd(ft.vmap(c.f))(c.data((2, D)))


def t_jvp_vmap(c):
    return ft.jvp(ft.vmap(c.f), (c.data((B, D)),), (torch.ones(B, D),))


def r_jvp_vmap():
    return torch.func.jvp(torch.func.vmap(ref_f), (Ctx("user").data((B, D)),),
                          (torch.ones(B, D),))


def t_vmap_jvp(c):
    return ft.vmap(lambda a: ft.jvp(c.f, (a,), (torch.ones(D),)))(c.data((B, D)))


def r_vmap_jvp():
    return torch.func.vmap(lambda a: torch.func.jvp(ref_f, (a,), (torch.ones(D),)))(
        Ctx("user").data((B, D)))


def t_vmap_jacrev(c):
    return ft.vmap(ft.jacrev(c.f))(c.data((B, D)))


def r_vmap_jac():
    return torch.func.vmap(torch.func.jacrev(ref_f))(Ctx("user").data((B, D)))


def t_vmap_hessian(c):
    return ft.vmap(ft.hessian(lambda a: c.f(a).sum()))(c.data((B, D)))


def r_vmap_hessian():
    return torch.func.vmap(torch.func.hessian(lambda a: ref_f(a).sum()))(Ctx("user").data((B, D)))


def t_vmap_grad_chunked(c):
    return ft.vmap(ft.grad(lambda a: c.f(a).sum()), chunk_size=2)(c.data((B, D)))


ALL_KINDS = ("user", "rule", "fallback", "backward")
NO_BWD = ("user", "rule", "fallback")
# A custom op without a forward-AD formula silently gets a zero tangent in torch itself (and in
# torch.func), so the fallback op is left out of forward-mode cases.
FWD = ("user", "rule", "backward")

# name, run, ref, kinds, fail_at, vmap involved (a BatchedTensor must be captured; a tuple:
# for those kinds only)
TRANSFORMS = [
    ("vmap", t_vmap, r_vmap, NO_BWD, 1, True),
    ("vmap_chunk3of3", t_vmap_chunked, r_vmap, NO_BWD, 3, True),
    ("grad", t_grad, r_grad, ALL_KINDS, 1, False),
    ("grad_and_value", t_grad_and_value, r_grad_and_value, ALL_KINDS, 1, False),
    ("vjp", t_vjp, r_vjp, ALL_KINDS, 1, False),
    ("vmap(vjp_fn)", t_vmap_vjp_fn, r_vmap_vjp_fn, ("backward",), 1, True),
    ("vmap(vjp_fn)_chunk2of3", lambda c: t_vmap_vjp_fn(c, chunk_size=1), r_vmap_vjp_fn,
     ("backward",), 2, True),
    ("jvp", t_jvp, r_jvp, FWD, 1, False),
    ("linearize", t_linearize, r_jvp, ALL_KINDS, 1, False),
    ("jacrev", t_jacrev, r_jac, ALL_KINDS, 1, ("backward",)),
    ("jacrev_chunk3of3", lambda c: t_jacrev(c, chunk_size=1), r_jac, ("backward",), 3, True),
    ("jacfwd", t_jacfwd, r_jac, FWD, 1, False),
    ("jacfwd_chunk3of3", lambda c: t_jacfwd(c, chunk_size=1), r_jac, ("user", "rule"), 3,
     False),
    ("hessian", t_hessian, r_hessian, FWD, 1, False),
    ("hessian_chunk2of3", lambda c: t_hessian(c, chunk_size=1), r_hessian, ("backward",), 2,
     False),
    ("functional_call", t_functional_call, r_functional_call, ALL_KINDS, 1, True),
    ("stack_module_state", t_stack_module_state, r_stack_module_state, NO_BWD, 1, True),
    ("vmap(grad)", t_vmap_grad, r_vmap_grad, ALL_KINDS, 1, True),
    ("vmap(grad)_chunk3of3", t_vmap_grad_chunked, r_vmap_grad, ("user", "rule", "backward"), 3,
     True),
    ("grad(vmap)", t_grad_vmap, r_grad_vmap, NO_BWD, 1, True),
    ("vmap(vmap)", t_vmap_vmap, r_vmap_vmap, NO_BWD, 1, True),
    ("jacrev(vmap)", t_jacrev_vmap, r_jacrev_vmap, NO_BWD, 1, True),
    ("jacfwd(vmap)", t_jacfwd_vmap, r_jacrev_vmap, ("user", "rule"), 1, True),
    ("jvp(vmap)", t_jvp_vmap, r_jvp_vmap, NO_BWD, 1, True),
    ("vmap(jvp)", t_vmap_jvp, r_vmap_jvp, FWD, 1, True),
    ("vmap(jacrev)", t_vmap_jacrev, r_vmap_jac, ALL_KINDS, 1, True),
    ("vmap(hessian)", t_vmap_hessian, r_vmap_hessian, FWD, 1, True),
]

CASES = [pytest.param(name, run, ref, kind, fail_at,
                      has_vmap if isinstance(has_vmap, bool) else kind in has_vmap,
                      id=f"{name}-{kind}")
         for name, run, ref, kinds, fail_at, has_vmap in TRANSFORMS for kind in kinds]


# --- the checks --------------------------------------------------------------------------------

def assert_clean_state(grad_enabled: bool):
    assert _levels.stack() == [], f"levels leaked after an exception: {_levels.stack()}"
    assert getattr(fwAD, "_current_level", -1) == -1, "a forward-AD dual level was left entered"
    with fwAD.dual_level() as lvl:   # torch's own (C++) level state is clean too
        assert lvl == 0
    assert torch.is_grad_enabled() is grad_enabled, "grad mode was not restored"


def assert_unusable(bt: BatchedTensor):
    for use in (lambda: bt + 1, lambda: bt.sum(), lambda: torch.mul(torch.ones(()), bt),
                lambda: ft.vmap(lambda a: a * 2)(bt)):
        with pytest.raises(EscapedBatchedTensorError):
            use()


def check_escaped(captured, has_vmap: bool):
    bts = [t for t in captured if isinstance(t, BatchedTensor)]
    if has_vmap:
        assert bts, "expected the failed call to have created a BatchedTensor"
    for bt in bts:
        assert not bt.level.alive
        assert_unusable(bt)


@pytest.fixture(autouse=True)
def _quiet_fallback():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ft.PerformanceWarning)
        yield


@pytest.mark.parametrize("grad_mode", ["grad", "no_grad"])
@pytest.mark.parametrize("name,run,ref,kind,fail_at,has_vmap", CASES)
def test_exception_leaves_clean_state(name, run, ref, kind, fail_at, has_vmap, grad_mode):
    expected = ref()
    enabled = grad_mode == "grad"
    c = Ctx(kind, fail_at)
    with torch.set_grad_enabled(enabled):
        c.arm(fail=True)
        with pytest.raises((Boom, RuntimeError, ValueError)) as info:
            run(c)
        if kind in ("user", "backward"):
            assert info.type is Boom, f"the original exception was replaced: {info.value!r}"
        if kind == "fallback":
            assert "picky" in str(info.value)
        if fail_at > 1:
            assert (c.calls if kind != "backward" else c.bwd_calls) >= fail_at, \
                "the failure did not happen in a later chunk"
        assert_clean_state(enabled)
        captured = list(c.cap)
        del info
        check_escaped(captured, has_vmap)

        c.arm(fail=False)
        got = run(c)
        assert_clean_state(enabled)
    assert_same(got, expected, atol=1e-5, rtol=1e-5, msg=f"{name} after an exception")


# --- special cases -----------------------------------------------------------------------------

def test_vjp_fn_is_reusable_after_its_backward_raised():
    c = Ctx("backward")
    c.arm(fail=False)
    out, fn = ft.vjp(c.f, c.data(D))
    c.fail = True
    with pytest.raises(Boom):
        fn(torch.ones(D))
    with pytest.raises(Boom):
        ft.vmap(fn)(torch.eye(D))
    assert_clean_state(True)
    c.fail = False
    assert_same(fn(torch.arange(1.0, D + 1))[0], r_vjp()[1][0], atol=1e-6, rtol=1e-6)
    assert_same(ft.vmap(fn)(torch.eye(D) * torch.arange(1.0, D + 1)[:, None]), r_vmap_vjp_fn(),
                atol=1e-6, rtol=1e-6)


def test_vjp_fn_bad_cotangent_then_good():
    out, fn = ft.vjp(ref_f, Ctx("user").data(D))
    with pytest.raises(ft.TransformArgumentError):
        fn(torch.ones(D + 1))
    with pytest.raises(ft.TransformArgumentError):
        ft.vmap(fn)(torch.ones(4, D + 1))
    assert_clean_state(True)
    assert_same(fn(torch.arange(1.0, D + 1)), r_vjp()[1], atol=1e-6, rtol=1e-6)


def test_linearize_jvp_fn_is_reusable_after_it_raised():
    """linearize runs the first backward itself; jvp_fn differentiates that backward, so the
    failure is put in a double backward (the backward of the backward)."""
    state = {"fail": False}

    class DoubleBwd(torch.autograd.Function):   # g -> 3 g; its backward may raise
        @staticmethod
        def forward(c, g):
            return g * 3

        @staticmethod
        def backward(c, gg):
            if state["fail"]:
                raise Boom("double backward failed")
            return gg * 3

    class Triple(torch.autograd.Function):
        @staticmethod
        def forward(c, a):
            return a * 3

        @staticmethod
        def backward(c, g):
            return DoubleBwd.apply(g)

    f = lambda a: Triple.apply(torch.tanh(a) * a + torch.sin(a))
    out, fn = ft.linearize(f, Ctx("user").data(D))
    state["fail"] = True
    with pytest.raises(Boom):
        fn(torch.ones(D))
    with pytest.raises(ft.TransformArgumentError):
        fn(torch.ones(D + 1))
    assert_clean_state(True)
    state["fail"] = False
    assert_same(fn(torch.arange(1.0, D + 1)), r_jvp()[1], atol=1e-6, rtol=1e-6)
    assert_same(fn(torch.arange(1.0, D + 1)), r_jvp()[1], atol=1e-6, rtol=1e-6)


def test_inner_exception_caught_inside_outer_transform():
    """An inner vmap fails and the outer function catches it: the outer vmap goes on, its
    result is right, and the inner level is gone."""
    inner_cap = []

    def inner(a):
        inner_cap.append(a)
        raise Boom()

    def outer(a):
        depth = len(_levels.stack())
        try:
            ft.vmap(inner)(a.unsqueeze(0).expand(2, D))
        except Boom:
            pass
        assert len(_levels.stack()) == depth
        return ft.grad(lambda b: ref_f(b).sum())(a)

    x = Ctx("user").data((B, D))
    got = ft.vmap(outer)(x)
    assert_clean_state(True)
    assert_same(got, r_vmap_grad(), atol=1e-6, rtol=1e-6)
    check_escaped(inner_cap, True)


class _NotAnException(BaseException):
    pass


@pytest.mark.parametrize("wrap", ["vmap", "vmap(grad)", "jvp", "jacrev(vmap)"])
def test_base_exception_is_also_safe(wrap):
    """KeyboardInterrupt-like exceptions (not Exception subclasses) unwind cleanly too."""
    cap = []

    def f(a):
        cap.append(a)
        raise _NotAnException()

    x = Ctx("user").data((B, D))
    t = {"vmap": lambda: ft.vmap(f)(x),
         "vmap(grad)": lambda: ft.vmap(ft.grad(lambda a: f(a).sum()))(x),
         "jvp": lambda: ft.jvp(f, (x,), (x,)),
         "jacrev(vmap)": lambda: ft.jacrev(ft.vmap(f))(x)}[wrap]
    with pytest.raises(_NotAnException):
        t()
    assert_clean_state(True)
    check_escaped(cap, wrap != "jvp")
    assert_same(ft.vmap(ft.grad(lambda a: ref_f(a).sum()))(x), r_vmap_grad(), atol=1e-6,
                rtol=1e-6)


def test_output_processing_error_pops_level():
    """An error raised by vmap itself after the function returned (a bad out_dims)."""
    cap = []
    x = Ctx("user").data((B, D))
    with pytest.raises(ft.TransformArgumentError):
        ft.vmap(lambda a: (cap.append(a), a * 2)[1], out_dims=5)(x)
    with pytest.raises(ft.TransformArgumentError):
        ft.vmap(lambda a: (cap.append(a), (a * 2).sum().item())[1] if False else 3.0)(x)
    assert_clean_state(True)
    check_escaped(cap, True)


def test_escaped_tensor_unusable_inside_a_later_backward_pass():
    """grad refuses a gradient computed with an escaped wrapper.  (Inside the backward pass the
    wrapper still computes: dispatch exempts dead levels while the autograd engine runs, which
    backward passes of graphs recorded inside a vmap need; a plain .backward() outside any
    transform is not checked.)"""
    c = Ctx("user")
    c.arm(fail=True)
    with pytest.raises(Boom):
        t_vmap(c)
    escaped = next(t for t in c.cap if isinstance(t, BatchedTensor))

    class UsesEscaped(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return g * escaped.sum()

    with pytest.raises(EscapedBatchedTensorError):
        ft.grad(lambda a: UsesEscaped.apply(a).sum())(torch.randn(D))


def test_custom_function_under_outer_grad_of_vmap_is_refused():
    """grad(vmap(f)) records the vmap's physical ops, and a custom Function's forward runs
    without recording them: its backward would be skipped and a straight-through gradient
    silently 0 (the bug this test found).  functrans refuses it with a clear error (torch.func
    refuses such Functions too); vmap(grad(f)) uses the backward."""
    calls = []

    class STE(torch.autograd.Function):     # straight-through estimator
        @staticmethod
        def forward(c, a):
            return torch.round(a)

        @staticmethod
        def backward(c, g):
            calls.append(1)
            return g

    x = Ctx("user").data((B, D))
    with pytest.raises(UnsupportedUnderVmap, match=r"custom torch.autograd.Function.*vmap\(grad\(f\)\)"):
        ft.grad(lambda a: ft.vmap(STE.apply)(a).sum())(x)
    with pytest.raises(UnsupportedUnderVmap, match="custom torch.autograd.Function"):
        ft.jacrev(lambda a: ft.vmap(STE.apply)(a))(x[0:2])
    assert_clean_state(True)
    got = ft.vmap(ft.grad(lambda a: STE.apply(a).sum()))(x)
    assert calls, "the custom backward was never called"
    assert_same(got, torch.ones(B, D))
