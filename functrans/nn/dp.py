"""DP-SGD gradients (Abadi et al., 2016) from per-example gradients computed with ``vmap(grad)``.

One DP-SGD step, for a batch of ``B`` examples:

1. per-example gradients ``g_i`` of ``loss_fn(model(x_i), y_i)``, computed as
   ``vmap(grad(loss), in_dims=(None, None, 0, 0))`` over ``functional_call`` (parameters and
   buffers unbatched, the data batched along dim 0); every example runs as a batch of one, so
   the model sees ``x_i.unsqueeze(0)``;
2. clipping of each example's TOTAL gradient (all trainable parameters flattened together) to
   L2 norm ``max_norm``: ``g_i * min(1, max_norm / (||g_i|| + 1e-6))``.  This is Opacus' flat
   clipping factor; the ``1e-6`` keeps a zero gradient finite and makes the clipped norm at most
   ``max_norm`` (strictly below it for a clipped example);
3. the sum over the batch, ``S = sum_i clip(g_i)`` (one batched contraction, no Python loop);
4. Gaussian noise ``N(0, (noise_multiplier * max_norm)**2)`` added to every coordinate of ``S``,
   drawn parameter by parameter in ``model.named_parameters()`` order from the given
   ``torch.Generator`` (or a fresh one seeded with ``seed``; neither: the global RNG), so the
   same seed always gives the same noise;
5. optionally ``reduction="mean"``: the noisy sum divided by the batch size ``B`` (Opacus
   divides by the expected batch size; with a fixed batch size that is ``B``).  The default
   ``reduction="sum"`` returns the noisy sum itself.

Across processes (``process_group=`` / ``distributed=True``): every rank clips its own examples
and the clipped sums are all-reduced (SUM) in one flat collective.  The noise is added ONCE, by
the rank ``noise_rank`` (default 0), to its local sum before the all-reduce: the reduced result
is ``sum over all examples of clip(g_i) + noise``, identical (up to summation order) to one
process on the concatenated batch with the same seed.  ``reduction="mean"`` divides by the
global batch size.  Other ranks never touch their generator.

Building blocks (also usable on their own, e.g. under ``DistributedDataParallel``):
``per_sample_grads``, ``clip_and_sum``, ``add_gaussian_noise``, ``assign_grads`` (writes a
gradient dict into ``p.grad`` so any ``torch.optim`` optimizer can step) and
``surrogate_loss`` (a scalar whose backward puts a given gradient dict into ``p.grad``, which is
how DDP can be made to all-reduce DP-SGD gradients: each rank backwards the surrogate of its
local clipped sum, rank 0's with the noise, times the world size, anchored to a forward through
the DDP wrapper; DDP's averaging all-reduce then yields the global noisy sum).

The model must be functional per example: no BatchNorm in training mode (its statistics would
mix examples, which DP-SGD forbids anyway); buffers are passed through unbatched.

Argument errors are ``functrans.errors`` types that open with the call echoed
(``transform_call``), e.g. ``dp_sgd_grads(model, loss_fn, batch, max_norm=0.0, ...): ...``.

Imports: errors, stateless, batching.api, autodiff.grad.
"""
from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional, Tuple

import torch
from torch import nn

from ..autodiff.grad import grad
from ..batching.api import check_randomness, vmap
from ..errors import (TransformArgumentError, TransformKeyError, TransformTypeError,
                      transform_call)
from .stateless import functional_call

__all__ = ["per_sample_grads", "clip_and_sum", "add_gaussian_noise", "dp_sgd_grads",
           "assign_grads", "surrogate_loss", "CLIP_EPS"]

CLIP_EPS = 1e-6  # the Opacus constant in the clipping factor min(1, C / (norm + eps))

Grads = Dict[str, torch.Tensor]


def _trainable(model: nn.Module) -> Tuple[Grads, Grads]:
    """(trainable parameters, everything else: frozen parameters and buffers), detached."""
    params, rest = {}, {}
    for name, p in model.named_parameters():
        (params if p.requires_grad else rest)[name] = p.detach()
    for name, b in model.named_buffers():
        rest[name] = b.detach()
    return params, rest


def _as_tuple(batch, api: str) -> tuple:
    if isinstance(batch, torch.Tensor):
        return (batch,)
    if isinstance(batch, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in batch):
        return tuple(batch)
    raise TransformTypeError(
        f"{api}: batch must be a tensor or a tuple of tensors (inputs, targets, ...) batched "
        f"along dim 0; got {type(batch).__name__}. Pass e.g. batch=(inputs, targets).")


def _batch_size(batch: tuple, api: str) -> int:
    sizes = {t.shape[0] if t.dim() else None for t in batch}
    if len(sizes) != 1 or None in sizes:
        raise TransformArgumentError(
            f"{api}: every batch tensor needs the same dim-0 size (one row per example); got "
            f"shapes {[tuple(t.shape) for t in batch]}.")
    return sizes.pop()


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside a (Distributed)DataParallel wrapper: per-example gradients must run the
    plain module (the wrapper's forward would scatter / arm its reducer)."""
    wrappers = (nn.DataParallel, nn.parallel.DistributedDataParallel)
    return model.module if isinstance(model, wrappers) else model


def per_sample_grads(model: nn.Module, loss_fn: Callable[..., torch.Tensor], batch, *,
                     randomness: str = "different") -> Grads:
    """``{name: g}`` with ``g[i]`` the gradient of example ``i``'s loss w.r.t. parameter ``name``.

    ``batch`` is ``(inputs, targets)`` (or any tuple of tensors batched along dim 0); the loss
    of example ``i`` is ``loss_fn(model(inputs[i:i+1]), targets[i:i+1])`` (extra tensors are
    passed to ``loss_fn`` the same way).  Only parameters with ``requires_grad`` get gradients.
    ``randomness`` is vmap's: ``"different"`` (default) gives every example its own dropout mask,
    as a per-example loop would.
    """
    return _per_sample_grads(model, loss_fn, batch, randomness,
                             transform_call("per_sample_grads", "model", "loss_fn", "batch"))


def _per_sample_grads(model, loss_fn, batch, randomness, api) -> Grads:
    check_randomness(randomness, api)
    batch = _as_tuple(batch, api)
    _batch_size(batch, api)
    model = _unwrap(model)
    params, rest = _trainable(model)

    def example_loss(p, r, x, *others):
        out = functional_call(model, (p, r), (x.unsqueeze(0),))
        return loss_fn(out, *(o.unsqueeze(0) for o in others))

    in_dims = (None, None) + (0,) * len(batch)
    return vmap(grad(example_loss), in_dims=in_dims, randomness=randomness)(params, rest, *batch)


def clip_and_sum(per_sample: Mapping[str, torch.Tensor], max_norm: float
                 ) -> Tuple[Grads, torch.Tensor]:
    """Clip each example's total gradient norm to ``max_norm``, then sum over the examples.

    Returns ``(sums, norms)``: ``sums[name] = sum_i factor_i * per_sample[name][i]`` with
    ``factor_i = min(1, max_norm / (norms[i] + 1e-6))`` and ``norms[i]`` the L2 norm of example
    ``i``'s gradient over ALL parameters (before clipping).
    """
    return _clip_and_sum(per_sample, max_norm,
                         transform_call("clip_and_sum", "per_sample", max_norm=max_norm))


def _check_max_norm(max_norm, api: str) -> None:
    if max_norm <= 0:
        raise TransformArgumentError(
            f"{api}: max_norm must be positive (the clipping bound C); got {max_norm}.")


def _clip_and_sum(per_sample, max_norm, api):
    _check_max_norm(max_norm, api)
    grads = list(per_sample.values())
    if not grads:
        raise TransformArgumentError(
            f"{api}: there are no gradients to clip; does the model have trainable parameters "
            "(requires_grad=True)?")
    sq = torch.stack([g.reshape(g.shape[0], -1).pow(2).sum(1) for g in grads]).sum(0)
    norms = sq.sqrt()
    factor = (max_norm / (norms + CLIP_EPS)).clamp(max=1.0)
    sums = {name: torch.tensordot(factor.to(g.dtype), g, dims=1)
            for name, g in per_sample.items()}
    return sums, norms


def _generator(generator: Optional[torch.Generator], seed: Optional[int], api: str
               ) -> Optional[torch.Generator]:
    if generator is not None and seed is not None:
        raise TransformArgumentError(
            f"{api}: got both generator= and seed=; give either generator= or seed=, not both.")
    if seed is not None:
        return torch.Generator().manual_seed(int(seed))
    return generator


def add_gaussian_noise(grads: Mapping[str, torch.Tensor], std: float, *,
                       generator: Optional[torch.Generator] = None,
                       seed: Optional[int] = None) -> Grads:
    """``grads`` plus independent ``N(0, std**2)`` noise on every coordinate (a new dict).

    Noise is drawn tensor by tensor in the dict's order, on the generator's device, then moved
    to each gradient's device and dtype: the same generator state gives the same noise whatever
    device the gradients live on.
    """
    gen = _generator(generator, seed, transform_call("add_gaussian_noise", "grads", std=std))
    if std == 0:
        return dict(grads)
    out = {}
    for name, g in grads.items():
        device = gen.device if gen is not None else g.device
        noise = torch.randn(g.shape, generator=gen, device=device, dtype=g.dtype)
        out[name] = g + std * noise.to(g.device)
    return out


def _all_reduce_sum(grads: Grads, group) -> Grads:
    import torch.distributed as dist
    names = list(grads)
    flat = torch.cat([grads[n].reshape(-1) for n in names])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    out, start = {}, 0
    for n in names:
        numel = grads[n].numel()
        out[n] = flat[start:start + numel].view_as(grads[n])
        start += numel
    return out


def dp_sgd_grads(model: nn.Module, loss_fn: Callable[..., torch.Tensor], batch, *,
                 max_norm: float, noise_multiplier: float,
                 generator: Optional[torch.Generator] = None, seed: Optional[int] = None,
                 reduction: str = "sum", distributed: bool = False, process_group=None,
                 noise_rank: int = 0, return_norms: bool = False,
                 randomness: str = "different"):
    """The privatized gradient of one DP-SGD step (see the module docstring for the recipe).

    Returns ``{name: noisy clipped gradient}`` for the trainable parameters (plus the
    per-example norms before clipping, of this rank's examples, if ``return_norms``).
    ``reduction``: ``"sum"`` (the noisy sum) or ``"mean"`` (divided by the global batch size).
    ``distributed=True`` (or a ``process_group``): all-reduce the clipped sums across the group;
    only rank ``noise_rank`` (a rank within the group) adds noise, from its ``generator``/``seed``.
    ``randomness``: see ``per_sample_grads`` (dropout masks per example).
    """
    api = transform_call("dp_sgd_grads", "model", "loss_fn", "batch", max_norm=max_norm,
                         noise_multiplier=noise_multiplier)
    if reduction not in ("sum", "mean"):
        raise TransformArgumentError(
            f"{api}: reduction must be 'sum' (the noisy sum) or 'mean' (divided by the batch "
            f"size); got {reduction!r}.")
    if noise_multiplier < 0:
        raise TransformArgumentError(
            f"{api}: noise_multiplier must be >= 0 (0: no noise); got {noise_multiplier}.")
    _check_max_norm(max_norm, api)   # before the per-example gradients are computed
    gen = _generator(generator, seed, api)
    batch = _as_tuple(batch, api)
    n = _batch_size(batch, api)
    per_sample = _per_sample_grads(model, loss_fn, batch, randomness, api)
    sums, norms = _clip_and_sum(per_sample, max_norm, api)

    distributed = distributed or process_group is not None
    adds_noise = True
    if distributed:
        import torch.distributed as dist
        adds_noise = dist.get_rank(process_group) == noise_rank
        count = torch.tensor([float(n)], device=next(iter(sums.values())).device)
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=process_group)
        n = int(count.item())
    if adds_noise:
        sums = add_gaussian_noise(sums, noise_multiplier * max_norm, generator=gen)
    if distributed:
        sums = _all_reduce_sum(sums, process_group)
    if reduction == "mean":
        sums = {name: g / n for name, g in sums.items()}
    return (sums, norms) if return_norms else sums


def assign_grads(model: nn.Module, grads: Mapping[str, torch.Tensor], *,
                 accumulate: bool = False) -> None:
    """Write ``grads`` into ``p.grad`` of the model's parameters (by name), so that any torch
    optimizer can ``step()``.  ``accumulate=True`` adds to an existing ``p.grad`` instead.
    ``model`` may be a (Distributed)DataParallel wrapper (names are the inner module's)."""
    named = dict(_unwrap(model).named_parameters())
    unknown = sorted(set(grads) - set(named))
    if unknown:
        raise TransformKeyError(
            f"{transform_call('assign_grads', 'model', 'grads')}: the model has no parameters "
            f"named {unknown}; grads must be keyed by names of model.named_parameters().")
    for name, g in grads.items():
        p = named[name]
        g = g.detach().to(device=p.device, dtype=p.dtype)
        if accumulate and p.grad is not None:
            p.grad.add_(g)
        else:
            p.grad = g.clone()


def surrogate_loss(model: nn.Module, grads: Mapping[str, torch.Tensor], *,
                   scale: float = 1.0, anchor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A scalar ``scale * sum_p <p, grads[p]>``: its backward puts ``scale * grads[name]`` into
    the ``.grad`` of each named parameter.  ``model`` may be a DDP wrapper or the module itself.

    Under ``DistributedDataParallel`` (which AVERAGES gradients over the ranks): use
    ``scale=world_size`` so that DDP's all-reduce yields the SUM of the ranks' clipped gradients,
    and pass as ``anchor`` an output of a forward through the DDP wrapper in this step.  DDP's
    reducer only expects gradients after its own forward: a backward of the surrogate alone
    all-reduces nothing (every rank silently keeps its local gradient).  The anchor enters as
    ``0 * anchor.sum()``, so it contributes exact zeros to the gradients (as long as the forward
    is finite).
    """
    named = dict(_unwrap(model).named_parameters())
    terms = [(named[name] * g.detach().to(named[name].dtype)).sum()
             for name, g in grads.items()]
    loss = scale * torch.stack(terms).sum()
    if anchor is not None:
        loss = loss + 0.0 * anchor.sum()
    return loss
