"""Shared plumbing of the autodiff transforms: argnums, fresh differentiable aliases, has_aux,
and the decision whether an outer computation needs a differentiable result.

Each transform differentiates only with respect to FRESH aliases of its own inputs, so a nested
transform never confuses its perturbation with an outer one's.  An alias of a tensor that already
requires grad (an outer ``grad``, or ordinary autograd) is a view of it, so the result stays
differentiable from outside; an alias of any other tensor is a new leaf.  Views also keep a
forward-mode tangent, which is how ``jacfwd(jacrev(f))`` works; otherwise the alias is a
detached leaf.

Imports: _levels, _pytree, errors, batching.batched_tensor (to recognise wrappers, never the
dispatcher).
"""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple, Union

import torch

from .. import _levels
from .._pytree import leaf_paths, tree_flatten, tree_unflatten
from ..errors import EscapedBatchedTensorError, TransformArgumentError
from ..batching.batched_tensor import BatchedTensor

Argnums = Union[int, Tuple[int, ...]]


def normalize_argnums(argnums: Argnums, nargs: int, api: str) -> Argnums:
    def one(a):
        if not isinstance(a, int) or isinstance(a, bool):
            raise TransformArgumentError(
                f"{api}: argnums must be an int or a tuple of ints, got {argnums!r}.")
        if not -nargs <= a < nargs:
            raise TransformArgumentError(
                f"{api}: argnums={argnums!r} is out of range: the function was called with "
                f"{nargs} positional argument(s), so argnums must be in [{-nargs}, {nargs - 1}].")
        return a % nargs
    if isinstance(argnums, tuple):
        if not argnums:
            raise TransformArgumentError(f"{api}: argnums must not be an empty tuple.")
        out = tuple(one(a) for a in argnums)
        if len(set(out)) != len(out):
            raise TransformArgumentError(f"{api}: argnums={argnums!r} has duplicates.")
        return out
    return one(argnums)


def select_argnums(args: Sequence[Any], argnums: Argnums):
    return tuple(args[i] for i in argnums) if isinstance(argnums, tuple) else args[argnums]


def replace_argnums(args: Sequence[Any], argnums: Argnums, new) -> Tuple[Any, ...]:
    out = list(args)
    if isinstance(argnums, tuple):
        for i, v in zip(argnums, new):
            out[i] = v
    else:
        out[argnums] = new
    return tuple(out)


def requires_grad_anywhere(x: Any) -> bool:
    """Whether ``x`` is part of a graph at any level: a BatchedTensor reports
    ``requires_grad=False`` while its physical value (or a wrapper of an outer vmap inside it)
    may be differentiated by a transform outside the vmap (Note [autograd on physical values])."""
    while isinstance(x, torch.Tensor):
        if x.requires_grad:
            return True
        if type(x) is not BatchedTensor:
            return False
        x = x.value
    return False


_INTERNAL = "_functrans_internal_leaf"


def internal_leaf(t: torch.Tensor) -> torch.Tensor:
    """Mark a leaf that a transform creates for its own use (its differentiable aliases, the
    dummy cotangents of the double-vjp route), so that ``reaches_outside``, run by this or an
    outer transform, does not take it for a closed-over tensor."""
    setattr(t, _INTERNAL, True)
    return t


def differentiable_alias(x: torch.Tensor) -> torch.Tensor:
    """A fresh tensor to differentiate w.r.t.: a view when ``x`` is already part of a graph
    (requires grad) or may carry a forward-mode tangent, else a detached leaf (a view would let
    storage-addressing ops like as_strided see ``x``'s base)."""
    if requires_grad_anywhere(x) or _levels.forward_ad_state() in ("mine", "user"):
        alias = x.view_as(x)
        if not alias.requires_grad:
            internal_leaf(alias.requires_grad_())
        return alias
    return internal_leaf(x.detach().requires_grad_())


def make_differentiable(tree: Any, api: str, what: str) -> Tuple[Any, List[torch.Tensor]]:
    """Fresh differentiable aliases of every leaf of ``tree`` (all must be float tensors)."""
    flat, spec = tree_flatten(tree)
    out = []
    for i, leaf in enumerate(flat):
        if not isinstance(leaf, torch.Tensor):
            path = leaf_paths(tree, what)[i]
            raise TransformArgumentError(
                f"{api}: {path} is a {type(leaf).__name__}, not a tensor; it cannot be "
                "differentiated. Differentiate only tensor arguments (choose them with "
                "argnums) and pass other values as non-differentiated arguments.")
        if not (leaf.is_floating_point() or leaf.is_complex()):
            path = leaf_paths(tree, what)[i]
            raise TransformArgumentError(
                f"{api}: {path} has dtype {leaf.dtype}; only floating point and complex "
                "tensors can be differentiated. Convert it (x.float()) or exclude it from "
                "argnums.")
        out.append(differentiable_alias(leaf))
    return tree_unflatten(out, spec), out


def outer_needs_graph(tensors: Sequence[Any]) -> bool:
    """Whether the result must stay differentiable: ordinary autograd or an outer transform."""
    if not torch.is_grad_enabled():
        return False
    if any(level.kind in ("grad", "jvp") for level in _levels.stack()):
        return True
    return any(requires_grad_anywhere(t) for t in tensors)


def _accumulate_grad_type():
    with torch.enable_grad():
        leaf = torch.zeros(1, requires_grad=True)
        return type(leaf.view(1).grad_fn.next_functions[0][0])


_AccumulateGrad = _accumulate_grad_type()
# (dynamo_entry hook) Under torch.compile, AOTAutograd's fake inputs that require grad without
# being leaves hang from a DelayedError node (torch/_subclasses/meta_utils.py _backward_error),
# not an AccumulateGrad: reaching one is reaching outside (keeping the graph is never wrong).
_DelayedError = type(torch._C._functions.DelayedError("", 1)(
    torch.zeros(1, requires_grad=True)).grad_fn)


def reaches_outside(roots: Sequence[Any], own: Sequence[torch.Tensor]) -> bool:
    """Whether the autograd graph of ``roots`` reaches a leaf that requires grad other than
    the transform's own aliases ``own``: a tensor the function closed over (a parameter, a
    tensor of ordinary autograd outside).  Such a leaf makes the transform's results depend on
    something outside, so they must stay differentiable (as the reference library's do: its levels
    unwrap results to the outer level, where they require grad iff they depend on something
    that requires grad there).  The physical values inside BatchedTensors are walked too: a
    closed-over BatchedTensor whose physical value requires grad connects only through them
    (Note [autograd on physical values]).  Cost: one visit per graph node, stopping at the
    first outside leaf."""
    own_ids = {id(t) for t in own}
    todo = []
    for r in roots:
        while isinstance(r, torch.Tensor):
            fn = r.grad_fn
            if fn is not None:
                todo.append(fn)
            elif r.requires_grad and id(r) not in own_ids:
                return True
            if type(r) is not BatchedTensor:
                break
            r = r.value
    acc = _AccumulateGrad
    for nxt in _graph_below(todo):
        if type(nxt) is acc:
            var = nxt.variable
            if id(var) not in own_ids and not getattr(var, _INTERNAL, False):
                return True
        elif type(nxt) is _DelayedError:     # an input of AOTAutograd's trace (see above)
            return True
    return False


def _graph_below(todo: list):
    """Every autograd node reachable from the nodes in ``todo`` (not themselves), once each."""
    seen = set(todo)
    while todo:
        for nxt, _ in todo.pop().next_functions:
            if nxt is None or nxt in seen:
                continue
            seen.add(nxt)
            yield nxt
            todo.append(nxt)


def depends_on(root: torch.Tensor, inputs: Sequence[torch.Tensor]) -> bool:
    """Whether ``root``'s autograd graph reaches one of ``inputs`` (a transform's aliases, leaf
    or view): whether ``root`` depends on them at all (``jvp(strict=True)``).  Physical values
    inside BatchedTensors are walked too, as in ``reaches_outside``."""
    nodes, leaves = set(), set()
    for x in inputs:
        while isinstance(x, torch.Tensor):
            if x.grad_fn is not None:
                nodes.add(x.grad_fn)
            else:
                leaves.add(id(x))
            if type(x) is not BatchedTensor:
                break
            x = x.value
    todo = []
    while isinstance(root, torch.Tensor):
        if id(root) in leaves or root.grad_fn in nodes:
            return True
        if root.grad_fn is not None:
            todo.append(root.grad_fn)
        if type(root) is not BatchedTensor:
            break
        root = root.value
    acc = _AccumulateGrad
    return any(nxt in nodes or (type(nxt) is acc and id(nxt.variable) in leaves)
               for nxt in _graph_below(todo))


def connected_outside(pre: bool, grad_on: bool, roots: Sequence[Any],
                      own: Sequence[torch.Tensor]) -> bool:
    """Whether a transform's results must stay differentiable: ``pre`` (``outer_needs_graph``
    of its inputs, decided before running the function) or, when grad mode was on outside the
    transform (``grad_on``), a closed-over tensor that requires grad in ``roots``' graph."""
    return pre or (grad_on and reaches_outside(roots, own))


def split_aux(out: Any, api: str):
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        got = type(out).__name__
        if isinstance(out, (tuple, list)):
            got += f" of length {len(out)}"
        raise TransformArgumentError(
            f"{api}: with has_aux=True the function must return a pair (output, aux); got "
            f"{got}. Return `output, aux`, or set has_aux=False.")
    return out[0], out[1]


def detach_tree(tree: Any) -> Any:
    flat, spec = tree_flatten(tree)
    return tree_unflatten([t.detach() if isinstance(t, torch.Tensor) else t for t in flat], spec)


def gradients(outputs: List[torch.Tensor], inputs: List[torch.Tensor], cotangents, api: str,
              **grad_kwargs) -> List[torch.Tensor]:
    """``torch.autograd.grad(outputs, inputs, cotangents)`` for every transform: zeros for
    inputs the outputs do not depend on (no outputs at all: all zeros), autograd's "backward
    through the graph a second time" explained when the function called ``.backward()``
    itself, and a gradient that is a BatchedTensor of a vmap that has returned refused (the
    backward pass computed with a tensor that escaped it)."""
    grads = [None] * len(inputs)
    if outputs:
        try:
            grads = torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True,
                                        **grad_kwargs)
        except RuntimeError as e:
            if any(t.is_leaf and t.grad is not None for t in inputs):  # .backward() inside
                raise TransformArgumentError(
                    f"{api}: the function called .backward() (or torch.autograd.backward) on "
                    "its own output, which used up the graph the transform differentiates. Do "
                    "not call .backward() inside a transform: return the loss and let the "
                    "transform compute the gradient (grad / vjp), or call .backward() outside "
                    "the transform.") from e
            raise
    for g in grads:
        if type(g) is BatchedTensor and not g.level.alive:
            raise EscapedBatchedTensorError(
                f"{api}: the gradient is a BatchedTensor of a vmap (level {g.level.id}) that "
                "has already returned: the backward pass computed with a tensor that escaped "
                "that vmap (captured by a custom autograd.Function's backward, a hook or a "
                "closure). Return the tensor from the vmapped function instead of capturing it.")
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]


def flatten_tensor_outputs(out: Any, api: str):
    """``tree_flatten(out)``, requiring every leaf to be a tensor."""
    flat_out, out_spec = tree_flatten(out)
    for i, o in enumerate(flat_out):
        if not isinstance(o, torch.Tensor):
            raise TransformArgumentError(
                f"{api}: the function must return tensors (or pytrees of tensors); "
                f"{leaf_paths(out, 'output')[i]} is a {type(o).__name__}. Return it as aux with "
                "has_aux=True instead.")
    return flat_out, out_spec

