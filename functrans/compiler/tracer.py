"""Trace a function once into a graph of plain ATen ops.

What this module owns
- ``trace(fn, args, kwargs, tensors, symbolic=False)``: runs ``fn`` under ``make_fx``
  (torch.fx.experimental.proxy_tensor).  functrans's engine is a Python ``__torch_dispatch__``
  layer, so make_fx records what its rules emit: ordinary ATen ops on physical tensors, the whole
  transform stack flattened into one graph.  In the default real mode the trace IS an eager call
  (the ops run on the real tensors while they are recorded), so its outputs are the first call's
  answer: nothing runs twice, side effects included.  With ``symbolic=True`` tensors are fake
  with symbolic sizes (one graph for every batch size) and nothing runs.
- graph breaks (real mode, ``_Watcher``): a value read back into Python (``.item()``,
  ``bool()``, an ``if`` on a tensor: ``aten._local_scalar_dense``) is answered from the real
  tensor and recorded as a ``breaks.Read`` with a ``breaks.read_guard`` node at that point of
  the graph; an op whose output shape depends on data (tag ``dynamic_output_shape``:
  ``nonzero``, ``masked_select``) is followed by a ``breaks.size_guard`` on each output, and
  ``.tolist()`` of a tensor of at most ``breaks.MAX_LIST_VALUES`` values by a
  ``breaks.list_guard`` (``Trace.reads``).  Guards are then hoisted above writes that do not touch the value read
  (``breaks.hoist``); a graph that writes into an argument or captured tensor before a guard is
  untraceable, one that draws random numbers before a guard is marked
  (``Trace.random_before_read``).
- what a graph must never bake in, found while tracing: a read it cannot guard (``.tolist()``
  of a larger tensor, ``.numpy()``, any read in a symbolic trace), and Python-side effects the graph cannot replay
  (``Captured`` state — what ``fn`` and its object arguments reach — rebound or new tensors
  stored in it, ``.grad`` written by ``backward()``, tensors made with ``requires_grad=True``
  inside, a change of the random generators' state outside a random op: ``manual_seed``,
  ``set_rng_state``).  Each is reported once, with the op and the user's source line, as
  ``Trace.untraceable``.
- ``tracing()``: whether this thread is inside a trace (a compiled function called inside
  another's trace runs eagerly: its ops are recorded in the outer graph).

Imports: _levels, compiler.breaks, compiler.guards.
"""
from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from .. import _levels
from . import breaks
from .guards import Captured, object_arguments

_tls = threading.local()
_DATA_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
_ZERO_TENSOR = torch.ops.aten._efficientzerotensor.default
_READ_BACK = {torch.Tensor.tolist: ".tolist()", torch.Tensor.numpy: ".numpy()",
              torch.Tensor.__array__: "numpy.asarray()"}
_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch,)) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    os.path.dirname(os.path.abspath(threading.__file__)) + os.sep)


def _no_duck_sizes():
    import torch.fx.experimental._config as shape_config
    if hasattr(shape_config, "use_duck_shape"):
        return shape_config.patch(use_duck_shape=False)
    return contextlib.nullcontext()   # pragma: no cover - older torch


def _one_fake_mode():
    """One FakeTensorMode for a real-mode trace's metadata.  make_fx records each output's
    shape as a fake tensor made in the fake mode ``torch._guards.detect_fake_mode`` finds, and
    in real mode it finds none and builds a new FakeTensorMode per op, each capturing the whole
    Python stack (``traceback.extract_stack``): half of a small row's first call (NTK: 0.35 of
    0.7 s).  A thread-local TracingContext carrying one mode is what that lookup reads first."""
    from torch._guards import TracingContext, tracing as tracing_context
    from torch._subclasses.fake_tensor import FakeTensorMode

    if TracingContext.try_get() is not None:    # inside someone else's compilation: theirs
        return contextlib.nullcontext()
    context = TracingContext(_metadata_mode())
    context.functrans_metadata_only = True    # not torch.compile's: _levels.compiling() is False
    return tracing_context(context)


_METADATA_MODE: Optional[type] = None


def _metadata_mode():
    """A FakeTensorMode whose ``empty_strided`` (the only op make_fx's metadata runs in it)
    builds the fake tensor directly, without the mode's dispatch cache (0.3 ms an op)."""
    global _METADATA_MODE
    if _METADATA_MODE is None:
        from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

        empty_strided = torch.ops.aten.empty_strided.default

        class MetadataMode(FakeTensorMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                device = kwargs.get("device")
                if func is empty_strided and device is not None and set(kwargs) <= {
                        "dtype", "device", "layout", "pin_memory"} and kwargs.get(
                        "layout", torch.strided) == torch.strided:
                    elem = torch.empty_strided(*args, dtype=kwargs.get("dtype"),
                                               device="meta")
                    return FakeTensor(self, elem, torch.device(device))
                return super().__torch_dispatch__(func, types, args, kwargs)

        _METADATA_MODE = MetadataMode
    return _METADATA_MODE(allow_fallback_kernels=True)


def tracing() -> bool:
    return getattr(_tls, "depth", 0) > 0


def user_line() -> str:
    """'file:line (function)' of the innermost frame outside torch, functrans and the stdlib."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_LIBRARY_DIRS) and not filename.startswith("<frozen"):
            return f"{filename}:{frame.f_lineno} (in {frame.f_code.co_name})"
        frame = frame.f_back
    return "an unknown line"


class _Watcher:
    """Records the reads a graph is guarded on (real mode) and the first thing a graph must not
    bake in; lets the trace go on (in real mode the trace is the first call's eager run, so it
    finishes and its answer is right).

    In real mode a value read into Python (``aten._local_scalar_dense``: ``.item()``,
    ``bool()``, an ``if`` on a tensor) is answered here from the real tensor, below no mode:
    make_fx would raise on it, and the function, half run (its in-place writes done), would
    then have to run again eagerly — applying those writes twice.  The read is recorded as a
    ``breaks.Read`` and a ``breaks.read_guard`` node is put into the graph at that point; an op
    whose output shape depends on the data (``nonzero``) is recorded as make_fx records it, and
    a ``breaks.size_guard`` node on each of its outputs follows it; ``.tolist()`` of a small
    tensor gets a ``breaks.list_guard``.  A read the tracer cannot point at a graph value
    (``.numpy()``, ``.tolist()`` of a larger tensor, a tensor make_fx does not track) is the
    first untraceable thing instead, and symbolic traces guard nothing."""

    def __init__(self, real: bool = True) -> None:
        self.first: Optional[str] = None
        self.reads: List[breaks.Read] = []
        self.real = real
        self._rng: Optional[List[Any]] = None     # the generators' states after the last draw
        self._drew = False                         # a random op ran
        watcher = self

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                tags = func.tags
                kwargs = kwargs or {}
                if func is _LOCAL_SCALAR and real:
                    # make_fx refuses to read a traced tensor's value: read it below the tracer
                    with _disable_current_modes():
                        value = func(*args, **kwargs)
                    watcher._guard(breaks.read_guard, args[0], value, _READ_WHAT)
                    return value
                if any(tag in tags for tag in _DATA_TAGS):
                    if not real and watcher.first is None:
                        what = ("reads a tensor's value into Python (.item(), bool(), an `if` "
                                "on a tensor)" if func is _LOCAL_SCALAR
                                else "has an output whose shape or value depends on the data")
                        watcher.first = f"{func} {what}, at {user_line()}"
                    elif real and torch.Tag.data_dependent_output in tags:
                        with _disable_current_modes():     # (aten.item: decomposed above)
                            return func(*args, **kwargs)
                    elif real:                             # a data-dependent output shape
                        out = func(*args, **kwargs)
                        for leaf in pytree.tree_leaves(out):
                            if isinstance(leaf, torch.Tensor):
                                watcher._guard(breaks.size_guard, leaf, tuple(leaf.shape),
                                               f"the shape of {func}'s output, which "
                                               "depends on the data")
                        return out
                if func is _ZERO_TENSOR:
                    # forward AD's symbolic zero tangent: make_fx's proxy of a ZeroTensor
                    # crashed the process in a later op (a segfault in jvp(jacrev(f)) with
                    # index_put); an ordinary zeros tensor has the same values
                    return torch.ops.aten.zeros.default(*args, **kwargs)
                if real and _draws(func):
                    watcher._before_draw(func)
                    out = func(*args, **kwargs)
                    watcher._rng = watcher._rng_state()
                    watcher._drew = True
                    return out
                return func(*args, **kwargs)

        class Function(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                what = _READ_BACK.get(func)
                if what is None:
                    return func(*args, **(kwargs or {}))
                if (real and func is torch.Tensor.tolist and len(args) == 1 and not kwargs
                        and type(args[0]) in (torch.Tensor, torch.nn.Parameter)
                        and args[0].numel() <= breaks.MAX_LIST_VALUES):
                    value = func(*args)      # a few values: guarded, all of them
                    watcher._guard(breaks.list_guard, args[0], value,
                                   ".tolist() (its values)")
                    return value
                if watcher.first is None:
                    watcher.first = (f"{what} reads a tensor's values into Python, which a "
                                     f"graph cannot guard, at {user_line()}")
                return func(*args, **(kwargs or {}))

        self._modes = (Function(), Dispatch())

    def _guard(self, guard, tensor: torch.Tensor, value: Any, what: str) -> None:
        """Put ``guard(tensor's graph value, value, index)`` into the graph at this point."""
        line = user_line()
        from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
        mode = get_proxy_mode()
        if mode is None:
            if self.first is None:
                self.first = f"{what} at {line} cannot be guarded (no make_fx tracer)"
            return
        try:
            slot = get_proxy_slot(tensor, mode.tracer, None)
            if slot is None:
                # an alias through the tracer: a tensor it does not track (captured state)
                # becomes a constant as make_fx makes it; the replay's clean() drops the alias
                slot = get_proxy_slot(torch.ops.aten.alias.default(tensor), mode.tracer)
            proxy = slot.proxy
            mode.tracer.create_proxy("call_function", guard, (proxy, value, len(self.reads)),
                                     {})
        except Exception as exc:
            if self.first is None:
                self.first = (f"{what} at {line} cannot be guarded ({type(exc).__name__}: "
                              f"{exc})")
            return
        self.reads.append(breaks.Read(len(self.reads), value, what, line))

    # ------------------------------------------------------------ the random generators
    # A graph records the random ops, which draw from the global generators' states at replay
    # time; it cannot record a change of those states made outside an op (torch.manual_seed,
    # torch.set_rng_state, fork_rng / freeze_rng_state inside the function, as OpInfo's
    # wrapper_set_seed does, or vmap's chunks under randomness='same').  A replay would then
    # draw other numbers than the eager call, or leave the generators elsewhere: so the states
    # are read before and after each random op of a real-mode trace, and when they changed
    # between two of its random ops (or after the last one) the graph is untraceable.
    @staticmethod
    def _rng_state() -> List[Any]:
        with _disable_current_modes():      # (no op of this reaches the trace)
            return breaks.rng_state()

    def _rng_moved(self) -> bool:
        before = self._rng
        if before is None:
            return False
        now = self._rng_state()
        with _disable_current_modes():
            return len(now) != len(before) or not all(
                _same_states(a, b) for a, b in zip(now, before))

    def _before_draw(self, func) -> None:
        if self.first is None and self._rng_moved():
            self.first = (f"the random number generator's state was changed outside a random "
                          f"op before {func} at {user_line()} ({_RNG_SET}): a graph replays "
                          "the random ops, not that change of state, so a replay would draw "
                          "other numbers")

    def __enter__(self):
        if self.real:
            self._rng = self._rng_state()
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        if self.real and exc[0] is None and self.first is None and self._rng_moved():
            when = "after its last random op" if self._drew else "in a function drawing none"
            self.first = (f"the random number generator's state was changed outside a random "
                          f"op, {when} ({_RNG_SET}): a graph replays the random ops, not that "
                          "change of state, so a replay would leave the generator elsewhere")
        return False


_RNG_SET = "torch.manual_seed, torch.set_rng_state, or fork_rng / freeze_rng_state restoring it"
_SEEDED = torch.Tag.nondeterministic_seeded
_UNTAGGED_RANDOM = ("random_", "random")      # random ops without the tag


def _draws(func) -> bool:
    """Whether ``func`` may draw from a random number generator."""
    return _SEEDED in func.tags or func.overloadpacket.__name__ in _UNTAGGED_RANDOM


def _same_states(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_states(x, y) for x, y in zip(a, b))
    return bool(torch.equal(a, b))


_READ_WHAT = ("aten._local_scalar_dense: a tensor's value read into Python (.item(), bool(), "
              "an `if` on a tensor)")


_LITERAL_USERS = {torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift_fresh.default}


def _on_meta(node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.device.type == "meta"


def _unexplained_constant(gm, captured: Captured, tensors) -> Optional[str]:
    """A ``get_attr`` tensor no guard watches: not captured state (re-read on every call), not a
    literal (``torch.tensor([...])`` is lifted by ``lift_fresh_copy``), not an argument."""
    arguments = {id(t) for t in tensors}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target)
        if not isinstance(value, torch.Tensor) or id(value) in arguments:
            continue
        if captured.name_of(value) is not None:
            continue
        if node.users and all(u.op == "call_function" and u.target in _LITERAL_USERS
                              for u in node.users):
            continue
        if node.users and all(_on_meta(u) for u in node.users):
            continue        # read for its metadata only (``module.to("meta")``): no value used
        return f"a tensor of shape {tuple(value.shape)}"
    return None


@dataclass
class Trace:
    graph_module: Optional[torch.fx.GraphModule]
    out_spec: Any
    out_leaves: List[Any]          # the output's leaves, None where a graph output goes
    out_tensor_positions: List[int]
    captured: Optional[Captured]
    needs_autograd: bool
    seconds: float
    outputs: Any = None            # the first call's answer (real mode only)
    untraceable: Optional[str] = None
    constants: Dict[str, torch.Tensor] = field(default_factory=dict)
    reads: List[breaks.Read] = field(default_factory=list)   # the graph's breaks, in order
    random_before_read: bool = False   # a random op runs before some guard


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def trace(fn, args: tuple, kwargs: dict, tensors: List[torch.Tensor], *,
          symbolic: bool = False) -> Trace:
    """Trace ``fn(*args, **kwargs)``; ``tensors`` are the argument tensors in pytree order.
    Exceptions from ``fn`` propagate (in real mode they are the eager call's own)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    start = time.perf_counter()
    leaves, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    arguments = object_arguments(args, kwargs)
    before = Captured.discover(fn, arguments=arguments)
    reachable = [t for t, _ in before.tensors.values()] + list(tensors)
    grads_before = {id(t): t.grad for t in reachable if t.requires_grad}
    watcher = _Watcher(real=not symbolic)
    box: Dict[str, Any] = {}

    def flat(*traced):
        new = list(leaves)
        for pos, t in zip(positions, traced):
            new[pos] = t
        a, k = pytree.tree_unflatten(new, spec)
        with watcher:
            out = fn(*a, **k)
        out_leaves, out_spec = pytree.tree_flatten(out)
        box["out"], box["spec"] = out, out_spec
        box["leaves"] = [None if isinstance(x, torch.Tensor) else x for x in out_leaves]
        box["positions"] = [i for i, x in enumerate(out_leaves) if isinstance(x, torch.Tensor)]
        box["requires_grad"] = [x.requires_grad for x in out_leaves
                                if isinstance(x, torch.Tensor)]
        return [x for x in out_leaves if isinstance(x, torch.Tensor)]

    _tls.depth = getattr(_tls, "depth", 0) + 1
    collecting = gc.isenabled()
    gc.disable()     # make_fx makes many short-lived objects: the collector cost ~20% of a trace
    try:
        # control-flow operators (torch.cond, scan, ...) are traced as the Python control flow
        # they stand for (batching/control_flow.py), as under functrans's transforms
        with _levels.compile_trace():
            if symbolic:
                # no duck sizing: a batch of 2 beside a feature dim of 2 must not tie the two
                # sizes together (one graph per such coincidence)
                with _no_duck_sizes():
                    gm = make_fx(flat, tracing_mode="symbolic",
                                 _allow_non_fake_inputs=True)(*tensors)
            else:
                with _one_fake_mode():
                    gm = make_fx(flat, tracing_mode="real")(*tensors)
    finally:
        _tls.depth -= 1
        if collecting:
            gc.enable()

    constants = {node.target: getattr(gm, node.target) for node in gm.graph.nodes
                 if node.op == "get_attr"}
    constant_tensors = [c for c in constants.values() if isinstance(c, torch.Tensor)]
    captured = Captured.discover(fn, guarded_tensors={id(c) for c in constant_tensors},
                                 arguments=arguments)
    needs_autograd = torch.is_grad_enabled() and any(
        t.requires_grad for t in list(tensors) + constant_tensors)

    untraceable = watcher.first
    random_before_read = False
    if untraceable is None and watcher.reads:
        breaks.hoist(gm.graph)
        written, random_before_read = breaks.prefix_effects(gm.graph)
        if written is not None:
            index, op = written
            untraceable = (f"{_fn_name(fn)} writes outside its graph ({op}) "
                           f"before it reads a value at {watcher.reads[index].line} "
                           f"({watcher.reads[index].what}); a call that reads another value "
                           "there could not undo the write")
    if untraceable is None:
        unknown = _unexplained_constant(gm, captured, tensors)
        if unknown is not None:
            untraceable = (f"the graph of {_fn_name(fn)} would hold {unknown} as a constant: a "
                           "tensor it neither takes as an argument nor reads from Python state "
                           "this trace can re-read (made by an op hidden from the tracer), so a "
                           "later call could see a stale value")
    if untraceable is None:
        changed = before.check()
        if changed is not None:
            untraceable = (f"{_fn_name(fn)} changed Python state while it ran ({changed}); a "
                           "graph replays tensor ops only")
    if untraceable is None:
        stored = [name for key, (t, name) in captured.tensors.items()
                  if key not in before.tensors]
        if stored:
            untraceable = (f"{_fn_name(fn)} stored new tensors in Python state while it ran "
                           f"({', '.join(stored[:3])}); a graph replays tensor ops only")
    if untraceable is None:
        written = [t for t in reachable if t.requires_grad and id(t) in grads_before
                   and t.grad is not grads_before[id(t)]]
        if written:
            name = captured.name_of(written[0]) or before.name_of(written[0]) or "an argument"
            untraceable = (f"{_fn_name(fn)} wrote the .grad of {name} (backward() or an "
                           "optimizer); a graph cannot replay that: differentiate with "
                           "functrans.grad / vjp inside the compiled function instead")
    if untraceable is None and not symbolic and not needs_autograd and any(
            box["requires_grad"]):
        untraceable = (f"{_fn_name(fn)} returns a tensor that requires grad although no input "
                       "does (requires_grad=True or requires_grad_() inside it); a graph "
                       "cannot replay that")
    return Trace(graph_module=gm, out_spec=box["spec"], out_leaves=box["leaves"],
                 out_tensor_positions=box["positions"], captured=captured,
                 needs_autograd=needs_autograd, seconds=time.perf_counter() - start,
                 outputs=None if symbolic else box["out"], untraceable=untraceable,
                 constants=constants, reads=list(watcher.reads),
                 random_before_read=random_before_read)
