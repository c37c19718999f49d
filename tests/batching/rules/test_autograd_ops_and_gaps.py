"""Rules that the sweeps do not reach by themselves: autograd's helper ops (_neg_view,
fill_.Tensor), the private _logcumsumexp, _index_put_impl and _linalg_eigvals, in-place
scatter_add_, and the 3-D pooling backward ops (reached by vmap(grad)).  Loop oracle, every in_dims choice, strict."""
import torch
import torch.nn.functional as F

import functrans as ft
from tests.support.oracles import assert_same, check_vmap_all_bdims

g = torch.Generator().manual_seed(0)
X = torch.randn(4, 5, generator=g)


def test_neg_view_and_fill_tensor():
    check_vmap_all_bdims(lambda a: torch._neg_view(a) * 1, [X])
    check_vmap_all_bdims(lambda a, v: (a.clone() + 0 * v).fill_(v), [X, torch.tensor(0.5)])


def test_private_logcumsumexp():
    check_vmap_all_bdims(lambda a: torch._logcumsumexp(a, 1), [X])


def test_scatter_add_in_place():
    idx = torch.tensor([[0, 2, 1, 3, 0]])
    # (a.clone() + 0 * s.sum(): the target is batched whenever the source is, as in eager)
    check_vmap_all_bdims(lambda a, s: (a.clone() + 0 * s.sum()).scatter_add_(0, idx, s),
                         [X, X[:1] * 2])


def test_pool3d_backward_ops_under_vmap_grad():
    x = torch.randn(3, 2, 4, 4, 4, generator=g)
    for pool in (lambda b: F.avg_pool3d(b, 2), lambda b: F.max_pool3d(b, 2),
                 lambda b: F.adaptive_avg_pool3d(b, 2)):
        f = lambda b: (pool(b) ** 2).sum()
        with ft.config.strict_fallback():
            got = ft.vmap(ft.grad(f))(x)
        assert_same(got, torch.func.vmap(torch.func.grad(f))(x))


def test_functional_index_put_impl_and_eigvals():
    idx = torch.tensor([0, 2])
    f = lambda a, v: torch.ops.aten._index_put_impl(a, [idx], v, accumulate=True)
    check_vmap_all_bdims(f, [X, torch.randn(2, 5, generator=g)])
    A = torch.randn(4, 4, generator=g) + 3 * torch.eye(4)
    # (eager linalg.eigvals goes through linalg_eig on CPU; the private op is callable)
    check_vmap_all_bdims(lambda a: torch.ops.aten._linalg_eigvals(a).abs().sort().values, [A])


def test_fractional_max_pool_backward_under_vmap_of_vjp():
    for pool, x, samples in (
            (F.fractional_max_pool2d, torch.randn(1, 2, 6, 6, generator=g),
             torch.rand(1, 2, 2, generator=g)),
            (F.fractional_max_pool3d, torch.randn(1, 2, 6, 6, 6, generator=g),
             torch.rand(1, 2, 3, generator=g))):
        f = lambda a: pool(a, 2, output_size=3, _random_samples=samples)
        out, vjp_fn = ft.vjp(f, x)
        cts = torch.randn(3, *out.shape, generator=g)
        with ft.config.strict_fallback():
            got, = ft.vmap(vjp_fn)(cts)
        expected = torch.stack([torch.autograd.grad(f(x.requires_grad_()), x, c)[0]
                                for c in cts])
        assert_same(got, expected)
