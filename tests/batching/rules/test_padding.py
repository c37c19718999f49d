"""Padding rules (constant, reflect, replicate, circular; forward and backward ops) vs the loop
oracle (every in_dims choice, vmap∘vmap, strict) and per-example gradients vs torch.func."""
import pytest
import torch
import torch.nn.functional as F

import functrans as ft
from tests.support.oracles import assert_same, check_vmap_all_bdims

aten = torch.ops.aten

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


gen = torch.Generator().manual_seed(0)
NON_CONSTANT = {  # spatial dims -> (input with N, pad)
    1: (torch.randn(2, 3, 5, generator=gen), (2, 1)),
    2: (torch.randn(2, 2, 4, 5, generator=gen), (1, 2, 3, 0)),
    3: (torch.randn(1, 2, 3, 4, 3, generator=gen), (1, 0, 2, 1, 1, 2)),
}


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
@pytest.mark.parametrize("spatial", [1, 2, 3])
@pytest.mark.parametrize("has_n", [True, False], ids=["N", "no-N"])
def test_non_constant_pads(mode, spatial, has_n):
    x, pad = NON_CONSTANT[spatial]
    check_vmap_all_bdims(lambda a: F.pad(a, pad, mode=mode), [x if has_n else x[0]])


def test_negative_replicate_pad():
    x, _ = NON_CONSTANT[2]
    check_vmap_all_bdims(lambda a: F.pad(a, (-1, 2, 1, -2), mode="replicate"), [x])


@pytest.mark.parametrize("kind", ["reflection", "replication"])
@pytest.mark.parametrize("spatial", [1, 2, 3])
def test_backward_ops_with_mixed_batching(kind, spatial):
    x, pad = NON_CONSTANT[spatial]
    fwd = getattr(aten, f"{kind}_pad{spatial}d").default
    bwd = getattr(aten, f"{kind}_pad{spatial}d_backward").default
    grad = torch.randn(fwd(x, pad).shape, generator=gen)
    check_vmap_all_bdims(lambda go, a: bwd(go, a, pad), [grad, x])
    check_vmap_all_bdims(lambda go, a: bwd(go, a, pad), [grad[0], x[0]], nested=False)


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_per_example_gradients_strict(mode):
    x, pad = NON_CONSTANT[2]
    xs = torch.stack([x + 0.1 * i for i in range(3)])
    f = lambda a: F.pad(a, pad, mode=mode).sin().pow(2).sum()
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(f))(xs)
    assert_same(got, torch.func.vmap(torch.func.grad(f))(xs))


def test_out_variant_writes_a_batched_out():
    x, pad = NON_CONSTANT[1]
    xs = torch.stack([x + i for i in range(3)])

    def f(a):
        out = torch.empty_like(aten.reflection_pad1d.default(a, pad))
        return aten.reflection_pad1d.out(a, pad, out=out)
    with ft.config.strict_fallback():
        got = ft.vmap(f)(xs)
    assert_same(got, torch.stack([aten.reflection_pad1d.default(a, pad) for a in xs]))


def test_wrong_rank_raises_pytorchs_error():
    with pytest.raises(RuntimeError, match="Expected 2D or 3D"):
        ft.vmap(lambda a: aten.reflection_pad1d.default(a, [1, 1]))(torch.randn(3, 5))
