"""One ATen call on BatchedTensors, as named steps in the order they run.

``dispatch(op, args, kwargs)`` is called by the level's dispatch mode (``mode.py``) for every op
with a wrapper among its arguments (and by ``BatchedTensor.__torch_dispatch__`` when no mode is
active).  The steps:

1. ``top_level``: the innermost vmap level among the arguments (``batched_tensor.py``).  Only
   wrappers of that level are unwrapped; wrappers of lower levels are ordinary tensors to this
   level, which is what makes nesting work: a rule's own ops re-dispatch into the lower level.
   ``guards.check_alive`` refuses a wrapper whose vmap already returned.
2. ``registry.entry(op)``: the op's record (its rule and how it was found, its flags).
   CompositeImplicitAutograd ops run their own decomposition here.
3. ``unwrap``: the physical values of this level, their bdims, whether anything is batched,
   and whether autograd must see the physical ops (Note [autograd on physical values]).
   An op with nothing batched at this level runs one level down (``run_below``).
4. ``check_guards``: every refusal made before a rule runs (``guards.py``); in-place metadata
   ops (``x.unsqueeze_(0)``) take their own route (``run_inplace_view``).
5. ``run``: the rule; if it declines, the loop fallback; with no rule, a decomposition
   (``decompositions.py``, which runs on the wrappers and returns wrapped outputs), else the loop
   fallback (``fallback.py``).
6. ``rewrap``: the physical outputs wrapped at the same level (in-place ops return ``self``).

Rules never see wrappers of their own level and never deal with the cases above.

Imports: errors, functionalization (its state: is a functionalize active?), batched_tensor,
registry, guards, decompositions, fallback.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Dict, List, Tuple

import torch
import torch.autograd.forward_ad as _fwAD

from ..errors import EscapedBatchedTensorError, UnsupportedUnderVmap
from .. import functionalization as _functionalization
from . import decompositions, guards, registry
from .batched_tensor import BatchedTensor, at_level, top_level
from .fallback import loop_fallback

_BT = BatchedTensor
_entries = registry._entries   # the registry's cache, read directly on the hot path


def dispatch(op, args: Tuple[Any, ...], kwargs: Dict[str, Any], entry=None,
             _guarded: bool = False):
    # 1. the level
    level = top_level(args, kwargs)
    if not level.alive:
        guards.check_alive(op, level)
    if _functionalization._active_anywhere and not _guarded:
        # functionalize(vmap(f)): the physical values are functional wrappers, and PyTorch
        # excludes the Functionalize key inside __torch_dispatch__ (see
        # functrans/functionalization.py).
        # (Re-entered with _guarded rather than split into two functions: one Python call
        # less on every op of the common path.)
        guard = _functionalization.physical_functionalization(level)
        if guard is not None:
            with guard:
                return dispatch(op, args, kwargs, entry, _guarded=True)

    # 2. the op's record
    if entry is None:
        entry = _entries.get(id(op)) or registry.entry(op)
    if entry.how == "cia":
        return entry.decompose(*args, **kwargs)

    # 3. unwrap
    grad_on = _grad_enabled()
    vals, in_dims, batched, kw_batched, track = unwrap(args, kwargs, level, grad_on)
    if not batched and not kw_batched:
        return run_below(op, vals, kwargs, track)

    # 4. guards
    if entry.inplace_view:
        return run_inplace_view(op, args, kwargs, level)
    rule_checks = entry.checks_inplace and not kw_batched
    if entry.checked or not grad_on:
        check_guards(op, entry, args, vals, in_dims, kwargs, level, rule_checks, grad_on)

    # 5. rule -> decline -> decomposition -> fallback
    rule = entry.rule
    call_kwargs = kwargs
    if kw_batched:
        if rule is not None and entry.batched_kwargs:
            # out= variants (Note [derived rules]): physical keyword values and their bdims.
            call_kwargs, kw_dims = {}, {}
            for k, v in kwargs.items():
                call_kwargs[k], kw_dims[k] = _unwrap_one(v, level)
            call_kwargs["_kw_dims"] = kw_dims
        else:
            rule = None  # rules take bdims for positional arguments only
    if rule is None:
        done, result = decompositions.run_decomposition(op, args, kwargs)
        if done:
            return result   # the decomposition ran on the wrappers: already wrapped
        rule = functools.partial(loop_fallback, op)
        if result is not None:   # it raised: an error of the input's, or of the decomposition
            rule = decompositions.confirming(op, rule, result.error)
    out, out_dims = run(op, entry, rule, level, vals, in_dims, call_kwargs, kwargs, track,
                        rule_checks)

    # 6. rewrap
    return rewrap(entry, args, kwargs, kw_batched, out, out_dims, level)


def unwrap(args, kwargs, level, grad_on: bool):
    """``(vals, in_dims, batched, kw_batched, track)``: the physical values of ``args`` at
    ``level`` and their bdims; whether a positional / keyword argument is batched at this
    level; whether autograd must record the physical ops (a physical value requires grad
    while grad mode (``grad_on``) is on: Note [autograd on physical values])."""
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
            v, d = _unwrap_one(a, level)
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
    return vals, in_dims, batched, kw_batched, track


def _unwrap_one(a, level):
    """(physical value, bdim) of one argument at ``level`` (lists and tuples elementwise)."""
    if type(a) in (list, tuple) and a and any(type(b) is _BT for b in a):
        vals, dims = [], []
        for b in a:
            v, d = _unwrap_one(b, level)
            vals.append(v)
            dims.append(d)
        return type(a)(vals), dims
    return at_level(a, level)


def run_below(op, vals, kwargs, track):
    """Nothing is batched at this level: run the op one level down."""
    if track:
        with autograd_on_physical_values():
            return op(*vals, **kwargs)
    return op(*vals, **kwargs)


def check_guards(op, entry, args, vals, in_dims, kwargs, level, rule_checks, grad_on) -> None:
    """The refusals of ``guards.py`` that apply to this op and call.

    A rule registered with ``checks_inplace=True`` decides itself which writes into unbatched
    tensors are possible (batch norm's running stats: none in eval mode, one shared update for
    an unbatched input); the fallback after a Decline still gets the generic check."""
    if entry.checked:
        if entry.written_pos or entry.written_kw:
            guards.check_writes(op, entry, vals, in_dims, kwargs, level, rule_checks)
        if entry.random:
            guards.check_random(op, args, kwargs, level)
    if not grad_on and not _fw_grad_enabled() and not _inference_mode():
        # Both grad modes off, outside inference mode: a custom autograd.Function's forward.
        guards.check_custom_function(args, level)


def run(op, entry, rule, level, vals, in_dims, call_kwargs, kwargs, track, rule_checks):
    """``rule(level, in_dims, *vals)``; a Decline hands the call to the loop fallback.  Errors
    other than functrans's own get a note naming the op, its in_dims and the batch size."""
    try:
        try:
            if track:
                with autograd_on_physical_values():
                    return rule(level, in_dims, *vals, **call_kwargs)
            return rule(level, in_dims, *vals, **call_kwargs)
        except registry.Decline:
            if rule_checks:
                guards.check_inplace(op, entry, vals, in_dims, kwargs, level)
            with autograd_on_physical_values() if track else contextlib.nullcontext():
                return loop_fallback(op, level, in_dims, *vals, _declined=True, **kwargs)
    except Exception as e:
        if not isinstance(e, (UnsupportedUnderVmap, EscapedBatchedTensorError)):
            e.add_note(f"(functrans: while batching {op} with in_dims={tuple(in_dims)}, "
                       f"batch size {level.batch_size})")
        raise


def rewrap(entry, args, kwargs, kw_batched, out, out_dims, level):
    """The rule's physical outputs as wrappers of ``level`` (what eager returns)."""
    if entry.returns_self and type(args[0]) is _BT and args[0].level is level:
        return args[0]  # in-place ops return self: the rule wrote into its physical value
    if entry.returns_none:
        return None
    if entry.written_kw and kw_batched:
        outs = tuple(kwargs.get(k) for k in entry.written_kw)
        if all(type(o) is _BT and o.level is level for o in outs):
            # out= ops return their out tensors themselves, as in eager.
            return outs[0] if len(outs) == 1 else outs
    if type(out_dims) is int:
        return BatchedTensor(out, out_dims, level)
    return _wrap(out, out_dims, level)


def _wrap(out, out_dims, level):
    if out_dims is None:
        return out
    if isinstance(out_dims, int):
        return BatchedTensor(out, out_dims, level)
    return type(out)(_wrap(o, d, level) for o, d in zip(out, out_dims))


def _restrides_only_unit_dims(t, args, kwargs) -> bool:
    """``t.as_strided_(size, stride[, offset])`` that keeps ``t``'s logical shape and offset and
    changes only the strides of size-1 dims: the same values in another layout, so a batched
    ``t`` can stay as it is (ATen's ``adaptive_avg_pool2d(x, 1)`` of a channels_last input
    restrides its ``[N, C, 1, 1]`` mean so: issue 25, timm's ConvNeXt)."""
    size = args[1] if len(args) > 1 else kwargs.get("size")
    stride = args[2] if len(args) > 2 else kwargs.get("stride")
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    if size is None or stride is None or tuple(size) != tuple(t.shape) \
            or len(stride) != len(size):
        return False
    if offset is not None and offset != t.storage_offset():
        return False
    return all(n == 1 or s == cur for n, s, cur in zip(size, stride, t.stride()))


def run_inplace_view(op, args, kwargs, level):
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
    if name == "as_strided" and type(self_) is _BT and self_.level is level \
            and _restrides_only_unit_dims(self_, args, kwargs):
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


_grad_enabled = torch.is_grad_enabled
_fw_grad_enabled = torch._C._is_fwd_grad_enabled
_set_fw_grad_enabled = torch._C._set_fwd_grad_enabled
_inference_mode = torch.is_inference_mode_enabled


# ----------------------------------------------------------------------------- autograd
# Note [autograd on physical values]
# Autograd runs above ``__torch_dispatch__`` and is switched off inside it.  When a physical value
# requires grad, the rule runs with autograd switched back on, so its physical ops are recorded on
# the physical values.  This is
# how a transform OUTSIDE a vmap sees through it (``grad(vmap(f))``, ``jacrev(jacrev(f))``, a
# parameter closed over by the vmapped function): its graph holds only physical tensors, so its
# backward never meets a BatchedTensor of a vmap that has returned, and gradients of unbatched
# tensors come out summed over the batch by ordinary broadcasting backward.  A transform INSIDE a
# vmap (``vmap(grad(f))``) differentiates the wrappers themselves: autograd records on the
# BatchedTensors of the live level, and the backward formulas are batched by the rules.  (When a
# closed-over tensor that requires grad meets a BatchedTensor, autograd also records a node on the
# wrapper; vmap returns the physical value, so that node is never differentiated through.)
# Forward-mode AD is the exception: a tangent on a plain tensor that meets a BatchedTensor would be
# propagated at both levels, which PyTorch cannot do.  So a ``jvp`` whose function runs a vmap takes
# the exact double-vjp route (reverse mode only), and a raw ``forward_ad.dual_level`` around a
# vmap is refused with an error (see ``api._check_forward_ad``).  Forward AD inside a vmap
# (``vmap(jvp(f))``) records on the wrappers and is fully supported.

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
