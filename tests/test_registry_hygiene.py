"""Registry hygiene: rules only where they can run, and a reason for every known failure.

(The third check, that every registered rule runs somewhere in the default test run, is a
session-level check in tests/conftest.py: it needs the whole run.)
"""
import torch

from functrans.vmap import registry
from functrans.vmap.op_listing import decomposes_above_dispatch
from tests import opinfo_sweep


def _overloads(key):
    if isinstance(key, torch._ops.OpOverload):
        return [key]
    return [getattr(key, name) for name in key.overloads()]


def test_no_rule_for_an_op_that_decomposes_above_dispatch():
    """A CompositeImplicitAutograd op never reaches __torch_dispatch__ as itself: a rule for it
    could never run (the dispatcher decomposes it first)."""
    dead = []
    for key in list(registry._overload_rules) + list(registry._packet_rules):
        ovs = _overloads(key)
        if ovs and all(decomposes_above_dispatch(ov) for ov in ovs):
            dead.append(str(key))
    assert not dead, f"rules that can never run (composite ops): {dead}"


def test_every_rule_has_a_family_file():
    import pathlib
    rules_dir = pathlib.Path(registry.__file__).parent / "rules"
    files = {p.stem for p in rules_dir.glob("*.py")}
    bad = {str(op): registry._families[op] for op in registry.registered_ops()
           if op.namespace == "aten" and registry._families[op] not in files}
    assert not bad, bad


def test_known_failures_name_real_ops_and_give_reasons():
    ids = {opinfo_sweep.op_id(op) for op in opinfo_sweep.all_ops()}
    for name, reason in opinfo_sweep.XFAILS.items():
        assert name in ids, f"XFAILS entry {name!r} is not an OpInfo op"
        assert len(reason) > 20, f"XFAILS[{name!r}] needs a real reason"


def test_known_fallbacks_are_real_ops_with_reasons():
    from functrans.vmap.known_fallbacks import NO_RULE
    checked = 0
    for name, reason in NO_RULE.items():
        namespace, packet, overload = name.split(".")
        try:
            op = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
        except AttributeError:
            assert namespace != "aten", f"NO_RULE names {name}, which is not an aten op"
            continue  # a non-aten op this torch version does not have (or has not loaded)
        assert str(op) == name
        assert registry.find_rule(op)[1] is None, f"{name} has a rule now: remove it from NO_RULE"
        assert len(reason) > 20, f"NO_RULE[{name!r}] needs a real reason"
        checked += 1
    assert checked >= 10


def test_a_rule_belongs_to_the_file_that_registers_it():
    # factory-built rules (helpers.keep_bdim_rule, spatial.fold_into_n_rule) included
    aten = torch.ops.aten
    assert registry.family_of(aten.detach.default) == "autograd_ops"
    assert registry.family_of(aten.zero.default) == "factories"
    assert registry.family_of(aten.max_pool2d_with_indices.default) == "pooling"
    assert registry.family_of(aten.reflection_pad1d.default) == "padding"
    assert registry.family_of(aten.im2col.default) == "spatial"
