"""Clean a traced graph before a backend runs it.

What this module owns
- ``clean(graph, keep_autograd)``: dead code removed (random ops and ops that write are kept:
  dropping a random op would shift the generator's stream; so are ops that return nothing,
  such as ``_linalg_check_errors``, and every op that may raise on its inputs' values: only an
  op known not to (``_value_blind``) is dropped, so a replay raises the eager call's errors,
  such as ``binary_cross_entropy``'s on an input outside [0, 1] in a vjp that needs only its
  backward); with ``keep_autograd=False`` (the
  replay runs under no_grad) also ``alias``/``detach``/``lift_fresh`` and views that change
  nothing (same shape and strides) replaced by their input, and common subexpressions shared.
  A node that could see a write — it is written, or shares storage through views with a node
  that is — is never merged or bypassed (``_touched_by_writes``).
- ``count_ops(graph)``: the number of ops a backend will run (``cache_info`` reports it).

Imports: nothing (torch.fx only).
"""
from __future__ import annotations

import operator
from typing import Dict, Set

import torch
import torch.fx as fx

aten = torch.ops.aten
_IDENTITIES = {aten.alias.default, aten.detach.default, aten.lift_fresh.default}
_MAYBE_NOOP_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                     aten.expand.default, aten.permute.default, aten.squeeze.dim,
                     aten.squeeze.dims, aten.unsqueeze.default,
                     aten.slice.Tensor}


def _is_op(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)


def _writes(node: fx.Node) -> bool:
    return _is_op(node) and node.target._schema.is_mutable


def _random(node: fx.Node) -> bool:
    return _is_op(node) and torch.Tag.nondeterministic_seeded in node.target.tags


# Ops that cannot raise on the values of their tensor arguments (only on their shapes and
# dtypes, which the trace fixed), beyond views, identities and the tags ``_value_blind`` takes.
_BLIND_PACKETS = {getattr(aten, name) for name in (
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot",
    "_to_copy", "copy", "_unsafe_view", "cat", "stack", "constant_pad_nd",
    "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
    "zeros_like", "ones_like", "empty_like", "full_like",
    "new_zeros", "new_ones", "new_empty", "new_full", "select_backward", "slice_backward")}


def _value_blind(node: fx.Node) -> bool:
    """Whether an unused op may be dropped without losing an error the eager call raises: a
    view, an identity, a reduction, a pointwise op with a floating, complex or bool output (an
    integral one may divide by zero), an op of ``_BLIND_PACKETS``, or one without tensor
    arguments.  Any other op may check its inputs' values in its kernel (binary_cross_entropy's
    range, embedding's indices, ...), so an eager call of it can raise."""
    target = node.target
    if target.is_view or target in _IDENTITIES or target.overloadpacket in _BLIND_PACKETS:
        return True
    if torch.Tag.reduction in target.tags or not node.all_input_nodes:
        return True
    if torch.Tag.pointwise in target.tags:
        val = node.meta.get("val")
        return isinstance(val, torch.Tensor) and (
            val.dtype.is_floating_point or val.dtype.is_complex or val.dtype == torch.bool)
    return False


def _is_impure(node: fx.Node) -> bool:
    if node.op in ("placeholder", "output"):
        return True
    if node.op == "call_function" and _is_op(node):
        # an op returning nothing is there for its effect: a check (_linalg_check_errors)
        return (_writes(node) or _random(node) or not node.target._schema.returns
                or not _value_blind(node))
    return node.op == "call_function" and node.target is not operator.getitem


def _touched_by_writes(graph: fx.Graph) -> Set[fx.Node]:
    """Nodes sharing storage (through views or multi-output getitems) with a written node."""
    parent: Dict[fx.Node, fx.Node] = {}

    def find(n):
        while parent.get(n, n) is not n:
            n = parent[n]
        return n

    written = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        tensor_args = [a for a in node.all_input_nodes]
        aliases_input = node.target is operator.getitem or (
            _is_op(node) and (node.target.is_view or node.target in _IDENTITIES))
        if aliases_input and tensor_args:
            parent[find(node)] = find(tensor_args[0])
        if _writes(node):
            written.extend(tensor_args)
            if tensor_args:   # an in-place op returns its (written) self
                parent[find(node)] = find(tensor_args[0])
    roots = {find(n) for n in written}
    return {n for n in graph.nodes if find(n) in roots}


def _same_layout(node: fx.Node, source: fx.Node) -> bool:
    a, b = node.meta.get("tensor_meta"), source.meta.get("tensor_meta")
    return (a is not None and b is not None and tuple(a.shape) == tuple(b.shape)
            and tuple(a.stride) == tuple(b.stride) and a.dtype == b.dtype)


def _freeze(value):
    if isinstance(value, (list, tuple)):
        return (type(value),) + tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return (dict,) + tuple((k, _freeze(v)) for k, v in value.items())
    if isinstance(value, float) and value != value:
        return ("nan",)
    return value if isinstance(value, fx.Node) else (type(value), value)


def _dead_code(graph: fx.Graph) -> None:
    try:
        graph.eliminate_dead_code(is_impure_node=_is_impure)
    except TypeError:  # older torch: no is_impure_node (ops that write are impure there too)
        for node in reversed(list(graph.nodes)):
            if not node.users and not _is_impure(node):
                graph.erase_node(node)


def clean(graph: fx.Graph, keep_autograd: bool) -> fx.Graph:
    _dead_code(graph)
    if keep_autograd:
        return graph
    touched = _touched_by_writes(graph)
    outputs = set(next(n for n in graph.nodes if n.op == "output").all_input_nodes)
    seen: Dict[tuple, fx.Node] = {}
    for node in list(graph.nodes):
        if not _is_op(node) or node in touched:
            continue
        source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if source is not None and node not in outputs and (
                node.target in _IDENTITIES or (node.target in _MAYBE_NOOP_VIEWS
                                               and _same_layout(node, source))):
            node.replace_all_uses_with(source)
            graph.erase_node(node)
            continue
        if _random(node) or _writes(node):
            continue
        key = (node.target, _freeze(node.args), _freeze(node.kwargs))
        try:
            hash(key)
        except TypeError:
            continue
        twin = seen.get(key)
        if twin is not None and node not in outputs:
            node.replace_all_uses_with(twin)
            graph.erase_node(node)
        else:
            seen.setdefault(key, node)
    _dead_code(graph)
    return graph


def writes_outside(gm: fx.GraphModule) -> "str | None":
    """The first op that writes into an argument or a captured tensor (or a view of one), in
    words; None when the graph writes only into tensors it made."""
    outside = {n for n in gm.graph.nodes if n.op in ("placeholder", "get_attr")}
    for node in gm.graph.nodes:
        if not any(a in outside for a in node.all_input_nodes):
            continue
        if _writes(node):
            return f"it writes into an argument or a captured tensor ({node.target})"
        if node.op == "call_function" and (node.target is operator.getitem or (
                _is_op(node) and (node.target.is_view or node.target in _IDENTITIES))):
            outside.add(node)
    return None


def unreplayable_twice(gm: fx.GraphModule) -> "str | None":
    """Why running ``gm`` an extra time would change what the caller sees (it writes into an
    input or a captured tensor, or draws random numbers); None when it would not."""
    for node in gm.graph.nodes:
        if _random(node):
            return f"it draws random numbers ({node.target})"
    return writes_outside(gm)


is_op, is_write, is_random, IDENTITIES = _is_op, _writes, _random, _IDENTITIES
touched_by_writes = _touched_by_writes


def count_ops(graph: fx.Graph) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function")
