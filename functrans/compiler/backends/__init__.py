"""The backends a traced graph can run on.

- ``"tiered"`` (the default): the replay, then Inductor once the graph is hot and measured
  faster (compiler/tiering.py wraps the replay).
- ``"replay"`` (replay.py): the cleaned graph as generated straight-line Python.
- ``"inductor"`` (inductor.py): the graph functionalized and compiled by PyTorch's Inductor.
- ``"cudagraphs"`` (cudagraphs.py): the replay captured in a CUDA graph (CUDA tensors only).

``build(backend, trace, inputs)`` returns a callable from the list of argument tensors to the list
of output tensors.  A backend that cannot take a graph raises ``BackendUnavailable`` with the
reason; the compiled function then replays it and records why.

Imports: compiler.passes, compiler.backends.replay, compiler.backends.inductor,
compiler.backends.cudagraphs, compiler.tracer.
"""
from __future__ import annotations

from typing import Callable, List

import torch

from .. import passes
from ..tracer import Trace
from . import cudagraphs, inductor, replay

BACKENDS = ("tiered", "replay", "inductor", "cudagraphs")


class BackendUnavailable(Exception):
    """This backend cannot run this graph (the reason is the message)."""


def build(backend: str, trace: Trace, inputs: List[torch.Tensor]) -> Callable[[list], list]:
    gm = trace.graph_module
    if backend in ("replay", "tiered"):     # tiered: the replay first (compiler/tiering.py)
        # Inductor gets the graph as the inductor backend does, not the replay's (aliases,
        # detaches and no-op views gone, subexpressions shared): with that one Inductor's CNN
        # per-sample gradients took 19.4 ms a call against 17.0 (same process, interleaved)
        source = copy_graph(gm.graph) if backend == "tiered" else None
        passes.clean(gm.graph, keep_autograd=trace.needs_autograd)
        gm.recompile()
        run = replay.build(gm, keep_autograd=trace.needs_autograd)
        if source is not None:
            run.inductor_source = source    # type: ignore[attr-defined]
        return run
    if backend == "inductor":
        passes.clean(gm.graph, keep_autograd=True)
        gm.recompile()
        return inductor.build(gm, inputs, BackendUnavailable)
    # "cudagraphs" (compile() admits only the names in BACKENDS)
    passes.clean(gm.graph, keep_autograd=trace.needs_autograd)
    gm.recompile()
    return cudagraphs.build(gm, inputs, trace.needs_autograd, BackendUnavailable)


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph``'s nodes (cleaning one leaves the other as it was); a module made of
    it with ``GraphModule(owner, copy)`` shares the owner's tensors: captured state stays the
    caller's objects, read at every call."""
    out = torch.fx.Graph()
    out.output(out.graph_copy(graph, {}))
    return out


def build_inductor_from(gm, inputs: List[torch.Tensor]) -> Callable[[list], list]:
    """The inductor backend on a graph module of its own (the tiered backend's copy of an
    entry's replayed graph)."""
    passes.clean(gm.graph, keep_autograd=True)
    gm.recompile()
    return inductor.build(gm, inputs, BackendUnavailable)
