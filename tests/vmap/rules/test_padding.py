"""constant_pad_nd vs the loop oracle (every in_dims choice, vmap∘vmap, strict) and its
gradient."""
import pytest
import torch
import torch.nn.functional as F

import functrans as ft
from tests.oracles import assert_same, check_vmap_all_bdims

X = torch.randn(2, 3, 4)


@pytest.mark.parametrize("pad", [(1, 2), (0, 1, 2, 0), (1, 1, 1, 1, 1, 1), (-1, 2), ()])
@pytest.mark.parametrize("value", [0.0, 2.5])
def test_constant_pad(pad, value):
    check_vmap_all_bdims(lambda x: F.pad(x, pad, value=value), [X])


def test_pad_0d_and_too_long():
    check_vmap_all_bdims(lambda x: F.pad(x, ()), [torch.tensor(1.0)])
    with pytest.raises(RuntimeError, match="Length of pad"):
        ft.vmap(lambda x: torch.constant_pad_nd(x, (1, 1, 1, 1)))(torch.randn(3, 4))


def test_gradient_strict():
    x = torch.randn(3, 2, 4, requires_grad=True)
    f = lambda a: F.pad(a, (1, 2, 0, 1), value=1.0).pow(2)
    with ft.config.strict_fallback():
        g, = torch.autograd.grad(ft.vmap(f, in_dims=1)(x).sum(), x)
    e, = torch.autograd.grad(torch.stack([f(x[:, i]) for i in range(2)]).sum(), x)
    assert_same(g, e)
