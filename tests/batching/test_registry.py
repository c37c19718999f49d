"""The registry (batching/registry.py): one OpEntry per op, families from the registration, and
the rules derived from functional rules (Note [derived rules]): *_copy, in-place and out= variants,
against the loop oracle, strict (a pass proves the derived rule ran)."""
import pytest
import torch

import functrans as ft
from functrans.batching import registry
from tests.support.oracles import assert_same, check_vmap_all_bdims, loop_oracle

aten = torch.ops.aten
X = torch.randn(3, 4, 5)


@pytest.mark.parametrize("op, kind, base", [
    (aten.permute_copy.default, "copy", aten.permute.default),
    (aten.abs_.default, "inplace", aten.abs.default),
    (aten.index_add_.default, "inplace", aten.index_add.default),
    (aten.add.out, "out", aten.add.Tensor),
    (aten.sort.values, "out", aten.sort.default),
    (aten.linalg_inv_ex.inverse, "out", aten.linalg_inv_ex.default),
    (aten.add.Tensor, "", None),
])
def test_counterparts_are_found_by_schema(op, kind, base):
    assert registry.counterpart(op) == (kind, base)


def test_copy_variants():
    check_vmap_all_bdims(lambda a: torch.permute_copy(a, (1, 0)), [X[0]])
    check_vmap_all_bdims(lambda a: torch.transpose_copy(a, 0, 1), [X[0]])
    check_vmap_all_bdims(lambda a: torch.unsqueeze_copy(a, 1), [X[0]])
    out = ft.vmap(lambda a: torch.view_copy(a, (20,)))(X)
    assert out.untyped_storage().data_ptr() != X.untyped_storage().data_ptr()  # a copy


def test_in_place_variants_write_into_self_and_return_it():
    def f(a, s):
        y = a.clone() + 0 * s.sum()  # batched whenever either input is
        ret = y.cumsum_(0).index_add_(1, torch.tensor([0, 2]), s)
        assert ret is y
        return y
    check_vmap_all_bdims(f, [X[0], torch.randn(4, 2)])


def test_in_place_result_that_cannot_be_cast_raises_like_eager():
    with pytest.raises(RuntimeError, match="can't be cast"):
        ft.vmap(lambda a: torch.ones_like(a, dtype=torch.long).mul_(a))(X)


def test_out_variants_write_and_return_the_out_tensors():
    def f(a):
        o = torch.empty_like(a)
        assert torch.sin(a, out=o) is o
        v, i = torch.empty_like(a), torch.empty_like(a, dtype=torch.long)
        ret = torch.sort(a, -1, out=(v, i))
        assert ret[0] is v and ret[1] is i
        s = torch.sum(a, -1, out=torch.empty_like(a[..., 0]))
        return o, v, i, s
    with ft.config.strict_fallback():
        got = ft.vmap(f, in_dims=1)(X)
    assert_same(got, loop_oracle(f, (1,), 4, X))


def test_out_named_info_does_not_collide_with_the_rule_signature():
    A = torch.randn(3, 4, 4) + 4 * torch.eye(4)
    f = lambda a: torch.linalg.inv_ex(
        a, out=(torch.empty_like(a), torch.zeros_like(a[0, 0], dtype=torch.int32)))
    with ft.config.strict_fallback():
        got = ft.vmap(f)(A)
    assert_same(got, loop_oracle(f, (0,), 3, A))


def test_out_of_the_wrong_shape_is_a_clear_error():
    f = lambda a: torch.sin(a, out=torch.empty_like(a[0]).new_empty(0) + a.sum() * 0)
    with pytest.raises(ft.UnsupportedUnderVmap, match=r"shape \(0,\) per example .* \(4, 5\)"
                       r".*cannot be resized"):
        ft.vmap(f)(X)


def test_in_place_of_the_wrong_shape_raises_eagers_error():
    f = lambda a, b: a.clone().add_(b)  # self [5], other [4, 5]: eager cannot write that
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        ft.vmap(f)(X[:, 0], X)


def test_derived_rules_report_their_family():
    assert registry.find_rule(aten.index_add_.default)[0] == "derived"
    assert registry.rules_file(aten.index_add_.default).endswith("rules/indexing.py")


# --------------------------------------------------------------------------- OpEntry and lookup

def test_one_entry_per_op_with_its_rule_family_and_flags():
    e = registry.entry(aten.native_batch_norm.default)
    assert e is registry.entry(aten.native_batch_norm.default)   # one cached record
    assert (e.how, e.family) == ("rule", "norms")
    bn = registry.entry(aten._native_batch_norm_legit.default)
    assert bn.checks_inplace and not bn.batched_kwargs
    assert registry.entry(aten.searchsorted.Tensor).batched_kwargs
    out = registry.entry(aten.add.out)
    assert (out.how, out.batched_kwargs, out.written_kw) == ("derived", True, ["out"])
    inplace = registry.entry(aten.add_.Tensor)
    assert inplace.returns_self and inplace.written_pos == [0]
    assert registry.entry(aten.sin.default).how == "tag"
    assert registry.entry(aten.linear.default).how == "cia"
    # flags are fields of the record, never attributes of the rule function
    for op in registry.registered_ops():
        rule = registry.registration(op).rule
        assert not hasattr(rule, "checks_inplace") and not hasattr(rule, "batched_kwargs"), op


def test_the_family_is_an_argument_of_the_registration():
    lib = torch.library.Library("functrans_registry_test", "FRAGMENT")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
    op = torch.ops.functrans_registry_test.twice.default
    try:
        registry.register_batch_rule(op, lambda info, in_dims, x: (x * 2, in_dims[0]))
        assert registry.family_of(op) == registry.CUSTOM
        assert registry.rules_file(op) == "your own code, where its rule is registered"
        registry.registrar("pointwise")(op, lambda info, in_dims, x: (x * 2, in_dims[0]))
        assert registry.family_of(op) == "pointwise"
        with ft.config.strict_fallback():
            assert_same(ft.vmap(op)(X), X * 2)
    finally:
        registry.unregister_batch_rule(op)
    assert registry.entry(op).how == "none"


def test_a_packet_registers_every_overload_and_a_registration_refreshes_the_cache():
    lib = torch.library.Library("functrans_registry_test2", "FRAGMENT")
    lib.define("inc(Tensor x) -> Tensor")
    lib.define("inc.by(Tensor x, float k) -> Tensor")
    lib.impl("inc", lambda x: x + 1, "CompositeExplicitAutograd")
    lib.impl("inc.by", lambda x, k: x + k, "CompositeExplicitAutograd")
    packet = torch.ops.functrans_registry_test2.inc
    try:
        before = registry.entry(packet.default)
        assert before.how == "none"
        registry.register_batch_rule(packet, lambda info, in_dims, x, *a: (
            packet.by(x, *a) if a else packet.default(x), in_dims[0]))
        assert {packet.default, packet.by} <= registry.registered_ops()
        assert registry.entry(packet.default) is not before
        assert registry.entry(packet.default).how == "rule"
        with ft.config.strict_fallback():
            assert_same(ft.vmap(lambda x: packet.by(x, 2.0))(X), X + 2)
    finally:
        registry.unregister_batch_rule(packet)
    assert packet.by not in registry.registered_ops()


def test_register_batch_rule_names_a_bad_op():
    with pytest.raises(TypeError, match="expected an OpOverload or OpOverloadPacket"):
        registry.register_batch_rule("aten::sin", lambda *a: None)
