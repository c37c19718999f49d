"""Pytree helpers for the transforms: flattening, leaf paths and broadcasting of in_dims/out_dims
prefixes.

Uses ``torch.utils._pytree``, so custom nodes registered there work everywhere.
``tree_flatten``/``tree_unflatten`` answer the trees every transform call flattens several times
(a tensor, a tuple or list of tensors) without walking them: PyTorch's walk costs about 7 us per
call, several times per transform call (issue 16's profiles).  The specs they return are
PyTorch's own, so either function accepts the other's.

Imports: nothing (torch.utils._pytree only).
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
import torch.utils._pytree as pytree

_is_leaf = getattr(pytree, "tree_is_leaf", None) or pytree._is_leaf
_flatten = pytree.tree_flatten
_unflatten = pytree.tree_unflatten
_Tensor = torch.Tensor
_NODES = pytree.SUPPORTED_NODES
_LEAF_SPEC = _flatten(0)[1]
# (container type, length) -> PyTorch's spec of a flat container of that many leaves, and the
# ids of those specs -> their container type, for the way back.
_FLAT_SPECS: Dict[Tuple[type, int], Any] = {}
_FLAT_TYPES: Dict[int, type] = {}


def _flat_spec(kind: type, n: int):
    spec = _FLAT_SPECS.get((kind, n))
    if spec is None:
        spec = _flatten(kind(range(n)))[1]
        _FLAT_SPECS[(kind, n)] = spec
        _FLAT_TYPES[id(spec)] = kind
    return spec


def tree_flatten(tree: Any):
    """``torch.utils._pytree.tree_flatten``, with a tensor and a flat tuple or list of tensors
    answered directly."""
    t = type(tree)
    if t is tuple or t is list:
        if len(tree) < 16:   # (one cached spec per container length: keep the cache small)
            for x in tree:
                if not isinstance(x, _Tensor) or type(x) in _NODES:
                    return _flatten(tree)
            return list(tree), _flat_spec(t, len(tree))
    elif isinstance(tree, _Tensor) and t not in _NODES:
        return [tree], _LEAF_SPEC
    return _flatten(tree)


def tree_unflatten(leaves, spec):
    """``torch.utils._pytree.tree_unflatten`` (the inverse of ``tree_flatten``)."""
    kind = _FLAT_TYPES.get(id(spec))
    if kind is not None and len(leaves) == spec.num_leaves:
        return kind(leaves)
    if spec is _LEAF_SPEC and len(leaves) == 1:
        return leaves[0]
    return _unflatten(leaves, spec)


def leaf_paths(tree: Any, root: str) -> List[str]:
    """Human-readable names of each leaf, e.g. ``args[1]['w']``."""
    flat, _ = pytree.tree_flatten_with_path(tree)
    return [root + pytree.keystr(path) for path, _ in flat]


def broadcast_prefix(prefix: Any, tree: Any, is_leaf_prefix) -> List[Any] | None:
    """Flatten ``prefix`` broadcast over the leaves of ``tree``; None if it is no prefix.

    Lists and tuples match each other by length; dicts match by key set (in the tree's order);
    other registered nodes must have the same type and context.
    """
    if is_leaf_prefix(prefix):
        return [prefix] * len(pytree.tree_leaves(tree))
    if _is_leaf(tree):
        return None
    if isinstance(prefix, dict) and isinstance(tree, dict):
        if set(prefix) != set(tree):
            return None
        pairs = [(prefix[k], tree[k]) for k in tree]
    elif isinstance(prefix, (list, tuple)) and isinstance(tree, (list, tuple)):
        if len(prefix) != len(tree):
            return None
        pairs = list(zip(prefix, tree))
    else:
        if type(prefix) is not type(tree) or type(tree) not in pytree.SUPPORTED_NODES:
            return None
        flatten = pytree.SUPPORTED_NODES[type(tree)].flatten_fn
        p_children, p_ctx = flatten(prefix)
        t_children, t_ctx = flatten(tree)
        if p_ctx != t_ctx or len(p_children) != len(t_children):
            return None
        pairs = list(zip(p_children, t_children))
    out: List[Any] = []
    for p, t in pairs:
        sub = broadcast_prefix(p, t, is_leaf_prefix)
        if sub is None:
            return None
        out.extend(sub)
    return out


def describe_structure(tree: Any) -> str:
    """A one-line picture of a pytree: containers as written in Python, tensors as
    ``Tensor(shape)``, other leaves by type, e.g. ``(Tensor(4, 3), {'w': Tensor(5,)})``."""
    try:
        return _describe(tree)
    except Exception:  # pragma: no cover
        return repr(type(tree))


def _describe(tree: Any) -> str:
    import torch
    if isinstance(tree, torch.Tensor):
        return f"Tensor{tuple(tree.shape)}" if tree.dim() != 1 else f"Tensor({tree.shape[0]},)"
    if tree is None:
        return "None"
    if _is_leaf(tree):
        return type(tree).__name__
    if isinstance(tree, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in tree.items()) + "}"
    if isinstance(tree, list):
        return "[" + ", ".join(_describe(v) for v in tree) + "]"
    if type(tree) is tuple:
        inner = ", ".join(_describe(v) for v in tree)
        return f"({inner},)" if len(tree) == 1 else f"({inner})"
    node_type = getattr(pytree, "_get_node_type", type)(tree)
    children, _ = pytree.SUPPORTED_NODES[node_type].flatten_fn(tree)
    return f"{type(tree).__name__}(" + ", ".join(_describe(v) for v in children) + ")"
