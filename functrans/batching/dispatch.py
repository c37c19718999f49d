"""The body of ``BatchedTensor.__torch_dispatch__``.

For one ATen call the dispatcher
1. finds the highest vmap level among the arguments (only wrappers of that level are unwrapped;
   wrappers of lower levels are ordinary tensors to this level, which is what makes nesting
   work: a rule's own ops re-dispatch into the lower level);
2. refuses a wrapper whose vmap already returned (an escaped BatchedTensor), except while the
   autograd engine runs a backward pass recorded inside that vmap;
3. checks cross-cutting conditions once for every op: in-place writes of batched values into
   unbatched tensors, in-place metadata changes, random ops under randomness='error';
4. looks the op up: overload -> packet -> tag -> decomposition -> loop fallback;
5. wraps the physical outputs at the same level.

Rules never see wrappers of their own level and never deal with the cases above.

Note [autograd on physical values]
Autograd runs above ``__torch_dispatch__`` and is switched off inside it.  When a physical value
requires grad, the rule runs with autograd switched back on, so its physical ops are recorded on
the physical values.  This is
how a transform OUTSIDE a vmap sees through it (``grad(vmap(f))``, ``jacrev(jacrev(f))``, a
parameter closed over by the vmapped function): its graph holds only physical tensors, so its
backward never meets a BatchedTensor of a vmap that has returned, and gradients of unbatched
tensors come out summed over the batch by ordinary broadcasting backward.  A transform INSIDE a
vmap (``vmap(grad(f))``) differentiates the wrappers themselves: autograd records on the
BatchedTensors of the live level, and the backward formulas are batched by the rules.  (When a
closed-over tensor that requires grad meets a BatchedTensor, autograd also records a node on the
wrapper; vmap returns the physical value, so that node is never differentiated through.)
Forward-mode AD is the exception: a tangent on a plain tensor that meets a BatchedTensor would be
propagated at both levels, which PyTorch cannot do.  So a ``jvp`` whose function runs a vmap takes
the exact double-vjp route (reverse mode only), and a raw ``forward_ad.dual_level`` around a
vmap is refused with an error (see ``vmap.api._check_forward_ad``).  Forward AD inside a vmap
(``vmap(jvp(f))``) records on the wrappers and is fully supported.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Dict, List, Tuple

import torch
import torch.autograd.forward_ad as _fwAD

from ..errors import EscapedBatchedTensorError, InplaceIntoUnbatchedError, UnsupportedUnderVmap
from .. import functionalize as _functionalize
from . import copied_views, registry
from .batched_tensor import BatchedTensor

_BT = BatchedTensor


class _OpMeta:
    """Per-op facts computed once: which arguments the op writes to."""

    __slots__ = ("op", "mutable_pos", "mutable_kw", "inplace_view", "random", "returns_self",
                 "returns_none", "checked", "how", "rule", "generation", "name",
                 "rule_checks_inplace", "uninitialized", "query")

    def __init__(self, op: torch._ops.OpOverload):
        self.op = op  # keeps the overload alive, so its id() stays a valid key
        self.name = str(op)
        self.mutable_pos: List[int] = []
        self.mutable_kw: List[str] = []
        for i, a in enumerate(op._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                if a.kwarg_only:
                    self.mutable_kw.append(a.name)
                else:
                    self.mutable_pos.append(i)
        returns = op._schema.returns
        self.returns_none = not returns
        self.returns_self = bool(self.mutable_pos) and self.mutable_pos[0] == 0 and \
            len(returns) == 1 and returns[0].alias_info is not None
        self.inplace_view = torch.Tag.inplace_view in op.tags
        from .randomness import is_random_op
        self.random = is_random_op(op)
        self.uninitialized = op in (torch.ops.aten.empty_like.default,
                                    torch.ops.aten.new_empty.default)
        self.query = _METADATA_QUERIES.get(op)
        self.checked = bool(self.mutable_pos or self.mutable_kw or self.random
                            or self.inplace_view)
        self.how, self.rule, self.generation = "none", None, -1
        self.rule_checks_inplace = False


def _same_size(a, b):
    return a.shape == b.shape  # the shapes the caller sees: logical at every level


def _same_storage_numel(a, b):
    if type(a) is _BT and type(b) is _BT and a.level is b.level:
        return None  # both batched at one level: the rule compares the physical storages
    return a.numel() == b.numel()


# Metadata queries forward AD issues around every view of a dual tensor (``has_same_meta``).
# The randomness mode answers them from the wrappers' own metadata before any dispatching; a
# None answer means "ask the rule".
_METADATA_QUERIES = {torch.ops.aten.is_same_size.default: _same_size,
                     torch.ops.aten._has_same_storage_numel.default: _same_storage_numel}

# Keyed by id(op): OpOverload.__hash__ is a Python method, and this lookup runs on every op.
_op_meta: Dict[int, _OpMeta] = {}


def op_meta(op) -> _OpMeta:
    m = _op_meta.get(id(op))
    if m is None:
        m = _op_meta[id(op)] = _OpMeta(op)
    return m


def _unwrap(a, level):
    """(physical value, bdim) of one argument at ``level``."""
    if type(a) is _BT:
        if a.level is level:
            return a.value, a.bdim
        return a, None
    if type(a) in (list, tuple) and a and any(type(b) is _BT for b in a):
        vals, dims = [], []
        for b in a:
            v, d = _unwrap(b, level)
            vals.append(v)
            dims.append(d)
        return type(a)(vals), dims
    return a, None


def _wrap(out, out_dims, level):
    if out_dims is None:
        return out
    if isinstance(out_dims, int):
        return BatchedTensor(out, out_dims, level)
    return type(out)(_wrap(o, d, level) for o, d in zip(out, out_dims))


def _escaped_error(op, level) -> EscapedBatchedTensorError:
    return EscapedBatchedTensorError(
        f"vmap: {op} was called on a BatchedTensor of vmap level {level.id}, but that vmap has "
        "already returned. The tensor escaped its vmap (through a closure, a global, a list "
        "the function appended to, or a non-output attribute). Return it from the vmapped "
        "function instead, so vmap can turn it into an ordinary tensor with the batch dim.")


def _batched_any(dims) -> bool:
    if dims is None:
        return False
    if isinstance(dims, int):
        return True
    return any(d is not None for d in dims)


def _check_copied_views(op, meta: _OpMeta, args, kwargs) -> None:
    for i in meta.mutable_pos:
        if i < len(args) and isinstance(args[i], torch.Tensor):
            copied_views.check_write(op, args[i])
    for name in meta.mutable_kw:
        if isinstance(kwargs.get(name), torch.Tensor):
            copied_views.check_write(op, kwargs[name])


def _check_inplace(op, meta: _OpMeta, args, in_dims, kwargs, level) -> None:
    """Refuse a write of batched values into an unbatched tensor (see _inplace_error)."""
    for i in meta.mutable_pos:
        if i < len(args) and in_dims[i] is None and isinstance(args[i], torch.Tensor):
            if any(_batched_any(d) for j, d in enumerate(in_dims) if j != i) or any(
                    type(v) is _BT and v.level is level for v in kwargs.values()):
                raise _inplace_error(op, i)
    for name in meta.mutable_kw:
        out = kwargs.get(name)
        if isinstance(out, torch.Tensor) and not (type(out) is _BT and out.level is level):
            if any(_batched_any(d) for d in in_dims):
                raise _inplace_error(op, name)


def _inplace_error(op, which) -> InplaceIntoUnbatchedError:
    arg = f"argument {which}" if isinstance(which, int) else f"the {which}= argument"
    return InplaceIntoUnbatchedError(
        f"vmap: {op} is an in-place operation that would write a batched value into "
        f"{arg}, which is not batched (it was created inside the function with a factory like "
        "torch.zeros(shape), or captured from outside vmap). Each example would need its own "
        "copy of that tensor. Create it from a batched input instead, e.g. "
        "torch.zeros_like(x) or x.new_zeros(shape), or use the out-of-place version of the op"
        + (" (out[i] = v, out[mask] = v and out += v are in-place writes into out; build the "
           "result with torch.stack, torch.cat or torch.where instead)."
           if op.overloadpacket.__name__ in ("copy_", "index_put_", "add_", "masked_fill_",
                                             "fill_", "sub_", "mul_", "div_")
           else "."))


_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality,
                  torch._C.DispatchKey.ADInplaceOrView)


def autograd_on_physical_values():
    """Re-enable autograd (switched off inside __torch_dispatch__) for physical ops.
    See Note [autograd on physical values]."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    if not exclude.has(_AUTOGRAD_KEYS[0]):
        return contextlib.nullcontext()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    guard = torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)
    if _fwAD._current_level < 0:
        return guard
    return _WithoutForwardAD(guard)


class _WithoutForwardAD:
    """Reverse mode only for the physical ops of a rule while a dual level is open.  Forward AD
    has already run on the wrappers (the op's tangent is computed above __torch_dispatch__);
    a dual tensor among the physical values (an unbatched primal of a jvp inside the vmap,
    whose tangent is batched) would have its tangent propagated a second time, on physical
    layouts that forward AD's view/layout bookkeeping does not expect (a crash in PyTorch)."""
    __slots__ = ("guard", "prev")

    def __init__(self, guard):
        self.guard = guard

    def __enter__(self):
        self.guard.__enter__()
        self.prev = _fw_grad_enabled()
        _set_fw_grad_enabled(False)

    def __exit__(self, *exc):
        _set_fw_grad_enabled(self.prev)
        return self.guard.__exit__(*exc)


def _inplace_view(op, args, kwargs, level):
    """``x.squeeze_()``, ``x.unsqueeze_(d)``, ``x.transpose_(a, b)``...: run the out-of-place
    op, then rebind the wrapper to its result and update the wrapper's logical metadata.
    These ops change metadata and write no values, so the check for batched values written
    into an unbatched tensor does not apply; an unbatched ``self`` is refused below, except
    for ``resize_as_``, which reads only its template's logical shape: one shared resize (and
    a batched ``self`` that already has the template's shape is eager's no-op)."""
    self_ = args[0]
    name = op.overloadpacket.__name__.rstrip("_")
    if name == "resize_as" and kwargs.get("memory_format", args[2] if len(args) > 2 else None) \
            in (None, torch.contiguous_format):
        batched_self = type(self_) is _BT and self_.level is level
        if not batched_self:
            torch.ops.aten.resize_.default(self_, list(args[1].shape))
            return self_
        if tuple(self_.shape) == tuple(args[1].shape) and len(args) < 3 and not kwargs:
            return self_
    functional = getattr(torch.ops.aten, name, None) if name != "as_strided" else None
    if type(self_) is not _BT or self_.level is not level or functional is None:
        raise UnsupportedUnderVmap(
            f"vmap: {op} changes the shape or strides of a tensor in place, and functrans has no "
            "out-of-place counterpart for it under vmap. Use the out-of-place version "
            "(e.g. x = x.unsqueeze(0) instead of x.unsqueeze_(0)).")
    result = functional(*args, **kwargs)
    try:
        with torch._C._DisableTorchDispatch():
            torch.Tensor.as_strided_(self_, result.shape, result.stride())
    except RuntimeError as e:
        if name not in ("resize", "resize_as"):
            raise
        raise UnsupportedUnderVmap(
            f"vmap: {op} would grow a batched tensor from {tuple(self_.shape)} to "
            f"{tuple(result.shape)} elements per example. Under vmap a batched tensor cannot "
            "grow its storage in place. Create a tensor of the new shape instead, e.g. "
            "x.new_zeros(shape) (then copy into it), or resize outside vmap.") from None
    self_.value, self_.bdim = result.value, result.bdim
    return self_


_fw_grad_enabled = torch._C._is_fwd_grad_enabled
_set_fw_grad_enabled = torch._C._set_fwd_grad_enabled
_inference_mode = torch.is_inference_mode_enabled


def _refuse_custom_function_under_outer_grad(args, level) -> None:
    """A custom ``autograd.Function`` runs its forward with both grad modes off.  If a batched
    argument's physical value requires grad, a transform outside this vmap differentiates
    through it (Note [autograd on physical values]); that transform would record none of the
    forward's ops and never call the Function's backward: a silently wrong gradient.  (A
    wrapper that requires grad itself belongs to a transform inside the vmap, which records the
    Function's node on the wrappers: that case is fine.)  New-style Functions with a vmap
    staticmethod or ``generate_vmap_rule`` never get here under an outer transform: see
    batching/custom_function.py."""
    for a in args:
        if type(a) is _BT and a.level is level and a.value.requires_grad and \
                not a.requires_grad:
            raise UnsupportedUnderVmap(
                "vmap: a custom torch.autograd.Function ran on batched values that a "
                "transform outside this vmap differentiates (grad/jacrev/vjp around the vmap, "
                "or .backward() on its result). That transform sees the vmap's physical ops, "
                "and a Function's forward runs without recording them, so its backward would "
                "never be called and the gradient would be silently wrong. Put the gradient "
                "transform inside the vmap (vmap(grad(f)) instead of grad(vmap(f))), write "
                "the function with ordinary torch operations, or make the Function new-style "
                "(forward without ctx, a setup_context staticmethod) with a vmap staticmethod "
                "or generate_vmap_rule = True, which functrans differentiates from outside a "
                "vmap.")


def _resolve(op, meta: _OpMeta) -> None:
    meta.how, meta.rule = registry.find_rule(op)
    meta.rule_checks_inplace = getattr(meta.rule, "checks_inplace", False)
    meta.generation = registry.generation()


def dispatch(op, args: Tuple[Any, ...], kwargs: Dict[str, Any], meta: _OpMeta = None,
             _guarded: bool = False):
    # One pass to find the top level (wrappers of the highest level are unwrapped below).
    level = None
    for a in args:
        t = type(a)
        if t is _BT:
            if level is None or a.level.id > level.id:
                level = a.level
        elif (t is list or t is tuple) and a:
            for b in a:
                if type(b) is _BT and (level is None or b.level.id > level.id):
                    level = b.level
    if kwargs:
        for a in kwargs.values():
            if type(a) is _BT:
                if level is None or a.level.id > level.id:
                    level = a.level
            elif type(a) in (list, tuple):
                for b in a:
                    if type(b) is _BT and (level is None or b.level.id > level.id):
                        level = b.level
    if not level.alive and torch._C._current_autograd_node() is None:
        raise _escaped_error(op, level)
    if _functionalize._active_anywhere and not _guarded:
        # functionalize(vmap(f)): the physical values are functional wrappers, and PyTorch
        # excludes the Functionalize key inside __torch_dispatch__ (see functrans.functionalize).
        # (Re-entered with _guarded rather than split into two functions: one Python call
        # less on every op of the common path.)
        guard = _functionalize.physical_functionalization(level)
        if guard is not None:
            with guard:
                return dispatch(op, args, kwargs, meta, _guarded=True)

    if meta is None:
        meta = _op_meta.get(id(op)) or op_meta(op)
    if meta.generation != registry.generation():
        _resolve(op, meta)
    if meta.how == "cia":
        return op.decompose(*args, **kwargs)

    # One pass to unwrap this level, with the bdims and whether autograd must see physical ops.
    grad_on = torch.is_grad_enabled()
    track = False
    batched = False
    vals: List[Any] = []
    in_dims: List[Any] = []
    for a in args:
        t = type(a)
        if t is _BT:
            if a.level is level:
                v = a.value
                vals.append(v)
                in_dims.append(a.bdim)
                batched = True
            else:
                v = a
                vals.append(a)
                in_dims.append(None)
            if grad_on and not track and v.requires_grad:
                track = True
        elif (t is list or t is tuple) and a and any(type(b) is _BT for b in a):
            v, d = _unwrap(a, level)
            vals.append(v)
            in_dims.append(d)
            batched = batched or any(x is not None for x in d)
            if grad_on and not track:
                track = any(isinstance(x, torch.Tensor) and x.requires_grad for x in v)
        else:
            vals.append(a)
            in_dims.append(None)
            if grad_on and not track and isinstance(a, torch.Tensor) and a.requires_grad:
                track = True
    kw_batched = False
    if kwargs:
        for v in kwargs.values():
            if type(v) is _BT and v.level is level:
                kw_batched = True
            if grad_on and isinstance(v, torch.Tensor) and v.requires_grad:
                track = True

    if not grad_on and batched and not _fw_grad_enabled() and not _inference_mode():
        # Both grad modes off, outside inference mode: a custom autograd.Function's forward.
        _refuse_custom_function_under_outer_grad(args, level)

    if not batched and not kw_batched:
        # Nothing at this level is batched: run the op one level down.
        if track:
            with autograd_on_physical_values():
                return op(*vals, **kwargs)
        return op(*vals, **kwargs)

    # A rule registered with checks_inplace=True decides itself which writes into unbatched
    # tensors are possible (batch norm's running stats: none in eval mode, one shared update
    # for an unbatched input); the fallback still gets the generic check.
    rule_checks = meta.rule_checks_inplace and not kw_batched
    if meta.checked:
        if meta.inplace_view:   # metadata only: see _inplace_view
            return _inplace_view(op, args, kwargs, level)
        if meta.mutable_pos or meta.mutable_kw:
            if copied_views._copies:
                _check_copied_views(op, meta, vals, kwargs)
            if not rule_checks:
                _check_inplace(op, meta, vals, in_dims, kwargs, level)
        if meta.random and level.randomness == "error":
            from .randomness import draws_random, random_error
            if draws_random(op, args, kwargs):
                raise random_error(op)

    rule = meta.rule
    call_kwargs = kwargs
    if kw_batched:
        if rule is not None and getattr(rule, "batched_kwargs", False):
            # out= variants (derived.py): the rule gets physical keyword values and their bdims.
            call_kwargs, kw_dims = {}, {}
            for k, v in kwargs.items():
                call_kwargs[k], kw_dims[k] = _unwrap(v, level)
            call_kwargs["_kw_dims"] = kw_dims
        else:
            rule = None  # rules take bdims for positional arguments only
    if rule is None:
        from .decompositions import RAISED, confirming, run_decomposition
        from .fallback import loop_fallback
        done, result = run_decomposition(op, args, kwargs)
        if done:
            return result
        rule = functools.partial(loop_fallback, op)
        if result is RAISED:
            rule = confirming(op, rule)
    try:
        try:
            if track:
                with autograd_on_physical_values():
                    out, out_dims = rule(level, in_dims, *vals, **call_kwargs)
            else:
                out, out_dims = rule(level, in_dims, *vals, **call_kwargs)
        except registry.Decline:
            from .fallback import loop_fallback
            if rule_checks:
                _check_inplace(op, meta, vals, in_dims, kwargs, level)
            with autograd_on_physical_values() if track else contextlib.nullcontext():
                out, out_dims = loop_fallback(op, level, in_dims, *vals, _declined=True,
                                              **kwargs)
    except Exception as e:
        if not isinstance(e, (UnsupportedUnderVmap, EscapedBatchedTensorError)):
            e.add_note(f"(functrans: while batching {op} with in_dims={tuple(in_dims)}, "
                       f"batch size {level.batch_size})")
        raise

    if meta.returns_self and type(args[0]) is _BT and args[0].level is level:
        return args[0]  # in-place ops return self: the rule wrote into its physical value
    if meta.returns_none:
        return None
    if meta.mutable_kw and kw_batched:
        outs = tuple(kwargs.get(k) for k in meta.mutable_kw)
        if all(type(o) is _BT and o.level is level for o in outs):
            # out= ops return their out tensors themselves, as in eager.
            return outs[0] if len(outs) == 1 else outs
    if type(out_dims) is int:
        return BatchedTensor(out, out_dims, level)
    return _wrap(out, out_dims, level)
