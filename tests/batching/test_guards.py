"""The refusals of batching/guards.py, each made before any rule runs (the copied-view records
have their own file, test_guards_copied_views.py)."""
import pytest
import torch

import functrans as ft
from functrans.batching import guards
from functrans.errors import (EscapedBatchedTensorError, InplaceIntoUnbatchedError,
                              UnsupportedUnderVmap)
from tests.support.oracles import assert_same

X = torch.randn(3, 4)


def test_a_wrapper_of_a_returned_vmap_is_refused_with_the_op_named():
    kept = []
    ft.vmap(lambda x: kept.append(x) or x)(X)
    with pytest.raises(EscapedBatchedTensorError, match=r"aten\.sin.*already returned"):
        torch.sin(kept[0])


def test_a_batched_write_into_an_unbatched_tensor_is_refused_before_the_rule():
    def f(x):
        buf = torch.zeros(4)
        buf.add_(x)              # every example would need its own buf
        return buf
    with pytest.raises(InplaceIntoUnbatchedError, match=r"aten\.add_\.Tensor.*argument 0"):
        ft.vmap(f)(X)
    # the out= form names its keyword
    with pytest.raises(InplaceIntoUnbatchedError, match="the out= argument"):
        ft.vmap(lambda x: torch.sin(x, out=torch.empty(4)))(X)
    # writing an unbatched value into a batched tensor is fine, as in eager
    assert_same(ft.vmap(lambda x: x.clone().add_(torch.ones(4)))(X), X + 1)


def test_a_rule_registered_with_checks_inplace_gets_the_write_the_guard_would_refuse():
    """``checks_inplace=True`` hands the refusal of a batched write into an unbatched tensor
    to the rule (batch norm's running stats); without the flag the guard refuses first."""
    from functrans.batching import registry
    lib = torch.library.Library("functrans_guards_test", "FRAGMENT")
    lib.define("count_(Tensor(a!) counter, Tensor x) -> Tensor")

    def count_(counter, x):
        counter.add_(1)          # the same update whatever x holds
        return x * 2
    lib.impl("count_", count_, "CompositeExplicitAutograd")
    op = torch.ops.functrans_guards_test.count_.default

    def rule(info, in_dims, counter, x):   # one shared update, as eager's loop would not do
        counter.add_(1)
        return x * 2, in_dims[1]
    try:
        registry.register_batch_rule(op, rule)
        with pytest.raises(InplaceIntoUnbatchedError, match="argument 0"):
            ft.vmap(op, in_dims=(None, 0))(torch.zeros(()), X)
        registry.register_batch_rule(op, rule, checks_inplace=True)
        counter = torch.zeros(())
        with ft.config.strict_fallback():
            assert_same(ft.vmap(op, in_dims=(None, 0))(counter, X), X * 2)
        assert counter.item() == 1
    finally:
        registry.unregister_batch_rule(op)


def test_a_random_op_under_randomness_error_is_refused():
    with pytest.raises(UnsupportedUnderVmap, match=r"randomness='error'"):
        ft.vmap(lambda x: torch.bernoulli(x.sigmoid()))(X)
    # a dropout that draws nothing (p=0) is not random
    assert_same(ft.vmap(lambda x: torch.nn.functional.dropout(x, 0.0))(X), X)


def test_a_custom_function_under_an_outer_gradient_is_refused():
    class Old(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    w = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(UnsupportedUnderVmap, match="custom torch.autograd.Function"):
        ft.vmap(Old.apply)(w * 1.0)


def test_check_inplace_is_a_function_of_the_entry_not_the_rule():
    from functrans.batching import registry
    level = type("L", (), {"alive": True, "batch_size": 3})()
    entry = registry.entry(torch.ops.aten.add_.Tensor)
    with pytest.raises(InplaceIntoUnbatchedError):
        guards.check_inplace(torch.ops.aten.add_.Tensor, entry, [torch.zeros(4), X],
                             [None, 0], {}, level)
    guards.check_inplace(torch.ops.aten.add_.Tensor, entry, [X, torch.zeros(4)],
                         [0, None], {}, level)   # batched self: nothing to refuse
