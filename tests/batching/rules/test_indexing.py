"""The indexing family vs the loop oracle (every in_dims choice, vmap∘vmap, strict): gather,
scatter*, index_select, advanced indexing and index_put (x[i], x[:, i], x[i, :, j], x[i] = v,
index_put_ with accumulate), index_add/copy/fill/reduce, take/put, *_scatter, masked_fill /
masked_scatter, isin; boolean masks (batched where the shape is static, a clear error
otherwise); per-example gradients vs torch.func."""
import pytest
import torch

import functrans as ft
from tests.support.oracles import assert_same, check_vmap, check_vmap_all_bdims

g = torch.Generator().manual_seed(0)
X = torch.randn(3, 4, generator=g)
IDX = torch.tensor([[0, 2], [1, 1], [3, 0]])


@pytest.mark.parametrize("f, args", [
    (lambda x, i: torch.gather(x, 1, i), [X, IDX]),
    (lambda x, i: torch.gather(x, -1, i), [X, IDX]),
    (lambda x, i: torch.gather(x, 0, i), [X, IDX[:2]]),
    (lambda x, i: torch.gather(x, 0, i), [torch.tensor(2.0), torch.tensor(0)]),
    (lambda x, i, s: torch.scatter(x, 1, i, s), [X, IDX, torch.randn(3, 2, generator=g)]),
    (lambda x, i: torch.scatter(x, 1, i, 7.0), [X, IDX]),
    (lambda x, i, s: torch.scatter_add(x, 1, i, s), [X, IDX, torch.randn(3, 2, generator=g)]),
    (lambda x, i: torch.index_select(x, 1, i), [X, torch.tensor([3, 0, 0])]),
    (lambda x, i: torch.index_select(x, 0, i), [X, torch.tensor([2])]),
    (lambda x, i: torch.index_select(x, 0, i), [torch.tensor(5.0), torch.tensor(0)]),
    (lambda x, i: torch.index_select(x, 0, i), [torch.tensor(5.0), torch.tensor([0])]),
])
def test_matches_loop(f, args):
    check_vmap_all_bdims(f, args)


def test_inplace_scatter_into_batched_self():
    from tests.support.oracles import check_vmap
    f = lambda x, i, s: x.clone().scatter_(1, i, s)
    for dims in [(0, 0, 0), (0, None, 0), (-1, 0, None), (0, None, None)]:
        check_vmap(f, [X, IDX, torch.randn(3, 2, generator=g)], dims)


def test_integer_advanced_indexing_is_batched_and_bool_masks_raise():
    x, i = torch.randn(4, 5), torch.randint(0, 5, (4, 3))
    torch.testing.assert_close(ft.vmap(lambda a, j: a[j])(x, i),
                               torch.stack([a[j] for a, j in zip(x, i)]))
    with pytest.raises(ft.UnsupportedUnderVmap, match="shape depends on the values"):
        ft.vmap(lambda a: a[a > 0])(x)


# ------------------------------------------------------------------------------------------
# Advanced integer indexing and index_put (every in_dims choice, nested, strict).
# ------------------------------------------------------------------------------------------
X3 = torch.randn(4, 5, 6, generator=g)
I2 = torch.tensor([[0, 3], [2, 1]])      # in range for every dim of X3
I1 = torch.tensor([1, 0, 3])
S32 = torch.randn(3, 2, generator=g)
IDX1 = torch.tensor([2, 0, 2])
SRC1 = torch.randn(3, 3, generator=g)


def _setitem(key):
    def f(x, v):
        y = x.clone()
        y[key] = v
        return y
    return f


@pytest.mark.parametrize("f, args", [
    (lambda x, i: x[i], [X3, I2]),
    (lambda x, i: x[:, i], [X3, I2]),
    (lambda x, i: x[..., i], [X3, I2]),
    (lambda x, i, j: x[i, :, j], [X3, I2, I1[:2]]),           # not adjacent: dims to the front
    (lambda x, i, j: x[:, i, j], [X3, I2, I1[:2]]),           # adjacent, not at dim 0
    (lambda x, i, j: x[i, j], [X3, I1, torch.tensor([2])]),   # a size-1 index broadcasts
    (lambda x, i, j: torch.ops.aten.index.Tensor(x, [i, j]), [X3, I1, torch.tensor(2)]),
    (lambda x, i: x[None, i], [X3, I1]),
    (lambda x, i: torch.ops.aten._unsafe_index.Tensor(x, [None, i]), [X3, I2]),
    (lambda x, i, v: torch.index_put(x, (i,), v), [X3, I1[:1], torch.randn(5, 6, generator=g)]),
    (lambda x, i, j, v: torch.ops.aten.index_put(x, [i, None, j], v, True),
     [X3, I2, I1[:1], torch.randn(2, 2, 5, generator=g)]),
    (lambda x, i, j, v: torch.ops.aten.index_put(x, [None, i, j], v, True),
     [X3, I2, I1[:1], torch.randn(4, 2, 2, generator=g)]),
])
def test_advanced_indexing(f, args):
    check_vmap_all_bdims(f, args)


@pytest.mark.parametrize("f, args", [
    (lambda x, i, v: _setitem((slice(None), i))(x, v),
     [X3, I1[:1], torch.randn(4, 1, 6, generator=g)]),
    (lambda x, i, j, v: _setitem((i, slice(None), j))(x, v),
     [X3, I1[:2], I1[1:], torch.randn(2, 5, generator=g)]),
    (lambda x, i, v: _setitem(i)(x, v), [X3, I2, torch.randn(6, generator=g)]),
    (lambda x, i, v: x.clone().index_put_((i,), v, accumulate=True),
     [X3, I1, torch.randn(6, generator=g)]),
    (lambda x, i, v: x.clone().index_put_((i,), v), [X3, I1[:1], torch.randn(5, 6, generator=g)]),
    (lambda x, i, s: x.clone().scatter_reduce_(1, i, s, "prod"), [X, IDX, S32]),
    (lambda x, i, s: x.clone().index_add_(-1, i, s), [X, IDX1, SRC1]),
    (lambda x, i, v: x.clone().index_fill_(0, i, v), [X, torch.tensor([2]), torch.tensor(4.0)]),
    (lambda x, i, s: x.clone().put_(i, s), [X, torch.tensor([7]), torch.randn(1, generator=g)]),
    (lambda x, m, v: x.clone().masked_fill_(m, v), [X, X[0] > 0, torch.tensor(3.0)]),
    (lambda x, m, s: x.clone().masked_scatter_(m, s),
     [X, X[0] > 0, torch.randn(4, 3, generator=g)]),
])
def test_inplace_index_put_into_batched_self(f, args):
    """``x[key] = v`` / ``index_put_``: every in_dims choice with a batched ``x`` (writing a
    batched value into an unbatched tensor is refused, as in torch.vmap)."""
    from tests.support.oracles import bdim_choices, check_vmap
    for dims in bdim_choices(len(args)):
        if dims[0] is not None:
            check_vmap(f, args, dims)


def test_index_and_index_put_with_unbatched_masks():
    from tests.support.oracles import check_vmap
    mask = torch.tensor([True, False, True, True])
    check_vmap(lambda x, m: x[m], [X3, mask], (0, None))
    check_vmap(lambda x, m: x[:, :, m.repeat(2)[:6]], [X3, mask], (-1, None))
    check_vmap(lambda x, m, v: torch.index_put(x, (m,), v), [X3, mask, torch.randn(6, generator=g)],
               (None, None, 0))
    check_vmap(lambda x, m, v: torch.index_put(x, (m,), v, accumulate=True),
               [X3, mask, torch.randn(5, 1, generator=g)], (0, 0, 0))
    check_vmap(lambda x, m, v: _setitem(m)(x, v), [X3[0], X3[0] > 0, torch.tensor(2.0)], (0, 0, 0))


# ------------------------------------------------------------------------------------------
# scatter / index_* reductions, fills, copies; take / put; *_scatter; masks; isin.
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("f, args", [
    (lambda x, i, s: torch.scatter(x, 1, i, s, reduce="multiply"), [X, IDX, S32]),
    (lambda x, i: torch.scatter(x, 1, i, 2.0, reduce="add"), [X, IDX]),
    (lambda x, i, s: torch.scatter_reduce(x, 1, i, s, "amax"), [X, IDX, S32]),
    (lambda x, i, s: torch.scatter_reduce(x, 1, i, s, "mean", include_self=False), [X, IDX, S32]),
    (lambda x, i, s: torch.index_add(x, 1, i, s, alpha=2.0), [X, IDX1, SRC1]),
    (lambda x, i, s: torch.index_add(x, 0, i, s),
     [torch.tensor(1.0), torch.tensor([0]), torch.tensor(2.0)]),
    (lambda x, i, s: torch.index_copy(x, 1, i, s), [X, torch.tensor([3, 0, 1]), SRC1]),
    (lambda x, i, s: torch.index_reduce(x, 1, i, s, "amin", include_self=False), [X, IDX1, SRC1]),
    (lambda x, i, s: torch.index_reduce(x, 1, i, s, "mean"), [X, IDX1, SRC1]),
    (lambda x, i: torch.index_fill(x, 1, i, -1.5), [X, torch.tensor([-1, 0])]),
    (lambda x, i, v: torch.index_fill(x, 1, i, v), [X, torch.tensor([3, 1]), torch.tensor(4.0)]),
    (lambda x, i: torch.take(x, i), [X, torch.tensor([[-1, 5], [11, 0]])]),
    (lambda x, i: torch.take(x, i), [X, torch.tensor(-7)]),
    (lambda x, i, s: torch.put(x, i, s, accumulate=True),
     [X, torch.tensor([-12, 5, 11]), torch.randn(3, generator=g)]),
    (lambda x, s: torch.select_scatter(x, s, 1, -1), [X, torch.randn(3, generator=g)]),
    (lambda x, s: torch.slice_scatter(x, s, 1, 1, None, 2), [X, torch.randn(3, 2, generator=g)]),
    (lambda x, s: torch.diagonal_scatter(x, s, 1, 1, 0), [X, torch.randn(2, generator=g)]),
    (lambda x, m, v: torch.masked_fill(x, m, v), [X, X > 0, torch.tensor(3.0)]),
    (lambda x, m, s: torch.masked_scatter(x, m, s), [X, X > 0, torch.randn(12, generator=g)]),
    (lambda e, t: torch.isin(e, t), [torch.tensor([[1, 2], [3, 4]]), torch.tensor([2, 4, 0])]),
    (lambda e, t: torch.isin(e, t, invert=True),
     [torch.tensor([1., 2., 3.]), torch.tensor([2., 5.])]),
    (lambda t: torch.isin(3, t), [torch.tensor([1, 2, 3, 4])]),
    (lambda e: torch.isin(e, 3), [torch.tensor([1, 2, 3, 4])]),
    (lambda x, m, i: torch.ops.aten._unsafe_masked_index(x, m, [None, i], 0.5),
     [X, torch.tensor([[True, False], [False, True], [True, True]]), torch.tensor([1, 5])]),
    (lambda x, m, i, v: torch.ops.aten._unsafe_masked_index_put_accumulate(x, m, [i], v),
     [X, torch.tensor([[True], [False]]), torch.tensor([0, 2]), torch.randn(2, 4, generator=g)]),
])
def test_index_family_matches_loop(f, args):
    check_vmap_all_bdims(f, args)


def test_take_with_a_0d_index_reads_nothing_back_and_copies():
    """take's rule indexes with aten.index: Python indexing (``x[:, index]``) read a 0-d index
    back to the host (``.item()``, a device sync eager's take does not make) and returned a
    view of x where eager's take returns a new tensor."""
    from tests.support.device_audit import syncs_of
    xs = torch.randn(3, 2, 4, generator=g)
    with ft.config.strict_fallback():
        assert syncs_of(lambda: ft.vmap(torch.take, in_dims=(0, None))(xs, torch.tensor(5))) == {}
        out = ft.vmap(torch.take, in_dims=(0, None))(xs, torch.tensor(5))
    assert_same(out, torch.stack([torch.take(x, torch.tensor(5)) for x in xs]))
    out.zero_()
    assert xs.reshape(3, -1)[:, 5].ne(0).all()


# ------------------------------------------------------------------------------------------
# Gradients: vmap(grad) reaches index_put / masked_scatter_backward / ... with batched indices.
# ------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("loss, in_dims", [
    (lambda x, i: (x[i] ** 2).sum(), (None, 0)),
    (lambda x, i: (x[:, i] ** 2).sum() + x[i[:2], i[1:3]].exp().sum(), (0, 0)),
    (lambda x, i: (torch.take(x, i) * torch.arange(4.0)).sum(), (0, None)),
    (lambda x, i: torch.index_add(x, 0, i[:2] % 4, x[:2] ** 2).sum(), (0, 0)),
    (lambda x, i: torch.masked_scatter(x, x > 0, (x * 3).flip(0)).pow(2).sum(), (0, None)),
    (lambda x, i: torch.gather(x, 1, i[:, None] % 4).pow(3).sum(), (None, 0)),
])
def test_per_example_gradients_match_torch_func(loss, in_dims):
    x = torch.randn(3, 4, 4, generator=g)
    i = torch.randint(0, 4, (3, 4), generator=g)
    args = [x if in_dims[0] is not None else x[0], i if in_dims[1] is not None else i[0]]
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(loss), in_dims=in_dims)(*args)
    want = torch.func.vmap(torch.func.grad(loss), in_dims=in_dims)(*args)
    torch.testing.assert_close(got, want)


def test_masked_scatter_with_a_source_shorter_than_the_mask():
    x = torch.zeros(5)
    mask = torch.tensor([True, False, True, False, False])
    src = torch.randn(3)
    f = lambda a, m, s: a.masked_scatter(m, s)  # noqa: E731
    for dims in ((0, None, 0), (None, None, 0), (0, None, None), (-1, None, -1)):
        check_vmap(f, [x, mask, src], dims)   # (a batched mask could select more than 3)
    # combinations' gradient reaches it this way
    y = torch.randn(4)
    out, vjp_fn = ft.vjp(lambda a: torch.combinations(a, 2), y)
    cts = torch.randn(3, *out.shape)
    with ft.config.strict_fallback():
        got, = ft.vmap(vjp_fn)(cts)
    assert_same(got, torch.stack([torch.autograd.grad(
        torch.combinations(y.requires_grad_(), 2), y, c)[0] for c in cts]))
