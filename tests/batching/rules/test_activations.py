"""Activation rules (glu, prelu kernels, untagged elementwise kernels and backward kernels) vs
the loop oracle (every in_dims choice, vmap∘vmap, strict), per-sample gradients vs torch.func."""
import pytest
import torch
import torch.nn.functional as F

import functrans as ft
from tests.support.oracles import assert_same, check_vmap, check_vmap_all_bdims

g = torch.Generator().manual_seed(0)
X = torch.randn(4, 6, generator=g)

ACTIVATIONS = {
    "elu": lambda x: F.elu(x, alpha=0.7),
    "selu": F.selu,
    "celu": F.celu,
    "leaky_relu": lambda x: F.leaky_relu(x, 0.2),
    "hardtanh": lambda x: F.hardtanh(x, -0.5, 0.5),
    "relu6": F.relu6,
    "softplus": lambda x: F.softplus(x, beta=2.0, threshold=1.0),
    "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid,
    "softshrink": lambda x: F.softshrink(x, 0.3),
    "hardshrink": lambda x: F.hardshrink(x, 0.3),
    "logsigmoid": F.logsigmoid,
    "rrelu_eval": lambda x: F.rrelu(x, training=False),
    "gelu": F.gelu,
    "mish": F.mish,
    "silu": F.silu,
    "threshold": lambda x: F.threshold(x, 0.1, 2.0),
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_and_its_gradient(name):
    f = ACTIVATIONS[name]
    check_vmap_all_bdims(f, [X])
    check_vmap_all_bdims(ft.grad(lambda x: (f(x) * x.cos()).sum()), [X], nested=False)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_glu_and_backward(dim):
    x = torch.randn(4, 6, generator=g)
    check_vmap_all_bdims(lambda a: F.glu(a, dim), [x])
    gout = torch.randn(F.glu(x, dim).shape, generator=g)
    check_vmap_all_bdims(lambda a, c: torch.ops.aten.glu_backward(c, a, dim), [x, gout])
    check_vmap_all_bdims(ft.grad(lambda a: (F.glu(a, dim) ** 2).sum()), [x], nested=False)


@pytest.mark.parametrize("shape,wshape", [((3, 4, 5), (4,)), ((3, 4), (1,)), ((5,), (1,)),
                                          ((2, 3, 2, 2), (3,))])
def test_prelu_forward_and_kernel_backward(shape, wshape):
    x = torch.randn(shape, generator=g)
    w = torch.rand(wshape, generator=g)
    check_vmap_all_bdims(F.prelu, [x, w])
    both = ft.grad(lambda a, b: (F.prelu(a, b) * a).sum(), argnums=(0, 1))
    check_vmap_all_bdims(both, [x, w], nested=False)


def test_per_sample_gradients_of_an_mlp_vs_torch_func():
    params = {"w1": torch.randn(8, 6, generator=g), "a": torch.rand(8, generator=g),
              "w2": torch.randn(8, 4, generator=g)}

    def loss(p, x):
        h = F.prelu(F.linear(x, p["w1"]), p["a"])
        h = F.glu(torch.cat([F.hardswish(h), F.elu(h)], -1), -1)
        return F.logsigmoid(h @ p["w2"]).sum() + F.softplus(h).mean()

    xs = torch.randn(5, 2, 6, generator=g)
    with ft.config.strict_fallback():
        ours = ft.vmap(ft.grad(loss), in_dims=(None, 0))(params, xs)
    ref = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, xs)
    assert_same(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [0, -1])
def test_glu_forward_mode_inside_vmap(dim):
    x, t = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    # (batched alike: a tangent batched unlike its primal reaches
    # _new_zeros_with_same_feature_meta, a factories op)
    for in_dims in [(0, 0), (-1, -1)]:
        check_vmap(lambda a, b: ft.jvp(lambda y: F.glu(y, dim), (a,), (b,)), [x, t], in_dims)
