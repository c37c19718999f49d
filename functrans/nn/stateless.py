"""``functional_call``: run a module with parameters and buffers taken from dicts.

Semantics of PyTorch's own ``functional_call``: the module's own tensors are swapped for the given
ones for the duration of the call (and restored afterwards, also on error), so the call is a
pure function of the dicts: ``grad``, ``vmap`` and ``jacrev`` can differentiate or batch it.
* ``parameter_and_buffer_dicts``: one dict or a sequence of dicts of ``name -> tensor``; a name in
  two dicts is an error.  Names are dotted paths (``"encoder.0.weight"``); a name may also name a
  plain tensor attribute.
* ``strict=True``: the dicts must give exactly the module's parameters and buffers.
* ``tie_weights=True``: names that share one tensor in the module (tied weights) stay tied: giving
  one of them gives all; giving two of them different tensors is an error.
* Buffers that the forward updates in place (BatchNorm's running stats) are updated in the
  tensors you passed, as in PyTorch's own.

Imports: errors.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import (Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union,
                    cast)

import torch
from torch import nn

from ..errors import TransformArgumentError, transform_call

Dicts = Union[Mapping[str, torch.Tensor], Sequence[Mapping[str, torch.Tensor]]]


def _merge(dicts: Dicts, api: str) -> Dict[str, torch.Tensor]:
    if isinstance(dicts, Mapping):
        return dict(dicts)
    if not isinstance(dicts, (list, tuple)) or not all(isinstance(d, Mapping) for d in dicts):
        raise TransformArgumentError(
            f"{api}: parameter_and_buffer_dicts must be a dict of name -> tensor, or a "
            f"list/tuple of such dicts; got {type(dicts).__name__}.")
    merged: Dict[str, torch.Tensor] = {}
    for d in dicts:
        twice = sorted(set(d) & set(merged))
        if twice:
            raise TransformArgumentError(
                f"{api}: {twice} appeared in more than one of the dicts, so which "
                "value to use is ambiguous. Give each name in exactly one dict.")
        merged.update(d)
    return merged


def _tied_names(module: nn.Module) -> Dict[str, List[str]]:
    """name -> every name (itself included) that refers to the same tensor in ``module``."""
    by_tensor: Dict[int, List[str]] = {}
    named = list(module.named_parameters(remove_duplicate=False)) + \
        list(module.named_buffers(remove_duplicate=False))
    for name, t in named:
        by_tensor.setdefault(id(t), []).append(name)
    return {name: by_tensor[id(t)] for name, t in named}


def _expand_ties(module: nn.Module, values: Dict[str, torch.Tensor], api: str
                 ) -> Dict[str, torch.Tensor]:
    tied = _tied_names(module)
    out = dict(values)
    for name, value in values.items():
        for other in tied.get(name, [name]):
            if other == name:
                continue
            if other in values and values[other] is not value:
                raise TransformArgumentError(
                    f"{api}: got different values for {name!r} and {other!r}, which "
                    "are tied (the same tensor) in the module. Give one of them, or pass "
                    "tie_weights=False to untie them for this call.")
            out[other] = value
    return out


def _check_strict(module: nn.Module, values: Mapping[str, torch.Tensor], api: str) -> None:
    expected = {n for n, _ in module.named_parameters(remove_duplicate=False)} | \
        {n for n, _ in module.named_buffers(remove_duplicate=False)}
    missing = sorted(expected - set(values))
    unexpected = sorted(set(values) - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing key(s): {missing}")
        if unexpected:
            parts.append(f"unexpected key(s): {unexpected}")
        raise TransformArgumentError(
            f"{api}: with strict=True the dicts must give exactly the module's parameters "
            "and buffers; " + "; ".join(parts) + ".")


def _owner(module: nn.Module, name: str, api: str) -> Tuple[nn.Module, str]:
    *path, leaf = name.split(".")
    owner = module
    for i, part in enumerate(path):
        child = getattr(owner, part, None)
        if not isinstance(child, nn.Module):
            raise TransformArgumentError(
                f"{api}: {name!r} does not name a tensor of the module: "
                f"{'.'.join(path[:i + 1])!r} is not a submodule.")
        owner = child
    return owner, leaf


# The swap below changes the module object itself, so two threads calling functional_call on
# one module would compute with each other's tensors.  Each module gets a re-entrant lock, held
# for the swap and the forward: concurrent calls on one module run one after another (calls on
# different modules, and nested calls in one thread, are not held up).
_module_locks: "weakref.WeakKeyDictionary[nn.Module, threading.RLock]" = weakref.WeakKeyDictionary()
_module_locks_guard = threading.Lock()


def _module_lock(module: nn.Module) -> threading.RLock:
    lock = _module_locks.get(module)
    if lock is None:
        with _module_locks_guard:
            lock = _module_locks.setdefault(module, threading.RLock())
    return lock


@contextlib.contextmanager
def swapped_tensors(module: nn.Module, values: Mapping[str, torch.Tensor],
                    api: str = "functional_call") -> Iterator[None]:
    """Within the block, ``module``'s tensors named in ``values`` are the given tensors (and
    no other thread's functional_call on ``module`` runs).  ``api`` opens error messages."""
    with _module_lock(module):
        yield from _swapped(module, values, api)


def _swapped(module: nn.Module, values: Mapping[str, torch.Tensor], api: str
             ) -> Iterator[None]:
    undo: List[Tuple[Dict[str, Any], str, Any, bool]] = []
    try:
        for name, value in values.items():
            owner, leaf = _owner(module, name, api)
            tables = cast(Tuple[Dict[str, Any], ...], (owner._parameters, owner._buffers))
            for table in tables:
                if leaf in table:
                    undo.append((table, leaf, table[leaf], True))
                    table[leaf] = value
                    break
            else:
                had = leaf in owner.__dict__
                undo.append((owner.__dict__, leaf, owner.__dict__.get(leaf), had))
                owner.__dict__[leaf] = value
        yield
    finally:
        for table, leaf, old, had in reversed(undo):
            if had:
                table[leaf] = old
            else:
                table.pop(leaf, None)


def functional_call(module: nn.Module, parameter_and_buffer_dicts: Dicts,
                    args: Union[Any, Tuple[Any, ...]] = None,
                    kwargs: Optional[Dict[str, Any]] = None, *,
                    tie_weights: bool = True, strict: bool = False) -> Any:
    """Call ``module(*args, **kwargs)`` with its parameters and buffers replaced by the
    tensors in ``parameter_and_buffer_dicts``: the module as a pure function of its state.

    The module's own tensors are swapped in for the call and restored afterwards (also on
    error), so ``grad``, ``vmap`` and ``jacrev`` can differentiate or batch over the dicts
    (per-example gradients, ensembles).  Concurrent calls on one module from several threads
    run one after another.

    Args:
        module: the ``nn.Module`` to call.
        parameter_and_buffer_dicts: a dict of ``name -> tensor``, or a sequence of such dicts
            (e.g. ``(params, buffers)``; a name in two dicts is an error).  Names are dotted
            paths as in ``module.named_parameters()`` (``"encoder.0.weight"``); a name may
            also name a plain tensor attribute.  Names not given keep the module's own tensors
            (unless ``strict``).  Each tensor has the shape the module expects (under ``vmap``:
            per example).
        args: the positional arguments: a tuple, or a single argument (not a tuple) that is
            passed alone.  ``None``: no arguments.
        kwargs: keyword arguments for the forward.
        tie_weights: names that share one tensor in the module (tied weights) stay tied:
            giving one of them gives all; giving two of them different tensors is an error.
        strict: the dicts must give exactly the module's parameters and buffers.

    Returns:
        Whatever ``module(*args, **kwargs)`` returns.  Buffers that the forward updates in
        place (BatchNorm's running stats) are updated in the tensors you passed.

    Raises:
        TransformArgumentError: ``module`` is not an ``nn.Module``, a value is not a tensor, a
            name is given twice or does not name a tensor of the module, tied names get
            different tensors, or (``strict``) names are missing or unexpected.

    Example:
        >>> import torch, functrans
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Linear(3, 2)
        >>> x = torch.randn(4, 3)
        >>> zeros = {"weight": torch.zeros(2, 3), "bias": torch.ones(2)}
        >>> functrans.functional_call(model, zeros, (x,))
        tensor([[1., 1.],
                [1., 1.],
                [1., 1.],
                [1., 1.]])
        >>> params = {k: v.detach() for k, v in model.named_parameters()}
        >>> loss = lambda p, x: functrans.functional_call(model, p, (x,)).pow(2).sum()
        >>> per_example = functrans.vmap(functrans.grad(loss), in_dims=(None, 0))(params, x)
        >>> per_example["weight"].shape                 # one (2, 3) gradient per example
        torch.Size([4, 2, 3])
    """
    api = transform_call("functional_call", module, "parameter_and_buffer_dicts",
                         **({"strict": True} if strict else {}),
                         **({} if tie_weights else {"tie_weights": False}))
    if not isinstance(module, nn.Module):
        raise TransformArgumentError(
            f"{api}: expected an nn.Module as the first argument, got "
            f"{type(module).__name__}.")
    values = _merge(parameter_and_buffer_dicts, api)
    for name, v in values.items():
        if not isinstance(v, torch.Tensor):
            raise TransformArgumentError(
                f"{api}: the value for {name!r} is a {type(v).__name__}; every value "
                "must be a tensor.")
    if tie_weights:
        values = _expand_ties(module, values, api)
    if strict:
        _check_strict(module, values, api)
    if args is None:
        args = ()
    elif not isinstance(args, tuple):
        args = (args,)
    with swapped_tensors(module, values, api):
        return module(*args, **(kwargs or {}))
