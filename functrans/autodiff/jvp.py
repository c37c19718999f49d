"""``jvp`` and ``linearize``: forward-mode derivatives.

``jvp`` runs on ``torch.autograd.forward_ad`` dual tensors.  PyTorch refuses nested dual levels,
so when a forward-mode level is already active (``jvp(jvp(f))``, ``jacfwd(jacfwd(f))``), when
an op has no forward-AD formula, or when ``func`` runs a vmap (see Note [autograd on physical
values] in batching/dispatch.py), jvp takes the double-vjp route instead:
``J t = d/du <J^T u, t>``, two reverse passes, exact.  ``linearize`` uses the same identity so that
it evaluates ``func`` once and each ``jvp_fn(t)`` is a single backward pass.

Forward-mode AD is switched on for jvp's own dual level whatever the caller's setting (under
``torch.autograd.forward_ad._set_fwd_grad_enabled(False)``, or inside a custom
``autograd.Function.forward``, where PyTorch switches it off), and the caller's setting is
restored on return and on exceptions, as in the reference library.  Only for its own level: the
double-vjp route leaves the setting alone, so an outer jvp's tangents still stop in a region
where the user switched forward AD off, even around an inner jvp (the reference library does
the same).  What the function computes in such a region is a constant for the double-vjp
route's level too, though it is reverse mode, and for no reverse transform (See Note
[forward-disabled regions on the double-vjp route] in forward_regions.py).

A tangent of another floating dtype than its primal (a float64 tangent for a float32 primal:
curvlinops' GGN products under ``torch.set_default_dtype(torch.float64)``) is accepted as the
reference library accepts it, with its rule, which is forward AD's own (``make_dual``): a tangent
laid out exactly as its primal (same sizes, strides of the dims longer than 1, storage offset, and
outside vmap the same storage size; under vmap each example's view) is used as given, so the
output tangents are promoted with its dtype (``sin`` of a float32 primal with a float64 tangent
gives a float64 tangent); any other tangent is first copied into its primal's layout AND dtype,
so the output tangents have the primals' dtypes (tangents batched on their last dim, as in the
GGN product, give float32).  The derivative is computed in the primal's dtype on every route,
the promotion applied to the result (where the reference mixes dtypes op by op, and its matmul
formulas refuse a float64 tangent with a layout-matching float32 primal).  ``linearize``'s
``jvp_fn`` refuses another dtype outside vmap, as the reference's does.

Imports: _levels, _pytree, errors, functionalization, _differentiable, exact_norms,
forward_regions, levels,
batching.batched_tensor (to read a wrapper's per-example layout),
compiler.dynamo_entry (the route inside torch.compile).
"""
from __future__ import annotations

import functools
import re
from typing import Any, Callable, List, Literal, Optional, Sequence, Tuple

import torch
import torch.autograd.forward_ad as fwAD

from .. import _levels
from ..batching.batched_tensor import BatchedTensor
from ..compiler import dynamo_entry
from ..functionalization import functional_tangents, unwrap_functional
from .._pytree import describe_structure, leaf_paths, tree_flatten, tree_unflatten
from ..errors import (ForwardModeAroundVmap, InplaceIntoUnbatchedError, TransformArgumentError,
                      transform_call)
from .exact_norms import autodiff_level
from .forward_regions import deriving
from .levels import AutodiffLevel, claim_forward_ad, release_forward_ad
from ._differentiable import (connected_outside, depends_on, detach_tree,
                              flatten_tensor_outputs, internal_leaf, make_differentiable,
                              outer_needs_graph, reaches_outside, split_aux)


def _check_primals_tangents(primals: Any, tangents: Any, api: str, via_argnums: bool = False,
                            other_dtype_ok: bool = True) -> Tuple[List[Any], List[Any], Any]:
    """``api`` is the echoed call; ``via_argnums``: the primals were chosen by argnums (jacfwd),
    so the fix for a non-differentiable one is to leave it out of argnums; ``other_dtype_ok``:
    a tangent of another floating dtype is accepted outside vmap too (jvp, not linearize)."""
    if not isinstance(primals, (tuple, list)):
        raise TransformArgumentError(
            f"{api}: primals must be a tuple of the function's positional arguments, got a "
            f"{type(primals).__name__}. Wrap a single argument: primals=(x,).")
    if not isinstance(tangents, (tuple, list)):
        raise TransformArgumentError(
            f"{api}: tangents must be a tuple with the structure of primals, got a "
            f"{type(tangents).__name__}. Wrap a single tangent: tangents=(t,).")
    flat_p, spec_p = tree_flatten(tuple(primals))
    flat_t, spec_t = tree_flatten(tuple(tangents))
    if spec_p != spec_t:
        raise TransformArgumentError(
            f"{api}: tangents must have the same structure as primals; primals are "
            f"{describe_structure(tuple(primals))}, tangents are "
            f"{describe_structure(tuple(tangents))}.")
    names = None
    for i, (p, t) in enumerate(zip(flat_p, flat_t)):
        if not isinstance(t, torch.Tensor) or not isinstance(p, torch.Tensor):
            names = names or leaf_paths(tuple(primals), "primals")
            raise TransformArgumentError(
                f"{api}: {names[i]} and its tangent must both be tensors, got "
                f"{type(p).__name__} and {type(t).__name__}.")
        if not (p.is_floating_point() or p.is_complex()):
            names = names or leaf_paths(tuple(primals), "primals")
            raise TransformArgumentError(
                f"{api}: {names[i]} has dtype {p.dtype}; only floating point and complex "
                "tensors can be differentiated. Convert it (x.float()), or "
                + ("exclude it from argnums." if via_argnums else
                   "close over it in the function instead of passing it in primals."))
        if p.shape != t.shape:
            names = names or leaf_paths(tuple(primals), "primals")
            raise TransformArgumentError(
                f"{api}: the tangent for {names[i]} has shape {tuple(t.shape)} but the primal "
                f"has shape {tuple(p.shape)}; each tangent must have its primal's shape.")
        if p.dtype != t.dtype and not (p.is_floating_point() and t.is_floating_point()
                                       and (other_dtype_ok or _under_vmap())):
            # Another floating dtype is accepted (see the module docstring); a complex tangent
            # for a real primal (or the reverse), an integer tangent, or another floating dtype
            # in linearize's jvp_fn outside vmap is refused.
            names = names or leaf_paths(tuple(primals), "primals")
            raise TransformArgumentError(
                f"{api}: the tangent for {names[i]} has dtype {t.dtype} but the primal has "
                f"dtype {p.dtype}; convert the tangent with .to({p.dtype}).")
    return flat_p, flat_t, spec_p


def _under_vmap() -> bool:
    return any(level.kind == "vmap" for level in _levels.stack())


def _cast_tangents(flat_p: Sequence[torch.Tensor], flat_t: Sequence[torch.Tensor]
                   ) -> Tuple[List[torch.Tensor], Optional[torch.dtype]]:
    """The tangents in their primals' dtypes, and the dtype the output tangents are promoted
    with: None unless a tangent of another dtype had its primal's layout (forward AD keeps
    such a tangent as given, and copies any other into its primal's layout and dtype)."""
    promote = None
    cast = []
    for p, t in zip(flat_p, flat_t):
        if t.dtype != p.dtype:
            if _same_layout(p, t):
                promote = t.dtype if promote is None else torch.promote_types(promote, t.dtype)
            t = t.to(p.dtype)
        cast.append(t)
    return cast, promote


def _same_layout(p: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether forward AD's ``make_dual`` would keep tangent ``t`` of primal ``p`` as given
    (PyTorch's ``has_same_meta``): the same storage offset, sizes and strides (a dim of size 0
    or 1 has any stride) and, between plain tensors, the same storage size.  A vmap wrapper
    shows example 0's view (its sizes, strides and offset), and is not compared by storage."""
    if p.storage_offset() != t.storage_offset() or p.shape != t.shape:
        return False
    if any(n > 1 and a != b for n, a, b in zip(p.shape, p.stride(), t.stride())):
        return False
    if isinstance(p, BatchedTensor) or isinstance(t, BatchedTensor):
        return True
    try:
        return (p.untyped_storage().nbytes() // p.element_size()
                == t.untyped_storage().nbytes() // t.element_size())
    except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage
        return True


def _promote_tangents(tangents_out: List[torch.Tensor], promote: Optional[torch.dtype]
                      ) -> List[torch.Tensor]:
    if promote is None:
        return tangents_out
    return [t.to(torch.promote_types(t.dtype, promote))
            if t.is_floating_point() else t for t in tangents_out]


class _forward_grad_on:
    """Forward-mode AD switched on inside, the caller's setting restored on exit."""

    __slots__ = ("prev",)

    def __enter__(self) -> None:
        self.prev = torch._C._is_fwd_grad_enabled()
        torch._C._set_fwd_grad_enabled(True)

    def __exit__(self, *exc: Any) -> Literal[False]:
        torch._C._set_fwd_grad_enabled(self.prev)
        return False


def jvp(func: Callable[..., Any], primals: Any, tangents: Any, *, strict: bool = False,
        has_aux: bool = False) -> Tuple[Any, ...]:
    """Evaluate ``func(*primals)`` and its Jacobian-vector product with ``tangents``
    (forward mode): ``(func(*primals), J @ tangents)``.

    Args:
        func: a function of tensors (or pytrees of tensors) returning a tensor or a pytree of
            tensors (``(output, aux)`` with ``has_aux=True``).
        primals: a tuple (or list) of ``func``'s positional arguments: floating-point or
            complex tensors, or pytrees of them.  A single argument is still a 1-tuple.
        tangents: the direction, with the structure of ``primals``; each tangent has its
            primal's shape and dtype, or for a floating primal another floating dtype (the
            output tangents' dtype then follows forward AD's rule: see the module docstring).
        strict: raise when an output does not depend on the primals (its tangent would be
            zero) instead of giving it a zero tangent.
        has_aux: ``func`` returns ``(output, aux)``; ``aux`` is returned as is (detached).

    Returns:
        ``(output, tangent_out)``, or ``(output, tangent_out, aux)`` with ``has_aux``.
        ``tangent_out`` has the structure and shapes of ``output``.

    Raises:
        TransformArgumentError: ``primals``/``tangents`` not tuples, of different structures,
            shapes or kinds of dtype (a complex or integer tangent for a floating primal), a
            primal that is not floating-point/complex, or (``strict``) an
            output that does not depend on the primals.

    Example:
        >>> import torch, functrans
        >>> functrans.jvp(torch.sin, (torch.zeros(2),), (torch.ones(2),))
        (tensor([0., 0.]), tensor([1., 1.]))
        >>> x, t = torch.tensor([1., 2.]), torch.tensor([1., 0.])
        >>> functrans.jvp(lambda x: x ** 2, (x,), (t,))[1]     # 2 * x * t
        tensor([2., 0.])
    """
    if dynamo_entry.active():  # inside torch.compile
        traced: Tuple[Any, ...] = dynamo_entry.call(
            functools.partial(jvp, func, strict=strict, has_aux=has_aux), (primals, tangents), {})
        return traced
    api = transform_call("jvp", func, "primals", "tangents",
                         **({"strict": True} if strict else {}))
    return jvp_impl(func, primals, tangents, has_aux, api, strict=strict)


def jvp_impl(func: Callable[..., Any], primals: Any, tangents: Any, has_aux: bool, api: str,
             strict: bool = False, via_argnums: bool = False) -> Tuple[Any, ...]:
    """``api``: the echoed call errors open with (``transform_call``)."""
    flat_p, flat_t, spec = _check_primals_tangents(primals, tangents, api, via_argnums)
    flat_t, promote = _cast_tangents(flat_p, flat_t)
    result = _jvp_routes(func, flat_p, flat_t, spec, has_aux, api, strict)
    if promote is None:
        return result
    flat_to, spec_to = tree_flatten(result[1])
    return (result[0], tree_unflatten(_promote_tangents(flat_to, promote), spec_to)) + \
        tuple(result[2:])


def _strict_error(api: str, out: Any, i: int) -> TransformArgumentError:
    path = leaf_paths(out, "output")[i] if not isinstance(out, torch.Tensor) else "the output"
    return TransformArgumentError(
        f"{api}: {path} of the function does not depend on the primals, so its tangent would "
        "be zero; strict=True refuses that. Pass strict=False (the default) to get a zero "
        "tangent for it.")


def _jvp_routes(func: Callable[..., Any], flat_p: List[torch.Tensor], flat_t: List[torch.Tensor],
                spec: Any, has_aux: bool, api: str, strict: bool) -> Tuple[Any, ...]:
    # One dual level at a time in the whole process (see _levels.forward_ad_state): a jvp
    # inside another (this thread's or another thread's) takes the exact double-vjp route.
    # So does a jvp whose results something outside differentiates (grad(jvp(f))): reverse
    # mode over PyTorch's forward-AD formulas is not always possible (softmax's formula
    # modifies a saved exp() in place, and plain PyTorch raises there too).
    if _levels.forward_ad_state() != "none" or \
            outer_needs_graph(list(flat_p) + list(flat_t)) or not claim_forward_ad():
        return _jvp_double_vjp(func, flat_p, flat_t, spec, has_aux, api, strict)
    try:
        result = _jvp_forward_ad(func, flat_p, flat_t, spec, has_aux, api, strict)
        if result is not None:
            return result
    except ForwardModeAroundVmap:
        pass
    except InplaceIntoUnbatchedError:
        pass  # See Note [a tangent formula's write into an unbatched tensor]
    except (RuntimeError, NotImplementedError) as e:
        if not (_no_forward_formula(e) or _tangent_layout_assert(e)):
            raise
    finally:
        release_forward_ad()
    return _jvp_double_vjp(func, flat_p, flat_t, spec, has_aux, api, strict)


def _tangent_layout_assert(e: BaseException) -> bool:
    """PyTorch's internal assert for a forward-differentiable view whose tangent's layout
    differs from its primal's.  Under vmap it fires when an UNBATCHED primal takes a lazy
    ``.conj()`` view (``torch.fft.ifft``/``ihfft`` of a real input, ``hfft``) while its tangent
    is batched (``vmap(jvp(f), in_dims=(None, 0))``, ``jacfwd``): the primal carries a conj bit,
    the batched tangent's conj is materialised (Note [conjugate and negative bits] in
    batching/rules/autograd_ops.py), and forward AD refuses the pair.  The double-vjp route needs no
    such pairing and is exact."""
    return "has_fw_view" in str(e) and "same layout as primal" in str(e)


# Note [a tangent formula's write into an unbatched tensor]
# vmap refuses an in-place write of a batched value into an unbatched tensor
# (InplaceIntoUnbatchedError).  Under forward AD that is often a tangent formula, not the
# function: an in-place op's formula writes the new tangent into the old one, and a composite
# such as ``torch.quantile`` picks its in-place ``lerp_`` branch because vmap's dispatch mode
# makes every tensor look like a subclass to ATen (``isTensorSubclassLike``), so a batched
# tangent (of ``q``) is written into an unbatched one (of the input).  The double-vjp route
# runs no tangent formula; if the function itself makes the write, it raises the same error
# there.


def _no_forward_formula(e: BaseException) -> bool:
    """An op (ATen: "Trying to use forward AD with X that does not support it") or a custom
    autograd.Function ("You must implement the jvp function ...") has no forward formula."""
    msg = str(e)
    return bool(re.search(r"forward[ -]?(AD|mode)", msg)) and (
        "not support" in msg or "not been implemented" in msg or "must implement" in msg)


def _jvp_forward_ad(func: Callable[..., Any], flat_p: List[torch.Tensor],
                    flat_t: List[torch.Tensor], spec: Any, has_aux: bool, api: str,
                    strict: bool = False) -> Optional[Tuple[Any, ...]]:
    # jvp_impl takes this route only when nothing outside differentiates the results, so
    # they are detached: a graph made inside f (the jacrev in hessian = jacfwd(jacrev(f)))
    # would otherwise stay alive on every result.  The one thing not known before running f
    # is whether it closed over a tensor that requires grad (a parameter, for a gradient
    # penalty); then the results must stay differentiable, which reverse mode over forward-AD
    # formulas cannot always give (see jvp_impl), so this returns None and jvp_impl runs f
    # again on the double-vjp route.
    grad_on = torch.is_grad_enabled()
    with autodiff_level("jvp"), _forward_grad_on(), fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(flat_p, functional_tangents(flat_t))]
        out = func(*tree_unflatten(duals, spec))
        aux = None
        if has_aux:
            out, aux = split_aux(out, api)
        flat_out, out_spec = flatten_tensor_outputs(out, api)
        primals_out, tangents_out = [], []
        for i, o in enumerate(flat_out):
            p, t = fwAD.unpack_dual(o)
            if t is None and strict:
                raise _strict_error(api, out, i)
            primals_out.append(p)
            tangents_out.append(torch.zeros_like(p) if t is None else t)
        if aux is not None:
            aux = tree_unflatten([fwAD.unpack_dual(a).primal if isinstance(a, torch.Tensor)
                                  else a for a in tree_flatten(aux)[0]], tree_flatten(aux)[1])
    if grad_on and reaches_outside(
            primals_out + tangents_out + (tree_flatten(aux)[0] if has_aux else []), ()):
        return None
    result = (detach_tree(tree_unflatten(primals_out, out_spec)),
              detach_tree(tree_unflatten(tangents_out, out_spec)))
    aux = detach_tree(aux) if aux is not None else None
    return result + (aux,) if has_aux else result


def _double_vjp_setup(func: Callable[..., Any], flat_p: List[torch.Tensor], spec: Any,
                      has_aux: bool, api: str, needs_graph: bool, grad_on: bool,
                      level: AutodiffLevel
                      ) -> Tuple[Any, Any, List[torch.Tensor], Any, List[torch.Tensor],
                                 Sequence[Optional[torch.Tensor]], List[torch.Tensor], bool]:
    """Run ``func`` once with a graph; return what J^T u and its derivative need.
    ``needs_graph`` and ``grad_on`` are decided by the caller BEFORE it pushes its own grad
    level (which ``outer_needs_graph`` would otherwise count as an outer transform); the
    results also stay differentiable when the function's graph reaches a closed-over tensor
    that requires grad, as the reverse transforms' do."""
    diff, flat_in = make_differentiable(tree_unflatten(flat_p, spec), api, "primals")
    out = func(*diff)
    aux = None
    if has_aux:
        out, aux = split_aux(out, api)
    flat_out, out_spec = flatten_tensor_outputs(out, api)
    keep_graph = connected_outside(needs_graph, grad_on,
                                   flat_out + (tree_flatten(aux)[0] if has_aux else []),
                                   flat_in)
    live = [o for o in flat_out if o.requires_grad]
    # J^T u is linear in u, so its derivative is the same at any u; u = 1 rather than 0
    # because some backward formulas are smooth in their incoming gradient only away from 0
    # (logcumsumexp's takes log|grad|: at 0 its derivative is 0 * inf = NaN).
    dummies = [internal_leaf(torch.ones_like(o).requires_grad_()) for o in live]
    vjps: Sequence[Optional[torch.Tensor]]
    if live:
        with deriving(level):
            vjps = torch.autograd.grad(live, flat_in, dummies, create_graph=True,
                                       allow_unused=True)
    else:
        vjps = [None] * len(flat_in)
    return out, aux, flat_out, out_spec, flat_in, vjps, dummies, keep_graph


def _pushforward(flat_out: List[torch.Tensor], flat_in: List[torch.Tensor],
                 vjps: Sequence[Optional[torch.Tensor]], dummies: List[torch.Tensor],
                 flat_t: List[torch.Tensor], keep_graph: bool, level: AutodiffLevel
                 ) -> List[torch.Tensor]:
    pairs = [(v, t) for v, t in zip(vjps, flat_t) if v is not None and v.requires_grad]
    grads_list: Sequence[Optional[torch.Tensor]]
    if pairs and dummies:
        with deriving(level):
            grads_list = torch.autograd.grad([v for v, _ in pairs], dummies,
                                             [t for _, t in pairs], retain_graph=True,
                                             create_graph=keep_graph, allow_unused=True)
    else:
        grads_list = [None] * len(dummies)
    # unwrap_functional: a graph recorded inside functionalize gives functional wrappers here
    grads = iter(grads_list)
    return [torch.zeros_like(o) if not o.requires_grad else
            (lambda g: torch.zeros_like(o) if g is None else unwrap_functional(g))(next(grads))
            for o in flat_out]


def _jvp_double_vjp(func: Callable[..., Any], flat_p: List[torch.Tensor],
                    flat_t: List[torch.Tensor], spec: Any, has_aux: bool, api: str,
                    strict: bool = False) -> Tuple[Any, ...]:
    needs_graph = outer_needs_graph(list(flat_p) + list(flat_t))
    grad_on = torch.is_grad_enabled()
    with autodiff_level("grad", order=2, forward=True) as level, torch.enable_grad():
        out, aux, flat_out, out_spec, flat_in, vjps, dummies, keep_graph = \
            _double_vjp_setup(func, flat_p, spec, has_aux, api, needs_graph, grad_on, level)
        if strict:
            for i, o in enumerate(flat_out):
                if not depends_on(o, flat_in):
                    raise _strict_error(api, out, i)
        tangents_out = _pushforward(flat_out, flat_in, vjps, dummies, flat_t, keep_graph, level)
    primal_out = out if keep_graph else detach_tree(out)
    result = (primal_out, tree_unflatten(tangents_out, out_spec))
    if has_aux:
        return result + (aux if keep_graph else detach_tree(aux),)
    return result


def linearize(func: Callable[..., Any], *primals: Any) -> Tuple[Any, Callable[..., Any]]:
    """Evaluate ``func(*primals)`` once and return a function for its Jacobian-vector
    products at ``primals``: ``(output, jvp_fn)``.

    ``jvp_fn(*tangents)`` equals ``jvp(func, primals, tangents)[1]``, but ``func`` is not run
    again: each call is one backward pass through a graph recorded once, so it pays off when
    many tangents are pushed at one point.

    Args:
        func: a function of tensors (or pytrees of tensors) returning a tensor or a pytree of
            tensors.
        *primals: the positional arguments ``func`` is evaluated at (floating-point or complex
            tensors, or pytrees of them).

    Returns:
        ``(output, jvp_fn)``: ``output`` is ``func(*primals)``; ``jvp_fn`` takes one tangent
        per primal (same structure, shapes and dtypes) and returns the output tangent, with
        the structure and shapes of ``output``.

    Example:
        >>> import torch, functrans
        >>> out, jvp_fn = functrans.linearize(lambda x: x ** 2, torch.tensor([1., 2.]))
        >>> jvp_fn(torch.tensor([1., 0.]))
        tensor([2., 0.])
        >>> jvp_fn(torch.tensor([0., 1.]))
        tensor([0., 4.])
    """
    api = transform_call("linearize", func, "*primals")
    flat_p, spec = tree_flatten(tuple(primals))
    needs_graph, grad_on = outer_needs_graph(flat_p), torch.is_grad_enabled()
    with autodiff_level("grad", order=2, forward=True) as level, torch.enable_grad():
        out, _, flat_out, out_spec, flat_in, vjps, dummies, keep_graph = \
            _double_vjp_setup(func, flat_p, spec, False, api, needs_graph, grad_on, level)

    def jvp_fn(*tangents: Any) -> Any:
        _, flat_t, _ = _check_primals_tangents(primals, tangents, f"{api}'s jvp_fn",
                                               other_dtype_ok=False)
        flat_t, promote = _cast_tangents(flat_p, flat_t)
        # differentiable when the primal side is, or a tangent is part of a graph
        graph = keep_graph or outer_needs_graph(flat_t)
        with torch.enable_grad():
            return tree_unflatten(_promote_tangents(
                _pushforward(flat_out, flat_in, vjps, dummies, flat_t, graph, level), promote),
                out_spec)

    return (out if keep_graph else detach_tree(out)), jvp_fn
