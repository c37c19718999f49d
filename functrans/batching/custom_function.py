"""Custom ``torch.autograd.Function``\\ s under vmap: the ``vmap`` staticmethod and
``generate_vmap_rule``.

This module owns what ``Function.apply`` does when one of its arguments is a ``BatchedTensor`` of
a live vmap level, following the contract PyTorch documents for its own vmap (``extending.func``):

* a Function with a ``vmap(info, in_dims, *args)`` staticmethod: the staticmethod is called on
  the physical values (``info.batch_size``, ``info.randomness``; one ``in_dim`` per argument,
  None for unbatched ones) *below* the level (that level's dispatch mode is popped, so its own
  random draws are plain), and its ``(output, out_dims)`` are wrapped back at the level.
  ``out_dims`` may be an int, None, or a tuple matching the outputs.  The Function's
  ``setup_context`` / ``backward`` / ``jvp`` are attached to the *wrappers* by a generated
  Function (as PyTorch's ``generate_single_level_function`` does), so a transform inside the
  vmap (``vmap(grad(f))``, ``vmap(jvp(f))``) calls them on batched values, and a transform outside
  it (``grad(vmap(f))``, ``jacrev``) sees what the staticmethod did to the physical values (the
  staticmethod usually calls ``Function.apply`` again on them, which records the Function's node
  there).
* ``generate_vmap_rule = True``: when nothing outside the vmap differentiates the arguments, the
  forward runs on the wrappers (the vmap of the forward at this level) and autograd records the
  Function on them, as functrans did for every Function before.  When something may (a physical
  value, or an unbatched argument, requires grad: ``grad(vmap(f))``, ``jacrev(vmap(f))``), the
  rule is a "vmapified" Function applied to the physical values, whose forward, setup_context
  and backward are the Function's run under a fresh vmap of the same size and randomness, with
  the gradients reduced to each input's batch dim and per-example shape (PyTorch's
  ``vmapify_autograd_function``); the Function's own node is still put on the wrappers.
* a new-style Function (``setup_context``) with neither raises ``UnsupportedUnderVmap``, as
  PyTorch's vmap raises; so does one with both.
* old-style Functions (``forward(ctx, ...)``, no ``setup_context``) keep today's behaviour: the
  forward runs on the wrappers.

How functrans sees ``Function.apply``: PyTorch's ``apply`` asks
``torch._C._are_functorch_transforms_active()``, which is False for functrans, and
``_FunctionBase.apply`` offers no ``__torch_function__`` hook (a ``TorchFunctionMode`` sees only
the ops inside the forward).  So ``install()`` (run once when functrans is imported) replaces
``torch.autograd.Function.apply`` with ``_apply``, which hands every call to PyTorch's own
``apply`` unless an argument is a ``BatchedTensor`` of a live level.  It is installed for good,
not only while a vmap runs, because ``vmap(MyFn.apply)`` binds the method before the vmap starts.
Its cost outside vmap is a scan of the arguments' types (about 0.4 us on the 4-15 us of an
``apply``, measured on CPU); no ordinary op pays anything.  ``uninstall()`` restores PyTorch's
method.

Imports: _levels, _pytree, errors, batched_tensor, mode.
"""
from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode, _push_mode

from .. import _levels
from .._pytree import broadcast_prefix, tree_flatten, tree_unflatten
from ..errors import UnsupportedUnderVmap
from .batched_tensor import BatchedTensor, at_level, top_level
from .mode import VmapLevelMode

_BT = BatchedTensor
_Function = torch.autograd.Function
_original_apply = _Function.__dict__["apply"]  # the classmethod object PyTorch defines
_original_apply_fn = _original_apply.__func__
_base_setup_context = getattr(torch.autograd.function, "_SingleLevelFunction",
                              torch.autograd.Function).setup_context
_base_vmap = _Function.vmap


class VmapInfo(NamedTuple):
    """The ``info`` argument of a Function's ``vmap`` staticmethod."""
    batch_size: int
    randomness: str


def _top_level(args):
    """The innermost live vmap level among the arguments, or None."""
    level = top_level(args)
    return level if level is not None and level.alive else None


def _saves_inputs_only(cls) -> bool:
    """``torch.utils.checkpoint``'s ``_NoopSaveInputs`` (torch 2.11; later torches save the
    checkpoint's inputs on the frame, with no Function): its forward reads no value (it returns
    a fresh ``torch.empty((0,))``), its backward is never run, and its ``setup_context`` only
    saves the inputs for the recomputation.  Under vmap it is applied to the wrappers as they
    are, so the recomputation sees the same batched inputs as the forward (what later torches'
    ``_CheckpointFrame.save_inputs`` does with the wrappers)."""
    return cls.__name__ == "_NoopSaveInputs" and cls.__module__ == "torch.utils.checkpoint"


def _apply(cls, *args, **kwargs):
    """``torch.autograd.Function.apply`` while functrans is imported (see the module docstring)."""
    if args:
        level = _top_level(args)
        if level is not None and cls.setup_context is not _base_setup_context \
                and not _saves_inputs_only(cls):
            return _apply_under_vmap(cls, level, args, kwargs)
    return _original_apply_fn(cls, *args, **kwargs)


def install() -> None:
    if _Function.__dict__["apply"] is _original_apply:
        _Function.apply = classmethod(_apply)


def uninstall() -> None:
    if _Function.__dict__["apply"] is not _original_apply:
        _Function.apply = _original_apply


def _apply_under_vmap(cls, level, args, kwargs):
    signature = inspect.signature(cls.forward)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    args, kwargs = bound.args, bound.kwargs
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            raise UnsupportedUnderVmap(
                f"vmap: {cls.__name__}.apply got the tensor {k}= as a keyword-only argument "
                "inside a vmapped function. An autograd.Function under vmap takes tensors as "
                "positional arguments only (as in PyTorch's vmap); pass it positionally.")
    has_rule = cls.vmap is not _base_vmap
    if cls.generate_vmap_rule:
        if has_rule:
            raise UnsupportedUnderVmap(
                f"vmap: {cls.__name__} has both generate_vmap_rule=True and its own vmap "
                "staticmethod, so it is ambiguous which one batches it. Set "
                "generate_vmap_rule=False to use the staticmethod, or delete the staticmethod "
                "to vmap the forward (only if forward, backward and jvp use PyTorch ops).")
        if _outer_graph_needed(args, level):
            return _call_generated(_generated(cls, "_functrans_vmapified"),
                                   _Call(level, kwargs, True), args)
        return _original_apply_fn(cls, *args, **kwargs)
    if not has_rule:
        raise UnsupportedUnderVmap(
            f"vmap: {cls.__name__}.apply was called on batched tensors inside a vmapped "
            f"function, but {cls.__name__} has no vmap support. Override its vmap staticmethod "
            "(vmap(info, in_dims, *args) -> (output, out_dims)), or set "
            "generate_vmap_rule = True on the class if its forward, backward and jvp are "
            "written with PyTorch operations.")
    return _call_generated(_generated(cls, "_functrans_vmapped"),
                           _Call(level, kwargs, torch.is_grad_enabled()), args)


def _call_generated(gen, call, args):
    out = gen.apply(*args, call)
    if call.plain:
        # Unbatched outputs that carry the physical graph of the rule are returned as the rule
        # made them: the generated node on them would call the Function's backward on the
        # wrappers even for a transform outside the vmap (after it has returned).  The node
        # stays on batched outputs (a transform inside the vmap) and on unbatched outputs
        # with no graph of their own.
        if isinstance(out, tuple):
            out = tuple(call.plain.get(i, o) for i, o in enumerate(out))
        else:
            out = call.plain.get(0, out)
    return out


def _outer_graph_needed(args, level) -> bool:
    """May a transform outside ``level`` differentiate through these arguments: a physical
    value (or a value of a value, for nested vmaps) requires grad, or an unbatched argument
    does (it may belong to a transform inside the vmap or outside it: both graphs are made)?"""
    if not torch.is_grad_enabled():
        return False
    for a in args:
        for b in (a if type(a) in (list, tuple) else (a,)):
            if type(b) is not _BT or b.level is not level:
                if isinstance(b, torch.Tensor) and b.requires_grad:
                    return True
            else:
                v = b.value
                while True:
                    if v.requires_grad:
                        return True
                    if type(v) is not _BT:
                        break
                    v = v.value
    return False


class _Call:
    """What one call passes to the generated Function besides the user's arguments."""
    __slots__ = ("level", "kwargs", "grad_enabled", "plain")

    def __init__(self, level, kwargs, grad_enabled):
        self.level, self.kwargs, self.grad_enabled = level, kwargs, grad_enabled
        self.plain = None  # output index -> unbatched output with a graph (_call_generated)


class _Below:
    """Run code below ``level``: pop the dispatch modes of that level and of inner levels
    (they sit on top of the dispatch mode stack), push them back afterwards."""
    __slots__ = ("level", "popped")

    def __init__(self, level):
        self.level = level

    def __enter__(self):
        self.popped = []
        while True:
            mode = _get_current_dispatch_mode()
            if not (isinstance(mode, VmapLevelMode) and mode.level.id >= self.level.id):
                break
            self.popped.append(_pop_mode())

    def __exit__(self, *exc):
        for mode in reversed(self.popped):
            _push_mode(mode)


def _unwrap(a, level):
    if type(a) in (list, tuple) and any(type(b) is _BT for b in a):
        pairs = [_unwrap(b, level) for b in a]
        return type(a)(p[0] for p in pairs), type(a)(p[1] for p in pairs)
    return at_level(a, level)


def _is_dim_leaf(x) -> bool:
    return x is None or (isinstance(x, int) and not isinstance(x, bool))


def _run_vmap_rule(cls, rule, call: _Call, args):
    level = call.level
    pairs = [_unwrap(a, level) for a in args]
    vals = [p[0] for p in pairs]
    in_dims = tuple(p[1] for p in pairs)
    info = VmapInfo(level.batch_size, level.randomness)
    with torch.set_grad_enabled(call.grad_enabled), _Below(level):
        result = rule(info, in_dims, *vals, **call.kwargs)
    if not isinstance(result, tuple) or len(result) != 2:
        got = f"a {type(result).__name__}" if not isinstance(result, tuple) else \
            f"{len(result)} values"
        raise UnsupportedUnderVmap(
            f"vmap: {cls.__name__}.vmap must return a tuple (output, out_dims), with out_dims "
            f"of the same structure as output (an int or None per output); it returned {got}.")
    output, out_dims = result
    flat, spec = tree_flatten(output)
    flat_dims = broadcast_prefix(out_dims, output, _is_dim_leaf)
    if flat_dims is None or not all(_is_dim_leaf(d) for d in flat_dims):
        raise UnsupportedUnderVmap(
            f"vmap: {cls.__name__}.vmap returned out_dims={out_dims!r}, which does not match "
            f"its output ({len(flat)} value(s)). Give an int or None per output (a tuple for a "
            "tuple of outputs), or one int for all of them.")
    by_id = {}
    for a, v in zip(args, vals):
        if isinstance(v, torch.Tensor):
            by_id[id(v)] = a
    wrapped = []
    for i, (o, d) in enumerate(zip(flat, flat_dims)):
        if not isinstance(o, torch.Tensor):
            wrapped.append(o)
        elif id(o) in by_id:  # an input returned as is (mark_dirty needs the same object)
            wrapped.append(by_id[id(o)])
        elif d is None:
            if o.requires_grad and type(o) is not _BT:
                call.plain = call.plain or {}
                call.plain[i] = o
                o = o.detach()
            wrapped.append(o)
        else:
            if not -o.dim() <= d < o.dim():
                raise UnsupportedUnderVmap(
                    f"vmap: {cls.__name__}.vmap returned out_dims[{i}]={d} for an output of "
                    f"shape {tuple(o.shape)}; expected an out_dim in [{-o.dim()}, "
                    f"{o.dim() - 1}] (the dim of that physical output that is the batch).")
            d %= o.dim()
            if o.shape[d] != level.batch_size:
                raise UnsupportedUnderVmap(
                    f"vmap: {cls.__name__}.vmap returned an output of shape {tuple(o.shape)} "
                    f"with out_dim {d}, but the batch size is {level.batch_size} "
                    f"(info.batch_size); the out_dim must name the batch dim of the output.")
            wrapped.append(BatchedTensor(o, d, level))
    return tree_unflatten(wrapped, spec)


def _generated(cls, attr):
    """A Function whose forward runs a vmap rule on the physical values and whose
    setup_context / backward / jvp are ``cls``'s, on the wrappers (PyTorch's
    ``generate_single_level_function``).  The rule is ``cls.vmap`` (attr ``_functrans_vmapped``)
    or, for ``generate_vmap_rule``, ``_vmapified_rule`` (attr ``_functrans_vmapified``).  Its
    last argument is the ``_Call`` (last, so that ``ctx.needs_input_grad[i]`` is still the
    user's argument i); it gets no gradient."""
    gen = cls.__dict__.get(attr)  # on the class itself: a subclass gets its own
    if gen is not None:
        return gen
    rule = cls.vmap if attr == "_functrans_vmapped" else \
        (lambda info, in_dims, *vals, **kw: _vmapified_rule(cls, info, in_dims, vals, kw))

    def forward(*args):
        return _run_vmap_rule(cls, rule, args[-1], args[:-1])

    def setup_context(ctx, inputs, output):
        return cls.setup_context(ctx, inputs[:-1], output)

    def backward(ctx, *grads):
        result = cls.backward(ctx, *grads)
        if isinstance(result, tuple):
            return (*result, None)
        return result, None

    def jvp(ctx, *tangents):
        return cls.jvp(ctx, *tangents[:-1])

    gen = type(f"{cls.__name__}Vmapped", (_Function,),
               {"forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
                "backward": staticmethod(backward), "jvp": staticmethod(jvp),
                "apply": classmethod(_base_apply)})
    type.__setattr__(cls, attr, gen)
    return gen


def _base_apply(cls, *args):
    # PyTorch's _FunctionBase.apply, bypassing Function.apply (and so this module's _apply).
    return super(_Function, cls).apply(*args)


# ---------------------------------------------------------------------------------------------
# generate_vmap_rule under a transform outside the vmap (PyTorch: vmapify_autograd_function)
#
# ``grad(vmap(F))`` differentiates the physical values, so F's node must be recorded on them: a
# Function applied to the physical values whose forward, setup_context and backward are F's, each
# run under a fresh vmap of the same batch size and randomness (setup_context too, so that what
# it stores, e.g. a shape, is per example).  Gradients come back with the batch dim of each
# input, reduced to the input's per-example shape.


def _vmapified_rule(cls, info, in_dims, vals, kwargs):
    state = {}

    def forward(*xs):
        # Detached: nothing in the forward is recorded (the node is), and the dispatcher's
        # refusal of Function forwards under an outer transform does not apply to it.
        xs = [x.detach() if isinstance(x, torch.Tensor) else x for x in xs]
        out, out_dims = _restore_vmap(lambda *a: cls.forward(*a, **kwargs), in_dims, info)(*xs)
        state["out_dims"] = out_dims
        return out

    def setup_context(ctx, inputs, output):
        out_dims = state["out_dims"]
        saving = _CtxSavingBdims(ctx)

        def inner(inputs, output):
            saving._level = _levels.stack()[-1]
            cls.setup_context(saving, inputs, output)

        _restore_vmap(inner, (in_dims, out_dims), info)(tuple(inputs), output)
        # Keyed by this class: nested vmaps vmapify a vmapified Function, on one ctx.
        if not hasattr(ctx, "_functrans_vmapified"):
            ctx._functrans_vmapified = {}
        ctx._functrans_vmapified[key] = saving._saved_dims, out_dims, tuple(
            None if not isinstance(x, torch.Tensor) else
            (x.shape if d is None else x.shape[:d % x.dim()] + x.shape[d % x.dim() + 1:])
            for x, d in zip(inputs, in_dims))

    def backward(ctx, *grads):
        saved_dims, out_dims, input_shapes = ctx._functrans_vmapified[key]
        flat_out_dims = out_dims if isinstance(out_dims, tuple) else (out_dims,)
        grad_dims = tuple(None if g is None else d for g, d in zip(grads, flat_out_dims))

        def backward_no_context(saved, grads):
            return cls.backward(_CtxWithSaved(ctx, saved), *grads)

        gins, gin_dims = _restore_vmap(backward_no_context,
                                       (saved_dims, grad_dims), info)(
            ctx.saved_tensors, grads)
        if not isinstance(gins, tuple):
            gins, gin_dims = (gins,), (gin_dims,)
        return tuple(_reduce_grad(g, gd, d, info.batch_size, shape)
                     for g, gd, d, shape in zip(gins, gin_dims, in_dims, input_shapes))

    Vmapified = type(f"Vmapified{cls.__name__}", (_Function,),
                     {"forward": staticmethod(forward),
                      "setup_context": staticmethod(setup_context),
                      "backward": staticmethod(backward), "generate_vmap_rule": True})
    key = id(Vmapified)
    out = Vmapified.apply(*vals)  # through _apply: nested vmaps vmapify it again
    return out, state["out_dims"]


def _restore_vmap(fn, in_dims, info):
    """``fn`` under a fresh vmap level of ``info``'s batch size and randomness; returns its
    outputs (physical) and their batch dims (None for outputs that are not batched), with the
    structure of the output."""

    def run(*args):
        flat, spec = tree_flatten(args)
        flat_dims = broadcast_prefix(in_dims, args, _is_dim_leaf)
        level = _levels.VmapLevel(info.batch_size, info.randomness)
        with _levels.pushed(level), VmapLevelMode(level):
            wrapped = [x if d is None or not isinstance(x, torch.Tensor) else
                       BatchedTensor(x, d % x.dim(), level) for x, d in zip(flat, flat_dims)]
            out = fn(*tree_unflatten(wrapped, spec))
            flat_out, out_spec = tree_flatten(out)
            pairs = [at_level(o, level) for o in flat_out]
        return (tree_unflatten([v for v, _ in pairs], out_spec),
                tree_unflatten([d for _, d in pairs], out_spec))

    return run


class _WrappedCtx:
    """Forwards attribute reads and writes to the autograd ctx, except its own slots."""
    _own = ("_ctx",)

    def __init__(self, ctx):
        object.__setattr__(self, "_ctx", ctx)

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def __setattr__(self, name, value):
        if name in type(self)._own:
            object.__setattr__(self, name, value)
        else:
            setattr(self._ctx, name, value)


class _CtxSavingBdims(_WrappedCtx):
    """setup_context's ctx under the fresh vmap: saves physical values, remembers their dims."""
    _own = ("_ctx", "_level", "_saved_dims")

    def __init__(self, ctx):
        super().__init__(ctx)
        self._saved_dims = ()

    def _unwrap_saved(self, tensors):
        pairs = [at_level(t, self._level) for t in tensors]
        self._saved_dims = tuple(d for _, d in pairs)
        return [v for v, _ in pairs]

    def save_for_backward(self, *tensors):
        self._ctx.save_for_backward(*self._unwrap_saved(tensors))

    def save_for_forward(self, *tensors):
        self._ctx.save_for_forward(*self._unwrap_saved(tensors))

    def mark_non_differentiable(self, *tensors):
        self._ctx.mark_non_differentiable(
            *[at_level(t, self._level)[0] for t in tensors])


class _CtxWithSaved(_WrappedCtx):
    _own = ("_ctx", "saved_tensors")

    def __init__(self, ctx, saved):
        super().__init__(ctx)
        object.__setattr__(self, "saved_tensors", saved)


def _reduce_grad(g, g_dim, in_dim, batch_size, shape):
    """A per-example gradient (batch dim ``g_dim``) as the gradient of an input with batch dim
    ``in_dim`` and per-example shape ``shape`` (PyTorch's ``reductify``)."""
    if g is None or (g_dim is None and in_dim is None):
        return g
    if in_dim is None:
        return g.sum(g_dim)
    in_dim = in_dim % (len(shape) + 1)
    g = g.unsqueeze(0).expand(batch_size, *g.shape) if g_dim is None else g.movedim(g_dim, 0)
    if tuple(g.shape[1:]) != tuple(shape):
        extra = g.dim() - 1 - len(shape)
        target = (batch_size,) + (1,) * extra + tuple(shape)
        g = g.sum_to_size(target).reshape(batch_size, *shape)
    return g.movedim(0, in_dim)
