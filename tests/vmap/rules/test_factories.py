"""Factories from batched tensors: batched results, values/dtype vs the loop, in-place writes."""
import warnings

import pytest
import torch

import functrans
from functrans import vmap
from tests.oracles import assert_same, check_vmap_all_bdims

T = torch.randn(3, 4)


@pytest.mark.parametrize("f", [
    lambda a: torch.zeros_like(a), lambda a: torch.ones_like(a, dtype=torch.int32),
    lambda a: torch.full_like(a, 2.5), lambda a: a.new_zeros(2, 5), lambda a: a.new_ones(()),
    lambda a: a.new_full((2,), 7.0, dtype=torch.float64),
    lambda a: torch.zeros_like(a, memory_format=torch.contiguous_format),
    lambda a: torch.empty_like(a).fill_(1.0), lambda a: a.new_empty(3).zero_(),
    lambda a: a.new_empty_strided((2, 3), (1, 2)).fill_(4.0),
])
def test_factory_values(f):
    check_vmap_all_bdims(f, [T])


def test_results_are_batched_so_inplace_writes_work():
    x, y = torch.randn(4, 3), torch.randn(4, 3)

    def f(a, b):
        z = torch.zeros_like(a)
        z.copy_(b * 2)
        w = a.new_zeros(2)
        w.select(0, 1).copy_(a.sum())
        return z, w

    with functrans.config.strict_fallback():
        z, w = vmap(f)(x, y)
    assert_same(z, y * 2)
    assert_same(w, torch.stack([torch.zeros(4), x.sum(1)], 1))


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
