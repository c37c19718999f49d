"""The benchmark workloads: each one, written once, for functrans, torch.func, a Python loop and
(where one exists) the hand-batched closed form.

A workload is a ``Workload(name, size, tier, build)``.  ``build(device)`` makes the inputs and
returns a ``Row``: ``impls`` maps an implementation name to a zero-argument callable that does
the whole computation being timed, and ``rtol``/``atol`` say how closely the results must agree.
The functrans and torch.func versions share their code: a workload takes the transforms module
``m`` (``functrans`` or ``torch.func``) as a parameter, so the two differ in nothing but the
library.

Tiers carry the eager targets (functrans / torch.func on CPU, issue 16): ``small`` <= 1.2,
``medium`` <= 1.0; ``large`` rows are reported without a CPU target; a workload's own
``target`` replaces its tier's (the Opacus rows: <= 1.0).  A workload that ``requires`` an
optional package is reported as skipped, with the reason, when the package is missing; one with
``compiled=False`` has no compiled columns.  On a GPU the target is
<= 1.05 for rows whose batch is >= 256 (``gpu_target``).

The compiled columns (``COMPILED``, built by benchmarks/table.py from the functrans callable,
so no workload writes them) carry issue 15's targets, small and medium tiers: replay <= 1.0x
torch.func eager, <= 0.5x on the overhead-bound workloads (``OVERHEAD_BOUND``), <= 0.7x on
per-sample grads MLP and the NTK (``replay_target``); inductor <= 1.1x torch.compile over
torch.func (``INDUCTOR_VS_ANCHOR``); the first calls (trace + first replay) under
``FIRST_CALL_S`` seconds on small rows.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

import functrans as ft

IMPLS = ("functrans", "torch.func", "loop", "closed form")
# functrans.compile(<the functrans callable>, backend=...) per backend; the anchor is
# torch.compile(<the torch.func callable>) (inductor, the whole transformed call), measured in a
# subprocess (benchmarks/anchor.py).
COMPILED = {"ft.compile tiered": "tiered", "ft.compile replay": "replay",
            "ft.compile inductor": "inductor"}
ANCHOR = "torch.compile(torch.func)"
OVERHEAD_BOUND = ("release-notes jacobian", "vmap(jacrev) MLP", "vmap(jacfwd) MLP", "hessian",
                  "vmap(hessian)")
REPLAY_07 = ("per-sample grads MLP", "empirical NTK")
INDUCTOR_VS_ANCHOR = 1.1
FIRST_CALL_S = 0.5
TIERED_FIRST_CALL_S = 0.3       # issue 26: the default's first calls, and <= 0.2x torch.compile's
TIERED_VS_ANCHOR_FIRST = 0.2
LIBS = {"functrans": ft, "torch.func": torch.func}


@dataclasses.dataclass
class Row:
    impls: Dict[str, Callable[[], object]]
    rtol: float = 1e-4
    atol: float = 1e-5


@dataclasses.dataclass
class Workload:
    name: str
    size: str
    tier: str                   # "small" | "medium" | "large"
    build: Callable[[torch.device], Row]
    batch: Optional[int] = None  # the batch a GPU target keys on
    target: Optional[float] = None  # a CPU target of its own, in place of the tier's
    requires: Optional[str] = None  # an optional package the row needs; skipped without it
    compiled: bool = True           # whether the compiled columns apply to this row

    @property
    def id(self) -> str:
        return f"{self.name}[{self.size}]"

    @property
    def cpu_target(self) -> Optional[float]:
        if self.target is not None:
            return self.target
        return {"small": 1.2, "medium": 1.0}.get(self.tier)

    @property
    def replay_target(self) -> Optional[float]:
        """functrans.compile replay / torch.func eager, CPU, small and medium tiers."""
        if self.tier not in ("small", "medium"):
            return None
        return 0.5 if self.name in OVERHEAD_BOUND else 0.7 if self.name in REPLAY_07 else 1.0

    @property
    def gpu_target(self) -> Optional[float]:
        return 1.05 if self.batch is not None and self.batch >= 256 else None


def _both(make: Callable) -> Dict[str, Callable[[], object]]:
    """``make(m)`` for m = functrans and torch.func."""
    return {name: make(m) for name, m in LIBS.items()}


def _randn(*shape, device, scale=1.0):
    return torch.randn(*shape, device=device) * scale


# (a) The PyTorch 1.11 release-notes Jacobian: vmap over vjp_fn against the row loop.

def _release_notes_jacobian(D: int, device) -> Row:
    weight, bias, x = _randn(D, D, device=device), _randn(D, device=device), _randn(D, device=device)

    def predict(weight, bias, x):
        return F.linear(x, weight, bias).tanh()

    unit_vectors = torch.eye(D, device=device)

    def with_lib(m):
        def run():
            _, vjp_fn = m.vjp(functools.partial(predict, weight, bias), x)
            (jac,) = m.vmap(vjp_fn)(unit_vectors)
            return jac
        return run

    def loop():
        xr = x.detach().requires_grad_()
        y = predict(weight, bias, xr)
        return torch.stack([torch.autograd.grad(y, xr, v, retain_graph=True)[0]
                            for v in unit_vectors])

    def closed_form():
        return (1 - predict(weight, bias, x) ** 2)[:, None] * weight

    return Row({**_both(with_lib), "loop": loop, "closed form": closed_form})


# (b) Per-sample gradients: MLP 784-512-256-10 and a small CNN on 28x28.

def _mlp_params(sizes, device, gen_scale=True):
    params = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:]), 1):
        params[f"w{i}"] = _randn(fan_out, fan_in, device=device, scale=fan_in ** -0.5)
        params[f"b{i}"] = _randn(fan_out, device=device, scale=0.1)
    return params


def _mlp(p, x, act=F.relu):
    n = len(p) // 2
    for i in range(1, n):
        x = act(F.linear(x, p[f"w{i}"], p[f"b{i}"]))
    return F.linear(x, p[f"w{n}"], p[f"b{n}"])


def _xent(logits, y):
    return F.cross_entropy(logits.unsqueeze(0), y.unsqueeze(0))


def _per_sample_mlp(batch: int, device) -> Row:
    p = _mlp_params([784, 512, 256, 10], device)
    xs, ys = _randn(batch, 784, device=device), torch.randint(0, 10, (batch,), device=device)

    def loss(p, x, y):
        return _xent(_mlp(p, x), y)

    def with_lib(m):
        g = m.vmap(m.grad(loss), in_dims=(None, 0, 0))
        return lambda: g(p, xs, ys)

    leaves = {k: v.detach().requires_grad_() for k, v in p.items()}

    def loop():
        per = [torch.autograd.grad(loss(leaves, x, y), list(leaves.values()))
               for x, y in zip(xs, ys)]
        return {k: torch.stack([g[i] for g in per]) for i, k in enumerate(leaves)}

    def closed_form():                       # backprop by hand, one outer product per layer
        h1 = F.linear(xs, p["w1"], p["b1"]).relu()
        h2 = F.linear(h1, p["w2"], p["b2"]).relu()
        logits = F.linear(h2, p["w3"], p["b3"])
        d3 = logits.softmax(-1) - F.one_hot(ys, 10).to(logits.dtype)
        d2 = (d3 @ p["w3"]) * (h2 > 0)
        d1 = (d2 @ p["w2"]) * (h1 > 0)
        return {"w1": d1[:, :, None] * xs[:, None, :], "b1": d1,
                "w2": d2[:, :, None] * h1[:, None, :], "b2": d2,
                "w3": d3[:, :, None] * h2[:, None, :], "b3": d3}

    return Row({**_both(with_lib), "loop": loop, "closed form": closed_form})


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 7 * 7, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def _per_sample_cnn(batch: int, device) -> Row:
    model = SmallCNN().to(device)
    p = {k: v.detach() for k, v in model.named_parameters()}
    xs, ys = _randn(batch, 1, 28, 28, device=device), torch.randint(0, 10, (batch,), device=device)

    def with_lib(m):
        def loss(p, x, y):
            return _xent(m.functional_call(model, p, (x.unsqueeze(0),)).squeeze(0), y)
        g = m.vmap(m.grad(loss), in_dims=(None, 0, 0))
        return lambda: g(p, xs, ys)

    params = list(model.parameters())

    def loop():
        per = [torch.autograd.grad(_xent(model(x.unsqueeze(0)).squeeze(0), y), params)
               for x, y in zip(xs, ys)]
        return {k: torch.stack([g[i] for g in per]) for i, (k, _) in enumerate(model.named_parameters())}

    return Row({**_both(with_lib), "loop": loop}, rtol=1e-4, atol=1e-5)


# (c) Batched jacrev and jacfwd of an MLP (tanh, 32 -> 64 -> 64 -> 16).

def _batched_jacobian(kind: str, batch: int, device) -> Row:
    p = _mlp_params([32, 64, 64, 16], device)
    xs = _randn(batch, 32, device=device)

    def f(x):
        return _mlp(p, x, act=torch.tanh)

    def with_lib(m):
        jac = m.vmap(getattr(m, kind)(f))
        return lambda: jac(xs)

    single = getattr(ft, kind)(f)

    def loop():
        return torch.stack([single(x) for x in xs])

    def closed_form():                        # W3 diag(s2') W2 diag(s1') W1, per example
        h1 = F.linear(xs, p["w1"], p["b1"]).tanh()
        h2 = F.linear(h1, p["w2"], p["b2"]).tanh()
        j = (1 - h1 ** 2)[:, :, None] * p["w1"]
        j = (1 - h2 ** 2)[:, :, None] * (p["w2"] @ j)
        return p["w3"] @ j

    return Row({**_both(with_lib), "loop": loop, "closed form": closed_form})


# (d) Hessian of f(x) = sum(tanh(W x + b)), and vmap(hessian) over a batch.

def _hessian_problem(D: int, device):
    W, b = _randn(D, D, device=device, scale=D ** -0.5), _randn(D, device=device, scale=0.1)

    def f(x):
        return torch.tanh(F.linear(x, W, b)).sum()

    def closed(x):                            # W^T diag(-2 t (1 - t^2)) W, t = tanh(Wx + b)
        t = torch.tanh(F.linear(x, W, b))
        s = -2 * t * (1 - t ** 2)
        return (W.mT * s.unsqueeze(-2)) @ W

    return f, closed


def _hessian(D: int, device) -> Row:
    f, closed = _hessian_problem(D, device)
    x = _randn(D, device=device)

    def with_lib(m):
        h = m.hessian(f)
        return lambda: h(x)

    def loop():                                # one Hessian-vector product per row
        xr = x.detach().requires_grad_()
        (g,) = torch.autograd.grad(f(xr), xr, create_graph=True)
        return torch.stack([torch.autograd.grad(g, xr, e, retain_graph=True)[0]
                            for e in torch.eye(D, device=device)])

    return Row({**_both(with_lib), "loop": loop, "closed form": lambda: closed(x)})


def _batched_hessian(batch: int, D: int, device) -> Row:
    f, closed = _hessian_problem(D, device)
    xs = _randn(batch, D, device=device)

    def with_lib(m):
        h = m.vmap(m.hessian(f))
        return lambda: h(xs)

    single = ft.hessian(f)
    return Row({**_both(with_lib), "loop": lambda: torch.stack([single(x) for x in xs]),
                "closed form": lambda: closed(xs)})


# (e) Ensembles of MLPs (64 -> 128 -> 128 -> 10), one shared minibatch of 64: forward and
# per-member parameter gradients.

def _ensemble(n_models: int, what: str, device) -> Row:
    models = [nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                            nn.Linear(128, 10)).to(device) for _ in range(n_models)]
    params, _ = ft.stack_module_state(models)
    params = {k: v.detach() for k, v in params.items()}
    base = models[0]
    x, y = _randn(64, 64, device=device), torch.randint(0, 10, (64,), device=device)

    def with_lib(m):
        def forward(p):
            return m.functional_call(base, p, (x,))
        if what == "forward":
            run = m.vmap(forward)
        else:
            run = m.vmap(m.grad(lambda p: F.cross_entropy(forward(p), y)))
        return lambda: run(params)

    names = list(params)
    # The hand-batched form: the same network written with batched matmuls over stacked weights.
    def batched_forward(p):
        h = x
        for i, layer in enumerate((0, 2, 4)):
            w, b = p[f"{layer}.weight"], p[f"{layer}.bias"]
            h = torch.baddbmm(b.unsqueeze(1), h.expand(n_models, *h.shape) if h.dim() == 2 else h,
                              w.mT)
            if layer != 4:
                h = h.relu()
        return h

    if what == "forward":
        def loop():
            with torch.no_grad():
                return torch.stack([mod(x) for mod in models])

        def closed_form():
            with torch.no_grad():
                return batched_forward(params)
    else:
        def loop():
            per = [torch.autograd.grad(F.cross_entropy(mod(x), y), list(mod.parameters()))
                   for mod in models]
            return {k: torch.stack([g[i] for g in per]) for i, k in enumerate(names)}

        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}

        def closed_form():      # members are independent, so grad of the sum is per member
            out = batched_forward(leaves)
            loss = F.cross_entropy(out.flatten(0, 1), y.repeat(n_models), reduction="none")
            grads = torch.autograd.grad(loss.view(n_models, -1).mean(1).sum(), list(leaves.values()))
            return dict(zip(names, grads))

    return Row({**_both(with_lib), "loop": loop, "closed form": closed_form})


# (f) Empirical NTK of a small MLP (16 -> 64 -> 64 -> 4), Jacobian contraction.

def _ntk(n: int, device) -> Row:
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 4)).to(device)
    p = {k: v.detach() for k, v in model.named_parameters()}
    x1, x2 = _randn(n, 16, device=device), _randn(n, 16, device=device)

    def with_lib(m):
        def f_single(p, x):
            return m.functional_call(model, p, (x.unsqueeze(0),)).squeeze(0)
        jac = m.vmap(m.jacrev(f_single), (None, 0))

        def run():
            j1, j2 = jac(p, x1), jac(p, x2)
            return sum(torch.einsum("Naf,Mbf->NMab", j1[k].flatten(2), j2[k].flatten(2))
                       for k in p)
        return run

    params = list(model.parameters())

    def jac_loop(xs):             # one backward pass per example and output
        rows = []
        for x in xs:
            out = model(x.unsqueeze(0)).squeeze(0)
            rows.append(torch.stack([torch.cat([g.flatten() for g in torch.autograd.grad(
                out[a], params, retain_graph=True)]) for a in range(out.shape[0])]))
        return torch.stack(rows)

    def loop():
        return torch.einsum("Naf,Mbf->NMab", jac_loop(x1), jac_loop(x2))

    return Row({**_both(with_lib), "loop": loop}, rtol=1e-4, atol=1e-4)


# (g) Dispatch overhead: a chain of 100 small ops under vmap.

def _chain(a, c):
    for i in range(20):                 # 5 ops per step: unary, binary, reduction, view, scalar
        a = torch.sin(a)
        a = a * c
        a = a - a.mean(-1, keepdim=True)
        a = a.view(-1)
        a = a + 0.1
    return a


def _dispatch_overhead(batch: int, device) -> Row:
    xs, c = _randn(batch, 16, device=device), _randn(16, device=device)

    def with_lib(m):
        run = m.vmap(_chain, in_dims=(0, None))
        return lambda: run(xs, c)

    def closed_form():                  # the same chain written for the batch by hand
        a = xs
        for i in range(20):
            a = torch.sin(a)
            a = a * c
            a = a - a.mean(-1, keepdim=True)
            a = a.view(batch, -1)
            a = a + 0.1
        return a

    return Row({**_both(with_lib), "loop": lambda: torch.stack([_chain(x, c) for x in xs]),
                "closed form": closed_form})


# (h) Opacus's DP training step with functrans as its per-sample-gradient engine, beside torch.func
# (benchmarks/opacus_rows.py; needs the optional package opacus, imported only when built).  The
# step runs hooks, an optimizer and random noise, so the compiled columns do not apply.

def _opacus_step(kind: str, batch: int, device) -> Row:
    from .opacus_rows import opacus_row
    return opacus_row(kind, batch, device)


def _w(name, size, tier, build, batch=None, **kw):
    return Workload(name, size, tier, build, batch, **kw)


WORKLOADS: List[Workload] = [
    _w("release-notes jacobian", "D=16", "small", functools.partial(_release_notes_jacobian, 16)),
    _w("release-notes jacobian", "D=256", "medium", functools.partial(_release_notes_jacobian, 256), 256),
    _w("release-notes jacobian", "D=1024", "large", functools.partial(_release_notes_jacobian, 1024), 1024),
    _w("per-sample grads MLP", "B=64", "small", functools.partial(_per_sample_mlp, 64), 64),
    _w("per-sample grads MLP", "B=256", "medium", functools.partial(_per_sample_mlp, 256), 256),
    _w("per-sample grads MLP", "B=1024", "large", functools.partial(_per_sample_mlp, 1024), 1024),
    _w("per-sample grads CNN", "B=64", "small", functools.partial(_per_sample_cnn, 64), 64),
    _w("per-sample grads CNN", "B=256", "medium", functools.partial(_per_sample_cnn, 256), 256),
    _w("vmap(jacrev) MLP", "B=16", "small", functools.partial(_batched_jacobian, "jacrev", 16)),
    _w("vmap(jacrev) MLP", "B=256", "medium", functools.partial(_batched_jacobian, "jacrev", 256), 256),
    _w("vmap(jacfwd) MLP", "B=16", "small", functools.partial(_batched_jacobian, "jacfwd", 16)),
    _w("vmap(jacfwd) MLP", "B=256", "medium", functools.partial(_batched_jacobian, "jacfwd", 256), 256),
    _w("hessian", "D=64", "small", functools.partial(_hessian, 64)),
    _w("hessian", "D=256", "medium", functools.partial(_hessian, 256), 256),
    _w("vmap(hessian)", "B=16 D=32", "small", functools.partial(_batched_hessian, 16, 32)),
    _w("vmap(hessian)", "B=256 D=32", "medium", functools.partial(_batched_hessian, 256, 32), 256),
    _w("ensemble forward", "8 MLPs", "small", functools.partial(_ensemble, 8, "forward")),
    _w("ensemble forward", "32 MLPs", "medium", functools.partial(_ensemble, 32, "forward")),
    _w("ensemble grad", "8 MLPs", "small", functools.partial(_ensemble, 8, "grad")),
    _w("ensemble grad", "32 MLPs", "medium", functools.partial(_ensemble, 32, "grad")),
    _w("empirical NTK", "N=8", "small", functools.partial(_ntk, 8)),
    _w("empirical NTK", "N=64", "medium", functools.partial(_ntk, 64)),
    _w("100-op chain (dispatch overhead)", "B=8", "small", functools.partial(_dispatch_overhead, 8)),
    _w("100-op chain (dispatch overhead)", "B=256", "medium", functools.partial(_dispatch_overhead, 256), 256),
    _w("Opacus step CNN", "B=64", "small", functools.partial(_opacus_step, "CNN", 64), 64,
       target=1.0, requires="opacus", compiled=False),
    _w("Opacus step LSTM", "B=32 T=16", "small", functools.partial(_opacus_step, "LSTM", 32), 32,
       target=1.0, requires="opacus", compiled=False),
]
