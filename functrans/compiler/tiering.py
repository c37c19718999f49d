"""Tiered compilation: the default backend ``"tiered"`` of ``functrans.compile``.

What this module owns
- ``Tiered``: an entry's callable that replays the traced graph (``backends.replay``) and, once
  the graph stays hot, has Inductor compile it on a background thread (one compilation at a time
  in the process), then measures the compiled graph against the replay on the next calls and
  keeps whichever is faster.  No call waits for Inductor: until the compiled graph is ready (or
  if Inductor fails, or is slower when measured, or gives another answer), calls replay.
  ``state()`` says which tier serves the entry and why (``cache_info()`` shows it);
  ``wait(timeout)`` blocks until no compilation of this entry is pending (benchmarks, tests).

A graph with breaks (compiler/breaks.py) gets one ``Tiered`` per segment, so each segment
goes to Inductor on its own once it is hot.

The life of an entry: ``replay`` → after ``HOT_CALLS`` calls and ``HOT_SECONDS`` of replay time
(or ``HOT_MANY_CALLS`` calls however short), the graph is copied and handed to the compiler
thread with clones of this call's inputs (``compiling``) → ready: the next call runs both (when
the graph is pure: no writes into its inputs, no random draws) and compares, then the two run
alternately, ``TRIAL_CALLS`` timed calls each after one untimed and at least ``TRIAL_SECONDS`` of
each (so both see the same load on
the machine), and the medians decide, Inductor winning ties within ``TRIAL_MARGIN`` (CPU; on CUDA the compiled graph is kept without timing:
launches are asynchronous) → ``inductor`` or back to ``replay`` with the reason.

A caveat of running Inductor beside the caller: while its AOTAutograd traces (make_fx), FX's
process-wide "symbolic tracing" flag is up, and a ``torch.compile``d function called meanwhile in
another thread would refuse to run ("Detected that you are using FX to symbolically trace a
dynamo-optimized function"); Dynamo's ``error_on_nested_fx_trace`` is off for the duration, so
such a call runs its function eagerly instead (same answer, slower for that call).

Imports: compiler.passes, compiler.backends.
"""
from __future__ import annotations

import concurrent.futures
import statistics
import threading
import time
from typing import Any, Callable, List, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from . import passes
from .backends import copy_graph

HOT_CALLS = 8           # calls before a graph counts as hot ...
HOT_SECONDS = 0.05      # ... and seconds of replay time summed over them,
HOT_MANY_CALLS = 200    # or this many calls however short
TRIAL_CALLS = 6         # calls of each, alternated, timed before the choice (after one each),
TRIAL_SECONDS = 0.05    # and at least this many timed seconds of each (a 0.4 ms graph: 125
TRIAL_MAX_CALLS = 500   # calls; 6 were noise), up to this many calls of each;
TRIAL_MARGIN = 0.05     # Inductor is kept unless the replay is faster by more than this: on a
#                         kernel-bound graph the two differ by less than the machine's noise
#                         (per-sample grads MLP: Inductor 0.92 of eager, replay 0.98, and one
#                         trial kept the replay)

_executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
_executor_lock = threading.Lock()


def _compiler_thread() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="functrans-inductor")
        return _executor


def _clone(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    with torch.no_grad():
        out.copy_(t)
    return out.requires_grad_(t.requires_grad)


def _same(a: List[Any], b: List[Any]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            if x.is_floating_point() or x.is_complex():
                if not torch.allclose(x.detach(), y.detach(), rtol=1e-4, atol=1e-5,
                                      equal_nan=True):
                    return False
            elif not torch.equal(x, y):
                return False
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) or x != y:
            return False
    return True


class Tiered:
    """Replay now, Inductor when hot and faster (see the module doc)."""

    def __init__(self, replay: Callable[[list], list], graph_module: fx.GraphModule,
                 build_inductor: Callable[[fx.GraphModule, List[torch.Tensor]],
                                          Callable[[list], list]],
                 source: Optional[fx.Graph] = None) -> None:
        """``source``: the graph Inductor compiles (default: ``graph_module``'s), its tensors
        ``graph_module``'s."""
        self._replay = replay
        self._graph = graph_module
        self._source = source if source is not None else graph_module.graph
        self._build = build_inductor
        self._lock = threading.Lock()
        self._calls = 0
        self._replay_seconds = 0.0
        self._replay_times: List[float] = []
        self._future: Optional[concurrent.futures.Future] = None
        self._candidate: Optional[Callable[[list], list]] = None
        self._trial: List[float] = []
        self._checked = False
        self._chosen: Optional[Callable[[list], list]] = None
        self._tier = "replay"
        self._why = ""
        self._pure = passes.unreplayable_twice(graph_module) is None
        self.on_change: Optional[Callable[[str, str], None]] = None

    # ------------------------------------------------------------------ the call
    def __call__(self, inputs: list) -> list:
        chosen = self._chosen
        if chosen is not None:
            return chosen(inputs)
        candidate = self._candidate
        if candidate is not None:
            return self._try(candidate, inputs)
        start = time.perf_counter()
        out = self._replay(inputs)
        self._calls += 1
        self._replay_seconds += time.perf_counter() - start
        if self._future is None and self._tier == "replay" and not self._why \
                and self._calls >= HOT_CALLS and (self._replay_seconds >= HOT_SECONDS
                                                  or self._calls >= HOT_MANY_CALLS):
            self._start(inputs)
        return out

    def _start(self, inputs: list) -> None:
        with self._lock:
            if self._future is not None:
                return
            try:
                # a copy of the nodes (Inductor's passes edit them) and the caller's own
                # tensors: a deepcopy of the module copied captured tensors too, so a weight
                # updated in place after the entry moved to Inductor was read stale
                graph = fx.GraphModule(self._graph, copy_graph(self._source))
                examples = [_clone(t) if isinstance(t, torch.Tensor) else t for t in inputs]
            except Exception as exc:          # pragma: no cover - a graph that cannot be copied
                self._settle(None, f"the graph could not be copied for Inductor ({exc})")
                return
            self._tier = "compiling"
            self._future = _compiler_thread().submit(self._compile, graph, examples)

    def _compile(self, graph: fx.GraphModule, examples: list) -> None:
        import torch._dynamo.config as dynamo_config
        try:
            with dynamo_config.patch(error_on_nested_fx_trace=False):
                run = self._build(graph, examples)
        except Exception as exc:
            self._settle(None, f"Inductor failed ({type(exc).__name__}: {str(exc)[:200]})")
            return
        self._candidate = run

    def _try(self, candidate: Callable[[list], list], inputs: list) -> list:
        with self._lock:
            if self._chosen is not None:                  # another thread decided meanwhile
                return self._chosen(inputs)
            if self._candidate is not candidate:
                return self._replay(inputs)
            cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs)
            # the trial alternates the two, so that both see the same load on the machine
            replay_turn = self._checked and len(self._replay_times) < len(self._trial)
            start = time.perf_counter()
            if replay_turn:
                out = self._replay(inputs)
                self._replay_times.append(time.perf_counter() - start)
                return out
            try:
                out = candidate(inputs)
            except Exception as exc:
                self._settle(None, f"Inductor's graph failed on a call "
                                   f"({type(exc).__name__}: {str(exc)[:200]})")
                return self._replay(inputs)
            seconds = time.perf_counter() - start
            if not self._checked:
                self._checked = True
                if self._pure:
                    with torch.no_grad():
                        expected = self._replay(inputs)
                    if not _same(pytree.tree_leaves(out), pytree.tree_leaves(expected)):
                        self._settle(None, "Inductor's graph gave another answer than the "
                                           "replay; kept on replay")
                        return expected if not torch.is_grad_enabled() else \
                            self._replay(inputs)
                if cuda:
                    self._settle(candidate, "compiled by Inductor in the background (CUDA: "
                                            "not timed)")
                return out
            self._trial.append(seconds)
            if self._trial_done():
                compiled_ms = statistics.median(self._trial[1:]) * 1e3     # after one each
                replay_ms = statistics.median(self._replay_times[1:]) * 1e3
                if compiled_ms <= replay_ms * (1 + TRIAL_MARGIN):
                    self._settle(candidate, f"compiled by Inductor in the background "
                                            f"({compiled_ms:.3g} ms a call, replay "
                                            f"{replay_ms:.3g} ms)")
                else:
                    self._settle(None, f"Inductor was slower when measured "
                                       f"({compiled_ms:.3g} ms a call, replay "
                                       f"{replay_ms:.3g} ms); kept on replay")
            return out

    def _trial_done(self) -> bool:
        compiled, replay = self._trial[1:], self._replay_times[1:]   # after one each
        if len(compiled) < TRIAL_CALLS or len(replay) < TRIAL_CALLS:
            return False
        return (sum(compiled) >= TRIAL_SECONDS and sum(replay) >= TRIAL_SECONDS) \
            or len(compiled) >= TRIAL_MAX_CALLS

    def _settle(self, chosen: Optional[Callable[[list], list]], why: str) -> None:
        self._chosen = chosen if chosen is not None else self._replay
        self._candidate = None
        self._tier = "inductor" if chosen is not None else "replay"
        self._why = why
        if self.on_change is not None:
            self.on_change(self._tier, why)

    # ------------------------------------------------------------------ introspection
    @property
    def tier(self) -> str:
        """'replay', 'compiling' or 'inductor': what serves the entry now."""
        return self._tier

    def state(self) -> str:
        """The tier serving the entry now, and why (for ``cache_info()``)."""
        if self._tier == "compiling" and self._candidate is not None:
            return "tier: inductor ready, on trial against the replay"
        if self._tier == "compiling":
            return "tier: replay while Inductor compiles in the background"
        if self._why:
            return f"tier: {self._tier}: {self._why}"
        return f"tier: replay ({self._calls} calls so far)"

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until no compilation of this entry is pending; whether none is."""
        future = self._future
        if future is None:
            return True
        try:
            future.result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        return True
