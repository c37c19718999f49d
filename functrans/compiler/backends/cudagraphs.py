"""The "cudagraphs" backend: the replay captured once in a CUDA graph, replayed with static
input buffers.

Each call copies the argument tensors into the static inputs, replays the CUDA graph and returns
clones of the static outputs (a later call must not overwrite what an earlier one returned).
Taken only where it is exact: every input on one CUDA device, no autograd graph needed (a CUDA
graph records no backward), and no op that writes an input or a captured tensor (the warm-up
run before capture would apply that write once more).  Warm-up runs on a side stream with the
random generators forked.  Otherwise ``unavailable`` is raised with the reason and the compiled
function replays the graph instead.

Imports: compiler.passes, compiler.backends.replay.
"""
from __future__ import annotations

from typing import Callable, List

import torch
import torch.fx as fx

from .. import passes
from . import replay


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
    run_graph = replay.build(gm, keep_autograd=False)
    device = next(iter(devices))
    static_inputs = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                     for t in inputs]
    for s, t in zip(static_inputs, inputs):
        s.copy_(t)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.random.fork_rng(devices=[device.index or 0]), torch.cuda.stream(stream):
        for _ in range(2):
            run_graph(static_inputs)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_outputs = run_graph(static_inputs)

    def run(tensors):
        for s, t in zip(static_inputs, tensors):
            s.copy_(t)
        graph.replay()
        return [o.clone() for o in static_outputs]

    return run
