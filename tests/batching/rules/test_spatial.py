"""im2col/col2im (F.unfold/F.fold), grid sampling, pixel/channel shuffles vs the loop oracle
(every in_dims choice incl. -1, vmap∘vmap, strict) and per-example gradients vs torch.func."""
import pytest
import torch
import torch.nn.functional as F

import functrans as ft
from tests.support.oracles import assert_same, check_vmap, check_vmap_all_bdims, loop_oracle

g = torch.Generator().manual_seed(0)
X4 = torch.randn(2, 3, 5, 6, generator=g)
X5 = torch.randn(2, 2, 3, 4, 5, generator=g)
GRID2 = torch.rand(2, 3, 4, 2, generator=g) * 2.4 - 1.2
GRID3 = torch.rand(2, 2, 3, 4, 3, generator=g) * 2.4 - 1.2


@pytest.mark.parametrize("x", [X4, X4[0]], ids=["4d", "no-N"])
def test_unfold_and_fold(x):
    check_vmap_all_bdims(lambda a: F.unfold(a, (2, 3), dilation=(1, 2), padding=1, stride=2), [x])
    cols = F.unfold(x, 2)
    check_vmap_all_bdims(lambda c: F.fold(c, (5, 6), 2), [cols])
    cols = F.unfold(x, 3, stride=2, padding=1)
    check_vmap_all_bdims(lambda c: F.fold(c, (5, 6), 3, stride=2, padding=1), [cols])


def test_unfold_fold_gradients_strict():
    xs = torch.stack([X4 + 0.1 * i for i in range(3)])
    f = lambda a: F.fold(F.unfold(a, 2, padding=1).sin(), (5, 6), 2, padding=1).pow(2).sum()
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(f))(xs)
    assert_same(got, torch.func.vmap(torch.func.grad(f))(xs))


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [False, True])
def test_grid_sample_2d(mode, padding_mode, align):
    f = lambda x, grid: F.grid_sample(x, grid, mode=mode, padding_mode=padding_mode,
                                      align_corners=align)
    check_vmap_all_bdims(f, [X4, GRID2])


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
def test_grid_sample_3d(mode):
    f = lambda x, grid: F.grid_sample(x, grid, mode=mode, padding_mode="border")
    check_vmap_all_bdims(f, [X5, GRID3])


def test_grid_sample_batched_grid_at_last_dim():
    # torch.vmap gets this one wrong; the grid's last dim (x, y) must not be mixed with the batch.
    f = lambda x, grid: F.grid_sample(x, grid, align_corners=False)
    for in_dims in [(None, -1), (0, -1), (-1, -1), (-1, None)]:
        check_vmap(f, [X4, GRID2], in_dims, size=4)


@pytest.mark.parametrize("in_dims", [(0, 0), (None, 0), (0, None), (-1, -1)])
@pytest.mark.parametrize("rank", [2, 3])
def test_grid_sample_gradients_wrt_input_and_grid_strict(in_dims, rank):
    x, grid = (X4, GRID2) if rank == 2 else (X5, GRID3)
    xs = torch.stack([x + 0.1 * i for i in range(3)], in_dims[0] or 0)
    grids = torch.stack([grid * (1 - 0.1 * i) for i in range(3)], in_dims[1] or 0)
    xs = xs if in_dims[0] is not None else x
    grids = grids if in_dims[1] is not None else grid
    f = lambda a, gr: F.grid_sample(a, gr, align_corners=True).pow(2).sum()
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(f, argnums=(0, 1)), in_dims=in_dims)(xs, grids)
    ref = torch.func.vmap(torch.func.grad(f, argnums=(0, 1)), in_dims=in_dims)(xs, grids)
    assert_same(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(8, 2, 3), (2, 8, 2, 3), (2, 2, 8, 2, 3)])
def test_pixel_shuffles(shape):
    x = torch.randn(shape, generator=g)
    check_vmap_all_bdims(lambda a: F.pixel_shuffle(a, 2), [x])
    check_vmap_all_bdims(lambda a: F.pixel_unshuffle(F.pixel_shuffle(a, 2).sin(), 2), [x])


@pytest.mark.parametrize("shape", [(2, 6, 3), (1, 6, 2, 3), (2, 6, 1, 2, 2)])
def test_channel_shuffle(shape):
    check_vmap_all_bdims(lambda a: F.channel_shuffle(a, 3), [torch.randn(shape, generator=g)])


def test_shuffle_gradients_strict():
    xs = torch.randn(3, 2, 8, 2, 3, generator=g)
    f = lambda a: F.channel_shuffle(F.pixel_shuffle(a, 2), 2).mul(a.sum()).sin().sum()
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(f))(xs)
    assert_same(got, torch.func.vmap(torch.func.grad(f))(xs))


def test_too_low_ranks_raise_pytorchs_errors():
    with pytest.raises(RuntimeError, match="pixel_shuffle expects input to have at least 3"):
        ft.vmap(lambda a: F.pixel_shuffle(a, 2))(torch.randn(3, 4, 4))
    with pytest.raises(RuntimeError, match="channel_shuffle expects input with > 2 dims"):
        ft.vmap(lambda a: F.channel_shuffle(a, 2))(torch.randn(3, 2, 4))


def test_grid_sample_gradient_wrt_one_operand_only_strict():
    # grid_sampler_2d_backward then returns None for the other operand.
    xs = torch.stack([X4 + 0.1 * i for i in range(3)])
    grids = torch.stack([GRID2 * (1 - 0.1 * i) for i in range(3)])
    f = lambda a, gr: F.grid_sample(a, gr, mode="bicubic", align_corners=False).pow(2).sum()
    for argnums, in_dims in [(0, (0, None)), (1, (None, 0)), (0, (0, 0))]:
        args = [xs if in_dims[0] is not None else X4, grids if in_dims[1] is not None else GRID2]
        with ft.config.strict_fallback():
            got = ft.vmap(ft.grad(f, argnums=argnums), in_dims=in_dims)(*args)
        try:
            ref = torch.func.vmap(torch.func.grad(f, argnums=argnums), in_dims=in_dims)(*args)
        except RuntimeError as e:
            # torch 2.11's torch.func fails here (its grid_sampler_2d_backward batching meets
            # the undefined gradient of the other operand); the loop of eager gradients is the
            # reference there
            assert "Expected a proper Tensor but got None" in str(e), e
            ref = loop_oracle(torch.func.grad(f, argnums=argnums), in_dims, 3, *args)
        assert_same(got, ref, rtol=1e-4, atol=1e-5)
