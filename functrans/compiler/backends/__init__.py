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
        passes.clean(gm.graph, keep_autograd=trace.needs_autograd)
        gm.recompile()
        return replay.build(gm, keep_autograd=trace.needs_autograd)
    if backend == "inductor":
        # the graph the tiered backend hands Inductor: cleaned as the replay is (aliases,
        # detaches and no-op views gone, common subexpressions shared) when no output needs
        # autograd (vmap(jacrev) MLP: 0.15 of torch.func eager pinned, 0.10 tiered, before)
        passes.clean(gm.graph, keep_autograd=trace.needs_autograd)
        gm.recompile()
        return inductor.build(gm, inputs, BackendUnavailable)
    # "cudagraphs" (compile() admits only the names in BACKENDS)
    passes.clean(gm.graph, keep_autograd=trace.needs_autograd)
    gm.recompile()
    return cudagraphs.build(gm, inputs, trace.needs_autograd, BackendUnavailable)


def build_inductor_from(gm, inputs: List[torch.Tensor]) -> Callable[[list], list]:
    """The inductor backend on a graph module of its own (the tiered backend's copy of an
    entry's replayed graph)."""
    passes.clean(gm.graph, keep_autograd=True)
    gm.recompile()
    return inductor.build(gm, inputs, BackendUnavailable)
