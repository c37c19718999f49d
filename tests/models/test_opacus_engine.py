"""functrans.nn.opacus_engine: Opacus's GradSampleModule computes with functrans the per-sample
gradients of the layers it has no grad sampler for.

Two layers Opacus does not know: a custom layer whose parameter enters nonlinearly
(``x * scale.tanh() + x``) and a GRU encoder with a learned initial state (``nn.GRU`` inside a
module with a parameter of its own, so that GradSampleModule hooks the encoder as one layer; it
returns a tensor).  Through ``GradSampleModule`` with the adapter, their per-sample gradients
equal a per-example loop of ``torch.autograd.grad``; on the custom layer they also equal Opacus's
own torch.func path; on the GRU Opacus's torch.func path fails (vmap of nn.GRU), which is what
the adapter is for.  The engine's call counter and ``functrans_layers()`` show that functrans
did the work; Opacus's own functions are back after the block / ``uninstall()``.
"""
from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from functrans.errors import MissingDependencyError, TransformArgumentError
from functrans.nn import opacus_engine
from functrans.nn.dp import dp_sgd_grads

HOOK_WARNING = "Full backward hook is firing when gradients"
NAMES = ("vmap", "grad", "make_functional")


@pytest.fixture
def ofunctorch():
    pytest.importorskip("opacus")
    from opacus.grad_sample import functorch
    before = {n: getattr(functorch, n) for n in NAMES}
    yield functorch
    opacus_engine.uninstall()
    assert {n: getattr(functorch, n) for n in NAMES} == before, "Opacus's names not restored"


class ScaleTanh(nn.Module):
    """A custom layer: its parameter enters through tanh."""

    def __init__(self, n: int):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(n))

    def forward(self, x):
        return x * self.scale.tanh() + x


class GRUEncoder(nn.Module):
    """nn.GRU with a learned initial state; returns the last step's output."""

    def __init__(self, n_in: int = 5, hidden: int = 6):
        super().__init__()
        self.gru = nn.GRU(n_in, hidden, batch_first=True)
        self.h0 = nn.Parameter(0.1 * torch.randn(1, 1, hidden))

    def forward(self, x):
        h0 = self.h0.expand(1, x.shape[0], -1).contiguous()
        return self.gru(x, h0)[0][:, -1]


def _custom_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), ScaleTanh(8), nn.ReLU(), nn.Linear(8, 3)).double()
    return model, torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))


def _gru_model():
    torch.manual_seed(0)
    model = nn.Sequential(GRUEncoder(), nn.Linear(6, 3)).double()
    return model, torch.randn(5, 4, 5, dtype=torch.float64), torch.randint(0, 3, (5,))


def _loop(model, x, y):
    named = list(model.named_parameters())
    rows = [torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]),
                                [p for _, p in named]) for i in range(x.shape[0])]
    return {k: torch.stack([r[j] for r in rows]) for j, (k, _) in enumerate(named)}


def _grad_samples(gsm, x, y):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=HOOK_WARNING)
        F.cross_entropy(gsm(x), y).backward()
    return {k: p.grad_sample for k, p in gsm._module.named_parameters()}


def _close(a, b, what):
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].shape == b[k].shape, f"{what}: {k} shape {a[k].shape} vs {b[k].shape}"
        torch.testing.assert_close(a[k], b[k], rtol=1e-10, atol=1e-12, msg=f"{what}: {k}")


def test_custom_layer_equals_the_loop_and_opacus_torch_func(ofunctorch):
    from opacus import GradSampleModule
    model, x, y = _custom_model()
    with opacus_engine.use_functrans() as engine:
        assert ofunctorch.vmap.__self__ is engine and engine.active
        gsm = GradSampleModule(copy.deepcopy(model))
    assert not engine.active
    assert opacus_engine.functrans_layers(gsm) == ["1"]   # the custom layer; Linear: Opacus's
    assert opacus_engine.functrans_layers(gsm._module) == ["1"]
    assert engine.layers_prepared == 1 and engine.calls == 0
    ours = _grad_samples(gsm, x, y)
    assert engine.calls == 1      # the custom layer's per-sample gradients came from functrans

    theirs = _grad_samples(GradSampleModule(copy.deepcopy(model)), x, y)   # torch.func
    assert engine.calls == 1
    _close(ours, _loop(model, x, y), "functrans engine vs the per-example loop")
    _close(ours, theirs, "functrans engine vs Opacus's torch.func")


def test_force_functorch_runs_every_layer_on_functrans(ofunctorch):
    from opacus import GradSampleModule
    model, x, y = _custom_model()
    with opacus_engine.use_functrans() as engine:
        gsm = GradSampleModule(copy.deepcopy(model), force_functorch=True)
    assert opacus_engine.functrans_layers(gsm) == ["0", "1", "3"]
    ours = _grad_samples(gsm, x, y)
    assert engine.calls == 3
    closed_form = _grad_samples(GradSampleModule(copy.deepcopy(model)), x, y)
    _close(ours, closed_form, "functrans for every layer vs Opacus's grad samplers")


def test_gru_equals_the_loop_where_opacus_torch_func_fails(ofunctorch):
    from opacus import GradSampleModule
    model, x, y = _gru_model()
    with opacus_engine.use_functrans() as engine:
        gsm = GradSampleModule(copy.deepcopy(model))
    assert opacus_engine.functrans_layers(gsm) == ["0"]   # the encoder, GRU inside, one layer
    ours = _grad_samples(gsm, x, y)
    assert engine.calls == 1
    assert ours["0.gru.weight_hh_l0"].shape == (5, 18, 6)
    _close(ours, _loop(model, x, y), "GRU through the functrans engine vs the loop")

    # Opacus's own functorch path cannot batch nn.GRU: the reason for the adapter
    with pytest.raises(RuntimeError, match="broadcast shape"):
        _grad_samples(GradSampleModule(copy.deepcopy(model)), x, y)


def test_opacus_dp_step_on_functrans_equals_dp_sgd_grads(ofunctorch):
    """A whole DPOptimizer step (clipping, seeded noise, mean) with the engine gives
    functrans.nn.dp.dp_sgd_grads's gradient on the same model and seed."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer
    model, x, y = _gru_model()
    engine = opacus_engine.install()
    assert opacus_engine.install() is engine and opacus_engine.installed() is engine
    gsm = GradSampleModule(copy.deepcopy(model))
    opacus_engine.uninstall()
    assert opacus_engine.installed() is None and not engine.active
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.1), noise_multiplier=0.8,
                      max_grad_norm=0.2, expected_batch_size=5,
                      generator=torch.Generator().manual_seed(11))
    _grad_samples(gsm, x, y)   # prepared under install(): still functrans after uninstall()
    assert engine.calls == 1 and opt.pre_step()
    theirs = {k: p.grad for k, p in gsm._module.named_parameters()}
    ours = dp_sgd_grads(model, F.cross_entropy, (x, y), max_norm=0.2, noise_multiplier=0.8,
                        seed=11, reduction="mean")
    _close(ours, theirs, "DPOptimizer on the functrans engine vs dp_sgd_grads")


def test_the_block_restores_opacus_on_error_and_is_not_reentrant(ofunctorch):
    saved = {n: getattr(ofunctorch, n) for n in NAMES}
    engine = opacus_engine.use_functrans()
    with pytest.raises(ValueError, match="inside"):
        with engine:
            assert all(getattr(ofunctorch, n) is not saved[n] for n in NAMES)
            raise ValueError("inside")
    assert {n: getattr(ofunctorch, n) for n in NAMES} == saved
    with engine:
        with pytest.raises(TransformArgumentError, match="not re-entrant"):
            engine.__enter__()
        with opacus_engine.use_functrans() as inner:   # a distinct engine nests
            assert ofunctorch.vmap.__self__ is inner
        assert ofunctorch.vmap.__self__ is engine
    assert {n: getattr(ofunctorch, n) for n in NAMES} == saved
    assert "inactive" in repr(engine)


def test_without_opacus_the_error_says_what_to_install(monkeypatch):
    for name in ("opacus", "opacus.grad_sample", "opacus.grad_sample.functorch"):
        monkeypatch.setitem(sys.modules, name, None)   # as if not installed: import fails
    with pytest.raises(MissingDependencyError, match=r"pip install functrans\[dp\]"):
        opacus_engine.use_functrans().__enter__()
    with pytest.raises(ImportError, match="--no-deps opacus==1.6.0"):
        opacus_engine.install()
    assert opacus_engine.installed() is None
    assert opacus_engine.functrans_layers(nn.Linear(2, 2)) == []
