"""The default backend "tiered" (functrans/compiler/tiering.py): replay at once, Inductor in the
background once a graph is hot, swapped in only when ready, equal and faster; no call waits.
Every answer is compared with torch.func.  The rest of the suite runs with tiering held back
(tests/conftest.py); these tests lower the threshold."""
import threading
import time

import pytest
import torch
import torch.func

import functrans
from functrans.compiler import backends, tiering


def loss(w, x, y):
    return ((torch.tanh(x @ w) - y) ** 2).sum()


@pytest.fixture
def hot_soon(monkeypatch):
    monkeypatch.setattr(tiering, "HOT_CALLS", 3)
    monkeypatch.setattr(tiering, "HOT_SECONDS", 0.0)
    monkeypatch.setattr(tiering, "TRIAL_SECONDS", 0.0)   # the trial's count of calls decides


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=g), torch.randn(6, 8, generator=g), \
        torch.randn(6, 4, generator=g)


def _run(compiled, calls):
    reference = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))
    for i in range(calls):
        w, x, y = _data(i)
        torch.testing.assert_close(compiled(w, x, y), reference(w, x, y))


def _compiled():
    return functrans.compile(functrans.vmap(functrans.grad(loss), in_dims=(None, 0, 0)))


def test_hot_graph_moves_to_inductor_when_faster(hot_soon, monkeypatch):
    monkeypatch.setattr(tiering, "TRIAL_CALLS", 2)
    monkeypatch.setattr(tiering, "HOT_MANY_CALLS", 10**9)
    compiled = _compiled()
    assert compiled.backend == "tiered"
    _run(compiled, 5)
    assert compiled.wait(timeout=300)
    # the trial measured as instant, so the choice does not hang on this machine's timing
    monkeypatch.setattr(tiering.time, "perf_counter", lambda: 0.0)
    _run(compiled, 8)
    monkeypatch.undo()
    info = compiled.cache_info()
    assert [e.backend for e in info.entries] == ["inductor"], str(info)
    assert "compiled by Inductor in the background" in info.entries[0].tier, str(info)
    assert "tier: inductor" in str(info)
    _run(compiled, 3)                            # served by Inductor's graph now
    assert compiled.cache_info().misses == 1


def _with_build(monkeypatch, build):
    monkeypatch.setattr(backends, "build_inductor_from", build)


def test_inductor_failure_keeps_replay(hot_soon, monkeypatch):
    def fails(gm, inputs):
        raise RuntimeError("no C++ compiler here")
    _with_build(monkeypatch, fails)
    compiled = _compiled()
    _run(compiled, 5)
    assert compiled.wait(timeout=60)
    _run(compiled, 3)
    entry = compiled.cache_info().entries[0]
    assert entry.backend == "replay" and "Inductor failed (RuntimeError: no C++ compiler here)" \
        in entry.tier, entry


def test_slower_compiled_graph_keeps_replay(hot_soon, monkeypatch):
    def slow(gm, inputs):
        replay = backends.replay.build(gm, keep_autograd=True)

        def run(tensors):
            time.sleep(0.02)
            return replay(tensors)
        return run
    _with_build(monkeypatch, slow)
    compiled = _compiled()
    _run(compiled, 5)
    assert compiled.wait(timeout=60)
    _run(compiled, 2 * tiering.TRIAL_CALLS + 4)
    entry = compiled.cache_info().entries[0]
    assert entry.backend == "replay" and "slower when measured" in entry.tier, entry


def test_compiled_graph_with_another_answer_is_never_used(hot_soon, monkeypatch):
    def wrong(gm, inputs):
        replay = backends.replay.build(gm, keep_autograd=True)
        return lambda tensors: [t + 1 for t in replay(tensors)]
    _with_build(monkeypatch, wrong)
    compiled = _compiled()
    _run(compiled, 5)
    assert compiled.wait(timeout=60)
    _run(compiled, 6)                            # every answer still torch.func's
    entry = compiled.cache_info().entries[0]
    assert entry.backend == "replay" and "another answer" in entry.tier, entry


def test_no_call_waits_for_the_compiler(hot_soon, monkeypatch):
    release = threading.Event()

    def blocked(gm, inputs):
        release.wait(30)
        raise RuntimeError("released")
    _with_build(monkeypatch, blocked)
    compiled = _compiled()
    _run(compiled, 4)                            # hot: the compilation is pending now
    assert "compiles in the background" in compiled.cache_info().entries[0].tier
    start = time.perf_counter()
    _run(compiled, 20)
    assert time.perf_counter() - start < 25      # the calls did not wait for the 30 s
    assert not compiled.wait(timeout=0.01)
    release.set()
    assert compiled.wait(timeout=30)


def test_pinned_backends_never_tier(hot_soon):
    compiled = functrans.compile(functrans.vmap(functrans.grad(loss), in_dims=(None, 0, 0)),
                                 backend="replay")
    _run(compiled, 8)
    assert compiled.wait(timeout=0)
    entry = compiled.cache_info().entries[0]
    assert entry.backend == "replay" and entry.tier == ""


def test_trial_times_short_graphs_for_long_enough(monkeypatch):
    """The trial of a short graph runs until each side has TRIAL_SECONDS of timed calls (six
    calls of a 0.4 ms graph were noise: the ensemble row kept the slower tier), and stops at
    TRIAL_MAX_CALLS however short the calls."""
    t = tiering.Tiered(lambda inputs: inputs, torch.fx.symbolic_trace(lambda x: x), None)
    monkeypatch.setattr(tiering, "TRIAL_SECONDS", 0.01)
    t._trial, t._replay_times = [0.0] + [0.001] * 6, [0.0] + [0.001] * 6
    assert not t._trial_done()                   # 6 ms of each: too short
    t._trial += [0.001] * 4
    t._replay_times += [0.001] * 4
    assert t._trial_done()                       # 10 ms of each
    monkeypatch.setattr(tiering, "TRIAL_MAX_CALLS", 8)
    t._trial, t._replay_times = [0.0] + [1e-6] * 8, [0.0] + [1e-6] * 8
    assert t._trial_done()


def test_a_captured_tensor_updated_in_place_is_read_after_the_move_to_inductor(hot_soon,
                                                                                 monkeypatch):
    """The Inductor candidate was built from a deepcopy of the graph module, which copied the
    captured tensors: a weight updated in place (an optimizer step) after the entry moved to
    Inductor was read stale — a wrong answer.  It shares the caller's tensors now."""
    monkeypatch.setattr(tiering, "TRIAL_CALLS", 2)
    monkeypatch.setattr(tiering, "TRIAL_MARGIN", 100.0)     # keep Inductor whatever the timing
    w = torch.randn(3, 3)

    def f(x):
        return torch.tanh(x @ w)
    compiled = functrans.compile(f)
    x = torch.randn(4, 3)
    _run_plain(compiled, x, 4)
    assert compiled.wait(timeout=300)
    _run_plain(compiled, x, 2 * tiering.TRIAL_CALLS + 4)
    assert compiled.cache_info().entries[0].backend == "inductor", compiled.cache_info()
    with torch.no_grad():
        w.mul_(-2)
    torch.testing.assert_close(compiled(x), f(x))
    assert compiled.cache_info().misses == 1


def _run_plain(compiled, x, calls):
    for _ in range(calls):
        compiled(x)
