"""Pooling rules vs the loop oracle (every in_dims choice, vmap∘vmap, strict) and gradients."""
import pytest
import torch
import torch.nn.functional as F

import functrans as ft
from tests.support.oracles import assert_same, check_vmap_all_bdims

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


UNPOOL = {  # name -> (pool, unpool, input with N)
    "1d": (F.max_pool1d, F.max_unpool1d, X4.flatten(-2)),
    "2d": (F.max_pool2d, F.max_unpool2d, X4),
    "3d": (F.max_pool3d, F.max_unpool3d, X5),
}


@pytest.mark.parametrize("name", list(UNPOOL))
@pytest.mark.parametrize("has_n", [True, False], ids=["N", "no-N"])
def test_max_unpool(name, has_n):
    # Indices come from pooling ``x`` (unique per plane: with duplicate indices PyTorch's own
    # kernel result depends on its threading), values from an independently batched ``v``.
    pool, unpool, x = UNPOOL[name]
    x = x if has_n else x[0]
    v = torch.randn(pool(x, 2).shape, generator=g)
    bigger = [d + 1 for d in x.shape[-int(name[0]):]]  # allowed: below default size + stride
    for size in (None, bigger):
        f = lambda a, b: unpool(b, pool(a, 2, return_indices=True)[1], 2, output_size=size)
        check_vmap_all_bdims(f, [x, v], nested=size is None)


@pytest.mark.parametrize("name", list(UNPOOL))
def test_max_unpool_gradients_strict(name):
    pool, unpool, x = UNPOOL[name]
    xs = torch.stack([x + 0.1 * i for i in range(3)])
    f = lambda a: unpool(*pool(a, 2, return_indices=True), 2).pow(2).sum()
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(f))(xs)
    assert_same(got, torch.func.vmap(torch.func.grad(f))(xs))


def test_adaptive_avg_pool_to_one_of_channels_last_examples():
    """Issue 25 (timm's ConvNeXt ensemble): ``adaptive_avg_pool2d(x, 1)`` of a channels_last
    input restrides its [N, C, 1, 1] mean with ``as_strided_`` (a layout change of size-1 dims
    only: the same values); under vmap, and through its gradient, it runs without the loop and
    gives the loop's values.  A value-changing ``as_strided_`` is still refused."""
    from functrans.errors import UnsupportedUnderVmap

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 4, 4, 5, generator=g).permute(0, 1, 4, 2, 3)   # channels_last examples
    assert x[0].is_contiguous(memory_format=torch.channels_last)
    f = lambda t: F.adaptive_avg_pool2d(t, 1)  # noqa: E731
    with ft.config.strict_fallback():
        got = ft.vmap(f)(x)
        grads = ft.vmap(ft.grad(lambda t: (f(t) * t.mean()).sum()))(x)
    assert_same(got, torch.stack([f(t) for t in x]))
    loop = [torch.autograd.grad((f(t) * t.mean()).sum(), t)[0]
            for t in (e.detach().requires_grad_() for e in x)]
    assert_same(grads, torch.stack(loop), rtol=1e-5, atol=1e-6)
    with pytest.raises(UnsupportedUnderVmap, match="as_strided_"):
        ft.vmap(lambda t: t.clone().as_strided_((2, 2), (1, 2)))(torch.randn(3, 4))


def test_max_unpool2d_with_duplicate_indices_layout_channels_last():
    """Layout ``channels_last`` (issue 25): 4-d examples in channels_last memory format,
    different per example, whose indices repeat an output position with different values.
    Eager max_unpool2d's channels_last path resolves such duplicates in another order than its
    contiguous path (which keeps each plane in order on one thread), differently from call to
    call; the rule gives the contiguous loop's answer (See Note [layout-dependent kernels])."""
    from tests.support.layouts import lay_out
    from tests.support.oracles import contiguous_loop
    g = torch.Generator().manual_seed(7)
    B = 3
    f = lambda v, i: F.max_unpool2d(v, i, 3, 2, 1, output_size=(3, 6))   # noqa: E731
    for _ in range(10):
        x = torch.randn(B, 1, 2, 2, 4, generator=g)
        idx = torch.randint(0, 18, (B, 1, 2, 2, 4), generator=g)        # with duplicates
        xs, ids = lay_out(x, [0], "channels_last"), lay_out(idx, [0], "channels_last")
        assert xs.select(0, 0).is_contiguous(memory_format=torch.channels_last)
        want = contiguous_loop(f, (0, 0), B, xs, ids)
        with ft.config.strict_fallback():
            got = ft.vmap(f)(xs, ids)
        assert_same(got, want)
