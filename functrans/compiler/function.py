"""``functrans.compile``: the compiled function and the path of one call through it.

A call: ``guards.call_key`` (the key; arguments it cannot key on run eagerly) → ``GraphCache``
lookup (a hit re-checks the entry's captured state, ``Entry.stale``, variant by variant) → the
backend's callable on the argument tensors → the output pytree rebuilt.  A miss (under one lock:
a thread that waited on it finds the entry another filed) traces (``tracer.trace``; real mode:
the trace is the eager call and its outputs are the answer), hands the graph to the backend
(``backends.build``) and files the entry.

Graph breaks (compiler/breaks.py): a graph whose trace read values into Python (``.item()``,
``bool()``, a data-dependent size) is replayed with a guard at each break (``_guarded``).  When
a guard reads another value, the variant of the key that read the values seen so far runs
instead, or a new variant is traced (a miss: that trace is the eager call); the variants of a
key form a tree keyed by the values read.  No op after the failing guard ran, none before it
wrote outside the graph (such a graph is refused when traced), and the random generators are
put back to where the call found them, so the call's answer and effects are the eager call's.
More values than a graph per value is worth (``cache_size`` variants, or a float read that took
more than ``breaks.MAX_FLOAT_VALUES`` values) make the function run eagerly, with the reason.
Under the tiered backend each segment is its own graph, tiered on its own (``breaks.split``);
the pinned inductor/cudagraphs backends replay a graph with breaks whole.

Runs eagerly, with the reason recorded in ``cache_info()``: inside another functrans transform
(a compiled function called under ``vmap``/``grad``/``jvp`` sees wrappers or levels a graph
traced outside them does not know), inside the trace of another compiled function (its ops are
recorded in that graph), under a forward-AD level the caller opened, on arguments
``call_key`` cannot key.  A function that does something a graph cannot bake in
(``Trace.untraceable``: a read it cannot guard, a write before a read, Python side effects)
runs eagerly from then on, after one ``CompileWarning`` naming the op and the line
(``strict=True``: ``UntraceableError`` instead).

Imports: _levels, errors, compiler.breaks, compiler.guards, compiler.cache, compiler.tracer,
compiler.tiering, compiler.backends, compiler.passes.
"""
from __future__ import annotations

import functools
import os
import threading
import time
import traceback
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Union, cast, overload

import torch
import torch.utils._pytree as pytree

from .. import _levels
from ..errors import CompileWarning, TransformArgumentError, UntraceableError, transform_call
from . import backends, breaks, passes, tiering, tracer
from .cache import CacheInfo, Entry, EntryInfo, GraphCache
from .guards import (Unguardable, call_key, describe_difference, dynamic_key,
                     only_sizes_differ, shape_guard)

_TRACE_LOCK = threading.RLock()
_all_compiled: "weakref.WeakSet[CompiledFunction]" = weakref.WeakSet()
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TRACER_DIRS = tuple(_TORCH_DIR + d + os.sep for d in ("fx", "_subclasses", "_dynamo",
                                                        "_guards"))


def _mismatch(entry: Entry, tensors: List[torch.Tensor], answer: Any) -> Optional[str]:
    """None when ``entry`` run on copies of ``tensors`` gives ``answer``; else why not."""
    copies = [t.detach().clone() for t in tensors]
    with torch.no_grad():
        got = entry.outputs(entry.run(copies))
    expected_leaves, _ = pytree.tree_flatten(answer)
    got_leaves, _ = pytree.tree_flatten(got)
    if len(got_leaves) != len(expected_leaves):
        return "the symbolic graph's outputs differ from the eager call's"
    for a, b in zip(got_leaves, expected_leaves):
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype \
                    or not torch.allclose(a, b.detach(), rtol=1e-5, atol=1e-6, equal_nan=True):
                return "the symbolic graph's outputs differ from the eager call's"
        elif a != b:
            return "the symbolic graph's outputs differ from the eager call's"
    return None


def _tracer_failure(exc: BaseException) -> bool:
    """Whether an exception was raised by make_fx's own machinery (not by the function)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_TRACER_DIRS)


class CompiledFunction:
    """``fn`` traced once per key into a graph and replayed; see ``functrans.compile``."""

    def __init__(self, fn: Callable[..., Any], backend: str, dynamic: Optional[bool],
                 strict: bool, cache_size: int) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn
        self.backend = backend
        self.dynamic = dynamic
        self.strict = strict
        self._cache = GraphCache(cache_size)
        self._eager_reason: Optional[str] = None
        # dynamic sizes: graphs traced with symbolic sizes, keyed by guards.dynamic_key
        self._symbolic = dynamic is True and backend in ("replay", "tiered")
        self._dynamic: Dict[Any, List[Entry]] = {}
        _all_compiled.add(self)

    # ---------------------------------------------------------------- the call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._eager_reason is not None:
            self._cache.note_eager(None)
            return self._fn(*args, **kwargs)
        reason = self._eager_now()
        if reason is None:
            try:
                key, tensors = call_key(args, kwargs)
            except Unguardable as exc:
                reason = f"an argument cannot be keyed on: {exc}"
        if reason is not None:
            self._cache.note_eager(reason)
            return self._fn(*args, **kwargs)
        entry, stale = self._cache.lookup(key)
        if entry is not None:
            if entry.reads is None:
                return entry.outputs(entry.run(tensors))
            return self._guarded(key, entry, args, kwargs, tensors)
        if stale is not None:
            return self._miss(key, args, kwargs, tensors, stale)
        if self._dynamic:
            entry = self._dynamic_hit(key, tensors)
            if entry is not None:
                self._cache.note_hit()
                self._cache.put(entry, key)   # this exact key finds it directly next time
                return entry.outputs(entry.run(tensors))
        latest = self._cache.latest()
        why = None if latest is None else describe_difference(latest.key, key)
        if (latest is not None and self.dynamic is None
                and self.backend in ("replay", "tiered")
                and only_sizes_differ(latest.key, key)):
            self._symbolic = True      # a second size: from now on, trace sizes symbolically
        out = self._miss(key, args, kwargs, tensors, why)
        if self._symbolic and self._eager_reason is None and not self._cache.read_variants(key):
            self._add_symbolic(key, args, kwargs, tensors, out)
        return out

    @staticmethod
    def _eager_now() -> Optional[str]:
        if tracer.tracing():
            return "called while another compiled function is traced (recorded in its graph)"
        if _levels.stack():
            return "called inside a functrans transform"
        if _levels.forward_ad_state() != "none":
            return "called under a forward-AD dual level"
        return None

    # ---------------------------------------------------------------- dynamic sizes
    def _dynamic_hit(self, key: Any, tensors: List[torch.Tensor]) -> Optional[Entry]:
        for entry in self._dynamic.get(dynamic_key(key), ()):
            guard: Any = entry.shape_guard   # set when a symbolic entry is filed
            if guard(tensors) and entry.stale() is None:
                return entry
        return None

    def _add_symbolic(self, key: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                      tensors: List[torch.Tensor], answer: Any) -> None:
        """After a static miss (whose real trace gave ``answer``): trace again with symbolic
        sizes (nothing runs), check that graph against ``answer`` on copies of the arguments,
        and file it under the key without sizes.  Fake tensors can get strides the real kernels
        do not produce, which bakes a wrong view into a symbolic graph, so a graph that does not
        reproduce the eager answer here is never used.  Graphs that write into arguments or
        captured tensors, or draw random numbers, cannot be checked that way: they stay static."""
        with _TRACE_LOCK, torch._C._PreserveDispatchKeyGuard():
            if self._dynamic_hit(key, tensors) is not None:
                return                   # another thread filed one that covers these sizes
            try:
                trace = tracer.trace(self._fn, args, kwargs, tensors, symbolic=True)
                # (a trace that is not untraceable has its graph)
                gm = cast(torch.fx.GraphModule, trace.graph_module)
                refusal = trace.untraceable or passes.unreplayable_twice(gm)
                if refusal is None:
                    guard = shape_guard(gm)
                    entry = self._make_entry(key, trace, tensors)
                    refusal = _mismatch(entry, tensors, answer)
            except Exception as exc:
                refusal = f"{type(exc).__name__}: {str(exc)[:300]}"
        if refusal is not None:
            self._symbolic_failure = refusal
            self._symbolic = False       # one graph per size from now on
            return
        self._cache.trace_seconds += trace.seconds
        entry.symbolic = True
        entry.shape_guard = guard
        entries = self._dynamic.setdefault(dynamic_key(key), [])
        entries.append(entry)
        del entries[:-self._cache.size]

    # ---------------------------------------------------------------- graph breaks
    def _guarded(self, key: Any, entry: Entry, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                 tensors: List[torch.Tensor]) -> Any:
        """Run a graph with breaks (compiler/breaks.py): segment by segment, each guard
        comparing the value read with the trace's.  When one differs (no op after it ran; none
        before it wrote outside the graph, and the random generators are put back where the
        call found them), the variant of this key that read these values runs instead, or a
        new one is traced: that trace is the eager call."""
        rng = None
        tried = []
        while True:
            tried.append(entry)
            if rng is None and entry.save_rng:
                rng = breaks.rng_state()
            try:
                out = entry.outputs(entry.run(tensors))
            except breaks.ReadChanged as changed:
                self._cache.note_read_change()
                if rng is not None:
                    breaks.set_rng_state(rng)
                reads = cast(List[breaks.Read], entry.reads)
                observed = [r.value for r in reads[:changed.index]] + [changed.value]
                found = self._cache.variant_reading(key, observed)
                if found is not None and all(found is not e for e in tried):
                    entry = found
                    continue
                if found is not None:   # pragma: no cover - a guard disagreeing with its trace
                    self._cache.note_eager("a graph's guard disagreed with the value its trace "
                                           "read; this call ran eagerly")
                    return self._fn(*args, **kwargs)
                read = reads[changed.index]
                why = (f"break {read.index + 1} ({read.what}) at {read.line} read "
                       f"{changed.value!r} where the graph traced read {read.value!r}")
                self._cache.note_hit(-1)            # counted as a miss: this call traces
                return self._miss(key, args, kwargs, tensors, why, observed)
            self._cache.promote(key, entry)
            return out

    def _too_many_values(self, key: Any, observed: List[Any]) -> Optional[str]:
        """Why no further graph is traced for the values a call read at its breaks: the key
        holds ``cache_size`` graphs with breaks already, or a float read at this break took
        more than ``breaks.MAX_FLOAT_VALUES`` values (a loss, a norm: a new one every call)."""
        variants = self._cache.read_variants(key)
        if len(variants) >= self._cache.size:
            return (f"{len(variants)} graphs (the cache_size) were traced for the values read "
                    "at its breaks, and this call read others")
        last = observed[-1]
        if breaks.has_float(last):
            index = len(observed) - 1
            values = {repr(last)} | {
                repr(cast(List[breaks.Read], e.reads)[index].value) for e in variants
                if len(cast(List[breaks.Read], e.reads)) > index and all(
                    breaks.same_value(r.value, v)
                    for r, v in zip(cast(List[breaks.Read], e.reads), observed[:-1]))}
            if len(values) > breaks.MAX_FLOAT_VALUES:
                return (f"the float read there took {len(values)} values (a graph per value "
                        "is not worth tracing)")
        return None

    # ---------------------------------------------------------------- a miss
    def _miss(self, key: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any],
              tensors: List[torch.Tensor], why: Optional[str],
              observed: Optional[List[Any]] = None) -> Any:
        with _TRACE_LOCK:
            if self._eager_reason is not None:      # another thread's trace gave up meanwhile
                self._cache.note_eager(None)
                return self._fn(*args, **kwargs)
            if observed is None:
                entry, _ = self._cache.lookup(key)
            else:                                   # a break read a value no variant has
                entry = self._cache.variant_reading(key, observed)
            if entry is not None:                   # another thread traced it meanwhile
                if entry.reads is None:
                    return entry.outputs(entry.run(tensors))
                return self._guarded(key, entry, args, kwargs, tensors)
            refusal = None if observed is None else self._too_many_values(key, observed)
            if refusal is not None:
                self._go_eager(f"{why}: {refusal}")
                self._cache.note_eager(None)
                return self._fn(*args, **kwargs)
            try:
                trace = tracer.trace(self._fn, args, kwargs, tensors)
            except Exception as exc:
                if not _tracer_failure(exc):
                    raise          # the function's own error: what an eager call raises
                self._go_eager(f"tracing failed inside make_fx ({type(exc).__name__}: {exc})")
                return self._fn(*args, **kwargs)
            # filed under the lock: a thread waiting on it finds the entry, not a second trace
            self._cache.note_miss(why, trace.seconds)
            if trace.untraceable is not None:
                self._go_eager(trace.untraceable)
                return trace.outputs
            self._cache.put(self._make_entry(key, trace, tensors))
            return trace.outputs

    def _make_entry(self, key: Any, trace: tracer.Trace, tensors: List[torch.Tensor]) -> Entry:
        backend = self.backend if not trace.reads else "replay"
        notes: List[str] = []
        try:
            run = backends.build(backend, trace, tensors)
        except backends.BackendUnavailable as exc:
            notes.append(f"{backend} unavailable ({exc}); replayed instead")
            warnings.warn(f"{self._api()}: backend {backend!r} cannot run this graph: {exc}. "
                          "It is replayed instead.", CompileWarning, stacklevel=4)
            backend = "replay"
            run = backends.build("replay", trace, tensors)
        notes.extend(getattr(run, "notes", ()))   # what a backend chose inside (cudagraphs)
        if backend == "inductor":
            run = self._with_replay_fallback(run, trace, tensors, notes)
        if backend == "tiered":
            run = tiering.Tiered(run, cast(torch.fx.GraphModule, trace.graph_module),
                                 backends.build_inductor_from,
                                 source=getattr(run, "inductor_source", None))
        elif trace.reads and self.backend == "tiered":
            # a graph with breaks: each segment its own graph, tiered on its own, the guards
            # between them (the replay of the whole graph where it cannot be cut)
            segmented = self._segments(trace, run)
            if segmented is not None:
                run = segmented
                notes.append("replayed whole until hot, then each segment replayed and "
                             "compiled by Inductor in the background once it stays hot")
            else:
                notes.append("replayed whole with a guard at each break (a value crossing a "
                             "break is not a tensor)")
        elif trace.reads and self.backend != "replay":
            # a graph with breaks: its guards are Python calls between its segments
            notes.append(f"replayed with a guard at each break (backend {self.backend!r} takes "
                         "graphs without breaks)")
        gm = cast(torch.fx.GraphModule, trace.graph_module)  # an entry is made of a graph
        constants = [c for c in trace.constants.values() if isinstance(c, torch.Tensor)]
        entry = Entry(key, run, trace.captured, constants, trace.out_spec, trace.out_leaves,
                      trace.out_tensor_positions, passes.count_ops(gm.graph), trace.seconds,
                      backend, gm, getattr(run, "__source__", None))
        entry.notes.extend(notes)
        if trace.reads:
            entry.reads = list(trace.reads)
            entry.save_rng = trace.random_before_read
        if isinstance(run, breaks.Segmented):
            entry.backend = "replay"
            segments = [r for r in run.runs if isinstance(r, tiering.Tiered)]

            def segment_promoted(tier: str, why: str, entry: Entry = entry) -> None:
                tiers = {r.tier for r in segments}
                entry.backend = "inductor" if tiers == {"inductor"} else \
                    "replay+inductor" if "inductor" in tiers else "replay"
            for segment in segments:
                segment.on_change = segment_promoted
        if isinstance(run, tiering.Tiered):
            entry.backend = "replay"

            def promoted(tier: str, why: str, entry: Entry = entry) -> None:
                entry.backend = tier
            run.on_change = promoted
        return entry

    @staticmethod
    def _segments(trace: tracer.Trace, whole: Callable[[List[Any]], List[Any]]
                  ) -> Optional[breaks.Segmented]:
        gm = cast(torch.fx.GraphModule, trace.graph_module)   # cleaned by backends.build

        def make_run(module: torch.fx.GraphModule, replay_only: bool) -> Any:
            replay = backends.replay.build(module, keep_autograd=trace.needs_autograd)
            if replay_only:
                return replay
            return tiering.Tiered(replay, module, backends.build_inductor_from)
        try:
            return breaks.split(gm, make_run, whole)
        except Exception:       # pragma: no cover - a graph fx cannot cut: replayed whole
            return None

    def _with_replay_fallback(self, run: Callable[[List[Any]], List[Any]], trace: tracer.Trace,
                              tensors: List[torch.Tensor], notes: List[str]
                              ) -> Callable[[List[Any]], List[Any]]:
        """Inductor compiles on its first run: if that fails (before any kernel ran), the
        entry replays the graph from then on."""
        state: Dict[str, Any] = {"run": run, "checked": False}

        def first_then(inputs: List[Any]) -> List[Any]:
            if state["checked"]:
                done: List[Any] = state["run"](inputs)
                return done
            try:
                out: List[Any] = state["run"](inputs)
            except Exception as exc:
                notes.append(f"inductor failed ({type(exc).__name__}: {exc}); replayed instead")
                warnings.warn(f"{self._api()}: inductor could not compile this graph "
                              f"({type(exc).__name__}: {exc}); it is replayed instead.",
                              CompileWarning, stacklevel=3)
                state["run"] = backends.replay.build(
                    cast(torch.fx.GraphModule, trace.graph_module),
                    keep_autograd=trace.needs_autograd)
                out = state["run"](inputs)
            state["checked"] = True
            return out

        return first_then

    def _go_eager(self, reason: str) -> None:
        message = (f"{self._api()} runs eagerly: {reason}. A compiled graph must not bake in "
                   "one answer for values it cannot see; move that step out of the compiled "
                   "function, or keep it eager.")
        if self.strict:
            raise UntraceableError(message)
        self._eager_reason = reason
        warnings.warn(message, CompileWarning, stacklevel=4)

    # ---------------------------------------------------------------- introspection
    def _api(self) -> str:
        return transform_call("compile", self._fn, backend=self.backend)

    def cache_info(self) -> CacheInfo:
        info = self._cache.info(self._eager_reason)
        for entries in list(self._dynamic.values()):
            info.entries += [EntryInfo(e.backend, e.ops, e.trace_seconds, True, list(e.notes))
                             for e in entries]
        failure = getattr(self, "_symbolic_failure", None)
        if failure is not None:
            info.eager_reasons.append(f"symbolic sizes not traceable ({failure}); "
                                      "one graph per size")
        return info

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until no background Inductor compilation of this function's graphs is pending
        (backend ``"tiered"``); whether none is.  Calls never need this: they replay meanwhile."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for entry in self._cache.all_entries():
            if isinstance(entry.run, (tiering.Tiered, breaks.Segmented)):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not entry.run.wait(left):
                    return False
        return True

    def cache_clear(self) -> None:
        self._cache.clear()
        self._dynamic.clear()

    def entries(self) -> List[Entry]:
        return self._cache.all_entries()

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        return functools.partial(self, obj)

    def __repr__(self) -> str:
        return f"<functrans.compile({getattr(self._fn, '__name__', self._fn)!r}, " \
               f"backend={self.backend!r})>"


@overload
def compile(fn: Callable[..., Any], *, backend: str = ..., dynamic: Optional[bool] = ...,
            strict: bool = ..., cache_size: int = ...) -> CompiledFunction: ...


@overload
def compile(fn: None = ..., *, backend: str = ..., dynamic: Optional[bool] = ...,
            strict: bool = ..., cache_size: int = ...
            ) -> Callable[[Callable[..., Any]], CompiledFunction]: ...


def compile(fn: Optional[Callable[..., Any]] = None, *, backend: str = "tiered",
            dynamic: Optional[bool] = None, strict: bool = False, cache_size: int = 8
            ) -> Union[CompiledFunction, Callable[[Callable[..., Any]], CompiledFunction]]:
    """Trace ``fn`` (typically a transform stack: ``compile(vmap(grad(loss)))``) once per
    argument signature into one graph of plain ATen ops, and replay it on later calls.

    Same signature and results as ``fn``; see the README's "Compiled transforms".  Usable as
    ``@compile`` or ``@compile(backend="inductor")``.  A call is keyed on the arguments'
    structure, tensor metadata (shape, strides, dtype, device, requires_grad), non-tensor
    values and ambient state (grad mode, default dtype, autocast); a new key traces again.
    A value read into Python (``.item()``, a branch on a tensor's value) or a data-dependent
    size (``nonzero``) is a graph break: the graph is replayed in segments with a guard on the
    value read at each break, and another value runs (or traces) the graph for that value.
    Calls inside another functrans transform, and functions that do something a graph cannot
    bake in (``.numpy()``, an in-place write before a read, Python side effects, a re-seeding of
    the random generator), run eagerly
    (after one ``CompileWarning``); ``cache_info()`` and ``explain`` say why.

    Args:
        fn: the function to compile; ``None`` returns a decorator with these settings.
        backend: ``'tiered'`` (the default: the graph replayed at once, and compiled by
            Inductor in the background once it stays hot, swapped in when ready and measured
            faster; no call waits for Inductor), or one pinned: ``'replay'`` (the traced graph
            replayed op by op, no compiler needed), ``'inductor'`` or ``'cudagraphs'``.
        dynamic: ``True``: trace sizes symbolically, so one graph serves every size its shape
            guards allow; ``False``: one graph per size; ``None``: static, symbolic after a
            second size is seen.
        strict: raise ``UntraceableError`` instead of warning and running eagerly (graph
            breaks are allowed).
        cache_size: how many graphs to keep (least recently used evicted beyond it).

    Returns:
        A ``CompiledFunction`` (callable like ``fn``, with ``cache_info()``,
        ``cache_clear()`` and ``wait()``), or, with ``fn=None``, a decorator that makes one.

    Raises:
        TransformArgumentError: an unknown backend, a bad ``dynamic``/``strict``/``cache_size``,
            or an ``fn`` that is not callable.

    Example:
        >>> import torch, functrans
        >>> loss = lambda w, x: (x @ w).pow(2).sum()
        >>> per_example_grads = functrans.compile(functrans.vmap(functrans.grad(loss),
        ...                                                      in_dims=(None, 0)))
        >>> w, xs = torch.ones(3), torch.ones(4, 2, 3)
        >>> per_example_grads(w, xs).shape          # traced on this first call
        torch.Size([4, 3])
        >>> torch.allclose(per_example_grads(w, xs), torch.full((4, 3), 12.))   # replayed
        True
        >>> info = per_example_grads.cache_info()
        >>> info.misses, info.hits, len(info.entries)
        (1, 1, 1)
    """
    api = transform_call("compile", fn, backend=backend, dynamic=dynamic, strict=strict,
                         cache_size=cache_size)
    if backend not in backends.BACKENDS:
        raise TransformArgumentError(
            f"{api}: unknown backend {backend!r}; the backends are "
            f"{', '.join(repr(b) for b in backends.BACKENDS)}.")
    if dynamic not in (None, True, False):
        raise TransformArgumentError(f"{api}: dynamic must be None, True or False, got "
                                     f"{dynamic!r}.")
    if not isinstance(strict, bool):
        raise TransformArgumentError(f"{api}: strict must be True or False, got {strict!r}.")
    if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
        raise TransformArgumentError(f"{api}: cache_size must be a positive int, got "
                                     f"{cache_size!r}.")
    if fn is None:
        return functools.partial(compile, backend=backend, dynamic=dynamic, strict=strict,
                                 cache_size=cache_size)
    if not callable(fn):
        raise TransformArgumentError(f"{api}: expected a function to compile, got "
                                     f"{type(fn).__name__}.")
    return CompiledFunction(fn, backend, dynamic, strict, cache_size)


def all_compiled() -> List[CompiledFunction]:
    return list(_all_compiled)
