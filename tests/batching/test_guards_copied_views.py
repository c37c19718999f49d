"""Views stay aliases under vmap wherever eager's are, and a view that had to be a copy can
never give a silent wrong answer (see Note [view after moving the bdim] in batching/guards.py)."""
import pytest
import torch

import functrans as ft
from functrans.errors import UnsupportedUnderVmap
from tests.support.oracles import assert_same, loop_oracle, make_batch


def _write_through_view(x):
    y = x.clone()
    y.view(-1).add_(1)           # an in-place write through a view must reach y
    return y


def _write_into_base(x):
    y = x.clone()
    v = y.view(-1)
    y.mul_(2)                    # a write into the base must show through the view
    return v


@pytest.mark.parametrize("f", [_write_through_view, _write_into_base])
@pytest.mark.parametrize("bdim", [0, 1, 2, -1])
def test_views_of_clones_alias_for_every_bdim(f, bdim):
    x = make_batch(torch.randn(3, 4), bdim, 5)
    with ft.config.strict_fallback():
        got = ft.vmap(f, in_dims=bdim)(x)
    assert_same(got, loop_oracle(f, (bdim,), 5, x))


def test_clone_lays_out_each_example_as_eager_does():
    x = make_batch(torch.randn(3, 4), 1, 2)

    def f(a):
        c = a.clone()
        assert c.is_contiguous() == a.clone().is_contiguous()
        return c
    ft.vmap(f, in_dims=1)(x)
    # A permuted, non-dense example: eager's clone is dense with the dims in stride order.
    y = torch.randn(3, 2, 4).permute(2, 1, 0)       # examples [4, 3] with strides (1, 8)
    seen = []
    ft.vmap(lambda a: seen.append(a.clone().stride()) or a, in_dims=1)(y)
    assert seen == [y.select(1, 0).clone().stride()] == [(1, 4)]
    # A dense example keeps its strides and the batch dim stays where it is.
    z = torch.randn(4, 2, 3).permute(2, 1, 0)       # examples [3, 4] with strides (1, 3)
    seen.clear()
    out = ft.vmap(lambda a: seen.append(a.clone().stride()) or a.clone(), in_dims=1)(z)
    assert seen == [z.select(1, 0).clone().stride()] and torch.equal(out, z.movedim(1, 0))


def test_view_that_needs_per_example_strides_is_still_an_alias():
    # examples of shape [2, 6] stored with the batch between the two dims; viewing as [2, 2, 3]
    # only splits the last dim, which is possible per example but not with the batch in front
    # after a transpose.
    x = make_batch(torch.randn(2, 6), 1, 3)

    def f(a):
        y = a.clone()
        v = y.view(2, 2, 3)
        v.add_(1)
        return y
    assert_same(ft.vmap(f, in_dims=1)(x), loop_oracle(f, (1,), 3, x))


def _pointwise_then_view_write(x):
    y = x * 2                    # keeps the batch dim in the middle of each example
    v = y.view(-1)               # eager: an alias; vmap: a copy, recorded
    v.add_(1)
    return y


def _pointwise_then_base_write(x):
    y = x * 2
    v = y.view(-1)
    y.add_(1)
    return v


@pytest.mark.parametrize("f", [_pointwise_then_view_write, _pointwise_then_base_write])
def test_write_that_would_miss_a_copied_view_raises(f):
    x = torch.randn(3, 5, 4)
    with pytest.raises(UnsupportedUnderVmap, match=r"view\(\), but under vmap that view had to be a copy.*contiguous"):
        ft.vmap(f, in_dims=1)(x)
    # ...and the advice works: in_dims=0 aliases, and so does .contiguous() first.
    assert_same(ft.vmap(f)(x.movedim(1, 0).contiguous()), loop_oracle(f, (1,), 5, x))


def test_copied_view_without_writes_is_fine():
    x = torch.randn(3, 5, 4)
    f = lambda a: (a * 2).view(-1).sin()
    with ft.config.strict_fallback():
        assert_same(ft.vmap(f, in_dims=1)(x), loop_oracle(f, (1,), 5, x))


@pytest.mark.parametrize("f", [_write_through_view, _write_into_base])
def test_views_alias_under_nested_vmap(f):
    x = torch.randn(2, 3, 4, 5)          # outer batch (2) at dim 0, inner batch (4) at dim 2
    got = ft.vmap(ft.vmap(f, in_dims=1))(x)
    assert_same(got, torch.stack([loop_oracle(f, (1,), 4, x[i]) for i in range(2)]))


def test_copied_view_write_raises_under_nested_vmap():
    x = torch.randn(2, 3, 5, 4)
    with pytest.raises(UnsupportedUnderVmap, match="had to be a copy"):
        ft.vmap(ft.vmap(_pointwise_then_view_write, in_dims=1))(x)


def _slice_writes(x):
    y = x.clone()
    y[1:3] = y[1:3] * 2          # autograd's gradient for this uses new_empty_strided + as_strided
    y[0].mul_(3)
    return y


def test_vmap_of_vjp_through_in_place_slice_writes():
    x = torch.randn(5)
    _, vjp_fn = ft.vjp(_slice_writes, x)
    cts = torch.randn(4, 5)
    with ft.config.strict_fallback():
        got, = ft.vmap(vjp_fn)(cts)
    expected = torch.stack([torch.autograd.grad(_slice_writes(x.requires_grad_()), x, c)[0]
                            for c in cts])
    assert_same(got, expected)
    assert_same(ft.vmap(ft.grad(lambda a: (_slice_writes(a) ** 2).sum()))(cts),
                torch.func.vmap(torch.func.grad(lambda a: (_slice_writes(a) ** 2).sum()))(cts))


def test_as_strided_on_examples_that_own_their_memory():
    x = torch.randn(3, 6)
    f = lambda a: a.as_strided((2, 2), (3, 1), 1)
    with ft.config.strict_fallback():
        got = ft.vmap(f)(x)
    assert_same(got, torch.stack([f(a.clone()) for a in x]))   # each example a fresh tensor


def test_as_strided_on_shared_or_interleaved_memory_follows_the_reference():
    """Each example is viewed as example 0 is, at its own place in the storage (Note
    [as_strided under vmap]): interleaved examples (x.t()) read across the batch as in
    torch.func; a window starting before the example's own memory (x[:, 1:] at offset 0) is
    refused, as there."""
    x = torch.randn(6, 6).t()
    f = lambda a: a.as_strided((2,), (1,), 0)
    with ft.config.strict_fallback():
        got = ft.vmap(f)(x)
    assert_same(got, torch.func.vmap(f)(x))
    assert_same(got, torch.stack([a.as_strided((2,), (1,), a.storage_offset()) for a in x]))
    y = torch.randn(6, 6)[:, 1:]
    with pytest.raises(RuntimeError):
        torch.func.vmap(f)(y)
    with pytest.raises(UnsupportedUnderVmap,
                       match=r"reads storage elements \[0, 1\], but each example of x spans "
                             r"storage elements \[1, 5\]"):
        ft.vmap(f)(y)


def test_vmap_of_vjp_of_circular_pad_with_empty_examples():
    import torch.nn.functional as F
    for shape in ((1, 3, 3), (0, 3, 3)):
        x = torch.randn(*shape)
        f = lambda a: F.pad(a, (1, 2), mode="circular")
        out, vjp_fn = ft.vjp(f, x)
        cts = torch.randn(3, *out.shape)
        with ft.config.strict_fallback():
            got, = ft.vmap(vjp_fn)(cts)
        ref, = torch.func.vmap(torch.func.vjp(f, x)[1])(cts)
        assert_same(got, ref)
