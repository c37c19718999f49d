"""``chunk_size="auto"`` (functrans/batching/chunking.py): the same results as no chunking and
as fixed chunks (vmap, jacrev, jacfwd, hessian, an Ensemble; nested), a chunk that shrinks with
``functrans.config.max_memory`` and whose measured peak fits it, the fallback when the fake
trace fails, the errors for bad values, and the budget's context manager."""
import pytest
import torch

import functrans as ft
from functrans import config
from functrans.batching import chunking
from functrans.errors import TransformArgumentError

torch.manual_seed(0)
W = torch.randn(16, 16) / 4
B = torch.randn(16)


def f(x):
    return torch.tanh(W @ x + B) * x.sin()


def loss(x):
    return (torch.tanh(W @ x) ** 2).sum()


def assert_same(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("limit", [2048, 2 ** 30])
def test_vmap_jacrev_jacfwd_hessian_equal_unchunked_and_fixed(limit):
    x, xs = torch.randn(16), torch.randn(20, 16)
    with config.max_memory(limit), chunking.recording() as seen:
        assert_same(ft.vmap(f, chunk_size="auto")(xs), ft.vmap(f)(xs))
        assert_same(ft.vmap(f, chunk_size="auto")(xs), ft.vmap(f, chunk_size=3)(xs))
        assert_same(ft.jacrev(f, chunk_size="auto")(x), ft.jacrev(f)(x))
        assert_same(ft.jacrev(f, chunk_size="auto")(x), ft.jacrev(f, chunk_size=5)(x))
        assert_same(ft.jacfwd(f, chunk_size="auto")(x), ft.jacfwd(f, chunk_size=7)(x))
        assert_same(ft.hessian(loss, chunk_size="auto")(x), ft.hessian(loss)(x))
        assert_same(ft.hessian(loss, chunk_size="auto")(x), ft.hessian(loss, chunk_size=4)(x))
    chunked = {c.api.split("(")[0] + str(c.batch_size) for c in seen if c.chunk_size}
    # 2 KB: vmap's 20 examples, jacrev's and jacfwd's 16 basis vectors run in chunks
    assert chunked == ({"vmap20", "vmap16"} if limit == 2048 else set())
    assert not any(c.fell_back and "another vmap" not in c.reason for c in seen)


def test_nested_auto_equals_unchunked():
    xs = torch.randn(6, 16)
    with config.max_memory(4096), chunking.recording() as seen:
        inner = ft.vmap(ft.jacrev(f, chunk_size="auto"))(xs)
        outer = ft.vmap(ft.jacfwd(f), chunk_size="auto")(xs)
        both = ft.vmap(ft.vmap(f, chunk_size="auto"), chunk_size="auto", in_dims=1)(
            xs.T.reshape(16, 6, 1).expand(16, 6, 16).contiguous())
    want = ft.vmap(ft.jacrev(f))(xs)
    assert_same(inner, want)
    assert_same(outer, want)
    assert_same(both, ft.vmap(ft.vmap(f), in_dims=1)(
        xs.T.reshape(16, 6, 1).expand(16, 6, 16).contiguous()))
    # the inner auto of vmap(jacrev(...)) runs unchunked, and says why; the outer one measures
    nested = [c for c in seen if c.fell_back]
    assert nested and all("inside another vmap" in c.reason and c.chunk_size is None
                          for c in nested)
    assert any(not c.fell_back and c.chunk_size is not None for c in seen)


def test_grad_through_auto_chunks():
    x = torch.randn(16)
    with config.max_memory(2048):
        got = ft.grad(lambda x: ft.jacrev(f, chunk_size="auto")(x).sum())(x)
    assert chunking.last_choice().chunk_size is not None
    assert_same(got, ft.grad(lambda x: ft.jacrev(f)(x).sum())(x))


def test_ensemble_takes_auto():
    models = [torch.nn.Linear(4, 3) for _ in range(5)]
    x = torch.randn(2, 4)
    with config.max_memory(64):
        got = ft.Ensemble(models, chunk_size="auto")(x)
    assert_same(got, ft.Ensemble(models)(x))


def test_compiled_auto_chunks_in_the_graph():
    """functrans.compile traces the chosen chunk: the probes stay out of the graph."""
    x = torch.randn(16)
    with config.max_memory(1024):
        fn = ft.compile(ft.jacrev(f, chunk_size="auto"), backend="replay")
        got = fn(x)
        assert_same(fn(x), got)
    info = fn.cache_info()
    assert info.eager_calls == 0 and info.misses == 1 and info.hits == 1
    assert chunking.last_choice().chunk_size is not None
    assert_same(got, ft.jacrev(f)(x))


def test_chunk_shrinks_with_the_budget_and_its_measured_peak_fits():
    xs = torch.randn(64, 16)
    chunks = []
    for limit in (2 ** 30, 64 * 1024, 16 * 1024, 4 * 1024):
        with config.max_memory(limit), chunking.recording() as seen:
            ft.vmap(f, chunk_size="auto")(xs)
        (choice,) = seen
        assert choice is chunking.last_choice() and choice.budget == limit
        assert choice.peak_bytes > 0 and not choice.fell_back
        if choice.chunk_size is not None:
            assert choice.chunk_peak_bytes <= choice.estimated_peak_bytes
            assert choice.estimated_peak_bytes <= limit or choice.chunk_size == 1 or \
                2 * choice.result_bytes > limit
            assert choice.per_example_bytes > 0
        chunks.append(choice.chunk_size or 64)
    assert chunks[0] == 64 and chunks == sorted(chunks, reverse=True) and chunks[-1] < chunks[1]


def test_choices_are_cached_per_call_signature(monkeypatch):
    """A second call with the same shapes and budget takes the first call's chunk without
    probing; another budget or another shape probes again (vmap's cache and jacrev's)."""
    calls = []
    measure = chunking.measure
    monkeypatch.setattr(chunking, "measure", lambda *a: calls.append(a[-1]) or measure(*a))
    xs = torch.randn(32, 16)
    vg, jg = ft.vmap(f, chunk_size="auto"), ft.jacrev(f, chunk_size="auto")
    for fn, arg in ((vg, xs), (jg, xs[0])):
        with config.max_memory(2048):
            want = fn(arg)
            first = chunking.last_choice()
            calls.clear()
            assert_same(fn(arg), want)
            again = chunking.last_choice()
        assert again.reason == first.reason + " (cached)" and again.chunk_size == first.chunk_size
        assert first.chunk_size is not None and len(calls) == 0      # no probe
        with config.max_memory(2 ** 30):
            fn(arg)
        assert not chunking.last_choice().reason.endswith("(cached)")
    with config.max_memory(2048):
        vg(xs[:20])
    assert not chunking.last_choice().reason.endswith("(cached)")


def test_the_count_follows_live_tensors():
    """Peaks that are known exactly: a float32 (n, 100) temporary freed before the next one is
    made counts once; two alive together count twice; a view counts nothing more."""
    def run(args, size):
        x = args[0]
        for _ in range(3):
            y = x * 2                   # 400 * size bytes, freed at the next iteration
        return y.view(-1)
    x = torch.randn(10, 100)
    assert chunking.peak_bytes(run, [x], [0], 10) == 2 * 4000   # y and the next x * 2

    def two(args, size):
        a, b = args[0] + 1, args[0] + 2
        return a, b
    assert chunking.peak_bytes(two, [x], [0], 4) == 2 * 1600


def test_fallback_when_the_fake_trace_fails():
    def data_dependent(x):
        return x * x.sum().item() if x.numel() > 3 else x      # .item() of an unbatched value

    w = torch.ones(5)
    g = lambda x: x + data_dependent(w)
    xs = torch.randn(8, 5)
    with config.max_memory(16):
        got = ft.vmap(g, chunk_size="auto")(xs)
    choice = chunking.last_choice()
    assert choice.fell_back and choice.chunk_size is None
    assert "fake trace failed" in choice.reason and choice.batch_size == 8
    assert_same(got, ft.vmap(g)(xs))


def test_the_probes_leave_the_random_state_alone():
    xs = torch.randn(6, 3)
    torch.manual_seed(1)
    with config.max_memory(64):
        got = ft.vmap(lambda x: x + torch.rand(3), randomness="different", chunk_size="auto")(xs)
    chunk = chunking.last_choice().chunk_size
    torch.manual_seed(1)
    want = ft.vmap(lambda x: x + torch.rand(3), randomness="different", chunk_size=chunk)(xs)
    assert_same(got, want)


@pytest.mark.parametrize("bad", ["Auto", "", 0, -2, 2.5, True])
@pytest.mark.parametrize("api, call", [
    ("vmap", lambda c: ft.vmap(torch.sin, chunk_size=c)),
    ("jacrev", lambda c: ft.jacrev(torch.sin, chunk_size=c)),
    ("jacfwd", lambda c: ft.jacfwd(torch.sin, chunk_size=c)),
    ("hessian", lambda c: ft.hessian(torch.sin, chunk_size=c)),
])
def test_bad_chunk_size_names_the_argument_and_the_accepted_values(api, call, bad):
    with pytest.raises(TransformArgumentError) as e:
        call(bad)
    msg = str(e.value)
    assert msg.startswith(f"{api}(sin") and "chunk_size must be None, a positive int or " \
        "'auto'" in msg and repr(bad) in msg


@pytest.mark.parametrize("bad", [0, -1, 1.5, 0.0, "512MB", True])
def test_bad_memory_limit(bad):
    with pytest.raises(TransformArgumentError, match=r"memory limit must be None .* positive "
                       r"int \(bytes.*float in \(0, 1\]"):
        config.max_memory(bad)
    with pytest.raises(TransformArgumentError, match="functrans.config.memory_limit"):
        config.memory_limit = bad
    assert config.memory_limit is None


def test_max_memory_restores_the_setting_also_on_exceptions():
    assert config.memory_limit_setting() is None
    with pytest.raises(KeyError):
        with config.max_memory(1000):
            with config.max_memory(0.25):
                assert config.memory_limit_setting() == 0.25
            assert config.memory_limit_setting() == 1000
            raise KeyError("inside")
    assert config.memory_limit_setting() is None
    try:
        config.memory_limit = 2 ** 20
        assert chunking.budget(torch.device("cpu")) == 2 ** 20
        with config.max_memory(None):       # None: the default fraction, not the module's
            assert config.memory_limit_setting() is None
        assert config.memory_limit_setting() == 2 ** 20
    finally:
        config.memory_limit = None


def test_default_budget_is_a_fraction_of_free_memory():
    free = chunking.free_memory(torch.device("cpu"))
    assert free > 0
    got = chunking.budget(torch.device("cpu"))
    assert 0.3 * free <= got <= 0.7 * free        # 0.5 of a value read twice (it moves)
    with config.max_memory(0.25):
        assert chunking.budget(torch.device("cpu")) <= 0.35 * free
