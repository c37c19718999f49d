"""The Opacus rows: one differentially private training step of Opacus 1.6 with functrans as its
per-sample-gradient engine, beside the same step with torch.func (Opacus's own engine).

Opacus's ``GradSampleModule(model, force_functorch=True)`` computes every layer's per-sample
gradients in opacus/grad_sample/functorch.py: ``prepare_layer`` builds, once per layer,
``vmap(grad(loss), in_dims=(None, 0, 0))`` from the module-level names ``vmap`` and ``grad``
(imported from torch.func) over a stateless copy of the layer made by ``make_functional`` (which
calls ``torch.func.functional_call``), and the backward hooks call it on the layer's captured
activations and backprops.  ``FunctransEngine()`` points those three names at functrans for
the duration of a ``with`` block and puts Opacus's own back afterwards; it edits no Opacus file.
Because ``prepare_layer`` binds the names when the ``GradSampleModule`` is built, the functrans
model is built inside the block and each of its timed steps runs inside it too; the torch.func
model is built and run outside it.  Every per-sample-gradient function built inside the block
counts its calls (``FunctransEngine.calls``), so the check can see that functrans did the work.
The mechanism is the package's public adapter, ``functrans.nn.opacus_engine`` (its
``FunctransEngine`` is what ``use_functrans()`` returns); this module only uses it.

A step (what is timed) is the whole of Opacus's training step: ``optimizer.zero_grad()``, the
``GradSampleModule`` forward, the loss, ``loss.backward()`` (the hooks compute the per-sample
gradients), and ``DPOptimizer.step()`` (per-sample clipping to ``MAX_GRAD_NORM``, Gaussian
noise, the SGD update).  The noise comes from a generator re-seeded every step, so the two
engines' steps are comparable: a step returns the per-sample gradients and the updated
parameters, checked equal between the engines.  The ``closed form`` column is Opacus's default
mode, its hand-written per-layer grad samplers (einsum closed forms; no vmap).

Workloads: a small CNN (conv, relu, max-pool, linear; 1x28x28 inputs, B=64) and a DPLSTM
(Opacus's LSTM made of ``RNNLinear`` layers, whose hooks run once per time step; input 16,
hidden 32, B=32, sequence 16) with a linear head on the last step.  Opacus is optional: without
it benchmarks/table.py reports the rows as skipped, with ``MISSING`` as the reason.
"""
from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from functrans.nn.opacus_engine import OPACUS_VERSION, FunctransEngine

from .workloads import Row, SmallCNN as OpacusCNN   # no buffers, as Opacus requires

MISSING = (f"opacus is not installed (bash scripts/setup.sh bench, or .venv/bin/pip install "
           f"--no-deps opacus=={OPACUS_VERSION} scipy opt_einsum)")   # scripts/setup.sh's pin
NOISE_MULTIPLIER = 1.0
MAX_GRAD_NORM = 1.0
LR = 0.05


class OpacusLSTM(nn.Module):
    """Opacus's DPLSTM (batch first) and a linear head on the last time step."""

    def __init__(self, n_in=16, hidden=32, n_out=10):
        super().__init__()
        from opacus.layers import DPLSTM
        self.lstm = DPLSTM(n_in, hidden, batch_first=True)
        self.head = nn.Linear(hidden, n_out)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def _step_fn(model: nn.Module, xs, ys, engine: Optional[str], batch: int
             ) -> Callable[[], Dict[str, Dict[str, torch.Tensor]]]:
    """One Opacus training step on a private copy of ``model``: engine ``"functrans"``,
    ``"torch.func"`` (both ``force_functorch=True``) or None (Opacus's hand-written samplers)."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    model = copy.deepcopy(model)
    ctx = FunctransEngine() if engine == "functrans" else contextlib.nullcontext()
    with ctx:
        gsm = GradSampleModule(model, force_functorch=engine is not None)
    gen = torch.Generator(device=xs.device)
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=LR),
                      noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=MAX_GRAD_NORM,
                      expected_batch_size=batch, generator=gen)
    named = list(gsm._module.named_parameters())

    engine_obj = ctx if engine == "functrans" else None
    built = [m.ft_compute_sample_grad for m in gsm.modules()
             if hasattr(m, "ft_compute_sample_grad")]
    if engine is not None and not built:
        raise AssertionError(f"{engine}: Opacus prepared no layer in its functorch mode")
    if any(getattr(f, "functrans_engine", None) is not engine_obj for f in built):
        raise AssertionError(f"{engine}: a layer's per-sample-gradient function was built by "
                             f"the other engine")

    def step():
        calls = engine_obj.calls if engine_obj is not None else 0
        with ctx:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(gsm(xs), ys)
            loss.backward()
            grad_samples = {k: p.grad_sample for k, p in named}
            gen.manual_seed(0)
            opt.step()
        if engine_obj is not None and engine_obj.calls == calls:
            raise AssertionError("functrans: the step made no call to functrans's per-sample "
                                 "gradients; Opacus did not use the engine")
        return {"grad_sample": grad_samples,
                "params": {k: p.detach().clone() for k, p in named}}

    step.engine = engine_obj
    return step


def opacus_row(kind: str, batch: int, device) -> Row:
    """The Row for ``kind`` in ("CNN", "LSTM"): functrans, torch.func and Opacus's closed form."""
    if kind == "CNN":
        model = OpacusCNN().to(device)
        xs = torch.randn(batch, 1, 28, 28, device=device)
    else:
        model = OpacusLSTM().to(device)
        xs = torch.randn(batch, 16, 16, device=device)
    ys = torch.randint(0, 10, (batch,), device=device)
    # Opacus's hooks are full backward hooks on layers whose inputs need no gradient (the data):
    # PyTorch warns about it once; it is how Opacus always runs.
    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients")
    impls = {"functrans": _step_fn(model, xs, ys, "functrans", batch),
             "torch.func": _step_fn(model, xs, ys, "torch.func", batch),
             "closed form": _step_fn(model, xs, ys, None, batch)}
    return Row(impls, rtol=1e-4, atol=1e-5)
