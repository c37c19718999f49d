"""The "cudagraphs" backend (compiler/backends/cudagraphs.py): Inductor's graph captured in a CUDA
graph, results returned without a copy and never overwritten while the caller holds them.

The CUDA tests skip cleanly without a GPU; the CPU test checks that the backend declines CPU
tensors with a warning and the compiled function still answers (by replay).
"""
from __future__ import annotations

import pytest
import torch

import functrans as ft
from functrans.compiler.backends import cudagraphs
from functrans.errors import CompileWarning

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _loss(w, x, y):
    return ((torch.tanh(w @ x) - y) ** 2).sum()


def _per_sample(w, xs, ys):
    return ft.vmap(ft.grad(_loss), in_dims=(None, 0, 0))(w, xs, ys)


def _inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(t.to(device) for t in (torch.randn(3, 8, generator=g),
                                        torch.randn(16, 8, generator=g),
                                        torch.randn(16, 3, generator=g)))


def _run(fn):
    """The backend's callable of the (single) cache entry of the compiled function ``fn``."""
    (variants,) = fn._cache.entries.values()
    return variants[0].run


def test_cpu_tensors_are_declined_and_replayed():
    fast = ft.compile(_per_sample, backend="cudagraphs")
    args = _inputs("cpu")
    with pytest.warns(CompileWarning, match="cudagraphs"):
        fast(*args)
    torch.testing.assert_close(fast(*args), _per_sample(*args))
    (entry,) = fast.cache_info().entries
    assert entry.backend == "replay"
    assert any("cudagraphs unavailable" in n for n in entry.notes), entry.notes


@cuda
@pytest.mark.cuda
def test_per_sample_gradients_run_inductor_inside_one_graph():
    fast = ft.compile(_per_sample, backend="cudagraphs", strict=True)
    for seed in range(4):                        # results dropped: one graph is replayed
        args = _inputs("cuda", seed)
        torch.testing.assert_close(fast(*args), _per_sample(*args))
    info = fast.cache_info()
    assert info.misses == 1 and info.hits == 3 and not info.eager_calls, info
    (entry,) = info.entries
    assert entry.backend == "cudagraphs" and not entry.notes, entry.notes   # Inductor inside
    run = _run(fast)
    assert len(run.captured) == 1


@cuda
@pytest.mark.cuda
def test_held_results_and_their_views_are_not_overwritten():
    fast = ft.compile(_per_sample, backend="cudagraphs", strict=True)
    args = [_inputs("cuda", seed) for seed in range(cudagraphs.MAX_GRAPHS + 2)]
    expected = [_per_sample(*a) for a in args]
    held = [fast(*args[0])]
    view = fast(*args[1])[2:5]                   # only a view of the second result survives
    held += [fast(*a) for a in args[2:]]         # more than MAX_GRAPHS held: eager path too
    torch.testing.assert_close(held[0], expected[0])
    torch.testing.assert_close(view, expected[1][2:5])
    for got, want in zip(held[1:], expected[2:]):
        torch.testing.assert_close(got, want)
    assert len(_run(fast).captured) == cudagraphs.MAX_GRAPHS
    del held, view
    torch.testing.assert_close(fast(*args[0]), expected[0])   # a freed graph is reused
    assert len(_run(fast).captured) == cudagraphs.MAX_GRAPHS


@cuda
@pytest.mark.cuda
def test_an_output_that_is_an_input_is_copied():
    fast = ft.compile(lambda x, y: (x, x.view(-1)[:2], y * 2), backend="cudagraphs", strict=True)
    a, b = torch.randn(2, 3, device="cuda"), torch.randn(3, device="cuda")
    first = fast(a, b)
    second = fast(a + 1, b + 1)
    torch.testing.assert_close(first[0], a)
    torch.testing.assert_close(first[1], a.view(-1)[:2])
    torch.testing.assert_close(second[0], a + 1)
    torch.testing.assert_close(first[2], b * 2)


@cuda
@pytest.mark.cuda
def test_what_a_cuda_graph_cannot_take_is_replayed_with_the_reason():
    def writes(x):
        x.add_(1)
        return x * 2
    fast = ft.compile(writes, backend="cudagraphs")
    x = torch.zeros(3, device="cuda")
    with pytest.warns(CompileWarning, match="warmed up"):
        out = fast(x)
    torch.testing.assert_close(out, torch.full((3,), 2.0, device="cuda"))
    torch.testing.assert_close(x, torch.ones(3, device="cuda"))   # written once, not again
    needs_grad = ft.compile(lambda w: (w * 2).sum(), backend="cudagraphs")
    w = torch.randn(3, device="cuda", requires_grad=True)
    with pytest.warns(CompileWarning, match="autograd"):
        needs_grad(w).backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 2.0, device="cuda"))
