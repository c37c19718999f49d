"""The batching-rule registry: register rules, look them up, list coverage.

A rule has the signature of ``torch.library.register_vmap``::

    rule(info, in_dims, *args, **kwargs) -> (out, out_dims)

``args`` are this level's physical values (tensors of lower levels are ordinary tensors here),
``in_dims`` mirrors ``args`` (an int or None per tensor, a list of those per tensor list, None
for everything else) and ``info`` is the ``VmapLevel`` (``batch_size``, ``randomness``).  The
rule returns physical outputs and their bdims in the same structure.

Lookup order for an op: its ``OpOverload``, then its ``OpOverloadPacket``, then a rule factory
for one of its tags (``torch.Tag.pointwise``), then a rule derived from its functional
counterpart's (in-place, ``out=`` and ``*_copy`` variants, ``derived.py``), then a
decomposition, then the loop fallback.
Resolutions are cached per op; registering a rule clears the cache.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, FrozenSet, Iterable, Optional, Set, Tuple, Union

import torch

Rule = Callable[..., Tuple[object, object]]


class Decline(Exception):
    """Raised by a rule for argument combinations it does not batch (before it has written
    anything): the dispatcher runs the loop fallback instead."""
OpLike = Union[torch._ops.OpOverload, torch._ops.OpOverloadPacket]

_overload_rules: Dict[torch._ops.OpOverload, Rule] = {}
_packet_rules: Dict[torch._ops.OpOverloadPacket, Rule] = {}
_tag_rule_factories: Dict[torch.Tag, Callable[[torch._ops.OpOverload], Optional[Rule]]] = {}
_families: Dict[OpLike, str] = {}
_tag_families: Dict[torch.Tag, str] = {}
_resolved_cache: Dict[torch._ops.OpOverload, Tuple[str, Optional[Rule]]] = {}
_generation = [0]  # bumped on every registration, so per-op caches elsewhere can refresh


def generation() -> int:
    return _generation[0]


def _changed() -> None:
    _resolved_cache.clear()
    _generation[0] += 1


_RULES_PACKAGE = __name__.rsplit(".", 1)[0] + ".rules."   # "functrans.batching.rules."
CUSTOM = "custom"   # the family of rules registered outside functrans: they live in user code


def _registering_module() -> str:
    """The family of a rule being registered, from the module that called the register function
    (two frames up): for a module of ``functrans.batching.rules`` the last part of its name (a rule
    belongs to the family file that registers it, even when a factory defined elsewhere,
    helpers.keep_bdim_rule or spatial.fold_into_n_rule, built it); for any other module (a
    user's ``__main__`` or ``mylib``) ``"custom"``: its rule lives in the user's own code."""
    import sys
    module = sys._getframe(2).f_globals.get("__name__", "?")
    if module.startswith(_RULES_PACKAGE):
        return module[len(_RULES_PACKAGE):].rsplit(".", 1)[-1]
    return CUSTOM


@functools.lru_cache(maxsize=None)
def functrans_families() -> FrozenSet[str]:
    """The names of functrans's own rules files (``functrans/batching/rules/<family>.py``)."""
    import pathlib
    rules_dir = pathlib.Path(__file__).resolve().parent / "rules"
    return frozenset(p.stem for p in rules_dir.glob("*.py") if p.stem != "__init__")


def register_batch_rule(ops, rule: Optional[Rule] = None, *, family: Optional[str] = None,
                        checks_inplace: bool = False):
    """Register ``rule`` for one op or several (``OpOverload`` or ``OpOverloadPacket``).

    Usable as a decorator (``@register_batch_rule(aten.sum.dim_IntList)``) or called directly.
    ``family`` defaults to the name of the module that registers the rule when that is a module
    of ``functrans.batching.rules``, else to ``"custom"`` (messages then say the rule lives in the
    user's own code).  ``checks_inplace``: the rule itself refuses (or handles) writes into
    unbatched mutable arguments, so the dispatcher's generic refusal is skipped for it (not for
    the fallback after a Decline).
    """
    if isinstance(ops, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        ops = [ops]
    ops = list(ops)
    fam = family or _registering_module()

    def register(fn: Rule) -> Rule:
        if checks_inplace:
            fn.checks_inplace = True
        for op in ops:
            if isinstance(op, torch._ops.OpOverloadPacket):
                _packet_rules[op] = fn
            elif isinstance(op, torch._ops.OpOverload):
                _overload_rules[op] = fn
            else:
                raise TypeError(f"register_batch_rule: expected an OpOverload or "
                                f"OpOverloadPacket, got {op!r}")
            _families[op] = fam
        _changed()
        return fn

    return register if rule is None else register(rule)


def register_tag_rule(tag: torch.Tag, factory, *, family: Optional[str] = None) -> None:
    """Register ``factory(op) -> rule or None`` for every op carrying ``tag``."""
    _tag_rule_factories[tag] = factory
    _tag_families[tag] = family or _registering_module()
    _changed()


def find_rule(op: torch._ops.OpOverload) -> Tuple[str, Optional[Rule]]:
    """``(how, rule)``: how is 'rule', 'tag' or 'derived' (from the functional op's rule, see
    ``derived.py``); ('cia', None) for CompositeImplicitAutograd
    ops, which the dispatcher decomposes; ('none', None) when no rule applies."""
    hit = _resolved_cache.get(op)
    if hit is not None:
        return hit
    if torch._C._dispatch_has_kernel_for_dispatch_key(
            op.name(), torch._C.DispatchKey.CompositeImplicitAutograd):
        # Reached only when called from inside another __torch_dispatch__ (autograd, which
        # normally decomposes these, is excluded there): run the op's own decomposition.
        hit = _resolved_cache[op] = ("cia", None)
        return hit
    rule = _overload_rules.get(op)
    how = "rule"
    if rule is None:
        rule = _packet_rules.get(op.overloadpacket)
    if rule is None:
        how = "tag"
        for tag in op.tags:
            factory = _tag_rule_factories.get(tag)
            if factory is not None:
                rule = factory(op)
                if rule is not None:
                    break
    if rule is None:
        from .derived import derive_rule
        how = "derived"
        rule = derive_rule(op, find_rule)
    hit = (how, rule) if rule is not None else ("none", None)
    _resolved_cache[op] = hit
    return hit


def registered_ops(family: Optional[str] = None) -> Set[OpLike]:
    """Ops with an explicit rule (overloads and packets), optionally of one family."""
    ops: Iterable[OpLike] = list(_overload_rules) + list(_packet_rules)
    return {op for op in ops if family is None or _families.get(op) == family}


def family_of(op: torch._ops.OpOverload) -> str:
    """The rules file an op's rule lives in, or should live in."""
    for key in (op, op.overloadpacket):
        if key in _families:
            return _families[key]
    for tag in op.tags:
        if tag in _tag_families and find_rule(op)[0] == "tag":
            return _tag_families[tag]
    from .derived import counterpart
    kind, base = counterpart(op)
    if base is not None:
        return family_of(base)
    return _guess_family(op)


def rules_file(op: torch._ops.OpOverload) -> str:
    """Where ``op``'s rule lives or belongs, for messages: a rules file of functrans, or the
    user's own code for ops outside ``aten`` and for rules registered outside functrans (any
    family that is not one of functrans's rules files, e.g. an explicit ``family="mylib"``)."""
    family = family_of(op)
    if family == CUSTOM or family not in functrans_families():
        if find_rule(op)[1] is not None:   # a rule of the user's own (that declined)
            return "your own code, where its rule is registered"
        return "your own code: register one with functrans.extend.register_batch_rule"
    return f"functrans/batching/rules/{family}.py"


# Where a rule for an op without one belongs, by the words in its name (first match wins).
_FAMILY_WORDS = (
    ("rnn", "rnn"), ("lstm", "rnn"), ("gru", "rnn"), ("attention", "attention"),
    ("transformer", "attention"), ("_sdp", "attention"),
    ("conv", "conv"), ("unpool", "pooling"), ("pool", "pooling"), ("upsample", "upsample"),
    ("grid_sampler", "spatial"), ("im2col", "spatial"), ("col2im", "spatial"),
    ("pixel_", "spatial"), ("_pad", "padding"), ("norm", "norms"), ("embedding", "embedding"),
    ("index", "indexing"), ("scatter", "indexing"), ("gather", "indexing"), ("take", "indexing"),
    ("put", "indexing"), ("masked", "indexing"), ("histc", "histograms"),
    ("histogram", "histograms"), ("bincount", "histograms"), ("searchsorted", "sorting"),
    ("bucketize", "sorting"), ("sort", "sorting"), ("topk", "sorting"), ("linalg", "linalg_solvers"),
    ("cholesky", "linalg_solvers"), ("lu_", "linalg_solvers"), ("svd", "linalg_solvers"),
    ("solve", "linalg_solvers"), ("mm", "linalg"), ("mv", "linalg"), ("loss", "losses"),
    ("fft", "fft"), ("_like", "factories"), ("new_", "factories"), ("glu", "activations"),
    ("prelu", "activations"), ("backward", "autograd_ops"),
)


def _guess_family(op: torch._ops.OpOverload) -> str:
    if op.namespace != "aten":
        return CUSTOM
    name = op.overloadpacket.__name__
    tags = set(op.tags)
    if torch.Tag.nondeterministic_seeded in tags:
        return "random"
    for key, fam in _FAMILY_WORDS:
        if key in name:
            return fam
    if torch.Tag.reduction in tags:
        return "reductions"
    return "views"
