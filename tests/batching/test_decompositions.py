"""Decompositions under vmap (batching/decompositions.py): a failure is local to its op, says so
once, and a user's own error disables nothing."""
import warnings

import pytest
import torch

import functrans as ft
from functrans.batching import decompositions
from functrans.errors import PerformanceWarning, UnsupportedUnderVmap
from tests.support.oracles import assert_same


@pytest.fixture
def fake_table(monkeypatch):
    """Two ops with decompositions of our own: one that cannot run under vmap, one that can."""
    lib = torch.library.Library("functrans_decomp_test", "FRAGMENT")
    lib.define("bad(Tensor x) -> Tensor")
    lib.define("good(Tensor x) -> Tensor")
    lib.define("strict(Tensor x) -> Tensor")
    lib.impl("bad", lambda x: x + 1, "CompositeExplicitAutograd")
    lib.impl("good", lambda x: x * 3, "CompositeExplicitAutograd")

    def strict_impl(x):
        if x.shape[-1] != 4:
            raise RuntimeError("strict: the last dim must be 4")
        return x - 1
    lib.impl("strict", strict_impl, "CompositeExplicitAutograd")
    ops = torch.ops.functrans_decomp_test

    def bad(x):
        raise UnsupportedUnderVmap("vmap: the decomposition calls .item()")

    def strict(x):
        if x.shape[-1] != 4:
            raise RuntimeError("strict: the last dim must be 4")
        raise ValueError("a decomposition bug")

    table = dict(decompositions._load())
    table.update({ops.bad.default: bad, ops.good.default: lambda x: x * 3,
                  ops.strict.default: strict})
    monkeypatch.setattr(decompositions, "_table", table)
    yield ops
    for op in (ops.bad.default, ops.good.default, ops.strict.default):
        decompositions._failed.pop(op, None)


def test_a_failing_decomposition_disables_only_its_op_and_the_warning_says_why(fake_table):
    ops = fake_table
    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_same(ft.vmap(ops.bad)(x), x + 1)      # fell back to the loop, correctly
    assert "calls .item()" in decompositions.failure(ops.bad.default)
    texts = [str(w.message) for w in caught if issubclass(w.category, PerformanceWarning)]
    assert any("decomposition cannot run under vmap" in t and ".item()" in t for t in texts)
    # the other op's decomposition still runs (strict: no loop allowed)
    with ft.config.strict_fallback():
        assert_same(ft.vmap(ops.good)(x), x * 3)
    assert decompositions.has_decomposition(ops.good.default)
    assert not decompositions.has_decomposition(ops.bad.default)


def test_a_users_own_error_disables_nothing(fake_table):
    ops = fake_table
    with pytest.raises(RuntimeError, match="the last dim must be 4"):
        ft.vmap(ops.strict)(torch.randn(3, 5))
    assert decompositions.failure(ops.strict.default) == ""
    assert decompositions.has_decomposition(ops.strict.default)
    # a decomposition bug (the loop succeeds where it raised) disables it, for this op only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)
        assert_same(ft.vmap(ops.strict)(torch.zeros(3, 4)), -torch.ones(3, 4))
    assert "a decomposition bug" in decompositions.failure(ops.strict.default)
    assert decompositions.has_decomposition(ops.good.default)
