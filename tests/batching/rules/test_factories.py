"""Batching rules of functrans/batching/rules/factories.py.

Values, shapes and dtypes against the loop oracle (every in_dims choice, nested, strict); the
results are BATCHED (in-place writes of batched values into them work, as under torch.vmap);
memory formats apply to each example; kwargs (dtype, device) pass through.
"""
import warnings

import pytest
import torch

import functrans
from functrans import vmap
from tests.support.oracles import assert_same, check_vmap, check_vmap_all_bdims, make_batch

aten = torch.ops.aten
T = torch.randn(3, 4)
I = torch.randint(-5, 5, (3, 4))

CASES = {
    "zeros_like": lambda a: torch.zeros_like(a),
    "zeros_like_dtype": lambda a: torch.zeros_like(a, dtype=torch.int32),
    "ones_like": lambda a: torch.ones_like(a),
    "ones_like_dtype_device": lambda a: torch.ones_like(a, dtype=torch.float64, device="cpu"),
    "full_like": lambda a: torch.full_like(a, 2.5),
    "full_like_int": lambda a: torch.full_like(a, 7, dtype=torch.int64),
    "empty_like_filled": lambda a: torch.empty_like(a).fill_(1.0),
    "empty_like_dtype": lambda a: torch.empty_like(a, dtype=torch.float64).zero_(),
    "zeros_like_contiguous": lambda a: torch.zeros_like(a.t(),
                                                        memory_format=torch.contiguous_format),
    "ones_like_preserve": lambda a: torch.ones_like(a.t(), memory_format=torch.preserve_format),
    "new_zeros": lambda a: a.new_zeros(2, 5),
    "new_zeros_0d": lambda a: a.new_zeros(()),
    "new_ones": lambda a: a.new_ones((3,), dtype=torch.bool),
    "new_full": lambda a: a.new_full((2,), 7.0, dtype=torch.float64),
    "new_empty": lambda a: a.new_empty(3).zero_(),
    "new_empty_strided": lambda a: a.new_empty_strided((2, 3), (1, 2)).fill_(4.0),
    "new_empty_strided_0": lambda a: a.new_empty_strided((0, 3), (3, 1)),
    "fill_scalar": lambda a: torch.fill(a, 3),
    "zero": lambda a: aten.zero(a),
    "from_0d": lambda a: torch.zeros_like(a.sum()) + a.new_ones(()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_float_input_matches_loop(name):
    check_vmap_all_bdims(CASES[name], [T])


@pytest.mark.parametrize("name", ["zeros_like", "ones_like", "full_like", "new_zeros",
                                  "new_full", "fill_scalar", "zero"])
def test_integer_input_matches_loop(name):
    check_vmap_all_bdims(CASES[name], [I])


def test_fill_tensor_with_batched_and_unbatched_values():
    value = torch.tensor(1.5)
    check_vmap_all_bdims(lambda a, v: torch.fill(a, v), [T, value])
    check_vmap_all_bdims(lambda a, v: torch.fill(a, v), [I, value])  # keeps a's dtype
    out = check_vmap(lambda v: torch.fill(T, v), [value], [0])
    assert out.shape == (3, *T.shape)


def test_batch_size_one():
    for name in ("zeros_like", "new_zeros", "new_empty_strided"):
        check_vmap(CASES[name], [T], [0], size=1)


def test_results_are_batched_so_inplace_writes_work():
    x, y = torch.randn(4, 3), torch.randn(4, 3)

    def f(a, b):
        z = torch.zeros_like(a)
        z.copy_(b * 2)
        o = torch.ones_like(a, dtype=torch.float64)
        o.mul_(b)
        w = a.new_zeros(2)
        w.select(0, 1).copy_(a.sum())
        e = a.new_empty_strided((2,), (1,))
        e.copy_(a[:2])
        return z, o, w, e

    with functrans.config.strict_fallback():
        z, o, w, e = vmap(f)(x, y)
    assert_same(z, y * 2)
    assert_same(o, y.double())
    assert_same(w, torch.stack([torch.zeros(4), x.sum(1)], 1))
    assert_same(e, x[:, :2])


def test_results_of_an_unbatched_like_input_inside_vmap_stay_writable():
    """zeros_like of a batched value is batched even when the value's bdim is not 0."""
    x = torch.randn(3, 5)

    def f(a):
        z = torch.zeros_like(a)
        z.add_(a)
        return z

    with functrans.config.strict_fallback():
        assert_same(vmap(f, in_dims=1)(x), x.t())


def test_index_assignment_into_new_zeros_is_correct():
    x = torch.randn(4, 3)

    def f(a):
        z = a.new_zeros(3)
        z[0] = a.sum()  # index_put: a rule or the fallback, but never wrong
        return z

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", functrans.PerformanceWarning)
        out = vmap(f)(x)
    expected = torch.zeros(4, 3)
    expected[:, 0] = x.sum(1)
    assert_same(out, expected)


@pytest.mark.parametrize("fmt,shape", [(torch.channels_last, (2, 3, 4, 5)),
                                       (torch.channels_last_3d, (2, 3, 2, 4, 5)),
                                       (torch.contiguous_format, (2, 3, 4))])
@pytest.mark.parametrize("bdim", [0, -1])
def test_memory_format_applies_to_each_example(fmt, shape, bdim):
    """The logical result has the strides eager gives one example (Note [memory_format of
    *_like]), and the values of the loop."""
    x = make_batch(torch.randn(shape), bdim, 3)
    eager_strides = torch.empty(shape, memory_format=fmt).stride()

    def f(a):
        outs = [torch.zeros_like(a, memory_format=fmt),
                torch.full_like(a, 2.0, memory_format=fmt),
                torch.empty_like(a, memory_format=fmt)]
        for o in outs:
            assert o.stride() == eager_strides, (o.stride(), eager_strides)
        return outs[0], outs[1], outs[2].copy_(a)

    with functrans.config.strict_fallback():
        z, full, e = vmap(f, in_dims=bdim)(x)
    logical = x.movedim(bdim, 0)
    assert_same((z, full, e), (torch.zeros_like(logical), torch.full_like(logical, 2.0), logical))


def test_memory_format_that_does_not_fit_raises_eagers_error():
    with pytest.raises(RuntimeError) as eager:
        torch.zeros_like(torch.randn(3, 4), memory_format=torch.channels_last)
    with pytest.raises(RuntimeError) as ours:
        vmap(lambda a: torch.zeros_like(a, memory_format=torch.channels_last))(torch.randn(2, 3, 4))
    assert str(eager.value).splitlines()[0] in str(ours.value)


def test_new_empty_strided_has_the_strides_asked_for_and_its_own_memory():
    x = torch.randn(4, 3)

    def f(a):
        e = a.new_empty_strided((2, 3), (1, 2))
        assert e.stride() == (1, 2)
        return e.copy_(a.new_ones(2, 3) * a.sum())

    with functrans.config.strict_fallback():
        out = vmap(f)(x)
    assert_same(out, x.sum(1)[:, None, None].expand(4, 2, 3))


def test_factories_under_autograd():
    x = torch.randn(3, 4, requires_grad=True)

    def f(a):
        return (a * torch.ones_like(a) + a.new_full((4,), 2.0) * a).sum()

    with functrans.config.strict_fallback():
        grad, = torch.autograd.grad(vmap(f)(x).sum(), x)
    assert_same(grad, torch.full((3, 4), 3.0))


def test_new_zeros_with_same_feature_meta_under_vmap_of_jvp():
    # forward AD allocates tangents with it when a primal's layout is unusual (LAPACK's
    # column-major inverse, then a view)
    A = torch.randn(3, 4, 4) + 4 * torch.eye(4)
    T = torch.randn(3, 4, 4)
    f = lambda a, t: functrans.jvp(lambda x: torch.linalg.inv(x).mT.reshape(2, 8), (a,), (t,))
    with functrans.config.strict_fallback():
        got = functrans.vmap(f)(A, T)
    ref = torch.func.vmap(lambda a, t: torch.func.jvp(
        lambda x: torch.linalg.inv(x).mT.reshape(2, 8), (a,), (t,)))(A, T)
    assert_same(got, ref, rtol=1e-5, atol=1e-5)
    for bdims in ((0, None), (None, 0)):
        other = torch.randn(2, 5)
        op = torch.ops.aten._new_zeros_with_same_feature_meta.default
        g = lambda s, o: op(s, o, self_num_batch_dims=1)
        check_vmap(g, [torch.randn(6, 2, 5), other], bdims, strict=bdims[1] is None)
