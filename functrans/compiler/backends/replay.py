"""The "replay" backend: a cleaned graph run by generated straight-line Python.

What this module owns
- ``build(graph_module, keep_autograd)``: Python source with one line per op, compiled once,
  each op called through its fastest entry point (``entry_point``), intermediates freed after
  their last use; run under ``no_grad`` when the graph's outputs need no autograd graph.
- ``entry_point(node)``: the ``torch.*`` / ``Tensor.*`` / ``torch._C._nn``... function that
  dispatches to exactly the node's ``OpOverload`` with these arguments, else the overload's own
  C++ callable (``OpOverload._op``, no Python frame).  Measured on this CPU, one thread, small
  tensors: ``torch.tanh`` 1.18 µs, ``aten.tanh.default._op`` 1.49 µs, ``aten.tanh.default``
  1.98 µs; ``torch.sum(x, [1])`` 2.31 µs vs ``aten.sum.dim_IntList`` 3.62 µs.  A candidate is
  checked once per (op, argument kinds) by calling it on meta tensors under a dispatch mode
  that records what it reached; it is used only when that is the node's op and nothing else.

Imports: nothing (torch only).
"""
from __future__ import annotations

import keyword
import math
import operator
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

_NAMESPACES = (torch, torch._C._nn, torch._C._linalg, torch._C._special, torch._C._fft)
_verified: Dict[tuple, Optional[Callable]] = {}


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: List[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _kind(value: Any) -> Any:
    if isinstance(value, fx.Node):
        return "T"
    if isinstance(value, (list, tuple)):
        return (type(value).__name__,) + tuple(_kind(v) for v in value)
    return type(value).__name__


_NO_META = object()


def _as_meta(value: Any) -> Any:
    """value with each node replaced by a meta tensor like it; _NO_META where one cannot be
    made (no recorded metadata, or symbolic sizes)."""
    if isinstance(value, fx.Node):
        meta = value.meta.get("tensor_meta")
        if meta is None or not all(type(d) is int for d in (*meta.shape, *meta.stride)):
            return _NO_META
        return torch.empty_strided(tuple(meta.shape), tuple(meta.stride), dtype=meta.dtype,
                                   device="meta")
    if isinstance(value, (list, tuple)):
        items = [_as_meta(v) for v in value]
        return _NO_META if any(i is _NO_META for i in items) else type(value)(items)
    if isinstance(value, dict):
        items = {k: _as_meta(v) for k, v in value.items()}
        return _NO_META if any(i is _NO_META for i in items.values()) else items
    return value


def _candidates(op: torch._ops.OpOverload):
    name = op._schema.name.split("::")[-1]
    for space in _NAMESPACES:
        fn = getattr(space, name, None)
        if callable(fn):
            yield fn
    method = getattr(torch.Tensor, name, None)
    if callable(method):
        yield method


def entry_point(node: fx.Node) -> Callable:
    op = node.target
    key = (op, _kind(node.args), tuple(node.kwargs), tuple(_kind(v) for v in node.kwargs.values()))
    if key in _verified:
        return _verified[key] or op._op
    found = None
    args, kwargs = _as_meta(node.args), _as_meta(dict(node.kwargs))
    if args is _NO_META or kwargs is _NO_META:
        return op._op                 # nothing to check a candidate on: the op's own entry
    # a random factory (``rand([3], device=cpu)``) has no tensor to put on meta: the check
    # draws for real, so the generators are put back (the traced call drew what eager draws)
    random = torch.Tag.nondeterministic_seeded in op.tags
    cuda = random and torch.cuda.is_available() and torch.cuda.is_initialized()
    states = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None) \
        if random else None
    for candidate in _candidates(op):
        recorder = _Recorder()
        try:
            with recorder:
                candidate(*args, **kwargs)
        except Exception:
            continue
        if recorder.ops == [op]:
            found = candidate
            break
    if states is not None:
        torch.set_rng_state(states[0])
        if states[1] is not None:
            torch.cuda.set_rng_state_all(states[1])
    _verified[key] = found
    return found or op._op


def _literal(value: Any) -> Optional[str]:
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    return None


class _Source:
    def __init__(self):
        self.names: Dict[fx.Node, str] = {}
        self.globals: Dict[str, Any] = {}

    def bind(self, value: Any, prefix: str) -> str:
        name = f"{prefix}{len(self.globals)}"
        self.globals[name] = value
        return name

    def expr(self, value: Any) -> str:
        if isinstance(value, fx.Node):
            return self.names[value]
        if isinstance(value, (list, tuple)):
            inner = ", ".join(self.expr(v) for v in value)
            return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
        literal = _literal(value)
        return literal if literal is not None else self.bind(value, "k")


def generate(graph_module: fx.GraphModule) -> tuple:
    """(source, globals) of ``def replay(inputs): ... return [outputs]``."""
    graph = graph_module.graph
    src = _Source()
    lines = ["def replay(inputs):"]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        src.names[node] = f"a{i}"
    if placeholders:
        lines.append(f"    {', '.join(src.names[n] for n in placeholders)}"
                     f"{',' if len(placeholders) == 1 else ''} = inputs")
    last_use: Dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        for arg in node.all_input_nodes:
            last_use[arg] = node
    frees: Dict[fx.Node, List[fx.Node]] = {}
    for value, user in last_use.items():
        frees.setdefault(user, []).append(value)
    for i, node in enumerate(graph.nodes):
        if node.op == "placeholder":
            continue
        if node.op == "get_attr":
            src.names[node] = src.bind(getattr(graph_module, node.target), "c")
            continue
        if node.op == "output":
            outs = node.args[0]
            lines.append(f"    return [{', '.join(src.expr(v) for v in outs)}]")
            break
        name = f"v{i}"
        if node.target is operator.getitem:
            call = f"{src.expr(node.args[0])}[{src.expr(node.args[1])}]"
        else:
            fn = entry_point(node) if isinstance(node.target, torch._ops.OpOverload) \
                else node.target
            parts = [src.expr(a) for a in node.args]
            parts += [f"{k}={src.expr(v)}" for k, v in node.kwargs.items()
                      if k.isidentifier() and not keyword.iskeyword(k)]
            label = str(node.target).replace("aten.", "", 1).split(".")[0] \
                if isinstance(node.target, torch._ops.OpOverload) else "f"
            label = label if label.isidentifier() and not keyword.iskeyword(label) else "f"
            call = f"{src.bind(fn, label + '_')}({', '.join(parts)})"
        src.names[node] = name
        lines.append(f"    {name} = {call}")
        dead = [src.names[v] for v in frees.get(node, ()) if v.op == "call_function"]
        if dead:
            lines.append(f"    del {', '.join(dead)}")
    return "\n".join(lines) + "\n", src.globals


def build(graph_module: fx.GraphModule, keep_autograd: bool) -> Callable[[list], list]:
    source, namespace = generate(graph_module)
    code = compile(source, f"<functrans replay {id(graph_module):#x}>", "exec")
    exec(code, namespace)
    replay = namespace["replay"]
    replay.__source__ = source
    if keep_autograd:
        return replay
    set_grad = torch._C._set_grad_enabled
    is_enabled = torch.is_grad_enabled

    def replay_no_grad(inputs):
        if not is_enabled():
            return replay(inputs)
        set_grad(False)
        try:
            return replay(inputs)
        finally:
            set_grad(True)

    replay_no_grad.__source__ = source
    return replay_no_grad
