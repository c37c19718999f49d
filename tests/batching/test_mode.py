"""The vmap level's dispatch mode (batching/mode.py): what it answers before the dispatcher."""
import pytest
import torch
import torch.utils._python_dispatch as python_dispatch

import functrans as ft
from functrans.batching import dispatch as dispatch_module, mode
from functrans.batching.batched_tensor import BatchedTensor
from functrans.errors import UnsupportedUnderVmap
from tests.support.oracles import assert_same

X = torch.randn(3, 4)


def test_the_mode_is_on_the_stack_exactly_while_the_function_runs():
    seen = []

    def f(x):
        seen.append([type(m).__name__ for m in python_dispatch._get_current_dispatch_mode_stack()])
        return x
    ft.vmap(f)(X)
    assert "VmapLevelMode" in seen[0]
    assert not any(isinstance(m, mode.VmapLevelMode)
                   for m in python_dispatch._get_current_dispatch_mode_stack())


def test_ops_on_wrappers_go_to_the_dispatcher_with_the_op_entry(monkeypatch):
    calls = []
    original = mode.dispatch

    def logged(func, args, kwargs, entry=None):
        calls.append((str(func), entry is not None))
        return original(func, args, kwargs, entry)
    monkeypatch.setattr(mode, "dispatch", logged)
    ft.vmap(lambda x: x.sin() * 2)(X)
    assert ("aten.sin.default", True) in calls and ("aten.mul.Tensor", True) in calls


def test_random_ops_without_a_batched_argument_follow_the_level_randomness():
    torch.manual_seed(0)
    same = ft.vmap(lambda x: x + torch.randn(4), randomness="same")(X)
    assert_same(same - X, (same - X)[:1].expand(3, 4))          # one draw for all
    diff = ft.vmap(lambda x: x + torch.randn(4), randomness="different")(X)
    assert not torch.allclose((diff - X)[0], (diff - X)[1])     # one draw each
    with pytest.raises(UnsupportedUnderVmap, match="randomness='error'"):
        ft.vmap(lambda x: x + torch.randn(4))(X)
    # an uninitialised buffer of an unbatched tensor is batched under 'different', so a random
    # fill of it (dropout's bernoulli_) draws per example
    out = ft.vmap(lambda x: torch.empty_like(torch.ones(4)).bernoulli_(0.5) + x * 0,
                  randomness="different")(torch.zeros(64, 4))
    assert out.shape == (64, 4) and not (out == out[0]).all()


def test_metadata_queries_are_answered_from_the_wrappers_and_agree_with_the_rules():
    aten = torch.ops.aten
    seen = []

    def probe(x, y):
        for op in (aten.is_same_size.default, aten._has_same_storage_numel.default):
            for a, b in ((x, y), (y, x), (x, x)):
                fast = mode.METADATA_QUERIES[op](a, b)
                ruled = dispatch_module.dispatch(op, (a, b), {})
                assert fast is None or fast == ruled, (op, a.shape, b.shape)
                seen.append(fast is not None)
        return x

    ft.vmap(probe, in_dims=(0, None))(torch.randn(3, 4, 5), torch.randn(4, 5))
    ft.vmap(probe, in_dims=(0, None))(torch.randn(3, 4, 5), torch.randn(5, 4))
    ft.vmap(ft.vmap(probe, in_dims=(0, None)), in_dims=(None, 0))(torch.randn(3, 4),
                                                                 torch.randn(2, 4))
    assert any(seen) and not all(seen)


def test_ops_on_plain_tensors_run_as_they_are():
    captured = torch.randn(4)

    def f(x):
        y = captured.cos()          # no wrapper: runs unchanged under the mode
        assert type(y) is torch.Tensor
        return x + y
    assert_same(ft.vmap(f)(X), X + captured.cos())
    assert isinstance(ft.vmap(lambda x: x)(X), torch.Tensor)
    assert not isinstance(ft.vmap(lambda x: x)(X), BatchedTensor)
