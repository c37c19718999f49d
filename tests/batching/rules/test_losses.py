"""Loss rules (nll / cross_entropy incl. 2-D inputs, elementwise losses, margin losses) vs the
loop oracle (every in_dims choice, vmap∘vmap, strict), their backward kernels through
vmap(grad), and per-sample gradients vs torch.func."""
import pytest
import torch
import torch.nn.functional as F

import functrans as ft
from tests.support.oracles import assert_same, check_vmap, check_vmap_all_bdims

g = torch.Generator().manual_seed(0)
LOGITS = torch.randn(4, 5, generator=g)
TARGET = torch.tensor([1, 0, 4, 2])
W = torch.rand(5, generator=g) + 0.5


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ignore", [-100, 2])
def test_nll_loss_2d_input(reduction, weighted, ignore):
    f = lambda x, t: F.nll_loss(x.log_softmax(-1), t, weight=W if weighted else None,
                                reduction=reduction, ignore_index=ignore)
    check_vmap_all_bdims(f, [LOGITS, TARGET])


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_nll_loss_1d_input_and_cross_entropy(reduction):
    check_vmap_all_bdims(lambda x, t: F.nll_loss(x, t, reduction=reduction),
                         [LOGITS[0], TARGET[0]])
    check_vmap_all_bdims(lambda x, t: F.cross_entropy(x, t, reduction=reduction, weight=W),
                         [LOGITS, TARGET])


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_batched_class_weights(reduction):
    f = lambda x, t, w: F.nll_loss(x, t, weight=w, reduction=reduction, ignore_index=2)
    check_vmap_all_bdims(f, [LOGITS, TARGET, W])
    check_vmap_all_bdims(ft.grad(lambda x, t, w: f(x, t, w).sum() if reduction == "none"
                                 else f(x, t, w)), [LOGITS, TARGET, W],
                         nested=False)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_cross_entropy_on_images_reaches_nll_loss2d(reduction):
    x = torch.randn(2, 5, 3, 4, generator=g)
    t = torch.randint(0, 5, (2, 3, 4), generator=g)
    t[0, 0, 0], t[1, 2, 3] = 0, 4
    f = lambda a, b, w: F.cross_entropy(a, b, weight=w, reduction=reduction, ignore_index=1)
    check_vmap_all_bdims(lambda a, b: f(a, b, W), [x, t], nested=reduction == "mean")
    check_vmap_all_bdims(ft.grad(lambda a, b, w: f(a, b, w).sum()), [x, t, W], nested=False)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_gradients_strict(reduction):
    x = torch.stack([LOGITS + 0.1 * i for i in range(3)]).requires_grad_()
    f = lambda a: F.cross_entropy(a, TARGET, weight=W, reduction=reduction, ignore_index=2)
    with ft.config.strict_fallback():
        got, = torch.autograd.grad(ft.vmap(f)(x).sum(), x)
    exp, = torch.autograd.grad(torch.stack([f(a) for a in x]).sum(), x)
    assert_same(got, exp)


def test_per_sample_cross_entropy_gradients_vs_torch_func():
    params = {"w": torch.randn(5, 3, generator=g), "b": torch.randn(5, generator=g)}
    xs, ys = torch.randn(6, 3, generator=g), torch.tensor([0, 1, 2, 3, 4, 0])
    loss = lambda p, x, y: F.cross_entropy(F.linear(x, p["w"], p["b"]), y)
    with ft.config.strict_fallback():
        ours = ft.vmap(ft.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    ref = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    assert_same(ours, ref, rtol=1e-5, atol=1e-6)


ELEMENTWISE = {
    "mse": lambda x, t, r: F.mse_loss(x, t, reduction=r),
    "huber": lambda x, t, r: F.huber_loss(x, t, reduction=r, delta=0.3),
    "smooth_l1": lambda x, t, r: F.smooth_l1_loss(x, t, reduction=r, beta=0.2),
    "l1": lambda x, t, r: F.l1_loss(x, t, reduction=r),
    "soft_margin": lambda x, t, r: F.soft_margin_loss(x, t, reduction=r),
    "bce": lambda x, t, r: F.binary_cross_entropy(x.sigmoid(), t.clamp(0, 1), reduction=r),
    "bce_logits": lambda x, t, r: F.binary_cross_entropy_with_logits(x, t, reduction=r),
    "kl_div": lambda x, t, r: F.kl_div(x, t, reduction=r),
}


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
@pytest.mark.parametrize("shape", [(3, 4), ()])
def test_elementwise_losses_and_backward(name, reduction, shape):
    f = ELEMENTWISE[name]
    x, t = torch.randn(shape, generator=g), torch.rand(shape, generator=g)
    check_vmap_all_bdims(lambda a, b: f(a, b, reduction), [x, t], nested=shape == ())
    check_vmap_all_bdims(ft.grad(lambda a, b: f(a, b, reduction).sum()), [x, t], nested=False)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_weighted_binary_cross_entropy(reduction):
    x, t = torch.randn(3, 4, generator=g), torch.rand(3, 4, generator=g)
    w, pw = torch.rand(4, generator=g), torch.rand(4, generator=g) + 0.5
    bce = lambda a, b, c: F.binary_cross_entropy(a.sigmoid(), b.clamp(0, 1), weight=c,
                                                 reduction=reduction)
    check_vmap_all_bdims(bce, [x, t, w])
    check_vmap_all_bdims(ft.grad(lambda a, b, c: bce(a, b, c).sum()), [x, t, w], nested=False)
    logits = lambda a, b, c, d: F.binary_cross_entropy_with_logits(a, b, weight=c, pos_weight=d,
                                                                   reduction=reduction)
    grads = ft.grad(lambda *a: logits(*a).sum(), argnums=(0, 1))
    for in_dims in [(0, 0, 0, 0), (0, None, None, None), (None, None, 0, -1), (-1, 0, None, 0),
                    (None, -1, -1, None)]:
        check_vmap(logits, [x, t, w, pw], in_dims)
        check_vmap(grads, [x, t, w, pw], in_dims)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("rows", [True, False])
def test_margin_losses_and_backward(reduction, rows):
    x = torch.randn((4, 5) if rows else (5,), generator=g)
    t = torch.tensor([1, 0, 4, 2]) if rows else torch.tensor(3)
    labels = torch.tensor([[1, 3, -1, 0, 2], [0, -1, 2, 2, 1], [4, 3, 2, 1, 0],
                           [-1, 0, 1, 2, 3]])
    labels = labels if rows else labels[0]
    w = torch.rand(5, generator=g) + 0.5
    multi = lambda a, b: F.multi_margin_loss(a, b, p=2, margin=0.7, weight=w, reduction=reduction)
    check_vmap_all_bdims(multi, [x, t])
    check_vmap_all_bdims(ft.grad(lambda a, b: multi(a, b).sum()), [x, t], nested=False)
    label = lambda a, b: F.multilabel_margin_loss(a, b, reduction=reduction)
    check_vmap_all_bdims(label, [x, labels])
    check_vmap_all_bdims(ft.grad(lambda a, b: label(a, b).sum()), [x, labels], nested=False)


def test_per_sample_gradients_of_a_regression_head_vs_torch_func():
    params = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(4, generator=g)}
    xs, ys = torch.randn(6, 2, 3, generator=g), torch.rand(6, 2, 4, generator=g)

    def loss(p, x, y):
        z = F.linear(x, p["w"], p["b"])
        return F.huber_loss(z, y, delta=0.5) + F.binary_cross_entropy(z.sigmoid(), y) + \
            F.mse_loss(z, y, reduction="sum") + F.multi_margin_loss(z, y.argmax(-1))

    with ft.config.strict_fallback():
        ours = ft.vmap(ft.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    ref = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    assert_same(ours, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_multi_margin_loss_with_batched_class_weights(reduction):
    x, t = torch.randn(4, 5, generator=g), torch.tensor([1, 0, 4, 2])
    f = lambda a, b, w: F.multi_margin_loss(a, b, weight=w, reduction=reduction)
    for in_dims in [(0, 0, 0), (None, None, 0), (-1, None, -1), (None, 0, 0)]:
        check_vmap(f, [x, t, W], in_dims)
        check_vmap(ft.grad(lambda a, b, w: f(a, b, w).sum()), [x, t, W], in_dims)


def test_margin_losses_of_0d_examples():
    x, t = torch.tensor(0.3), torch.tensor(0)
    check_vmap_all_bdims(lambda a, b: F.multi_margin_loss(a, b), [x, t])
    check_vmap_all_bdims(lambda a, b: F.multilabel_margin_loss(a, b), [x, t])
    check_vmap_all_bdims(ft.grad(lambda a, b: F.multilabel_margin_loss(a, b)), [x, t],
                         nested=False)
