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

Ghost clipping (``method="ghost"``; ``"materialize"``, steps 1-3 above, is the default): each
example's gradient NORM comes from the layers' inputs and output gradients, captured by module
and tensor hooks during one forward and backward of the batch (``functrans.nn.dp_ghost``, which
documents the layers it covers and its fallbacks), and the clipped sum from one more backward
of ``sum_i factor_i * loss_i``: peak memory a small multiple of an ordinary backward's (1.8x on
the README's MLP), where step 1 holds every example's gradient (330x there; ``python -m
benchmarks.dp_memory`` measures both).  Steps 4-5 and the
distributed path are the same code for both methods (the same noise from the same seed).  The
model must give each example, in the batch, the output it gives it alone (no BatchNorm in
training mode).

An empty batch (``B = 0``, which Poisson sampling draws now and then) is a step like any other:
the clipped sum is zero, the noise is added as usual; ``reduction="mean"`` raises (it would
divide by zero; use ``"sum"`` and divide by the expected batch size).

Compiled steps with Poisson sampling (``compiled_private_step``): the batch size changes every
step, and a graph traced for one size would be retraced for the next.  Each batch is padded up
to a bucket size (four per octave, multiples of an int, or given sizes) with masked rows: their
per-example gradients are replaced by exact zeros (``torch.where(mask, g, 0)``, which holds even
for a NaN or infinite gradient) BEFORE the norms, the clipping and the sum, so a padded row adds
exactly ``0.0`` to every coordinate of the clipped sum.  Steps 1-3 run as one graph traced by
``functrans.compile`` per bucket (at most one trace per bucket); steps 4-5 run as in
``dp_sgd_grads`` (the same noise from the same generator state, the mean over the REAL count).

Argument errors are ``functrans.errors`` types that open with the call echoed
(``transform_call``), e.g. ``dp_sgd_grads(model, loss_fn, batch, max_norm=0.0, ...): ...``.

Sampling and accounting (re-exported here from ``functrans.nn.poisson`` and
``functrans.nn.dp_accounting``): ``PoissonSampler`` / ``poisson_data_loader`` draw the batches
(each example joins a step with probability ``sample_rate``; divide the noisy sum by
``sampler.expected_batch_size`` for a mean); ``privacy_spent(noise_multiplier=, sample_rate=,
steps=, delta=, accountant="rdp")`` is the ε of a run, ``noise_for_epsilon(target_epsilon=,
...)`` the noise multiplier of a planned one, and ``PrivacyLedger`` the ε so far, step by step
(all from Opacus's accountants, an optional dependency: ``pip install functrans[dp]``).

Imports: errors, stateless, batching.api, autodiff.grad, compiler.function, dp_accounting,
poisson, dp_ghost.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..autodiff.grad import grad
from ..batching.api import check_randomness, vmap
from ..compiler.function import compile as _compile
from ..errors import (TransformArgumentError, TransformKeyError, TransformTypeError,
                      transform_call)
from .dp_ghost import ghost_clipped_sum
from .stateless import functional_call

__all__ = ["per_sample_grads", "clip_and_sum", "add_gaussian_noise", "dp_sgd_grads",
           "assign_grads", "surrogate_loss", "compiled_private_step", "CompiledPrivateStep",
           "CLIP_EPS", "PoissonSampler", "poisson_data_loader", "privacy_spent",
           "noise_for_epsilon", "PrivacyLedger"]

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
    n = _batch_size(batch, api)
    model = _unwrap(model)
    params, rest = _trainable(model)
    if n == 0:   # vmap over an empty dim cannot run the model: no examples, no gradients
        return {name: p.new_zeros((0,) + tuple(p.shape)) for name, p in params.items()}
    return _per_example_grad_fn(model, loss_fn, len(batch), randomness)(params, rest, *batch)


def _per_example_grad_fn(model, loss_fn, n_batch_tensors: int, randomness: str):
    """``vmap(grad(loss of one example))`` over (params, rest, *batch tensors)."""
    def example_loss(p, r, x, *others):
        out = functional_call(model, (p, r), (x.unsqueeze(0),))
        return loss_fn(out, *(o.unsqueeze(0) for o in others))

    in_dims = (None, None) + (0,) * n_batch_tensors
    return vmap(grad(example_loss), in_dims=in_dims, randomness=randomness)


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
    sq = torch.stack([g.reshape(g.shape[0], math.prod(g.shape[1:])).pow(2).sum(1)
                      for g in grads]).sum(0)
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
        # std * noise + g, in the noise's own buffer (one temporary less than g + std * noise;
        # the same values: IEEE addition and multiplication commute)
        out[name] = noise.to(g.device).mul_(std).add_(g)
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
                 randomness: str = "different", method: str = "materialize"):
    """The privatized gradient of one DP-SGD step (see the module docstring for the recipe).

    Returns ``{name: noisy clipped gradient}`` for the trainable parameters (plus the
    per-example norms before clipping, of this rank's examples, if ``return_norms``).
    ``reduction``: ``"sum"`` (the noisy sum) or ``"mean"`` (divided by the global batch size).
    ``distributed=True`` (or a ``process_group``): all-reduce the clipped sums across the group;
    only rank ``noise_rank`` (a rank within the group) adds noise, from its ``generator``/``seed``.
    ``randomness``: see ``per_sample_grads`` (dropout masks per example).
    ``method``: ``"materialize"`` (default): every example's gradient (``per_sample_grads``),
    then ``clip_and_sum``; ``"ghost"``: each example's gradient NORM from the layers' inputs and
    output gradients, then one more backward of the loss reweighted by the clipping factors
    (``functrans.nn.dp_ghost``: memory near an ordinary backward's; the model must give each
    example the output it gives it alone, e.g. no BatchNorm in training mode).  Both give the
    same result up to rounding (the noise is the same).
    """
    api = transform_call("dp_sgd_grads", "model", "loss_fn", "batch", max_norm=max_norm,
                         noise_multiplier=noise_multiplier)
    _check_method(method, api)
    _check_reduction(reduction, api)
    _check_noise_multiplier(noise_multiplier, api)
    _check_max_norm(max_norm, api)   # before the per-example gradients are computed
    gen = _generator(generator, seed, api)
    batch = _as_tuple(batch, api)
    n = _batch_size(batch, api)
    sums, norms = _clipped_sum(model, loss_fn, batch, max_norm, randomness, method, api)

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
    return _finish(sums, norms, n, reduction, return_norms, api)


_METHODS = ("materialize", "ghost")


def _check_method(method, api: str) -> None:
    if method not in _METHODS:
        raise TransformArgumentError(
            f"{api}: method must be 'materialize' (every example's gradient, then clipping) or "
            f"'ghost' (per-example gradient norms from the layers, then a reweighted "
            f"backward); got method={method!r}.")


def _check_ghost_randomness(randomness, method: str, api: str) -> None:
    check_randomness(randomness, api)
    if method == "ghost" and randomness != "different":
        raise TransformArgumentError(
            f"{api}: method='ghost' runs the batch through the model at once, so each example "
            f"draws its own random values (dropout), as randomness='different' does; got "
            f"randomness={randomness!r}.  Use method='materialize' for {randomness!r}.")


def _clipped_sum(model, loss_fn, batch: tuple, max_norm, randomness, method, api):
    """Steps 1-3: ``(sums, norms)`` by ``method``."""
    if method == "materialize":
        return _clip_and_sum(_per_sample_grads(model, loss_fn, batch, randomness, api),
                             max_norm, api)
    _check_ghost_randomness(randomness, method, api)
    return ghost_clipped_sum(_unwrap(model), loss_fn, batch,
                             lambda norms: (max_norm / (norms + CLIP_EPS)).clamp(max=1.0), api)


def _check_reduction(reduction, api: str) -> None:
    if reduction not in ("sum", "mean"):
        raise TransformArgumentError(
            f"{api}: reduction must be 'sum' (the noisy sum) or 'mean' (divided by the batch "
            f"size); got {reduction!r}.")


def _check_noise_multiplier(noise_multiplier, api: str) -> None:
    if noise_multiplier < 0:
        raise TransformArgumentError(
            f"{api}: noise_multiplier must be >= 0 (0: no noise); got {noise_multiplier}.")


def _finish(sums: Grads, norms: torch.Tensor, n: int, reduction: str, return_norms: bool,
            api: str):
    """Step 5 and the return value, shared by ``dp_sgd_grads`` and the compiled step."""
    if reduction == "mean":
        if n == 0:
            raise TransformArgumentError(
                f"{api}: reduction='mean' divides the noisy sum by the batch size, and this "
                "batch is empty (Poisson sampling draws empty batches now and then); use "
                "reduction='sum' and divide by the expected batch size.")
        sums = {name: g / n for name, g in sums.items()}
    return (sums, norms) if return_norms else sums


# --------------------------------------------------------------------------------------------
# The compiled step: padding to bucket sizes, masked rows, one trace per bucket.

Buckets = Union[None, int, Sequence[int]]


def _positive_int(value, name: str, api: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TransformArgumentError(f"{api}: {name} must be a positive int; got {value!r}.")
    return value


class CompiledPrivateStep:
    """One DP-SGD step per call, its per-example part compiled; see ``compiled_private_step``."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor], *,
                 max_norm: float, noise_multiplier: float, buckets: Buckets = None,
                 max_batch_size: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 seed: Optional[int] = None, reduction: str = "sum",
                 randomness: str = "different", backend: str = "replay",
                 method: str = "materialize"):
        api = transform_call("compiled_private_step", "model", "loss_fn", max_norm=max_norm,
                             noise_multiplier=noise_multiplier, buckets=buckets,
                             max_batch_size=max_batch_size)
        self._api = api
        _check_method(method, api)
        self.method = method
        _check_max_norm(max_norm, api)
        _check_noise_multiplier(noise_multiplier, api)
        _check_reduction(reduction, api)
        _check_ghost_randomness(randomness, method, api)
        self.model, self.loss_fn = model, loss_fn
        self.max_norm, self.noise_multiplier = max_norm, noise_multiplier
        self.reduction, self.randomness = reduction, randomness
        # a seed makes ONE generator here, which then advances from step to step
        self.generator = _generator(generator, seed, api)
        self._sizes: Optional[Tuple[int, ...]] = None   # explicit bucket sizes
        self._multiple: Optional[int] = None            # buckets=int: multiples of it
        if max_batch_size is not None:
            _positive_int(max_batch_size, "max_batch_size", api)
        self.max_batch_size = max_batch_size
        if isinstance(buckets, int) and not isinstance(buckets, bool):
            self._multiple = _positive_int(buckets, "buckets", api)
        elif buckets is not None:
            if not isinstance(buckets, (list, tuple)) or not buckets:
                raise TransformArgumentError(
                    f"{api}: buckets must be None (four sizes per octave), an int k (multiples "
                    f"of k) or a non-empty sequence of batch sizes; got {buckets!r}.")
            if max_batch_size is not None:
                raise TransformArgumentError(
                    f"{api}: give max_batch_size only with buckets=None or an int; with a "
                    "sequence of sizes the largest size is the maximum.")
            self._sizes = tuple(sorted({_positive_int(b, "every bucket size", api)
                                        for b in buckets}))
        count = self._bucket_count()
        part = self._masked_ghost_sum if method == "ghost" else self._masked_clipped_sum
        self._compiled = _compile(part, backend=backend,
                                  cache_size=count if count is not None else 32)

    # ---------------------------------------------------------------- buckets
    def _bucket_count(self) -> Optional[int]:
        """How many bucket sizes there are (None: no maximum, they grow with the batch)."""
        if self._sizes is not None:
            return len(self._sizes)
        if self.max_batch_size is None:
            return None
        return len({self.bucket_for(n) for n in _bucket_probe(self)})

    def bucket_for(self, n: int) -> int:
        """The padded size of a batch of ``n >= 1`` examples."""
        if self._sizes is not None:
            for size in self._sizes:
                if size >= n:
                    return size
            raise TransformArgumentError(
                f"{self._api}: a batch of {n} examples is larger than the largest of "
                f"buckets={list(self._sizes)}; add a larger bucket size (Poisson sampling "
                "draws a batch above its expected size now and then).")
        if self._multiple is not None:
            size = -(-n // self._multiple) * self._multiple
        else:   # 4 sizes per octave: n rounded up to its 3 leading binary digits
            shift = max(n.bit_length() - 3, 0)
            size = -(-n >> shift) << shift
        if self.max_batch_size is not None and size > self.max_batch_size:
            if n > self.max_batch_size:
                raise TransformArgumentError(
                    f"{self._api}: a batch of {n} examples is larger than "
                    f"max_batch_size={self.max_batch_size} (the largest bucket); raise "
                    "max_batch_size (Poisson sampling draws a batch above its expected size "
                    "now and then).")
            size = self.max_batch_size
        return size

    # ---------------------------------------------------------------- the compiled part
    def _masked_clipped_sum(self, params: Grads, rest: Grads, mask: torch.Tensor,
                            batch: tuple):
        """Steps 1-3 on a padded batch: the rows where ``mask`` is False give exact zeros."""
        per_sample = _per_example_grad_fn(_unwrap(self.model), self.loss_fn, len(batch),
                                          self.randomness)(params, rest, *batch)
        masked = {}
        for name, g in per_sample.items():
            keep = mask.reshape((-1,) + (1,) * (g.dim() - 1))
            masked[name] = torch.where(keep, g, g.new_zeros(()))
        return _clip_and_sum(masked, self.max_norm, self._api)

    def _masked_ghost_sum(self, model: nn.Module, mask: torch.Tensor, batch: tuple):
        """Steps 1-3 by ghost clipping on a padded batch: the rows where ``mask`` is False get
        the clipping factor 0 in the reweighted backward and the norm 0.  ``model`` (the plain
        module) is an argument so that ``functrans.compile`` re-reads its parameters and
        buffers on every call."""
        def factors(norms):
            return torch.where(mask, (self.max_norm / (norms + CLIP_EPS)).clamp(max=1.0),
                               norms.new_zeros(()))
        sums, norms = ghost_clipped_sum(model, self.loss_fn, batch, factors, self._api)
        return sums, torch.where(mask, norms, norms.new_zeros(()))

    def masked_clipped_sum(self, batch, mask: torch.Tensor) -> Tuple[Grads, torch.Tensor]:
        """Steps 1-3, compiled, on a batch that is already padded: ``(sums, norms)`` as
        ``clip_and_sum`` returns them, where the rows with ``mask[i] == False`` contribute
        exactly nothing (their gradients, whatever their content, are replaced by zeros before
        the norms: their norm is 0 and they add 0.0 to the sums).  ``mask``: a bool tensor
        ``[B]``.  One trace per batch shape; for data loaders that pad batches themselves."""
        api = self._api
        batch = _as_tuple(batch, api)
        n = _batch_size(batch, api)
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or \
                tuple(mask.shape) != (n,):
            raise TransformArgumentError(
                f"{api}: mask must be a bool tensor of shape [{n}] (one entry per row of the "
                f"batch); got {mask!r:.80}.")
        if n == 0:
            return _clip_and_sum(
                _per_sample_grads(self.model, self.loss_fn, batch, self.randomness, api),
                self.max_norm, api)
        if self.method == "ghost":
            return self._compiled(_unwrap(self.model), mask, batch)
        params, rest = _trainable(_unwrap(self.model))
        if not params:
            _clip_and_sum({}, self.max_norm, api)   # raises: nothing to clip
        return self._compiled(params, rest, mask, batch)

    # ---------------------------------------------------------------- one step
    def __call__(self, batch, *, return_norms: bool = False):
        """The privatized gradient of one step on ``batch`` (any size up to the maximum), as
        ``dp_sgd_grads`` returns it: ``{name: noisy clipped gradient}`` (plus the per-example
        norms before clipping, ``[B]``, if ``return_norms``)."""
        api = self._api
        batch = _as_tuple(batch, api)
        n = _batch_size(batch, api)
        if n == 0:   # no examples: the eager path (zero sums, no graph to trace)
            sums, norms = self.masked_clipped_sum(batch, torch.zeros(0, dtype=torch.bool))
        else:
            size = self.bucket_for(n)
            mask = torch.arange(size, device=batch[0].device) < n
            if size > n:   # rows repeating the first example: valid inputs, masked out
                batch = tuple(torch.cat([t, t[:1].expand((size - n,) + tuple(t.shape[1:]))])
                              for t in batch)
            sums, norms = self.masked_clipped_sum(batch, mask)
            norms = norms[:n]
        sums = add_gaussian_noise(sums, self.noise_multiplier * self.max_norm,
                                  generator=self.generator)
        return _finish(sums, norms, n, self.reduction, return_norms, api)

    # ---------------------------------------------------------------- introspection
    def cache_info(self):
        """The compiled part's ``cache_info()``: one miss (trace) per bucket size used."""
        return self._compiled.cache_info()

    def cache_clear(self) -> None:
        self._compiled.cache_clear()

    def __repr__(self) -> str:
        if self._sizes is not None:
            kind = f"buckets={list(self._sizes)}"
        else:
            kind = ("4 sizes per octave" if self._multiple is None else f"multiples of "
                    f"{self._multiple}") + f", max_batch_size={self.max_batch_size}"
        return f"<functrans.nn.dp.CompiledPrivateStep ({kind})>"


def _bucket_probe(step: CompiledPrivateStep):
    """Batch sizes that reach every bucket below ``max_batch_size``: each bucket's own size."""
    n, top = 1, step.max_batch_size
    while n <= top:
        yield n
        n = step.bucket_for(n) + 1


def compiled_private_step(model: nn.Module, loss_fn: Callable[..., torch.Tensor], *,
                          max_norm: float, noise_multiplier: float, buckets: Buckets = None,
                          max_batch_size: Optional[int] = None,
                          generator: Optional[torch.Generator] = None,
                          seed: Optional[int] = None, reduction: str = "sum",
                          randomness: str = "different", backend: str = "replay",
                          method: str = "materialize") -> CompiledPrivateStep:
    """A DP-SGD step for batches whose size changes every step (Poisson sampling), compiled
    with ``functrans.compile`` so that it never retraces per step.

    ``step = compiled_private_step(model, loss_fn, max_norm=1.0, noise_multiplier=1.1,
    max_batch_size=512)``; then each step ``grads = step((x, y))`` (``return_norms=True``: also
    the per-example norms) returns what ``dp_sgd_grads(model, loss_fn, (x, y), ...)`` returns,
    up to summation order (the noise is the same, drawn from the same generator state).

    The batch of ``B`` examples is padded to a bucket size with masked rows (copies of the
    first example whose gradients are replaced by exact zeros before the norms, the clipping
    and the sum: they contribute exactly nothing), and the per-example gradients, the clipping
    and the sum run as one graph per bucket size: at most one trace per bucket
    (``step.cache_info().misses``).  Noise and ``reduction="mean"`` (over the real ``B``)
    follow on the result as in ``dp_sgd_grads``.

    ``buckets``: ``None`` (default): four sizes per octave, ``B`` rounded up to its three
    leading binary digits (1..8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ...: at most 25% padding,
    where powers of two would pad a batch just above 128 to 256); an int ``k``: multiples of
    ``k``; a sequence of sizes: those sizes, the largest being the maximum (powers of two:
    ``buckets=[1, 2, 4, ...]``).  ``max_batch_size`` caps the default / multiples (the largest
    bucket is ``max_batch_size`` itself); a batch above the maximum raises an error naming
    ``max_batch_size`` (or ``buckets``).  Without a maximum, buckets grow with the batch (up to
    32 graphs are kept, least recently used evicted).
    ``generator`` / ``seed``: the noise's generator; a seed makes one generator here, which
    advances from step to step (``dp_sgd_grads(seed=...)`` reseeds on every call).
    ``randomness`` as in ``per_sample_grads``: dropout draws for the padded rows too, so the
    global generator advances by the padded size.  ``backend``: ``functrans.compile``'s.
    An empty batch gives zero clipped sums plus the noise (``reduction="mean"`` raises).
    Single process only (no ``process_group``).  ``step.masked_clipped_sum(batch, mask)`` runs
    the compiled part on a batch the caller padded; ``step.bucket_for(B)`` is the padded size;
    ``step.cache_info()`` the compiled part's counters.
    ``method="ghost"`` (see ``dp_sgd_grads``): steps 1-3 by ghost clipping, traced per bucket
    the same way (the module and tensor hooks, both backwards and the per-module ``vmap(grad)``
    fallbacks run during the trace and their ops are replayed); the parameters are read from
    the model on every call.  A padded row gets the clipping factor 0 in the reweighted
    backward and the norm 0: it adds exact zeros as long as the first example (which it
    copies) has a finite gradient.
    """
    return CompiledPrivateStep(model, loss_fn, max_norm=max_norm,
                               noise_multiplier=noise_multiplier, buckets=buckets,
                               max_batch_size=max_batch_size, generator=generator, seed=seed,
                               reduction=reduction, randomness=randomness, backend=backend,
                               method=method)


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


# Poisson sampling and privacy accounting live in their own modules; they are part of the DP-SGD
# API, so they are importable from here too.
from .dp_accounting import PrivacyLedger, noise_for_epsilon, privacy_spent  # noqa: E402
from .poisson import PoissonSampler, poisson_data_loader  # noqa: E402
