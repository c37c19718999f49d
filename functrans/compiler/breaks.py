"""Graph breaks as value guards: a value read into Python ends one segment of a traced graph.

A real-mode trace (compiler/tracer.py) is the eager call, so a value the function reads back
into Python (``.item()``, ``bool(t)``, ``if t:``: ``aten._local_scalar_dense``) is the real
value, and the rest of the graph is recorded for that value.  An op whose output shape depends
on the data (``nonzero``, ``masked_select``) is recorded with the size it had, and what follows
bakes that size in.  Instead of giving the graph up, the tracer records each such point as a
``Read`` and puts a guard node into the graph where the value was read: the graph up to a guard
is one segment, whose last value is the tensor read (or the output whose size was read).

What this module owns
- ``Read``: one break: its position in the sequence of reads, the value (a Python scalar, a
  tuple of sizes, or the list ``.tolist()`` gave), what was read and the user's line.
- ``read_guard`` / ``size_guard`` / ``list_guard`` (``.tolist()`` of a small tensor): the guard
  nodes' targets.  A replay runs the graph in order; at a guard it reads the value again and
  compares it with the trace's (``same_value``: NaN equals NaN):
  equal, the replay goes on into the next segment, which baked in that value; different, it
  raises ``ReadChanged`` before any op of the next segment ran.  The compiled function
  (compiler/function.py) then runs the variant traced for that value, or traces one: the
  graphs of one key form a tree keyed by the sequence of values read.
- ``hoist(graph)``: each guard moved up to just after the value it reads, where no write
  touches that value (a ``loss.item()`` returned after an in-place update is checked before
  the update).
- ``split(graph_module, make_run, whole)`` → ``Segmented``: the graph cut at its guards into one graph
  module per segment (the tiered backend replays each, and has Inductor compile a segment that
  stays hot), run in order with the guards between them.
- ``prefix_effects(graph)``: for each guard, whether ops before it write into an argument or
  captured tensor, or draw from a ``torch.Generator`` passed in (a guard that fails after such a
  write could not be undone: the function runs eagerly), and whether any draws random numbers
  (the global generators' states are saved before such a replay and restored when a guard
  fails, so the retrace draws the same numbers an eager call would: ``rng_state`` /
  ``set_rng_state``).
- ``Segmented``: the runner ``split`` returns (``state()`` and ``wait()`` over its segments); it
  replays the whole graph, guards inline, until the graph is hot, then runs segment by segment.

Imports: compiler.passes.
"""
from __future__ import annotations

import math
import operator
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.fx as fx

from . import passes


MAX_FLOAT_VALUES = 3    # a float read at one break that took more values: the function runs
                        # eagerly (compiler/function.py); ints, bools, sizes: up to cache_size
MAX_LIST_VALUES = 64    # .tolist() of a tensor with more values is not guarded (eager)
# (the limits on values a break may take are kept by compiler/function.py:
# CompiledFunction._too_many_values)


def has_float(value: Any) -> bool:
    """Whether a value read is (or holds) a float or complex."""
    if isinstance(value, list):
        return any(has_float(v) for v in value)
    return isinstance(value, (float, complex))


@dataclass
class Read:
    index: int            # position in the sequence of reads of one trace
    value: Any            # the Python scalar read, or the tuple of sizes
    what: str             # 'aten._local_scalar_dense (.item(), bool(), an `if` on a tensor)' ...
    line: str             # the user's line

    def describe(self) -> str:
        return f"break {self.index + 1} at {self.line}: {self.what} read {self.value!r}"


class ReadChanged(Exception):
    """A replay read another value at guard ``index`` than its trace did (no op after the
    guard ran)."""

    def __init__(self, index: int, value: Any) -> None:
        super().__init__(index, value)
        self.index, self.value = index, value


def same_value(a: Any, b: Any) -> bool:
    """Whether two values read are the same (NaN equals NaN; FX keeps a list argument as its
    ``immutable_list``)."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if type(a) is not type(b):
        return False
    if a == b:
        return True
    if isinstance(a, float):
        return math.isnan(a) and math.isnan(b)
    if isinstance(a, complex):
        return (a.real == b.real or (math.isnan(a.real) and math.isnan(b.real))) and \
            (a.imag == b.imag or (math.isnan(a.imag) and math.isnan(b.imag)))
    return False


def read_guard(tensor: torch.Tensor, expected: Any, index: int) -> None:
    """The guard node of a value read: ``tensor.item()`` must be ``expected``."""
    value = torch.ops.aten._local_scalar_dense.default(tensor)
    if not same_value(value, expected):
        raise ReadChanged(index, value)


def size_guard(tensor: torch.Tensor, expected: Tuple[int, ...], index: int) -> None:
    """The guard node of a data-dependent size: ``tensor``'s shape must be ``expected``."""
    shape = tuple(tensor.shape)
    if shape != expected:
        raise ReadChanged(index, shape)


def list_guard(tensor: torch.Tensor, expected: list, index: int) -> None:
    """The guard node of ``.tolist()``: every value must be the one the trace read."""
    values = tensor.tolist()
    if not same_value(values, expected):
        raise ReadChanged(index, values)


GUARDS = (read_guard, size_guard, list_guard)


def is_guard(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in GUARDS


def hoist(graph: fx.Graph) -> None:
    """Move each guard up to just after the value it reads (and the guard before it), when no
    op in the graph writes into that value's storage: the value there is the one read later,
    and a guard that fails earlier has run fewer ops (no write, no random draw) after the
    previous break.  The guards keep their order."""
    touched = passes.touched_by_writes(graph)
    previous: Optional[fx.Node] = None
    for node in [n for n in graph.nodes if is_guard(n)]:
        source = node.args[0]
        if isinstance(source, fx.Node) and source not in touched:
            order = {n: i for i, n in enumerate(graph.nodes)}
            anchor = source if previous is None or order[source] > order[previous] \
                else previous
            if order[anchor] < order[node]:
                anchor.append(node)
        previous = node


def prefix_effects(graph: fx.Graph) -> Tuple[Optional[Tuple[int, str]], bool]:
    """(``(index, the write in words)`` of the first guard some op before which writes into an
    argument or captured tensor, or None; whether a random op runs before some guard)."""
    outside = {n for n in graph.nodes if n.op in ("placeholder", "get_attr")}
    write: Optional[str] = None
    random_before = False
    random_seen = False
    for node in graph.nodes:
        if is_guard(node):
            if write is not None:
                return (node.args[2], write), random_before or random_seen
            random_before = random_before or random_seen
            continue
        if passes.is_random(node):
            random_seen = True
            if node.kwargs.get("generator") is not None and write is None:
                # a torch.Generator of the caller's: its state is not restored on a failure
                write = f"{node.target} drawing from a torch.Generator"
        if not any(a in outside for a in node.all_input_nodes):
            continue
        if passes.is_write(node) and write is None:
            write = f"{node.target} into an argument or a captured tensor"
        if node.op == "call_function" and (node.target is operator.getitem or (
                passes.is_op(node) and (node.target.is_view
                                        or node.target in passes.IDENTITIES))):
            outside.add(node)
    return None, random_before


def rng_state() -> List[Any]:
    """The global generators' states (CPU, and each CUDA device once CUDA is initialized)."""
    states: List[Any] = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state_all())
    return states


def set_rng_state(states: List[Any]) -> None:
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state_all(states[1])


WHOLE_CALLS = 8         # a graph with breaks is replayed whole (its guards inline) until it
WHOLE_SECONDS = 0.05    # ran this many calls and seconds; then segment by segment (Segmented)


class Segmented:
    """A graph with breaks run segment by segment, each segment its own callable (the tiered
    backend's: replayed, and compiled by Inductor in the background once that segment is hot),
    the guards between them.  ``steps``: ``(run, input nodes, output nodes)`` for a segment,
    ``(guard, node read, expected, index)`` for a break; values cross segments in a dict keyed
    by the original graph's nodes.  Until the graph is hot (``WHOLE_CALLS`` calls and
    ``WHOLE_SECONDS`` of replay) the replay of the whole graph, guards inline, serves the calls
    (``whole``): one generated function costs less a call than the segments' runners."""

    def __init__(self, placeholders: List[fx.Node], steps: List[tuple], outputs: List[Any],
                 runs: List[Any], constants: dict, whole: Any = None) -> None:
        self._placeholders, self._steps, self._outputs = placeholders, steps, outputs
        self._constants = constants   # get_attr node -> the tensor (captured: by identity)
        self.runs = runs        # the segments' callables (their state() and wait())
        self._whole = whole
        self._calls = 0
        self._seconds = 0.0

    def __call__(self, inputs: list) -> list:
        whole = self._whole
        if whole is not None:
            start = time.perf_counter()
            out: list = whole(inputs)
            self._calls += 1
            self._seconds += time.perf_counter() - start
            if self._calls >= WHOLE_CALLS and self._seconds >= WHOLE_SECONDS:
                self._whole = None          # hot: segment by segment from the next call
            return out
        env = dict(self._constants)
        env.update(zip(self._placeholders, inputs))
        for step in self._steps:
            if len(step) == 3:
                run, ins, outs = step
                env.update(zip(outs, run([env[n] for n in ins])))
            else:
                guard, node, expected, index = step
                guard(env[node], expected, index)
        return [env[o] if isinstance(o, fx.Node) else o for o in self._outputs]

    def state(self) -> str:
        if self._whole is not None:
            return (f"replayed whole until hot ({self._calls} calls so far), then segment by "
                    "segment")
        states = [run.state() if hasattr(run, "state") else
                  "replay (it writes into a value of an earlier segment)" for run in self.runs]
        return "segments: " + " | ".join(s.replace("tier: ", "") for s in states)

    def wait(self, timeout: Optional[float] = None) -> bool:
        return all(getattr(run, "wait", lambda t: True)(timeout) for run in self.runs)


def split(gm: fx.GraphModule, make_run: Any, whole: Any = None) -> Optional[Segmented]:
    """``gm`` (a cleaned graph with guards) as a ``Segmented``: each stretch between guards a
    graph module of its own (constants copied in, metadata kept), run by ``make_run(module,
    replay_only)`` (``replay_only``: the segment writes into a value an earlier one made); None
    when a value crossing a break is not a tensor (the whole graph is replayed then)."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    segment_of: dict = {}
    stretches: List[List[fx.Node]] = [[]]
    guards: List[fx.Node] = []
    for node in nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if is_guard(node):
            guards.append(node)
            stretches.append([])
            continue
        segment_of[node] = len(stretches) - 1
        stretches[-1].append(node)

    def later(user: fx.Node, index: int) -> bool:
        return user is output or is_guard(user) or segment_of.get(user, -1) > index

    steps: List[tuple] = []
    runs: List[Any] = []
    for index, stretch in enumerate(stretches):
        if stretch:
            graph = fx.Graph()
            env: dict = {}
            members = set(stretch)
            needed = list(dict.fromkeys(a for node in stretch for a in node.all_input_nodes
                                        if a not in members))
            # placeholders first, then constants: the arguments and earlier segments' values
            inputs = [a for a in needed if a.op != "get_attr"]
            if not all(isinstance(a.meta.get("val"), torch.Tensor) for a in inputs):
                return None
            for i, a in enumerate(inputs):
                env[a] = graph.placeholder(f"in{i}")
                env[a].meta = dict(a.meta)
            for a in needed:
                if a.op == "get_attr":
                    env[a] = graph.get_attr(a.target)
                    env[a].meta = dict(a.meta)
            for node in stretch:
                env[node] = graph.node_copy(node, lambda a: env[a])
            outs = [n for n in stretch if any(later(u, index) for u in n.users)]
            if not all(isinstance(n.meta.get("val"), torch.Tensor) for n in outs):
                return None
            graph.output([env[n] for n in outs])
            module = fx.GraphModule(gm, graph)
            # a segment writing into a value an earlier segment made (maybe a view of another
            # crossing value) stays replayed: Inductor sees its inputs as separate tensors
            crossing = any(a.op != "placeholder" for a in inputs)
            run = make_run(module, crossing and passes.writes_outside(module) is not None)
            runs.append(run)
            steps.append((run, inputs, outs))
        if index < len(guards):
            guard = guards[index]
            steps.append((guard.target, guard.args[0], guard.args[1], guard.args[2]))
    constants = {n: getattr(gm, n.target) for n in nodes if n.op == "get_attr"}
    return Segmented(placeholders, steps, list(output.args[0]), runs, constants, whole)

