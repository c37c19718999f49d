"""The batching-rule registry: one record per op (``OpEntry``), built once and cached.

A rule has the signature of ``torch.library.register_vmap``::

    rule(info, in_dims, *args, **kwargs) -> (out, out_dims)

``args`` are this level's physical values (tensors of lower levels are ordinary tensors here),
``in_dims`` mirrors ``args`` (an int or None per tensor, a list of those per tensor list, None
for everything else) and ``info`` is the ``VmapLevel`` (``batch_size``, ``randomness``).  The
rule returns physical outputs and their bdims in the same structure.  A rule that does not
batch some argument combination raises ``Decline`` before writing anything: the dispatcher
runs the loop fallback instead.

Where an op's rule comes from, in order (``OpEntry.how``):

1. ``'cia'``: the op is CompositeImplicitAutograd; the dispatcher runs its own decomposition
   (reached only from inside another ``__torch_dispatch__``, where autograd does not decompose);
2. ``'rule'``: a rule registered for the op (``register_batch_rule``);
3. ``'tag'``: a rule factory registered for one of the op's tags (``torch.Tag.pointwise``);
4. ``'derived'``: a rule built from its functional counterpart's rule, for in-place (``foo_``),
   ``out=`` and ``*_copy`` variants (Note [derived rules]);
5. ``'none'``: no rule; the dispatcher tries a decomposition, then the loop fallback.

Every fact the dispatcher needs about an op lives in its ``OpEntry``: the rule and how it was
found, the rules file it belongs to (``family``), the flags a registration gives
(``checks_inplace``, ``batched_kwargs``) and what the schema says (written arguments, random,
in-place view).  Entries are keyed by ``id(op)`` (``OpOverload.__hash__`` is a Python method and
the lookup runs on every op) and the cache is cleared by every registration.

A rule's family, the rules file it lives in, is an argument of the registration: each file of
``rules/`` registers through ``registrar("<its name>")``; a rule registered from anywhere else
(``functrans.extend.register_batch_rule``) belongs to ``"custom"``: the user's own code.

Imports: errors, helpers, op_schema, randomness (pure policy).  Nothing here dispatches.
"""
from __future__ import annotations

import functools
import pathlib
from typing import Callable, Dict, FrozenSet, List, NamedTuple, Optional, Set, Tuple, Union

import torch
from torch.utils._pytree import tree_map_only

from ..errors import TransformTypeError, UnsupportedUnderVmap
from .helpers import match_bdim
from .op_schema import decomposes_above_dispatch, overload_named, written_arguments
from .randomness import is_random_op

Rule = Callable[..., Tuple[object, object]]
OpLike = Union[torch._ops.OpOverload, torch._ops.OpOverloadPacket]
CUSTOM = "custom"   # the family of rules registered outside functrans: they live in user code


class Decline(Exception):
    """Raised by a rule for argument combinations it does not batch (before it has written
    anything): the dispatcher runs the loop fallback instead."""


class Registration(NamedTuple):
    """What one ``register_batch_rule`` call said about one op."""
    rule: Rule
    family: str
    checks_inplace: bool = False   # the rule itself refuses or handles writes into unbatched
    #                                mutable arguments (batch norm's running stats)
    batched_kwargs: bool = False   # the rule takes batched keyword values (out= variants)


class OpEntry:
    """Everything the dispatcher knows about one op, computed once."""

    __slots__ = ("op", "name", "how", "rule", "family", "checks_inplace", "batched_kwargs",
                 "written_pos", "written_kw", "returns_self", "returns_none", "inplace_view",
                 "random", "checked", "decompose")

    def __init__(self, op: torch._ops.OpOverload):
        self.op = op  # keeps the overload alive, so its id() stays a valid key
        self.name = str(op)
        self.written_pos, self.written_kw = written_arguments(op)
        returns = op._schema.returns
        self.returns_none = not returns
        self.returns_self = bool(self.written_pos) and self.written_pos[0] == 0 and \
            len(returns) == 1 and returns[0].alias_info is not None
        self.inplace_view = torch.Tag.inplace_view in op.tags
        self.random = is_random_op(op)
        self.checked = bool(self.written_pos or self.written_kw or self.random
                            or self.inplace_view)
        self.how, reg = _resolve(op)
        self.rule = reg.rule if reg is not None else None
        self.family = reg.family if reg is not None else _guess_family(op)
        self.checks_inplace = reg is not None and reg.checks_inplace
        self.batched_kwargs = reg is not None and reg.batched_kwargs
        # A 'cia' op's own decomposition, bound once: ``op.decompose`` looks the kernel up by
        # the op's name on every call (a few microseconds; movedim, flatten... reach it often).
        self.decompose = None
        if self.how == "cia":
            self.decompose = op.decompose if _CIA in op.py_kernels \
                else functools.partial(op._op_dk, _CIA)

    def __repr__(self) -> str:
        return f"OpEntry({self.name}, how={self.how!r}, family={self.family!r})"


_CIA = torch._C.DispatchKey.CompositeImplicitAutograd
_registrations: Dict[torch._ops.OpOverload, Registration] = {}
_tag_factories: Dict[torch.Tag, Tuple[Callable[[torch._ops.OpOverload], Optional[Rule]], str]] = {}
_entries: Dict[int, OpEntry] = {}


def entry(op: torch._ops.OpOverload) -> OpEntry:
    """``op``'s record (built on first use)."""
    e = _entries.get(id(op))
    if e is None:
        e = _entries[id(op)] = OpEntry(op)
    return e


# ----------------------------------------------------------------------------- registration

def register_batch_rule(ops, rule: Optional[Rule] = None, *, family: str = CUSTOM,
                        checks_inplace: bool = False, batched_kwargs: bool = False):
    """Register ``rule`` for one op or several.

    ``ops``: an ``OpOverload``, an ``OpOverloadPacket`` (every overload of it), or a list of
    those.  Usable as a decorator (``@register_batch_rule(aten.sum.dim_IntList)``) or called
    directly.  ``family``: the rules file the rule lives in (``rules/<family>.py``); the default
    ``"custom"`` makes messages say that the rule lives in the user's own code.
    ``checks_inplace``: the rule itself refuses (or handles) writes into unbatched mutable
    arguments, so the dispatcher's generic refusal is skipped for it (not for the fallback
    after a Decline).  ``batched_kwargs``: the rule receives physical keyword values and their
    bdims (``_kw_dims=``) instead of being bypassed when a keyword argument is batched.
    """
    if isinstance(ops, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        ops = [ops]
    overloads: List[torch._ops.OpOverload] = []
    for op in ops:
        if isinstance(op, torch._ops.OpOverloadPacket):
            overloads.extend(getattr(op, name) for name in op.overloads())
        elif isinstance(op, torch._ops.OpOverload):
            overloads.append(op)
        else:
            raise TransformTypeError(f"register_batch_rule: expected an OpOverload or "
                                     f"OpOverloadPacket "
                            f"(e.g. torch.ops.aten.sin.default), got {op!r}")

    def register(fn: Rule) -> Rule:
        for op in overloads:
            _registrations[op] = Registration(fn, family, checks_inplace, batched_kwargs)
        _entries.clear()
        return fn

    return register if rule is None else register(rule)


def unregister_batch_rule(ops) -> None:
    """Remove the rules registered for ``ops`` (same forms as ``register_batch_rule``)."""
    if isinstance(ops, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        ops = [ops]
    for op in ops:
        if isinstance(op, torch._ops.OpOverloadPacket):
            for name in op.overloads():
                _registrations.pop(getattr(op, name), None)
        else:
            _registrations.pop(op, None)
    _entries.clear()


def register_tag_rule(tag: torch.Tag, factory, *, family: str = CUSTOM) -> None:
    """Register ``factory(op) -> rule or None`` for every op carrying ``tag``."""
    _tag_factories[tag] = (factory, family)
    _entries.clear()


def registrar(family: str) -> Callable:
    """``register_batch_rule`` for the rules file ``rules/<family>.py``: each rules file
    registers through one of these, so every rule knows its file."""
    return functools.partial(register_batch_rule, family=family)


# ----------------------------------------------------------------------------- lookup

def _resolve(op: torch._ops.OpOverload) -> Tuple[str, Optional[Registration]]:
    if decomposes_above_dispatch(op):
        return "cia", None
    reg = _registrations.get(op)
    if reg is not None:
        return "rule", reg
    for tag in op.tags:
        hit = _tag_factories.get(tag)
        if hit is not None:
            rule = hit[0](op)
            if rule is not None:
                return "tag", Registration(rule, hit[1])
    reg = _derived_registration(op)
    if reg is not None:
        return "derived", reg
    return "none", None


def find_rule(op: torch._ops.OpOverload) -> Tuple[str, Optional[Rule]]:
    """``(how, rule)`` of ``op`` (see the module docstring)."""
    e = entry(op)
    return e.how, e.rule


def registered_ops(family: Optional[str] = None) -> Set[torch._ops.OpOverload]:
    """Ops with an explicitly registered rule, optionally of one family."""
    return {op for op, reg in _registrations.items() if family is None or reg.family == family}


def registration(op: torch._ops.OpOverload) -> Optional[Registration]:
    """What was registered for ``op`` itself (None for tag, derived or no rule)."""
    return _registrations.get(op)


@functools.lru_cache(maxsize=None)
def functrans_families() -> FrozenSet[str]:
    """The names of functrans's own rules files (``functrans/batching/rules/<family>.py``)."""
    rules_dir = pathlib.Path(__file__).resolve().parent / "rules"
    return frozenset(p.stem for p in rules_dir.glob("*.py") if p.stem != "__init__")


def family_of(op: torch._ops.OpOverload) -> str:
    """The rules file an op's rule lives in, or should live in."""
    return entry(op).family


def rules_file(op: torch._ops.OpOverload) -> str:
    """Where ``op``'s rule lives or belongs, for messages: a rules file of functrans, or the
    user's own code for ops outside ``aten`` and for rules registered outside functrans (any
    family that is not one of functrans's rules files, e.g. an explicit ``family="mylib"``)."""
    e = entry(op)
    if e.family == CUSTOM or e.family not in functrans_families():
        if e.rule is not None:   # a rule of the user's own (that declined)
            return "your own code, where its rule is registered"
        return "your own code: register one with functrans.extend.register_batch_rule"
    return f"functrans/batching/rules/{e.family}.py"


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
    ("bucketize", "sorting"), ("sort", "sorting"), ("topk", "sorting"),
    ("linalg", "linalg_solvers"),
    ("cholesky", "linalg_solvers"), ("lu_", "linalg_solvers"), ("svd", "linalg_solvers"),
    ("solve", "linalg_solvers"), ("mm", "linalg"), ("mv", "linalg"), ("loss", "losses"),
    ("fft", "fft"), ("_like", "factories"), ("new_", "factories"), ("glu", "activations"),
    ("prelu", "activations"), ("backward", "autograd_ops"),
)


def guessable_families() -> FrozenSet[str]:
    """Every family ``_guess_family`` can give an aten op without a rule."""
    return frozenset(fam for _, fam in _FAMILY_WORDS) | {"random", "reductions", "views"}


def _guess_family(op: torch._ops.OpOverload) -> str:
    if op.namespace != "aten":
        return CUSTOM
    kind, base = counterpart(op)
    if base is not None:
        return entry(base).family
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


# ----------------------------------------------------------------------------- derived rules
# Note [derived rules]
# Many ATen ops come in three or four flavours that compute the same values: ``index_add``,
# ``index_add_``, ``index_add.out``; ``permute`` and ``permute_copy``.  A rule written for the
# functional op serves the others:
#
# * ``foo_copy``: run ``foo``'s rule, then clone its outputs (a copy owns its memory).
# * ``foo_`` (in-place on argument 0): run ``foo``'s rule on the same arguments, move the result
#   to ``self``'s batch dim and ``copy_`` it into ``self``'s physical value.  The values are
#   computed before anything is written, so ``x.index_add_(0, i, x)`` is safe.  Like eager, a
#   result whose dtype cannot be cast to ``self``'s raises.
# * ``foo.out`` (``out=`` keyword arguments): run ``foo``'s rule and ``copy_`` each result into
#   the physical value of its ``out`` tensor.  An ``out`` of the wrong shape would have to be
#   resized, which a batched tensor cannot do per example: that raises an error saying so.
#
# The counterpart is found by schema, never by guessing: its arguments must be the variant's
# arguments minus the written ones, with the same names and types.  These are resolved only for
# ops with no rule of their own.

def _signature(args) -> List[Tuple[str, str]]:
    return [(a.name, str(a.type)) for a in args]


def counterpart(op: torch._ops.OpOverload) -> Tuple[str, Optional[torch._ops.OpOverload]]:
    """``(kind, functional op)`` with kind 'copy', 'inplace' or 'out'; ``('', None)`` if none."""
    if op.namespace != "aten":
        return "", None
    name, overload = op.overloadpacket.__name__, op._overloadname
    args = op._schema.arguments
    positions, names = written_arguments(op)
    written = [a for i, a in enumerate(args) if i in positions or a.name in names]
    if name.endswith("_copy") and not written:
        base = overload_named(f"aten::{name[:-len('_copy')]}.{overload}")
        if base is not None and _signature(base._schema.arguments) == _signature(args):
            return "copy", base
        return "", None
    if len(written) == 1 and args and args[0] is written[0] and name.endswith("_") \
            and not name.endswith("__"):
        base = overload_named(f"aten::{name[:-1]}.{overload}")
        if base is not None and _signature(base._schema.arguments) == _signature(args) \
                and len(base._schema.returns) == 1:
            return "inplace", base
        return "", None
    if written and all(a.kwarg_only for a in written):
        wanted = _signature([a for a in args if all(a is not w for w in written)])
        packet = op.overloadpacket
        for ov in packet.overloads():
            base = getattr(packet, ov)
            if base is not op and _signature(base._schema.arguments) == wanted \
                    and len(base._schema.returns) == len(written):
                return "out", base
    return "", None


def _derived_registration(op: torch._ops.OpOverload) -> Optional[Registration]:
    """A rule for ``op`` built from its functional counterpart's rule (Note [derived rules])."""
    kind, base = counterpart(op)
    if base is None:
        return None
    base_entry = entry(base)
    if base_entry.rule is None:
        return None
    make = {"copy": _copy_rule, "inplace": _inplace_rule, "out": _out_rule}[kind]
    rule = make(op, base, base_entry.rule)
    rule.__name__ = f"{kind}_rule[{op}] from {getattr(base_entry.rule, '__name__', base)}"
    return Registration(rule, base_entry.family, batched_kwargs=kind == "out")


def _copy_rule(op, base, base_rule):
    def rule(info, in_dims, /, *args, **kwargs):
        out, dims = base_rule(info, in_dims, *args, **kwargs)
        return tree_map_only(torch.Tensor, torch.clone, out), dims
    return rule


def _check_cast(op, result: torch.Tensor, target: torch.Tensor) -> None:
    if not torch.can_cast(result.dtype, target.dtype):
        raise RuntimeError(f"{op}: result type {result.dtype} can't be cast to the desired "
                           f"output type {target.dtype}")


def _write(op, info, results, result_dims, targets, target_dims, *, is_out: bool) -> None:
    """Check every (result, target) pair first, then write: nothing is ever half-written."""
    values = [match_bdim(r, rd, td, info.batch_size)
              for r, rd, td in zip(results, result_dims, target_dims)]
    for v, t, td in zip(values, targets, target_dims):
        if v.shape != t.shape:
            if not is_out:
                raise Decline()  # eager raises its own error for this self: the loop does
            shape = lambda x: tuple(x.shape[:td]) + tuple(x.shape[td + 1:])  # noqa: E731
            raise UnsupportedUnderVmap(
                f"vmap: {op} got an out= tensor of shape {shape(t)} per example for a result "
                f"of shape {shape(v)}. Eager PyTorch would resize it, but a batched out= "
                "tensor cannot be resized per example. Allocate it with the result's shape "
                "(e.g. torch.empty_like of an input of that shape), or drop out=.")
        _check_cast(op, v, t)
    for v, t in zip(values, targets):
        t.copy_(v)


def _inplace_rule(op, base, base_rule):
    def rule(info, in_dims, /, *args, **kwargs):
        if in_dims[0] is None:
            raise Decline()
        out, dim = base_rule(info, in_dims, *args, **kwargs)
        _write(op, info, [out], [dim], [args[0]], [in_dims[0]], is_out=False)
        return args[0], in_dims[0]
    return rule


def _out_rule(op, base, base_rule):
    names = [op._schema.arguments[i].name for i in written_arguments(op)[0]] + \
        written_arguments(op)[1]

    # (info, in_dims positional-only: ``info=`` is also an out argument of linalg_inv_ex.inverse)
    def rule(info, in_dims, /, *args, _kw_dims, **kwargs):
        targets = [kwargs.pop(n) for n in names]
        dims = [_kw_dims.get(n) for n in names]
        if any(d is None for d in dims) or any(
                d is not None for k, d in _kw_dims.items() if k not in names):
            raise Decline()  # an unbatched out=, or a batched non-out keyword argument
        if any(d is not None for d in in_dims):
            out, out_dims = base_rule(info, in_dims, *args, **kwargs)
        else:  # only the out= tensors are batched: compute once, broadcast into them
            out = base(*args, **kwargs)
            out_dims = None if isinstance(out, torch.Tensor) else type(out)(None for _ in out)
        outs = [out] if isinstance(out, torch.Tensor) else list(out)
        odims = [out_dims] if isinstance(out, torch.Tensor) else list(out_dims)
        if len(outs) != len(targets) or any(
                isinstance(o, torch.Tensor) and o.dtype != t.dtype
                for o, t in zip(outs, targets)):
            # An out= of another dtype: eager's rules differ by op (a cast for some, an error
            # for others, e.g. gather, aminmax, complex): the loop runs eager's per example.
            raise Decline()
        _write(op, info, outs, odims, targets, dims, is_out=True)
        if len(targets) == 1:
            return targets[0], dims[0]
        return tuple(targets), tuple(dims)

    return rule
