"""``vjp``: the output of a function and a function that pulls cotangents back to its inputs.

``vjp_fn`` may be called many times and under ``vmap`` (``vmap(vjp_fn)(basis)`` is a Jacobian):
it calls ``torch.autograd.grad`` with ``retain_graph=True`` on the recorded graph, and batched
cotangents flow through the backward formulas as BatchedTensors.

A ``torch.compile``'d function's compiled backward cannot take batched cotangents
(``vmap(vjp_fn)``): ``vjp_fn`` then records the forward again with compiled functions eager and
pulls the cotangents back through that graph, after one warning
(``batching.compile_boundary.retry_eagerly``).

Imports: _pytree, errors, _differentiable, exact_norms, compiler.dynamo_entry (the route inside
torch.compile), batching.compile_boundary (vjp_fn's eager retry).
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch

from ..batching.compile_boundary import is_batched_tangent_refusal, retry_eagerly
from ..compiler import dynamo_entry
from .._pytree import describe_structure, leaf_paths, tree_flatten, tree_unflatten
from ..errors import TransformArgumentError, transform_call
from .exact_norms import autodiff_level
from ._differentiable import (connected_outside, detach_tree, flatten_tensor_outputs,
                              gradients, make_differentiable, outer_needs_graph,
                              reaches_outside, split_aux)


def vjp(func: Callable[..., Any], *primals: Any, has_aux: bool = False) -> Tuple[Any, ...]:
    """Evaluate ``func(*primals)`` and return its output and a function that pulls
    cotangents back to the primals (a vector-Jacobian product, reverse mode).

    Args:
        func: a function of tensors (or pytrees of tensors) returning a tensor or a pytree of
            tensors (``(output, aux)`` with ``has_aux=True``).
        *primals: the positional arguments ``func`` is evaluated at; each a floating-point or
            complex tensor, or a pytree of them.
        has_aux: ``func`` returns ``(output, aux)``; ``aux`` is returned as is (detached) and
            not differentiated.

    Returns:
        ``(output, vjp_fn)``, or ``(output, vjp_fn, aux)`` with ``has_aux``.  ``output`` is
        ``func(*primals)``.  ``vjp_fn(cotangents)`` takes cotangents with the structure, shapes
        and dtypes of ``output`` and returns a tuple with one gradient per primal, each with
        that primal's structure and shapes.  ``vjp_fn`` may be called many times, and under
        ``vmap`` (``vmap(vjp_fn)(basis)`` gives Jacobian rows).  Its optional ``retain_graph``
        (default True) and ``create_graph`` (default: grad mode) are as in
        ``torch.autograd.grad``.

    Raises:
        TransformArgumentError: a primal that cannot be differentiated, or (from ``vjp_fn``)
            cotangents of another structure, shape or dtype than the output.

    Example:
        >>> import torch, functrans
        >>> out, vjp_fn = functrans.vjp(torch.sin, torch.zeros(3))
        >>> vjp_fn(torch.ones(3))
        (tensor([1., 1., 1.]),)
        >>> out, vjp_fn = functrans.vjp(torch.mul, torch.tensor([1., 2.]), torch.tensor([3., 4.]))
        >>> vjp_fn(torch.ones(2))             # one gradient per primal
        (tensor([3., 4.]), tensor([1., 2.]))
    """
    if dynamo_entry.active():  # inside torch.compile
        traced: Tuple[Any, ...] = dynamo_entry.vjp(vjp, func, primals, has_aux)
        return traced
    return vjp_impl(func, primals, has_aux, transform_call("vjp", func, "*primals"))


def vjp_impl(func: Callable[..., Any], primals: Tuple[Any, ...], has_aux: bool, api: str
             ) -> Tuple[Any, ...]:
    """``api``: the echoed call errors open with (``transform_call``)."""
    keep_graph = outer_needs_graph(tree_flatten(primals)[0])
    grad_on = torch.is_grad_enabled()
    with autodiff_level("grad"), torch.enable_grad():
        diff_primals, flat_inputs = make_differentiable(primals, api, "primals")
        out = func(*diff_primals)
        aux = None
        if has_aux:
            out, aux = split_aux(out, api)
        flat_out, out_spec = flatten_tensor_outputs(out, api)
    # Results stay differentiable (and vjp_fn builds a graph) only when they are connected to
    # something outside: an input that requires grad, an outer transform, or a closed-over
    # tensor that requires grad.  Otherwise they do not require grad, as the reference library's.
    aux_flat = tree_flatten(aux)[0] if has_aux else []
    keep_graph = connected_outside(keep_graph, grad_on, flat_out + aux_flat, flat_inputs)
    # Under torch.no_grad() the results are detached, but the function's graph (recorded under
    # enable_grad) still reaches an input or closed-over tensor that requires grad: a vjp_fn
    # called later with grad mode on gives a differentiable result, as the reference's does.
    connected = keep_graph or (not grad_on and reaches_outside(flat_out, flat_inputs))
    vjp_fn = _make_vjp_fn(flat_out, out_spec, flat_inputs, primals, api, connected,
                          lambda: vjp_impl(func, primals, has_aux, api)[1])
    result_out = out if keep_graph else detach_tree(out)
    if has_aux:
        return result_out, vjp_fn, (aux if keep_graph else detach_tree(aux))
    return result_out, vjp_fn


def _make_vjp_fn(flat_out: List[torch.Tensor], out_spec: Any, flat_inputs: List[torch.Tensor],
                 primals: Tuple[Any, ...], api: str, connected: bool,
                 eager_vjp_fn: Callable[[], Callable[..., Tuple[Any, ...]]]
                 ) -> Callable[..., Tuple[Any, ...]]:
    _, primals_spec = tree_flatten(primals)

    def vjp_fn(cotangents: Any, retain_graph: Optional[bool] = True,
               create_graph: Optional[bool] = None) -> Tuple[Any, ...]:
        """The gradients w.r.t. the primals for ``cotangents`` (one per output).
        ``retain_graph`` (default True) keeps the graph for another call (``None``: as
        ``create_graph``); ``create_graph`` (default: grad mode) makes the result differentiable
        when something outside can differentiate it, as ``torch.autograd.grad``'s."""
        for name, v in (("retain_graph", retain_graph), ("create_graph", create_graph)):
            if v is not None and not isinstance(v, bool):
                raise TransformArgumentError(
                    f"{api}: vjp_fn's {name} must be True, False or None, got {v!r}.")
        flat_ct, ct_spec = tree_flatten(cotangents)
        if ct_spec != out_spec:
            raise TransformArgumentError(
                f"{api}: vjp_fn expects cotangents with the structure of the function's output "
                f"({describe_structure(tree_unflatten(flat_out, out_spec))}), got "
                f"{describe_structure(cotangents)}. Pass one cotangent per "
                "output, in the same (nested) container.")
        for i, (c, o) in enumerate(zip(flat_ct, flat_out)):
            if not isinstance(c, torch.Tensor):
                raise TransformArgumentError(
                    f"{api}: vjp_fn got a {type(c).__name__} as the cotangent at "
                    f"{leaf_paths(cotangents, 'cotangents')[i]}; cotangents must be tensors "
                    "(one per output, of the output's shape and dtype).")
            if c.shape != o.shape:
                raise TransformArgumentError(
                    f"{api}: vjp_fn got a cotangent of shape {tuple(c.shape)} (at "
                    f"{leaf_paths(cotangents, 'cotangents')[i]}) for an output of shape "
                    f"{tuple(o.shape)}; a cotangent must have the shape of its output.")
            if c.dtype != o.dtype:
                raise TransformArgumentError(
                    f"{api}: vjp_fn got a cotangent of dtype {c.dtype} (at "
                    f"{leaf_paths(cotangents, 'cotangents')[i]}) for an output of dtype "
                    f"{o.dtype}; convert it with .to({o.dtype}).")
        if create_graph is None:
            create_graph = torch.is_grad_enabled()
        if retain_graph is None:
            retain_graph = create_graph
        # The aliases always require grad, so they say nothing: a graph is built only when the
        # function's graph reaches outside (``connected``), a cotangent requires grad, or a
        # transform is active around this call (otherwise nothing could differentiate the
        # result, and the reference's result does not require grad either).
        create_graph = create_graph and (
            connected or (torch.is_grad_enabled() and outer_needs_graph(flat_ct)))
        outs, cts = [], []
        for o, c in zip(flat_out, flat_ct):
            if o.requires_grad:
                outs.append(o)
                cts.append(c)
        try:
            with torch.enable_grad():
                grads = gradients(outs, flat_inputs, cts, api, retain_graph=retain_graph,
                                  create_graph=create_graph)
        except RuntimeError as e:
            if not is_batched_tangent_refusal(e):
                raise
            # A compiled backward refused batched cotangents: the forward again, eager.
            retried: Tuple[Any, ...] = retry_eagerly(eager_vjp_fn, e, api)(
                cotangents, retain_graph, create_graph)
            return retried
        return tuple(tree_unflatten(grads, primals_spec))

    return vjp_fn
