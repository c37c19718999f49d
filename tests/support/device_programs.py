"""Programs for the device and host-sync audits: every transform, and the models users run.

``PROGRAMS`` maps a name to ``make(lib, device) -> thunk``: the same program written against
``lib`` (``functrans`` or ``torch.func``, which have the same API), its inputs built on
``device``.  The audits (tests/support/device_audit.py, tests/device_audit/) run the functrans
thunk beside the torch.func one: on the fake GPU both must run with the same output shapes,
dtypes and devices; on the CPU functrans must not make the host wait where torch.func does not.
On a real device (the CPU, ``cuda``) the programs run with real values: modules are made on the
CPU from a fixed seed and moved with ``.to(device)``, inputs are drawn on the CPU and moved, so
every device sees the same numbers, and tests/device_audit/test_programs_on_device.py compares
the functrans thunk's values with torch.func's (or, where torch.func cannot run the program,
with ``LOOP_REFERENCES``: the same values by a per-example loop of ``torch.autograd.grad``).
Programs whose values the fake device cannot give (data-dependent shapes) are not here.

Imports: (tests only) torch, functrans, tests.support.device_audit (the fake GPU's name).
"""
from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

Make = Callable[[object, torch.device], Callable[[], object]]
PROGRAMS: Dict[str, Make] = {}
NOT_ON_A_FAKE_DEVICE: Dict[str, str] = {}   # program -> why the fake GPU cannot run it at all
# program -> make(device) -> thunk giving the program's values by a per-example loop, for the
# programs torch.func cannot run (tests/device_audit/test_programs_on_device.py compares with it)
LOOP_REFERENCES: Dict[str, Callable[[torch.device], Callable[[], object]]] = {}


def program(name: str):
    def register(make: Make) -> Make:
        PROGRAMS[name] = make
        return make
    return register


def _build(device, module_class, *args, seed: int = 0):
    """A module made on the CPU (from ``seed``) and moved to ``device`` with its values, or,
    on the fake GPU, with its parameters and buffers remade there (no values)."""
    from tests.support.device_audit import FAKE_GPU
    torch.manual_seed(seed)
    module = module_class(*args)
    if torch.device(device).type == FAKE_GPU:
        return remake_on(module, device)
    return module.to(device)


def _randn(*shape, device):
    """Normal draws made on the CPU (from the global seed) and moved: the same on every device."""
    return torch.randn(*shape).to(device)


def _randint(high, shape, device):
    return torch.randint(0, high, shape).to(device)


def remake_on(module: nn.Module, device) -> nn.Module:
    """``module`` with every parameter and buffer remade (no values) on the fake ``device``
    (``module.to`` cannot move a module to fake tensors: it swaps parameters)."""
    def remake(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)

    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                m._parameters[name] = nn.Parameter(remake(p), p.requires_grad)
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = remake(b)
        if isinstance(m, nn.RNNBase):
            m._init_flat_weights()
    return module


def _mlp(device, sizes=(6, 8, 3), seed=0):
    def mlp():
        layers = []
        for a, b in zip(sizes, sizes[1:]):
            layers += [nn.Linear(a, b), nn.Tanh()]
        return nn.Sequential(*layers[:-1])
    return _build(device, mlp, seed=seed)


def _params(model):
    return {k: v.detach() for k, v in model.named_parameters()}


def _loop_grads(loss, params, *batched):
    """``vmap(grad(loss), in_dims=(None, 0, ...))(params, *batched)`` by a loop over examples
    of ``torch.autograd.grad`` (a reference for programs torch.func cannot run)."""
    per_example = []
    for i in range(len(batched[0])):
        ps = {k: v.detach().requires_grad_() for k, v in params.items()}
        grads = torch.autograd.grad(loss(ps, *[b[i] for b in batched]), list(ps.values()))
        per_example.append(dict(zip(ps, grads)))
    return {k: torch.stack([g[k] for g in per_example]) for k in params}


def _classifier(lib, model):
    buffers = dict(model.named_buffers())

    def loss(p, x, y):
        out = lib.functional_call(model, (p, buffers), (x.unsqueeze(0),))
        return F.cross_entropy(out, y.unsqueeze(0))
    return loss


def _xy(device, batch=4, n_in=6, n_out=3, image=None):
    x = _randn(batch, *(image or (n_in,)), device=device)
    return x, _randint(n_out, (batch,), device=device)


@program("vmap(grad) MLP")
def _(lib, device):
    model = _mlp(device)
    x, y = _xy(device)
    return lambda: lib.vmap(lib.grad(_classifier(lib, model)), in_dims=(None, 0, 0))(
        _params(model), x, y)


@program("grad argnums has_aux, grad_and_value")
def _(lib, device):
    w, x = _randn(3, 4, device=device), _randn(4, device=device)

    def f(w, x):
        h = torch.tanh(w @ x)
        return (h ** 2).sum(), h

    return lambda: (lib.grad(f, argnums=(0, 1), has_aux=True)(w, x),
                    lib.grad_and_value(f, has_aux=True)(w, x))


@program("vjp and vmap(vjp_fn)")
def _(lib, device):
    w, x = _randn(5, 4, device=device), _randn(4, device=device)
    out, vjp_fn = lib.vjp(lambda a: torch.sigmoid(w @ a), x)
    return lambda: (vjp_fn(torch.ones_like(out)), lib.vmap(vjp_fn)(torch.eye(5, device=device)))


@program("jvp, vmap(jvp), linearize")
def _(lib, device):
    x, ts = _randn(4, device=device), _randn(3, 4, device=device)
    f = lambda a: torch.sin(a).cumsum(0) * a.norm()  # noqa: E731

    def run():
        out, jvp_fn = lib.linearize(f, x)
        return (lib.jvp(f, (x,), (ts[0],)),
                lib.vmap(lambda t: lib.jvp(f, (x,), (t,))[1])(ts), out, jvp_fn(ts[1]))
    return run


@program("jacrev jacfwd argnums chunk_size")
def _(lib, device):
    w, x = _randn(3, 4, device=device), _randn(4, device=device)
    f = lambda w, x: torch.tanh(w @ x)  # noqa: E731
    return lambda: (lib.jacrev(f, argnums=(0, 1))(w, x), lib.jacrev(f, chunk_size=2)(w, x),
                    lib.jacfwd(f, argnums=1)(w, x), lib.jacfwd(f, argnums=(0, 1))(w, x))


@program("hessian, vmap(hessian), jacfwd(jacrev)")
def _(lib, device):
    w, xs = _randn(3, 4, device=device), _randn(5, 4, device=device)
    f = lambda x: torch.tanh(w @ x).pow(2).sum()  # noqa: E731
    return lambda: (lib.hessian(f)(xs[0]), lib.vmap(lib.hessian(f))(xs),
                    lib.jacfwd(lib.jacrev(f))(xs[1]))


@program("ensemble: stack_module_state + vmap(functional_call)")
def _(lib, device):
    models = [_mlp(device, seed=seed) for seed in range(3)]
    params, buffers = lib.stack_module_state(models)
    base, x = models[0], _randn(7, 6, device=device)

    def forward(p, b, x):
        return lib.functional_call(base, (p, b), (x,))

    def loss(p, b, x):
        return forward(p, b, x).pow(2).mean()

    return lambda: (lib.vmap(forward, in_dims=(0, 0, None))(params, buffers, x),
                    lib.vmap(lib.grad(loss), in_dims=(0, 0, None))(params, buffers, x))


class _CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(F.max_pool2d(F.relu(self.norm(self.conv(x))), 2).flatten(1))


@program("vmap(grad) CNN (conv, group norm, max pool)")
def _(lib, device):
    model = _build(device, _CNN)
    x, y = _xy(device, image=(1, 8, 8))
    return lambda: lib.vmap(lib.grad(_classifier(lib, model)), in_dims=(None, 0, 0))(
        _params(model), x, y)


class _EmbedNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.norm = nn.LayerNorm(6)
        self.fc = nn.Linear(6, 3)

    def forward(self, tokens):
        return self.fc(self.norm(self.emb(tokens)).mean(1))


@program("vmap(grad) Embedding + LayerNorm")
def _(lib, device):
    model = _build(device, _EmbedNorm)
    tokens = _randint(11, (4, 5), device=device)
    y = _randint(3, (4,), device=device)
    return lambda: lib.vmap(lib.grad(_classifier(lib, model)), in_dims=(None, 0, 0))(
        _params(model), tokens, y)


class _LSTMHead(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.rnn = cell(3, 5, batch_first=True)
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc(self.rnn(x)[0][:, -1])


def _rnn_program(cell):
    def make(lib, device):
        model = _build(device, _LSTMHead, cell)
        x, y = _xy(device, image=(6, 3))
        return lambda: lib.vmap(lib.grad(_classifier(lib, model)), in_dims=(None, 0, 0))(
            _params(model), x, y)
    return make


def _rnn_loop_reference(cell):
    def make(device):
        model = _build(device, _LSTMHead, cell)
        x, y = _xy(device, image=(6, 3))
        import torch.func
        return lambda: _loop_grads(_classifier(torch.func, model), _params(model), x, y)
    return make


program("vmap(grad) LSTM")(_rnn_program(nn.LSTM))
program("vmap(grad) GRU")(_rnn_program(nn.GRU))
LOOP_REFERENCES["vmap(grad) GRU"] = _rnn_loop_reference(nn.GRU)   # torch.func: a shape error
NOT_ON_A_FAKE_DEVICE["vmap(grad) GRU"] = (
    "off the CPU a GRU runs aten._thnn_fused_gru_cell, which has no meta kernel in PyTorch, so "
    "no fake tensor can run it (the per-example loop neither); the GPU session runs it")


@program("vmap with randomness (dropout, randn_like)")
def _(lib, device):
    x = _randn(4, 6, device=device)
    f = lambda a: F.dropout(a, 0.5, training=True) + torch.randn_like(a)  # noqa: E731
    return lambda: (lib.vmap(f, randomness="different")(x), lib.vmap(f, randomness="same")(x))


@program("vmap surface: chunk_size, out_dims, nested in_dims, indexing")
def _(lib, device):
    x, idx = _randn(6, 4, 5, device=device), _randint(5, (6, 3), device=device)
    d = {"a": _randn(6, 4, device=device), "b": _randn(4, device=device)}

    def g(a, i):
        return a[:, i].sum(-1), torch.gather(a, 1, i.expand(4, 3)), a.index_select(1, i)

    return lambda: (lib.vmap(g, chunk_size=4)(x, idx), lib.vmap(torch.sin, out_dims=1)(x),
                    lib.vmap(lambda t: t["a"] * t["b"], in_dims=({"a": 0, "b": None},))(d))


def _checkpointed(device):
    w, xs = _randn(4, 4, device=device), _randn(3, 4, device=device)

    def f(w, x):
        return checkpoint(lambda a: torch.tanh(w @ a), x, use_reentrant=False).sum()
    return f, w, xs


@program("grad through torch.utils.checkpoint")
def _(lib, device):
    f, w, xs = _checkpointed(device)
    return lambda: lib.vmap(lib.grad(f), in_dims=(None, 0))(w, xs)


def _checkpoint_loop_reference(device):
    # torch.func refuses saved-tensor hooks inside grad
    f, w, xs = _checkpointed(device)
    return lambda: _loop_grads(lambda p, x: f(p["w"], x), {"w": w}, xs)["w"]


LOOP_REFERENCES["grad through torch.utils.checkpoint"] = _checkpoint_loop_reference


@program("batch norm in training mode under vmap (replace_all_batch_norm_modules_)")
def _(lib, device):
    model = _build(device, lambda: nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4)))
    import functrans
    functrans.replace_all_batch_norm_modules_(model)
    x = _randn(3, 5, 6, device=device)
    params, buffers = _params(model), dict(model.named_buffers())
    return lambda: lib.vmap(lambda a: lib.functional_call(model, (params, buffers), (a,)))(x)
