"""The for-loop oracle's edge cases: batch size 1, empty examples, 0-d examples, non-contiguous
and channels_last batches, integer/bool/complex dtypes, and CPU scalars (0-d tensors, Python
numbers) mixed with batched tensors.  Each case compares ``functrans.vmap`` (under
``strict_fallback``: no loop fallback) with the loop oracle of ``tests/support/oracles.py``
and, where torch.func can run it, with ``torch.func.vmap``; vmap∘grad and vmap∘vjp where
meaningful.

A wrong result found here is a bug: the test stays, marked ``xfail(strict=True)`` with the
reason.
"""
import pytest
import torch
import torch.func as tf
import torch.nn.functional as F

import functrans as ft
from functrans.errors import UnsupportedUnderVmap
from tests.support.oracles import assert_same, check_vmap, check_vmap_all_bdims, loop_oracle


def compare(make, args, in_dims, *, strict=True, torch_func=True, rtol=None, atol=None):
    """``ft.vmap(make(ft))`` vs the loop of ``make(ft)`` over already-batched ``args``, and vs
    ``torch.func.vmap(make(torch.func))`` when torch.func can run it."""
    size = next(a.shape[d] for a, d in zip(args, in_dims) if d is not None)
    f = make(ft)
    expected = loop_oracle(f, in_dims, size, *args)
    with ft.config.strict_fallback(strict):
        actual = ft.vmap(f, in_dims=tuple(in_dims))(*args)
    assert_same(actual, expected, rtol=rtol, atol=atol, msg="functrans vs loop")
    if torch_func:
        try:
            reference = tf.vmap(make(tf), in_dims=tuple(in_dims))(*args)
        except Exception:  # torch.func cannot run it: the loop is the reference
            return actual
        assert_same(actual, reference, rtol=rtol, atol=atol, msg="functrans vs torch.func")
    return actual


def plain(f):
    return lambda mod: f


def per_sample_grad(f, argnum=0):
    """vmap∘grad of a real scalar built from ``f``."""
    def loss(*a):
        out = f(*a)
        return (out.abs() ** 2).sum() if out.is_complex() else (out * out).sum()
    return lambda mod: mod.grad(loss, argnums=argnum)


def per_sample_vjp(f):
    """vmap∘vjp with a cotangent of ones (real) built inside the function."""
    def g(*a):
        out, fn = mod_vjp[0](f, *a)
        return fn(torch.ones_like(out))
    mod_vjp = [None]

    def make(mod):
        mod_vjp[0] = mod.vjp
        return g
    return make


# Per-example float ops over an example of shape (2, 3) [and a second operand].
FLOAT_OPS = {
    "pointwise": (lambda a: torch.sin(a) * 2 + a.exp(), 1),
    "binary": (lambda a, b: a * b - b / 3, 2),
    "sum": (lambda a: a.sum(-1), 1),
    "amax": (lambda a: a.amax(0), 1),
    "mean_keepdim": (lambda a: a.mean(-1, keepdim=True), 1),
    "view": (lambda a: a.reshape(-1)[1:4], 1),
    "transpose": (lambda a: a.t() + 1, 1),
    "matmul": (lambda a, b: a @ b.t(), 2),
    "index": (lambda a: a[:, torch.tensor([2, 0])], 1),
    "index_put": (lambda a, b: a.index_put((torch.tensor([1]),), b[0] * 2), 2),
    "softmax": (lambda a: torch.softmax(a, -1), 1),
    "cat": (lambda a, b: torch.cat([a, b], -1), 2),
}
DIFFERENTIABLE = ["pointwise", "binary", "sum", "mean_keepdim", "view", "transpose", "matmul",
                  "index", "softmax", "cat"]


def _args(n, shape=(2, 3), dtype=torch.float32):
    g = torch.Generator().manual_seed(n)
    return [torch.randn(shape, generator=g, dtype=dtype) for _ in range(n)]


# --- batch size 1 -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(FLOAT_OPS))
def test_batch_size_one(name):
    f, n = FLOAT_OPS[name]
    check_vmap_all_bdims(f, _args(n), size=1, nested=False)


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_batch_size_one_grad_and_vjp(name):
    f, n = FLOAT_OPS[name]
    args = [a[None] for a in _args(n)]
    compare(per_sample_grad(f), args, [0] * n)
    compare(per_sample_vjp(f), args, [0] * n)


def test_batch_size_one_nested():
    f, _ = FLOAT_OPS["matmul"]
    x, y = torch.randn(1, 1, 2, 3), torch.randn(1, 2, 3)
    expected = torch.stack([torch.stack([f(x[i, j], y[i]) for j in range(1)]) for i in range(1)])
    actual = ft.vmap(ft.vmap(f, in_dims=(0, None)))(x, y)
    assert_same(actual, expected)


# --- empty examples ---------------------------------------------------------------------------

EMPTY_OPS = {
    "pointwise": (lambda a: torch.sin(a) * 2, 1),
    "binary": (lambda a, b: a * b + 1, 2),
    "sum_empty_dim": (lambda a: a.sum(0), 1),
    "sum_other_dim": (lambda a: a.sum(-1), 1),
    "mean_empty_dim": (lambda a: a.mean(0), 1),
    "view": (lambda a: a.reshape(-1), 1),
    "view_split": (lambda a: a.reshape(0, 3, 1), 1),
    "transpose": (lambda a: a.t(), 1),
    "matmul_empty_rows": (lambda a, b: a @ b.t()[:, :2], 2),
    "matmul_empty_inner": (lambda a, b: a.t() @ b, 2),
    "index": (lambda a: a[:, torch.tensor([2, 0])], 1),
    "softmax": (lambda a: torch.softmax(a, -1), 1),
    "cat": (lambda a, b: torch.cat([a, b], 0), 2),
}


@pytest.mark.parametrize("name", list(EMPTY_OPS))
def test_empty_examples(name):
    f, n = EMPTY_OPS[name]
    check_vmap_all_bdims(f, _args(n, (0, 3)), nested=False)


@pytest.mark.parametrize("name", ["pointwise", "sum_empty_dim", "matmul_empty_inner", "softmax"])
def test_empty_examples_grad_and_vjp(name):
    f, n = EMPTY_OPS[name]
    args = [torch.randn(3, 0, 3) for _ in range(n)]
    compare(per_sample_grad(f), args, [0] * n)
    compare(per_sample_vjp(f), args, [0] * n)


def test_empty_batch():
    """A batch of zero examples: the result has batch size 0 (the loop has nothing to stack,
    so torch.func is the reference)."""
    x = torch.randn(0, 2, 3)
    out = ft.vmap(lambda a: a.sum(-1) * 2)(x)
    assert out.shape == (0, 2)
    assert_same(out, tf.vmap(lambda a: a.sum(-1) * 2)(x))


# --- 0-d examples -----------------------------------------------------------------------------

SCALAR_OPS = {
    "pointwise": (lambda a: torch.sin(a) * 2 + a, 1),
    "binary": (lambda a, b: a * b - b, 2),
    "sum": (lambda a: a.sum(), 1),
    "sum_dim0": (lambda a: a.sum(0), 1),
    "amax_dim-1": (lambda a: a.amax(-1), 1),
    "unsqueeze": (lambda a: a.unsqueeze(0).expand(3), 1),
    "reshape": (lambda a: a.reshape(1, 1), 1),
    "none_index": (lambda a: a[None, None] * 2, 1),
    "softmax": (lambda a: torch.softmax(a, 0), 1),
    "stack": (lambda a, b: torch.stack([a, b]), 2),
    "with_vector": (lambda a, b: a * b.expand(3) if b.dim() == 0 else a * b, 2),
    "outer_via_matmul": (lambda a, b: a.reshape(1, 1) @ b.reshape(1, 1), 2),
}


@pytest.mark.parametrize("name", list(SCALAR_OPS))
def test_zero_d_examples(name):
    f, n = SCALAR_OPS[name]
    check_vmap_all_bdims(f, _args(n, ()))


@pytest.mark.parametrize("name", ["pointwise", "binary", "unsqueeze", "softmax", "stack"])
def test_zero_d_examples_grad_and_vjp(name):
    f, n = SCALAR_OPS[name]
    args = [torch.randn(4) for _ in range(n)]
    compare(per_sample_grad(f), args, [0] * n)
    compare(per_sample_vjp(f), args, [0] * n)


# --- non-contiguous and channels_last batches --------------------------------------------------

def _noncontiguous(kind, shape, size=4, seed=0):
    """A batch of ``size`` examples of ``shape`` at in_dim 0, laid out non-contiguously."""
    g = torch.Generator().manual_seed(seed)
    if kind == "transposed":          # the batch dim is the innermost physical dim
        b = torch.randn(*shape, size, generator=g).movedim(-1, 0)
    elif kind == "step_sliced":       # every other element of a larger tensor
        b = torch.randn(size, *shape[:-1], 2 * shape[-1], generator=g)[..., ::2]
    elif kind == "batch_step":        # every other example, offset storage
        b = torch.randn(2 * size + 1, *shape, generator=g)[1::2]
    elif kind == "expanded":          # one example repeated by stride 0 (not a copy)
        b = torch.randn(1, *shape, generator=g).expand(size, *shape)
    else:
        raise ValueError(kind)
    assert not b.is_contiguous() or kind == "batch_step"
    return b


LAYOUTS = ["transposed", "step_sliced", "batch_step", "expanded"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(FLOAT_OPS))
def test_noncontiguous_batches(layout, name):
    f, n = FLOAT_OPS[name]
    args = [_noncontiguous(layout, (2, 3), seed=i) for i in range(n)]
    compare(plain(f), args, [0] * n)
    # The same memory mapped at a non-zero in_dim.
    moved = [a.movedim(0, -1) for a in args]
    compare(plain(f), moved, [-1] * n)


@pytest.mark.parametrize("layout", ["transposed", "step_sliced", "expanded"])
@pytest.mark.parametrize("name", ["pointwise", "matmul", "index", "softmax", "view"])
def test_noncontiguous_grad_and_vjp(layout, name):
    f, n = FLOAT_OPS[name]
    args = [_noncontiguous(layout, (2, 3), seed=i) for i in range(n)]
    compare(per_sample_grad(f), args, [0] * n)
    compare(per_sample_vjp(f), args, [0] * n)


def test_noncontiguous_unmapped_operand():
    x = torch.randn(4, 2, 3)
    w = torch.randn(3, 2).t()          # a transposed shared operand
    compare(plain(lambda a, b: a * b + (a @ b.t()).sum()), [x, w], [0, None])
    compare(per_sample_grad(lambda b, a: a @ b.t()), [w, x], [None, 0])


def _channels_last(size=3, c=2, h=5, wd=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, c, h, wd, generator=g).contiguous(memory_format=torch.channels_last)
    assert not x.is_contiguous()
    return x


CL_OPS = {
    "conv2d": lambda a, k: F.conv2d(a, k, padding=1),
    "conv2d_stride": lambda a, k: F.conv2d(a, k, stride=2),
    "pointwise": lambda a, k: torch.relu(a) * 2 + k.sum(),
    "sum_spatial": lambda a, k: a.sum((-1, -2)) * k.sum(),
    "softmax_channels": lambda a, k: torch.softmax(a, 0) + k.mean(),
    "avg_pool": lambda a, k: F.avg_pool2d(a, 2) * k.sum(),
    "flatten": lambda a, k: a.flatten() * k.sum(),
}


@pytest.mark.parametrize("name", list(CL_OPS))
def test_channels_last_batches(name):
    f = CL_OPS[name]
    x = _channels_last()
    k = torch.randn(3, 2, 3, 3)
    compare(plain(f), [x, k], [0, None], rtol=1e-5, atol=1e-5)
    ks = torch.randn(3, 3, 2, 3, 3).contiguous(memory_format=torch.channels_last_3d)
    compare(plain(f), [x, ks], [0, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["conv2d", "avg_pool", "softmax_channels"])
def test_channels_last_grad_and_vjp(name):
    f = CL_OPS[name]
    x = _channels_last()
    k = torch.randn(3, 2, 3, 3)
    compare(per_sample_grad(f), [x, k], [0, None], rtol=1e-4, atol=1e-5)
    compare(per_sample_grad(f, argnum=1), [x, k], [0, None], rtol=1e-4, atol=1e-5)
    compare(per_sample_vjp(f), [x, k], [0, None], rtol=1e-4, atol=1e-5)


# --- integer, bool and complex dtypes ----------------------------------------------------------

INT_OPS = {
    "add_mul": (lambda a, b: a * 3 + b, 2),
    "floor_divide": (lambda a, b: torch.div(a, b.abs() + 1, rounding_mode="floor"), 2),
    "remainder": (lambda a, b: a % (b.abs() + 1), 2),
    "true_divide": (lambda a, b: a / (b.abs() + 1), 2),
    "sum": (lambda a: a.sum(-1), 1),
    "amax": (lambda a: a.amax(0), 1),
    "cumsum": (lambda a: a.cumsum(-1), 1),
    "argmax": (lambda a: a.argmax(-1), 1),
    "compare": (lambda a, b: a > b, 2),
    "where": (lambda a, b: torch.where(a > b, a, b), 2),
    "view": (lambda a: a.t().reshape(-1), 1),
    "matmul": (lambda a, b: a @ b.t(), 2),
    "index": (lambda a: a[1, torch.tensor([2, 0])], 1),
    "gather_by_values": (lambda a, b: torch.gather(b, 1, a.long() % 3), 2),
    "bitwise": (lambda a, b: (a & b) ^ (a | 1), 2),
    "to_float": (lambda a: a.float().softmax(-1), 1),
}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
@pytest.mark.parametrize("name", list(INT_OPS))
def test_integer_dtypes(name, dtype):
    f, n = INT_OPS[name]
    g = torch.Generator().manual_seed(1)
    args = [torch.randint(0, 9, (2, 3), generator=g).to(dtype) for _ in range(n)]
    if name == "matmul" and dtype == torch.uint8:
        pytest.skip("eager uint8 matmul is not implemented on CPU")
    check_vmap_all_bdims(f, args, nested=False)


BOOL_OPS = {
    "logical": (lambda a, b: (a & ~b) | (a ^ b), 2),
    "any_all": (lambda a: torch.stack([a.any(-1), a.all(-1)]), 1),
    "sum": (lambda a: a.sum(-1), 1),
    "to_float": (lambda a: a.float() * 2, 1),
    "where": (lambda a, b: torch.where(a, b.float(), -1.0), 2),
    "view": (lambda a: a.t().reshape(-1), 1),
    "index": (lambda a: a[:, torch.tensor([0, 2])], 1),
    "masked_fill": (lambda a, b: b.float().masked_fill(a, 5.0), 2),
    "eq": (lambda a, b: a == b, 2),
}


@pytest.mark.parametrize("name", list(BOOL_OPS))
def test_bool_dtype(name):
    f, n = BOOL_OPS[name]
    g = torch.Generator().manual_seed(2)
    args = [torch.randint(0, 2, (2, 3), generator=g).bool() for _ in range(n)]
    check_vmap_all_bdims(f, args, nested=False)


COMPLEX_OPS = {
    "pointwise": (lambda a: torch.sin(a) * (1 + 2j) + a.exp(), 1),
    "binary": (lambda a, b: a * b.conj() - b / 3, 2),
    "abs_angle": (lambda a: a.abs() + a.angle(), 1),
    "sum": (lambda a: a.sum(-1), 1),
    "view": (lambda a: a.t().reshape(-1), 1),
    "matmul": (lambda a, b: a @ b.t(), 2),
    "index": (lambda a: a[:, torch.tensor([2, 0])], 1),
    "real_imag": (lambda a: a.real * 2 - a.imag, 1),
    "view_as_real": (lambda a: torch.view_as_real(a) * 2, 1),
    "conj_physical": (lambda a, b: a.conj() @ b.t(), 2),
}


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("name", list(COMPLEX_OPS))
def test_complex_dtypes(name, dtype):
    f, n = COMPLEX_OPS[name]
    check_vmap_all_bdims(f, _args(n, dtype=dtype), nested=False, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["pointwise", "binary", "matmul", "index", "real_imag",
                                  "conj_physical"])
def test_complex_grad_and_vjp(name):
    f, n = COMPLEX_OPS[name]
    args = [torch.randn(4, 2, 3, dtype=torch.complex64) for _ in range(n)]
    compare(per_sample_grad(f), args, [0] * n, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["pointwise", "binary", "matmul", "index"])
def test_complex_vjp(name):
    f, n = COMPLEX_OPS[name]
    args = [torch.randn(4, 2, 3, dtype=torch.complex64) for _ in range(n)]
    compare(per_sample_vjp(f), args, [0] * n, rtol=1e-4, atol=1e-5)


# --- CPU scalars mixed with tensors -------------------------------------------------------------

SCALAR_CASES = {
    # (per-example function, example args, in_dims)
    "python_float": (lambda a: a * 2.5 + 1, (torch.randn(3),), (0,)),
    "python_int_on_int": (lambda a: a * 3 - 1, (torch.arange(3),), (0,)),
    "python_float_on_int": (lambda a: a * 0.5, (torch.arange(3),), (0,)),
    "python_complex_on_float": (lambda a: a * (1 + 1j), (torch.randn(3),), (0,)),
    "python_bool_on_int": (lambda a: a + True, (torch.arange(3),), (0,)),
    "cpu_0d_float_captured": (lambda a: a * torch.tensor(2.0), (torch.randn(3),), (0,)),
    "cpu_0d_double_captured": (lambda a: a * torch.tensor(2.0, dtype=torch.float64),
                               (torch.randn(3),), (0,)),
    "cpu_0d_int_captured_on_float": (lambda a: a + torch.tensor(3), (torch.randn(3),), (0,)),
    "cpu_0d_float_captured_on_int": (lambda a: a + torch.tensor(0.5), (torch.arange(3),), (0,)),
    "0d_double_unmapped_arg": (lambda a, s: a * s, (torch.randn(3), torch.tensor(1.5,
                               dtype=torch.float64)), (0, None)),
    "0d_examples_double_times_float": (lambda s, b: s * b,
                                       (torch.tensor(1.5, dtype=torch.float64), torch.randn(3)),
                                       (0, None)),
    "0d_examples_double_times_mapped_float": (lambda s, b: s * b,
                                              (torch.tensor(1.5, dtype=torch.float64),
                                               torch.randn(3)), (0, 0)),
    "0d_examples_int_plus_float": (lambda s, b: b + s, (torch.tensor(2), torch.randn(3)),
                                   (0, None)),
    "0d_examples_float_plus_int_vector": (lambda s, b: b + s,
                                          (torch.tensor(0.5), torch.arange(3)), (0, None)),
    "0d_double_examples_pow": (lambda c, a: a ** c, (torch.tensor(0.5, dtype=torch.float64),
                                                    torch.rand(3)), (0, None)),
    "0d_double_examples_clamp": (lambda c, a: a.clamp(max=c),
                                 (torch.tensor(0.5, dtype=torch.float64), torch.rand(3)),
                                 (0, None)),
    "0d_double_examples_where": (lambda c, a: torch.where(a > 0.5, a, c),
                                 (torch.tensor(0.5, dtype=torch.float64), torch.rand(3)),
                                 (0, None)),
    "0d_double_examples_maximum": (lambda c, a: torch.maximum(a, c),
                                   (torch.tensor(0.5, dtype=torch.float64), torch.rand(3)),
                                   (0, None)),
    "0d_double_examples_rsub_div": (lambda c, a: (c - a) / c,
                                    (torch.tensor(0.5, dtype=torch.float64), torch.rand(3)),
                                    (0, None)),
    "0d_double_examples_fmod_atan2": (lambda c, a: torch.fmod(a, c) + torch.atan2(a, c),
                                      (torch.tensor(0.5, dtype=torch.float64), torch.rand(3)),
                                      (0, None)),
    "0d_double_examples_compare": (lambda c, a: a < c,
                                   (torch.tensor(0.5, dtype=torch.float64), torch.rand(3)),
                                   (0, None)),
    "0d_half_vector_double_examples": (lambda c, a: a * c,
                                       (torch.tensor(0.5, dtype=torch.float64),
                                        torch.rand(3).half()), (0, None)),
    "0d_complex_examples_times_float": (lambda c, a: a * c,
                                        (torch.tensor(1 + 2j, dtype=torch.complex128),
                                         torch.rand(3)), (0, None)),
    "0d_int_examples_divide_int": (lambda c, a: a / c, (torch.tensor(2), torch.arange(3)),
                                   (0, None)),
    "0d_int_examples_bitwise": (lambda c, a: (a & c) + (a << c),
                                (torch.tensor(1), torch.arange(3, dtype=torch.int32)), (0, None)),
    "0d_bool_examples_times_float": (lambda c, a: a * c, (torch.tensor(True), torch.rand(3)),
                                     (0, None)),
    "0d_examples_both": (lambda s, t: s * t + 1,
                         (torch.tensor(2.0), torch.tensor(3, dtype=torch.int32)), (0, 0)),
    "where_with_scalars": (lambda a: torch.where(a > 0, a, 0.0), (torch.randn(3),), (0,)),
    "clamp_scalars": (lambda a: a.clamp(-0.5, 0.5), (torch.randn(3),), (0,)),
    "pow_scalar_base": (lambda a: 2 ** a, (torch.randn(3),), (0,)),
    "scalar_minus_tensor": (lambda a: 1 - a, (torch.arange(3),), (0,)),
}


# torch.func promotes these to float64 (the batched 0-d examples become a 1-d float64 tensor,
# which takes part in type promotion); functrans keeps the loop's float32.
TORCH_FUNC_PROMOTES = {"0d_double_examples_clamp", "0d_double_examples_where"}


@pytest.mark.parametrize("name", list(SCALAR_CASES))
def test_cpu_scalars_mixed_with_tensors(name):
    f, args, in_dims = SCALAR_CASES[name]
    out = check_vmap(f, args, in_dims)
    if name in TORCH_FUNC_PROMOTES:
        return
    batched = [a.expand(3, *a.shape).clone() if d is not None else a
               for a, d in zip(args, in_dims)]
    assert_same(out.dtype, tf.vmap(f, in_dims=in_dims)(*batched).dtype)


@pytest.mark.parametrize("name", ["python_float", "cpu_0d_double_captured",
                                  "0d_double_unmapped_arg", "0d_examples_double_times_float",
                                  "where_with_scalars", "pow_scalar_base"])
def test_cpu_scalars_grad_and_vjp(name):
    f, args, in_dims = SCALAR_CASES[name]
    batched = [torch.randn(4, *a.shape, dtype=a.dtype) if d is not None else a
               for a, d in zip(args, in_dims)]
    argnum = next(i for i, d in enumerate(in_dims) if d is not None)
    compare(per_sample_grad(f, argnum), batched, list(in_dims))
    if all(d is not None for d in in_dims):
        compare(per_sample_vjp(f), batched, list(in_dims))


def test_zero_d_examples_mixed_dtypes_grad():
    """vmap∘grad w.r.t. float32 vectors with float64 0-d examples mapped beside them: the
    gradient stays float32 (0-d tensors do not promote), as in the loop."""
    f = lambda v, s: (v * s).sin()  # noqa: E731
    v = torch.randn(4, 3)
    s = torch.rand(4, dtype=torch.float64)
    out = compare(per_sample_grad(f), [v, s], [0, 0])
    assert out.dtype == torch.float32
    compare(per_sample_grad(f, argnum=1), [v, s], [0, 0])


# --- more batch-size-1 / empty / 0-d hazards (rules that squeeze or reshape the batch dim) ----

SIZE_ONE_OPS = {
    "squeeze_all": (lambda a: a.squeeze(), [(1, 3)]),
    "squeeze_dim": (lambda a: a.squeeze(0), [(1, 3)]),
    "flatten": (lambda a: a.flatten(), [(1, 3)]),
    "dot": (torch.dot, [(3,), (3,)]),
    "mv": (torch.mv, [(2, 3), (3,)]),
    "outer": (torch.outer, [(1,), (3,)]),
    "matmul_1d_2d": (torch.matmul, [(1,), (1, 3)]),
    "bmm": (torch.bmm, [(1, 1, 2), (1, 2, 1)]),
    "max_all": (lambda a: a.max(), [(1, 1)]),
    "logsumexp": (lambda a: a.logsumexp(-1), [(1, 1)]),
    "layer_norm": (lambda a: F.layer_norm(a, (3,)), [(1, 3)]),
    "cross_entropy": (lambda a: F.cross_entropy(a, torch.tensor([1])), [(1, 3)]),
    "conv1d": (lambda a, k: F.conv1d(a, k), [(1, 1, 5), (2, 1, 3)]),
    "max_pool": (lambda a: F.max_pool2d(a, 2), [(1, 4, 4)]),
    "embedding": (lambda w: F.embedding(torch.tensor([0, 0]), w), [(1, 3)]),
    "cdist": (torch.cdist, [(1, 3), (2, 3)]),
    "trace": (lambda a: a.trace(), [(1, 1)]),
    "unbind_stack": (lambda a: torch.stack(a.unbind(0)), [(1, 3)]),
}


@pytest.mark.parametrize("name", list(SIZE_ONE_OPS))
def test_batch_size_one_squeeze_hazards(name):
    f, shapes = SIZE_ONE_OPS[name]
    check_vmap_all_bdims(f, [torch.randn(s) for s in shapes], size=1)


MORE_EMPTY_OPS = {
    "cumsum": (lambda a: a.cumsum(0), [(0, 3)]),
    "mm": (torch.mm, [(2, 0), (0, 3)]),
    "max_other_dim": (lambda a: a.max(-1).values, [(0, 3)]),
    "sort": (lambda a: a.sort(0).values, [(0,)]),
    "index_with_empty": (lambda a: a[torch.tensor([], dtype=torch.long)], [(3,)]),
    "cat_with_empty": (lambda a, b: torch.cat([a, b]), [(0,), (3,)]),
    "prod": (lambda a: a.prod(0), [(0, 3)]),
    "logsumexp": (lambda a: a.logsumexp(0), [(0, 3)]),
    "any": (lambda a: (a > 0).any(0), [(0, 3)]),
    "norm": (lambda a: a.norm(), [(0,)]),
    "expand_to_empty": (lambda a: a.expand(0, 3), [(1, 3)]),
}


@pytest.mark.parametrize("name", list(MORE_EMPTY_OPS))
def test_more_empty_examples(name):
    f, shapes = MORE_EMPTY_OPS[name]
    check_vmap_all_bdims(f, [torch.randn(s) for s in shapes], nested=False)


# --- in-place ops on non-contiguous / channels_last batched inputs -----------------------------

def _same_layout_copy(b):
    """An independent copy of ``b`` with the same strides (and a base like b's)."""
    base = b._base if b._base is not None else b
    copy = base.detach().clone(memory_format=torch.preserve_format)
    return copy.as_strided(b.shape, b.stride(), b.storage_offset())


INPLACE_OPS = {
    "mul_": lambda a: a.mul_(2),
    "add_broadcast": lambda a: a.add_(torch.arange(3.0)),
    "setitem": lambda a: (a.__setitem__(1, 5.0), a)[1],
    "view_inplace": lambda a: (a[1:].mul_(3), a)[1],
    "transposed_view_inplace": lambda a: (a.t()[0].add_(1), a)[1],
    "relu_": lambda a: torch.relu_(a),
}


@pytest.mark.parametrize("layout", ["transposed", "step_sliced", "batch_step"])
@pytest.mark.parametrize("name", list(INPLACE_OPS))
def test_inplace_on_noncontiguous_inputs(layout, name):
    f = INPLACE_OPS[name]
    b = _noncontiguous(layout, (2, 3))
    for_loop, for_vmap, for_tf = (_same_layout_copy(b) for _ in range(3))
    expected = loop_oracle(f, [0], 4, for_loop)
    with ft.config.strict_fallback():
        actual = ft.vmap(f)(for_vmap)
    assert_same(actual, expected)
    assert_same(for_vmap, for_loop, msg="the input after the in-place op")
    tf.vmap(f)(for_tf)
    assert_same(for_vmap, for_tf, msg="functrans vs torch.func: the input after the op")


@pytest.mark.parametrize("name", ["relu_", "mul_"])
def test_inplace_on_channels_last_inputs(name):
    f = {"relu_": lambda a: F.relu(a, inplace=True),
         "mul_": lambda a: a.mul_(a.mean((1, 2), keepdim=True))}[name]
    x = _channels_last()
    for_loop, for_vmap = x.clone(), x.clone()
    assert not for_vmap.is_contiguous()
    expected = loop_oracle(f, [0], 3, for_loop)
    with ft.config.strict_fallback():
        actual = ft.vmap(f)(for_vmap)
    assert_same(actual, expected)
    assert_same(for_vmap, for_loop, msg="the input after the in-place op")


@pytest.mark.parametrize("op", ["mul_", "add_", "copy_", "imag_mul_"])
def test_inplace_through_conj_view_is_refused_clearly(op):
    """In eager, .conj() is a lazy view and these writes reach the input.  Under vmap the
    result is materialised (Note [conjugate and negative bits]), so the write could not reach
    the input: functrans refuses it with a clear error instead of silently leaving the input
    unchanged (the wrong result this test caught)."""
    f = {"mul_": lambda a: a.conj().mul_(2),
         "add_": lambda a: a.conj().add_(1),
         "copy_": lambda a: a.conj().copy_(torch.ones(3, dtype=a.dtype)),
         "imag_mul_": lambda a: a.conj().imag.mul_(2)}[op]
    z = torch.randn(4, 3, dtype=torch.complex64)
    for_loop = z.clone()
    loop_oracle(f, [0], 4, for_loop)
    assert not torch.equal(for_loop, z)        # eager writes through the view
    for_vmap = z.clone()
    with pytest.raises(UnsupportedUnderVmap, match=r"\.conj\(\).*Write into the original"):
        ft.vmap(f)(for_vmap)
    # out-of-place use of the conjugate, and writes into unrelated tensors, still work
    g = lambda a: (a.clone().mul_(2) + a.conj()).abs()
    assert_same(ft.vmap(g)(z), loop_oracle(g, [0], 4, z))


def test_inplace_through_real_views_of_complex_inputs():
    for f in (lambda a: a.imag.mul_(2), lambda a: torch.view_as_real(a).mul_(2),
              lambda a: a.real.add_(1)):
        z = torch.randn(4, 3, dtype=torch.complex64)
        for_loop, for_vmap = z.clone(), z.clone()
        expected = loop_oracle(f, [0], 4, for_loop)
        actual = ft.vmap(f)(for_vmap)
        assert_same(actual, expected)
        assert_same(for_vmap, for_loop, msg="the input after the in-place op")


# Python indexing treats a 0-d integer tensor as an int (eager calls .item() and selects); under
# vmap each example's k_i selects its own row, as the loop does.
@pytest.mark.parametrize("w_dim", [None, 0, 1])
def test_index_with_batched_zero_d_integer_tensor(w_dim):
    k = torch.tensor([0, 2, 1, 0])
    w = {None: torch.randn(3, 2), 0: torch.randn(4, 3, 2), 1: torch.randn(3, 4, 2)}[w_dim]
    compare(plain(lambda k, w: w[k]), [k, w], [0, w_dim])


ZERO_D_INDEXINGS = {
    "k_slice": lambda k, w: w[k, 1:],
    "slice_k": lambda k, w: w[:, k % 2],
    "ellipsis_k": lambda k, w: w[..., k % 2],
    "two_batched": lambda k, w: w[k, k % 2],
    "with_int_and_none": lambda k, w: w[None, k, 1],
    "with_list": lambda k, w: w[k, [1, 0, 1]],
    "with_unbatched_0d": lambda k, w: w[torch.tensor(1), k % 2],
    "int32": lambda k, w: w[k.int()],
    "negative": lambda k, w: w[k - 3],
    "then_arith": lambda k, w: w[k] * 2 + w[(k + 1) % 3],
}


@pytest.mark.parametrize("w_dim", [None, 0])
@pytest.mark.parametrize("name", list(ZERO_D_INDEXINGS))
def test_index_with_batched_zero_d_integer_tensor_forms(name, w_dim):
    k = torch.tensor([0, 2, 1, 0])
    w = torch.randn(3, 2) if w_dim is None else torch.randn(4, 3, 2)
    compare(plain(ZERO_D_INDEXINGS[name]), [k, w], [0, w_dim])


def test_index_with_batched_zero_d_integer_tensor_mixed_with_advanced_indices():
    # Eager selects first, then places the remaining advanced block where it would be without
    # the selected dim: here at dim 1, where a 0-d advanced index would have moved it to the front.
    k = torch.tensor([1, 0, 1, 1])
    for f, shape in ((lambda k, w: w[[0, 1], :, k], (4, 3, 5, 2)),
                     (lambda k, w: w[:, [0, 2], :, k], (4, 3, 3, 5, 2))):
        w = torch.randn(shape)
        assert_same(ft.vmap(f)(k, w), loop_oracle(f, [0, 0], 4, k, w))


def test_index_with_batched_zero_d_integer_tensor_nested():
    K, W = torch.randint(0, 3, (5, 4)), torch.randn(5, 4, 3, 2)
    f = lambda k, w: w[k, 1:]
    assert_same(ft.vmap(ft.vmap(f))(K, W), tf.vmap(tf.vmap(f))(K, W))
    # k batched at one level only, w at the other
    inner_k = ft.vmap(ft.vmap(f, in_dims=(0, None)), in_dims=(None, 0))(K[0], W[:, 0])
    assert_same(inner_k, torch.stack([torch.stack([W[i, 0][K[0, j], 1:] for j in range(4)])
                                      for i in range(5)]))
    outer_k = ft.vmap(ft.vmap(f, in_dims=(None, 0)), in_dims=(0, None))(K[:, 0], W[0])
    assert_same(outer_k, torch.stack([torch.stack([W[0, j][K[i, 0], 1:] for j in range(4)])
                                      for i in range(5)]))


@pytest.mark.parametrize("w_dim", [None, 0])
def test_index_with_batched_zero_d_integer_tensor_grad(w_dim):
    k = torch.tensor([0, 2, 1, 0])
    w = torch.randn(3, 2) if w_dim is None else torch.randn(4, 3, 2)
    # per-example gradients through w (torch.func cannot run vmap∘grad here: its grad wrapper
    # hides the batched index and it calls .item(); the loop is the reference)
    compare(per_sample_grad(lambda w, k: w[k, 1:] * w[k], argnum=0), [w, k], [w_dim, 0],
            torch_func=False)
    compare(lambda mod: mod.jacrev(lambda w, k: w[k].sin()), [w, k], [w_dim, 0],
            torch_func=False)
    # and the gradient of a vmap over indices, taken outside it
    g = ft.grad(lambda w: ft.vmap(lambda k: w[k])(k).pow(2).sum())(w[0] if w_dim else w)
    assert_same(g, tf.grad(lambda w: tf.vmap(lambda k: w[k])(k).pow(2).sum())(
        w[0] if w_dim else w))


def _set(index_fn):
    def f(k, w, v):
        x = w.clone()
        x[index_fn(k)] = v
        return x
    return f


@pytest.mark.parametrize("v_dim", [None, 0])
@pytest.mark.parametrize("index_fn, v_shape", [
    (lambda k: k, (2,)), (lambda k: (k, slice(1, None)), (1,)),
    (lambda k: (Ellipsis, k % 2), (3,)), (lambda k: (k, [1, 0]), (2,)),
    (lambda k: k - 3, ())], ids=["k", "k_slice", "ellipsis_k", "k_list", "negative"])
def test_setitem_with_batched_zero_d_integer_tensor(index_fn, v_shape, v_dim):
    k = torch.tensor([0, 2, 1, 0])
    w = torch.randn(4, 3, 2)
    v = torch.randn(v_shape) if v_dim is None else torch.randn((4,) + v_shape)
    compare(plain(_set(index_fn)), [k, w, v], [0, 0, v_dim])
    # a Python number as the value, and gradients through the written values and w
    compare(plain(lambda k, w: _set(index_fn)(k, w, 7.0)), [k, w], [0, 0])
    compare(per_sample_grad(lambda w, k, v: _set(index_fn)(k, w * 1, v) * w, argnum=(0, 2)),
            [w, k, v], [0, 0, v_dim], torch_func=False)


def test_setitem_with_batched_zero_d_integer_tensor_into_unbatched_raises():
    # each example would write its own row into one shared tensor, as with any batched write
    k, w = torch.tensor([0, 2, 1, 0]), torch.randn(3, 2)
    with pytest.raises(UnsupportedUnderVmap, match="in-place.*not batched"):
        ft.vmap(lambda k: _set(lambda k: k)(k, w, 1.0))(k)


@pytest.mark.parametrize("w_dim", [None, 0])
def test_index_with_batched_zero_d_integer_tensor_out_of_range(w_dim):
    w = torch.randn(3, 2) if w_dim is None else torch.randn(4, 3, 2)
    for k in (torch.tensor([0, 3, 1, 0]), torch.tensor([0, -4, 1, 0])):
        with pytest.raises(IndexError, match="out of bounds"):
            w[k[1]] if w_dim is None else w[0][k[1]]  # eager says the same
        with pytest.raises(IndexError, match=f"index {k[1].item()} is out of bounds"):
            ft.vmap(lambda k, w: w[k], in_dims=(0, w_dim))(k, w)


def test_index_with_batched_zero_d_bool_tensor():
    # eager: x[True] is x.unsqueeze(0), x[False] is empty: per-example shapes differ, so reading
    # raises (as torch.func does); writing x[m] = v keeps the shape and is a torch.where
    m, w = torch.tensor([True, False, True, False]), torch.randn(4, 3, 2)
    for f in (lambda m, w: w[m], lambda m, w: w[m, 0]):
        with pytest.raises(UnsupportedUnderVmap, match=r"0-d boolean.*torch\.where"):
            ft.vmap(f)(m, w)
    f = _set(lambda m: m)
    for v, v_dim in ((torch.randn(4, 3, 2), 0), (torch.randn(4, 1, 3, 2), 0),
                     (torch.randn(2), None)):
        assert_same(ft.vmap(f, in_dims=(0, 0, v_dim))(m, w, v),
                    loop_oracle(f, [0, 0, v_dim], 4, m, w, v))
    g = lambda m, w: f(m, w, 5.0)
    assert_same(ft.vmap(g)(m, w), loop_oracle(g, [0, 0], 4, m, w))
    with pytest.raises(UnsupportedUnderVmap, match=r"0-d boolean.*torch\.where"):
        ft.vmap(_set(lambda m: (m, 0)))(m, w, torch.randn(4, 2))


def test_other_ops_on_batched_zero_d_integer_tensors_unchanged():
    # the 0-d integer wrapper only intercepts indexing: arithmetic, Python-level torch
    # functions (broadcast_tensors, cross_entropy) and .item()'s error are as before
    k = torch.tensor([0, 2, 1, 0])
    f = lambda k: (k + 1, k[None], torch.broadcast_tensors(k, torch.zeros(2))[0])
    for a, b in zip(ft.vmap(f)(k), loop_oracle(f, [0], 4, k)):
        assert_same(a, b)
    logits = torch.randn(4, 3)
    assert_same(ft.vmap(F.cross_entropy)(logits, k),
                F.cross_entropy(logits, k, reduction="none"))
    with pytest.raises(UnsupportedUnderVmap, match=r"\.item\(\).*x\[k\]"):
        ft.vmap(lambda k, w: w[k.item()], in_dims=(0, None))(k, torch.randn(3))
