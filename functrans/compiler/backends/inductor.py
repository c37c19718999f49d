"""The "inductor" backend: the traced graph made functional, then compiled by Inductor.

Rules write in place into views (``fill_``, ``copy_`` into an ``as_strided`` slice), which
Inductor cannot take directly, so the graph is first re-traced through functrans's own
``functionalize(..., remove="mutations")``: a graph of out-of-place ops that writes mutated
inputs back with ``copy_``.  Views stay views: removing them too (``"mutations_and_views"``)
turns each into a ``*_copy`` op that Inductor must materialize where it is an output, and the
per-example gradients that ``vmap(grad)`` returns are transposed views of one ``bmm``: a copy
was a third of per-sample-gradient time on an H200 (0.39 of 1.13 ms at B=512, 2026-11-27).
Tensors the graph read from closures (``get_attr``
constants) become inputs first, so their mutations are written back too and their current
values are read at every call.  The re-trace runs on clones of the inputs with the random
generators forked (it must not change anything the caller sees).  Inductor's graph-level entry
(``torch._inductor.compile``, no Dynamo) then compiles that graph once, here, for these static
shapes (functrans's own guards key it); with inputs that require grad AOTAutograd builds its
backward.  A failure to compile is ``unavailable`` (the entry replays the graph instead).

Imports: functionalization.
"""
from __future__ import annotations

import copy
import threading
from typing import Callable, List

import torch
import torch.fx as fx

from ...functionalization import functionalize


_INDUCTOR_LOCK = threading.Lock()   # one Inductor compilation at a time in this process


def _lift_constants(gm: fx.GraphModule) -> tuple:
    """A graph module taking the constants as trailing inputs, and the constant tensors.  Made
    on a copy of ``gm``'s graph: ``gm`` is left as it was (the compiled function's replay
    fallback and the cudagraphs backend's both replay it)."""
    graph = copy.deepcopy(gm.graph)
    constants = []
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = last_placeholder[-1] if last_placeholder else next(iter(graph.nodes))
    by_target = {}
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target)
        if not isinstance(value, torch.Tensor):
            continue
        if node.target not in by_target:
            with graph.inserting_after(anchor) if last_placeholder else graph.inserting_before(anchor):
                placeholder = graph.placeholder(f"constant_{len(constants)}")
            anchor, last_placeholder = placeholder, [placeholder]
            by_target[node.target] = placeholder
            constants.append(value)
        node.replace_all_uses_with(by_target[node.target])
        graph.erase_node(node)
    graph.lint()
    return fx.GraphModule(gm, graph), constants


def _views_as_reshapes(gm: fx.GraphModule) -> None:
    """``view`` nodes become ``reshape``: the trace recorded a ``view`` that the eager strides
    allowed, but Inductor propagates its own strides through the graph (its decompositions and
    layouts choose them), and may meet a tensor that shape cannot view (T5's attention in
    per-sample gradients: "Cannot view a tensor with shape [3, 2, 8, 5] and strides (80, 8, 1,
    16)"), so Inductor failed and the graph stayed on replay.  The graph is functional here (no
    writes through views), so a reshape's copy, where it makes one, changes no value."""
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
            changed = True
    if changed:
        gm.recompile()


def _clone(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    with torch.no_grad():
        out.copy_(t)
    return out.requires_grad_(t.requires_grad)


def build(gm: fx.GraphModule, inputs: List[torch.Tensor], unavailable) -> Callable[[list], list]:
    from torch.fx.experimental.proxy_tensor import make_fx

    lifted, constants = _lift_constants(gm)
    examples = [_clone(t) for t in list(inputs) + constants]
    devices = sorted({t.device.index or 0 for t in examples if t.device.type == "cuda"})

    def run_lifted(*tensors):
        return lifted(*tensors)

    try:
        with torch.random.fork_rng(devices=devices):
            functional = make_fx(functionalize(run_lifted, remove="mutations"))(
                *examples)
    except Exception as exc:
        raise unavailable(f"functionalizing the graph failed: {type(exc).__name__}: {exc}") \
            from exc
    _views_as_reshapes(functional)
    # Inductor's graph-level entry, straight from the functional ATen graph: no second Dynamo
    # pass (its guards on every call; its eval-frame wrapper refuses to run while another
    # thread's make_fx has FX's process-wide "tracing" flag up).  fallback_random: random ops
    # call ATen's own kernels on the global generator, so a seed gives the numbers eager gives
    # (Inductor's own RNG would draw others).
    from torch._inductor import compile as inductor_compile
    try:
        with _INDUCTOR_LOCK, torch.random.fork_rng(devices=devices):
            compiled = inductor_compile(functional, [_clone(t) for t in examples],
                                        options={"fallback_random": True})
    except Exception as exc:
        raise unavailable(f"Inductor failed: {type(exc).__name__}: {exc}") from exc

    def run(tensors):
        return compiled(*tensors, *constants)

    run.graph_module = functional
    return run
