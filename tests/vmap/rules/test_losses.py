"""nll_loss / cross_entropy rules vs the loop oracle (every in_dims choice, vmap∘vmap, strict)
and per-sample cross-entropy gradients vs torch.func."""
import pytest
import torch
import torch.nn.functional as F

import functrans as ft
from tests.oracles import assert_same, check_vmap, check_vmap_all_bdims

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


def test_batched_class_weights_decline_to_the_correct_fallback():
    f = lambda x, t, w: F.nll_loss(x, t, weight=w)
    check_vmap(f, [LOGITS, TARGET, W], (0, None, 0), strict=False)


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
