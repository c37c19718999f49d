"""Thread safety (issue 7, item 3): transforms in 8 concurrent threads give the results of a
sequential run; a failing thread does not disturb the others' level stacks or grad mode."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

import functrans as ft
from functrans import _levels
from tests.support.oracles import assert_same

N_THREADS = 8
ROUNDS = 3
REPEATS = 4


class Boom(Exception):
    pass


def _kinds():
    return [lvl.kind for lvl in _levels.stack()]


def _seeded(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


_model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
_PARAMS = {k: v.detach().clone() for k, v in _model.named_parameters()}


def _jobs():
    """(name, thunk, expected level kinds seen inside the innermost function)."""
    W = _seeded((5, 5), 0)
    jobs = []

    def per_sample_grads():
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))  # own module
        model.load_state_dict(_model.state_dict())

        def loss(p, x, y):
            return ((ft.functional_call(model, p, (x,)) - y) ** 2).sum()
        return ft.vmap(ft.grad(loss), in_dims=(None, 0, 0))(
            _PARAMS, _seeded((17, 4), 1), _seeded((17, 2), 2))
    jobs.append(("vmap(grad(functional_call))", per_sample_grads, None))

    def chunked():
        def f(x):
            assert _kinds() == ["vmap"], _kinds()
            return torch.tanh(W @ x).softmax(0)
        return ft.vmap(f, chunk_size=3)(_seeded((10, 5), 3))
    jobs.append(("vmap chunk_size=3", chunked, None))

    def nested():
        def f(x, y):
            assert _kinds() == ["vmap", "vmap"], _kinds()
            return torch.dot(x, y)
        return ft.vmap(ft.vmap(f), in_dims=(0, None))(_seeded((3, 7, 5), 4), _seeded((7, 5), 5))
    jobs.append(("vmap(vmap)", nested, None))

    def jac():
        def f(x):
            assert _kinds()[0] == "grad", _kinds()
            return torch.sin(W @ x) * x
        return ft.jacrev(f, chunk_size=2)(_seeded(5, 6))
    jobs.append(("jacrev chunk_size=2", jac, None))

    def grad_of_vmap():
        def f(x):
            assert _kinds() == ["grad", "vmap"], _kinds()
            return (x.sin() * x).sum()
        return ft.grad(lambda a: ft.vmap(f)(a).sum())(_seeded((9, 5), 7))
    jobs.append(("grad(vmap)", grad_of_vmap, None))

    def vmap_vjp():
        out, fn = ft.vjp(lambda x: torch.tanh(W @ x), _seeded(5, 8))
        return out, ft.vmap(fn)(torch.eye(5))
    jobs.append(("vmap(vjp_fn)", vmap_vjp, None))

    def failing():
        def f(x):
            assert _kinds() == ["vmap", "grad"], _kinds()
            if torch.is_grad_enabled():
                raise Boom("on purpose")
            return x.sum()
        return ft.vmap(ft.grad(f))(_seeded((6, 5), 9))
    jobs.append(("failing vmap(grad)", failing, Boom))

    def no_grad_vmap():
        with torch.no_grad():
            out = ft.vmap(lambda x: (x @ W).relu())(_seeded((11, 5), 10))
            assert not torch.is_grad_enabled()
        return out
    jobs.append(("vmap under no_grad", no_grad_vmap, None))
    assert len(jobs) == N_THREADS
    return jobs


def _run_job(thunk, raises):
    if raises is not None:
        with pytest.raises(raises):
            thunk()
        return "raised"
    return thunk()


def _concurrently(jobs, rounds=ROUNDS, repeats=REPEATS):
    """Every job in its own thread, started together by a barrier; each repeats its call."""
    barrier = threading.Barrier(len(jobs))

    def worker(job):
        name, thunk, raises = job
        barrier.wait(timeout=60)
        out = []
        for _ in range(repeats):
            assert _levels.stack() == [], f"{name}: stack not empty before a call"
            grad_mode = torch.is_grad_enabled()
            out.append(_run_job(thunk, raises))
            assert _levels.stack() == [], f"{name}: levels leaked: {_levels.stack()}"
            assert torch.is_grad_enabled() == grad_mode, f"{name}: grad mode changed"
        return out

    results = []
    with ThreadPoolExecutor(len(jobs)) as pool:
        for _ in range(rounds):
            results.append(list(pool.map(worker, jobs)))
    return results


def test_concurrent_transforms_match_sequential_results():
    jobs = _jobs()
    expected = [_run_job(thunk, raises) for _, thunk, raises in jobs]   # sequential reference
    for rnd in _concurrently(jobs):
        for (name, _, _), exp, outs in zip(jobs, expected, rnd):
            for got in outs:
                assert_same(got, exp, msg=f"{name} in a thread", rtol=1e-6, atol=1e-6)
    assert _levels.stack() == []


def test_exception_in_one_thread_does_not_disturb_another():
    """Thread A fails again and again inside vmap(grad) while thread B is inside a deep stack of
    transforms; B's stack is exactly its own all along."""
    stop = threading.Event()
    b_inside = threading.Event()
    seen = []

    def thread_a():
        b_inside.wait(10)
        n = 0
        while not stop.is_set() and n < 200:
            with pytest.raises(Boom):
                ft.vmap(ft.grad(lambda x: (_ for _ in ()).throw(Boom())))(torch.randn(3, 2))
            assert _levels.stack() == []
            n += 1
        return n

    def thread_b():
        def inner(x):
            b_inside.set()
            for _ in range(50):
                seen.append(_kinds())
                x = torch.sin(x) + 0.1
            return x.sum()
        g = ft.grad(lambda y: ft.vmap(inner)(y.expand(2, 3)).sum())
        out = ft.vmap(ft.grad(lambda x: g(x).sum()))(torch.randn(4, 3))
        stop.set()
        return out

    with ThreadPoolExecutor(2) as pool:
        fa, fb = pool.submit(thread_a), pool.submit(thread_b)
        assert fa.result(timeout=60) > 0
        fb.result(timeout=60)
    assert seen and all(k == ["vmap", "grad", "grad", "vmap"] for k in seen), set(map(tuple, seen))


def test_grad_mode_is_per_thread():
    barrier = threading.Barrier(2)

    def off():
        with torch.no_grad():
            barrier.wait(10)
            for _ in range(20):
                ft.vmap(ft.grad(lambda x: x.sin().sum()))(torch.randn(3, 2))
                assert not torch.is_grad_enabled()

    def on():
        barrier.wait(10)
        for _ in range(20):
            g = ft.grad(lambda x: ft.vmap(torch.sin)(x).sum())(torch.randn(3, 2))
            assert torch.is_grad_enabled() and not g.requires_grad

    with ThreadPoolExecutor(2) as pool:
        for fut in [pool.submit(off), pool.submit(on)]:
            fut.result(timeout=60)


def test_forward_mode_in_one_thread_does_not_refuse_vmap_in_another():
    inside, done = threading.Event(), threading.Event()

    def jvp_thread():
        def f(x):
            inside.set()
            done.wait(10)
            return x.sin()
        return ft.jvp(f, (torch.zeros(3),), (torch.ones(3),))

    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(jvp_thread)
        try:
            assert inside.wait(10)
            x = torch.randn(4, 3)
            assert_same(ft.vmap(torch.sin)(x), x.sin())
            assert_same(ft.jacfwd(torch.sin)(x[0]), torch.diag(x[0].cos()))
        finally:
            done.set()
            _, t = fut.result(timeout=30)
    assert_same(t, torch.ones(3))


def test_functional_call_on_a_shared_module():
    """Two threads call functional_call on one module, interleaved on purpose: each computes
    with its own tensors and the module ends with its own (a per-module lock serialises them;
    torch.func has no such lock)."""
    role = threading.local()
    a_inside, b_inside, a_done = threading.Event(), threading.Event(), threading.Event()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(3, 3), nn.Linear(3, 2)

        def forward(self, x):
            h = self.l1(x)
            if getattr(role, "name", None) == "a":
                a_inside.set()
                b_inside.wait(1)         # B swaps its parameters in now (if it can)
            elif getattr(role, "name", None) == "b":
                b_inside.set()
                a_done.wait(1)           # A finishes and restores while B is mid-forward
            return self.l2(h)

    model = Net()
    originals = dict(model.named_parameters())
    pa = {k: torch.randn_like(v) for k, v in originals.items()}
    pb = {k: torch.randn_like(v) for k, v in originals.items()}
    x = torch.randn(5, 3)
    exp_a, exp_b = (torch.func.functional_call(model, p, (x,)) for p in (pa, pb))

    def run(name, params):
        role.name = name
        try:
            return ft.functional_call(model, params, (x,))
        finally:
            if name == "a":
                a_done.set()

    with ThreadPoolExecutor(2) as pool:
        fa = pool.submit(run, "a", pa)
        a_inside.wait(10)
        fb = pool.submit(run, "b", pb)
        got_a, got_b = fa.result(timeout=30), fb.result(timeout=30)
    after = dict(model.named_parameters())
    assert all(after[k] is originals[k] for k in originals), "module left with swapped tensors"
    assert_same(got_a, exp_a)
    assert_same(got_b, exp_b)
