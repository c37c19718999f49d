"""FFT and sorting rules vs the loop oracle (every in_dims choice, vmap∘vmap, strict) and
gradients through them."""
import pytest
import torch

import functrans as ft
from tests.support.oracles import assert_same, check_vmap_all_bdims

g = torch.Generator().manual_seed(0)
X = torch.randn(3, 4, generator=g)
C = torch.randn(3, 4, dtype=torch.complex64, generator=g)


@pytest.mark.parametrize("f, x", [
    (lambda a: torch.fft.fft(a), C), (lambda a: torch.fft.ifft(a, dim=0), C),
    (lambda a: torch.fft.fft2(a), C), (lambda a: torch.fft.rfft(a), X),
    (lambda a: torch.fft.rfft2(a, norm="ortho"), X), (lambda a: torch.fft.irfft(a, n=6), C),
    (lambda a: torch.fft.hfft(a, dim=0), C), (lambda a: torch.fft.ihfft(a), X),
    (lambda a: torch.fft.fftn(a, dim=(0, 1)), X), (lambda a: torch.fft.irfftn(a), C),
])
def test_fft_matches_loop(f, x):
    check_vmap_all_bdims(f, [x])


@pytest.mark.parametrize("f", [
    lambda a: torch.sort(a), lambda a: torch.sort(a, dim=0, descending=True),
    lambda a: torch.sort(a, stable=True, dim=-1), lambda a: torch.argsort(a, dim=0),
    lambda a: torch.topk(a, 2), lambda a: torch.topk(a, 1, dim=0, largest=False),
    lambda a: torch.msort(a),
])
def test_sorting_matches_loop(f):
    check_vmap_all_bdims(f, [X])
    check_vmap_all_bdims(lambda a: torch.sort(a), [torch.tensor(3.0)])


def test_gradients_strict():
    x = torch.stack([X + 0.1 * i for i in range(3)]).requires_grad_()
    for f in (lambda a: torch.fft.rfft(a).abs().sum(), lambda a: torch.topk(a, 2).values.sum(),
              lambda a: torch.sort(a, dim=0).values.pow(2).sum()):
        with ft.config.strict_fallback():
            got = ft.vmap(ft.grad(f))(x.detach())
        exp = torch.stack([torch.autograd.grad(f(a), a)[0] for a in x.detach().requires_grad_()])
        assert_same(got, exp, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("in_dim", [0, -1])
def test_sort_of_expanded_examples_layout_expanded(in_dim):
    """Layout ``expanded`` (issue 25): examples of 8,000 equal values, each expanded from one
    value (stride 0), different per example.  Eager sort orders those ties differently on the
    stride-0 input than on a contiguous one; sort and argsort give the contiguous loop's
    indices (See Note [layout-dependent kernels])."""
    from tests.support.oracles import contiguous_loop
    B, n = 3, 8000
    values = torch.tensor([0.5, -1.0, 2.0])
    x = values[:, None].expand(B, n) if in_dim == 0 else values[None, :].expand(n, B)
    for f in (lambda t: torch.sort(t), lambda t: torch.argsort(t),
              lambda t: torch.sort(t, stable=True, descending=True)):
        want = contiguous_loop(f, (in_dim,), B, x)
        with ft.config.strict_fallback():
            got = ft.vmap(f, in_dims=in_dim)(x)
        assert_same(tuple(got) if isinstance(got, tuple) else got,
                    tuple(want) if isinstance(want, tuple) else want)
