"""functrans's DP-SGD equals Opacus's: on the same model, data and seed.

* noise off: the per-sample gradients (Opacus's ``p.grad_sample``, from its hand-written grad
  samplers) and the clipped, averaged gradient (Opacus's ``p.grad`` after
  ``DPOptimizer.pre_step()``: the clipped sum divided by ``expected_batch_size = B``) equal
  functrans's ``per_sample_grads`` and ``dp_sgd_grads(..., reduction="mean",
  noise_multiplier=0.0)``, for an MLP, a CNN, an LSTM (Opacus's DPLSTM on both sides; and
  functrans on ``nn.LSTM`` with the same weights) and Embedding + LayerNorm, in float32
  (relative 1e-5) and float64 (relative 1e-12), with ``max_norm`` at the median per-example
  norm so that half the examples are clipped.  Both are also checked against a per-example
  loop of ``torch.autograd.grad``.
* noise on: the noise has the documented standard deviation, ``noise_multiplier * max_norm``
  on the sum and that over B on the mean, measured on both sides on a 256x256 weight (65536
  draws: the standard error of the measured std is 0.3%; the bounds are 3%); and with the same
  seed the noisy gradients themselves agree (both draw the same Gaussian stream parameter by
  parameter).

The models and the two sides live in benchmarks/opacus_equivalence.py (``python -m
benchmarks.opacus_equivalence`` prints the measured differences and the step times).
"""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("opacus")

from benchmarks import opacus_equivalence as eq  # noqa: E402  (needs opacus for the LSTM)

RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}
MODELS = list(eq.MODELS)


def _loop_grads(model: nn.Module, batch) -> dict:
    """The per-example gradients by a loop of torch.autograd.grad (the oracle)."""
    x, y = batch
    named = [(k, p) for k, p in model.named_parameters()]
    rows = []
    for i in range(x.shape[0]):
        loss = F.cross_entropy(model(x[i:i + 1]), y[i:i + 1])
        rows.append(torch.autograd.grad(loss, [p for _, p in named]))
    return {k: torch.stack([r[j] for r in rows]) for j, (k, _) in enumerate(named)}


def _assert_close(a: dict, b: dict, rtol: float, what: str) -> None:
    abs_d, rel_d = eq.max_diff(a, b)
    assert rel_d <= rtol, f"{what}: max abs difference {abs_d:.2e}, relative {rel_d:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", MODELS)
def test_clipped_mean_gradient_equals_opacus_without_noise(name, dtype):
    model, batch = eq.make(name, 8, dtype)
    c = eq.median_norm(model, batch)
    ft_ps, ft_mean = eq.functrans_side(model, batch, max_norm=c, noise_multiplier=0.0)
    op_ps, op_mean = eq.opacus_side(model, batch, max_norm=c, noise_multiplier=0.0)
    loop = _loop_grads(model, batch)
    rtol = RTOL[dtype]
    _assert_close(ft_ps, op_ps, rtol, f"{name}: per-sample gradients, functrans vs Opacus")
    _assert_close(ft_ps, loop, rtol, f"{name}: per-sample gradients, functrans vs the loop")
    _assert_close(ft_mean, op_mean, rtol, f"{name}: clipped mean gradient")

    # the clipping mattered: some examples above max_norm, some below
    norms = torch.stack([g.reshape(8, -1).pow(2).sum(1) for g in loop.values()]).sum(0).sqrt()
    assert (norms > c * 1.001).any() and (norms < c * 0.999).any()
    # and the result is the clipped mean of the loop's gradients, written out
    factor = (c / (norms + 1e-6)).clamp(max=1.0)
    expected = {k: (factor.reshape(-1, *[1] * (g.dim() - 1)) * g).sum(0) / 8
                for k, g in loop.items()}
    _assert_close(ft_mean, expected, rtol, f"{name}: clipped mean vs the formula")


def test_functrans_on_nn_lstm_equals_opacus_on_dplstm():
    """The same function on both sides with each library's own LSTM: Opacus needs its DPLSTM
    (no grad sampler for nn.LSTM), functrans runs nn.LSTM itself.  DPLSTM keeps nn.LSTM's
    parameter names and gate order, so the weights carry over by name."""
    dp_model, batch = eq.make("LSTM", 8, torch.float64)

    class TorchLSTMNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(8, 16, batch_first=True)
            self.head = nn.Linear(16, eq.N_CLASSES)

        def forward(self, x):
            return self.head(self.lstm(x)[0][:, -1])

    torch_model = TorchLSTMNet().double()
    # DPLSTM's state_dict also holds its cells' own names (lstm.l0.ih.weight): copy by the
    # parameter names, which must be exactly nn.LSTM's
    torch_model.load_state_dict({k: p.detach() for k, p in dp_model.named_parameters()})
    c = eq.median_norm(dp_model, batch)
    ft_ps, ft_mean = eq.functrans_side(torch_model, batch, max_norm=c, noise_multiplier=0.0)
    op_ps, op_mean = eq.opacus_side(dp_model, batch, max_norm=c, noise_multiplier=0.0)
    _assert_close(ft_ps, op_ps, 1e-12, "nn.LSTM (functrans) vs DPLSTM (Opacus), per-sample")
    _assert_close(ft_mean, op_mean, 1e-12, "nn.LSTM (functrans) vs DPLSTM (Opacus), mean")


@pytest.mark.parametrize("name", ["MLP", "Embedding+LayerNorm"])
def test_noisy_gradient_equals_opacus_with_the_same_seed(name):
    """With the noise on and one seed, the noisy mean gradients agree too: both sides draw
    N(0, (noise_multiplier * max_norm)**2) parameter by parameter in the model's order."""
    model, batch = eq.make(name, 8, torch.float64)
    kw = dict(max_norm=eq.median_norm(model, batch), noise_multiplier=1.3, seed=7)
    _, ft_mean = eq.functrans_side(model, batch, **kw)
    _, op_mean = eq.opacus_side(model, batch, **kw)
    _, clean = eq.functrans_side(model, batch, **{**kw, "noise_multiplier": 0.0})
    _assert_close(ft_mean, op_mean, 1e-12, f"{name}: noisy mean gradient, same seed")
    assert all((ft_mean[k] - clean[k]).abs().max() > 0 for k in clean)   # the noise is there


class Wide(nn.Sequential):
    """A 256x256 weight: 65536 noise draws in one parameter."""

    def __init__(self):
        super().__init__(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256, bias=False),
                         nn.ReLU(), nn.Linear(256, eq.N_CLASSES))


def _noise_stats(noise: torch.Tensor, std: float):
    z = (noise / std).double().reshape(-1)
    return z.mean().item(), z.std().item(), (z.abs() < 1).double().mean().item(), z.numel()


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_noise_has_the_documented_std_on_both_sides(reduction):
    """noisy - clean on the 256x256 weight: N(0, sigma**2) with sigma = noise_multiplier *
    max_norm (sum) or that over B (mean): its mean, its std and the fraction within one sigma
    (0.6827 for a Gaussian) are measured on both sides."""
    torch.manual_seed(0)
    model = Wide()
    batch = (torch.randn(4, 16), torch.randint(0, eq.N_CLASSES, (4,)))
    nm, c, b = 1.1, 0.5, 4
    sigma = nm * c / (b if reduction == "mean" else 1)
    kw = dict(max_norm=c, reduction=reduction, seed=3)
    sides = {"functrans": eq.functrans_side, "Opacus": eq.opacus_side}
    for side, run in sides.items():
        _, noisy = run(model, batch, noise_multiplier=nm, **kw)
        _, clean = run(model, batch, noise_multiplier=0.0, **kw)
        noise = noisy["2.weight"] - clean["2.weight"]
        mean, std, within, n = _noise_stats(noise, sigma)
        assert n == 65536
        assert abs(mean) < 6 / math.sqrt(n), f"{side}: noise mean {mean * sigma:.2e}"
        assert abs(std - 1) < 0.03, f"{side}: noise std {std * sigma:.4e}, expected {sigma}"
        assert abs(within - 0.6827) < 0.01, f"{side}: {within:.4f} within one sigma"


def test_opacus_side_reads_pre_step_gradient():
    """The Opacus side's mean gradient is what DPOptimizer.step() then applies: SGD's update
    equals lr times it (the harness reads the right tensor)."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer
    model, (x, y) = eq.make("MLP", 8, torch.float64)
    _, op_mean = eq.opacus_side(model, (x, y), max_norm=0.3, noise_multiplier=0.0)
    m = copy.deepcopy(model)
    gsm = GradSampleModule(m)
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.5), noise_multiplier=0.0,
                      max_grad_norm=0.3, expected_batch_size=8)
    before = {k: p.detach().clone() for k, p in m.named_parameters()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=eq.HOOK_WARNING)
        F.cross_entropy(gsm(x), y).backward()
    opt.step()
    step = {k: (before[k] - p.detach()) / 0.5 for k, p in m.named_parameters()}
    _assert_close(step, op_mean, 1e-12, "SGD update / lr vs pre_step's p.grad")
