"""Every loss of torch.nn.functional that reaches a batching rule, under vmap against the
for-loop oracle with odd per-example shapes: 0-d and ``(1,)`` targets, 1-D vs 2-D inputs, class
dims of size 1, class weights, ignore_index, every reduction.  The per-example output SHAPE must
be eager's (reduction='none' is where rules used to get it wrong: multi_margin_loss of a ``[C]``
input with a ``(1,)`` target gives ``(1,)`` per example, not ``()``).  Forward and the backward
kernels (through ``vmap(grad)``) run strict: no loop fallback may hide a missing rule.

Also: ``F.one_hot`` with ``num_classes`` and without it (the clear data-dependence error)."""
import pytest
import torch
import torch.nn.functional as F

import functrans as ft
from functrans.errors import UnsupportedUnderVmap
from tests.support.oracles import check_vmap

REDUCTIONS = ["none", "sum", "mean"]


def _g(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=0):
    return torch.randn(shape, generator=_g(seed))


def rand(*shape, seed=0):
    return torch.rand(shape, generator=_g(seed))


def classes(hi, *shape, lo=0, seed=0):
    return torch.randint(lo, hi, shape, generator=_g(seed))


W5 = rand(5, seed=9) + 0.5
W1 = rand(1, seed=9) + 0.5

# name -> (loss(reduction) -> per-example function, per-example args).  The first argument is
# the differentiated input.
CASES = {
    # nll_loss / cross_entropy (nll_loss_forward / nll_loss2d_forward)
    "nll_1d_0d_target": (lambda r: lambda x, t: F.nll_loss(x, t, reduction=r),
                         [randn(5), classes(5)]),
    "nll_1d_1elem_target": (lambda r: lambda x, t: F.nll_loss(x, t, reduction=r),
                            [randn(5), classes(5, 1)]),
    "nll_2d_weight_ignore": (lambda r: lambda x, t: F.nll_loss(x, t, weight=W5, reduction=r,
                                                              ignore_index=2),
                             [randn(4, 5), classes(5, 4)]),
    "nll_1d_batched_weight": (lambda r: lambda x, t, w: F.nll_loss(x, t, weight=w, reduction=r),
                              [randn(5), classes(5), W5]),
    "nll_one_row": (lambda r: lambda x, t: F.nll_loss(x, t, reduction=r),
                    [randn(1, 5), classes(5, 1)]),
    "nll_one_class": (lambda r: lambda x, t: F.nll_loss(x, t, weight=W1, reduction=r),
                      [randn(3, 1), classes(1, 3)]),
    "nll_3d_input": (lambda r: lambda x, t: F.nll_loss(x, t, reduction=r, ignore_index=0),
                     [randn(2, 5, 3), classes(5, 2, 3)]),
    "cross_entropy_image": (lambda r: lambda x, t: F.cross_entropy(x, t, weight=W5, reduction=r),
                            [randn(2, 5, 3, 2), classes(5, 2, 3, 2)]),
    "cross_entropy_1d_smoothing": (lambda r: lambda x, t: F.cross_entropy(
        x, t, reduction=r, label_smoothing=0.2), [randn(5), classes(5)]),
    "cross_entropy_probs": (lambda r: lambda x, t: F.cross_entropy(x, t.softmax(-1),
                                                                   reduction=r),
                            [randn(3, 5), randn(3, 5, seed=1)]),
    # elementwise losses, 0-d and size-1 shapes
    "mse_0d": (lambda r: lambda x, t: F.mse_loss(x, t, reduction=r), [randn(), randn(seed=1)]),
    "mse_1elem": (lambda r: lambda x, t: F.mse_loss(x, t, reduction=r),
                  [randn(1), randn(1, seed=1)]),
    "mse_broadcast": (lambda r: lambda x, t: F.mse_loss(x, t.expand(3, 3), reduction=r),
                      [randn(3, 1), randn(3, seed=1)]),
    "l1_broadcast_target": (lambda r: lambda x, t: F.l1_loss(x, t.expand(2, 4), reduction=r),
                            [randn(2, 4), randn(4, seed=1)]),
    "huber_2d": (lambda r: lambda x, t: F.huber_loss(x, t, reduction=r, delta=0.4),
                 [randn(3, 1), randn(3, 1, seed=1)]),
    "smooth_l1_1d": (lambda r: lambda x, t: F.smooth_l1_loss(x, t, reduction=r, beta=0.3),
                     [randn(4), randn(4, seed=1)]),
    "l1_0d": (lambda r: lambda x, t: F.l1_loss(x, t, reduction=r), [randn(), randn(seed=1)]),
    "soft_margin_1elem": (lambda r: lambda x, t: F.soft_margin_loss(x, t.sign(), reduction=r),
                          [randn(1), randn(1, seed=1)]),
    "bce_weight": (lambda r: lambda x, t: F.binary_cross_entropy(
        x.sigmoid(), t.clamp(0, 1), weight=W5, reduction=r), [randn(2, 5), rand(2, 5, seed=1)]),
    "bce_0d": (lambda r: lambda x, t: F.binary_cross_entropy(x.sigmoid(), t.clamp(0, 1),
                                                             reduction=r),
               [randn(), rand(seed=1)]),
    "bce_logits_pos_weight": (lambda r: lambda x, t: F.binary_cross_entropy_with_logits(
        x, t, pos_weight=W1, reduction=r), [randn(3, 1), rand(3, 1, seed=1)]),
    "kl_div_log_target": (lambda r: lambda x, t: F.kl_div(x, t, reduction=r, log_target=True),
                          [randn(2, 3), randn(2, 3, seed=1)]),
    "poisson_nll": (lambda r: lambda x, t: F.poisson_nll_loss(x, t, reduction=r, full=True),
                    [randn(3), rand(3, seed=1) * 3]),
    # margin losses
    "multi_margin_1d_1elem_target": (lambda r: lambda x, t: F.multi_margin_loss(x, t,
                                                                               reduction=r),
                                     [randn(5), classes(5, 1)]),
    "multi_margin_1d_0d_target": (lambda r: lambda x, t: F.multi_margin_loss(
        x, t, p=2, margin=0.5, reduction=r), [randn(5), classes(5)]),
    "multi_margin_0d_input_1elem_target": (lambda r: lambda x, t: F.multi_margin_loss(
        x, t, reduction=r), [randn(), classes(1, 1)]),
    "multi_margin_one_row_0d_target": (lambda r: lambda x, t: F.multi_margin_loss(
        x, t, weight=W5, reduction=r), [randn(1, 5), classes(5)]),
    "multi_margin_one_class": (lambda r: lambda x, t: F.multi_margin_loss(x, t, weight=W1,
                                                                         reduction=r),
                               [randn(3, 1), classes(1, 3)]),
    "multi_margin_1d_batched_weight": (lambda r: lambda x, t, w: F.multi_margin_loss(
        x, t, weight=w, reduction=r), [randn(5), classes(5, 1), W5]),
    "multi_margin_rows_batched_weight_p2": (lambda r: lambda x, t, w: F.multi_margin_loss(
        x, t, p=2, weight=w, reduction=r), [randn(3, 5), classes(5, 3), W5]),
    "multi_margin_1elem_input": (lambda r: lambda x, t: F.multi_margin_loss(x, t, reduction=r),
                                 [randn(1), classes(1, 1)]),
    "multilabel_margin_1d": (lambda r: lambda x, t: F.multilabel_margin_loss(x, t, reduction=r),
                             [randn(5), torch.tensor([3, 0, -1, 1, 2])]),
    "multilabel_margin_0d_input_1elem_target": (lambda r: lambda x, t: F.multilabel_margin_loss(
        x, t, reduction=r), [randn(), torch.tensor([0])]),
    "multilabel_margin_one_row": (lambda r: lambda x, t: F.multilabel_margin_loss(
        x, t, reduction=r), [randn(1, 4), torch.tensor([[2, 1, -1, 0]])]),
    "multilabel_margin_one_class": (lambda r: lambda x, t: F.multilabel_margin_loss(
        x, t, reduction=r), [randn(3, 1), torch.tensor([[0], [-1], [0]])]),
    "multilabel_soft_margin_weight": (lambda r: lambda x, t: F.multilabel_soft_margin_loss(
        x, t.round(), weight=W5, reduction=r), [randn(2, 5), rand(2, 5, seed=1)]),
    "hinge_embedding_0d": (lambda r: lambda x, t: F.hinge_embedding_loss(x, t.sign(),
                                                                         reduction=r),
                           [randn(), randn(seed=1)]),
    "margin_ranking_1elem": (lambda r: lambda x, y, t: F.margin_ranking_loss(
        x, y, t.sign(), margin=0.1, reduction=r), [randn(1), randn(1, seed=1), randn(1, seed=2)]),
    "cosine_embedding_1d": (lambda r: lambda x, y, t: F.cosine_embedding_loss(
        x, y, t.sign(), reduction=r), [randn(4), randn(4, seed=1), randn(seed=2)]),
    "triplet_margin_2d": (lambda r: lambda a, p, n: F.triplet_margin_loss(a, p, n, reduction=r,
                                                                          swap=True),
                          [randn(2, 3), randn(2, 3, seed=1), randn(2, 3, seed=2)]),
}


# Eager's own backward refuses a [C] input with a (1,) target ("size mismatch"): forward only.
FORWARD_ONLY = {"nll_1d_1elem_target"}
# cross_entropy with label_smoothing is composite in ATen and ends with an in-place
# ``smooth_loss.masked_fill_(target == ignore_index, 0)``: with the input unbatched and the
# target batched that writes a batched mask into an unbatched tensor, which functrans (like
# torch.func) refuses with its clear in-place error.  Checked as such below.
INPLACE_REFUSED = {"cross_entropy_1d_smoothing": (None, 0)}


def _in_dims_choices(n):
    """Every argument batched at 0; each argument alone batched (at -1 for the first)."""
    yield (0,) * n
    for i in range(n):
        yield tuple((-1 if i == 0 else 0) if j == i else None for j in range(n))


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_loss_matches_the_loop(name, reduction):
    make, args = CASES[name]
    f = make(reduction)
    f(*args)  # the per-example call is valid in eager
    for in_dims in _in_dims_choices(len(args)):
        if INPLACE_REFUSED.get(name) == in_dims:
            batched = [a if d is None else torch.stack([a, a, a], d) for a, d in
                       zip(args, in_dims)]
            with pytest.raises(UnsupportedUnderVmap, match="in-place operation"):
                ft.vmap(f, in_dims=in_dims)(*batched)
            continue
        check_vmap(f, args, in_dims)
        if name not in FORWARD_ONLY:
            check_vmap(ft.grad(lambda *a: f(*a).sum()), args, in_dims)


def test_multi_margin_loss_none_keeps_the_targets_dim():
    """The reported case: a [C] input with a (1,) target gives (1,) per example in eager."""
    x, t = randn(4, 5), classes(5, 4, 1)
    out = ft.vmap(lambda a, b: F.multi_margin_loss(a, b, reduction="none"))(x, t)
    assert out.shape == (4, 1)
    ref = torch.stack([F.multi_margin_loss(a, b, reduction="none") for a, b in zip(x, t)])
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("name", ["multi_margin_1d_1elem_target", "nll_2d_weight_ignore",
                                  "multilabel_margin_one_row", "bce_weight"])
def test_loss_under_vmap_of_vmap(name):
    make, args = CASES[name]
    f = make("none")
    batched = [torch.stack([a, a]) for a in args]
    batched[0] = batched[0] + 0.1 * randn(*batched[0].shape, seed=5)
    inner = lambda *a: ft.vmap(f)(*a)
    check_vmap(inner, batched, (0,) * len(args))


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_gaussian_nll_loss_with_a_batched_var(reduction):
    """F.gaussian_nll_loss checks ``if torch.any(var < 0): raise`` in Python.  Every example
    passes the check, so the branch is taken once for the batch (Note [a branch every example
    takes the same way] in batching/batched_tensor.py) and the loss batches."""
    x, t, v = randn(3, 4), randn(3, 4, seed=1), rand(3, 4, seed=2) + 1.0  # > 0 when perturbed
    f = lambda a, b, c: F.gaussian_nll_loss(a, b, c, reduction=reduction)  # noqa: E731
    check_vmap(f, [x, t, v], (0, 0, 0))
    check_vmap(f, [x[0], t[0], v[0, :1]], (0, 0, None))


def test_gaussian_nll_loss_with_a_negative_var_in_one_example_is_refused_clearly():
    x, t, v = randn(3, 4), randn(3, 4, seed=1), rand(3, 4, seed=2) + 0.1
    v[1, 2] = -1.0   # eager raises for that example alone
    with pytest.raises(UnsupportedUnderVmap, match="disagree"):
        ft.vmap(F.gaussian_nll_loss)(x, t, v)


@pytest.mark.parametrize("in_dims", [0, 1])
def test_one_hot_with_num_classes_matches_the_loop(in_dims):
    labels = classes(6, 4, 3)
    check_vmap(lambda a: F.one_hot(a, 6), [labels], (in_dims,))
    check_vmap(lambda a: F.one_hot(a, num_classes=6), [classes(6)], (0,))


def test_one_hot_without_num_classes_is_refused_clearly():
    """num_classes=-1 infers a per-example class count (a data-dependent shape): refused,
    asking for num_classes, as torch.func refuses it."""
    with pytest.raises(RuntimeError, match="explicit positive num_classes"):
        torch.func.vmap(F.one_hot)(classes(6, 4, 3))
    for f in (F.one_hot, lambda a: F.one_hot(a, -1)):
        with pytest.raises(UnsupportedUnderVmap,
                           match=r"one_hot\(labels, num_classes=-1\).*differs per example.*"
                                 r"Pass num_classes explicitly"):
            ft.vmap(f)(classes(6, 4, 3))
        with pytest.raises(UnsupportedUnderVmap, match="Pass num_classes explicitly"):
            ft.vmap(ft.vmap(f))(classes(6, 2, 4, 3))


@pytest.mark.parametrize("bad,eager", [(6, "smaller than num_classes"), (-1, "non-negative")])
def test_one_hot_with_an_out_of_range_label_raises_eagers_error(bad, eager):
    """Out-of-range labels gave rows of zeros (and do in torch.func); eager raises, and so does
    functrans now, naming the label and num_classes, in any example and under nested vmap."""
    labels = classes(6, 4, 3)
    labels[2, 1] = bad
    with pytest.raises(RuntimeError, match=eager):
        F.one_hot(labels[2], 6)
    for in_dims in (0, 1):
        with pytest.raises(RuntimeError,
                           match=f"Class values must be {eager}.*num_classes=6.*label {bad}"):
            ft.vmap(lambda a: F.one_hot(a, 6), in_dims=in_dims)(labels)
    with pytest.raises(RuntimeError, match=f"label {bad}"):
        ft.vmap(ft.vmap(lambda a: F.one_hot(a, num_classes=6)))(labels.reshape(2, 2, 3))
    # in range: the loop's and torch.func's answer; an empty batch checks nothing
    labels[2, 1] = 5
    with ft.config.strict_fallback():
        got = ft.vmap(lambda a: F.one_hot(a, 6))(labels)
    assert torch.equal(got, torch.stack([F.one_hot(a, 6) for a in labels]))
    assert torch.equal(got, torch.func.vmap(lambda a: F.one_hot(a, 6))(labels))
    empty = ft.vmap(lambda a: F.one_hot(a, 6))(labels[:, :0])
    assert empty.shape == (4, 0, 6)


_LCE_OPTIONS = getattr(torch.nn, "LinearCrossEntropyOptions", None)
needs_chunked_lce = pytest.mark.skipif(
    _LCE_OPTIONS is None, reason="F.linear_cross_entropy's chunked path is new in torch 2.13")


@needs_chunked_lce
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("extra", ["plain", "ignore_index", "weight", "bias", "weight_ignore"])
def test_chunked_linear_cross_entropy_matches_the_loop(reduction, extra):
    """The torch_nn chunked ops fold the batch into their rows (strict: no loop), with the
    linear weight shared; a per-example linear weight is declined to the loop."""
    kw = {"plain": {}, "ignore_index": {"ignore_index": 1}, "weight": {"weight": W5},
          "bias": {"linear_bias": randn(5, seed=4)},
          "weight_ignore": {"weight": W5, "ignore_index": 3}}[extra]
    opts = _LCE_OPTIONS(batch_chunk_size=2, allow_retain_graph=reduction != "none")
    lw = randn(5, 3, seed=3)
    f = lambda x, t: F.linear_cross_entropy(x, lw, t, reduction=reduction, options=opts, **kw)
    x, t = randn(4, 3), classes(5, 4, seed=2)
    for in_dims in [(0, 0), (-1, None), (None, 0)]:
        check_vmap(f, [x, t], in_dims)
        if reduction != "none":
            check_vmap(ft.grad(lambda a, b: f(a, b)), [x, t], in_dims)
    if extra == "ignore_index":   # under vmap of vmap: the inner fold re-dispatches
        xs, ts = torch.stack([x, x + 0.1]), torch.stack([t, t.flip(0)])
        check_vmap(lambda a, b: ft.vmap(f)(a, b), [xs, ts], (0, 0))
        if reduction != "none":
            check_vmap(lambda a, b: ft.vmap(ft.grad(f))(a, b), [xs, ts], (0, 0))
    g = lambda x, w, t: F.linear_cross_entropy(x, w, t, reduction=reduction, options=opts, **kw)
    check_vmap(g, [x, lw, t], (0, 0, 0), strict=False)


@needs_chunked_lce
def test_chunked_linear_cross_entropy_per_sample_gradients():
    """Per-sample gradients of the shared linear weight (the op sums that gradient over its
    rows, so the rule declines and the loop runs it per example; torch.func cannot run this
    op under grad at all: its autograd.Function lacks setup_context)."""
    opts = _LCE_OPTIONS(batch_chunk_size=2, allow_retain_graph=True)
    lw, x, t = randn(5, 3, seed=3), randn(4, 3), classes(5, 4)
    loss = lambda w, x, t: F.linear_cross_entropy(x, w, t, options=opts, ignore_index=2)
    check_vmap(ft.grad(loss), [lw, x, t], (None, 0, 0), strict=False)
    check_vmap(ft.grad(loss, argnums=(0, 1)), [lw, x, t], (None, 0, 0), strict=False)


@needs_chunked_lce
def test_chunked_linear_cross_entropy_none_backward_is_refused_clearly():
    """reduction='none' recomputes its gradients in a Python backward that accumulates into
    fresh torch.zeros buffers: with a per-example cotangent those are in-place writes of
    batched values into unbatched tensors, refused with functrans's clear error (torch.func
    refuses it too).  The forward batches (test above)."""
    opts = _LCE_OPTIONS(batch_chunk_size=2)
    lw = randn(5, 3, seed=3)
    f = lambda x, t: F.linear_cross_entropy(x, lw, t, reduction="none", options=opts).sum()
    with pytest.raises(UnsupportedUnderVmap, match="in-place operation"):
        ft.vmap(ft.grad(f))(randn(3, 4, 3), classes(5, 3, 4))


aten = torch.ops.aten


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("shapes", [((5,), ()), ((5,), (1,)), ((3, 5), (3,)), ((1, 5), (1,))],
                         ids=["1d-0d", "1d-1", "2d", "one-row"])
@pytest.mark.parametrize("weighted", [False, True])
def test_aten_nll_loss_forward_both_outputs(reduction, shapes, weighted):
    """Both outputs of the kernel itself, as eager: the loss and total_weight (which for a
    [C] input with reduction='none' is w[target], and 0 for any other input)."""
    xs, ts = shapes
    w = W5 if weighted else None
    f = lambda x, t: aten.nll_loss_forward(x, t, w, reduction, 1)  # noqa: E731
    for in_dims in [(0, 0), (-1, None), (None, 0)]:
        check_vmap(f, [randn(*xs).log_softmax(-1), classes(5, *ts)], in_dims)
    g = lambda x, t: aten.nll_loss2d_forward(x, t, w, reduction, 1)  # noqa: E731
    check_vmap(g, [randn(2, 5, 3, 2), classes(5, 2, 3, 2)], (0, 0))


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("shapes", [((5,), (5,)), ((), (1,)), ((1,), ()), ((2, 4), (2, 4))],
                         ids=["1d", "0d-1", "1-0d", "2d"])
def test_aten_multilabel_margin_loss_forward_both_outputs(reduction, shapes):
    """The loss and is_target, whose shape is the TARGET's (a 0-d input with a (1,) target
    gives a (1,) is_target)."""
    xs, ts = shapes
    C = xs[-1] if xs else 1
    f = lambda x, t: aten.multilabel_margin_loss_forward(x, t, reduction)  # noqa: E731
    for in_dims in [(0, 0), (-1, None), (None, 0)]:
        check_vmap(f, [randn(*xs), classes(C, *ts, lo=-1)], in_dims)
