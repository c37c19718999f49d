"""Registry hygiene: rules only where they can run, and a reason for every known failure.

(The third check, that every registered rule runs somewhere in the default test run, is a
session-level check in tests/conftest.py: it needs the whole run.)
"""
import torch

from functrans.batching import registry
from functrans.batching.op_schema import decomposes_above_dispatch
from tests.support import opinfo_sweep


def test_no_rule_for_an_op_that_decomposes_above_dispatch():
    """A CompositeImplicitAutograd op never reaches __torch_dispatch__ as itself: a rule for it
    could never run (the dispatcher decomposes it first)."""
    dead = []
    for op in registry.registered_ops():
        if decomposes_above_dispatch(op):
            dead.append(str(op))
    assert not dead, f"rules that can never run (composite ops): {dead}"


def test_every_rule_has_a_family_file():
    import pathlib
    rules_dir = pathlib.Path(registry.__file__).parent / "rules"
    files = {p.stem for p in rules_dir.glob("*.py")}
    bad = {str(op): registry.family_of(op) for op in registry.registered_ops()
           if op.namespace == "aten" and registry.family_of(op) not in files}
    assert not bad, bad


def test_known_failures_name_real_ops_and_give_reasons():
    ids = {opinfo_sweep.op_id(op) for op in opinfo_sweep.all_ops()}
    for name, reason in opinfo_sweep.XFAILS.items():
        assert name in ids, f"XFAILS entry {name!r} is not an OpInfo op"
        assert len(reason) > 20, f"XFAILS[{name!r}] needs a real reason"


def _known_fallback_ops():
    """``(name, op or None, reason)`` for each NO_RULE entry (None: a non-aten op this torch
    version does not have)."""
    import importlib
    from functrans.batching.known_fallbacks import NO_RULE
    try:  # defines the torch_nn ops (torch registers them when this module is first imported)
        importlib.import_module("torch.nn.modules.linear_cross_entropy")
    except ImportError:
        pass
    for name, reason in NO_RULE.items():
        namespace, packet, overload = name.split(".")
        try:
            op = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
        except AttributeError:
            assert namespace != "aten", f"NO_RULE names {name}, which is not an aten op"
            op = None
        yield name, op, reason


def test_known_fallbacks_are_real_ops_with_reasons():
    checked = 0
    for name, op, reason in _known_fallback_ops():
        if op is None:
            continue
        assert str(op) == name
        assert registry.find_rule(op)[1] is None, f"{name} has a rule now: remove it from NO_RULE"
        assert len(reason) > 20, f"NO_RULE[{name!r}] needs a real reason"
        checked += 1
    assert checked >= 7


def test_known_fallbacks_really_fall_back():
    """An entry says the op runs on the loop on purpose: stale once vmap runs it some other way
    (a rule, a derived rule, a decomposition; e.g. adaptive_max_pool3d's forward decomposes,
    only its backward loops)."""
    from functrans import batching_coverage
    stale = {name: batching_coverage(op) for name, op, _ in _known_fallback_ops()
             if op is not None and batching_coverage(op) != "fallback"}
    assert not stale, (f"known_fallbacks.NO_RULE lists ops that do not run on the loop fallback "
                       f"(remove or correct these entries): {stale}")


def test_every_functrans_family_guess_is_a_rules_file():
    """rules_file() names functrans/batching/rules/<family>.py only for real rules files (any other
    family is taken for the user's own), so every family an op without a rule can be given must
    be one."""
    guesses = registry.guessable_families()
    assert guesses <= registry.functrans_families(), guesses - registry.functrans_families()


def test_a_rule_belongs_to_the_file_that_registers_it():
    # factory-built rules (helpers.keep_bdim_rule, spatial.fold_into_n_rule) included
    aten = torch.ops.aten
    assert registry.family_of(aten.detach.default) == "autograd_ops"
    assert registry.family_of(aten.zero.default) == "factories"
    assert registry.family_of(aten.max_pool2d_with_indices.default) == "pooling"
    assert registry.family_of(aten.reflection_pad1d.default) == "padding"
    assert registry.family_of(aten.im2col.default) == "spatial"
