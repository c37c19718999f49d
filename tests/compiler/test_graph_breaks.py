"""Graph breaks (compiler/breaks.py): a value read into Python (``.item()``, ``bool()``, an
``if`` on a tensor) or a data-dependent size (``nonzero``) ends one segment of the traced graph;
the value read is guarded, and a call that reads another value runs the graph traced for that
value (or traces one: that trace is the eager call).  Every call is compared with the eager
function (and torch.func where it is the same computation); random draws and in-place writes
are compared through the generator's state and the written tensors."""
import os
import warnings

import pytest
import torch
import torch.func

import functrans as ft
from functrans import CompileWarning, UntraceableError

THIS_FILE = os.path.basename(__file__)


@pytest.fixture(autouse=True, params=["whole", "segments"])
def _runner(request, monkeypatch):
    """Each test twice: a graph with breaks replayed whole, guards inline (its first calls), and
    segment by segment (breaks.Segmented once the graph is hot: here from the first call)."""
    from functrans.compiler import breaks
    if request.param == "segments":
        monkeypatch.setattr(breaks, "WHOLE_CALLS", 0)
        monkeypatch.setattr(breaks, "WHOLE_SECONDS", 0.0)
    return request.param


def _line(fn, offset):
    return f"{THIS_FILE}:{fn.__code__.co_firstlineno + offset}"


def _no_compile_warnings(caught):
    assert not [w for w in caught if issubclass(w.category, CompileWarning)], \
        [str(w.message) for w in caught]


def test_branch_flipping_between_calls():
    def f(x):
        y = x.sin()
        if y.sum() > 0:
            return y * 2
        return y.cos() - 1
    compiled = ft.compile(f)
    pos, neg = torch.rand(4) + 0.5, -torch.rand(4) - 0.5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in (pos, neg, pos, pos, neg, neg, pos):
            torch.testing.assert_close(compiled(x), f(x))
    _no_compile_warnings(caught)
    info = compiled.cache_info()
    assert (info.misses, info.hits, info.eager_calls) == (2, 5, 0), info
    assert info.read_changes >= 2, info      # flips that ran the other variant
    assert len(info.entries) == 2 and all(e.segments == 2 for e in info.entries)
    values = sorted(e.breaks[0].rsplit(" read ", 1)[1] for e in info.entries)
    assert values == ["False", "True"], info
    assert all(_line(f, 2) in e.breaks[0] for e in info.entries), info
    assert "2 segments" in str(info) and "read True" in str(info)


def test_several_reads_in_sequence():
    def f(x, y):
        out = x * 1
        if x.sum() > 0:
            out = out + y
        if (out * y).sum() > 0:         # depends on the first branch
            out = out * 3
        n = int((out > 0).sum())        # an int read
        return out / (n + 1)
    compiled = ft.compile(f)
    g = torch.Generator().manual_seed(1)
    inputs = [(torch.randn(5, generator=g), torch.randn(5, generator=g)) for _ in range(12)]
    for x, y in inputs + inputs[::-1]:
        torch.testing.assert_close(compiled(x, y), f(x, y))
    info = compiled.cache_info()
    assert info.eager_calls == 0 and info.eager_reason is None, info
    assert all(e.segments == 4 for e in info.entries), info
    assert info.hits >= 12, info        # the second pass finds a graph for every input


def test_item_in_a_training_step_with_grad():
    def loss(w, x, y):
        return ((torch.tanh(x @ w) - y) ** 2).mean()

    def step(w, x, y):
        value = loss(w, x, y)
        g = ft.grad(loss)(w, x, y)
        if value.item() > 0.5:          # a larger step on a large loss
            return w - 0.5 * g, value.item()
        return w - 0.1 * g, value.item()

    def reference(w, x, y):
        value = loss(w, x, y)
        g = torch.func.grad(loss)(w, x, y)
        return (w - (0.5 if value.item() > 0.5 else 0.1) * g), value.item()
    compiled = ft.compile(step, cache_size=16)
    w = torch.randn(4, 2)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    for scale in (1.0, 1.0, 0.01, 1.0, 0.01):
        got, want = compiled(w, x * scale, y * scale), reference(w, x * scale, y * scale)
        torch.testing.assert_close(got[0], want[0])
        assert got[1] == want[1]
    info = compiled.cache_info()
    assert info.eager_calls == 0 and len(info.entries) == 2, info
    assert all(e.segments == 3 for e in info.entries), info    # two reads of value


def test_unbatched_item_of_a_hyperparameter_inside_vmap_grad():
    scale = torch.tensor(2.0)

    def loss(w, x):
        return (x @ w).pow(2).sum() * scale.item()     # unbatched: read once, guarded
    compiled = ft.compile(ft.vmap(ft.grad(loss), in_dims=(None, 0)))
    w, xs = torch.randn(3), torch.randn(6, 3)
    expected = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))
    torch.testing.assert_close(compiled(w, xs), expected(w, xs))
    torch.testing.assert_close(compiled(w, xs), expected(w, xs))
    scale.fill_(-0.5)                   # updated in place: the guard sees the new value
    torch.testing.assert_close(compiled(w, xs), expected(w, xs))
    scale.fill_(2.0)
    torch.testing.assert_close(compiled(w, xs), expected(w, xs))
    info = compiled.cache_info()
    assert (info.misses, info.hits, info.eager_calls) == (2, 2, 0), info
    assert all(e.segments == 2 and _line(loss, 1) in e.breaks[0] for e in info.entries), info


def test_bool_of_a_batched_tensor_under_vmap_is_still_refused():
    def f(x):
        return x * 2 if x.sum() > 0 else x
    compiled = ft.compile(ft.vmap(f))
    with pytest.raises(Exception) as eager:
        ft.vmap(f)(torch.randn(3, 2))
    with pytest.raises(type(eager.value)):
        compiled(torch.randn(3, 2))


def test_nonzero_masking():
    def f(x, w):
        idx = torch.nonzero(x > 0).squeeze(1)
        picked = x[idx] * w[idx]
        return picked.sum() + torch.masked_select(x, x < 0).sum(), picked
    compiled = ft.compile(f)
    w = torch.randn(6)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(6, generator=g) for _ in range(5)]
    for x in xs + xs:
        got, want = compiled(x, w), f(x, w)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
    info = compiled.cache_info()
    assert info.eager_calls == 0 and info.hits >= 5, info
    assert any("nonzero" in b for e in info.entries for b in e.breaks), info
    assert any("masked_select" in b for e in info.entries for b in e.breaks), info


def test_random_draws_before_and_after_a_break_match_eager():
    def f(x):
        noise = torch.rand(3)                        # before the break
        if (x + noise).sum() > 1.5:
            return x * torch.rand(3)                 # after it, in one branch
        return x - torch.randn(3) * 0.1
    compiled = ft.compile(f)
    x = torch.zeros(3)                               # the branch flips with the noise
    for seed in range(12):
        torch.manual_seed(seed)
        want, after_eager = f(x), torch.rand(2)
        torch.manual_seed(seed)
        got, after_compiled = compiled(x), torch.rand(2)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(after_compiled, after_eager)   # the same draws, once
    info = compiled.cache_info()
    assert info.eager_calls == 0 and len(info.entries) == 2 and info.read_changes >= 1, info


def test_write_after_a_break_is_applied_once():
    w = torch.zeros(3)

    def step(x):
        positive = (x > 0).sum()
        loss = (x * (w + 1)).sum()
        if loss > 0:
            w.sub_(0.1 * x)             # written after the read: a failed guard wrote nothing
        else:
            w.add_(0.1)
        return loss, int(positive)   # read after the write, checked before it (hoisted)
    compiled = ft.compile(step)
    w_eager = w.clone()

    def eager(x):
        nonlocal w
        saved, w_ref = w, w_eager
        w = w_ref
        try:
            return step(x)
        finally:
            w = saved
    xs = [torch.ones(3), -torch.ones(3), torch.ones(3) * 2, -torch.ones(3)]
    for x in xs + xs:
        got, want = compiled(x), eager(x)
        torch.testing.assert_close(got[0], want[0])
        assert got[1] == want[1]
        torch.testing.assert_close(w, w_eager)
    info = compiled.cache_info()
    assert info.eager_reason is None and info.eager_calls == 0, info
    assert all(e.segments == 3 for e in info.entries) and info.hits >= 4, info


def test_write_before_a_break_runs_eagerly_with_the_reason():
    def f(x):
        x.mul_(2)
        if x.sum() > 0:
            return x + 1
        return x - 1
    compiled = ft.compile(f)
    a, b = torch.ones(3), torch.ones(3)
    with pytest.warns(CompileWarning, match="before it reads a value"):
        compiled(a)
    f(b)
    torch.testing.assert_close(a, b)                 # written once
    torch.testing.assert_close(compiled(-a), f(-b))
    info = compiled.cache_info()
    assert "could not undo the write" in info.eager_reason and _line(f, 2) in info.eager_reason
    with pytest.raises(UntraceableError):
        ft.compile(f, strict=True)(torch.ones(3))


def test_a_generator_drawn_before_a_break_runs_eagerly():
    gen = torch.Generator().manual_seed(0)

    def f(x):
        noise = torch.rand(3, generator=gen)     # its state could not be put back
        return x + noise if noise.sum() > 1.5 else x - noise
    compiled = ft.compile(f)
    with pytest.warns(CompileWarning, match="Generator"):   # (torch 2.11: make_fx refuses it)
        compiled(torch.zeros(3))
    assert "Generator" in compiled.cache_info().eager_reason


@pytest.mark.parametrize("cache_size, why", [
    (3, "cache_size"),            # the cache is full first
    (8, "took 4 values"),         # a new float every call: not worth a graph each
])
def test_a_float_read_that_changes_every_call_runs_eagerly(cache_size, why):
    def f(x):
        return x * x.sum().item()
    compiled = ft.compile(f, cache_size=cache_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(6):
            x = torch.full((2,), float(i))
            torch.testing.assert_close(compiled(x), f(x))
    warned = [str(w.message) for w in caught if issubclass(w.category, CompileWarning)]
    assert len(warned) == 1 and why in warned[0], warned
    info = compiled.cache_info()
    assert (info.misses, info.eager_calls) == (3, 3), info
    assert why in info.eager_reason and _line(f, 1) in info.eager_reason


def test_int_reads_take_a_graph_each_up_to_cache_size():
    def f(x):
        return torch.zeros(int((x > 0).sum())) + x.sum()   # the size is the value read
    compiled = ft.compile(f)
    xs = [torch.tensor([1.0, -1, -1, -1]), torch.tensor([1.0, 1, -1, -1]),
          torch.tensor([1.0, 1, 1, -1]), torch.tensor([1.0, 1, 1, 1])]
    for x in xs + xs:
        torch.testing.assert_close(compiled(x), f(x))
    info = compiled.cache_info()
    assert (info.misses, info.hits, info.eager_calls) == (4, 4, 0), info


@pytest.mark.parametrize("backend", ["replay", "inductor", "tiered"])
def test_backends_replay_graphs_with_breaks(backend):
    def f(x):
        return x.exp() if x.mean() > 0 else x.tanh()
    compiled = ft.compile(f, backend=backend)
    for x in (torch.ones(3), -torch.ones(3), torch.ones(3)):
        torch.testing.assert_close(compiled(x), f(x))
    info = compiled.cache_info()
    assert [e.backend for e in info.entries] == ["replay", "replay"], info
    if backend == "inductor":
        assert all("guard at each break" in e.notes[0] for e in info.entries), info
    if backend == "tiered":
        assert all("each segment replayed" in e.notes[0] for e in info.entries), info
        assert all(e.tier.startswith(("segments: replay", "replayed whole until hot"))
                   for e in info.entries), info


def test_tiered_segments_move_to_inductor_on_their_own(monkeypatch, _runner):
    from functrans.compiler import tiering
    if _runner == "whole":
        pytest.skip("the segments run from the first call here")
    monkeypatch.setattr(tiering, "HOT_CALLS", 3)
    monkeypatch.setattr(tiering, "HOT_SECONDS", 0.0)
    monkeypatch.setattr(tiering, "TRIAL_CALLS", 2)
    monkeypatch.setattr(tiering, "TRIAL_SECONDS", 0.0)
    w = torch.randn(4, 3)

    def loss(w, x, y):
        return ((torch.tanh(x @ w) - y) ** 2).sum()

    def step(w, x, y):
        g = ft.vmap(ft.grad(loss), in_dims=(None, 0, 0))(w, x, y)
        if y.sum() > 0:             # a break between two segments of work
            return torch.sin(g).sum(0)
        return torch.cos(g).sum(0)
    compiled = ft.compile(step)
    x, y = torch.randn(5, 4), torch.rand(5, 3)
    for _ in range(5):
        torch.testing.assert_close(compiled(w, x, y), step(w, x, y))
    assert compiled.wait(timeout=300)
    monkeypatch.setattr(tiering.time, "perf_counter", lambda: 0.0)   # trials measure as instant
    for _ in range(2 * tiering.TRIAL_CALLS + 4):    # the check, then the alternating trial
        torch.testing.assert_close(compiled(w, x, y), step(w, x, y))
    monkeypatch.undo()
    torch.testing.assert_close(compiled(w, x, -y), step(w, x, -y))  # the other branch: traced
    info = compiled.cache_info()
    assert "inductor" in info.entries[0].tier and info.entries[0].segments == 2, info
    assert info.entries[0].backend in ("inductor", "replay+inductor"), info
    assert info.eager_calls == 0, info


def test_breaks_with_dynamic_sizes():
    def f(x):
        return x * 2 if x.sum() > 0 else x - 1
    compiled = ft.compile(f, dynamic=True)
    for n in (3, 5, 3, 7):
        for x in (torch.ones(n), -torch.ones(n)):
            torch.testing.assert_close(compiled(x), f(x))
    assert compiled.cache_info().eager_calls == 0


def test_outputs_keep_autograd_across_a_break():
    def f(w, x):
        y = x @ w
        return y.tanh() if y.sum() > 0 else y.sigmoid()
    compiled = ft.compile(f)
    for sign in (1.0, -1.0, 1.0):
        w = torch.randn(3, 2, requires_grad=True)
        x = torch.ones(4, 3) * sign
        w.data = w.data.abs()
        out = compiled(w, x)
        (gw,) = torch.autograd.grad(out.sum(), w)
        w2 = w.detach().clone().requires_grad_()
        (gw2,) = torch.autograd.grad(f(w2, x).sum(), w2)
        torch.testing.assert_close(gw, gw2)


def test_explain_shows_the_segments():
    def f(x):
        if x.sum() > 0:
            return x.sin()
        return x.cos()
    text = str(ft.explain(f, torch.ones(3)))
    assert "2 segments" in text and _line(f, 1) in text and "read True" in text
    assert "read_guard" in text


def test_a_write_into_a_value_made_before_the_break(_runner):
    def f(x):
        y = x * 2
        view = y[1:]
        if x.sum() > 0:
            view.add_(1)            # the segment after the break writes into y through a view
        return y
    compiled = ft.compile(f)
    for x in (torch.ones(3), -torch.ones(3), torch.ones(3), -torch.ones(3)):
        torch.testing.assert_close(compiled(x), f(x))
    info = compiled.cache_info()
    assert info.eager_calls == 0 and info.hits == 2, info
    if _runner == "segments":
        assert any("writes into a value of an earlier segment" in e.tier
                   for e in info.entries), info


def test_tolist_of_a_few_values_is_a_break_on_all_of_them():
    def f(x):
        signs = (x > 0).long().tolist()
        return x * sum(signs), torch.tensor(signs)
    compiled = ft.compile(f, strict=True)
    xs = [torch.ones(3), -torch.ones(3), torch.tensor([1.0, -1, 1]), torch.ones(3) * 2]
    for x in xs + xs:
        for got, want in zip(compiled(x), f(x)):
            torch.testing.assert_close(got, want)
    info = compiled.cache_info()
    assert (info.misses, info.hits, info.eager_calls) == (3, 5, 0), info
    assert all(".tolist()" in e.breaks[0] for e in info.entries), info
