"""Stacking N models into one batched state: ``stack_module_state`` and ``Ensemble``.

``stack_module_state(models)`` returns ``(params, buffers)``: for every name, the N models'
tensors stacked along a new leading dim.  Parameters are new leaf tensors (they require grad when
the models' do), so a ``torch.optim`` optimizer can update them directly; buffers are stacked
values.  ``Ensemble`` owns such a state and a copy of the first model as the skeleton, and runs
every member with one ``vmap`` over the stacked state.

Imports: errors, stateless, batching.api.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Iterator, List, Literal, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..errors import TransformArgumentError, transform_call
from ..batching.api import vmap
from .stateless import functional_call


_API = transform_call("stack_module_state", "models")
_ENSEMBLE_CALL = transform_call(transform_call("Ensemble", "models"), None, "*args", shared=False)


def _stack(name: str, tensors: Sequence[torch.Tensor], kind: str) -> torch.Tensor:
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1:
        raise TransformArgumentError(
            f"{_API}: the {kind} {name!r} has different shapes across the models "
            f"({sorted(shapes)}); models of one ensemble must have the same architecture.")
    grads = {t.requires_grad for t in tensors}
    if len(grads) != 1:
        raise TransformArgumentError(
            f"{_API}: the {kind} {name!r} requires grad in some models and not in "
            "others; freeze or unfreeze it in all of them.")
    stacked = torch.stack([t.detach() for t in tensors])
    return stacked.requires_grad_() if grads.pop() and kind == "parameter" else stacked


def stack_module_state(models: Sequence[nn.Module]
                       ) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """The parameters and buffers of ``models`` stacked along a new leading dim, for ``vmap``
    over ``functional_call`` (an ensemble in one batched call).

    Args:
        models: N modules of one class and architecture: the same parameter/buffer names and
            shapes, the same ``requires_grad`` per parameter, all in training or all in eval
            mode.

    Returns:
        ``(params, buffers)``: two dicts ``name -> tensor``; a parameter of shape ``S`` gives a
        tensor of shape ``(N, *S)``.  Stacked parameters are new leaf tensors (requiring grad
        when the models' do), so an optimizer can update them directly; buffers are stacked
        copies.  Later changes to ``models`` do not show in them.

    Raises:
        TransformArgumentError: no models, a non-module, different classes, modes, names,
            shapes or ``requires_grad``.

    Example:
        >>> import torch, functrans
        >>> models = [torch.nn.Linear(3, 2) for _ in range(4)]
        >>> params, buffers = functrans.stack_module_state(models)
        >>> params["weight"].shape, params["bias"].requires_grad, buffers
        (torch.Size([4, 2, 3]), True, {})
        >>> skeleton = models[0]
        >>> run = lambda p, b, x: functrans.functional_call(skeleton, (p, b), (x,))
        >>> functrans.vmap(run, in_dims=(0, 0, None))(params, buffers, torch.ones(5, 3)).shape
        torch.Size([4, 5, 2])
    """
    models = list(models)
    if not models:
        raise TransformArgumentError(f"{_API}: expected at least one model, got 0.")
    if not all(isinstance(m, nn.Module) for m in models):
        raise TransformArgumentError(f"{_API}: every element must be an nn.Module.")
    kinds = {type(m) for m in models}
    if len(kinds) != 1:
        raise TransformArgumentError(
            f"{_API}: the models must all be of one class; got "
            f"{sorted(k.__name__ for k in kinds)}.")
    if len({m.training for m in models}) != 1:
        raise TransformArgumentError(
            f"{_API}: some models are in training mode and some in eval mode; call "
            ".train() or .eval() on all of them first.")
    names0 = [n for n, _ in models[0].named_parameters()]
    bnames0 = [n for n, _ in models[0].named_buffers()]
    for i, m in enumerate(models[1:], 1):
        if [n for n, _ in m.named_parameters()] != names0 or \
                [n for n, _ in m.named_buffers()] != bnames0:
            raise TransformArgumentError(
                f"{_API}: model {i} has different parameter or buffer names than "
                "model 0; models of one ensemble must have the same architecture.")
    all_params = [dict(m.named_parameters()) for m in models]
    all_buffers = [dict(m.named_buffers()) for m in models]
    params = {n: _stack(n, [p[n] for p in all_params], "parameter") for n in names0}
    buffers = {n: _stack(n, [b[n] for b in all_buffers], "buffer") for n in bnames0}
    return params, buffers


class Ensemble:
    """N models of one architecture evaluated together with one ``vmap``.

    ``params`` / ``buffers`` are the stacked state (see ``stack_module_state``: a parameter
    of shape ``S`` is stored as ``(N, *S)``); buffers such as BatchNorm's running stats are
    updated per member in training mode.  ``members()`` returns ordinary modules holding each
    member's current values.

    Args:
        models: N modules of one class and architecture (copied: later changes to them do
            not show in the ensemble).
        randomness: as ``vmap``'s: ``'error'``, ``'different'`` (dropout draws per member) or
            ``'same'``.
        chunk_size: as ``vmap``'s: run this many members at a time (bounds memory), or
            ``"auto"``.

    Calling ``ens(*args, shared=True, **kwargs)`` runs every member: on the same inputs
    (``shared=True``; a result of per-member shape ``S`` comes back as ``(N, *S)``), or member
    ``i`` on ``args[j][i]`` for each tensor argument (``shared=False``: dim 0 of every tensor
    argument must be N).  Keyword arguments are shared.  Members with no parameters and no
    buffers (``nn.ReLU()``, ``nn.Dropout()``) are one function N times: the result on shared
    inputs is the same for every member (computed once, broadcast to ``(N, *S)``), except what
    draws random numbers, which each member draws anew with ``randomness='different'``.

    Example:
        >>> import torch, functrans
        >>> models = [torch.nn.Linear(3, 2) for _ in range(4)]
        >>> ens = functrans.Ensemble(models)
        >>> x = torch.randn(5, 3)
        >>> ens(x).shape                                # the same minibatch for every member
        torch.Size([4, 5, 2])
        >>> torch.allclose(ens(x)[2], models[2](x))
        True
        >>> ens(torch.randn(4, 5, 3), shared=False).shape   # minibatch i for member i
        torch.Size([4, 5, 2])
        >>> opt = torch.optim.SGD(ens.parameters(), lr=0.1)  # trains all 4 at once
        >>> len(ens), len(ens.members())
        (4, 4)
    """

    def __init__(self, models: Sequence[nn.Module], *, randomness: str = "error",
                 chunk_size: Union[int, Literal["auto"], None] = None):
        self.params, self.buffers = stack_module_state(models)
        self.size = len(models)
        self.randomness = randomness
        self.chunk_size = chunk_size
        self._skeleton = copy.deepcopy(models[0])

    def __len__(self) -> int:
        return self.size

    def parameters(self) -> Iterator[torch.Tensor]:
        return iter(self.params.values())

    def named_parameters(self) -> Iterator[Tuple[str, torch.Tensor]]:
        return iter(self.params.items())

    def train(self, mode: bool = True) -> "Ensemble":
        self._skeleton.train(mode)
        return self

    def eval(self) -> "Ensemble":
        return self.train(False)

    def __call__(self, *args: Any, shared: bool = True, **kwargs: Any) -> Any:
        """Every member on ``args``: the same inputs for all (``shared=True``) or input ``i``
        along dim 0 for member ``i`` (``shared=False``).  Outputs gain a leading member dim."""
        if not shared:
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor) and (a.dim() == 0 or a.shape[0] != self.size):
                    raise TransformArgumentError(
                        f"{_ENSEMBLE_CALL}: argument {i} has shape {tuple(a.shape)}; its "
                        f"dim 0 must be the number of members ({self.size}).")
        skeleton = self._skeleton

        def one(params: Dict[str, torch.Tensor], buffers: Dict[str, torch.Tensor],
                *a: Any) -> Any:
            return functional_call(skeleton, (params, buffers), a, kwargs)

        data_dims = tuple(None if shared or not isinstance(a, torch.Tensor) else 0 for a in args)
        if not self.params and not self.buffers:
            # members without state (nn.ReLU(), nn.Dropout()): an empty mapped tensor gives
            # vmap the number of members (see the class docstring)
            def stateless(members: torch.Tensor, *a: Any) -> Any:
                return functional_call(skeleton, {}, a, kwargs)

            return vmap(stateless, in_dims=(0,) + data_dims, randomness=self.randomness,
                        chunk_size=self.chunk_size)(torch.empty(self.size, 0), *args)
        return vmap(one, in_dims=(0, 0) + data_dims, randomness=self.randomness,
                    chunk_size=self.chunk_size)(self.params, self.buffers, *args)

    def members(self) -> List[nn.Module]:
        """Each member as an ordinary module with its current parameters and buffers."""
        out = []
        with torch.no_grad():
            for i in range(self.size):
                m = copy.deepcopy(self._skeleton)
                own = {**dict(m.named_parameters()), **dict(m.named_buffers())}
                for name, stacked in {**self.params, **self.buffers}.items():
                    own[name].copy_(stacked[i])
                out.append(m)
        return out
