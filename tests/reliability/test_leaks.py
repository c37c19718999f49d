"""No leaks (issue 7, item 4): repeated transform calls keep Python allocations and RSS flat,
leave no extra live tensors, and free their tensors by plain reference counting (no cycles).

The default run does 2,000 calls of the main workload; ``-m sweep`` does 10,000."""
from __future__ import annotations

import gc
import os
import tracemalloc
import weakref

import pytest
import torch
from torch import nn

import functrans as ft
from functrans.batching.batched_tensor import BatchedTensor

MB = 1 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * _PAGE


def _per_sample_grads():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(16, 4), torch.randn(16, 2)

    def loss(p, xi, yi):
        return ((ft.functional_call(model, p, (xi,)) - yi) ** 2).sum()
    g = ft.vmap(ft.grad(loss), in_dims=(None, 0, 0))
    return lambda: g(params, x, y)


def _jacrev():
    w = torch.randn(4, 3)
    f = ft.jacrev(lambda x: torch.tanh(x @ w))
    x = torch.randn(4)
    return lambda: f(x)


def _hessian():
    f = ft.hessian(lambda x: (torch.tanh(x) * x).sum())
    x = torch.randn(4)
    return lambda: f(x)


def _jvp():
    x, t = torch.randn(5), torch.randn(5)
    return lambda: ft.jvp(lambda a: torch.sin(a) * a, (x,), (t,))


WORKLOADS = {"vmap(grad(functional_call))": _per_sample_grads, "jacrev": _jacrev,
             "hessian": _hessian, "jvp": _jvp}


def _live_tensors():
    gc.collect()
    objs = gc.get_objects()
    n = sum(1 for o in objs if issubclass(type(o), torch.Tensor))
    nb = sum(1 for o in objs if type(o) is BatchedTensor)
    return n, nb


def _measure(call, n_calls: int, warmup: int = 200):
    for _ in range(warmup):
        call()
    gc.collect()
    tracemalloc.start()
    try:
        half = n_calls // 2
        for _ in range(half):
            call()
        gc.collect()
        py_mid, rss_mid = tracemalloc.get_traced_memory()[0], _rss()
        for _ in range(n_calls - half):
            call()
        gc.collect()
        py_end, rss_end = tracemalloc.get_traced_memory()[0], _rss()
    finally:
        tracemalloc.stop()
    return py_end - py_mid, rss_end - rss_mid


def _check_flat(name, n_calls):
    call = _per_sample_grads() if name is None else WORKLOADS[name]()
    # On a shared machine RSS moves with the allocator; a real leak grows on every attempt.
    results = []
    for _ in range(2):
        py_growth, rss_growth = _measure(call, n_calls)
        results.append((py_growth, rss_growth))
        if py_growth < 1 * MB and rss_growth < 4 * MB:
            break
    print(f"{name}: {n_calls} calls, growth over the last half (python, rss): "
          f"{[(round(p / 1024, 1), round(r / 1024, 1)) for p, r in results]} KiB")
    py_growth, rss_growth = results[-1]
    assert py_growth < 1 * MB, f"{name}: Python allocations grew {py_growth / MB:.2f} MB"
    assert rss_growth < 4 * MB, f"{name}: RSS grew {rss_growth / MB:.2f} MB"


def test_per_sample_grads_memory_is_flat():
    _check_flat("vmap(grad(functional_call))", 2000)


@pytest.mark.parametrize("name", ["jacrev", "hessian", "jvp"])
def test_jacobian_memory_is_flat(name):
    _check_flat(name, 600)


@pytest.mark.sweep
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_memory_is_flat_10000_calls(name):
    _check_flat(name, 10_000)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_no_extra_live_tensors(name):
    call = WORKLOADS[name]()
    for _ in range(20):
        call()
    before = _live_tensors()
    for _ in range(200):
        out = call()
    del out
    after = _live_tensors()
    print(f"{name}: live tensors / BatchedTensors before {before}, after {after}")
    assert after[0] <= before[0] and after[1] == 0 and before[1] == 0, (before, after)


def _refcount_freed(make_call):
    """Run calls with the cycle collector off: every weakref to an input, intermediate
    BatchedTensor and output must die by reference counting alone."""
    refs = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(20):
            out = make_call(refs)
            flat = out if isinstance(out, (tuple, list)) else [out]
            for o in flat:
                if isinstance(o, dict):
                    refs.extend(weakref.ref(v) for v in o.values())
                elif isinstance(o, torch.Tensor):
                    refs.append(weakref.ref(o))
            del out, flat, o
        alive = [r() for r in refs if r() is not None]
        return len(refs), alive
    finally:
        gc.enable()


def _vmap_grad_capturing(refs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    refs.extend(weakref.ref(t) for t in (x, y, *params.values()))

    def loss(p, xi, yi):
        out = ft.functional_call(model, p, (xi,))
        refs.extend(weakref.ref(t) for t in (xi, out, *p.values()))
        return ((out - yi) ** 2).sum()
    return ft.vmap(ft.grad(loss), in_dims=(None, 0, 0))(params, x, y)


def _jacrev_capturing(refs):
    w = torch.randn(4, 3)
    x = torch.randn(4)
    refs.extend([weakref.ref(w), weakref.ref(x)])

    def f(a):
        h = torch.tanh(a @ w)
        refs.append(weakref.ref(h))
        return h
    return ft.jacrev(f)(x)


def _vmap_capturing(refs):
    x = torch.randn(8, 5)
    refs.append(weakref.ref(x))

    def f(a):
        h = a.sin() * a
        refs.extend([weakref.ref(a), weakref.ref(h)])
        return h.sum()
    return ft.vmap(f, chunk_size=3)(x)


def _failing_capturing(refs):
    x = torch.randn(8, 5)
    refs.append(weakref.ref(x))

    def f(a):
        h = a.sin()
        refs.extend([weakref.ref(a), weakref.ref(h)])
        raise ValueError("on purpose")
    try:
        ft.vmap(ft.grad(lambda a: f(a).sum()))(x)
    except ValueError:
        pass
    return torch.zeros(1)


@pytest.mark.parametrize("make_call", [_vmap_grad_capturing, _jacrev_capturing, _vmap_capturing,
                                       _failing_capturing],
                         ids=["vmap(grad(functional_call))", "jacrev", "vmap chunked",
                              "failing vmap(grad)"])
def test_tensors_freed_by_refcounting(make_call):
    n, alive = _refcount_freed(make_call)
    assert n > 0
    assert not alive, f"{len(alive)} of {n} tensors outlived their call without the cycle " \
                      f"collector: {[type(t).__name__ + str(tuple(t.shape)) for t in alive[:5]]}"
    assert not any(isinstance(t, BatchedTensor) for t in alive)


def test_no_cycles_hold_tensors():
    """With DEBUG_SAVEALL, whatever the collector finds unreachable after many calls stays in
    gc.garbage: no tensor may be there."""
    calls = [WORKLOADS[k]() for k in WORKLOADS]
    for c in calls:
        c()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(50):
            for c in calls:
                c()
        gc.collect()
        tensors = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
        n_garbage = len(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not tensors, f"{len(tensors)} tensors were only freed by the cycle collector " \
                        f"({n_garbage} objects in cycles)"


def test_hessian_result_holds_no_graph():
    x = torch.randn(4)
    assert not torch.func.hessian(lambda a: torch.sin(a).sum())(x).requires_grad
    h = ft.hessian(lambda a: torch.sin(a).sum())(x)
    assert not h.requires_grad and h.grad_fn is None
