"""``grad`` and ``grad_and_value``: gradients of a scalar function w.r.t. chosen arguments.

The gradient is taken with ``torch.autograd.grad`` w.r.t. fresh aliases of the chosen arguments;
``create_graph`` is on only when ordinary autograd or an outer transform needs the result to be
differentiable.  An outer ``torch.no_grad()`` is overridden (the transform still differentiates);
a ``torch.no_grad()`` inside the function is respected.

Imports: _pytree, errors, _differentiable, exact_norms, compiler.dynamo_entry (the route inside
torch.compile).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Tuple

import torch

from .._pytree import tree_flatten, tree_unflatten
from ..compiler import dynamo_entry
from ..errors import TransformArgumentError, transform_call
from .exact_norms import autodiff_level
from ._differentiable import (Argnums, connected_outside, detach_tree, gradients,
                              make_differentiable, normalize_argnums, outer_needs_graph,
                              replace_argnums, select_argnums, split_aux)


def grad_and_value(func: Callable[..., Any], argnums: Argnums = 0, has_aux: bool = False
                   ) -> Callable[..., Any]:
    """Like ``grad``, but the transformed function returns ``(gradient, value)``: one forward
    and one backward pass give both the loss and its gradient.

    Args:
        func: returns a scalar (0-d) tensor, or ``(scalar, aux)`` with ``has_aux=True``.
        argnums: which positional argument(s) to differentiate: an int or a tuple of ints
            (negative counts from the end).  An argument may be a pytree of tensors.
        has_aux: ``func`` returns ``(scalar, aux)``; ``aux`` (any pytree) is passed through,
            detached, and not differentiated.

    Returns:
        A function of the same arguments as ``func`` returning ``(gradient, value)``, or
        ``(gradient, (value, aux))`` with ``has_aux``.  ``gradient`` is as ``grad``'s (the
        structure and shapes of ``args[argnums]``; a tuple for a tuple ``argnums``); ``value``
        is ``func``'s 0-d output.

    Raises:
        TransformArgumentError: ``func`` does not return a 0-d tensor, ``argnums`` is out of
            range, or a chosen argument is not a floating-point/complex tensor.

    Example:
        >>> import torch, functrans
        >>> g, loss = functrans.grad_and_value(lambda x: (x ** 2).sum())(torch.tensor([1., 2.]))
        >>> g, loss
        (tensor([2., 4.]), tensor(5.))
        >>> f = lambda x: ((x ** 2).sum(), x.mean())
        >>> g, (loss, aux) = functrans.grad_and_value(f, has_aux=True)(torch.tensor([1., 2.]))
        >>> aux
        tensor(1.5000)
    """
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if dynamo_entry.active():  # inside torch.compile
            return dynamo_entry.call_transform(grad_and_value, (func, argnums, has_aux), {},
                                               args, kwargs)
        g, value, aux = grad_and_value_impl(func, argnums, has_aux, args, kwargs,
                                            "grad_and_value")
        return (g, (value, aux)) if has_aux else (g, value)
    return wrapper


def grad(func: Callable[..., Any], argnums: Argnums = 0, has_aux: bool = False
         ) -> Callable[..., Any]:
    """The gradient of a function returning a scalar tensor, w.r.t. ``args[argnums]``.

    ``grad(f)(*args)`` is ``torch.autograd.grad(f(*args), args[argnums])`` without the
    bookkeeping: it composes with ``vmap`` (per-example gradients) and with itself (higher
    derivatives).  An outer ``torch.no_grad()`` does not stop it.

    Args:
        func: returns a scalar (0-d) tensor, or ``(scalar, aux)`` with ``has_aux=True``.
        argnums: which positional argument(s) to differentiate: an int or a tuple of ints
            (negative counts from the end).  An argument may be a pytree of tensors (a dict of
            parameters); its gradient has the same structure.
        has_aux: ``func`` returns ``(scalar, aux)``; ``aux`` (any pytree) is passed through,
            detached, and not differentiated.

    Returns:
        A function of the same arguments as ``func``.  It returns the gradient: for an int
        ``argnums``, a value with the structure and shapes of ``args[argnums]``; for a tuple
        ``argnums``, a tuple of those.  With ``has_aux``: ``(gradient, aux)``.

    Raises:
        TransformArgumentError: ``func`` does not return a 0-d tensor, ``argnums`` is out of
            range, or a chosen argument is not a floating-point/complex tensor.

    Example:
        >>> import torch, functrans
        >>> functrans.grad(lambda x: (x ** 2).sum())(torch.tensor([1., 2.]))
        tensor([2., 4.])
        >>> f = lambda w, x: (w * x).sum()
        >>> functrans.grad(f, argnums=(0, 1))(torch.tensor([1., 2.]), torch.tensor([3., 4.]))
        (tensor([3., 4.]), tensor([1., 2.]))
        >>> per_example = functrans.vmap(functrans.grad(f), in_dims=(None, 0))
        >>> per_example(torch.ones(2), torch.arange(6.).reshape(3, 2))
        tensor([[0., 1.],
                [2., 3.],
                [4., 5.]])
        >>> functrans.grad(functrans.grad(lambda x: x ** 3))(torch.tensor(2.))
        tensor(12.)
    """
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if dynamo_entry.active():  # inside torch.compile
            return dynamo_entry.call_transform(grad, (func, argnums, has_aux), {}, args, kwargs)
        g, _, aux = grad_and_value_impl(func, argnums, has_aux, args, kwargs, "grad")
        return (g, aux) if has_aux else g
    return wrapper


def grad_and_value_impl(func: Callable[..., Any], argnums: Argnums, has_aux: bool,
                        args: Tuple[Any, ...], kwargs: Dict[str, Any], api: str
                        ) -> Tuple[Any, torch.Tensor, Any]:
    """(gradient, value, aux) of ``func`` at ``args``; ``api`` names the caller in errors."""
    api_call = transform_call(api, func, argnums=argnums)
    if not args:
        raise TransformArgumentError(
            f"{api_call}: the function was called with no positional arguments; {api} "
            "differentiates w.r.t. positional arguments chosen by argnums.")
    argnums = normalize_argnums(argnums, len(args), api_call)
    chosen = select_argnums(args, argnums)
    keep_graph = outer_needs_graph(tree_flatten(chosen)[0])
    grad_on = torch.is_grad_enabled()
    with autodiff_level("grad"), torch.enable_grad():
        diff, flat_inputs = make_differentiable(chosen, api_call, f"args[{argnums}]"
                                                if isinstance(argnums, int) else "args")
        out = func(*replace_argnums(args, argnums, diff), **kwargs)
        aux = None
        if has_aux:
            out, aux = split_aux(out, api_call)
        if not isinstance(out, torch.Tensor):
            raise TransformArgumentError(
                f"{api_call}: the function must return a scalar tensor, got "
                f"{type(out).__name__}. With an auxiliary output, return (loss, aux) and pass "
                "has_aux=True.")
        if out.dim() != 0:
            raise TransformArgumentError(
                f"{api_call}: the function must return a scalar (0-d) tensor, got shape "
                f"{tuple(out.shape)}. Reduce it (e.g. .sum() or .mean()), or use vjp or jacrev "
                "for non-scalar outputs.")
        # A closed-over tensor that requires grad (a parameter: gradient penalties) also
        # needs the graph, as in the reference library; found by walking the function's graph.
        keep_graph = connected_outside(keep_graph, grad_on,
                                       [out] + (tree_flatten(aux)[0] if has_aux else []),
                                       flat_inputs)
        grads = gradients([out] if out.requires_grad else [], flat_inputs, None, api_call,
                          create_graph=keep_graph)
    _, spec = tree_flatten(chosen)
    g = tree_unflatten(grads, spec)
    if not keep_graph:
        out, aux = out.detach(), detach_tree(aux)
    return g, out, aux
