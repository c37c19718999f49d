"""searchsorted / bucketize (and later histogram) rules vs the loop oracle (every in_dims choice,
vmap∘vmap, strict): shared 1-D boundaries, per-example boundaries, N-D boundaries, Scalar
overloads, ``right`` / ``side`` / ``out_int32`` / ``sorter``."""
import pytest
import torch

import functrans as ft
from tests.support.oracles import (assert_same, check_vmap, check_vmap_all_bdims, loop_oracle,
                                    make_batch)

g = torch.Generator().manual_seed(0)
EDGES = torch.linspace(-1.5, 1.5, 7)
VALUES = torch.randn(3, 4, generator=g)


def sorted_(b):
    return b.sort(-1).values   # perturbed boundaries stay sorted per example


@pytest.mark.parametrize("right", [False, True])
@pytest.mark.parametrize("values", [VALUES, VALUES[0, 0]], ids=["2d", "0d"])
def test_searchsorted_1d_boundaries(right, values):
    f = lambda b, v: torch.searchsorted(sorted_(b), v, right=right)
    check_vmap_all_bdims(f, [EDGES, values])
    check_vmap_all_bdims(lambda b, v: torch.searchsorted(sorted_(b), v, side="right",
                                                         out_int32=True), [EDGES, values])


def test_searchsorted_nd_boundaries_and_sorter():
    edges = torch.randn(3, 5, generator=g)
    check_vmap_all_bdims(lambda b, v: torch.searchsorted(sorted_(b), v), [edges, VALUES])
    perm = torch.randperm(7, generator=g)
    shuffled = EDGES[perm]
    sorter = perm.argsort()
    for in_dims in [(0, None), (None, 0), (-1, -1)]:
        check_vmap(lambda v, b: torch.searchsorted(b, v, sorter=sorter),
                   [VALUES, shuffled], in_dims)


@pytest.mark.parametrize("right", [False, True])
def test_scalar_overloads(right):
    check_vmap_all_bdims(lambda b: torch.searchsorted(sorted_(b), 0.25, right=right), [EDGES])
    check_vmap_all_bdims(lambda b: torch.bucketize(0.5, sorted_(b), right=right), [EDGES])
    ints = torch.arange(0, 12, 2)
    check_vmap_all_bdims(lambda b: torch.searchsorted(b.sort().values, 4, right=right), [ints])


@pytest.mark.parametrize("right", [False, True])
def test_bucketize(right):
    f = lambda v, b: torch.bucketize(v, sorted_(b), right=right, out_int32=right)
    check_vmap_all_bdims(f, [VALUES, EDGES])
    check_vmap_all_bdims(f, [VALUES[0, 0], EDGES])


def test_bucketize_inside_a_per_sample_gradient():
    edges = torch.linspace(-2, 2, 5)
    table = torch.randn(6, generator=g)

    def loss(w, x):
        y = x * w
        return (table[torch.bucketize(y.detach(), edges)] * y).sum()

    xs = torch.randn(4, 3, generator=g)
    w = torch.randn(3, generator=g)
    with ft.config.strict_fallback():
        ours = ft.vmap(ft.grad(loss), in_dims=(None, 0))(w, xs)
    ref = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(w, xs)
    torch.testing.assert_close(ours, ref)


# ---------------------------------------------------------------------------------------------
# Histograms: every example's histogram is its own.

def edge_cases(lo, hi, bins, dtype=torch.float32):
    """A batch whose examples sit exactly on, and one ulp either side of, the bin edges."""
    edges = torch.linspace(lo, hi, bins + 1, dtype=dtype)
    up, down = edges.nextafter(torch.full_like(edges, 1e9)), edges.nextafter(-torch.full_like(
        edges, 1e9))
    extra = torch.tensor([lo - 1, hi + 1, float("nan"), (lo + hi) / 3], dtype=dtype)
    return torch.stack([torch.cat([edges, extra]), torch.cat([up, extra]),
                        torch.cat([down, extra])])


def check_exact_on_edges(f, lo, hi, bins):
    for dtype in (torch.float32, torch.float64):
        batch = edge_cases(lo, hi, bins, dtype)
        with ft.config.strict_fallback():
            got = ft.vmap(f)(batch)
        expected = torch.stack([f(x) for x in batch])
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("bins,lo,hi", [(5, -1.0, 1.0), (7, -0.3, 2.9), (3, 0.0, 0.0)])
def test_histc(bins, lo, hi):
    x = torch.randn(2, 6, generator=g)
    nested = lo != hi   # a data-dependent range declines under nested vmap (test below)
    check_vmap_all_bdims(lambda v: torch.histc(v, bins, lo, hi), [x], nested=nested)
    check_vmap_all_bdims(lambda v: torch.histc(v, bins, lo, hi), [x[0, 0]], nested=nested)
    if lo != hi:
        check_exact_on_edges(lambda v: torch.histc(v, bins, lo, hi), lo, hi, bins)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lo,hi", [(-1e39, 1e39), (1.0, 1.0 + 2.0 ** -30), (-3e38, 3e38)])
@pytest.mark.filterwarnings("ignore::functrans.PerformanceWarning")
def test_histc_range_checked_on_the_host_as_the_kernel_rounds_it(dtype, lo, hi):
    # issue 17: the range is rounded to the input's dtype and checked as numbers on the host
    # (no value read of a device tensor); edge ranges give eager's result or eager's error
    x = torch.randn(3, 5, generator=g).to(dtype)
    f = lambda v: torch.histc(v, 4, lo, hi)  # noqa: E731
    try:
        expected = torch.stack([f(v) for v in x])
    except RuntimeError as e:
        with pytest.raises(RuntimeError, match=str(e).splitlines()[0][:40]):
            ft.vmap(f)(x)
    else:
        assert_same(ft.vmap(f)(x), expected)


def test_histc_with_a_data_dependent_range_declines_under_nesting_only():
    x = torch.randn(2, 6, generator=g)
    check_vmap(lambda v: torch.histc(v, 4), [x], (0,))
    check_vmap(lambda v: torch.histc(v, 4), [x], (-1,))
    check_vmap(lambda v: torch.histc(v, 4), [torch.ones(3)], (0,))   # widened by 1
    with pytest.raises(Exception, match="loop fallback is disabled"):
        check_vmap(lambda v: ft.vmap(lambda w: torch.histc(w, 4))(v), [x], (0,))


@pytest.mark.parametrize("density", [False, True])
def test_histogram_with_a_bins_tensor(density):
    x = torch.randn(3, 4, generator=g)
    edges = torch.tensor([-1.0, -0.2, 0.1, 0.9, 1.5])
    w = torch.rand(3, 4, generator=g)
    f = lambda v, b: torch.histogram(v, b.sort().values, weight=w, density=density)
    check_vmap_all_bdims(lambda v, b: tuple(f(v, b)), [x, edges])
    check_exact_on_edges(lambda v: torch.histogram(v, torch.linspace(-1, 1, 6, dtype=v.dtype)
                                                   ).hist, -1.0, 1.0, 5)


@pytest.mark.parametrize("density", [False, True])
def test_histogram_with_a_bin_count(density):
    x = torch.randn(3, 4, generator=g)
    w = torch.rand(3, 4, generator=g)
    f = lambda v: tuple(torch.histogram(v, 6, range=(-1.2, 1.1), weight=w, density=density))
    check_vmap_all_bdims(f, [x])
    for bins, lo, hi in [(5, -1.0, 1.0), (7, -0.3, 2.9), (10, 0.1, 0.7)]:
        check_exact_on_edges(lambda v: torch.histogram(v, bins, range=(lo, hi)).hist,
                             lo, hi, bins)
        check_exact_on_edges(lambda v: torch.histogramdd(v.unsqueeze(-1), [bins],
                                                         range=[lo, hi]).hist, lo, hi, bins)


@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "min", "prod"])
def test_segment_reduce_and_backward(reduce):
    d = torch.randn(5, 3, generator=g)
    lengths, offsets = torch.tensor([2, 0, 3]), torch.tensor([0, 2, 2, 5])
    initial = None if reduce == "mean" else 0.5
    f = lambda x: torch.segment_reduce(x, reduce, lengths=lengths, initial=initial)
    check_vmap_all_bdims(f, [d])
    check_vmap_all_bdims(lambda x: torch.segment_reduce(x, reduce, offsets=offsets), [d])
    check_vmap_all_bdims(ft.grad(lambda x: (f(x) * f(x).detach().sin()).sum()), [d],
                         nested=False)
    d2, lengths2 = torch.randn(2, 5, 3, generator=g), torch.tensor([[2, 0, 3], [1, 1, 3]])
    f2 = lambda x: torch.segment_reduce(x, reduce, lengths=lengths2, axis=-2, initial=initial)
    check_vmap_all_bdims(f2, [d2])
    check_vmap_all_bdims(ft.grad(lambda x: f2(x).sum()), [d2], nested=False)


@pytest.mark.parametrize("density", [False, True])
def test_histogramdd(density):
    x = torch.randn(6, 2, generator=g)
    w = torch.rand(6, generator=g)
    f = lambda v: tuple(torch.histogramdd(v, [3, 4], range=[-1.0, 1.0, -0.5, 1.5], weight=w,
                                          density=density))
    check_vmap_all_bdims(lambda v: f(v)[0], [x])
    check_vmap(f, [x], (0,))
    edges = [torch.tensor([-1.0, 0.0, 0.5, 1.0]), torch.tensor([-2.0, -0.1, 0.3])]
    t = lambda v, a, b: torch.histogramdd(v, [a.sort().values, b.sort().values],
                                          density=density).hist
    for in_dims in [(0, None, None), (None, 0, None), (-1, 0, -1), (0, 0, 0)]:
        check_vmap(t, [x, *edges], in_dims)


def test_searchsorted_with_batched_sorter():
    seq = torch.randn(6)
    vals = torch.randn(4)
    # in_dims for (seq, values, sorter): the sorter must sort its own example's boundaries
    for dims in ((0, None, 0), (0, 0, 0), (-1, None, -1)):
        seqs = make_batch(seq, dims[0], 3)
        sorters = torch.stack([torch.argsort(s) for s in seqs.movedim(dims[0], 0)],
                              dims[0] % 2)
        f = lambda s, v, o: torch.searchsorted(s, v, sorter=o)
        batched = [seqs, vals if dims[1] is None else make_batch(vals, dims[1], 3), sorters]
        with ft.config.strict_fallback():
            got = ft.vmap(f, in_dims=dims)(*batched)
        assert_same(got, loop_oracle(f, dims, 3, *batched))
