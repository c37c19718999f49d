"""Model ensembling (issue 5, item 5): ``stack_module_state`` + ``vmap`` over the stacked
parameters of N real ``nn`` modules, against loops over the N models.

* forward with one shared minibatch (``in_dims=(0, 0, None)``) and one minibatch per member
  (``in_dims=(0, 0, 0)``), for an MLP, a CNN and an LSTM;
* training: the ensemble's summed loss (computed with vmap) ``.backward()``-ed into the stacked
  leaves and one torch optimizer (SGD with momentum, Adam) stepping them equals N optimizers
  stepping N models (parameters compared after 2 steps);
* BatchNorm: stacked buffers, and train mode updates each member's running statistics.

All vmapped calls run strict (``config.strict_fallback()``): no loop fallback.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import functrans as ft
from tests.support.oracles import assert_same

TOL = dict(rtol=1e-4, atol=1e-5)
N = 3  # ensemble members

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")

functional_call, stack_module_state = ft.functional_call, ft.stack_module_state


class _CNN(nn.Module):
    def __init__(self, norm=None):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4) if norm == "batch" else nn.Identity()
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(4 * 3 * 3, 3)

    def forward(self, x):
        return self.fc(self.pool(F.relu(self.norm(self.conv(x)))).flatten(1))


class _LSTMHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.fc(out[:, -1])


MODELS = {
    "mlp": (lambda: nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)), (5,)),
    "cnn": (lambda: _CNN(), (2, 6, 6)),
    "lstm": (lambda: _LSTMHead(), (4, 3)),  # [T, F], batch_first
}


def _ensemble(kind, device, n=N):
    make, example_shape = MODELS[kind]
    models = [make().to(device) for _ in range(n)]
    return models, example_shape


def _fmodel(base):
    return lambda params, buffers, x: functional_call(base, (params, buffers), (x,))


def _meta_copy(model):
    return copy.deepcopy(model).to("meta")


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("shared_batch", [True, False], ids=["shared", "per_member"])
def test_ensemble_forward(device, kind, shared_batch):
    torch.manual_seed(0)
    models, shape = _ensemble(kind, device)
    params, buffers = stack_module_state(models)
    assert all(v.shape[0] == N for v in params.values())
    if shared_batch:
        x = torch.randn(2, *shape, device=device)
        dims, member_inputs = (0, 0, None), [x] * N
    else:
        xs = torch.randn(N, 2, *shape, device=device)
        dims, member_inputs = (0, 0, 0), list(xs)
        x = xs
    # the stateless base is a meta copy, as in the torch.func tutorial: the stacked state is
    # all that functional_call may read
    with ft.config.strict_fallback():
        got = ft.vmap(_fmodel(_meta_copy(models[0])), in_dims=dims)(params, buffers, x)
    with torch.no_grad():
        expected = torch.stack([m(xi) for m, xi in zip(models, member_inputs)])
    assert_same(got.detach(), expected, **TOL)
    assert not torch.allclose(got[0], got[1])  # the members differ
    if kind != "lstm":  # torch.func agrees too (its LSTM ensemble takes a slow fallback)
        ref = torch.func.vmap(_fmodel(_meta_copy(models[0])), in_dims=dims)(params, buffers, x)
        assert_same(got.detach(), ref.detach(), **TOL)


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.05),
}


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_ensemble_training_steps_match_separate_optimizers(device, kind, opt):
    torch.manual_seed(1)
    models, shape = _ensemble(kind, device)
    params, buffers = stack_module_state(models)
    assert all(v.is_leaf and v.requires_grad for v in params.values())
    xs = torch.randn(N, 2, *shape, device=device)
    ys = torch.randint(0, 3, (N, 2), device=device)
    base = _meta_copy(models[0])
    initial = {k: v.detach().clone() for k, v in params.items()}

    def member_loss(p, b, x, y):
        return F.cross_entropy(functional_call(base, (p, b), (x,)), y)

    ensemble_opt = OPTIMIZERS[opt](list(params.values()))
    member_opts = [OPTIMIZERS[opt](m.parameters()) for m in models]
    for step in range(2):
        ensemble_opt.zero_grad()
        with ft.config.strict_fallback():
            losses = ft.vmap(member_loss)(params, buffers, xs, ys)
        losses.sum().backward()
        ensemble_opt.step()
        for i, (m, o) in enumerate(zip(models, member_opts)):
            o.zero_grad()
            loss_i = F.cross_entropy(m(xs[i]), ys[i])
            loss_i.backward()
            o.step()
            torch.testing.assert_close(losses[i].detach(), loss_i.detach(), **TOL)
    for name, stacked in params.items():
        expected = torch.stack([dict(m.named_parameters())[name].detach() for m in models])
        assert_same(stacked.detach(), expected, msg=name, **TOL)
    # the steps really moved every parameter
    assert all(not torch.allclose(params[k], initial[k]) for k in params)


@pytest.mark.parametrize("shared_batch", [True, False], ids=["shared", "per_member"])
def test_batch_norm_ensemble_updates_each_members_running_stats(device, shared_batch):
    torch.manual_seed(2)
    models = [_CNN("batch").to(device).train() for _ in range(N)]
    params, buffers = stack_module_state(models)
    assert set(buffers) == {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}
    assert buffers["norm.running_mean"].shape == (N, 4)
    before = {k: v.clone() for k, v in buffers.items()}
    xs = torch.randn(N, 5, 2, 6, 6, device=device)
    x, dims = (xs[0], (0, 0, None)) if shared_batch else (xs, (0, 0, 0))
    fmodel = _fmodel(_meta_copy(models[0]).train())
    with ft.config.strict_fallback():
        for _ in range(2):
            got = ft.vmap(fmodel, in_dims=dims)(params, buffers, x)
    with torch.no_grad():
        for _ in range(2):
            expected = torch.stack([m(xs[0] if shared_batch else xs[i])
                                    for i, m in enumerate(models)])
    assert_same(got.detach(), expected, **TOL)
    for name, stacked in buffers.items():
        per_model = torch.stack([dict(m.named_buffers())[name] for m in models])
        assert_same(stacked, per_model, msg=name, **TOL)
    assert not torch.allclose(buffers["norm.running_mean"], before["norm.running_mean"])
    assert torch.equal(buffers["norm.num_batches_tracked"],
                       before["norm.num_batches_tracked"] + 2)
    # the members' running statistics differ from each other (each saw its own activations)
    assert not torch.allclose(buffers["norm.running_var"][0], buffers["norm.running_var"][1])


def test_batch_norm_ensemble_eval_uses_each_members_stats(device):
    torch.manual_seed(3)
    models = [_CNN("batch").to(device) for _ in range(N)]
    with torch.no_grad():  # distinct running statistics per member
        for m in models:
            m(torch.randn(4, 2, 6, 6, device=device))
            m.eval()
    params, buffers = stack_module_state(models)
    x = torch.randn(2, 2, 6, 6, device=device)
    with ft.config.strict_fallback():
        got = ft.vmap(_fmodel(_meta_copy(models[0]).eval()), in_dims=(0, 0, None))(
            params, buffers, x)
    with torch.no_grad():
        expected = torch.stack([m(x) for m in models])
    assert_same(got.detach(), expected, **TOL)
