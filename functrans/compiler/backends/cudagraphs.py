"""The "cudagraphs" backend: the graph compiled by Inductor (or, where Inductor cannot take it,
the replay), captured once in a CUDA graph and replayed with static input buffers.

A call copies the argument tensors into the static inputs, replays the CUDA graph, and returns
the static outputs themselves (as fresh tensors over the same memory): no copy of the results.
A later call must not overwrite what an earlier call returned and the caller still holds, so
before a replay each captured graph's output storages are checked for holders beyond the
backend's own (``torch._C._storage_Use_Count``: a returned tensor, or any view of one, still
alive); the first graph whose outputs nobody holds is replayed, and when every one is held a
further graph is captured (up to ``MAX_GRAPHS``, each with its own memory pool), after which the
call runs the compiled graph without a CUDA graph (fresh outputs).  A training loop that drops
each step's results replays one graph; ``a = f(x); b = f(y)`` captures a second.  Outputs that
are views of an input are cloned (the next call's input copy would overwrite them).

Taken only where it is exact: every input on one CUDA device, no autograd graph needed (a CUDA
graph records no backward), and no op that writes an input or a captured tensor (the warm-up
runs before capture would apply that write again).  Warm-up runs (which also compile with
Inductor) are on a side stream with the random generators forked.  Otherwise ``unavailable`` is
raised with the reason and the compiled function replays the graph instead.  Inductor failing
to compile the graph is not fatal: the replay is captured, and ``run.notes`` says why.

Imports: compiler.passes, compiler.backends.replay, compiler.backends.inductor.
"""
from __future__ import annotations

from typing import Callable, List, Set

import torch
import torch.fx as fx

from .. import passes
from . import inductor, replay

MAX_GRAPHS = 3
_use_count = torch._C._storage_Use_Count


def _storage_uses(t: torch.Tensor) -> int:
    return _use_count(t.untyped_storage()._cdata)


class _Captured:
    """One CUDA graph, its static outputs, how many holders their storages have when only this
    backend holds them, and which outputs share an input's storage (those are returned cloned:
    the next call's input copy would overwrite them)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, outputs: List[torch.Tensor],
                 input_storages: Set[int]):
        self.graph, self.outputs = graph, outputs
        self.baseline = [_storage_uses(o) for o in outputs]
        self.aliases_input = [o.untyped_storage().data_ptr() in input_storages for o in outputs]

    def free(self) -> bool:
        return all(_storage_uses(o) == n for o, n in zip(self.outputs, self.baseline))

    def results(self) -> list:
        return [o.clone() if alias else o.detach()
                for o, alias in zip(self.outputs, self.aliases_input)]


def build(gm: fx.GraphModule, inputs: List[torch.Tensor], needs_autograd: bool,
          unavailable) -> Callable[[list], list]:
    if not torch.cuda.is_available():
        raise unavailable("no CUDA device is available")
    devices = {t.device for t in inputs}
    if not inputs or any(d.type != "cuda" for d in devices) or len(devices) != 1:
        raise unavailable("cudagraphs needs every argument tensor on one CUDA device "
                          f"(got {sorted(str(d) for d in devices) or 'no tensor'})")
    if needs_autograd:
        raise unavailable("outputs need an autograd graph (a CUDA graph records no backward)")
    writes = passes.writes_outside(gm)
    if writes is not None:
        raise unavailable(f"the graph cannot be warmed up before capture: {writes}")
    device = next(iter(devices))
    static_inputs = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                     for t in inputs]
    with torch.no_grad():
        for s, t in zip(static_inputs, inputs):
            s.copy_(t)
    notes: List[str] = []
    try:       # Inductor's kernels, else the replay (inductor.build leaves ``gm`` as it was)
        inner = inductor.build(gm, inputs, unavailable)
        _warm_up(inner, static_inputs, device)
    except Exception as exc:
        notes.append(f"Inductor could not take the graph ({type(exc).__name__}: {exc}); the "
                     "replay is captured")
        inner = replay.build(gm, keep_autograd=False)
        _warm_up(inner, static_inputs, device)
    input_storages = {t.untyped_storage().data_ptr() for t in static_inputs}

    def capture() -> _Captured:
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            outputs = list(inner(static_inputs))
        return _Captured(graph, outputs, input_storages)

    captured = [capture()]

    def run(tensors):
        with torch.no_grad():
            for s, t in zip(static_inputs, tensors):
                if s.data_ptr() != t.data_ptr():
                    s.copy_(t)
            g = next((c for c in captured if c.free()), None)
            if g is None and len(captured) < MAX_GRAPHS:
                g = capture()
                captured.append(g)
            if g is None:          # every graph's outputs are held: run without a CUDA graph
                return [o.clone() if o.untyped_storage().data_ptr() in input_storages else o
                        for o in inner(static_inputs)]
            g.graph.replay()
            return g.results()

    run.notes = notes
    run.captured = captured
    return run


def _warm_up(inner: Callable[[list], list], static_inputs: List[torch.Tensor],
             device: torch.device) -> None:
    """Two runs on a side stream (the first compiles and loads kernels), generators forked."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.random.fork_rng(devices=[device.index or 0]), torch.cuda.stream(stream), \
            torch.no_grad():
        for _ in range(2):
            inner(static_inputs)
    torch.cuda.current_stream(device).wait_stream(stream)
