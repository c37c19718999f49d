"""Ops that were refused or broken under vmap: narrow with a 0-d tensor start, torch.cov (via
torch.equal), tensor_split with tensor split points, index_fill / index_put under vmap∘vjp,
resize_as_, torch.sparse.sampled_addmm, vmap(vmap(to_sparse)).

Batching is checked against the for-loop oracle over batches of DIFFERENT examples; transforms
against torch.func on the same inputs (or, where torch.func itself refuses, against a loop of
plain autograd).  Where no per-example answer can exist, the error must be functrans's own
clear ``UnsupportedUnderVmap`` (never PyTorch's internal text)."""
import warnings

import pytest
import torch

import functrans as ft
from functrans.errors import UnsupportedUnderVmap
from tests.support.oracles import (assert_same, check_vmap, check_vmap_all_bdims, loop_oracle,
                                    make_batch)

g = torch.Generator().manual_seed(0)
X = torch.randn(5, 4, generator=g)
INTERNAL = ("data is not allocated", "INTERNAL ASSERT", "setStorage", "is_contiguous")


def _no_internal_text(e: BaseException):
    assert not any(s in str(e) for s in INTERNAL), str(e)


# --------------------------------------------------------------------------------------------
# narrow with a 0-d tensor start

STARTS = torch.tensor([0, 3, -2, 1, -5, 2])   # different per example, negative ones included


@pytest.mark.parametrize("narrow", [lambda x, s: torch.narrow(x, 0, s, 2),
                                    lambda x, s: x.narrow(-2, s, 2),
                                    lambda x, s: torch.narrow(x, dim=0, start=s, length=2)])
@pytest.mark.parametrize("x_dim", [0, -1, None])
def test_narrow_with_a_batched_start_matches_loop(narrow, x_dim):
    xs = X if x_dim is None else make_batch(X, x_dim, 6)
    expected = loop_oracle(narrow, (x_dim, 0), 6, xs, STARTS)
    with ft.config.strict_fallback():
        actual = ft.vmap(narrow, in_dims=(x_dim, 0))(xs, STARTS)
    assert_same(actual, expected)


def test_narrow_with_a_batched_start_along_a_later_dim_and_nested():
    f = lambda x, s: torch.narrow(x, 1, s, 3)
    starts = torch.tensor([[0, 1, -3], [1, 0, -4]])   # 2 x 3 examples, all different
    xs = torch.randn(2, 3, 5, 4, generator=g)
    inner = lambda x, s: ft.vmap(f)(x, s)
    expected = torch.stack([torch.stack([f(xs[i, j], starts[i, j]) for j in range(3)])
                            for i in range(2)])
    assert_same(ft.vmap(inner)(xs, starts), expected)
    # start batched at the outer level only, x at the inner level only
    s_outer = torch.tensor([1, -3])
    xi = torch.randn(3, 5, 4, generator=g)
    out = ft.vmap(lambda s: ft.vmap(lambda x: f(x, s))(xi))(s_outer)
    expected = torch.stack([torch.stack([f(xi[j], s_outer[i]) for j in range(3)])
                            for i in range(2)])
    assert_same(out, expected)


def test_narrow_with_an_unbatched_0d_start_matches_loop():
    check_vmap_all_bdims(lambda x: torch.narrow(x, 1, torch.tensor(1), 2), [X])
    check_vmap_all_bdims(lambda x: torch.narrow(x, 0, torch.tensor(-3), 2), [X])


def test_narrow_with_a_batched_start_out_of_range_and_writes_raise_clearly():
    with pytest.raises(IndexError, match="exceeds dimension size"):
        ft.vmap(lambda x, s: torch.narrow(x, 0, s, 2))(make_batch(X, 0, 3),
                                                       torch.tensor([0, 4, 1]))
    with pytest.raises(IndexError, match="out of range"):
        ft.vmap(lambda x, s: torch.narrow(x, 0, s, 2))(make_batch(X, 0, 3),
                                                       torch.tensor([0, -6, 1]))

    def write_through(x, s):
        y = torch.narrow(x, 0, s, 2)
        y.mul_(2)   # in eager this writes into x: under vmap y is a copy, so it must refuse
        return x
    with pytest.raises(UnsupportedUnderVmap, match="narrow with a batched"):
        ft.vmap(write_through)(make_batch(X, 0, 3).clone(), torch.tensor([0, 1, 2]))


def test_per_example_gradient_through_narrow_with_a_batched_start():
    # torch.func refuses a batched start (.item()): the reference is a loop of autograd.grad.
    loss = lambda x, s: (torch.narrow(x, 0, s, 3) ** 2).sum()
    xs = make_batch(X, 0, 4)
    starts = torch.tensor([0, 2, -3, 1])
    expected = torch.stack([_grad(loss, xs[i], starts[i]) for i in range(4)])
    assert_same(ft.vmap(ft.grad(loss))(xs, starts), expected)


def _grad(f, x, *rest):
    x = x.detach().clone().requires_grad_()
    return torch.autograd.grad(f(x, *rest), x)[0]


# --------------------------------------------------------------------------------------------
# torch.cov, and torch.equal which its checks use

OBS = torch.randn(3, 6, generator=g)


@pytest.mark.parametrize("kwargs_of", [
    lambda fw, aw: {},
    lambda fw, aw: {"correction": 0},
    lambda fw, aw: {"fweights": fw},
    lambda fw, aw: {"aweights": aw, "correction": 0},
    lambda fw, aw: {"fweights": fw, "aweights": aw},
])
def test_cov_with_batched_weights_matches_loop(kwargs_of):
    fw0 = torch.tensor([1, 2, 1, 3, 1, 2])
    aw0 = torch.rand(6, generator=g) + 0.5
    f = lambda x, fw, aw: torch.cov(x, **kwargs_of(fw, aw))
    for dims in [(0, 0, 0), (None, 0, -1), (-1, None, 0), (0, None, None)]:
        check_vmap(f, [OBS, fw0, aw0], dims, size=4)
    check_vmap(lambda x: torch.cov(x), [OBS[0]], [0])


def test_cov_with_per_example_degrees_of_freedom_of_different_signs_raises_clearly():
    # fweights summing to 1 with correction=1 give norm_factor 0 in one example only: eager
    # branches on it (warns, divides by 0); one Python bool cannot answer for the whole batch.
    fw = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    with pytest.raises(UnsupportedUnderVmap, match="torch.equal") as e:
        ft.vmap(lambda x, w: torch.cov(x, fweights=w))(OBS.expand(2, 3, 6), fw)
    _no_internal_text(e.value)


def test_equal_is_answered_when_every_example_agrees():
    a = make_batch(torch.randn(3, generator=g), 0, 4)
    assert ft.vmap(lambda x: torch.tensor(torch.equal(x, x.clone())))(a).all()
    assert not ft.vmap(lambda x: torch.tensor(torch.equal(x, x + 1)))(a).any()
    assert not ft.vmap(lambda x: torch.tensor(torch.equal(x, x[:2])))(a).any()
    # nested: the inner level's answers are themselves answered by the outer level
    a2 = torch.stack([a, a + 1])
    eq = lambda x, y: torch.tensor(torch.equal(x, y))
    out = ft.vmap(ft.vmap(eq, in_dims=(0, None)), in_dims=(0, None))(a2, a[0] + 100)
    assert out.shape == (2, 4) and not out.any()
    out = ft.vmap(ft.vmap(eq))(a2, a2.clone())
    assert out.shape == (2, 4) and out.all()
    with pytest.raises(UnsupportedUnderVmap, match="True for some examples"):
        ft.vmap(ft.vmap(eq, in_dims=(0, None)), in_dims=(0, None))(a2, a[0])
    b = a.clone()
    b[1, 0] += 1   # example 1 differs, the others are equal: no single answer
    with pytest.raises(UnsupportedUnderVmap, match="True for some examples"):
        ft.vmap(lambda x, y: torch.tensor(torch.equal(x, y)))(a, b)


# --------------------------------------------------------------------------------------------
# tensor_split with tensor split points

def test_tensor_split_with_unbatched_tensor_split_points_matches_loop():
    x = torch.randn(6, 4, generator=g)
    check_vmap_all_bdims(lambda t: torch.tensor_split(t, torch.tensor([1, 4]), 0), [x])
    check_vmap_all_bdims(lambda t: torch.tensor_split(t, torch.tensor(3), 1), [x])
    # an integer tensor being split (its wrapper answers __torch_function__) is unaffected
    ints = torch.arange(12).reshape(6, 2)
    check_vmap(lambda t: t.tensor_split([1, 3]), [ints[:, 0]], [0])
    check_vmap(lambda t: torch.narrow(t, 0, 1, 3), [ints[:, 0]], [0])


@pytest.mark.parametrize("split", [torch.tensor([[1, 3], [1, 3], [2, 5]]),
                                   torch.tensor([[1, 3], [1, 3], [1, 3]]),
                                   torch.tensor([2, 3, 2])])
def test_tensor_split_with_batched_split_points_raises_clearly(split):
    xs = make_batch(torch.randn(6, 4, generator=g), 0, 3)
    for fn in (lambda t, s: torch.tensor_split(t, s, 0), lambda t, s: t.tensor_split(s),
               lambda t, s: torch.tensor_split(t, tensor_indices_or_sections=s)):
        with pytest.raises(UnsupportedUnderVmap, match="tensor_split") as e:
            ft.vmap(fn)(xs, split)
        _no_internal_text(e.value)
    # split points batched at an outer level, the tensor at an inner one
    with pytest.raises(UnsupportedUnderVmap, match="tensor_split"):
        ft.vmap(lambda s: ft.vmap(lambda t: torch.tensor_split(t, s, 0))(xs))(split[:2])


# --------------------------------------------------------------------------------------------
# index_fill / index_put under vmap∘vjp

def _vmap_vjp(m, f, primals, cts, in_dims):
    def one(*a):
        n = len(primals)
        return m.vjp(f, *a[:n])[1](a[n])
    return m.vmap(one, in_dims=in_dims)(*primals, cts)


@pytest.mark.parametrize("f, primals, out_shape", [
    (lambda x, v: torch.index_fill(x, 1, torch.tensor([3, 0, 3]), v),
     [torch.randn(3, 5, generator=g), torch.tensor(0.7)], (3, 5)),
    (lambda x, v: x.index_put((torch.tensor([2, 0]),), v),
     [torch.randn(4, 3, generator=g), torch.randn(2, 3, generator=g)], (4, 3)),
    (lambda x, v: x.index_put((torch.tensor([2, 2]),), v, accumulate=True),
     [torch.randn(4, 3, generator=g), torch.randn(2, 3, generator=g)], (4, 3)),
    (lambda x, v: x.index_put((torch.tensor([True, False, True, False]),), v),
     [torch.randn(4, 3, generator=g), torch.randn(3, generator=g)], (4, 3)),
])
def test_index_fill_and_index_put_under_vmap_vjp_match_torch_func(f, primals, out_shape):
    cts = make_batch(torch.randn(out_shape, generator=g), 0, 3)
    for pd in [(None, None), (0, None), (0, 0), (None, 0)]:
        ps = [p if d is None else make_batch(p, d, 3) for p, d in zip(primals, pd)]
        dims = (*pd, 0)
        assert_same(_vmap_vjp(ft, f, ps, cts, dims), _vmap_vjp(torch.func, f, ps, cts, dims),
                    msg=str(dims))


def test_index_fill_and_index_put_with_batched_indices_under_vmap_vjp():
    x = torch.randn(3, 5, generator=g)
    xs, cts = make_batch(x, 0, 3), make_batch(torch.randn(3, 5, generator=g), 0, 3)
    idx = torch.tensor([[1, 4], [0, 0], [2, 3]])   # different per example
    # the gradient w.r.t. self batches: index_fill's self formula has a fixed shape
    fill_self = lambda x, i: torch.index_fill(x, 1, i, -1.0)
    got = ft.vmap(lambda x, i, c: ft.vjp(lambda t: fill_self(t, i), x)[1](c))(xs, idx, cts)
    ref = torch.func.vmap(lambda x, i, c: torch.func.vjp(lambda t: fill_self(t, i), x)[1](c))(
        xs, idx, cts)
    assert_same(got, ref)
    # the gradient w.r.t. a tensor value uses unique(index), whose length differs per example:
    # a clear error (torch.func loops and fails to stack; functrans says the shape depends on
    # the values, and which formulation batches: the torch.where form below)
    v = torch.tensor(0.5)
    fill = lambda x, v, i: torch.index_fill(x, 1, i, v)
    with pytest.raises(UnsupportedUnderVmap, match="shape depends on the values") as e:
        ft.vmap(lambda x, v, i, c: ft.vjp(lambda a, b: fill(a, b, i), x, v)[1](c),
                in_dims=(0, None, 0, 0))(xs, v, idx, cts)
    _no_internal_text(e.value)
    # the fixed-shape formulation the error suggests batches, and matches a loop of autograd
    def fill_where(x, v, i):
        mask = torch.zeros_like(x, dtype=torch.bool).index_fill(1, i, True)
        return torch.where(mask, v, x)
    vs = torch.tensor([0.5, -1.0, 2.0])
    got = ft.vmap(lambda x, v, i, c: ft.vjp(lambda a, b: fill_where(a, b, i), x, v)[1](c))(
        xs, vs, idx, cts)
    for k in range(3):
        a, b = xs[k].clone().requires_grad_(), vs[k].clone().requires_grad_()
        ref = torch.autograd.grad(fill(a, b, idx[k]), (a, b), cts[k])
        assert_same(tuple(t[k] for t in got), ref)
    # index_put with a per-example boolean mask: the values' gradient is grad[mask], which
    # runs per example and stacks when every mask selects as many rows (a loop of autograd)...
    masks = torch.tensor([[True, False, True], [False, True, True], [True, True, False]])
    put = lambda x, v, m: x.index_put((m,), v)
    got = ft.vmap(lambda x, m, c: ft.vjp(lambda a, b: put(a, b, m), x, torch.ones(5))[1](c))(
        xs, masks, cts)
    for k in range(3):
        a, b = xs[k].clone().requires_grad_(), torch.ones(5, requires_grad=True)
        assert_same(tuple(t[k] for t in got), torch.autograd.grad(put(a, b, masks[k]), (a, b),
                                                                  cts[k]))
    # ... and raises the clear error, with the torch.where form, when the counts differ
    ragged = torch.tensor([[True, False, True], [False, False, True], [True, True, True]])
    with pytest.raises(UnsupportedUnderVmap,
                       match=r"gradient of x\[mask\] = v.*torch\.where\(mask, v, x\)") as e:
        ft.vmap(lambda x, m, c: ft.vjp(lambda a, b: put(a, b, m), x, torch.ones(5))[1](c))(
            xs, ragged, cts)
    _no_internal_text(e.value)
    # ... and the suggested torch.where form batches and matches a loop of autograd
    put_where = lambda x, v, m: torch.where(m.unsqueeze(-1), v, x)
    got = ft.vmap(lambda x, m, c: ft.vjp(lambda a, b: put_where(a, b, m), x, torch.ones(5))[1](
        c))(xs, masks, cts)
    for k in range(3):
        a, b = xs[k].clone().requires_grad_(), torch.ones(5, requires_grad=True)
        ref = torch.autograd.grad(put(a, b, masks[k]), (a, b), cts[k])
        assert_same(tuple(t[k] for t in got), ref)


# --------------------------------------------------------------------------------------------
# resize_as_

Y54, Y22, Y20, Y66 = (torch.randn(*s, generator=g) for s in [(5, 4), (2, 2), (20,), (6, 6)])


@pytest.mark.parametrize("f, args, dims", [
    # an unbatched self resized like a batched other: only other's (logical) shape is read
    (lambda b: Y54.clone().resize_as_(b), [torch.randn(2, 2, generator=g)], [0]),
    (lambda a, b: a.clone().resize_as_(b), [Y54, torch.randn(5, 4, generator=g)], [None, -1]),
    # a batched self whose shape already matches: a no-op
    (lambda a, b: a.clone().resize_as_(b), [Y54, torch.randn(5, 4, generator=g)], [0, 0]),
    (lambda a, b: a.clone().resize_as_(b), [Y54, Y54], [-1, None]),
    # shrinking or keeping the number of elements keeps each example's leading values
    (lambda a: a.clone().resize_as_(Y22), [Y54], [0]),
    (lambda a: a.clone().resize_as_(Y20), [Y54], [0]),
])
def test_resize_as_matches_loop(f, args, dims):
    check_vmap(f, args, dims, size=3, strict=False)


@pytest.mark.parametrize("layout", ["transposed", "batch_moved"])
@pytest.mark.parametrize("in_dim", [0, -1])
def test_resize_reads_each_example_in_its_logical_order(layout, in_dim):
    """Layouts ``transposed`` and ``batch_moved`` (issue 25): eager ``resize_`` keeps a
    tensor's storage and restrides it contiguously, so on a transposed example it reads the
    elements in memory order (shown below); under vmap each example reads its logical order,
    the contiguous loop's answer (the loop fallback gives aten.resize contiguous examples: See
    Note [layout-dependent kernels])."""
    from tests.support.layouts import bdim_positions, lay_out
    from tests.support.oracles import contiguous_loop
    gen = torch.Generator().manual_seed(11)
    stacked = torch.stack([torch.randn(5, 4, 3, generator=gen) for _ in range(3)], in_dim)
    x = lay_out(stacked, bdim_positions(3, [in_dim]), layout)
    fns = [lambda a: a.clone().resize_(20, 3), lambda a: a.clone().resize_(6),
           lambda a: a.clone().resize_as_(Y22)]
    if layout == "transposed":   # eager: the example's clone keeps its transposed layout
        example = x.select(in_dim, 0)
        assert not torch.equal(fns[0](example), fns[0](example.contiguous()))
    for f in fns:
        want = contiguous_loop(f, (in_dim,), 3, x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = ft.vmap(f, in_dims=in_dim)(x)
        assert_same(got, want)


def test_resize_as_that_grows_a_batched_tensor_raises_clearly():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(UnsupportedUnderVmap, match="would grow") as e:
            ft.vmap(lambda a: a.clone().resize_as_(Y66))(make_batch(Y54, 0, 3))
    _no_internal_text(e.value)


# --------------------------------------------------------------------------------------------
# torch.sparse.sampled_addmm

def test_sparse_sampled_addmm_raises_clearly_and_the_suggested_dense_form_matches_loop():
    inp = (torch.rand(4, 5, generator=g) > 0.5).float() * torch.randn(4, 5, generator=g)
    csr = inp.to_sparse_csr()
    m1 = make_batch(torch.randn(4, 3, generator=g), 0, 3)
    m2 = make_batch(torch.randn(3, 5, generator=g), 0, 3)
    for dims in [(0, 0), (0, None), (None, 0)]:
        a = m1 if dims[0] is not None else m1[0]
        b = m2 if dims[1] is not None else m2[0]
        with pytest.raises(UnsupportedUnderVmap, match="sparse CSR") as e:
            ft.vmap(lambda x, y: torch.sparse.sampled_addmm(csr, x, y, beta=0.5, alpha=2.0),
                    in_dims=dims)(a, b)
        _no_internal_text(e.value)
        dense = lambda x, y: 0.5 * inp + 2.0 * (x @ y) * (inp != 0)
        expected = loop_oracle(
            lambda x, y: torch.sparse.sampled_addmm(csr, x, y, beta=0.5, alpha=2.0).to_dense(),
            dims, 3, a, b)
        with ft.config.strict_fallback():
            assert_same(ft.vmap(dense, in_dims=dims)(a, b), expected, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# vmap(vmap(Tensor.to_sparse))

@pytest.mark.parametrize("args", [(), (1,)])
@pytest.mark.parametrize("inner_dim, outer_dim", [(0, 0), (1, 0), (-1, 1)])
def test_nested_to_sparse_matches_loop(args, inner_dim, outer_dim):
    x = torch.randn(2, 3, 4, 5, generator=g)
    x[x.abs() < 0.6] = 0   # different sparsity patterns (and nnz) per example
    f = lambda a: a.to_sparse(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = ft.vmap(ft.vmap(f, in_dims=inner_dim), in_dims=outer_dim)(x)
    xo = x.movedim(outer_dim, 0)
    expected = torch.stack([torch.stack([f(e) for e in xi.movedim(inner_dim, 0)])
                            for xi in xo])
    assert out.layout == torch.sparse_coo and out.shape == expected.shape
    assert out.sparse_dim() == expected.sparse_dim()
    oc, ec = out.coalesce(), expected.coalesce()
    assert torch.equal(oc.indices(), ec.indices())
    assert torch.equal(oc.values(), ec.values())
    single = ft.vmap(f)(x[0])
    assert torch.equal(single.to_dense(), torch.stack([f(e) for e in x[0]]).to_dense())
