"""The loop fallback: correct for any op, warns once per op, strict mode raises."""
import warnings

import pytest
import torch

import functrans
from functrans import vmap
from functrans.batching import fallback
from functrans.errors import PerformanceWarning, UnsupportedUnderVmap
from tests.support.oracles import assert_same, loop_oracle, make_batch

LIB = "functrans_test"


@torch.library.custom_op(f"{LIB}::scaled_cumsum", mutates_args=())
def scaled_cumsum(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.cumsum(x, 0) * scale


@torch.library.custom_op(f"{LIB}::split_pair", mutates_args=())
def split_pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, x.sum(0)


@torch.library.custom_op(f"{LIB}::add_into", mutates_args=("out",))
def add_into(out: torch.Tensor, x: torch.Tensor) -> None:
    out.add_(x)


@torch.library.custom_op(f"{LIB}::count_rows", mutates_args=())
def count_rows(x: torch.Tensor) -> int:
    return x.shape[0]


def test_fallback_is_correct_and_warns_once():
    x = make_batch(torch.randn(5), 0, 4)
    f = lambda a: torch.ops.functrans_test.scaled_cumsum(a, 2.0)
    fallback._warned.discard(torch.ops.functrans_test.scaled_cumsum.default)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = vmap(f)(x)
        vmap(f)(x)
    assert_same(got, loop_oracle(f, (0,), 4, x))
    perf = [w for w in caught if issubclass(w.category, PerformanceWarning)]
    assert len(perf) == 1, "the fallback warns exactly once per op"
    msg = str(perf[0].message)
    assert "scaled_cumsum" in msg and "your own code: register one with functrans.extend" in msg
    assert perf[0].filename == __file__  # points at the user's line


def test_fallback_warning_text_names_op_and_family_file():
    fallback._warned.discard(torch.ops.functrans_test.scaled_cumsum.default)
    with pytest.warns(PerformanceWarning, match=r"scaled_cumsum.*per-example loop.*your own code"):
        vmap(lambda a: torch.ops.functrans_test.scaled_cumsum(a, 1.0))(torch.randn(3, 4))


def test_strict_mode_raises():
    with functrans.config.strict_fallback():
        with pytest.raises(UnsupportedUnderVmap, match=r"no batching rule for .*scaled_cumsum.*disabled"):
            vmap(lambda a: torch.ops.functrans_test.scaled_cumsum(a, 1.0))(torch.randn(3, 4))


def test_fallback_tuple_outputs_and_in_dims():
    x = make_batch(torch.randn(3, 2), 1, 5)
    f = lambda a: torch.ops.functrans_test.split_pair(a)
    assert_same(vmap(f, in_dims=1)(x), loop_oracle(f, (1,), 5, x))


def test_fallback_inplace_into_batched_self():
    out = make_batch(torch.randn(3), 1, 4).T.contiguous().T  # bdim 1, non-default layout
    expected = out.clone() + 1.5
    returned = vmap(lambda o: torch.ops.functrans_test.add_into(o, torch.full((3,), 1.5)),
                    in_dims=1, out_dims=None)(out)
    assert returned is None
    assert_same(out, expected)


def test_fallback_nested():
    x = make_batch(make_batch(torch.randn(4), 0, 3), 1, 2)
    f = lambda a: torch.ops.functrans_test.scaled_cumsum(a, 3.0)
    assert_same(vmap(vmap(f), in_dims=1)(x), torch.stack(
        [torch.stack([f(x[i, j]) for i in range(3)]) for j in range(2)]))


def test_fallback_non_tensor_output():
    x = torch.randn(4, 6, 2)
    assert vmap(lambda a: torch.ops.functrans_test.count_rows(a), out_dims=None)(x) == 6


def test_fallback_under_autograd_for_differentiable_decomposed_op():
    x = torch.randn(4, 5, requires_grad=True)
    out = vmap(lambda a: torch.ops.functrans_test.scaled_cumsum(a.detach(), 2.0) * a)(x)
    g, = torch.autograd.grad(out.sum(), x)
    expected = torch.cumsum(x.detach(), 1) * 2.0
    assert_same(g, expected)


def test_an_invalid_call_does_not_disable_a_decomposition():
    # adaptive_max_pool3d runs by its torch._decomp decomposition under vmap.  A call with an
    # invalid argument raises inside the decomposition as in eager; that must not make every
    # later valid call take the loop (the op used to be remembered as "fails under vmap").
    # (torch 2.11 has no decomposition of it: there the pooling fold rule runs, and the same
    # holds of it.)
    import functrans as ft
    import torch.nn.functional as F
    x = torch.randn(2, 1, 4, 4, 4)
    with pytest.raises(RuntimeError):
        F.adaptive_max_pool3d(x[0, 0, 0], 2)              # eager: a 2-D input is invalid
    with pytest.raises(RuntimeError):
        ft.vmap(lambda a: F.adaptive_max_pool3d(a[0, 0], 2))(x)
    with ft.config.strict_fallback():
        out = ft.vmap(lambda a: F.adaptive_max_pool3d(a, 2))(x)
    torch.testing.assert_close(out, torch.stack([F.adaptive_max_pool3d(e, 2) for e in x]))
