"""``jacrev``, ``jacfwd`` and ``hessian``: Jacobians as ``vmap`` over ``vjp`` / ``jvp`` with
standard-basis cotangents / tangents.

Shapes nest as in PyTorch's transforms: for output leaf ``o`` and input leaf ``x`` the block has
shape ``o.shape + x.shape``; the output's pytree is outside, the input's (and argnums') inside.
``chunk_size`` bounds how many basis vectors are pushed at once (memory), for all three; it is
checked by ``errors.check_chunk_size``, as vmap's is, and ``"auto"`` is passed on to the vmap
(``batching/chunking.py``).  Errors open with the call echoed
(``errors.transform_call``): ``hessian``'s name its own call, not the jacfwd/jacrev inside it.

Imports: _pytree, errors, _differentiable, vjp, jvp, batching.api (jacrev and jacfwd are vmaps of
vjp and jvp), compiler.dynamo_entry (the route inside torch.compile).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Literal, Tuple, Union

import torch

from .._pytree import tree_flatten, tree_unflatten
from ..errors import TransformArgumentError, check_chunk_size, transform_call
from ..batching.api import check_randomness, vmap_in
from ..compiler import dynamo_entry
from ._differentiable import Argnums, normalize_argnums, replace_argnums, select_argnums
from .jvp import jvp_impl
from .vjp import vjp_impl


def _basis(flat: List[torch.Tensor]) -> List[torch.Tensor]:
    """Standard basis vectors for a list of tensors, as one [N, *t.shape] block per tensor."""
    sizes = [t.numel() for t in flat]
    total = sum(sizes)
    out = []
    offset = 0
    for t, n in zip(flat, sizes):
        # out of place (no fill_diagonal_ on a slice): functionalize(jacfwd(f)) traces it
        eye = torch.eye(n, dtype=t.dtype, device=t.device)
        block = torch.cat([eye.new_zeros(offset, n), eye, eye.new_zeros(total - offset - n, n)])
        out.append(block.view(total, *t.shape))
        offset += n
    return out


def _partial(func: Callable[..., Any], args: Tuple[Any, ...], argnums: Argnums,
             kwargs: Dict[str, Any]) -> Callable[..., Any]:
    def f(*diff: Any) -> Any:
        chosen = diff if isinstance(argnums, tuple) else diff[0]
        return func(*replace_argnums(args, argnums, chosen), **kwargs)
    return f


def _argnums_setup(func: Callable[..., Any], argnums: Argnums, args: Tuple[Any, ...],
                   kwargs: Dict[str, Any], api: str
                   ) -> Tuple[Argnums, Tuple[Any, ...], Callable[..., Any]]:
    if not args:
        raise TransformArgumentError(f"{api}: the function was called with no positional "
                                     "arguments; argnums chooses positional arguments.")
    argnums = normalize_argnums(argnums, len(args), api)
    chosen = select_argnums(args, argnums)
    primals = chosen if isinstance(argnums, tuple) else (chosen,)
    return argnums, primals, _partial(func, args, argnums, kwargs)


def _nest(blocks: List[List[torch.Tensor]], out_spec: Any, in_structure: Tuple[Any, Any],
          argnums: Argnums) -> Any:
    """blocks[i][j]: block of output leaf i w.r.t. flat input leaf j -> nested result."""
    flat_in, in_spec = in_structure
    per_output = [tree_unflatten(row, in_spec) for row in blocks]
    if not isinstance(argnums, tuple):
        per_output = [p[0] for p in per_output]
    return tree_unflatten(per_output, out_spec)


def jacrev(func: Callable[..., Any], argnums: Argnums = 0, *, has_aux: bool = False,
           chunk_size: Union[int, Literal["auto"], None] = None) -> Callable[..., Any]:
    """The Jacobian of ``func`` w.r.t. ``args[argnums]`` by reverse mode (``vmap`` over
    ``vjp``): one backward pass per output element, batched.

    Prefer it to ``jacfwd`` when the function has fewer outputs than inputs.  A function with
    a single output element (a scalar loss) takes one backward pass and no vmap.

    Args:
        func: a function of tensors (or pytrees of tensors) returning a tensor or a pytree of
            tensors (``(output, aux)`` with ``has_aux=True``).
        argnums: which positional argument(s) to differentiate with respect to: an int or a
            tuple of ints (negative counts from the end).  A chosen argument may be a pytree of
            tensors (a dict of parameters).
        has_aux: ``func`` returns ``(output, aux)``; ``aux`` is passed through (detached) and
            not differentiated.
        chunk_size: how many basis cotangents (output elements) to pull back at once: bounds
            the memory of the vmapped backward; ``None`` means all at once; ``"auto"`` the
            most that fit in ``functrans.config.max_memory`` (measured on fake tensors, see
            ``vmap``).  The result does not depend on it.

    Returns:
        A function of the same arguments as ``func`` that returns the Jacobian, or
        ``(jacobian, aux)`` with ``has_aux``.
        The Jacobian has one block per (output leaf, input leaf) pair: for an output tensor
        ``o`` and an input tensor ``x`` the block has shape ``o.shape + x.shape``.  The
        output's pytree is outside, the input's inside: a dict output of tensors gives a dict
        of blocks; a dict input gives, per output, a dict of blocks; a tuple ``argnums`` gives,
        per output, a tuple with one entry per chosen argument.

    Raises:
        TransformArgumentError: ``argnums`` out of range, a chosen argument that is not a
            floating-point/complex tensor, or a bad ``chunk_size``.

    Example:
        >>> import torch, functrans
        >>> x = torch.tensor([1., 2., 3.])
        >>> functrans.jacrev(lambda x: x ** 2)(x)
        tensor([[2., 0., 0.],
                [0., 4., 0.],
                [0., 0., 6.]])
        >>> functrans.jacrev(lambda x: x.outer(x))(x).shape     # output (3, 3) + input (3,)
        torch.Size([3, 3, 3])
        >>> jx, jy = functrans.jacrev(torch.mul, argnums=(0, 1))(x, torch.ones(3))
        >>> jx.shape, jy.shape
        (torch.Size([3, 3]), torch.Size([3, 3]))
        >>> params = {"w": torch.ones(2, 3), "b": torch.ones(2)}
        >>> jac = functrans.jacrev(lambda p: p["w"] @ x + p["b"])(params)
        >>> jac["w"].shape, jac["b"].shape                      # (2,) + (2, 3), (2,) + (2,)
        (torch.Size([2, 2, 3]), torch.Size([2, 2]))
        >>> jac, aux = functrans.jacrev(lambda x: (x ** 2, x.sum()), has_aux=True)(x)
        >>> aux
        tensor(6.)
    """
    api = transform_call("jacrev", func, argnums=argnums)
    check_chunk_size(chunk_size, api)
    # (a torch.compile'd backward inside cannot take jacrev's batched cotangents: its vjp_fn then
    # records the forward again with compiled functions eager, see autodiff/vjp.py)
    return _jacrev(func, argnums, has_aux, chunk_size, api)


def _jacrev(func: Callable[..., Any], argnums: Argnums, has_aux: bool,
            chunk_size: Union[int, Literal["auto"], None], api: str) -> Callable[..., Any]:
    auto_cache: Dict[Any, Any] = {}     # chunk_size="auto": the choices, by call signature

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if dynamo_entry.active():  # inside torch.compile
            return dynamo_entry.call_transform(_jacrev, (func, argnums, has_aux, chunk_size, api),
                                               {}, args, kwargs)
        nums, primals, f = _argnums_setup(func, argnums, args, kwargs, api)
        res = vjp_impl(f, primals, has_aux, api)
        out, vjp_fn = res[0], res[1]
        flat_out, out_spec = tree_flatten(out)
        basis = _basis(flat_out)
        flat_in, in_spec = tree_flatten(primals)
        if basis and basis[0].shape[0] == 1:
            # One output element (a scalar loss): one vjp, no vmap.  Besides saving the vmap,
            # this keeps hessian = jacfwd(jacrev(f)) of a scalar f in forward-over-reverse
            # mode: a vmap inside a jvp sends the jvp down the double-vjp route.
            grads = vjp_fn(tree_unflatten([b[0] for b in basis], out_spec))
            flat_grads = [g.unsqueeze(0) for g in tree_flatten(grads)[0]]
        elif basis and basis[0].shape[0] > 0:
            grads = vmap_in(auto_cache, (args, kwargs),
                            lambda *ct: vjp_fn(tree_unflatten(list(ct), out_spec)),
                            chunk_size=chunk_size)(*basis)
            flat_grads = tree_flatten(grads)[0]
        else:
            flat_grads = [x.new_zeros((0, *x.shape)) for x in flat_in]
        blocks = []
        offset = 0
        for o in flat_out:
            n = o.numel()
            blocks.append([g[offset:offset + n].view(tuple(o.shape) + tuple(x.shape))
                           for g, x in zip(flat_grads, flat_in)])
            offset += n
        jac = _nest(blocks, out_spec, (flat_in, in_spec), nums)
        return (jac, res[2]) if has_aux else jac

    return wrapper


def jacfwd(func: Callable[..., Any], argnums: Argnums = 0, has_aux: bool = False, *,
           randomness: str = "error",
           chunk_size: Union[int, Literal["auto"], None] = None) -> Callable[..., Any]:
    """The Jacobian of ``func`` w.r.t. ``args[argnums]`` by forward mode (``vmap`` over
    ``jvp``): one Jacobian-vector product per input element, batched.

    Prefer it to ``jacrev`` when the function has more outputs than inputs.  The result is
    the same as ``jacrev``'s (same shapes and nesting).

    Args:
        func: a function of tensors (or pytrees of tensors) returning a tensor or a pytree of
            tensors (``(output, aux)`` with ``has_aux=True``).
        argnums: which positional argument(s) to differentiate with respect to: an int or a
            tuple of ints (negative counts from the end).  A chosen argument may be a pytree of
            tensors (a dict of parameters).
        has_aux: ``func`` returns ``(output, aux)``; ``aux`` is passed through (detached) and
            not differentiated.
        randomness: as ``vmap``'s (the basis tangents are pushed under a vmap): ``'error'``,
            ``'different'`` or ``'same'``.
        chunk_size: how many basis tangents (input elements) to push at once: bounds memory;
            ``None`` means all at once; ``"auto"`` as ``jacrev``'s.  The result does not
            depend on it.

    Returns:
        A function of the same arguments as ``func`` that returns the Jacobian, or
        ``(jacobian, aux)`` with ``has_aux``.
        The Jacobian has one block per (output leaf, input leaf) pair: for an output tensor
        ``o`` and an input tensor ``x`` the block has shape ``o.shape + x.shape``.  The
        output's pytree is outside, the input's inside: a dict output of tensors gives a dict
        of blocks; a dict input gives, per output, a dict of blocks; a tuple ``argnums`` gives,
        per output, a tuple with one entry per chosen argument.

    Raises:
        TransformArgumentError: ``argnums`` out of range, a chosen argument that is not a
            floating-point/complex tensor, a bad ``randomness`` or ``chunk_size``.

    Example:
        >>> import torch, functrans
        >>> x = torch.tensor([1., 2., 3.])
        >>> functrans.jacfwd(lambda x: torch.stack([x.sum(), x.prod()]))(x)
        tensor([[1., 1., 1.],
                [6., 3., 2.]])
        >>> functrans.jacfwd(torch.sin, chunk_size=2)(torch.zeros(3))
        tensor([[1., 0., 0.],
                [0., 1., 0.],
                [0., 0., 1.]])
        >>> jac = functrans.jacfwd(lambda x: x.outer(x))(x)
        >>> torch.allclose(jac, functrans.jacrev(lambda x: x.outer(x))(x))
        True
    """
    api = transform_call("jacfwd", func, argnums=argnums)
    check_randomness(randomness, api)
    check_chunk_size(chunk_size, api)
    return _jacfwd(func, argnums, has_aux, randomness, chunk_size, api)


def _jacfwd(func: Callable[..., Any], argnums: Argnums, has_aux: bool, randomness: str,
            chunk_size: Union[int, Literal["auto"], None], api: str) -> Callable[..., Any]:
    auto_cache: Dict[Any, Any] = {}     # chunk_size="auto": the choices, by call signature

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if dynamo_entry.active():  # inside torch.compile
            return dynamo_entry.call_transform(
                _jacfwd, (func, argnums, has_aux, randomness, chunk_size, api), {}, args, kwargs)
        nums, primals, f = _argnums_setup(func, argnums, args, kwargs, api)
        flat_in, in_spec = tree_flatten(primals)
        basis = _basis(flat_in)

        def push(*tangents: Any) -> Any:
            res = jvp_impl(f, primals, tree_unflatten(list(tangents), in_spec), has_aux, api,
                           via_argnums=True)
            return (res[1], res[2]) if has_aux else res[1]

        if has_aux:
            tangents_out, aux = vmap_in(auto_cache, (args, kwargs), push, out_dims=(0, None),
                                        randomness=randomness, chunk_size=chunk_size)(*basis)
        else:
            tangents_out = vmap_in(auto_cache, (args, kwargs), push, randomness=randomness,
                                   chunk_size=chunk_size)(*basis)
        flat_t, out_spec = tree_flatten(tangents_out)
        blocks = []
        for t in flat_t:
            o_shape = t.shape[1:]
            row, offset = [], 0
            for x in flat_in:
                n = x.numel()
                blk = t[offset:offset + n]                      # [n, *o_shape]
                blk = blk.movedim(0, -1).reshape(tuple(o_shape) + tuple(x.shape))
                row.append(blk)
                offset += n
            blocks.append(row)
        jac = _nest(blocks, out_spec, (flat_in, in_spec), nums)
        return (jac, aux) if has_aux else jac

    return wrapper


def hessian(func: Callable[..., Any], argnums: Argnums = 0, *, has_aux: bool = False,
            chunk_size: Union[int, Literal["auto"], None] = None) -> Callable[..., Any]:
    """The Hessian of ``func`` w.r.t. ``args[argnums]``: ``jacfwd(jacrev(func))``
    (forward-over-reverse).

    Args:
        func: a function of tensors (or pytrees of tensors), usually returning a scalar (0-d)
            tensor; for a non-scalar output the result is the Jacobian of its Jacobian.
            ``(output, aux)`` with ``has_aux=True``.
        argnums: which positional argument(s) to differentiate with respect to: an int or a
            tuple of ints (negative counts from the end).  A chosen argument may be a pytree of
            tensors (a dict of parameters).
        has_aux: ``func`` returns ``(output, aux)``; ``aux`` is passed through (detached) and
            not differentiated.
        chunk_size: as ``jacrev``'s and ``jacfwd``'s, for both passes; ``None`` means all at
            once.  With ``"auto"`` the outer (jacfwd) pass measures the whole computation and
            the inner one, running inside it, is not chunked.

    Returns:
        A function of the same arguments as ``func`` that returns the Hessian, or
        ``(hessian, aux)`` with ``has_aux``.  For a scalar output and an input tensor ``x``
        it has shape ``x.shape + x.shape`` (generally ``o.shape + x.shape + x.shape``).  With
        a tuple ``argnums`` it is a tuple of tuples: ``h[i][j]`` is the block of second
        derivatives w.r.t. chosen arguments ``i`` and ``j``, of shape
        ``o.shape + xi.shape + xj.shape``.

    Raises:
        TransformArgumentError: ``argnums`` out of range, a chosen argument that is not a
            floating-point/complex tensor, or a bad ``chunk_size``.

    Example:
        >>> import torch, functrans
        >>> x = torch.tensor([1., 2., 3.])
        >>> functrans.hessian(lambda x: (x ** 3).sum())(x)
        tensor([[ 6.,  0.,  0.],
                [ 0., 12.,  0.],
                [ 0.,  0., 18.]])
        >>> h = functrans.hessian(lambda x, y: (x * y).sum(), argnums=(0, 1))(x, torch.ones(2, 3))
        >>> h[0][1].shape                       # d2/dx dy: x.shape + y.shape
        torch.Size([3, 2, 3])
    """
    api = transform_call("hessian", func, argnums=argnums)
    check_chunk_size(chunk_size, api)
    inner = _jacrev(func, argnums, has_aux, chunk_size, api)
    return _jacfwd(inner, argnums, has_aux, "error", chunk_size, api)
