"""``vmap``: argument checking, batch-size inference, chunking, and one batched call.

One batched call pushes a ``VmapLevel`` (and its dispatch mode, ``mode.py``), wraps each mapped
input in a ``BatchedTensor``, runs the function, and turns each output back into a physical
tensor with its batch dim at ``out_dims`` (``helpers.match_bdim``); an output that aliases an
input comes back as a view of that input, as in eager (``_as_view_of_input``).  Wrapping needs no
autograd.Function: an input that carries autograd state keeps it on the physical value, and the
dispatcher records the rules' physical ops (see Note [autograd on physical values] in
dispatch.py).

``chunk_size="auto"`` asks ``chunking.choose()`` for the chunk, giving it this module's batched
call to probe on fake tensors, and the vmap's cache of earlier choices (``vmap_in()``: a cache
that a transform built on vmap keeps across its calls).

Imports: _levels, _pytree, errors, functionalization, chunking, batched_tensor, helpers, mode,
compiler.dynamo_entry (the route inside torch.compile).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple, Union, cast

import torch

from .. import _levels
from .. import functionalization as _functionalization
from .._pytree import broadcast_prefix, describe_structure, leaf_paths, tree_flatten, \
    tree_unflatten
from ..errors import (EscapedBatchedTensorError, ForwardModeAroundVmap, TransformArgumentError,
                      UnsupportedUnderVmap, check_chunk_size, transform_call)
from . import chunking
from .batched_tensor import BatchedTensor
from .helpers import match_bdim
from .mode import VmapLevelMode
from ..compiler import dynamo_entry

_RANDOMNESS = ("error", "different", "same")
# BatchedTensor as an isinstance target that does not narrow for the type checker: its
# ``level`` (set in ``__new__``) is not declared on the class
_BatchedTensor: Any = BatchedTensor


def vmap(func: Callable[..., Any], in_dims: Any = 0, out_dims: Any = 0, randomness: str = "error",
         *, chunk_size: Union[int, Literal["auto"], None] = None) -> Callable[..., Any]:
    """Vectorize ``func`` over a batch dimension of its inputs.

    Write ``func`` for ONE example; ``vmap(func)`` runs it on a batch, as if by a loop over the
    batch followed by ``torch.stack``, but with batched kernels.  Inside ``func`` every mapped
    tensor shows the shape of one example (the batch dim is hidden).

    Args:
        func: a function of tensors (or pytrees of tensors: tuples, lists, dicts) returning
            tensors (or pytrees of them).  Non-tensor arguments are passed through.
        in_dims: per positional argument, the dim to map over: an int (negative counts from the
            end), ``None`` for an argument shared by every example, or a pytree prefix of the
            arguments (a tuple with one entry per positional argument, each an int, ``None`` or
            a container matching that argument).  Keyword arguments are never mapped.  Every
            mapped dim must have the same size ``B``.
        out_dims: where the batch dim goes in each output: an int, ``None`` (for outputs that
            do not depend on the batch), or a pytree prefix of the outputs (a 1-tuple ``(k,)``
            is accepted for a function that returns one tensor).
        randomness: ``'error'`` (random ops raise), ``'different'`` (each example draws its own
            values) or ``'same'`` (one draw shared by the batch).
        chunk_size: run the batch in chunks of this many examples (bounds memory); the result
            is the same as without chunking.  ``None``: the whole batch at once.  ``"auto"``:
            the most examples whose peak memory, measured on fake tensors, fits in
            ``functrans.config.max_memory`` (by default half the free memory of the inputs'
            device); see ``functrans/batching/chunking.py``.

    Returns:
        The batched function.  Called with inputs whose mapped dims have size ``B``, it returns
        ``func``'s outputs (same pytree structure), each tensor with a dim of size ``B``
        inserted at its ``out_dim``: an output of per-example shape ``S`` has shape ``(B, *S)``
        with ``out_dims=0``.

    Raises:
        TransformArgumentError: (a ``ValueError``) bad ``in_dims``/``out_dims``/``randomness``/
            ``chunk_size``, or mapped inputs that disagree on the batch size.
        UnsupportedUnderVmap: an operation with no per-example meaning (``.item()`` on a
            batched value, a random op with ``randomness='error'``, ...).

    Example:
        >>> import torch, functrans
        >>> x = torch.arange(15.).reshape(5, 3)
        >>> functrans.vmap(torch.dot)(x, x)           # one dot product per row
        tensor([  5.,  50., 149., 302., 509.])
        >>> w = torch.ones(3, 2)
        >>> functrans.vmap(torch.mv, in_dims=(None, 0))(w.T, x).shape   # w shared
        torch.Size([5, 2])
        >>> functrans.vmap(lambda r: r * 2, out_dims=1)(x).shape
        torch.Size([3, 5])
    """
    api = _api_name(func, in_dims, out_dims)
    check_randomness(randomness, api)
    check_chunk_size(chunk_size, api)
    _check_dims_spec(in_dims, "in_dims", api)
    _check_dims_spec(out_dims, "out_dims", api)

    auto_cache: Dict[Any, Any] = {}     # chunk_size="auto": the choices, by call signature

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if dynamo_entry.active():  # inside torch.compile
            return dynamo_entry.call_transform(vmap, (func, in_dims, out_dims, randomness),
                                               {"chunk_size": chunk_size}, args, kwargs)
        return _vmap_call(func, in_dims, out_dims, randomness, chunk_size, args, kwargs,
                          auto_cache)

    return wrapped


def vmap_in(auto_cache: Dict[Any, Any], auto_key: Any, func: Callable[..., Any],
            out_dims: Any = 0, randomness: str = "error",
            chunk_size: Union[int, Literal["auto"], None] = None) -> Callable[..., Any]:
    """``vmap(func, 0, out_dims, randomness, chunk_size=chunk_size)`` for a transform built on
    vmap (jacrev, jacfwd) that makes a new ``func`` on every call: ``chunk_size="auto"``'s
    choices are kept in the transform's own ``auto_cache``, under ``auto_key`` (what the
    transform's call depends on beyond ``func``'s arguments) and the call's signature."""
    if dynamo_entry.active():  # inside torch.compile: as vmap's own route
        return vmap(func, 0, out_dims, randomness, chunk_size=chunk_size)

    def call(*args: Any) -> Any:
        return _vmap_call(func, 0, out_dims, randomness, chunk_size, args, {}, auto_cache,
                          auto_key)
    return call


def _is_dim_leaf(x: Any) -> bool:
    return x is None or (isinstance(x, int) and not isinstance(x, bool))


def check_randomness(randomness: Any, api: str) -> None:
    """``randomness`` must be one of vmap's modes (vmap, jacfwd); ``api`` opens the message."""
    if randomness not in _RANDOMNESS:
        raise TransformArgumentError(
            f"{api}: randomness must be one of {_RANDOMNESS}, got {randomness!r}: 'error' "
            "(random ops raise), 'different' (each example draws its own values) or 'same' "
            "(one draw shared by the batch).")


def _check_dims_spec(spec: Any, name: str, api: str) -> None:
    leaves, _ = tree_flatten(spec)
    for leaf in leaves:
        if not _is_dim_leaf(leaf):
            raise TransformArgumentError(
                f"{api}: {name} must be an int, None, or a (nested) tuple/list/dict of those "
                f"matching the structure of the {'inputs' if name == 'in_dims' else 'outputs'}; "
                f"got {spec!r}, which contains {leaf!r} ({type(leaf).__name__}).")


def _api_name(func: Any, in_dims: Any, out_dims: Any) -> str:
    return transform_call("vmap", func, in_dims=in_dims, out_dims=out_dims)


def _flat_in_dims(in_dims: Any, args: Tuple[Any, ...], api: str) -> List[Any]:
    if isinstance(in_dims, (int, type(None))):
        # (an int or None is a prefix of any tree: never None here)
        return cast(List[Any], broadcast_prefix(in_dims, args, _is_dim_leaf))
    if not isinstance(in_dims, (tuple, list)):
        raise TransformArgumentError(
            f"{api}: in_dims must be an int, None, or a tuple with one entry per positional "
            f"argument; got a {type(in_dims).__name__}. Wrap it in a tuple: "
            f"in_dims=({in_dims!r},).")
    if len(in_dims) != len(args):
        raise TransformArgumentError(
            f"{api}: in_dims has {len(in_dims)} entries but the function was called with "
            f"{len(args)} positional arguments. Give one in_dim per positional argument "
            "(None for arguments that are not mapped); keyword arguments are never mapped.")
    flat = broadcast_prefix(tuple(in_dims), tuple(args), _is_dim_leaf)
    if flat is None:
        for i, (d, a) in enumerate(zip(in_dims, args)):
            if broadcast_prefix(d, a, _is_dim_leaf) is None:
                raise TransformArgumentError(
                    f"{api}: in_dims[{i}]={d!r} does not match the structure of argument {i} "
                    f"({describe_structure(a)}). An in_dim must be an int or None, or a "
                    "container of the same structure as its argument.")
        raise TransformArgumentError(f"{api}: in_dims {in_dims!r} do not match the inputs.")
    return flat


def _check_forward_ad(api: str) -> None:
    state = _levels.forward_ad_state()
    if state in ("none", "other"):  # 'other': a jvp in another thread; nothing of ours
        return
    if state == "mine":
        raise ForwardModeAroundVmap()
    raise UnsupportedUnderVmap(
        f"{api}: vmap was called inside a torch.autograd.forward_ad.dual_level() block. "
        "Tangents of tensors outside the vmap cannot be propagated through it that way. Use "
        "functrans.jvp (or jacfwd) around the vmapped function instead; it handles this case.")


def _vmap_call(func: Callable[..., Any], in_dims: Any, out_dims: Any, randomness: str,
               chunk_size: Union[int, Literal["auto"], None], args: Tuple[Any, ...],
               kwargs: Dict[str, Any], auto_cache: Optional[Dict[Any, Any]] = None,
               auto_key: Any = ()) -> Any:
    api = _api_name(func, in_dims, out_dims)
    _check_forward_ad(api)
    flat_args, args_spec = tree_flatten(args)
    flat_dims = _flat_in_dims(in_dims, args, api)
    names = None
    batch_size = None
    sizes = []
    for i, (a, d) in enumerate(zip(flat_args, flat_dims)):
        if d is None:
            continue
        if not isinstance(a, torch.Tensor):
            names = names or leaf_paths(args, "args")
            raise TransformArgumentError(
                f"{api}: in_dim={d} was given for {names[i]}, which is a "
                f"{type(a).__name__}, not a tensor. vmap can only map over tensors; use "
                f"in_dim None for that argument (pass in_dims as a tuple with None there).")
        if isinstance(a, _BatchedTensor) and not a.level.alive and \
                torch._C._current_autograd_node() is None:
            names = names or leaf_paths(args, "args")
            raise EscapedBatchedTensorError(
                f"{api}: {names[i]} is a BatchedTensor whose vmap (level {a.level.id}) has "
                "already returned; it escaped that vmap (through a closure, a global or a list "
                "the function appended to). Return it from that vmapped function instead, and "
                "pass the returned tensor here.")
        nd = a.dim()
        if nd == 0:
            names = names or leaf_paths(args, "args")
            raise TransformArgumentError(
                f"{api}: in_dim={d} was given for {names[i]}, a 0-d tensor (shape ()): a 0-d "
                "tensor cannot be mapped, it has no dim to map over. Use in_dim None for it "
                "(one value shared by every example), or pass a tensor with a batch dim.")
        if not -nd <= d < nd:
            names = names or leaf_paths(args, "args")
            raise TransformArgumentError(
                f"{api}: in_dim={d} is out of range for {names[i]}, a tensor of shape "
                f"{tuple(a.shape)} ({nd} dims); expected an in_dim in [{-nd}, {nd - 1}].")
        d = d % nd
        flat_dims[i] = d
        sizes.append((i, d, a.shape[d]))
    if not sizes:
        raise TransformArgumentError(
            f"{api}: no input is mapped (every in_dim is None, or there are no tensor inputs). "
            "At least one tensor input must have an int in_dim to give the batch size.")
    batch_size = sizes[0][2]
    if any(s != batch_size for _, _, s in sizes):
        names = names or leaf_paths(args, "args")
        detail = "\n".join(f"  {names[i]} (in_dim={d}): size {s}" for i, d, s in sizes)
        raise TransformArgumentError(
            f"{api}: mapped inputs disagree on batch size:\n{detail}\nAll mapped dims must "
            "have the same size; use in_dim None for an input shared by every example.")

    chunk: Optional[int]
    if isinstance(chunk_size, str):     # "auto" (checked by vmap())
        def probe(probe_args: List[Any], size: int) -> Any:
            return _run(func, probe_args, flat_dims, args_spec, kwargs, out_dims, size,
                        randomness, api)
        outer = [lv for lv in _levels.stack() if isinstance(lv, _levels.VmapLevel)]
        chunk = chunking.choose(
            api, probe, flat_args, flat_dims, batch_size,
            unmeasurable=f"inside another vmap (level {outer[-1].id}), whose ops a fake trace "
            "cannot see" if outer else None, cache=auto_cache,
            key=chunking.signature((auto_key, flat_args, flat_dims, kwargs)))
    else:
        chunk = chunk_size
    try:
        if chunk is None or chunk >= batch_size:
            flat_out, out_spec = _run(func, flat_args, flat_dims, args_spec, kwargs, out_dims,
                                      batch_size, randomness, api)
            return tree_unflatten(flat_out, out_spec)
        return _run_chunked(func, flat_args, flat_dims, args_spec, kwargs, out_dims,
                            batch_size, randomness, chunk, api)
    except RuntimeError as e:
        if _RAW_DATA_READ in str(e) and not isinstance(e, UnsupportedUnderVmap):
            raise _raw_data_error(api) from None
        raise


# PyTorch's message when C++ code reads the memory of a tensor that has none (a wrapper
# subclass such as a BatchedTensor): ATen does that without dispatching, e.g. in torch.tensor()
# of batched elements or for torch.tensor_split's 1-D tensor of split points, so no rule can
# see it.
_RAW_DATA_READ = "data is not allocated yet"


def _raw_data_error(api: str) -> UnsupportedUnderVmap:
    return UnsupportedUnderVmap(
        f"{api}: a PyTorch function read the values of a batched tensor directly, as Python "
        "numbers, before any batching rule could see the call. ATen does this in "
        "torch.tensor([...]) / torch.as_tensor built from batched elements (use "
        "torch.stack([...]) instead), for the split points of "
        "torch.tensor_split(x, tensor_of_indices), and for a few other arguments that must be "
        "Python integers (pass those as Python ints/lists, or as tensors that are not mapped "
        "over: in_dims=None for them, or created inside the function). Under vmap the batched "
        "tensor differs per example, so it has no single value.")


def _resolve_bits(x: torch.Tensor) -> torch.Tensor:
    """See Note [conjugate and negative bits] in rules/autograd_ops.py."""
    if x.is_conj():
        x = x.resolve_conj()
    if x.is_neg():
        x = x.resolve_neg()
    return x


def _run(func: Callable[..., Any], flat_args: List[Any], flat_dims: List[Any], args_spec: Any,
         kwargs: Dict[str, Any], out_dims: Any, batch_size: int, randomness: str, api: str
         ) -> Tuple["results_with_dims", Any]:
    level = _levels.VmapLevel(batch_size, randomness)
    # logical_ops first: its mode must sit below VmapLevelMode (see functionalization.py)
    with _levels.pushed(level), _functionalization.logical_ops(level), VmapLevelMode(level):
        batched = [a if d is None else BatchedTensor(_resolve_bits(a), d, level)
                   for a, d in zip(flat_args, flat_dims)]
        out = func(*tree_unflatten(batched, args_spec), **kwargs)
        return _unwrap_outputs(out, out_dims, level, api, flat_args)


def _unwrap_outputs(out: Any, out_dims: Any, level: Any, api: str, inputs: Sequence[Any] = ()
                    ) -> Tuple["results_with_dims", Any]:
    flat_out, out_spec = tree_flatten(out)
    flat_dims: Optional[List[Any]]
    if _is_dim_leaf(out_dims):
        flat_dims = [out_dims] * len(flat_out)
    elif type(out_dims) is tuple and len(out_dims) == 1 and _is_dim_leaf(out_dims[0]) and \
            isinstance(out, torch.Tensor):
        flat_dims = list(out_dims)  # out_dims=(k,) for a function returning one tensor
    else:
        flat_dims = broadcast_prefix(out_dims, out, _is_dim_leaf)
        if flat_dims is None:
            raise TransformArgumentError(
                f"{api}: out_dims={out_dims!r} does not match the structure of the function's "
                f"output ({describe_structure(out)}). Give one int/None for every output, or a "
                "single int for all of them.")
    results = []
    names = None
    for i, (o, d) in enumerate(zip(flat_out, flat_dims)):
        if not isinstance(o, torch.Tensor):
            if d is None:
                results.append(o)
                continue
            names = names or leaf_paths(out, "output")
            raise TransformArgumentError(
                f"{api}: the function returned a {type(o).__name__} at {names[i]}; vmap needs "
                "tensor outputs so it can stack them along the batch dim. Return a tensor "
                "(e.g. torch.tensor(value)) or set that output's out_dim to None."
                + (" (Did the function forget to return?)" if o is None and len(flat_out) == 1
                   else ""))
        batched_here = isinstance(o, _BatchedTensor) and o.level is level
        if isinstance(o, _BatchedTensor) and not batched_here and not o.level.alive:
            raise EscapedBatchedTensorError(
                f"{api}: the function returned a BatchedTensor of an inner vmap (level "
                f"{o.level.id}) that has already returned; it escaped that vmap.")
        if d is None:
            if batched_here:
                names = names or leaf_paths(out, "output")
                raise TransformArgumentError(
                    f"{api}: out_dim is None for {names[i]}, but that output depends on the "
                    "mapped inputs (it differs across the batch). Give it an int out_dim, or "
                    "return a value that does not depend on the batch.")
            results.append(o)
            continue
        nd = o.dim() + 1
        if not -nd <= d < nd:
            names = names or leaf_paths(out, "output")
            raise TransformArgumentError(
                f"{api}: out_dim={d} is out of range for {names[i]}, which has {nd - 1} dims "
                f"per example; expected an out_dim in [{-nd}, {nd - 1}].")
        d %= nd
        if batched_here:
            bt: Any = o  # a BatchedTensor of this level
            v = bt.value
            if inputs and type(v) is torch.Tensor and v._base is None:
                v = _as_view_of_input(v, inputs)
            results.append(match_bdim(v, bt.bdim, d, level.batch_size))
        else:
            results.append(match_bdim(o, None, d, level.batch_size))
    return results_with_dims(results, flat_dims), out_spec


_is_alias_of = getattr(torch._C, "_is_alias_of", None)


def _as_view_of_input(v: torch.Tensor, inputs: Sequence[Any]) -> torch.Tensor:
    """``v`` (a batched output's physical value), as a view of the input it aliases.

    Rules run inside ``__torch_dispatch__``, where view tracking (the ADInplaceOrView key) is
    off unless autograd records the physical ops (Note [autograd on physical values] in
    dispatch.py): a view of an input comes out sharing the input's storage, but with no
    ``_base`` and its own version counter.  Eager's view of one example has the input as its
    ``_base`` (its root, if the input is itself a view), so the output is rebuilt here as the
    same window of the input: ``vmap(lambda t: t.view(2, 2))(x)._base is x``, and in-place
    writes to ``x`` show in the output's version counter as they do in eager.  This runs once per
    output of a vmap call, not per op: view ops keep their dispatch cost.

    Left as it is: an output aliasing an input that requires grad (with grad mode on, autograd
    recorded its ops with view tracking, so a missing ``_base`` means the function detached it;
    under no_grad the alias stays detached, where eager's no-grad view would report
    requires_grad), a value whose dtype, conjugate or negative bit differs from the input's (no
    window of the input reads it), and an output that aliases no input (a view of an
    intermediate, or of a tensor the function closed over: no ``_base``, unlike eager).  The
    one case made a view that eager does not: ``t.detach()`` of an input that does not require
    grad (the physical value cannot tell a detach from a view)."""
    if _is_alias_of is None:
        return v
    for a in inputs:
        if type(a) is not torch.Tensor or a is v or not _is_alias_of(v, a):
            continue
        if a.requires_grad or a.dtype != v.dtype or a.is_conj() != v.is_conj() or \
                a.is_neg() != v.is_neg() or a.layout is not torch.strided:
            return v
        # plain tensors: the vmap's own mode lets the op through, and a tracer around the
        # vmap (functrans.compile's make_fx) records it instead of baking in its result
        return a.as_strided(v.shape, v.stride(), v.storage_offset())
    return v


class results_with_dims(list[Any]):  # (list[Any] subclasses plain list at run time)
    """The flat outputs of one batched call, with the normalised out_dims (for chunking)."""

    def __init__(self, results: List[Any], dims: List[Any]) -> None:
        super().__init__(results)
        self.dims = [None if d is None else d % (r.dim() if isinstance(r, torch.Tensor) else 1)
                     for r, d in zip(results, dims)]


def _run_chunked(func: Callable[..., Any], flat_args: List[Any], flat_dims: List[Any],
                 args_spec: Any, kwargs: Dict[str, Any], out_dims: Any, batch_size: int,
                 randomness: str, chunk_size: int, api: str) -> Any:
    split = [a.split(chunk_size, d) if d is not None else None
             for a, d in zip(flat_args, flat_dims)]
    n_chunks = (batch_size + chunk_size - 1) // chunk_size
    rng_state = torch.get_rng_state() if randomness == "same" else None
    chunks_out = []
    out_spec = None
    for c in range(n_chunks):
        if rng_state is not None:
            torch.set_rng_state(rng_state)
        chunk_args = [a if s is None else s[c] for a, s in zip(flat_args, split)]
        size = min(chunk_size, batch_size - c * chunk_size)
        flat_out, out_spec = _run(func, chunk_args, flat_dims, args_spec, kwargs, out_dims,
                                  size, randomness, api)
        chunks_out.append(flat_out)
    dims = chunks_out[0].dims
    merged = []
    for k, d in enumerate(dims):
        parts = [c[k] for c in chunks_out]
        if d is None or not isinstance(parts[0], torch.Tensor):
            merged.append(parts[0])
        else:
            merged.append(torch.cat(parts, d))
    return tree_unflatten(merged, out_spec)
