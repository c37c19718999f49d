"""Pooling rules vs the loop oracle (every in_dims choice, vmap∘vmap, strict) and gradients."""
import pytest
import torch
import torch.nn.functional as F

import functrans as ft
from tests.oracles import assert_same, check_vmap_all_bdims

g = torch.Generator().manual_seed(0)
X4 = torch.randn(2, 3, 6, 6, generator=g)
X3 = torch.randn(3, 6, 6, generator=g)
X5 = torch.randn(1, 2, 4, 4, 4, generator=g)

FUNCS = {
    "max_pool2d": lambda x: F.max_pool2d(x, 2),
    "max_pool2d_idx": lambda x: F.max_pool2d(x, 3, stride=2, padding=1, return_indices=True),
    "max_pool1d": lambda x: F.max_pool1d(x.flatten(-2), 3),
    "avg_pool2d": lambda x: F.avg_pool2d(x, 2, ceil_mode=True),
    "avg_pool1d": lambda x: F.avg_pool1d(x.flatten(-2), 4),
    "adaptive_avg_pool2d": lambda x: F.adaptive_avg_pool2d(x, (4, 3)),
    "adaptive_max_pool2d": lambda x: F.adaptive_max_pool2d(x, 3, return_indices=True),
}


@pytest.mark.parametrize("name", list(FUNCS))
@pytest.mark.parametrize("x", [X4, X3], ids=["4d", "3d"])
def test_matches_loop(name, x):
    check_vmap_all_bdims(FUNCS[name], [x])


def test_3d_pools():
    check_vmap_all_bdims(lambda x: F.max_pool3d(x, 2), [X5])
    check_vmap_all_bdims(lambda x: F.avg_pool3d(x, 2), [X5])
    check_vmap_all_bdims(lambda x: F.adaptive_avg_pool3d(x, 2), [X5])


@pytest.mark.parametrize("name", ["max_pool2d", "avg_pool2d", "adaptive_avg_pool2d",
                                  "adaptive_max_pool2d"])
def test_gradients_strict(name):
    f = FUNCS[name]
    call = (lambda a: f(a)[0]) if name == "adaptive_max_pool2d" else f
    x = torch.stack([X4 + 0.1 * i for i in range(3)]).requires_grad_()
    with ft.config.strict_fallback():
        got, = torch.autograd.grad(ft.vmap(call)(x).pow(2).sum(), x)
    exp, = torch.autograd.grad(torch.stack([call(a) for a in x]).pow(2).sum(), x)
    assert_same(got, exp)
    with ft.config.strict_fallback():
        per_example = ft.vmap(ft.grad(lambda a: call(a).pow(2).sum()))(x.detach())
    assert_same(per_example, exp)
