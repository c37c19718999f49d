"""functrans.compile: every guard flipped between two calls retraces, gives the eager answer, and
names what changed in ``cache_info().retrace_reasons``; the cache's LRU beyond cache_size."""
import pytest
import torch
import torch.func

import functrans


def _f(x, y):
    return torch.sin(x) * y + (x @ y.T) @ y


def _flip(first_args, second_args, fn=_f, context=None, **compile_kwargs):
    """Call a compiled fn on first_args, then (under context, if given) on second_args; check
    each answer against eager and return the compiled function.  Static sizes: a second size
    would otherwise add a symbolic graph (tested in test_dynamic)."""
    compile_kwargs.setdefault("dynamic", False)
    compiled = functrans.compile(fn, **compile_kwargs)
    torch.testing.assert_close(compiled(*first_args), fn(*first_args))
    torch.testing.assert_close(compiled(*first_args), fn(*first_args))   # a hit
    if context is None:
        out, expected = compiled(*second_args), fn(*second_args)
    else:
        with context():
            out, expected = compiled(*second_args), fn(*second_args)
    torch.testing.assert_close(out, expected)
    info = compiled.cache_info()
    assert info.hits == 1 and info.misses == 2 and len(info.entries) == 2, info
    assert len(info.retrace_reasons) == 1, info
    return compiled, info.retrace_reasons[0], out


def test_pytree_structure_flip():
    def fn(xs):
        return sum(x.cos() for x in xs) if isinstance(xs, (list, tuple)) else \
            xs["a"].cos() + xs["b"].cos()
    a, b = torch.randn(3), torch.randn(3)
    _, reason, _ = _flip(([a, b],), ({"a": a, "b": b},), fn=fn)
    assert "structure" in reason
    _, reason, _ = _flip(([a, b],), ([a, b, a],), fn=fn)
    assert "structure" in reason


def test_shape_flip():
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _, reason, out = _flip((x, y), (torch.randn(5, 4), torch.randn(5, 4)))
    assert "shape (3, 4) -> (5, 4)" in reason
    assert out.shape == (5, 4)


def test_dtype_flip():
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _, reason, out = _flip((x, y), (x.double(), y.double()))
    assert "dtype torch.float32 -> torch.float64" in reason
    assert out.dtype == torch.float64


def test_strides_flip_transposed_input():
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    xt = torch.randn(4, 3).T            # same shape (3, 4), strides (1, 3)
    assert xt.shape == x.shape and xt.stride() != x.stride()
    _, reason, _ = _flip((x, y), (xt, y))
    assert "strides (4, 1) -> (1, 3)" in reason


def test_strides_that_address_nothing_do_not_retrace():
    # a size-1 dim's stride and an empty tensor's strides are not significant (torch's
    # check_significant_strides): linalg.pinv's vjp on a transposed (3, 1) column, then on a
    # contiguous one, retraced and then went symbolic for a difference in nothing
    compiled = functrans.compile(lambda x, y: torch.sin(x) * y, dynamic=False)
    y = torch.randn(3, 1)
    for x in (torch.randn(1, 3).T, torch.randn(3, 1), torch.randn(0, 3).T, torch.randn(3, 0)):
        torch.testing.assert_close(compiled(x, y), torch.sin(x) * y)
    info = compiled.cache_info()
    assert info.misses == 2 and info.hits == 2, info        # one graph per shape
    x = torch.randn(4, 1, 3).permute(2, 1, 0)     # (3, 1, 4): strides (1, 3, 3)
    _, reason, _ = _flip((torch.randn(3, 1, 4), torch.randn(1, 4)), (x, torch.randn(1, 4)),
                         fn=lambda x, y: x * y)
    assert "strides (4, *, 1) -> (1, *, 3)" in reason


def test_strides_flip_keeps_output_layout_of_eager():
    # an op whose output layout follows its input's: the graph traced on a contiguous input
    # must not hand a transposed input's caller the contiguous layout (or the reverse)
    compiled = functrans.compile(lambda x: x * 2)
    x = torch.randn(3, 4)
    xt = torch.randn(4, 3).T
    assert compiled(x).stride() == (x * 2).stride()
    assert compiled(xt).stride() == (xt * 2).stride()
    torch.testing.assert_close(compiled(xt), xt * 2)


def test_requires_grad_flip():
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    xr = x.clone().requires_grad_()
    compiled, reason, out = _flip((x, y), (xr, y))
    assert "requires_grad False -> True" in reason
    assert out.requires_grad
    out.sum().backward()
    xe = x.clone().requires_grad_()
    _f(xe, y).sum().backward()
    torch.testing.assert_close(xr.grad, xe.grad)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_device_flip():
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _, reason, out = _flip((x, y), (x.cuda(), y.cuda()))
    assert "device" in reason and "cuda" in reason
    assert out.device.type == "cuda"


@pytest.mark.parametrize("first,second,expected", [
    (2, 3, "(2 -> 3)"),
    (0.5, 1.5, "(0.5 -> 1.5)"),
    (2, 2.0, "(2 -> 2.0)"),               # same value, another type: another graph
    ("sum", "max", "('sum' -> 'max')"),
])
def test_non_tensor_argument_flip(first, second, expected):
    def fn(x, p):
        if p == "sum":
            return x.sum(0)
        if p == "max":
            return x.amax(0)
        return x * p + p
    x = torch.randn(3, 4)
    _, reason, out = _flip((x, first), (x, second), fn=fn)
    assert "non-tensor argument" in reason and expected in reason
    assert type(fn(x, second)) is type(out)


def test_keyword_argument_flip():
    def fn(x, *, scale):
        return x * scale
    compiled = functrans.compile(fn)
    x = torch.randn(3)
    torch.testing.assert_close(compiled(x, scale=2.0), x * 2.0)
    torch.testing.assert_close(compiled(x, scale=3.0), x * 3.0)
    assert compiled.cache_info().misses == 2
    assert "(2.0 -> 3.0)" in compiled.cache_info().retrace_reasons[0]


def test_grad_mode_flip():
    x = torch.randn(3, 4, requires_grad=True)
    y = torch.randn(3, 4)
    _, reason, out = _flip((x, y), (x, y), context=torch.no_grad)
    assert "grad mode changed (True -> False)" in reason
    assert not out.requires_grad


def test_inference_mode_flip():
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _, reason, out = _flip((x, y), (x, y), context=torch.inference_mode)
    assert "inference mode changed (False -> True)" in reason
    assert out.is_inference()


def test_default_dtype_flip():
    def fn(x):
        return x + torch.ones(x.shape[0])     # the factory follows the default dtype
    x = torch.randn(3)
    compiled = functrans.compile(fn)
    torch.testing.assert_close(compiled(x), fn(x))
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        out = compiled(x)
        expected = fn(x)
    finally:
        torch.set_default_dtype(previous)
    assert out.dtype == expected.dtype == torch.float64
    torch.testing.assert_close(out, expected)
    reasons = compiled.cache_info().retrace_reasons
    assert reasons == ["default dtype changed (torch.float32 -> torch.float64)"]


def test_cpu_autocast_flip():
    def fn(x, y):
        return x @ y
    x, y = torch.randn(4, 5), torch.randn(5, 3)
    _, reason, out = _flip((x, y), (x, y), fn=fn,
                           context=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert "CPU autocast" in reason
    assert out.dtype == torch.bfloat16


def test_cpu_autocast_dtype_flip():
    def fn(x, y):
        return x @ y
    x, y = torch.randn(4, 5), torch.randn(5, 3)
    compiled = functrans.compile(fn)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compiled(x, y).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16):
        out, expected = compiled(x, y), fn(x, y)
    assert out.dtype == expected.dtype == torch.float16
    torch.testing.assert_close(out, expected)
    assert "CPU autocast" in compiled.cache_info().retrace_reasons[0]


def test_guards_match_torch_func_under_vmap_stack():
    # the flips above on a transform stack, compared with torch.func
    def loss(w, x):
        return torch.tanh(x @ w).pow(2).sum()
    compiled = functrans.compile(functrans.vmap(functrans.grad(loss), in_dims=(None, 0)))
    reference = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))
    w = torch.randn(4, 2)
    for x in (torch.randn(6, 3, 4), torch.randn(5, 3, 4), torch.randn(6, 3, 4).double()):
        torch.testing.assert_close(compiled(w.to(x.dtype), x), reference(w.to(x.dtype), x))
    info = compiled.cache_info()
    assert info.misses == 3 and [r.split(":")[1].split()[0] for r in info.retrace_reasons] \
        == ["shape", "dtype"], info.retrace_reasons


def test_lru_eviction_beyond_cache_size():
    compiled = functrans.compile(lambda x: x.exp() + 1, cache_size=2, dynamic=False)
    xs = [torch.randn(n) for n in (2, 3, 4)]
    for x in xs:
        torch.testing.assert_close(compiled(x), x.exp() + 1)
    info = compiled.cache_info()
    assert len(info.entries) == 2 and info.misses == 3 and info.hits == 0
    torch.testing.assert_close(compiled(xs[2]), xs[2].exp() + 1)      # still cached
    assert compiled.cache_info().hits == 1
    torch.testing.assert_close(compiled(xs[0]), xs[0].exp() + 1)      # evicted: traced again
    info = compiled.cache_info()
    assert info.misses == 4 and info.hits == 1 and len(info.entries) == 2
    torch.testing.assert_close(compiled(xs[1]), xs[1].exp() + 1)      # LRU was xs[1]: evicted
    info = compiled.cache_info()
    assert info.misses == 5 and len(info.entries) == 2
    torch.testing.assert_close(compiled(xs[0]), xs[0].exp() + 1)      # recently used: kept
    assert compiled.cache_info().misses == 5
    torch.testing.assert_close(compiled(xs[2]), xs[2].exp() + 1)      # evicted by xs[1]
    assert compiled.cache_info().misses == 6


def test_cache_clear():
    compiled = functrans.compile(lambda x: x * 3)
    x = torch.randn(3)
    compiled(x)
    compiled.cache_clear()
    assert compiled.cache_info().entries == []
    torch.testing.assert_close(compiled(x), x * 3)
    assert compiled.cache_info().misses == 2
