"""Convolution rules vs the loop oracle (every in_dims choice, vmap∘vmap, strict), gradients,
per-sample CNN gradients and an ensemble against torch.func."""
import pytest
import torch
import torch.nn.functional as F

import functrans as ft
from tests.support.oracles import assert_same, check_vmap_all_bdims

g = torch.Generator().manual_seed(0)


def r(*s):
    return torch.randn(*s, generator=g)


CASES = {
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b), [r(2, 3, 6, 6), r(4, 3, 3, 3), r(4)]),
    "conv2d_nobias_stride_pad": (lambda x, w: F.conv2d(x, w, stride=2, padding=1), [r(2, 3, 7, 7), r(4, 3, 3, 3)]),
    "conv2d_groups_dilation": (lambda x, w: F.conv2d(x, w, groups=2, dilation=2), [r(1, 4, 7, 7), r(6, 2, 2, 2)]),
    "conv1d": (lambda x, w, b: F.conv1d(x, w, b, padding=2), [r(2, 3, 8), r(5, 3, 3), r(5)]),
    "conv3d": (lambda x, w: F.conv3d(x, w), [r(1, 2, 4, 4, 4), r(3, 2, 2, 2, 2)]),
    "conv_transpose2d": (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2), [r(2, 3, 4, 4), r(3, 5, 3, 3), r(5)]),
    "conv_transpose1d_groups": (lambda x, w: F.conv_transpose1d(x, w, groups=2), [r(1, 4, 5), r(4, 3, 2)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_loop(name):
    f, args = CASES[name]
    check_vmap_all_bdims(f, args)


def test_conv_input_without_its_own_batch_dim():
    from tests.support.oracles import check_vmap
    for dims in ((0, None), (-1, 0), (None, 0)):
        check_vmap(lambda x, w: F.conv2d(x, w), [r(3, 6, 6), r(4, 3, 3, 3)], dims)


@pytest.mark.parametrize("name", ["conv2d", "conv_transpose2d", "conv2d_groups_dilation"])
def test_gradients_strict(name):
    f, args = CASES[name]
    for batched in range(len(args)):
        leaves = [a.clone().requires_grad_() for a in args]
        xs = torch.stack([leaves[batched] + 0.1 * i for i in range(3)])
        call = lambda v: f(*[v if k == batched else a for k, a in enumerate(leaves)])
        in_dims = 0
        with ft.config.strict_fallback():
            got = torch.autograd.grad(ft.vmap(call, in_dims=in_dims)(xs).pow(2).sum(), leaves)
        exp = torch.autograd.grad(torch.stack([call(v) for v in xs]).pow(2).sum(), leaves)
        assert_same(got, exp, rtol=1e-4, atol=1e-5)


def cnn_loss(p, x, y):
    h = F.relu(F.conv2d(x.unsqueeze(0), p["c1"], p["b1"], padding=1))
    h = F.relu(F.conv2d(h, p["c2"], p["b2"], stride=2))
    return F.cross_entropy(h.flatten(1) @ p["fc"], y.unsqueeze(0))


def test_per_sample_cnn_gradients_vs_torch_func():
    params = {"c1": r(4, 1, 3, 3), "b1": r(4), "c2": r(6, 4, 3, 3), "b2": r(6), "fc": r(6 * 3 * 3, 10)}
    xs, ys = r(5, 1, 8, 8), torch.randint(0, 10, (5,), generator=g)
    with ft.config.strict_fallback():
        ours = ft.vmap(ft.grad(cnn_loss), in_dims=(None, 0, 0))(params, xs, ys)
    ref = torch.func.vmap(torch.func.grad(cnn_loss), in_dims=(None, 0, 0))(params, xs, ys)
    assert_same(ours, ref, rtol=1e-4, atol=1e-5)


def test_ensemble_of_cnns_vs_torch_func():
    stacked = {"c1": r(3, 4, 1, 3, 3), "b1": r(3, 4), "c2": r(3, 6, 4, 3, 3), "b2": r(3, 6),
               "fc": r(3, 6 * 3 * 3, 10)}
    x, y = r(1, 8, 8), torch.tensor(3)
    with ft.config.strict_fallback():
        ours = ft.vmap(cnn_loss, in_dims=(0, None, None))(stacked, x, y)
        grads = ft.vmap(ft.grad(cnn_loss), in_dims=(0, None, None))(stacked, x, y)
    assert_same(ours, torch.func.vmap(cnn_loss, in_dims=(0, None, None))(stacked, x, y),
                rtol=1e-4, atol=1e-5)
    assert_same(grads, torch.func.vmap(torch.func.grad(cnn_loss), in_dims=(0, None, None))(
        stacked, x, y), rtol=1e-4, atol=1e-5)


def test_per_sample_input_gradient_runs_one_ungrouped_backward():
    """vmap(grad) over a CNN's parameters: the second conv's input gradient (the weight is shared)
    runs as one ordinary convolution backward with the batch folded into N, the weight and bias
    gradients as one grouped call; values as the loop's (and torch.func's)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.convolution_backward.default:
                calls.append((args[0].shape[0], args[9], tuple(args[10])))   # N, groups, mask
            return func(*args, **(kwargs or {}))

    params = {"c1": r(4, 1, 3, 3), "b1": r(4), "c2": r(6, 4, 3, 3), "b2": r(6), "fc": r(6 * 3 * 3, 10)}
    xs, ys = r(5, 1, 8, 8), torch.randint(0, 10, (5,), generator=g)
    with Record(), ft.config.strict_fallback():
        ours = ft.vmap(ft.grad(cnn_loss), in_dims=(None, 0, 0))(params, xs, ys)
    assert (5, 1, (True, False, False)) in calls, calls             # conv2's input gradient
    assert all(mask[0] is False for n, groups, mask in calls if groups == 5), calls
    assert not any(mask == (True, True, True) for _, _, mask in calls), calls
    loop = [torch.func.grad(cnn_loss)(params, x, y) for x, y in zip(xs, ys)]
    assert_same(ours, {k: torch.stack([l[k] for l in loop]) for k in params}, rtol=1e-4, atol=1e-5)
