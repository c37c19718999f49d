"""Batching rules of functrans/batching/rules/reductions.py against the for-loop oracle.

Every case runs over every in_dims choice and nested (``check_vmap_all_bdims``, strict: no
fallback), on several shapes including a logically 0-d example; float cases are also checked
under autograd, both through vmap (``grad(vmap(f))``) and inside it (``vmap(grad(f))``, which
batches the backward ops).
"""
import math

import pytest
import torch
import torch.nn.functional as F

import functrans
from functrans.batching.op_schema import decomposes_above_dispatch
from functrans.batching.registry import find_rule
from tests.support.oracles import (assert_same, check_vmap, check_vmap_all_bdims, loop_oracle,
                                    make_batch)

aten = torch.ops.aten

MATS = [(3, 4), (2, 1, 5)]   # 2-d and 3-d with a size-1 dim
ANY = MATS + [()]            # ... and a logically 0-d example
NAN = float("nan")

# (id, per-example function, example shapes)
FLOAT_CASES = [
    # sum / mean / nansum
    ("sum", lambda t: t.sum(), ANY),
    ("sum_dim0", lambda t: t.sum(0), ANY),
    ("sum_neg_keepdim", lambda t: t.sum(-1, keepdim=True), ANY),
    ("sum_dims", lambda t: t.sum((0, -1)), MATS),
    ("sum_dim_none_keepdim", lambda t: torch.sum(t, dim=None, keepdim=True), ANY),
    ("sum_dim_empty", lambda t: torch.sum(t, dim=[]), ANY),
    ("sum_dtype", lambda t: t.sum(dtype=torch.float64), ANY),
    ("sum_dim_dtype", lambda t: t.sum(-1, dtype=torch.float64), ANY),
    ("mean", lambda t: t.mean(), ANY),
    ("mean_dim", lambda t: t.mean(-1, keepdim=True), ANY),
    ("mean_dims", lambda t: t.mean((1, 0)), MATS),
    ("mean_dtype", lambda t: t.mean(0, dtype=torch.float64), ANY),
    ("nansum", lambda t: torch.where(t > 0.5, NAN, t).nansum(), ANY),
    ("nansum_dim", lambda t: torch.where(t > 0.5, NAN, t).nansum(-1, keepdim=True), ANY),
    # prod
    ("prod", lambda t: t.prod(), ANY),
    ("prod_dim", lambda t: t.prod(-1), ANY),
    ("prod_dim_keepdim", lambda t: t.prod(0, keepdim=True, dtype=torch.float64), ANY),
    # amax / amin / max / min / aminmax
    ("amax", lambda t: t.amax(), ANY),
    ("amax_dims_keepdim", lambda t: t.amax((0, -1), keepdim=True), MATS),
    ("amin_dim", lambda t: t.amin(-1), ANY),
    ("max", lambda t: t.max(), ANY),
    ("min", lambda t: t.min(), ANY),
    ("max_dim", lambda t: t.max(0), ANY),
    ("max_dim_keepdim", lambda t: t.max(-1, keepdim=True), ANY),
    ("min_dim", lambda t: t.min(-1), ANY),
    ("aminmax", lambda t: torch.aminmax(t), ANY),
    ("aminmax_none_keepdim", lambda t: torch.aminmax(t, dim=None, keepdim=True), ANY),
    ("aminmax_dim", lambda t: torch.aminmax(t, dim=-1, keepdim=True), ANY),
    # argmax / argmin (indices must be logical)
    ("argmax", lambda t: t.argmax(), ANY),
    ("argmax_keepdim", lambda t: t.argmax(keepdim=True), ANY),
    ("argmax_dim", lambda t: t.argmax(-1), ANY),
    ("argmin_dim_keepdim", lambda t: t.argmin(0, keepdim=True), ANY),
    ("argmin", lambda t: t.argmin(), ANY),
    # var / std / var_mean / std_mean
    ("var", lambda t: t.var(), MATS),
    ("var_dim", lambda t: t.var(0), MATS),
    ("var_dim_keepdim_corr0", lambda t: t.var(-1, keepdim=True, correction=0), ANY),
    ("var_none_keepdim", lambda t: torch.var(t, dim=None, keepdim=True), MATS),
    ("std", lambda t: t.std(), MATS),
    ("std_dims", lambda t: t.std((0, -1)), MATS),
    ("std_unbiased_false", lambda t: t.std(0, unbiased=False), ANY),
    ("var_mean", lambda t: torch.var_mean(t, -1), MATS),
    ("var_mean_all", lambda t: torch.var_mean(t, correction=0), ANY),
    ("std_mean_keepdim", lambda t: torch.std_mean(t, (0, -1), keepdim=True, correction=2), MATS),
    # norms
    ("norm_scalar", lambda t: aten.norm.Scalar(t, 3), ANY),
    ("norm_scalar_default", lambda t: aten.norm.Scalar(t), ANY),
    ("norm_dtype", lambda t: aten.norm.ScalarOpt_dtype(t, 1, dtype=torch.float64), ANY),
    ("norm_dim", lambda t: aten.norm.ScalarOpt_dim(t, 2, [-1], True), ANY),
    ("norm_dim_empty", lambda t: aten.norm.ScalarOpt_dim(t, 2, []), ANY),
    ("norm_dim_dtype", lambda t: aten.norm.ScalarOpt_dim_dtype(t, 1, [0], False,
                                                               dtype=torch.float64), ANY),
    ("torch_norm", lambda t: t.norm(), ANY),
    ("torch_norm_p_dim", lambda t: torch.norm(t, p=3, dim=-1, keepdim=True), ANY),
    ("vector_norm", lambda t: torch.linalg.vector_norm(t), ANY),
    ("vector_norm_ord1_dim", lambda t: torch.linalg.vector_norm(t, 1, -1), ANY),
    ("vector_norm_inf_dims", lambda t: torch.linalg.vector_norm(t, math.inf, (0, 1), True), MATS),
    ("vector_norm_dtype", lambda t: torch.linalg.vector_norm(t, 0.5, dtype=torch.float64), ANY),
    # logsumexp
    ("logsumexp", lambda t: t.logsumexp(0), ANY),
    ("logsumexp_dims_keepdim", lambda t: t.logsumexp((0, -1), keepdim=True), MATS),
    ("logsumexp_neg", lambda t: t.logsumexp(-1), ANY),
    # scans
    ("cumsum", lambda t: t.cumsum(0), ANY),
    ("cumsum_neg_dtype", lambda t: t.cumsum(-1, dtype=torch.float64), ANY),
    ("cumprod", lambda t: t.cumprod(-1), ANY),
    ("cumsum_inplace", lambda t: t.clone().cumsum_(-1), ANY),
    ("cumprod_inplace", lambda t: t.clone().cumprod_(0), ANY),
    ("cummax", lambda t: t.cummax(-1), ANY),
    ("cummin", lambda t: t.cummin(0), ANY),
    ("logcumsumexp", lambda t: t.logcumsumexp(-1), ANY),
    # softmax
    ("softmax", lambda t: t.softmax(-1), ANY),
    ("softmax_dim0", lambda t: F.softmax(t, 0), ANY),
    ("softmax_dtype", lambda t: F.softmax(t, -1, dtype=torch.float64), ANY),
    ("log_softmax", lambda t: t.log_softmax(0), ANY),
    ("log_softmax_neg", lambda t: F.log_softmax(t, -1), ANY),
    # order statistics
    ("median", lambda t: t.median(), ANY),
    ("median_dim", lambda t: t.median(-1), ANY),
    ("nanmedian", lambda t: torch.where(t > 0.5, NAN, t).nanmedian(), ANY),
    ("nanmedian_dim_keepdim", lambda t: torch.where(t > 0.5, NAN, t).nanmedian(0, True), ANY),
    ("kthvalue", lambda t: t.kthvalue(1, 0, keepdim=True), ANY),
    ("kthvalue_last_dim", lambda t: t.kthvalue(2), MATS),
    ("mode", lambda t: torch.round(t).mode(), ANY),
    # counting
    ("count_nonzero", lambda t: torch.count_nonzero(torch.relu(t - 0.3)), ANY),
    ("count_nonzero_dim", lambda t: torch.count_nonzero(torch.relu(t - 0.3), -1), ANY),
    ("count_nonzero_dims", lambda t: torch.count_nonzero(torch.relu(t - 0.3), (0, 1)), MATS),
]

INT_CASES = [
    ("sum", lambda t: t.sum()),
    ("sum_dim", lambda t: t.sum(-1, keepdim=True)),
    ("prod", lambda t: t.prod()),
    ("prod_dim", lambda t: t.prod(0)),
    ("cumsum", lambda t: t.cumsum(-1)),
    ("cumprod", lambda t: t.cumprod(0)),
    ("amax", lambda t: t.amax(-1)),
    ("max_dim", lambda t: t.max(0)),
    ("argmin", lambda t: t.argmin()),
    ("aminmax", lambda t: torch.aminmax(t)),
    ("cummax", lambda t: t.cummax(-1)),
    ("count_nonzero", lambda t: torch.count_nonzero(t, -1)),
    ("mode", lambda t: t.mode(0)),
    ("median", lambda t: t.median()),
    ("nansum", lambda t: t.nansum(0)),
]

BOOL_CASES = [
    ("any", lambda t: t.any(), ANY),
    ("all", lambda t: t.all(), ANY),
    ("any_dim", lambda t: t.any(-1), ANY),
    ("all_dim_keepdim", lambda t: t.all(0, keepdim=True), ANY),
    ("any_dims", lambda t: t.any((0, -1)), MATS),
    ("all_dims_keepdim", lambda t: torch.all(t, dim=(-1,), keepdim=True), ANY),
    ("any_dims_empty", lambda t: aten.any.dims(t, []), ANY),
    ("all_dims_none", lambda t: aten.all.dims(t, None, True), ANY),
    ("sum", lambda t: t.sum(0), ANY),
    ("count_nonzero", lambda t: torch.count_nonzero(t), ANY),
]


def _params_of(cases):
    for name, f, shapes in cases:
        for shape in shapes:
            yield pytest.param(f, shape, id=f"{name}-{'x'.join(map(str, shape)) or '0d'}")


@pytest.mark.parametrize("f,shape", list(_params_of(FLOAT_CASES)))
def test_float(f, shape):
    check_vmap_all_bdims(f, [torch.randn(shape)])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
@pytest.mark.parametrize("shape", [(3, 4), ()], ids=["3x4", "0d"])
@pytest.mark.parametrize("f", [c[1] for c in INT_CASES], ids=[c[0] for c in INT_CASES])
def test_integer(f, shape, dtype):
    check_vmap_all_bdims(f, [torch.randint(0, 6, shape, dtype=dtype)])


@pytest.mark.parametrize("f,shape", list(_params_of(BOOL_CASES)))
def test_bool(f, shape):
    x = torch.rand(shape) > 0.5
    check_vmap_all_bdims(f, [x])


@pytest.mark.parametrize("op", [aten._softmax_backward_data.default,
                                aten._log_softmax_backward_data.default])
@pytest.mark.parametrize("shape,dim", [((3, 4), -1), ((3, 4), 0), ((), 0)])
def test_softmax_backward_data(op, shape, dim):
    f = lambda g, out: op(g, out, dim, torch.float32)
    check_vmap_all_bdims(f, [torch.randn(shape), torch.randn(shape).softmax(dim)])


# ---- batch layout edge cases --------------------------------------------------------------

@pytest.mark.parametrize("f", [lambda t: t.sum(-1), lambda t: t.max(0), lambda t: t.argmax(),
                               lambda t: t.var(1, keepdim=True), lambda t: t.cumsum(0),
                               lambda t: t.softmax(-1)])
@pytest.mark.parametrize("bdim", [0, 1, 2])
def test_non_contiguous_physical_input(f, bdim):
    x = torch.randn(5, 4, 3).transpose(0, 2)[:, ::2]  # (3, 2, 5), non-contiguous
    assert not x.is_contiguous()
    with functrans.config.strict_fallback():
        actual = functrans.vmap(f, in_dims=bdim)(x)
    assert_same(actual, loop_oracle(f, [bdim], x.shape[bdim], x))


@pytest.mark.parametrize("f", [lambda t: t.sum(), lambda t: t.amax(-1), lambda t: t.min(1),
                               lambda t: t.logsumexp(0), lambda t: t.cummin(-1)])
def test_batch_size_one(f):
    check_vmap(f, [torch.randn(3, 4)], [1], size=1)


def test_max_indices_are_logical():
    x = torch.zeros(4, 3, 5)
    x[2, 1, 3] = 1.0  # example 3 (bdim -1) has its max at logical (2, 1)
    out = functrans.vmap(lambda t: (t.argmax(), t.max(0).indices, torch.aminmax(t)),
                         in_dims=-1)(x)
    assert out[0][3].item() == 2 * 3 + 1
    assert out[1][3].tolist() == [0, 2, 0]
    assert out[0].max() < 12


def test_inplace_scan_writes_into_batched_input():
    x = make_batch(torch.randn(3, 4), -1, 3)
    expected = loop_oracle(lambda t: t.clone().cumsum_(0), [-1], 3, x)
    with functrans.config.strict_fallback():
        out = functrans.vmap(lambda t: t.cumsum_(0), in_dims=-1)(x)
    assert_same(out, expected)
    assert_same(x.movedim(-1, 0), expected)


@pytest.mark.parametrize("f", [lambda t: t.sum(2), lambda t: t.max(-3), lambda t: t.cumsum(2),
                               lambda t: t.argmax(5), lambda t: t.softmax(-3)])
def test_dim_out_of_range_is_logical(f):
    # The example is 2-d; the physical tensor is 3-d, but dim 2 / -3 must still be refused.
    with pytest.raises(IndexError):
        f(torch.randn(3, 4))
    with pytest.raises(IndexError):
        functrans.vmap(f)(torch.randn(5, 3, 4))


def test_zero_d_rejects_dim_one():
    with pytest.raises(IndexError):
        functrans.vmap(lambda t: t.sum(1))(torch.randn(3))
    with pytest.raises(IndexError):
        functrans.vmap(lambda t: t.cumsum(1))(torch.randn(3))


@pytest.mark.parametrize("shape", [(5, 3, 4), (5,)])
def test_repeated_dim_is_refused(shape):
    # On a 0-d example, dims 0 and -1 are the same dim.
    with pytest.raises(RuntimeError, match="multiple times"):
        functrans.vmap(lambda t: t.sum((0, -1 - (t.dim() > 0))))(torch.randn(shape))


# ---- autograd -----------------------------------------------------------------------------

GRAD_CASES = [c for c in FLOAT_CASES if not c[0].startswith(("argm", "count_nonzero"))]


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _weighted(f):
    """A scalar loss whose cotangent differs per output element (so the backward is tested)."""
    def loss(t):
        out = _first(f(t))
        w = torch.arange(1.0, out.numel() + 1, dtype=out.dtype).reshape(out.shape)
        return (out * w).sum()
    return loss


def _aminmax_differentiable(forward: bool) -> bool:
    """Whether this torch has a derivative formula for aten.aminmax (torch 2.11 has neither a
    backward nor a forward-mode one: eager autograd raises on it; torch 2.13 has both)."""
    x = torch.randn(3, dtype=torch.float64)
    try:
        if forward:
            import torch.autograd.forward_ad as fwAD
            with fwAD.dual_level():
                torch.aminmax(fwAD.make_dual(x, torch.ones_like(x)))
        else:
            torch.aminmax(x.requires_grad_())[0].backward()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _needs_aminmax_derivative(name, forward):
    return pytest.mark.skipif(
        name.startswith("aminmax") and not _aminmax_differentiable(forward),
        reason="this torch (2.11) has no " + ("forward-mode " if forward else "") +
               "derivative formula for aten.aminmax: eager autograd raises on it too")


def _grad_params():
    for name, f, shapes in GRAD_CASES:
        for shape in (shapes[0], ()) if () in shapes else shapes[:1]:
            yield pytest.param(f, shape, id=f"{name}-{'x'.join(map(str, shape)) or '0d'}",
                               marks=_needs_aminmax_derivative(name, False))


@pytest.mark.parametrize("f,shape", list(_grad_params()))
def test_grad_through_vmap(f, shape):
    x = make_batch(torch.randn(shape, dtype=torch.float64), -1, 3).requires_grad_()
    loss = _weighted(f)
    with functrans.config.strict_fallback():
        actual, = torch.autograd.grad(functrans.vmap(loss, in_dims=-1)(x).sum(), x)
    expected, = torch.autograd.grad(loop_oracle(loss, [-1], 3, x).sum(), x)
    assert_same(actual, expected)


@pytest.mark.parametrize("f,shape", list(_grad_params()))
def test_vmap_of_grad(f, shape):
    # The backward ops run on BatchedTensors: this batches them (some belong to other rule
    # families, so this is not strict; test_backward_ops_are_batched proves ours run).
    x = make_batch(torch.randn(shape, dtype=torch.float64), -1, 3)
    loss = _weighted(f)
    actual = functrans.vmap(functrans.grad(loss), in_dims=-1)(x)
    expected = torch.stack([torch.func.grad(loss)(x[..., i]) for i in range(3)])
    assert_same(actual, expected)


# aten.norm.Scalar / ScalarOpt_dtype: PyTorch's own forward-mode formula fails on them, eager
# too ("Trying to set a forward gradient that has a different size").
JVP_CASES = [c for c in GRAD_CASES if not c[0].startswith(("norm_scalar", "norm_dtype"))]


@pytest.mark.parametrize("f", [pytest.param(c[1], id=c[0],
                                            marks=_needs_aminmax_derivative(c[0], True))
                               for c in JVP_CASES])
def test_vmap_of_jvp(f):
    x = make_batch(torch.randn(3, 4, dtype=torch.float64), 0, 3)
    v = make_batch(torch.randn(3, 4, dtype=torch.float64), 0, 3)
    tangent_out = lambda p, t: functrans.jvp(lambda a: _first(f(a)), (p,), (t,))[1]
    expected = torch.stack([torch.func.jvp(lambda a: _first(f(a)), (x[i],), (v[i],))[1]
                            for i in range(3)])
    assert_same(functrans.vmap(tangent_out)(x, v), expected)


@pytest.mark.parametrize("f", [lambda t: t.softmax(-1), lambda t: F.log_softmax(t, 0)])
def test_backward_ops_are_batched(f):
    x = make_batch(torch.randn(3, 4, dtype=torch.float64), 1, 3)
    g = torch.randn(3, 4, dtype=torch.float64)
    loss = lambda t: (f(t) * g).sum()
    with functrans.config.strict_fallback():
        actual = functrans.vmap(functrans.grad(loss), in_dims=1)(x)
    expected = torch.stack([torch.func.grad(loss)(x[:, i]) for i in range(3)])
    assert_same(actual, expected)


# ---- against torch.vmap, and the op list ---------------------------------------------------

@pytest.mark.parametrize("f", [lambda t: t.sum((0, -1), keepdim=True), lambda t: t.max(-1),
                               lambda t: t.argmax(), lambda t: torch.var_mean(t, 0),
                               lambda t: t.logsumexp(-1), lambda t: t.cummax(0),
                               lambda t: torch.linalg.vector_norm(t, 3, -1),
                               lambda t: F.log_softmax(t, 1), lambda t: (t > 0).any(-1)])
@pytest.mark.parametrize("in_dim", [0, -1])
def test_matches_torch_vmap(f, in_dim):
    x = torch.randn(4, 3, 5)
    with functrans.config.strict_fallback():
        actual = functrans.vmap(f, in_dims=in_dim)(x)
    assert_same(actual, torch.vmap(f, in_dims=in_dim)(x))


OWNED = [aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim,
         aten.prod.default, aten.prod.dim_int, aten.amax.default, aten.amin.default,
         aten.max.default, aten.max.dim, aten.min.default, aten.min.dim, aten.aminmax.default,
         aten.argmax.default, aten.argmin.default, aten.var.correction, aten.std.correction,
         aten.var_mean.correction, aten.std_mean.correction, aten.norm.Scalar,
         aten.norm.ScalarOpt_dim, aten.norm.ScalarOpt_dim_dtype, aten.norm.ScalarOpt_dtype,
         aten.linalg_vector_norm.default, aten.logsumexp.default, aten.cumsum.default,
         aten.cumsum_.default, aten.cumprod.default, aten.cumprod_.default,
         aten.cummax.default, aten.cummin.default, aten.logcumsumexp.default,
         aten._logcumsumexp.default, aten._softmax.default, aten._log_softmax.default,
         aten._softmax_backward_data.default, aten._log_softmax_backward_data.default,
         aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim,
         aten.all.dims, aten.nansum.default, aten.count_nonzero.default,
         aten.count_nonzero.dim_IntList, aten.median.default, aten.median.dim,
         aten.nanmedian.default, aten.nanmedian.dim, aten.mode.default, aten.kthvalue.default]


@pytest.mark.parametrize("op", OWNED, ids=str)
def test_owned_ops_have_a_rule_and_are_not_composite(op):
    assert not decomposes_above_dispatch(op)
    assert find_rule(op)[0] == "rule"


def test_hash_tensor():
    x = torch.randn(3, 4)
    for kwargs in ({}, {"dim": [1]}, {"dim": [0, 1], "keepdim": True}):
        check_vmap_all_bdims(lambda a: torch.ops.aten.hash_tensor(a, **kwargs), [x])


@pytest.mark.parametrize("in_dim", [0, -1])
@pytest.mark.parametrize("op", [torch.median, torch.nanmedian], ids=["median", "nanmedian"])
def test_median_of_expanded_examples_layout_expanded(op, in_dim):
    """Layout ``expanded`` (issue 25): each example expanded (stride 0) along the reduced dim,
    different examples in the batch.  Eager median.dim / nanmedian.dim over a stride-0 dim
    return uninitialised memory; the rule gives the contiguous loop's answer (See Note
    [layout-dependent kernels]), for the dim overload and for the whole-tensor median."""
    from tests.support.oracles import contiguous_loop
    g = torch.Generator().manual_seed(3)
    B = 3
    base = torch.randn(B, 4, 1, generator=g)          # example k: 4 rows, each one value
    x = base.expand(B, 4, 6)                          # ... repeated 6 times (stride 0)
    if in_dim == -1:
        x = base.permute(1, 2, 0).expand(4, 6, B)     # the batch innermost in memory
    for f in (lambda t: op(t, 1), lambda t: op(t, 0), lambda t: op(t)):
        want = contiguous_loop(f, (in_dim,), B, x)
        with functrans.config.strict_fallback():
            got = functrans.vmap(f, in_dims=in_dim)(x)
        assert_same(got, want)
