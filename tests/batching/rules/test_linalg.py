"""Batching rules of functrans/batching/rules/linalg.py (the matmul family).

Every case runs against the for-loop oracle over every in_dims choice and nested
(``check_vmap_all_bdims``, strict: no fallback).  Differentiable cases are also checked under
autograd through vmap (``grad(vmap(f))``) and inside it (``vmap(grad(f))``, which batches the
backward ops), with each argument batched alone.  One-sided products are checked to run ONE
kernel without expanding the unbatched operand, and per-sample gradients of an MLP are compared
with torch.func.
"""
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import functrans as ft
from functrans.batching.rules import linalg
from tests.support.oracles import (assert_same, check_vmap, check_vmap_all_bdims, loop_oracle,
                                    make_batch)

g = torch.Generator().manual_seed(0)
NAN = float("nan")


def r(*shape, dtype=torch.float32):
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-4, 5, shape, generator=g).to(dtype)


C64 = torch.complex64

# (per-example function, per-example args, differentiable)
CASES = {
    # the ATen ops themselves
    "mm": (torch.mm, [r(2, 3), r(3, 4)], True),
    "mm_transposed": (lambda a, b: torch.mm(a.t(), b.t()), [r(3, 2), r(4, 3)], True),
    "mm_size1": (torch.mm, [r(1, 3), r(3, 1)], True),
    "mm_int": (torch.mm, [r(2, 3, dtype=torch.int64), r(3, 4, dtype=torch.int64)], False),
    "mm_complex": (torch.mm, [r(2, 3, dtype=C64), r(3, 2, dtype=C64)], False),
    "mm_conj_transposed": (lambda a, b: torch.mm(a.mH, b.conj()),
                           [r(3, 2, dtype=C64), r(3, 2, dtype=C64)], False),
    "addmm_complex": (lambda s, a, b: torch.addmm(s, a, b.conj(), beta=1j, alpha=2),
                      [r(4, dtype=C64), r(2, 3, dtype=C64), r(3, 4, dtype=C64)], False),
    "bmm": (torch.bmm, [r(2, 2, 3), r(2, 3, 4)], True),
    "bmm_transposed": (lambda a, b: torch.bmm(a.mT, b), [r(2, 3, 2), r(2, 3, 4)], True),
    "mv": (torch.mv, [r(2, 3), r(3)], True),
    "mv_transposed": (lambda a, v: torch.mv(a.t(), v), [r(3, 2), r(3)], True),
    "dot": (torch.dot, [r(3), r(3)], True),
    "dot_int": (torch.dot, [r(3, dtype=torch.int32), r(3, dtype=torch.int32)], False),
    "vdot_complex": (torch.vdot, [r(3, dtype=C64), r(3, dtype=C64)], False),
    "vdot": (torch.vdot, [r(3), r(3)], True),
    "addmm": (lambda s, a, b: torch.addmm(s, a, b, beta=0.5, alpha=2),
              [r(2, 4), r(2, 3), r(3, 4)], True),
    "addmm_bias": (torch.addmm, [r(4), r(2, 3), r(3, 4)], True),
    "addmm_row_bias": (torch.addmm, [r(1, 4), r(2, 3), r(3, 4)], True),
    "addmm_col_bias": (lambda s, a, b: torch.addmm(s, a, b, alpha=-1), [r(2, 1), r(2, 3), r(3, 4)],
                       True),
    "addmm_0d_self": (lambda s, a, b: torch.addmm(s, a, b, beta=3), [r(), r(2, 3), r(3, 4)], True),
    "addmm_beta0_nan": (lambda s, a, b: torch.addmm(s * NAN, a, b, beta=0),
                        [r(2, 4), r(2, 3), r(3, 4)], False),
    "addmm_alpha0": (lambda s, a, b: torch.addmm(s, a, b, alpha=0), [r(2, 4), r(2, 3), r(3, 4)],
                     True),
    "addmm_int": (lambda s, a, b: torch.addmm(s, a, b, beta=2, alpha=3),
                  [r(2, 4, dtype=torch.int64), r(2, 3, dtype=torch.int64),
                   r(3, 4, dtype=torch.int64)], False),
    "addmv": (lambda s, a, v: torch.addmv(s, a, v, alpha=3), [r(2), r(2, 3), r(3)], True),
    "addmv_0d_self": (lambda s, a, v: torch.addmv(s, a, v, beta=0.5), [r(), r(2, 3), r(3)], True),
    "addmv_beta0_nan": (lambda s, a, v: torch.addmv(s * NAN, a, v, beta=0), [r(2), r(2, 3), r(3)],
                        False),
    "baddbmm": (lambda s, a, b: torch.baddbmm(s, a, b, beta=2),
                [r(2, 2, 4), r(2, 2, 3), r(2, 3, 4)], True),
    "baddbmm_bias": (lambda s, a, b: torch.baddbmm(s, a, b, alpha=0.5),
                     [r(4), r(2, 2, 3), r(2, 3, 4)], True),
    "addbmm": (torch.addbmm, [r(2, 4), r(5, 2, 3), r(5, 3, 4)], True),
    "addbmm_scaled": (lambda s, a, b: torch.addbmm(s, a, b, beta=0.5, alpha=2),
                      [r(4), r(5, 2, 3), r(5, 3, 4)], True),
    "addr": (lambda s, a, b: torch.addr(s, a, b, beta=2), [r(2, 3), r(2), r(3)], True),
    "addr_alpha": (lambda s, a, b: torch.addr(s, a, b, alpha=0.5), [r(3), r(2), r(3)], True),
    "addr_bool": (lambda s, a, b: torch.addr(s, a, b, beta=False),
                  [r(2, 3) > 0, r(2) > 0, r(3) > 0], False),
    "addr_bool_or": (torch.addr, [r(2, 3) > 0, r(2) > 0, r(3) > 0], False),
    # composites that reach these ops
    "matmul_1d_1d": (torch.matmul, [r(3), r(3)], True),
    "matmul_1d_2d": (torch.matmul, [r(3), r(3, 4)], True),
    "matmul_2d_1d": (torch.matmul, [r(2, 3), r(3)], True),
    "matmul_2d_2d": (torch.matmul, [r(2, 3), r(3, 4)], True),
    "matmul_3d_2d": (torch.matmul, [r(2, 2, 3), r(3, 4)], True),
    "matmul_2d_3d": (torch.matmul, [r(2, 3), r(2, 3, 4)], True),
    "matmul_1d_3d": (torch.matmul, [r(3), r(2, 3, 4)], True),
    "matmul_3d_1d": (torch.matmul, [r(2, 2, 3), r(3)], True),
    "matmul_3d_3d": (torch.matmul, [r(2, 2, 3), r(2, 3, 4)], True),
    "matmul_broadcast": (torch.matmul, [r(2, 1, 2, 3), r(4, 3, 2)], True),
    "linear_1d": (F.linear, [r(3), r(4, 3), r(4)], True),
    "linear_1d_nobias": (F.linear, [r(3), r(4, 3)], True),
    "linear_2d": (F.linear, [r(2, 3), r(4, 3), r(4)], True),
    "linear_2d_nobias": (F.linear, [r(2, 3), r(4, 3)], True),
    "linear_3d": (F.linear, [r(2, 5, 3), r(4, 3), r(4)], True),
    "linear_3d_nobias": (F.linear, [r(2, 5, 3), r(4, 3)], True),
    "outer": (torch.outer, [r(2), r(3)], True),
    "inner_1d": (torch.inner, [r(3), r(3)], True),
    "inner": (torch.inner, [r(2, 3), r(4, 3)], True),
    "einsum_mm": (lambda a, b: torch.einsum("ij,jk->ik", a, b), [r(2, 3), r(3, 4)], True),
    "einsum_nt": (lambda a, b: torch.einsum("ij,kj->ki", a, b), [r(2, 3), r(4, 3)], True),
    "einsum_bmm": (lambda a, b: torch.einsum("bij,bjk->bik", a, b), [r(2, 2, 3), r(2, 3, 4)],
                   True),
    "einsum_dot": (lambda a, b: torch.einsum("i,i->", a, b), [r(3), r(3)], True),
    "einsum_outer": (lambda a, b: torch.einsum("i,j->ij", a, b), [r(2), r(3)], True),
    "einsum_three": (lambda a, b, c: torch.einsum("ij,jk,k->i", a, b, c),
                     [r(2, 3), r(3, 4), r(4)], True),
    "tensordot": (lambda a, b: torch.tensordot(a, b, dims=([1], [0])), [r(2, 3), r(3, 4)], True),
    "tensordot_2": (lambda a, b: torch.tensordot(a, b, dims=2), [r(2, 3, 4), r(3, 4, 5)], True),
}
DIFFERENTIABLE = [name for name, case in CASES.items() if case[2]]


@pytest.mark.parametrize("name", list(CASES))
def test_matches_loop(name):
    f, args, _ = CASES[name]
    check_vmap_all_bdims(f, args)


@pytest.mark.parametrize("name", ["mm", "addmm_bias", "linear_1d", "dot", "matmul_2d_3d"])
def test_batch_size_one(name):
    f, args, _ = CASES[name]
    for k in range(len(args)):
        check_vmap(f, args, [0 if i == k else None for i in range(len(args))], size=1)


@pytest.mark.parametrize("name", ["mm", "linear_2d", "matmul_broadcast"])
def test_matches_torch_vmap(name):
    f, args, _ = CASES[name]
    batched = [make_batch(a, 0, 3) for a in args]
    in_dims = (0,) + (None,) * (len(args) - 1)
    inputs = [batched[0]] + args[1:]
    with ft.config.strict_fallback():
        ours = ft.vmap(f, in_dims=in_dims)(*inputs)
    assert_same(ours, torch.vmap(f, in_dims=in_dims)(*inputs))


def _one_batched(args, k, size=3):
    in_dims = tuple(0 if i == k else None for i in range(len(args)))
    return [make_batch(a, 0, size) if d == 0 else a.clone() for a, d in zip(args, in_dims)], \
        in_dims


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_gradients_through_vmap(name):
    """``grad(vmap(f))`` with each argument batched alone: the physical ops are differentiated."""
    f, args, _ = CASES[name]
    for k in range(len(args)):
        inputs, in_dims = _one_batched(args, k)
        inputs = [a.requires_grad_() for a in inputs]
        with ft.config.strict_fallback():
            out = ft.vmap(f, in_dims=in_dims)(*inputs)
            grads = torch.autograd.grad((out * out).sum(), inputs)
        loop = loop_oracle(f, in_dims, 3, *inputs)
        assert_same(grads, torch.autograd.grad((loop * loop).sum(), inputs),
                    msg=f"in_dims={in_dims}")


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_gradients_inside_vmap(name):
    """``vmap(grad(f))``: the backward ops of the family run batched, with no fallback."""
    f, args, _ = CASES[name]

    def per_example_grads(*xs):
        with torch.enable_grad():
            xs = [x.detach().requires_grad_() for x in xs]
            out = f(*xs)
            return torch.autograd.grad((out * out).sum(), xs)

    for k in range(len(args)):
        inputs, in_dims = _one_batched(args, k)
        with ft.config.strict_fallback():
            ours = ft.vmap(per_example_grads, in_dims=in_dims)(*inputs)
        expected = loop_oracle(per_example_grads, in_dims, 3, *inputs)
        assert_same(ours, expected, rtol=1e-5, atol=1e-5, msg=f"in_dims={in_dims}")


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


B = 5


def _stacked(x, bdim):
    return torch.stack([x + i for i in range(B)], bdim)


ONE_SIDED = [
    # (rule, args with the batched one physical, which is batched, its bdim, the kernel)
    (linalg.mm_rule, [_stacked(r(2, 3), 0), r(3, 4)], 0, 0, "mm"),
    (linalg.mm_rule, [_stacked(r(2, 3), 1), r(3, 4)], 0, 1, "mm"),
    (linalg.mm_rule, [r(2, 3), _stacked(r(3, 4), 1)], 1, 1, "mm"),
    (linalg.mm_rule, [r(2, 3), _stacked(r(3, 4), 2)], 1, 2, "mm"),
    (linalg.mm_rule, [r(2, 3), r(B, 4, 3).mT], 1, 0, "mm"),  # a transposed batch of weights
    (linalg.bmm_rule, [_stacked(r(2, 2, 3), 1), r(2, 3, 4)], 0, 1, "bmm"),
    (linalg.bmm_rule, [r(2, 2, 3), _stacked(r(2, 3, 4), 3)], 1, 3, "bmm"),
    (linalg.mv_rule, [_stacked(r(2, 3), 0), r(3)], 0, 0, "mm"),
    (linalg.mv_rule, [r(2, 3), _stacked(r(3), 0)], 1, 0, "mm"),
    (linalg.dot_rule, [_stacked(r(3), 0), r(3)], 0, 0, "mm"),
    (linalg.dot_rule, [r(3), _stacked(r(3), 1)], 1, 1, "mm"),
    (linalg.addmm_rule, [r(4), _stacked(r(2, 3), 0), r(3, 4)], 1, 0, "addmm"),
    (linalg.addmm_rule, [r(2, 1), r(2, 3), _stacked(r(3, 4), 2)], 2, 2, "addmm"),
    (linalg.baddbmm_rule, [r(4), _stacked(r(2, 2, 3), 1), r(2, 3, 4)], 1, 1, "baddbmm"),
]
EAGER = {linalg.mm_rule: torch.mm, linalg.bmm_rule: torch.bmm, linalg.mv_rule: torch.mv,
         linalg.dot_rule: torch.dot, linalg.addmm_rule: torch.addmm,
         linalg.baddbmm_rule: torch.baddbmm}
HEAVY = ("mm", "bmm", "addmm", "baddbmm", "expand", "clone", "_unsafe_view", "copy_")


@pytest.mark.parametrize("rule,args,k,bdim,kernel", ONE_SIDED,
                         ids=[f"{c[0].__name__}-arg{c[2]}-bdim{c[3]}" for c in ONE_SIDED])
def test_one_sided_product_is_one_kernel_on_a_view(rule, args, k, bdim, kernel):
    """One batched operand: the batch folds into a free dim as a VIEW (no copy of the batched
    operand, no expand of the unbatched one) and one unbatched kernel runs."""
    in_dims = [None] * len(args)
    in_dims[k] = bdim
    log = _OpLog()
    with log:
        out, out_dim = rule(types.SimpleNamespace(batch_size=B), in_dims, *args)
    assert [op for op in log.ops if op in HEAVY] == [kernel], log.ops
    expected = torch.stack([EAGER[rule](*[a.select(bdim, i) if j == k else a
                                          for j, a in enumerate(args)]) for i in range(B)])
    assert_same(out.movedim(out_dim, 0), expected)


def test_non_foldable_layout_copies_only_the_batched_operand():
    a = torch.randn(B, 3, 4).mT  # physical [B, n, k] with n innermost: no fold is a view
    w = torch.randn(3, 5)
    log = _OpLog()
    with log:
        out, out_dim = linalg.mm_rule(types.SimpleNamespace(batch_size=B), [0, None], a, w)
    assert "expand" not in log.ops and "bmm" not in log.ops and log.ops.count("mm") == 1, log.ops
    assert_same(out.movedim(out_dim, 0), a @ w)


def _mlp_loss(p, x, y):
    h = torch.tanh(F.linear(x, p["w1"], p["b1"]))
    return ((F.linear(h, p["w2"], p["b2"]) - y) ** 2).mean()


def _mlp_data():
    params = {"w1": r(8, 5), "b1": r(8), "w2": r(3, 8), "b2": r(3)}
    return params, r(6, 5), r(6, 3)


@pytest.mark.parametrize("example_shape", [(5,), (2, 5)], ids=["vector", "minibatch"])
def test_per_sample_gradients_of_an_mlp_vs_torch_func(example_shape):
    """Per-sample gradients through torch.autograd.grad inside functrans.vmap."""
    params, xs, ys = _mlp_data()
    xs = torch.randn(6, *example_shape, generator=g)
    ys = torch.randn(6, *example_shape[:-1], 3, generator=g)

    def per_sample(x, y):
        with torch.enable_grad():
            p = {k: v.detach().requires_grad_() for k, v in params.items()}
            grads = torch.autograd.grad(_mlp_loss(p, x, y), list(p.values()))
        return dict(zip(p, grads))

    with ft.config.strict_fallback():
        ours = ft.vmap(per_sample)(xs, ys)
    ref = torch.func.vmap(torch.func.grad(_mlp_loss), in_dims=(None, 0, 0))(params, xs, ys)
    assert_same(ours, ref, rtol=1e-5, atol=1e-6)


def test_per_sample_gradients_with_ft_grad_vs_torch_func():
    params, xs, ys = _mlp_data()
    with ft.config.strict_fallback():
        ours = ft.vmap(ft.grad(_mlp_loss), in_dims=(None, 0, 0))(params, xs, ys)
    ref = torch.func.vmap(torch.func.grad(_mlp_loss), in_dims=(None, 0, 0))(params, xs, ys)
    assert_same(ours, ref, rtol=1e-5, atol=1e-6)


def test_input_gradients_of_an_mlp_vs_torch_func():
    params, xs, ys = _mlp_data()

    def per_example(x, y):
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            return torch.autograd.grad(_mlp_loss(params, x, y), x)[0]

    with ft.config.strict_fallback():
        ours = ft.vmap(per_example)(xs, ys)
    ref = torch.func.vmap(torch.func.grad(_mlp_loss, argnums=1), in_dims=(None, 0, 0))(
        params, xs, ys)
    assert_same(ours, ref, rtol=1e-5, atol=1e-6)


def test_ensemble_of_mlps_vs_torch_func():
    """Batched weights, shared input: the b-side fold and the both-batched paths."""
    stacked = {k: make_batch(v, 0, 4) for k, v in _mlp_data()[0].items()}
    x = r(6, 5)

    def forward(p, x):
        return F.linear(torch.tanh(F.linear(x, p["w1"], p["b1"])), p["w2"], p["b2"])

    with ft.config.strict_fallback():
        ours = ft.vmap(forward, in_dims=(0, None))(stacked, x)
    assert_same(ours, torch.func.vmap(forward, in_dims=(0, None))(stacked, x))


def test_bilinear_trilinear_forward_and_per_sample_grads():
    import torch.nn.functional as F
    import functrans as ft
    from tests.support.oracles import assert_same, check_vmap_all_bdims
    x1, x2, w, b = torch.randn(4, 3), torch.randn(4, 5), torch.randn(6, 3, 5), torch.randn(6)
    check_vmap_all_bdims(lambda a, c, ww, bb: F.bilinear(a, c, ww, bb), [x1, x2, w, b])
    check_vmap_all_bdims(lambda a, c, ww: F.bilinear(a, c, ww), [x1[0], x2[0], w])
    f = lambda ww, a, c: F.bilinear(a, c, ww).pow(2).sum()
    X1, X2 = torch.randn(3, 4, 3), torch.randn(3, 4, 5)
    for dims in ((None, 0, 0), (0, 0, None)):
        args = (w if dims[0] is None else torch.randn(3, 6, 3, 5), X1,
                X2 if dims[2] is not None else X2[0])
        with ft.config.strict_fallback():
            got = ft.vmap(ft.grad(f), in_dims=dims)(*args)
        assert_same(got, torch.func.vmap(torch.func.grad(f), in_dims=dims)(*args),
                    rtol=1e-5, atol=1e-5)
