"""Normalisation rules (layer / group / batch / instance norm, forward and backward) vs the
loop oracle (every in_dims choice, vmap∘vmap, strict), running-stat updates under vmap, and
per-sample gradients of small networks vs torch.func."""
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

import functrans as ft
from tests.support.oracles import (assert_same, check_vmap, check_vmap_all_bdims, loop_oracle,
                                    make_batch)

aten = torch.ops.aten
g = torch.Generator().manual_seed(0)
X = torch.randn(4, 6, 5, generator=g)          # [N, C, L]
X4 = torch.randn(2, 6, 3, 4, generator=g)      # [N, C, H, W]
W = torch.randn(6, generator=g)
BIAS = torch.randn(6, generator=g)
RM = torch.randn(6, generator=g)
RV = torch.rand(6, generator=g) + 0.5
EPS = 1e-5


def _defined(outs):
    """The outputs a backward op computed (vmap cannot return None)."""
    return tuple(o for o in outs if o is not None)


def _pairs(n_free, n_batched):
    """in_dims with ``n_free`` tensors in {0, -1, None} then ``n_batched`` always batched."""
    for free in itertools.product((0, -1, None), repeat=n_free):
        for fixed in itertools.product((0, -1), repeat=n_batched):
            yield free + fixed


# ----------------------------------------------------------------------------- layer norm

@pytest.mark.parametrize("shape", [(5,), (6, 5)])
def test_layer_norm_affine(shape):
    w, b = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    check_vmap_all_bdims(lambda x, w, b: F.layer_norm(x, shape, w, b), [X, w, b])


def test_layer_norm_plain_and_native_outputs():
    check_vmap_all_bdims(lambda x: F.layer_norm(x, (5,)), [X])
    check_vmap_all_bdims(lambda x, w: aten.native_layer_norm(x, [6, 5], None, w, EPS),
                         [X, torch.randn(6, 5, generator=g)])


@pytest.mark.parametrize("mask", [[True, True, True], [True, False, False],
                                  [False, True, True]])
def test_native_layer_norm_backward(mask):
    w, b = W[:5], BIAS[:5]

    def f(grad, x, w):
        _, mean, rstd = aten.native_layer_norm(x, [5], w, b, EPS)
        return _defined(aten.native_layer_norm_backward(grad, x, [5], mean, rstd, w, b, mask))
    check_vmap_all_bdims(f, [torch.randn_like(X), X, w])


def test_layer_norm_vjp_batched_bias():
    def f(x, b, ct):
        return ft.vjp(lambda x, b: F.layer_norm(x, (5,), W[:5], b), x, b)[1](ct)
    check_vmap_all_bdims(f, [X, BIAS[:5], torch.randn_like(X)], nested=False)


# ----------------------------------------------------------------------------- group norm

@pytest.mark.parametrize("x", [X, X4, X[:, :, 0]], ids=["3d", "4d", "2d"])
def test_group_norm(x):
    check_vmap_all_bdims(lambda x, w, b: F.group_norm(x, 3, w, b), [x, W, BIAS])


def test_native_group_norm_outputs():
    def f(x, w):  # .contiguous(): the kernel's contract (see the next test)
        return aten.native_group_norm(x.contiguous(), w.contiguous(), None, 2, 6, 12, 2, EPS)
    check_vmap_all_bdims(f, [X4, W])


def _contiguous_loop(f, args, in_dims):
    """The loop over CONTIGUOUS examples: what the op computes, whatever the layout."""
    n = next(a.shape[d] for a, d in zip(args, in_dims) if d is not None)
    outs = [f(*[a if d is None else a.select(d, i).contiguous() for a, d in zip(args, in_dims)])
            for i in range(n)]
    return [None if o[0] is None else torch.stack(o) for o in zip(*outs)]


@pytest.mark.parametrize("layout", ["stacked last", "sliced"])
def test_native_group_norm_answer_does_not_depend_on_the_layout(layout):
    """Issue 25's repro: every batched operand with its batch dim physically last (eager's
    kernel reads a non-contiguous weight as contiguous memory: a layout-dependent value).  The
    rule gives the op's value on contiguous examples, as torch.func does."""
    g = torch.Generator().manual_seed(5)
    N, C, HW, G, B = 2, 4, 3, 2, 3
    f = lambda x, w, b: aten.native_group_norm(x, w, b, N, C, HW, G, 0.5)  # noqa: E731
    examples = [(torch.randn(N, C, HW, generator=g), torch.randn(C, generator=g),
                 torch.randn(C, generator=g)) for _ in range(B)]
    if layout == "stacked last":        # the batch physically contiguous in the last position
        args = [torch.stack(t, dim=-1) for t in zip(*examples)]
    else:                               # a strided slice of a wider buffer
        args = [torch.stack(t, dim=-1).repeat_interleave(2, -1)[..., ::2] for t in zip(*examples)]
    for in_dims in [(-1, -1, -1), (-1, None, None), (None, -1, -1), (-1, -1, None)]:
        call = [a if d is not None else a[..., 0].contiguous() for a, d in zip(args, in_dims)]
        with ft.config.strict_fallback():
            got = ft.vmap(f, in_dims=in_dims)(*call)
        want = _contiguous_loop(f, call, in_dims)
        assert_same(list(got), want, rtol=1e-5, atol=1e-6)
        assert_same(list(got), list(torch.func.vmap(f, in_dims=in_dims)(*call)),
                    rtol=1e-5, atol=1e-6)

    def bwd(grad, x, w):
        _, mean, rstd = aten.native_group_norm(x, w, None, N, C, HW, G, 0.5)
        return aten.native_group_norm_backward(grad, x, mean, rstd, w, N, C, HW, G,
                                               [True, True, True])
    grad = torch.randn(N, C, HW, B, generator=g)
    bargs = [grad, args[0].contiguous(), args[1]]
    with ft.config.strict_fallback():
        got = ft.vmap(bwd, in_dims=(-1, -1, -1))(*bargs)
    assert_same(list(got), _contiguous_loop(bwd, bargs, (-1, -1, -1)), rtol=1e-4, atol=1e-5)


def test_native_group_norm_under_vmap_of_vjp_vs_torch_func():
    """Per-example gradients through native_group_norm (its backward rule under vmap∘vjp),
    with a shared and with a per-example weight, against torch.func."""
    x, w = torch.randn(3, 4, 6, 5), W + 0.5
    cot = torch.randn(3, 4, 6, 5)

    def f(x, w, ct, vjp):
        out, pull = vjp(lambda a, b: aten.native_group_norm(a, b, None, 4, 6, 5, 3, EPS)[0],
                        x, w)
        return pull(ct)
    for in_dims, wb in [((0, None, 0), w), ((0, 0, 0), torch.stack([w, w * 2, w - 0.3]))]:
        ours = ft.vmap(lambda *a: f(*a, ft.vjp), in_dims=in_dims)(x, wb, cot)
        ref = torch.func.vmap(lambda *a: f(*a, torch.func.vjp), in_dims=in_dims)(x, wb, cot)
        assert_same(ours, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mask", [[True, True, True], [True, False, True]])
def test_native_group_norm_backward(mask):
    def f(grad, x, w):
        grad, x, w = grad.contiguous(), x.contiguous(), w.contiguous()  # as autograd does
        _, mean, rstd = aten.native_group_norm(x, w, None, 2, 6, 12, 3, EPS)
        return _defined(aten.native_group_norm_backward(grad, x, mean, rstd, w, 2, 6, 12, 3,
                                                        mask))
    check_vmap_all_bdims(f, [torch.randn_like(X4), X4, W])


# ----------------------------------------------------------------------------- batch norm

@pytest.mark.parametrize("x", [X4, X[:, :, 0]], ids=["4d", "2d"])
def test_batch_norm_training_without_running_stats(x):
    check_vmap_all_bdims(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
                         [x, W, BIAS], nested=x.dim() == 4)


def test_batch_norm_eval():
    check_vmap_all_bdims(lambda x, rm, rv: F.batch_norm(x, rm, rv, W, BIAS), [X, RM, RV])
    check_vmap_all_bdims(lambda x, w, b: F.batch_norm(x, RM, RV, w, b), [X4, W, BIAS])


def _bn_train(x, w, rm, rv):
    rm, rv = rm.clone(), rv.clone()
    out = F.batch_norm(x, rm, rv, w, BIAS, training=True, momentum=0.3)
    return out, rm, rv


def test_batch_norm_training_with_batched_running_stats():
    for dims in _pairs(2, 2):
        check_vmap(_bn_train, [X, W, RM, RV], dims)


def test_batch_norm_training_updates_batched_buffers_in_place():
    xs, rms, rvs = make_batch(X, 0, 3), make_batch(RM, 1, 3), make_batch(RV, 0, 3)
    exp_m, exp_v = rms.clone(), rvs.clone()
    expected = torch.stack([F.batch_norm(xs[i], exp_m[:, i], exp_v[i], training=True)
                            for i in range(3)])
    with ft.config.strict_fallback():
        got = ft.vmap(lambda x, m, v: F.batch_norm(x, m, v, training=True),
                      in_dims=(0, 1, 0))(xs, rms, rvs)
    assert_same(got, expected)
    assert_same(rms, exp_m)
    assert_same(rvs, exp_v)


def test_batch_norm_training_unbatched_buffers_batched_input_raises():
    rm, rv = RM.clone(), RV.clone()
    f = lambda x: F.batch_norm(x, rm, rv, W, BIAS, training=True)  # noqa: E731
    with pytest.raises(ft.UnsupportedUnderVmap,
                       match="native_batch_norm.*replace_all_batch_norm_modules_"):
        ft.vmap(f)(make_batch(X, 0, 3))
    assert_same(rm, RM)  # nothing was written
    assert_same(rv, RV)


def test_batch_norm_training_unbatched_input_updates_buffers_once():
    rm, rv = RM.clone(), RV.clone()
    ws = make_batch(W, 0, 3)
    with ft.config.strict_fallback():
        got = ft.vmap(lambda w: F.batch_norm(X, rm, rv, w, BIAS, training=True))(ws)
    exp_m, exp_v = RM.clone(), RV.clone()
    F.batch_norm(X, exp_m, exp_v, training=True)
    assert_same(rm, exp_m)
    assert_same(rv, exp_v)
    assert_same(got, torch.stack([F.batch_norm(X, None, None, w, BIAS, training=True)
                                  for w in ws]), rtol=1e-5, atol=1e-5)


def test_instance_norm():
    check_vmap_all_bdims(lambda x, w, b: F.instance_norm(x, weight=w, bias=b), [X4, W, BIAS])
    check_vmap_all_bdims(lambda x, rm: F.instance_norm(x, rm, RV, use_input_stats=False),
                         [X, RM])


# Direct calls of every batch-norm entry point (what decompositions and export reach).
def _legit(x, w, rm, rv):
    rm, rv = rm.clone(), rv.clone()
    return aten._native_batch_norm_legit(x, w, BIAS, rm, rv, True, 0.2, EPS), rm, rv


def _with_update(x, w, rm, rv):
    rm, rv = rm.clone(), rv.clone()
    return aten._batch_norm_with_update(x, w, BIAS, rm, rv, 0.2, EPS), rm, rv


def _legit_eval(x, w, rm, rv):
    return aten._native_batch_norm_legit(x, w, BIAS, rm, rv, False, 0.2, EPS)


@pytest.mark.parametrize("f", [_legit, _with_update, _legit_eval])
def test_batch_norm_entry_points_with_mutable_stats(f):
    for dims in _pairs(2, 2):
        check_vmap(f, [X, W, RM, RV], dims)


@pytest.mark.parametrize("f", [
    lambda x, w, rm: aten._native_batch_norm_legit_no_training(x, w, BIAS, rm, RV, 0.1, EPS),
    lambda x, w, rm: aten._native_batch_norm_legit_functional(x, w, BIAS, rm, RV, True, 0.1,
                                                              EPS),
    lambda x, w, rm: aten._batch_norm_with_update_functional(x, w, BIAS, rm, RV, 0.1, EPS),
    lambda x, w, rm: aten._batch_norm_no_update(x, w, BIAS, rm, RV, 0.1, EPS),
    lambda x, w, rm: aten.native_batch_norm(x, w, BIAS, rm, RV, False, 0.1, EPS),
    lambda x, w, rm: aten._native_batch_norm_legit.no_stats(x, w, rm, True, 0.1, EPS),
], ids=["no_training", "legit_functional", "with_update_functional", "no_update",
        "native_eval", "legit_no_stats"])
def test_batch_norm_functional_entry_points(f):
    check_vmap_all_bdims(f, [X, W, RM], nested=False)


@pytest.mark.parametrize("train, mask", [(True, [True, True, True]),
                                         (False, [True, False, False])])
def test_native_batch_norm_backward(train, mask):
    def f(grad, x, w):
        _, mean, invstd = aten.native_batch_norm(x, w, None, RM, RV, False, 0.1, EPS) \
            if not train else aten.native_batch_norm(x, w, None, None, None, True, 0.1, EPS)
        return _defined(aten.native_batch_norm_backward(grad, x, w, RM, RV, mean, invstd, train,
                                                        EPS, mask))
    check_vmap_all_bdims(f, [torch.randn_like(X4), X4, W])


@pytest.mark.parametrize("update", [True, False])
def test_batch_norm_backward(update):
    def f(grad, x, w):
        if update:
            stats = (x.sum((0, 2)) + w) * 0  # batched whenever the forward is
            _, mean, var, reserve = aten._batch_norm_with_update(
                x, w, None, stats, stats + 1, 0.1, EPS)
        else:
            _, mean, var, reserve = aten._batch_norm_no_update(x, w, None, RM, RV, 0.1, EPS)
        return aten.batch_norm_backward(grad, x, w, RM, RV, mean, var, update, EPS,
                                        [True, True, True], reserve)
    check_vmap_all_bdims(f, [torch.randn_like(X), X, W], nested=not update)


# ----------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("norm", ["layer", "group", "batch", "instance"])
def test_vmap_grad_strict_vs_loop(norm):
    fns = {
        "layer": lambda x, w: F.layer_norm(x, (6, 5), w[:, None].expand(6, 5)),
        "group": lambda x, w: F.group_norm(x, 2, w, w),
        "batch": lambda x, w: F.batch_norm(x, None, None, w, w, training=True),
        "instance": lambda x, w: F.instance_norm(x, weight=w, bias=w),
    }
    fn = fns[norm]
    loss = lambda x, w: (fn(x, w) ** 2 * torch.arange(5.0)).sum()  # noqa: E731
    xs, ws = make_batch(X, 0, 3), make_batch(W, 0, 3)
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(loss, argnums=(0, 1)))(xs, ws)
        got_shared = ft.vmap(ft.grad(loss, argnums=(0, 1)), in_dims=(0, None))(xs, W)
    exp = [torch.autograd.grad(loss(x.requires_grad_(), w.requires_grad_()), (x, w))
           for x, w in zip(xs.clone(), ws.clone())]
    assert_same(got, tuple(torch.stack(t) for t in zip(*exp)), rtol=1e-4, atol=1e-5)
    exp = [torch.autograd.grad(loss(x.requires_grad_(), w), (x, w))
           for x in xs.clone() for w in [W.clone().requires_grad_()]]
    assert_same(got_shared, tuple(torch.stack(t) for t in zip(*exp)), rtol=1e-4, atol=1e-5)


class _SmallCNN(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = {"group": nn.GroupNorm(2, 4), "layer": nn.LayerNorm([4, 5, 5]),
                     "batch": nn.BatchNorm2d(4)}[norm]
        self.fc = nn.Linear(4 * 25, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.norm(self.conv(x))).flatten(1))


@pytest.mark.parametrize("norm", ["group", "layer", "batch"])
def test_per_sample_gradients_of_small_cnn_vs_torch_func(norm):
    torch.manual_seed(0)
    model = _SmallCNN(norm).eval()  # batch norm: eval mode reads the (unbatched) buffers
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())
    xs, ys = torch.randn(5, 1, 2, 5, 5), torch.tensor([[0], [1], [2], [1], [0]])

    def loss(p, x, y):
        out = torch.func.functional_call(model, (p, buffers), (x,))
        return F.cross_entropy(out, y)
    with ft.config.strict_fallback():
        ours = ft.vmap(ft.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    ref = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    assert_same(ours, ref, rtol=1e-4, atol=1e-5)


def test_batch_norm_ensemble_training_vs_torch_func():
    torch.manual_seed(0)
    models = [_SmallCNN("batch") for _ in range(3)]
    def stack(name):
        per_model = [dict(getattr(m, name)()) for m in models]
        return {k: torch.stack([d[k].detach() for d in per_model]) for k in per_model[0]}
    params, buffers = stack("named_parameters"), stack("named_buffers")
    x = torch.randn(4, 2, 5, 5)

    def run(vmap, bufs):
        call = lambda p, b: torch.func.functional_call(models[0], (p, b), (x,))  # noqa: E731
        return vmap(call)(params, bufs)
    ours_bufs = {k: v.clone() for k, v in buffers.items()}
    ref_bufs = {k: v.clone() for k, v in buffers.items()}
    with ft.config.strict_fallback():
        ours = run(ft.vmap, ours_bufs)
    ref = run(torch.func.vmap, ref_bufs)
    assert_same(ours, ref, rtol=1e-4, atol=1e-5)
    assert_same(ours_bufs, ref_bufs, rtol=1e-5, atol=1e-6)
    assert not torch.equal(ours_bufs["norm.running_mean"], buffers["norm.running_mean"])


@pytest.mark.parametrize("f", [_legit, _with_update, _legit_eval])
@pytest.mark.parametrize("dims", [(0, None, None, None), (None, 0, None, None),
                                  (-1, 0, None, None)])
def test_unbatched_running_stats_where_the_update_is_possible(f, dims):
    # Eval mode writes nothing; an unbatched input gives every example the same update (a
    # batched weight does not change the statistics).  The rule decides (checks_inplace), so
    # these run instead of being refused; training with a batched input must still raise.
    training = f is not _legit_eval
    if training and dims[0] is not None:
        with pytest.raises(ft.UnsupportedUnderVmap, match="running"):
            check_vmap(f, [X, W, RM, RV], dims)
    else:
        check_vmap(f, [X, W, RM, RV], dims)


@pytest.mark.parametrize("dims", [(None, 0, None), (None, None, 0), (None, -1, 0)])
def test_batch_norm_with_only_the_affine_batched_also_under_fake_tensors(dims):
    """Only the affine batched: the statistics are computed once with a unit affine (not
    None), so the kernel picks the backend each example's call picks, and PyTorch's
    decomposition of the ops that return a cuDNN reserve (what FakeTensorMode and torch.compile
    run) works: it refuses a missing weight or bias (``_select_batch_norm_backend``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def f(x, w, b):
        rm, rv = RM.clone(), RV.clone()
        return aten._batch_norm_with_update(x, w, b, rm, rv, 0.2, EPS), rm, rv
    check_vmap(f, [X, W, BIAS], dims, rtol=1e-5, atol=1e-5)
    batched = [t if d is None else make_batch(t, d, 3) for t, d in zip((X, W, BIAS), dims)]
    with FakeTensorMode(allow_non_fake_inputs=True):
        expected = loop_oracle(f, dims, 3, *batched)
        with ft.config.strict_fallback():
            actual = ft.vmap(f, in_dims=dims)(*batched)
    meta = lambda tree: [(t.shape, t.dtype) for t in pytree.tree_leaves(tree)]  # noqa: E731
    assert meta(actual) == meta(expected)
