"""Poisson sampling of batches for DP-SGD: every example joins each batch independently with
probability ``sample_rate``, so batch sizes vary from step to step and a batch can be empty.

What this module owns: ``PoissonSampler`` (an iterable of index tensors, one per step, also a
``torch.utils.data.Sampler`` usable as a ``DataLoader``'s ``batch_sampler``) and
``poisson_data_loader`` (a ``DataLoader`` over it whose collate function turns an empty batch
into zero-row tensors instead of failing).

This is the sampling the privacy accountants assume (``functrans.nn.dp_accounting``: the
Poisson-subsampled Gaussian mechanism with rate ``q = sample_rate``); fixed-size shuffled
batches are a different mechanism, for which those ε are not a guarantee.  The draw is Opacus's
(``opacus.utils.uniform_sampler.UniformWithReplacementSampler``): per step one
``torch.rand(num_samples, generator=...) < sample_rate``, so with the same generator state both
give the same batches.

Averaging: DP-SGD divides the noisy sum by the EXPECTED batch size ``num_samples *
sample_rate`` (``sampler.expected_batch_size``), as Opacus does, not by the drawn size (which
would leak it, and is 0 now and then): ``dp_sgd_grads(..., reduction="sum")`` then ``/
sampler.expected_batch_size``.

Imports: errors.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, Iterator, List, Optional, cast

import torch
from torch.utils.data import DataLoader, Sampler, default_collate

from ..errors import TransformArgumentError, transform_call

__all__ = ["PoissonSampler", "poisson_data_loader"]


def check_sample_rate(sample_rate: Any, api: str) -> float:
    """``sample_rate`` as a float in (0, 1], or the argument error (shared with the privacy
    accounting, which takes the same rate)."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, numbers.Real) or \
            not 0 < float(sample_rate) <= 1:
        raise TransformArgumentError(
            f"{api}: sample_rate must be in (0, 1] (the probability that an example joins a "
            f"batch: expected batch size / dataset size); got {sample_rate!r}.")
    return float(sample_rate)


class PoissonSampler(Sampler[torch.Tensor]):
    """Batches of indices into ``range(num_samples)``, each index kept with probability
    ``sample_rate``, independently, at every step.

    ``num_samples``: the dataset size N (an int >= 1).  ``sample_rate``: q in (0, 1].
    ``steps``: batches per pass (``len(sampler)``); default ``int(1 / sample_rate)``, one epoch
    in expectation (Opacus's default).  ``generator`` / ``seed``: the draws' ``torch.Generator``
    (a seed makes one here); the generator advances from pass to pass, so a second pass draws
    new batches and two samplers with the same seed draw the same ones.  Neither: the global
    RNG.

    Iterating yields one ``int64`` index tensor per step, sorted, of varying length (0 included):
    index the data with it directly (``x[idx]``), or pass the sampler as a ``DataLoader``'s
    ``batch_sampler`` (see ``poisson_data_loader`` for empty batches).
    ``sampler.expected_batch_size`` is ``N * q``, the divisor for a mean gradient.

    >>> sampler = PoissonSampler(10, sample_rate=0.3, steps=3, seed=0)
    >>> [idx.tolist() for idx in sampler]
    [[2, 3], [2, 3, 4, 8, 9], [7, 8]]
    >>> sampler.expected_batch_size
    3.0
    """

    num_samples: int
    sample_rate: float
    steps: int
    generator: Optional[torch.Generator]

    def __init__(self, num_samples: int, sample_rate: float, *, steps: Optional[int] = None,
                 generator: Optional[torch.Generator] = None,
                 seed: Optional[int] = None) -> None:
        api = transform_call("PoissonSampler", None, "num_samples", sample_rate=sample_rate,
                             steps=steps)
        if isinstance(num_samples, bool) or not isinstance(num_samples, numbers.Integral) or \
                num_samples < 1:
            raise TransformArgumentError(
                f"{api}: num_samples must be an int >= 1 (the dataset size); got "
                f"{num_samples!r}.")
        sample_rate = check_sample_rate(sample_rate, api)
        if steps is None:
            steps = int(1 / sample_rate)
        elif isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
            raise TransformArgumentError(
                f"{api}: steps must be None (1 / sample_rate batches per pass) or an int >= 0; "
                f"got {steps!r}.")
        if generator is not None and seed is not None:
            raise TransformArgumentError(
                f"{api}: got both generator= and seed=; give either generator= or seed=, not "
                "both.")
        self.num_samples = int(num_samples)
        self.sample_rate = float(sample_rate)
        self.steps = int(steps)
        self.generator = (torch.Generator().manual_seed(int(seed)) if seed is not None
                          else generator)

    @property
    def expected_batch_size(self) -> float:
        """``num_samples * sample_rate``: the mean batch size, the divisor of a mean gradient."""
        return self.num_samples * self.sample_rate

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[torch.Tensor]:
        for _ in range(self.steps):
            mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            yield mask.nonzero(as_tuple=False).reshape(-1)

    def __repr__(self) -> str:
        return (f"PoissonSampler(num_samples={self.num_samples}, "
                f"sample_rate={self.sample_rate}, steps={self.steps})")


class _CollateAllowingEmpty:
    """``collate``, except that an empty batch gives ``collate([example])`` cut to zero rows
    (a class, not a closure, so that worker processes can unpickle it)."""

    def __init__(self, example: Any, collate: Callable[[List[Any]], Any]) -> None:
        self.example, self.collate = example, collate

    def __call__(self, batch: List[Any]) -> Any:
        if len(batch):
            return self.collate(batch)
        return _zero_rows(self.collate([self.example]))


def _zero_rows(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value[:0]
    if isinstance(value, dict):
        return {k: _zero_rows(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        rows = [_zero_rows(v) for v in value]
        return type(value)(*rows) if hasattr(value, "_fields") else type(value)(rows)
    return value


def poisson_data_loader(dataset: Any, *, sample_rate: float, steps: Optional[int] = None,
                        generator: Optional[torch.Generator] = None, seed: Optional[int] = None,
                        collate_fn: Optional[Callable[[List[Any]], Any]] = None,
                        **loader_kwargs: Any) -> "DataLoader[Any]":
    """A ``DataLoader`` over ``dataset`` (a map-style dataset with ``len``) whose batches come
    from ``PoissonSampler(len(dataset), sample_rate, steps=, generator=, seed=)``.

    An empty batch collates to zero-row tensors shaped like ``dataset[0]``'s (the default
    collate function would fail on it): ``collate_fn([dataset[0]])`` with every tensor in it
    (in tuples, lists, dicts) cut to its first zero rows.  ``collate_fn`` (default: torch's ``default_collate``)
    and any other ``DataLoader`` argument (``num_workers``, ``pin_memory``...) pass through;
    ``batch_size``, ``shuffle``, ``sampler`` and ``batch_sampler`` are the sampler's.
    ``loader.batch_sampler`` is the ``PoissonSampler`` (``.expected_batch_size``).

    >>> data = torch.utils.data.TensorDataset(torch.arange(8.0).reshape(4, 2), torch.arange(4))
    >>> loader = poisson_data_loader(data, sample_rate=0.5, steps=3, seed=6)
    >>> [(tuple(x.shape), y.tolist()) for x, y in loader]   # the first batch is empty
    [((0, 2), []), ((2, 2), [0, 1]), ((3, 2), [1, 2, 3])]
    """
    api = transform_call("poisson_data_loader", None, "dataset", sample_rate=sample_rate)
    taken = sorted({"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"}
                   & set(loader_kwargs))
    if taken:
        raise TransformArgumentError(
            f"{api}: {taken} cannot be given: Poisson sampling decides the batches (each "
            "example joins a batch with probability sample_rate).")
    sampler = PoissonSampler(len(dataset), sample_rate, steps=steps, generator=generator,
                             seed=seed)
    collate = _CollateAllowingEmpty(dataset[0], collate_fn or default_collate)
    # the DataLoader iterates each index tensor like a list of ints (its 0-d elements index)
    batches = cast("Sampler[List[int]]", sampler)
    return DataLoader(dataset, batch_sampler=batches, collate_fn=collate, **loader_kwargs)
