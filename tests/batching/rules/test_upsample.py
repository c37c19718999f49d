"""Upsampling rules (every mode, forward and backward ops) vs the loop oracle (every in_dims
choice, vmap∘vmap, strict), per-example gradients, and a small upsampling CNN's per-sample
gradients vs torch.func."""
import pytest
import torch
import torch.nn.functional as F

import functrans as ft
from tests.support.oracles import assert_same, check_vmap_all_bdims

aten = torch.ops.aten
g = torch.Generator().manual_seed(0)
X3 = torch.randn(2, 3, 5, generator=g)
X4 = torch.randn(2, 3, 4, 5, generator=g)
X5 = torch.randn(1, 2, 3, 4, 3, generator=g)

CASES = {  # name -> (input, interpolate kwargs)
    "nearest1d": (X3, dict(scale_factor=2.0)),
    "nearest2d": (X4, dict(size=(7, 3))),
    "nearest3d": (X5, dict(scale_factor=1.5)),
    "nearest-exact1d": (X3, dict(size=8, mode="nearest-exact")),
    "nearest-exact2d": (X4, dict(scale_factor=(1.5, 0.7), mode="nearest-exact")),
    "nearest-exact3d": (X5, dict(size=(2, 5, 4), mode="nearest-exact")),
    "linear": (X3, dict(size=8, mode="linear", align_corners=True)),
    "bilinear": (X4, dict(scale_factor=1.7, mode="bilinear")),
    "bilinear-aligned": (X4, dict(size=(6, 8), mode="bilinear", align_corners=True)),
    "bilinear-aa": (X4, dict(size=(3, 2), mode="bilinear", antialias=True)),
    "bicubic": (X4, dict(size=(6, 7), mode="bicubic")),
    "bicubic-aa": (X4, dict(scale_factor=0.6, mode="bicubic", antialias=True)),
    "trilinear": (X5, dict(size=(4, 5, 2), mode="trilinear")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_interpolate_matches_loop(name):
    x, kw = CASES[name]
    check_vmap_all_bdims(lambda a: F.interpolate(a, **kw), [x])


@pytest.mark.parametrize("name", list(CASES))
def test_per_example_gradients_strict(name):
    x, kw = CASES[name]
    xs = torch.stack([x + 0.1 * i for i in range(3)])
    f = lambda a: F.interpolate(a, **kw).sin().sum()
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(f))(xs)
    assert_same(got, torch.func.vmap(torch.func.grad(f))(xs))


@pytest.mark.parametrize("op,sizes,extra", [
    (aten.upsample_nearest1d_backward.default, ([8], [2, 3, 5]), ()),
    (aten.upsample_bilinear2d_backward.default, ([6, 7], [2, 3, 4, 5]), (False,)),
    (aten.upsample_bicubic2d_backward.default, ([6, 7], [2, 3, 4, 5]), (True,)),
    (aten._upsample_bilinear2d_aa_backward.default, ([3, 2], [2, 3, 4, 5]), (False,)),
    (aten.upsample_trilinear3d_backward.default, ([4, 5, 2], [1, 2, 3, 4, 3]), (False,)),
])
def test_backward_ops_fold_input_size(op, sizes, extra):
    out_size, in_size = sizes
    grad = torch.randn(*in_size[:2], *out_size, generator=g)
    check_vmap_all_bdims(lambda go: op(go, out_size, in_size, *extra), [grad])


def test_input_size_as_keyword():
    grad = torch.randn(2, 3, 8, generator=g)
    f = lambda go: aten.upsample_linear1d_backward.default(
        go, output_size=[8], input_size=[2, 3, 5], align_corners=False)
    check_vmap_all_bdims(f, [grad])


def test_wrong_rank_raises_pytorchs_error():
    with pytest.raises(RuntimeError, match="input_size equals to 3"):
        ft.vmap(lambda a: aten.upsample_nearest1d.default(a, [8]))(torch.randn(3, 2, 5))


def test_per_sample_gradients_of_an_upsampling_cnn_vs_torch_func():
    params = {"w1": torch.randn(4, 2, 3, 3, generator=g) * 0.3,
              "w2": torch.randn(1, 4, 3, 3, generator=g) * 0.3, "b2": torch.randn(1, generator=g)}

    def loss(p, x, y):
        h = F.conv2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), p["w1"]).relu()
        h = F.interpolate(h[None], scale_factor=2, mode="bilinear")[0]
        h = F.pad(h, (1, 1, 1, 1), mode="replicate")
        out = F.conv2d(h, p["w2"], p["b2"])
        return F.interpolate(out[None], size=(5, 5), mode="nearest")[0].sub(y).pow(2).mean()

    xs, ys = torch.randn(4, 2, 5, 5, generator=g), torch.randn(4, 1, 5, 5, generator=g)
    with ft.config.strict_fallback():
        ours = ft.vmap(ft.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    ref = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    assert_same(ours, ref, rtol=1e-4, atol=1e-5)
