"""functrans transforms inside ``torch.compile``: one opaque, AOT-traced call per transform.

What this module owns
- ``active()``: whether a transform's wrapper should route here (Dynamo or AOTAutograd is
  compiling — ``torch.compiler.is_compiling()`` — and this thread is not already inside an
  entry).  The transform wrappers (``batching/api.py``'s vmap, ``autodiff/grad.py``,
  ``jacobians.py``, ``jvp.py``, ``vjp.py``) check it on their first line; in eager mode it is one
  ``is_compiling()`` call.
- ``call_transform(factory, fargs, fkwargs, args, kwargs)``: the routed call.  In a Dynamo trace
  it becomes one ``flat_apply`` node of the graph; AOTAutograd then traces it under fake
  tensors, so the graph holds the engine's physical ATen ops (the same ops ``functrans.compile``
  records with make_fx), which inductor compiles like any other.
- ``vjp_fn``: the function ``vjp`` returns inside ``torch.compile`` (it recomputes the forward
  in the same opaque call, see below).

Which Dynamo extension point, and why: ``torch._dynamo.nonstrict_trace``.  Dynamo must not
trace the engine (a ``TorchDispatchMode`` whose Python internals Dynamo cannot follow: every op
graph-breaks and recompiles), but AOTAutograd must (that is where the ops come from).
``nonstrict_trace`` is exactly that: opaque to Dynamo, traced by AOTAutograd, differentiable by
an outer ``backward()``.  ``allow_in_graph`` would need tensor-only arguments and runs the
function on fake tensors with no way to pass the transform's static configuration.  The
configuration (the transform factory, the user's function, ``in_dims``, ``argnums``...) travels
as a pytree node with no leaves (``_Static``): Dynamo turns it into a Python constant of the
graph (``as_python_constant``; a function made inside the compiled region is rebuilt from its
code and its constant closure), and guards it through its sources (the user's function read
from a global or a closure is guarded by identity, so rebinding it recompiles).
``pytree.register_constant`` would need the object to exist before the compiled region, which a
``vmap(grad(loss))`` written inside it does not.

Limits (each is compiled exactly, left to eager, or refused with an error; never wrong):
- a function made inside the compiled region that closes over tensors of the region
  (``grad(lambda y: (y * w).sum())(x)``) is not a Python constant (Dynamo's
  ``ClosureConversionError``): ``call`` lifts those tensors into inputs of the opaque call
  (``_lift``: the function travels as its code, its module's name and a spec of its cells, and is
  rebuilt in the call by ``_rebuild``), so it compiles in the same graph, also through partials,
  tuples, lists, dicts and nested functions of the region (``vmap(lambda x: grad(lambda p: ...
  w ...)(p))``), and an outer ``backward()`` reaches the lifted tensors.  Dynamo gives traced
  code no ``__closure__``, so the cells are read at trace time by a ``comptime`` hook
  (``_cells``, which uses Dynamo's no-BC-promise accessors ``_i_will_not_complain_if_bc_breaks_*``,
  ``NestedUserFunctionVariable.closure/defaults/kwdefaults/f_globals`` and
  ``side_effects.load_cell``).  Whatever it cannot lift (a function that closes over itself,
  globals that are not its module's, a Dynamo whose internals differ) is an ordinary graph break
  (``fullgraph=True`` raises ``Unsupported``) and the transform runs eagerly.  A cell the
  function rebinds (``nonlocal``) is rebound in the rebuilt copy only, not in the region.
- a tensor the function reads from a global, a closure made outside the region or a module
  (``functional_call``'s buffers) would be a graph constant under ``nonstrict_trace`` (a
  rebinding of the name silently stale).  ``_run`` refuses it while Dynamo's fake tensors run
  the call (FakeTensorMode raises on a real tensor), so Dynamo graph-breaks there
  (``fullgraph=True`` raises) and the transform runs eagerly, reading the tensor afresh.  The
  body is ``torch._dynamo.disable``-d, so that eager run is never traced by Dynamo.
- ``vjp``: ``vjp_fn(ct)`` is a second opaque call that recomputes the forward and pulls ``ct``
  back (one more forward than eager; inside the region, in the same graph; a ``vjp_fn``
  returned from the region runs eagerly).  ``linearize`` is not routed (not done): Dynamo
  traces into the engine as it did before this module (graph breaks, then eager).
- randomness: ``vmap(..., randomness='different'|'same')`` draws through the graph's random ops
  (AOTAutograd functionalizes the generator), so each call draws fresh numbers with the right
  distribution; 'same' draws once per call, shared by the batch (tested by
  tests/compiler/test_inside_torch_compile.py).

Imports: nothing (torch only; the transforms import this module).
"""
from __future__ import annotations

import functools
import sys
import threading
import types
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

_tls = threading.local()
_ENTRY: list = []   # the nonstrict-traced entry, once made (_make_entry)


class _Static:
    """The transform's configuration: a pytree node whose context is a Python constant (the
    function, or the ``_lift`` spec of a function that closes over tensors of the compiled
    region), and whose leaves are those tensors (graph inputs of the opaque call)."""

    __slots__ = ("fn", "leaves")

    def __init__(self, fn: Any, leaves: tuple = ()) -> None:
        self.fn = fn
        self.leaves = leaves


pytree.register_pytree_node(_Static, lambda s: (list(s.leaves), s.fn),
                            lambda leaves, fn: _Static(fn, tuple(leaves)))


def _compile_session() -> bool:
    """Whether a Dynamo compile is in progress on this thread, asked from code Dynamo runs for
    real during its trace (``active``).  torch 2.11's ``torch.compiler.is_compiling()`` is True
    only in code Dynamo traces (it has no ``_compile_session_context``, which later torches
    hold around the whole compile), so there the compile is read from Dynamo's compile
    context: set for the duration of a compile, never while compiled code runs."""
    if torch.compiler.is_compiling():
        return True
    guards = sys.modules.get("torch._guards")
    return guards is not None and guards.CompileContext.try_get() is not None


# torch.compiler.is_compiling() itself where it is True for the whole compile session.
_compiling: Callable[[], bool] = torch.compiler.is_compiling \
    if hasattr(torch.compiler, "_compile_session_context") else _compile_session


def active() -> bool:
    """True when a transform wrapper should route its call here (see the module docstring).

    In a Dynamo trace this function runs for real, its answer a constant of the trace
    (``assume_constant_result``, set below by its attribute), which also makes the entry there:
    Dynamo then reads it as a global of this module, guarded by identity."""
    if not _compiling() or getattr(_tls, "inside", False):
        return False
    if not _ENTRY:
        _make_entry()
    return True


def _apply(factory, fargs, fkwargs, *args, **kwargs):
    return factory(*fargs, **fkwargs)(*args, **kwargs)


def _run(static: _Static, args, kwargs):
    from torch._subclasses.fake_tensor import fake_tensor_tls
    prev = getattr(_tls, "inside", False)
    _tls.inside = True
    # Under Dynamo's and AOTAutograd's fake tensors, nonstrict_trace lets a real tensor the
    # function reads from a global or a closure into the graph as a constant: a rebinding of
    # that name would then be silently stale.  Refused here (FakeTensorMode raises on a real
    # tensor), so Dynamo graph-breaks and the transform runs eagerly, reading it afresh.
    allow = getattr(fake_tensor_tls, "allow_non_fake_inputs_override", None)
    fake_tensor_tls.allow_non_fake_inputs_override = None if allow is None else False
    try:
        fn = _rebuild(static.fn, static.leaves) if static.leaves else static.fn
        return fn(*args, **kwargs)
    finally:
        fake_tensor_tls.allow_non_fake_inputs_override = allow
        _tls.inside = prev


def _make_entry() -> None:
    """The nonstrict-traced entry, made on first use: importing torch._dynamo costs more than
    importing functrans, so it is not done at import."""
    import torch._dynamo
    # disable: Dynamo never traces the body, neither as the opaque call's (AOTAutograd traces
    # it, below Dynamo) nor when a graph break makes the call run eagerly.
    entry = torch._dynamo.nonstrict_trace(torch._dynamo.disable(_run))
    entry.__name__ = "functrans_transform"
    _ENTRY.append(entry)


# Dynamo runs it for real (torch._dynamo.assume_constant_result, which only sets this attribute:
# decorating would import torch._dynamo).
active._dynamo_marked_constant = True


def call_transform(factory: Callable, fargs: tuple, fkwargs: dict, args: tuple, kwargs: dict):
    """``factory(*fargs, **fkwargs)(*args, **kwargs)`` as one opaque call of the graph."""
    return call(functools.partial(_apply, factory, fargs, fkwargs), args, kwargs)


def call(fn: Callable, args: tuple, kwargs: dict):
    """``fn(*args, **kwargs)`` as one opaque call of the graph."""
    if torch.compiler.is_dynamo_compiling():
        leaves: list = []
        spec = _lift(fn, leaves)
        if leaves:       # closes over tensors of the region: they become inputs of the call
            return _ENTRY[0](_Static(spec, tuple(leaves)), args, kwargs)
    return _ENTRY[0](_Static(fn), args, kwargs)


# ---- functions made inside the compiled region that close over its tensors ------------------
# Dynamo makes a function defined inside the compiled region a Python constant of the graph by
# rebuilding it from its code and its closure, which fails when a cell holds a tensor of the
# region (ClosureConversionError).  ``_lift`` runs in Dynamo's trace (Dynamo interprets it): it
# walks the transform's configuration (partials, tuples, lists, dicts, functions) and returns a
# constant spec in which every tensor is replaced by its index in ``leaves``, the tensors
# themselves becoming graph inputs of the opaque call; ``_rebuild`` runs in the call (under
# AOTAutograd) and makes the function again from its code, its module's globals and new cells.
# Dynamo does not let traced code read ``__closure__``, so the cells' contents are read by a
# ``comptime`` hook (``_cells``), Dynamo's documented window on its trace state.

_CONST, _LEAF, _FN, _PARTIAL, _TUPLE, _LIST, _DICT = range(7)


def _lift(obj: Any, leaves: list):
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return (_LEAF, len(leaves) - 1)
    if isinstance(obj, functools.partial):
        return (_PARTIAL, _lift(obj.func, leaves), _lift(obj.args, leaves),
                _lift(obj.keywords, leaves))
    if isinstance(obj, tuple):
        return (_TUPLE, tuple(_lift(o, leaves) for o in obj))
    if isinstance(obj, list):
        return (_LIST, tuple(_lift(o, leaves) for o in obj))
    if isinstance(obj, dict):
        return (_DICT, tuple((k, _lift(v, leaves)) for k, v in obj.items()))
    if isinstance(obj, types.FunctionType) and obj.__code__.co_freevars:
        fn = obj
        out: list = []
        from torch._dynamo.comptime import comptime
        comptime(_cells)    # out = [made in the region with a non-constant closure, module, ...]
        if out and out[0]:
            return (_FN, fn.__code__, out[1], fn.__name__, _lift(out[2], leaves),
                    _lift(out[3], leaves), tuple(_lift(c, leaves) for c in out[4:]))
    return (_CONST, obj)


def _cells(ctx) -> None:
    """comptime hook, called by ``_lift`` (at trace time, in Dynamo): appends to the local
    ``out`` whether the local ``fn`` is a function made in the region whose closure is not a
    Python constant, and if so its module's name, defaults, keyword defaults and cell contents.
    Anything it cannot read is a graph break (the transform then runs eagerly), never an error."""
    import sys
    fn_var = ctx.get_local("fn")
    if fn_var.is_python_constant():
        return
    reason = None
    try:
        fn = fn_var._i_will_not_complain_if_bc_breaks_VariableTracker()
        out = ctx.get_local("out")._i_will_not_complain_if_bc_breaks_VariableTracker()
        tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
        from torch._dynamo.variables import ConstantVariable
        f_globals = fn.f_globals
        module = f_globals.get("__name__")
        if getattr(sys.modules.get(module), "__dict__", None) is not f_globals:
            reason = f"the globals of {module!r} are not its module's"
        else:
            items = [ConstantVariable.create(True), ConstantVariable.create(module),
                     fn.defaults or ConstantVariable.create(None),
                     fn.kwdefaults or ConstantVariable.create(None)]
            for cell in fn.closure.items:
                contents = tx.output.side_effects.load_cell(cell)
                if contents is fn:
                    reason = "the function closes over itself"
                    break
                items.append(contents)
    except Exception as e:  # noqa: BLE001 -- any failure to read the closure: run eagerly
        reason = repr(e)
    if reason is not None:
        ctx.graph_break("functrans: a function made inside the compiled region closes over a "
                        f"value that is not a constant and could not be lifted ({reason}); the "
                        "transform runs eagerly")
        return
    for item in items:
        out.call_method(tx, "append", [item], {})


def _rebuild(spec: tuple, leaves: tuple):
    kind = spec[0]
    if kind == _CONST:
        return spec[1]
    if kind == _LEAF:
        return leaves[spec[1]]
    if kind == _PARTIAL:
        return functools.partial(_rebuild(spec[1], leaves), *_rebuild(spec[2], leaves),
                                 **_rebuild(spec[3], leaves))
    if kind == _TUPLE:
        return tuple(_rebuild(s, leaves) for s in spec[1])
    if kind == _LIST:
        return [_rebuild(s, leaves) for s in spec[1]]
    if kind == _DICT:
        return {k: _rebuild(s, leaves) for k, s in spec[1]}
    import sys
    _, code, module, name, defaults, kwdefaults, cells = spec
    fn = types.FunctionType(code, sys.modules[module].__dict__, name, _rebuild(defaults, leaves),
                            tuple(types.CellType(_rebuild(c, leaves)) for c in cells))
    fn.__kwdefaults__ = _rebuild(kwdefaults, leaves)
    return fn


def _vjp_forward(vjp_transform, func, has_aux, *primals):
    res = vjp_transform(func, *primals, has_aux=has_aux)
    return (res[0], res[2]) if has_aux else res[0]


def _vjp_pull(vjp_transform, func, has_aux, n_primals, create_graph, *flat):
    res = vjp_transform(func, *flat[:n_primals], has_aux=has_aux)
    return res[1](flat[n_primals], create_graph=create_graph)


def vjp(vjp_transform: Callable, func: Callable, primals: tuple, has_aux: bool):
    """``vjp`` inside ``torch.compile``: the output by one opaque call, and a ``vjp_fn`` whose
    every call is another opaque call that recomputes the forward and pulls the cotangents back
    (a function cannot be an output of the opaque call)."""
    res = call(functools.partial(_vjp_forward, vjp_transform, func, has_aux), primals, {})

    def vjp_fn(cotangents: Any, retain_graph: Any = True, create_graph: Any = None):
        # retain_graph has no effect here: every call recomputes the forward
        return call(functools.partial(_vjp_pull, vjp_transform, func, has_aux, len(primals),
                                      create_graph), (*primals, cotangents), {})

    return (res[0], vjp_fn, res[1]) if has_aux else (res, vjp_fn)
