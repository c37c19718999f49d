"""functrans's DP-SGD step beside Opacus's on the same models: the equivalence (the largest
difference of the per-sample gradients and of the clipped, noised, averaged gradient) and the
step time, side by side.  ``python -m benchmarks.opacus_equivalence`` prints both tables.

The two sides (each on its own deep copy of one model: Opacus's hooks stay on its copy):

* functrans: ``per_sample_grads`` (the per-sample gradients) and
  ``dp_sgd_grads(..., reduction="mean", generator=g)``: clip each example's total gradient to
  ``max_norm``, sum, add ``N(0, (noise_multiplier * max_norm)**2)`` per coordinate, divide by B;
* Opacus 1.6: ``GradSampleModule(model)`` (its hand-written grad samplers; ``p.grad_sample``
  after ``loss.backward()``) and ``DPOptimizer(max_grad_norm=max_norm, expected_batch_size=B,
  generator=g)``, whose ``pre_step()`` leaves in ``p.grad`` the clipped sum plus the noise,
  divided by ``expected_batch_size`` (opacus/optimizers/optimizer.py: ``clip_and_accumulate``,
  ``add_noise``, ``scale_grad``).  Both clip with ``min(1, C / (norm + 1e-6))``, and both draw
  the noise parameter by parameter in the model's order from the generator (Opacus with
  ``torch.normal(0, std)``, functrans with ``std * torch.randn``: the same stream), so with the
  same seed even the noisy gradients agree.

Models (``MODELS``): an MLP, a CNN (conv, relu, max-pool, linear), an LSTM (Opacus's ``DPLSTM``,
the same module on both sides: Opacus has no grad sampler for ``nn.LSTM``; functrans runs
``DPLSTM`` per example like any module) with a linear head on the last step, and Embedding +
LayerNorm (mean over the sequence, a linear head).  The loss is cross-entropy, mean over the
batch (``loss_reduction="mean"`` on Opacus's side, whose backprops are scaled back by B).

Step time: one thread, the two steps interleaved, the median of the repeats; a step is the
whole training step with the noise on (functrans: ``dp_sgd_grads`` + ``assign_grads`` +
``SGD.step``; Opacus: ``zero_grad``, forward, loss, ``backward`` (the hooks), ``DPOptimizer.step``).
Opacus is optional (``pip install functrans[dp]``).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from functrans.nn.dp import assign_grads, dp_sgd_grads, per_sample_grads

Grads = Dict[str, torch.Tensor]
Batch = Tuple[torch.Tensor, torch.Tensor]
N_CLASSES = 10

# Opacus's hooks are full backward hooks on layers whose inputs (the data) need no gradient:
# PyTorch warns about it once per module; it is how Opacus always runs.
HOOK_WARNING = "Full backward hook is firing when gradients"


class MLP(nn.Sequential):
    def __init__(self, n_in: int = 16, hidden: int = 32) -> None:
        super().__init__(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, N_CLASSES))


class CNN(nn.Sequential):
    def __init__(self) -> None:   # 1x12x12 -> 8x10x10 -> 8x5x5
        super().__init__(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(8 * 5 * 5, N_CLASSES))


class LSTMNet(nn.Module):
    """Opacus's DPLSTM (batch first; the same parameter names as ``nn.LSTM``) and a head on the
    last time step."""

    def __init__(self, n_in: int = 8, hidden: int = 16) -> None:
        super().__init__()
        from opacus.layers import DPLSTM
        self.lstm = DPLSTM(n_in, hidden, batch_first=True)
        self.head = nn.Linear(hidden, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class EmbedLN(nn.Module):
    """Embedding, LayerNorm, the mean over the sequence, a linear head."""

    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(x)).mean(1))


def _inputs(name: str, batch: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if name == "MLP":
        return torch.randn(batch, 16, generator=gen, dtype=dtype)
    if name == "CNN":
        return torch.randn(batch, 1, 12, 12, generator=gen, dtype=dtype)
    if name == "LSTM":
        return torch.randn(batch, 6, 8, generator=gen, dtype=dtype)
    return torch.randint(0, 50, (batch, 7), generator=gen)


MODELS: Dict[str, Callable[[], nn.Module]] = {
    "MLP": MLP, "CNN": CNN, "LSTM": LSTMNet, "Embedding+LayerNorm": EmbedLN}


def make(name: str, batch: int, dtype: torch.dtype = torch.float32, seed: int = 0
         ) -> Tuple[nn.Module, Batch]:
    """The model ``name`` (weights from ``seed``) in ``dtype`` and a batch ``(x, y)``."""
    torch.manual_seed(seed)
    model = MODELS[name]().to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    x = _inputs(name, batch, dtype, gen)
    y = torch.randint(0, N_CLASSES, (batch,), generator=gen)
    return model, (x, y)


def functrans_side(model: nn.Module, batch: Batch, *, max_norm: float,
                   noise_multiplier: float, seed: int = 0,
                   reduction: str = "mean") -> Tuple[Grads, Grads]:
    """``(per-sample gradients, privatized gradient)`` from functrans, on a copy of ``model``."""
    model = copy.deepcopy(model)
    per_sample = per_sample_grads(model, F.cross_entropy, batch)
    private = dp_sgd_grads(model, F.cross_entropy, batch, max_norm=max_norm,
                           noise_multiplier=noise_multiplier, seed=seed, reduction=reduction)
    return per_sample, private


def _cudnn_flags_settable():
    """Opacus's Embedding grad sampler sets ``torch.backends.cudnn.deterministic``; a process
    that imported ``torch.testing._internal.common_utils`` (the OpInfo tests do) has frozen
    those flags (``torch.backends.disable_global_flags()``), so the assignment would raise.
    This allows it for the block, as the flags' own context managers do."""
    return getattr(torch.backends, "__allow_nonbracketed_mutation")()


def opacus_side(model: nn.Module, batch: Batch, *, max_norm: float, noise_multiplier: float,
                seed: int = 0, reduction: str = "mean") -> Tuple[Grads, Grads]:
    """``(p.grad_sample, p.grad after DPOptimizer.pre_step())`` from Opacus, on a copy of
    ``model``; ``reduction`` is the loss's and Opacus's ``loss_reduction``."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    model = copy.deepcopy(model)
    x, y = batch
    gsm = GradSampleModule(model, loss_reduction=reduction)
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.1),
                      noise_multiplier=noise_multiplier, max_grad_norm=max_norm,
                      expected_batch_size=x.shape[0], loss_reduction=reduction,
                      generator=torch.Generator().manual_seed(seed))
    with warnings.catch_warnings(), _cudnn_flags_settable():
        warnings.filterwarnings("ignore", message=HOOK_WARNING)
        F.cross_entropy(gsm(x), y, reduction=reduction).backward()
    named = list(model.named_parameters())
    grad_sample = {k: p.grad_sample.detach().clone() for k, p in named}
    assert opt.pre_step(), "DPOptimizer skipped the step"
    return grad_sample, {k: p.grad.detach().clone() for k, p in named}


def max_diff(a: Grads, b: Grads) -> Tuple[float, float]:
    """``(max abs difference, max relative difference)`` over the parameters; the relative one
    is each parameter's max abs difference over its largest ``|b|``."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    abs_d = max((a[k] - b[k]).abs().max().item() for k in a)
    rel_d = max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)).item()
                for k in a)
    return abs_d, rel_d


def median_norm(model: nn.Module, batch: Batch) -> float:
    """The median per-example gradient norm: as ``max_norm``, half the examples are clipped."""
    g = per_sample_grads(model, F.cross_entropy, batch)
    sq = sum(v.reshape(v.shape[0], -1).pow(2).sum(1) for v in g.values())
    return float(torch.as_tensor(sq).sqrt().median())


def equivalence(name: str, dtype: torch.dtype, batch: int = 8, noise_multiplier: float = 0.0
                ) -> Dict[str, Tuple[float, float]]:
    """The largest differences, functrans vs Opacus, on ``name``: of the per-sample gradients
    and of the privatized mean gradient (``max_norm``: the median per-example norm)."""
    model, data = make(name, batch, dtype)
    c = median_norm(model, data)
    ft_ps, ft_priv = functrans_side(model, data, max_norm=c, noise_multiplier=noise_multiplier)
    op_ps, op_priv = opacus_side(model, data, max_norm=c, noise_multiplier=noise_multiplier)
    return {"per-sample": max_diff(ft_ps, op_ps), "private mean": max_diff(ft_priv, op_priv)}


# --------------------------------------------------------------------------- step time
def _functrans_step(model: nn.Module, data: Batch, max_norm: float, nm: float
                    ) -> Callable[[], None]:
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator()

    def step() -> None:
        gen.manual_seed(0)
        grads = dp_sgd_grads(model, F.cross_entropy, data, max_norm=max_norm,
                             noise_multiplier=nm, generator=gen, reduction="mean")
        assign_grads(model, grads)
        opt.step()
    return step


def _opacus_step(model: nn.Module, data: Batch, max_norm: float, nm: float
                 ) -> Callable[[], None]:
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer
    gsm = GradSampleModule(copy.deepcopy(model))
    gen = torch.Generator()
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.05), noise_multiplier=nm,
                      max_grad_norm=max_norm, expected_batch_size=data[0].shape[0],
                      generator=gen)
    x, y = data

    def step() -> None:
        gen.manual_seed(0)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(gsm(x), y).backward()
        opt.step()
    return step


def step_times(name: str, batch: int = 64, repeats: int = 21, warmup: int = 3
               ) -> Dict[str, float]:
    """Median seconds per training step (noise on), functrans and Opacus interleaved."""
    model, data = make(name, batch)
    steps = {"functrans": _functrans_step(model, data, 1.0, 1.0),
             "Opacus": _opacus_step(model, data, 1.0, 1.0)}
    times: Dict[str, List[float]] = {k: [] for k in steps}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=HOOK_WARNING)
        for _ in range(warmup):
            for fn in steps.values():
                fn()
        for _ in range(repeats):
            for k, fn in steps.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="batch size of the timed steps")
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("equivalence, functrans vs Opacus (B=8, max_norm = median per-example norm): max abs "
          "/ max rel difference; noise off, and noise on (noise_multiplier=1, one seed)")
    print(f"{'model':<20} {'dtype':<8} {'per-sample grads':>20} {'clipped mean grad':>20} "
          f"{'noisy mean grad':>20}")
    for name in MODELS:
        for dtype in (torch.float32, torch.float64):
            r = equivalence(name, dtype)
            noisy = equivalence(name, dtype, noise_multiplier=1.0)["private mean"]
            cells = [f"{a:.1e} / {b:.1e}" for a, b in (r["per-sample"], r["private mean"],
                                                          noisy)]
            print(f"{name:<20} {str(dtype)[6:]:<8} " + " ".join(f"{c:>20}" for c in cells))
    print(f"\nstep time (1 thread, B={args.batch}, noise on, median of {args.repeats} "
          f"interleaved steps)")
    print(f"{'model':<20} {'functrans ms':>13} {'Opacus ms':>10} {'functrans/Opacus':>17}")
    for name in MODELS:
        t = step_times(name, args.batch, args.repeats)
        print(f"{name:<20} {t['functrans'] * 1e3:>13.2f} {t['Opacus'] * 1e3:>10.2f} "
              f"{t['functrans'] / t['Opacus']:>17.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
