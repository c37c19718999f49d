"""Ghost clipping (``dp_sgd_grads(..., method="ghost")``, functrans/nn/dp_ghost.py): the same
clipped sums and per-example norms as ``method="materialize"`` without per-example gradients
of the whole model.

References: ``method="materialize"`` (itself checked against a per-example loop and Opacus in
test_dpsgd.py / test_opacus_equivalence.py) and, for a few models, a per-example loop of
``torch.autograd.grad`` written out here.  Tolerances: relative to the largest entry, 1e-5 in
float32 and 1e-12 in float64.  ``max_norm`` is the median per-example norm, so that some
examples are clipped and some are not.  Models: every layer kind with a factorised kernel
(Linear with and without positions per example, Conv1d/2d/3d with groups, dilation, stride,
string padding and padding modes, Embedding with padding_idx, LayerNorm, GroupNorm, RMSNorm),
the fallbacks (nn.LSTM batch-first and seq-first, BatchNorm in eval mode, a custom module, one
returning a tensor twice, a module called twice, Opacus's DPLSTM, MultiheadAttention whose
out_proj weight is read by its parent, tied weights, a positional embedding of arange(T), an
unused layer), the models of test_dpsgd.py and test_opacus_equivalence.py, frozen parameters,
zero gradients, B = 0 and B = 1, the compiled step, the errors.  Two processes (the clipped
sums all-reduced; DDP with ``surrogate_loss``) with ``method="ghost"``: the ``*_ghost`` modes of
tests/models/dp_worker.py, run by test_dpsgd.py's ``test_two_processes_equal_one_process``.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from functrans.errors import TransformArgumentError
from functrans.nn.dp import (CLIP_EPS, compiled_private_step, dp_sgd_grads,
                             per_sample_grads)

RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}
N_CLASSES = 5


def _rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    scale = max(max(v.abs().max().item() for v in b.values()), 1e-30)
    return max((a[k] - b[k]).abs().max().item() for k in a) / scale


class Net(nn.Module):
    """``body`` (any module) -> flatten after dim 0 -> a linear head to N_CLASSES."""

    def __init__(self, body: nn.Module, width: int):
        super().__init__()
        self.body, self.head = body, nn.Linear(width, N_CLASSES)

    def forward(self, x):
        return self.head(self.body(x).flatten(1))


class Twice(nn.Module):
    """One Linear applied twice (its parameters are used by two calls)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.head = nn.Linear(6, N_CLASSES)

    def forward(self, x):
        return self.head(self.lin(torch.tanh(self.lin(x))))


class Scaled(nn.Module):
    """A custom module with its own parameter around a Linear child."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.scale = nn.Parameter(torch.randn(8))
        self.head = nn.Linear(8, N_CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x) * self.scale))


class Dup(nn.Module):
    """A custom module that returns one tensor twice."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6))

    def forward(self, x):
        y = x * self.w
        return y, y


class ReturnsTwice(nn.Module):
    """Both of Dup's outputs used downstream."""

    def __init__(self):
        super().__init__()
        self.dup = Dup()
        self.head = nn.Linear(6, N_CLASSES)

    def forward(self, x):
        a, b = self.dup(x)
        return self.head(torch.tanh(a) + 2 * b)


class LSTMNet(nn.Module):
    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.lstm = nn.LSTM(4, 6, batch_first=batch_first)
        self.head = nn.Linear(6, N_CLASSES)

    def forward(self, x):   # x: [B, T, 4]
        if not self.batch_first:
            return self.head(self.lstm(x.transpose(0, 1))[0][-1])
        return self.head(self.lstm(x)[0][:, -1])


class SeqFirstAttention(nn.Module):
    """MultiheadAttention (sequence first) and Linear / LayerNorm on [T, B, E] tensors;
    MHA's forward reads its out_proj's weight itself (a parameter used outside its owner's
    call: the whole-model fallback)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.attn = nn.MultiheadAttention(8, 2)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, N_CLASSES)

    def forward(self, x):   # x: [B, T, 4]
        h = self.inp(x.transpose(0, 1))
        h = self.norm(h + self.attn(h, h, h, need_weights=False)[0])
        return self.head(h.mean(0))


class TiedLM(nn.Module):
    """An embedding whose weight is also the output layer's: tied by registration (``head``)
    or read in the parent's forward (``read``)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(N_CLASSES, 6)
        self.mix = nn.Linear(6, 6)
        if how == "head":
            self.head = nn.Linear(6, N_CLASSES, bias=False)
            self.head.weight = self.emb.weight

    def forward(self, x):   # x: [B, T] tokens
        h = torch.tanh(self.mix(self.emb(x))).mean(1)
        return self.head(h) if self.how == "head" else h @ self.emb.weight.T


class Positional(nn.Module):
    """A positional embedding of arange(T): its output is the same for every example."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(N_CLASSES, 6)
        self.pos = nn.Embedding(4, 6)
        self.unused = nn.Linear(6, 6)   # never called: a zero gradient for every example
        self.head = nn.Linear(6, N_CLASSES)

    def forward(self, x):   # x: [B, 4] tokens
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        return self.head(torch.tanh(h).mean(1))


def _tokens(vocab, t):
    return lambda b, g: torch.randint(0, vocab, (b, t), generator=g)


def _randn(*shape):
    return lambda b, g: torch.randn(b, *shape, generator=g)


# name -> (model factory, input maker)
MODELS = {
    "mlp": (lambda: nn.Sequential(nn.Linear(7, 10), nn.ReLU(), nn.Linear(10, N_CLASSES)),
            _randn(7)),
    "linear-positions-gram": (lambda: Net(nn.Sequential(nn.Linear(4, 6), nn.Tanh()), 18),
                              _randn(3, 4)),
    "linear-positions-materialized": (lambda: Net(nn.Sequential(nn.Linear(2, 2), nn.Tanh()),
                                                  40), _randn(20, 2)),
    "conv2d": (lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                     nn.Flatten(), nn.Linear(27, N_CLASSES)),
               _randn(2, 6, 6)),
    "conv2d-groups-reflect-same-dilated": (
        lambda: Net(nn.Conv2d(4, 6, 3, padding="same", dilation=2, groups=2,
                              padding_mode="reflect"), 6 * 25), _randn(4, 5, 5)),
    "conv2d-strided-gram": (lambda: Net(nn.Conv2d(3, 4, 2, stride=2, bias=False), 4 * 4),
                            _randn(3, 4, 4)),
    "conv1d-strided-dilated": (lambda: Net(nn.Conv1d(3, 4, 3, stride=2, dilation=2,
                                                     padding=2), 4 * 5), _randn(3, 10)),
    "conv3d-circular": (lambda: Net(nn.Conv3d(2, 2, 2, padding=1, padding_mode="circular"),
                                    2 * 4 * 4 * 4), _randn(2, 3, 3, 3)),
    "embedding-padding-gram": (lambda: Net(nn.Embedding(30, 4, padding_idx=0), 7 * 4),
                               _tokens(30, 7)),
    "embedding-materialized": (lambda: Net(nn.Embedding(3, 2), 9 * 2), _tokens(3, 9)),
    "layernorm-2d-no-bias": (lambda: Net(nn.Sequential(nn.Linear(4, 6), nn.Unflatten(-1, (2, 3)),
                                                       nn.LayerNorm((2, 3), bias=False)), 3 * 6),
                             _randn(3, 4)),
    "groupnorm": (lambda: Net(nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4)), 4 * 9),
                  _randn(2, 5, 5)),
    "rmsnorm": (lambda: Net(nn.Sequential(nn.Linear(4, 6), nn.RMSNorm(6)), 3 * 6), _randn(3, 4)),
    "batchnorm-eval": (lambda: Net(nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3).eval()),
                                   3 * 9), _randn(2, 5, 5)),
    "module-called-twice": (Twice, _randn(6)),
    "custom-module": (Scaled, _randn(6)),
    "custom-module-returns-twice": (ReturnsTwice, _randn(6)),
    "lstm-batch-first": (lambda: LSTMNet(True), _randn(5, 4)),
    "lstm-seq-first": (lambda: LSTMNet(False), _randn(5, 4)),
    "attention-seq-first": (SeqFirstAttention, _randn(5, 4)),
    "tied-head": (lambda: TiedLM("head"), _tokens(N_CLASSES, 4)),
    "tied-read-in-parent": (lambda: TiedLM("read"), _tokens(N_CLASSES, 4)),
    "positional-and-unused": (Positional, _tokens(N_CLASSES, 4)),
}


def _problem(name: str, dtype=torch.float64, b: int = 6, seed: int = 0):
    torch.manual_seed(seed)
    make, inputs = MODELS[name]
    model = make().to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = inputs(b, g)
    x = x.to(dtype) if x.is_floating_point() else x
    return model, (x, torch.randint(0, N_CLASSES, (b,), generator=g))


def _median_norm(model, batch) -> float:
    per = per_sample_grads(model, F.cross_entropy, batch)
    b = batch[0].shape[0]
    return torch.stack([g.reshape(b, -1).square().sum(1) for g in per.values()]).sum(0) \
        .sqrt().median().item()


def _both(model, batch, max_norm, **kw):
    kw = dict(max_norm=max_norm, noise_multiplier=0.0, return_norms=True, **kw)
    return (dp_sgd_grads(model, F.cross_entropy, batch, method="ghost", **kw),
            dp_sgd_grads(model, F.cross_entropy, batch, **kw))


# float32 on one model of each kernel and fallback kind (float64 on all of them)
F32 = ["mlp", "linear-positions-gram", "conv2d-groups-reflect-same-dilated",
       "embedding-padding-gram", "groupnorm", "lstm-seq-first", "attention-seq-first",
       "tied-head"]
CASES = [pytest.param(name, torch.float64, id=f"{name}-f64") for name in MODELS] + \
    [pytest.param(name, torch.float32, id=f"{name}-f32") for name in F32]


@pytest.mark.parametrize("name,dtype", CASES)
def test_ghost_equals_materialize(name, dtype):
    model, batch = _problem(name, dtype)
    c = _median_norm(model, batch)
    (ghost, g_norms), (mat, m_norms) = _both(model, batch, c)
    assert _rel(ghost, mat) <= RTOL[dtype], f"{name}: clipped sums differ by {_rel(ghost, mat)}"
    assert ((g_norms - m_norms).abs().max() / m_norms.max()).item() <= RTOL[dtype]
    assert (m_norms > c * 1.0001).any() and (m_norms < c * 0.9999).any()   # both branches


def _loop(model, batch, max_norm):
    """The recipe per example with torch.autograd.grad: the clipped sum and the norms."""
    x, y = batch
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    total = {k: torch.zeros_like(p) for k, p in named}
    norms = []
    for i in range(x.shape[0]):
        g = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]),
                                [p for _, p in named], allow_unused=True)
        g = [torch.zeros_like(p) if gi is None else gi for gi, (_, p) in zip(g, named)]
        norm = torch.sqrt(sum((gi ** 2).sum() for gi in g))
        factor = min(1.0, max_norm / (norm.item() + CLIP_EPS))
        for (k, _), gi in zip(named, g):
            total[k] += factor * gi
        norms.append(norm)
    return total, torch.stack(norms)


@pytest.mark.parametrize("name", ["mlp", "conv2d-groups-reflect-same-dilated",
                                  "embedding-padding-gram", "lstm-seq-first", "tied-head"])
def test_ghost_equals_per_example_loop(name):
    model, batch = _problem(name, torch.float64)
    c = _median_norm(model, batch)
    (ghost, norms), _ = _both(model, batch, c)
    ref, ref_norms = _loop(model, batch, c)
    assert _rel(ghost, ref) <= 1e-12
    torch.testing.assert_close(norms, ref_norms, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", ["MLP", "CNN", "LSTM", "Embedding+LayerNorm"])
def test_opacus_equivalence_models(name, dtype):
    pytest.importorskip("opacus")
    from benchmarks import opacus_equivalence as eq
    model, batch = eq.make(name, 8, dtype)
    c = eq.median_norm(model, batch)
    kw = dict(max_norm=c, noise_multiplier=1.3, seed=7, reduction="mean")
    ghost = dp_sgd_grads(model, F.cross_entropy, batch, method="ghost", **kw)
    mat = dp_sgd_grads(model, F.cross_entropy, batch, **kw)   # the same noise
    assert _rel(ghost, mat) <= RTOL[dtype]


def test_frozen_parameters_and_zero_gradients():
    """requires_grad=False parameters get no entry (a whole layer, or a weight whose bias
    trains); an example whose gradient is exactly zero has norm 0 and factor 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.Tanh(), nn.Linear(6, 3, bias=False),
                          nn.Linear(3, 2)).double()
    model[0].weight.requires_grad_(False)
    model[3].weight.requires_grad_(False)
    x = torch.randn(5, 4, dtype=torch.float64)
    x[2] = 0.0   # tanh(0 @ W) = 0: no gradient reaches layer 2's weight, and layer 3's bias...

    def loss_fn(out, y):   # ... gets none either: y equals the output's bias-free value
        return (out - y).square().sum()
    y = model(x).detach()
    y[2] = model[3].bias.detach()
    kw = dict(max_norm=0.1, noise_multiplier=0.0, return_norms=True)
    ghost, norms = dp_sgd_grads(model, loss_fn, (x, y), method="ghost", **kw)
    mat, m_norms = dp_sgd_grads(model, loss_fn, (x, y), **kw)
    assert set(ghost) == {"2.weight", "3.bias"}
    assert norms[2] == 0 and m_norms[2] == 0
    assert _rel(ghost, mat) <= 1e-12
    torch.testing.assert_close(norms, m_norms, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("b", [0, 1])
def test_empty_and_single_example_batches(b):
    model, batch = _problem("conv2d", torch.float64, b=b)
    kw = dict(max_norm=0.01, noise_multiplier=0.5, seed=3, return_norms=True)
    (ghost, norms), (mat, m_norms) = (
        dp_sgd_grads(model, F.cross_entropy, batch, method=m, **kw)
        for m in ("ghost", "materialize"))
    assert _rel(ghost, mat) <= 1e-12 and norms.shape == m_norms.shape == (b,)
    torch.testing.assert_close(norms, m_norms, rtol=1e-12, atol=0)


def test_loss_fn_gets_batches_of_one_and_extra_batch_tensors():
    """loss_fn(out_i, y_i, w_i) with every tensor a batch of one, as materialize calls it."""
    model, (x, y) = _problem("mlp")
    w = torch.rand(x.shape[0], dtype=torch.float64)
    shapes = set()

    def loss_fn(out, y, w):
        shapes.add((tuple(out.shape), tuple(y.shape), tuple(w.shape)))
        return (w * F.cross_entropy(out, y, reduction="none")).sum()
    kw = dict(max_norm=0.05, noise_multiplier=0.0)
    ghost = dp_sgd_grads(model, loss_fn, (x, y, w), method="ghost", **kw)
    assert shapes == {((1, N_CLASSES), (1,), (1,))}
    assert _rel(ghost, dp_sgd_grads(model, loss_fn, (x, y, w), **kw)) <= 1e-12


def test_compiled_step_traces_ghost_per_bucket():
    """compiled_private_step(method="ghost"): one trace per bucket, replayed; padded rows add
    nothing; the parameters are re-read (an optimizer's in-place update is seen)."""
    model, (x, y) = _problem("custom-module", torch.float64, b=10)
    step = compiled_private_step(model, F.cross_entropy, max_norm=0.05, noise_multiplier=0.0,
                                 max_batch_size=16, method="ghost")
    for n in (9, 10, 9):   # one bucket (10): 9 examples are padded with one masked row
        batch = (x[:n], y[:n])
        got, norms = step(batch, return_norms=True)
        want, want_norms = dp_sgd_grads(model, F.cross_entropy, batch, max_norm=0.05,
                                        noise_multiplier=0.0, return_norms=True)
        assert _rel(got, want) <= 1e-12
        torch.testing.assert_close(norms, want_norms, rtol=1e-12, atol=0)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)
    mask = torch.rand(10, generator=torch.Generator().manual_seed(0)) < 0.5
    sums, masked = step.masked_clipped_sum((x, y), mask)   # the same bucket: replayed
    ref, ref_norms = dp_sgd_grads(model, F.cross_entropy, (x[mask], y[mask]),
                                  max_norm=0.05, noise_multiplier=0.0, return_norms=True)
    assert _rel(sums, ref) <= 1e-12 and (masked[~mask] == 0).all()
    torch.testing.assert_close(masked[mask], ref_norms, rtol=1e-12, atol=0)
    info = step.cache_info()
    assert (info.misses, info.hits, info.eager_calls) == (1, 3, 0)


def test_errors():
    model, batch = _problem("mlp")
    kw = dict(max_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(TransformArgumentError, match="method=.*'exact'"):
        dp_sgd_grads(model, F.cross_entropy, batch, method="exact", **kw)
    with pytest.raises(TransformArgumentError, match="got method='Ghost'"):
        compiled_private_step(model, F.cross_entropy, method="Ghost", **kw)
    with pytest.raises(TransformArgumentError, match="randomness='same'"):
        dp_sgd_grads(model, F.cross_entropy, batch, method="ghost", randomness="same", **kw)
    bn = nn.Sequential(nn.Linear(7, 4), nn.BatchNorm1d(4)).double()
    with pytest.raises(TransformArgumentError, match=r"1 \(BatchNorm1d\) is in training mode"):
        dp_sgd_grads(bn, F.cross_entropy, batch, method="ghost", **kw)
    # dropout inside a module the fallback re-runs per example cannot be replayed
    torch.manual_seed(0)
    lstm = LSTMNet(True).double()
    lstm.lstm = nn.LSTM(4, 6, num_layers=2, dropout=0.5, batch_first=True).double()
    seq = (torch.randn(4, 5, 4, dtype=torch.float64), torch.randint(0, N_CLASSES, (4,)))
    with pytest.raises(TransformArgumentError, match=r"lstm \(LSTM\).*random"):
        dp_sgd_grads(lstm, F.cross_entropy, seq, method="ghost", **kw)

    class Pooled(nn.Module):   # mixes the examples: no batch dim survives
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(7, N_CLASSES)

        def forward(self, x):
            return self.lin(x).reshape(-1)
    with pytest.raises(TransformArgumentError, match="batch dim"):
        dp_sgd_grads(Pooled().double(), lambda o, y: o.sum(), batch, method="ghost", **kw)


def test_memory_benchmark_runs():
    """benchmarks/dp_memory.py's pieces on a batch of 4 (the numbers are not asserted)."""
    from benchmarks import dp_memory
    times = dp_memory.times_here(["backward", "ghost"], batch=4, repeats=2, budget=5.0)
    assert {m: t["runs"] for m, t in times.items()} == {"backward": 2, "ghost": 2}
    results = {m: {"peak_mb": 1.0, **times.get(m, {"time_s": 1.0, "runs": 1})}
               for m in dp_memory.METHODS}
    assert "ghost" in dp_memory.format_table(results, 4, markdown=True)
    assert set(dp_memory.targets(results).values()) <= {True, False}


@pytest.mark.parametrize("name", ["linear-positions-gram", "linear-positions-materialized",
                                  "conv2d-groups-reflect-same-dilated", "conv2d-strided-gram",
                                  "embedding-padding-gram", "embedding-materialized"])
def test_norms_in_chunks_of_examples(name, monkeypatch):
    """The Gram matrices / per-layer gradients of a norm are made a few examples at a time
    (at most _CHUNK_ELEMENTS elements); here one example at a time: the same result."""
    from functrans.nn import dp_ghost
    monkeypatch.setattr(dp_ghost, "_CHUNK_ELEMENTS", 7)
    test_ghost_equals_materialize(name, torch.float64)
