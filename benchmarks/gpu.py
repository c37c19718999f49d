"""The GPU benchmark table (issue 28): every workload at sizes that fill a GPU, run eagerly and
compiled by functrans and by torch.func, checked, timed with CUDA events, its peak memory read.

    python -m benchmarks.gpu --device cuda --json gpu.json --markdown gpu.md
    python -m benchmarks.gpu --device cuda --filter "per-sample" --workers 2
    python -m benchmarks.gpu --device cpu --smoke        # the same code path, tiny sizes, no GPU

Columns (cells), each a callable on the row's argument tensors: ``functrans`` and ``torch.func``
eager; ``functrans.compile`` with the backends ``replay`` (the default), ``inductor`` and
``cudagraphs``; ``torch.compile`` over the torch.func callable, default mode and
``mode="reduce-overhead"`` (CUDA graphs); the Python ``loop`` over examples (plain autograd).
Every cell's result is compared with torch.func eager (``Spec.rtol``/``atol``) before anything is
timed; where the two differ, both are compared with a float64 run, and the cell passes only if it
is as accurate as torch.func (``_Checker``; the errors are listed under the table).  A cell that
fails is reported with its reason and the row goes on.  A compiled cell that
ran eagerly, retraced, or fell back from the backend it was asked for fails.  TF32 is off
(``torch.backends.cudnn.allow_tf32`` / ``cuda.matmul.allow_tf32``), so the checks compare float32
with float32 and every column computes in the same precision.

The loop at a large batch would take minutes, so a workload with ``loop_batch`` measures its loop
on a row built with that many examples (checked against that row's torch.func) and scales the
time by ``batch / loop_batch``: every example's iteration does the same work, so the loop's time
is linear in the batch.  Such cells are marked in the table.

Timing: two warm-up calls per cell, then a call count per sample calibrated to about
``--sample-ms``; ``--rounds`` rounds time every cell once each, in rotating order; a sample is
the CUDA-event time over its calls divided by the count; the table shows the median.  Peak
memory of one steady-state call: what the cell holds between calls (what building and checking
it left allocated: a CUDA graph's static buffers, say) plus the most the call allocates above
what was allocated when it began (``torch.cuda.max_memory_allocated``), its result included;
both parts are in the JSON (``memory``), and where building a cell freed memory allocated before
it (a negative ``held``) no peak is claimed.
Rows whose target is missed are profiled (``torch.profiler``: host
wall time against the sum of device kernel time per call, and the top kernels).

Each row runs in its own process (``--row``), so a crash costs one row, and ``--workers`` rows
run at once: their compilations overlap, but the timing phase holds a file lock, so only one
process times on the GPU at a time.  ``--deadline`` seconds after the start no new row begins;
the rows not run are listed.

Targets (issue 28): functrans eager <= 1.05x torch.func where the batch is >= 512 or the
ensemble >= 32 (``GpuWorkload.eager_target``); functrans.compile cudagraphs <= 1.0x
torch.compile reduce-overhead on every row; functrans eager's peak memory <= 1.1x torch.func's.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import functools
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

import functrans as ft

from . import table
from .workloads import LIBS, SmallCNN, _mlp, _mlp_params, _xent

ROOT = Path(__file__).resolve().parent.parent
EAGER = ("functrans", "torch.func")
FT_COMPILED = {"ft.compile replay": "replay", "ft.compile inductor": "inductor",
               "ft.compile cudagraphs": "cudagraphs"}
TORCH_COMPILED = {"torch.compile": "default", "torch.compile reduce-overhead": "reduce-overhead"}
CELLS = (EAGER + tuple(FT_COMPILED) + tuple(TORCH_COMPILED) + ("loop",))
EAGER_TARGET, GRAPHS_TARGET, MEMORY_TARGET = 1.05, 1.0, 1.1


@dataclasses.dataclass
class Spec:
    """One row's computation: ``make(m)`` is the function for the library ``m`` (functrans or
    torch.func), called as ``fn(*args)``; ``loop(*args)`` is the plain-PyTorch per-example loop."""
    make: Callable[[object], Callable]
    args: tuple
    loop: Callable
    rtol: float = 1e-4
    atol: float = 1e-5


@dataclasses.dataclass
class GpuWorkload:
    name: str
    size: str
    build: Callable[[torch.device, bool], Spec]   # (device, smoke) -> Spec
    batch: int                    # what the eager target keys on (examples, members, HVPs)
    members: bool = False         # batch counts ensemble members (target at >= 32)
    loop_build: Optional[Callable[[torch.device, bool], Spec]] = None
    loop_scale: float = 1.0

    @property
    def id(self) -> str:
        return f"{self.name}[{self.size}]"

    @property
    def eager_target(self) -> Optional[float]:
        big = self.batch >= 32 if self.members else self.batch >= 512
        return EAGER_TARGET if big else None


def _randn(*shape, device, scale=1.0):
    return torch.randn(*shape, device=device) * scale


def _stack_grads(per, names):
    return {k: torch.stack([g[i] for g in per]) for i, k in enumerate(names)}


# --- per-sample gradients: the benchmark MLP (784-512-256-10) and CNN (28x28) ----------------

def _psg_mlp(batch: int, device, smoke: bool) -> Spec:
    sizes = [784, 512, 256, 10] if not smoke else [12, 8, 6, 10]
    p = _mlp_params(sizes, device)
    xs, ys = _randn(batch, sizes[0], device=device), torch.randint(0, 10, (batch,), device=device)

    def loss(p, x, y):
        return _xent(_mlp(p, x), y)

    def loop(p, xs, ys):
        leaves = {k: v.detach().requires_grad_() for k, v in p.items()}
        return _stack_grads([torch.autograd.grad(loss(leaves, x, y), list(leaves.values()))
                             for x, y in zip(xs, ys)], list(leaves))

    return Spec(lambda m: m.vmap(m.grad(loss), in_dims=(None, 0, 0)), (p, xs, ys), loop)


def _psg_cnn(batch: int, device, smoke: bool) -> Spec:
    torch.manual_seed(1)
    model = SmallCNN().to(device)
    p = {k: v.detach().clone() for k, v in model.named_parameters()}
    xs = _randn(batch, 1, 28, 28, device=device)
    ys = torch.randint(0, 10, (batch,), device=device)

    def make(m):
        def loss(p, x, y):
            return _xent(m.functional_call(model, p, (x.unsqueeze(0),)).squeeze(0), y)
        return m.vmap(m.grad(loss), in_dims=(None, 0, 0))

    def loop(p, xs, ys):             # the module's own parameters (equal to p)
        params = list(model.parameters())
        return _stack_grads([torch.autograd.grad(_xent(model(x.unsqueeze(0)).squeeze(0), y), params)
                             for x, y in zip(xs, ys)], [k for k, _ in model.named_parameters()])

    return Spec(make, (p, xs, ys), loop)


# --- ensembles: N MLPs (256-512-512-10), one shared minibatch of 512, per-member gradients ----

def _ensemble_grad(n: int, device, smoke: bool) -> Spec:
    d, h, b = (256, 512, 512) if not smoke else (8, 16, 8)
    torch.manual_seed(2)
    models = [nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(),
                            nn.Linear(h, 10)).to(device) for _ in range(n)]
    params, _ = ft.stack_module_state(models)
    params = {k: v.detach() for k, v in params.items()}
    base = models[0]
    x, y = _randn(b, d, device=device), torch.randint(0, 10, (b,), device=device)

    def make(m):
        def loss(p, x, y):
            return F.cross_entropy(m.functional_call(base, p, (x,)), y)
        return m.vmap(m.grad(loss), in_dims=(0, None, None))

    def loop(params, x, y):
        per = [torch.autograd.grad(F.cross_entropy(mod(x), y), list(mod.parameters()))
               for mod in models]
        return _stack_grads(per, list(params))

    return Spec(make, (params, x, y), loop)


# --- batched Jacobians of an MLP (tanh, 32-64-64-16) -----------------------------------------

def _batched_jacobian(kind: str, batch: int, device, smoke: bool) -> Spec:
    p = _mlp_params([32, 64, 64, 16], device)
    xs = _randn(batch, 32, device=device)

    def f(p, x):
        return _mlp(p, x, act=torch.tanh)

    def loop(p, xs):                 # one backward per example and output row
        rows = []
        for x in xs:
            xr = x.detach().requires_grad_()
            y = f(p, xr)
            rows.append(torch.stack([torch.autograd.grad(y, xr, e, retain_graph=True)[0]
                                     for e in torch.eye(y.shape[0], device=device)]))
        return torch.stack(rows)

    return Spec(lambda m: m.vmap(getattr(m, kind)(f, argnums=1), in_dims=(None, 0)), (p, xs),
                loop)


# --- Hessians of f(x) = sum(tanh(W x + b)) ---------------------------------------------------

def _tanh_sum(W, b, x):
    return torch.tanh(F.linear(x, W, b)).sum()


def _hvp_rows(W, b, x):
    """The Hessian by one Hessian-vector product per row (double backward)."""
    xr = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(_tanh_sum(W, b, xr), xr, create_graph=True)
    return torch.stack([torch.autograd.grad(g, xr, e, retain_graph=True)[0]
                        for e in torch.eye(x.shape[0], device=x.device)])


def _hessian(D: int, device, smoke: bool) -> Spec:
    W, b = _randn(D, D, device=device, scale=D ** -0.5), _randn(D, device=device, scale=0.1)
    x = _randn(D, device=device)
    return Spec(lambda m: m.hessian(_tanh_sum, argnums=2), (W, b, x), _hvp_rows,
                rtol=1e-4, atol=1e-5)


def _batched_hessian(batch: int, D: int, device, smoke: bool) -> Spec:
    W, b = _randn(D, D, device=device, scale=D ** -0.5), _randn(D, device=device, scale=0.1)
    xs = _randn(batch, D, device=device)
    return Spec(lambda m: m.vmap(m.hessian(_tanh_sum, argnums=2), in_dims=(None, None, 0)),
                (W, b, xs), lambda W, b, xs: torch.stack([_hvp_rows(W, b, x) for x in xs]))


# --- empirical NTK of an MLP (16-64-64-4 tanh) -----------------------------------------------

def _ntk(n: int, device, smoke: bool) -> Spec:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 4)).to(device)
    p = {k: v.detach().clone() for k, v in model.named_parameters()}
    x1, x2 = _randn(n, 16, device=device), _randn(n, 16, device=device)

    def make(m):
        def f_single(p, x):
            return m.functional_call(model, p, (x.unsqueeze(0),)).squeeze(0)
        jac = m.vmap(m.jacrev(f_single), (None, 0))

        def ntk(p, x1, x2):
            j1, j2 = jac(p, x1), jac(p, x2)
            return sum(torch.einsum("Naf,Mbf->NMab", j1[k].flatten(2), j2[k].flatten(2))
                       for k in p)
        return ntk

    params = list(model.parameters())

    def jac_loop(xs):
        rows = []
        for x in xs:
            out = model(x.unsqueeze(0)).squeeze(0)
            rows.append(torch.stack([torch.cat([g.flatten() for g in torch.autograd.grad(
                out[a], params, retain_graph=True)]) for a in range(out.shape[0])]))
        return torch.stack(rows)

    def loop(p, x1, x2):
        return torch.einsum("Naf,Mbf->NMab", jac_loop(x1), jac_loop(x2))

    return Spec(make, (p, x1, x2), loop, rtol=1e-4, atol=1e-4)


# --- one DP-SGD step: per-sample gradients, per-example clipping, sum, Gaussian noise ---------
# The noise is an argument (drawn by the training loop), so every column computes the same
# function and the compiled columns can be checked against eager.

MAX_NORM, SIGMA = 1.0, 1.1


def _clip_sum_noise(per: Dict[str, torch.Tensor], noise: Dict[str, torch.Tensor]):
    n = next(iter(per.values())).shape[0]
    norms = torch.stack([g.reshape(n, -1).norm(dim=1) for g in per.values()], 1).norm(dim=1)
    factor = (MAX_NORM / (norms + 1e-6)).clamp(max=1.0)
    return {k: (torch.einsum("n,n...->...", factor, g) + SIGMA * MAX_NORM * noise[k]) / n
            for k, g in per.items()}


def _dp_step(batch: int, device, smoke: bool) -> Spec:
    sizes = [784, 512, 256, 10] if not smoke else [12, 8, 6, 10]
    p = _mlp_params(sizes, device)
    xs, ys = _randn(batch, sizes[0], device=device), torch.randint(0, 10, (batch,), device=device)
    noise = {k: torch.randn_like(v) for k, v in p.items()}

    def loss(p, x, y):
        return _xent(_mlp(p, x), y)

    def make(m):
        per_sample = m.vmap(m.grad(loss), in_dims=(None, 0, 0))
        return lambda p, xs, ys, noise: _clip_sum_noise(per_sample(p, xs, ys), noise)

    def loop(p, xs, ys, noise):
        leaves = {k: v.detach().requires_grad_() for k, v in p.items()}
        per = _stack_grads([torch.autograd.grad(loss(leaves, x, y), list(leaves.values()))
                            for x, y in zip(xs, ys)], list(leaves))
        return _clip_sum_noise(per, noise)

    return Spec(make, (p, xs, ys, noise), loop)


def _w(name, size, build, batch, loop_batch=None, loop_build=None, **kw):
    """A workload; ``loop_batch`` (with ``loop_build``, the builder at that batch) measures the
    loop on fewer examples and scales its time by ``batch / loop_batch``."""
    scale = batch / loop_batch if loop_batch else 1.0
    return GpuWorkload(name, size, build, batch, loop_build=loop_build, loop_scale=scale, **kw)


P = functools.partial
WORKLOADS: List[GpuWorkload] = [
    *[_w("per-sample grads MLP", f"B={b}", P(_psg_mlp, b), b, min(b, 256), P(_psg_mlp, min(b, 256)))
      for b in (64, 512, 4096)],
    *[_w("per-sample grads CNN", f"B={b}", P(_psg_cnn, b), b, min(b, 256), P(_psg_cnn, min(b, 256)))
      for b in (64, 512, 4096)],
    *[_w("ensemble grad MLP", f"N={n}", P(_ensemble_grad, n), n, members=True)
      for n in (8, 32, 128)],
    _w("vmap(jacrev) MLP", "B=4096", P(_batched_jacobian, "jacrev", 4096), 4096, 128,
       P(_batched_jacobian, "jacrev", 128)),
    _w("vmap(jacfwd) MLP", "B=4096", P(_batched_jacobian, "jacfwd", 4096), 4096, 128,
       P(_batched_jacobian, "jacfwd", 128)),
    _w("hessian", "D=2048", P(_hessian, 2048), 2048),
    _w("vmap(hessian)", "B=1024 D=64", P(_batched_hessian, 1024, 64), 1024, 16,
       P(_batched_hessian, 16, 64)),
    _w("empirical NTK", "N=512", P(_ntk, 512), 512, 64, P(_ntk, 64)),
    _w("DP-SGD step MLP", "B=512", P(_dp_step, 512), 512, 256, P(_dp_step, 256)),
]
SMOKE_SIZES = {"B=4096": 8, "B=512": 6, "B=64": 4}


# --- one row, in its own process -------------------------------------------------------------

def _why(e: BaseException) -> str:
    """``table._why`` (the first line) and, for a failed comparison, its mismatch and greatest
    differences."""
    extra = [ln.strip()[:160] for ln in str(e).strip().splitlines()[1:] if ln.strip().startswith(
        ("Mismatched", "Greatest", "The failure occurred"))]
    return " ".join([table._why(e)] + extra)


class _Timer:
    """Seconds over ``n`` calls of ``fn``: CUDA events on a GPU, the host clock on the CPU."""

    def __init__(self, device):
        self.device = device

    def __call__(self, fn, n: int) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / n
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n


def _allocated(device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _transient_of_one_call(fn, device) -> Optional[int]:
    """The most one call allocates above what was allocated when it began (its result
    included)."""
    if device.type != "cuda":
        return None
    table._sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    table._sync(device)
    transient = torch.cuda.max_memory_allocated(device) - before
    del out
    return transient


@contextlib.contextmanager
def _gpu_lock(path: Optional[str]):
    if not path:
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


FLOAT32_OK = 1e-5    # normwise relative error of a float32 result against float64: accurate


def _to64(tree):
    return pytree.tree_map(lambda t: t.double() if isinstance(t, torch.Tensor)
                           and t.is_floating_point() else t, tree)


def _rel_errors(got, ref) -> List[float]:
    """Per leaf: ||got - ref|| / ||ref|| (in float64)."""
    return [float((g.double() - r).norm() / r.norm().clamp_min(1e-30))
            for g, r in zip(pytree.tree_leaves(got), pytree.tree_leaves(ref))]


class _Checker:
    """A cell's result against torch.func's, within the row's tolerance.  Where they differ,
    both are compared with a float64 reference (torch.func on float64 copies of the arguments):
    the cell passes if it is as accurate as torch.func (normwise relative error at most
    ``FLOAT32_OK`` or twice torch.func's), and the errors are recorded in ``numerics``; else it
    fails, naming both errors, so a failure says which of the two is wrong."""

    def __init__(self, spec: Spec, want, numerics: dict):
        self.spec, self.want, self.numerics = spec, want, numerics

    def __call__(self, got, name: str) -> None:
        try:
            table._assert_agree(got, self.want, self.spec, name)
            return
        except AssertionError as e:
            differs = _why(e).removeprefix("AssertionError: ")
        # made anew for each cell that needs it, and freed at once: kept, it would count in the
        # memory the next cells hold (13 GB for the per-sample gradients at B=4096)
        ref = self.spec.make(torch.func)(*_to64(self.spec.args))
        mine, theirs = max(_rel_errors(got, ref)), max(_rel_errors(self.want, ref))
        del ref, got
        self.numerics[name] = {"vs float64": mine, "torch.func vs float64": theirs,
                               "differs from torch.func": differs}
        if mine > max(FLOAT32_OK, 2 * theirs):
            raise AssertionError(f"{differs}; against float64: {mine:.2e}, torch.func's "
                                 f"{theirs:.2e}")


def _build_cells(w: GpuWorkload, spec: Spec, device, smoke: bool, result: dict) -> Dict[str, dict]:
    """``{cell: {"fn": zero-arg callable, "held": bytes the cell keeps allocated once built,
    "first_s": the first two calls (compile, check), seconds}}``; failures go to
    ``result["errors"]``, float64 adjudications to ``result["numerics"]``."""
    cells: Dict[str, dict] = {}
    errors = result["errors"]
    args = spec.args
    check = _Checker(spec, spec.make(torch.func)(*args), result["numerics"])

    def add(name, make_fn, check_info=None):
        table._sync(device)
        gc.collect()
        base = _allocated(device)
        try:
            t0 = time.perf_counter()
            fn = make_fn()
            # each result checked before the next call: torch.compile's CUDA graphs overwrite
            # (and forbid reading) a result once the function is called again
            check(fn(*args), name)
            check(fn(*args), name)
            table._sync(device)
            seconds = time.perf_counter() - t0
            if check_info is not None:
                check_info(fn)
            gc.collect()
            cells[name] = {"fn": functools.partial(fn, *args), "first_s": seconds,
                           "held": _allocated(device) - base}
        except Exception as e:                  # the cell fails, the row goes on
            errors[name] = _why(e)

    for name, m in LIBS.items():
        if name == "functrans":
            ft_fn = spec.make(ft)

            def strict_run(*a):          # checked without the loop fallback, timed without
                with ft.record_fallbacks() as report, ft.config.strict_fallback():
                    out = ft_fn(*a)
                if len(report):
                    raise AssertionError(f"functrans ran the loop fallback: {report}")
                return out
            add(name, lambda: strict_run)
            if name in cells:
                cells[name]["fn"] = functools.partial(ft_fn, *args)
        else:
            add(name, lambda m=m: spec.make(m))
    for name, backend in FT_COMPILED.items():
        if backend == "cudagraphs" and device.type != "cuda":
            continue

        def info(fn, backend=backend):
            ci = fn.cache_info()
            if ci.eager_calls or ci.misses != 1 or ci.entries[0].backend != backend:
                raise AssertionError(f"not compiled with {backend}: {ci}")
        add(name, lambda b=backend: ft.compile(spec.make(ft), backend=b, strict=True), info)
    for name, mode in TORCH_COMPILED.items():
        if mode == "reduce-overhead" and device.type != "cuda":
            continue
        add(name, lambda mode=mode: torch.compile(
            spec.make(torch.func), mode=None if mode == "default" else mode))
    loop_spec = w.loop_build(device, smoke) if w.loop_build and not smoke else spec
    loop_check = check if loop_spec is spec else _Checker(
        loop_spec, loop_spec.make(torch.func)(*loop_spec.args), result["numerics"])
    try:
        t0 = time.perf_counter()
        loop_check(loop_spec.loop(*loop_spec.args), "loop")
        cells["loop"] = {"fn": functools.partial(loop_spec.loop, *loop_spec.args),
                         "first_s": time.perf_counter() - t0, "held": 0,
                         "scale": w.loop_scale if loop_spec is not spec else 1.0}
    except Exception as e:
        errors["loop"] = _why(e)
    return cells


def _measure(cells: Dict[str, dict], device, rounds: int, sample_s: float) -> Dict[str, float]:
    timer = _Timer(device)
    names = list(cells)
    calls = {}
    for name in names:
        fn = cells[name]["fn"]
        fn()
        once = timer(fn, 1)
        calls[name] = max(1, min(200, math.ceil(sample_s / max(once, 1e-7))))
    samples: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(timer(cells[name]["fn"], calls[name]))
    return {n: statistics.median(s) * cells[n].get("scale", 1.0) for n, s in samples.items()}


def _profile(fn, device, calls: int = 5) -> dict:
    """Host wall time and the summed device (kernel) time per call, and the top kernels."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    table._sync(device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        table._sync(device)
        wall = (time.perf_counter() - t0) / calls
    events = prof.key_averages()
    attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") \
        else "self_cuda_time_total"
    kernels = [e for e in events if getattr(e, attr, 0) > 0 and e.device_type.name != "CPU"] \
        if device.type == "cuda" else []
    device_us = sum(getattr(e, attr) for e in kernels) / calls
    top = sorted(kernels, key=lambda e: -getattr(e, attr))[:5]
    return {"wall_ms": wall * 1e3, "device_ms": device_us / 1e3,
            "kernel_launches": sum(e.count for e in kernels) / calls,
            "top": [f"{e.key[:70]}: {getattr(e, attr) / calls / 1e3:.3f} ms" for e in top]}


def run_row(w: GpuWorkload, device, rounds: int, sample_s: float, smoke: bool,
            lock: Optional[str]) -> dict:
    result: dict = {"id": w.id, "workload": w.name, "size": w.size, "errors": {}, "numerics": {},
                    "times": {},
                    "peak_bytes": {}, "memory": {}, "first_s": {}, "loop_scale": None}
    torch.manual_seed(0)
    spec = w.build(device, smoke)
    cells = _build_cells(w, spec, device, smoke, result)
    result["first_s"] = {n: c["first_s"] for n, c in cells.items()}
    if "loop" in cells and cells["loop"].get("scale", 1.0) != 1.0:
        result["loop_scale"] = cells["loop"]["scale"]
    with _gpu_lock(lock):
        t0 = time.perf_counter()
        result["times"] = _measure(cells, device, rounds, sample_s)
        for name, c in cells.items():
            if name != "loop":
                transient = _transient_of_one_call(c["fn"], device)
                result["memory"][name] = {"held": c["held"], "transient": transient}
                # a negative "held" means building the cell freed memory allocated before it
                # (seen once for torch.compile's reduce-overhead): no peak is claimed then
                result["peak_bytes"][name] = (None if transient is None or c["held"] < 0
                                              else c["held"] + transient)
        result["targets"] = targets(w, result)
        result["profiles"] = {}
        for label, met, pair in result["targets"]:
            if not met:
                for name in pair:
                    if name in cells and name not in result["profiles"]:
                        try:
                            result["profiles"][name] = _profile(cells[name]["fn"], device)
                        except Exception as e:      # a profile is a report, not the row
                            result["profiles"][name] = {"error": _why(e)}
        result["timing_s"] = time.perf_counter() - t0
    return result


def targets(w: GpuWorkload, r: dict) -> List[tuple]:
    """``[(label, met, (cells compared))]`` for the issue's targets that apply to this row."""
    t, mem, out = r["times"], r["peak_bytes"], []
    if w.eager_target is not None and "functrans" in t and "torch.func" in t:
        out.append((f"eager ≤ {w.eager_target:g}× torch.func",
                    t["functrans"] / t["torch.func"] <= w.eager_target, EAGER))
    pair = ("ft.compile cudagraphs", "torch.compile reduce-overhead")
    if pair[1] in t:
        out.append((f"cudagraphs ≤ {GRAPHS_TARGET:g}× reduce-overhead",
                    pair[0] in t and t[pair[0]] / t[pair[1]] <= GRAPHS_TARGET, pair))
    if mem.get("functrans") is not None and mem.get("torch.func"):
        out.append((f"peak memory ≤ {MEMORY_TARGET:g}× torch.func",
                    mem["functrans"] <= MEMORY_TARGET * mem["torch.func"], EAGER))
    return out


# --- the table -------------------------------------------------------------------------------

SHORT = {"functrans": "ft", "torch.func": "torch.func", "ft.compile replay": "ft replay",
         "ft.compile inductor": "ft inductor", "ft.compile cudagraphs": "ft cudagraphs",
         "torch.compile": "torch.compile", "torch.compile reduce-overhead": "t.c. reduce-overhead",
         "loop": "loop"}


def _mb(b: Optional[int]) -> str:
    return "–" if b is None else f"{b / 2**20:.0f}" if b >= 2**20 else f"{b / 2**20:.2f}"


def format_tables(results: List[dict], markdown: bool) -> str:
    head = ["workload", "size"] + [f"{SHORT[c]} ms" for c in CELLS] + [
        "ft / torch.func", "ft cudagraphs / reduce-overhead", "loop / ft"]
    rows = []
    for r in results:
        if r.get("crashed"):
            rows.append([r["workload"], r["size"], "CRASHED: " + r["crashed"]]
                        + [""] * (len(head) - 3))
            continue
        t = r["times"]
        cells = []
        for c in CELLS:
            if c in r["errors"]:
                cells.append("FAILED")
            else:
                cells.append(table._ms(t.get(c)) + ("*" if c == "loop" and r.get("loop_scale")
                                                     and c in t else ""))
        ratio = lambda a, b: f"{t[a] / t[b]:.2f}" if a in t and b in t else "–"
        rows.append([r["workload"], r["size"]] + cells + [
            ratio("functrans", "torch.func"),
            ratio("ft.compile cudagraphs", "torch.compile reduce-overhead"),
            f"{t['loop'] / t['functrans']:.1f}×" if "loop" in t and "functrans" in t else "–"])
    times = table._render(head, rows, markdown)
    head2 = ["workload", "size"] + [f"{SHORT[c]} MB" for c in CELLS if c != "loop"] + [
        "ft / torch.func memory", "targets"]
    rows2 = []
    for r in results:
        if r.get("crashed"):
            continue
        m = r["peak_bytes"]
        mem_ratio = (f"{m['functrans'] / m['torch.func']:.2f}" if m.get("functrans") is not None
                     and m.get("torch.func") else "–")
        rows2.append([r["workload"], r["size"]] + [_mb(m.get(c)) for c in CELLS if c != "loop"]
                     + [mem_ratio, "; ".join(f"{label} {'met' if met else 'MISSED'}"
                                             for label, met, _ in r.get("targets", [])) or "–"])
    memory = table._render(head2, rows2, markdown)
    failures = [f"- {r['id']} {c}: {e}" for r in results for c, e in r.get("errors", {}).items()]
    text = (f"Time per call (median of CUDA-event samples; * = loop measured on fewer examples "
            f"and scaled linearly):\n\n{times}\n\nPeak memory of one steady-state call: what the "
            f"cell holds between calls plus what the call allocates (MB):\n\n{memory}")
    if failures:
        text += "\n\nFailed cells:\n" + "\n".join(failures)
    judged = [f"- {r['id']} {c}: {n['vs float64']:.1e} against float64, torch.func "
              f"{n['torch.func vs float64']:.1e} ({n['differs from torch.func']})"
              for r in results for c, n in r.get("numerics", {}).items()
              if c not in r.get("errors", {})]
    if judged:
        text += ("\n\nCells that differ from torch.func beyond the row's tolerance but are as "
                 "accurate (normwise relative error against a float64 run):\n" + "\n".join(judged))
    return text


def _setup(device: torch.device) -> None:
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    if device.type == "cpu":
        torch.set_num_threads(1)


def _smoke(w: GpuWorkload) -> GpuWorkload:
    """``w`` at tiny sizes (a CPU dry run of the whole code path)."""
    size = w.size.split()[0]
    n = SMOKE_SIZES.get(size, 4)
    builders = {"per-sample grads MLP": P(_psg_mlp, n), "per-sample grads CNN": P(_psg_cnn, n),
                "ensemble grad MLP": P(_ensemble_grad, 3),
                "vmap(jacrev) MLP": P(_batched_jacobian, "jacrev", 4),
                "vmap(jacfwd) MLP": P(_batched_jacobian, "jacfwd", 4),
                "hessian": P(_hessian, 8), "vmap(hessian)": P(_batched_hessian, 3, 5),
                "empirical NTK": P(_ntk, 3), "DP-SGD step MLP": P(_dp_step, 5)}
    return dataclasses.replace(w, build=builders[w.name], loop_build=None, loop_scale=1.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--filter", default="")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sample-ms", type=float, default=20.0)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds; no row starts after")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (a dry run, e.g. on the CPU)")
    ap.add_argument("--json", help="write the rows as JSON (rewritten after every row)")
    ap.add_argument("--markdown", help="write the tables as markdown")
    ap.add_argument("--render", metavar="JSON",
                    help="no run: print (and with --markdown/--update-readme write) the tables "
                         "of a JSON file an earlier run wrote")
    ap.add_argument("--update-readme", action="store_true",
                    help="replace the README's GPU table (<!-- bench:gpu:start/end -->)")
    ap.add_argument("--row", help=argparse.SUPPRESS)           # one row, in this process
    ap.add_argument("--lock", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.render:
        return _render_saved(args)
    device = torch.device(args.device)
    _setup(device)
    chosen = [w for w in WORKLOADS if args.filter.lower() in w.id.lower()]
    if args.smoke:
        chosen = [_smoke(w) for w in chosen]
    if args.row is not None:
        (w,) = [w for w in chosen if w.id == args.row]
        out = run_row(w, device, args.rounds, args.sample_ms / 1e3, args.smoke, args.lock)
        print("ROW " + json.dumps(out), flush=True)
        return 0
    return _run_all(chosen, device, args)


def _run_all(chosen: List[GpuWorkload], device, args) -> int:
    print(table.describe(device), flush=True)
    start = time.perf_counter()
    lock = tempfile.NamedTemporaryFile(prefix="ft-gpu-bench-", suffix=".lock", delete=False).name
    pending, running, results = list(chosen), [], {}
    base_cmd = [sys.executable, "-m", "benchmarks.gpu", "--device", str(device), "--rounds",
                str(args.rounds), "--sample-ms", str(args.sample_ms), "--lock", lock]
    if args.smoke:
        base_cmd.append("--smoke")
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS=os.environ.get(
        "TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 2) // (args.workers + 1)))))
    not_run = []

    def finish(w, proc, log, t0):
        proc.wait()
        log.seek(0)
        text = log.read()
        line = next((ln for ln in reversed(text.splitlines()) if ln.startswith("ROW ")), None)
        if line is not None:
            r = json.loads(line[4:])
        else:
            tail = [ln for ln in text.strip().splitlines()][-1:] or ["no output"]
            r = {"id": w.id, "workload": w.name, "size": w.size,
                 "crashed": f"exit {proc.returncode}: {tail[0][:200]}", "errors": {}}
        r["wall_s"] = time.perf_counter() - t0
        results[w.id] = r
        status = r.get("crashed") or ", ".join(
            f"{label} {'met' if met else 'MISSED'}" for label, met, _ in r.get("targets", []))
        errs = "; ".join(f"{c}: {e}" for c, e in r.get("errors", {}).items())
        print(f"  {w.id}: {status or 'no target'}" + (f" | FAILED {errs}" if errs else ""),
              file=sys.stderr, flush=True)
        _write(args, device, [results[x.id] for x in chosen if x.id in results], not_run)

    while pending or running:
        while pending and len(running) < args.workers:
            w = pending.pop(0)
            if time.perf_counter() - start > args.deadline:
                not_run.append(w.id)
                continue
            log = tempfile.TemporaryFile(mode="w+")
            proc = subprocess.Popen(base_cmd + ["--row", w.id], cwd=ROOT, stdout=log,
                                    stderr=subprocess.STDOUT, text=True, env=env)
            running.append((w, proc, log, time.perf_counter()))
        time.sleep(0.2)
        for item in list(running):
            if item[1].poll() is not None:
                running.remove(item)
                finish(*item)
    ordered = [results[w.id] for w in chosen if w.id in results]
    text = _write(args, device, ordered, not_run)
    print(text)
    failed = [r["id"] for r in ordered if r.get("crashed") or r.get("errors")]
    missed = [f"{r['id']} {label}" for r in ordered for label, met, _ in r.get("targets", [])
              if not met]
    print(f"\n{len(ordered)} rows in {time.perf_counter() - start:.0f} s; failed: "
          f"{', '.join(failed) or 'none'}; not run (deadline): {', '.join(not_run) or 'none'}; "
          f"targets missed: {'; '.join(missed) or 'none'}")
    return 1 if failed else 0


def _render_saved(args) -> int:
    saved = json.loads(Path(args.render).read_text())
    md = f"{saved['device']}\n\n{format_tables(saved['rows'], markdown=True)}"
    print(f"{saved['device']}\n\n{format_tables(saved['rows'], markdown=False)}")
    if args.markdown:
        Path(args.markdown).write_text(md + "\n")
    if args.update_readme:
        table.update_readme(md, torch.device("cuda"), readme=table.README)
    return 0


def _write(args, device, ordered: List[dict], not_run: List[str]) -> str:
    text = f"{table.describe(device)}\n\n{format_tables(ordered, markdown=False)}"
    if args.json:
        Path(args.json).write_text(json.dumps({"device": table.describe(device), "rows": ordered,
                                               "not_run": not_run}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(
            f"{table.describe(device)}\n\n{format_tables(ordered, markdown=True)}\n")
    return text


if __name__ == "__main__":
    sys.exit(main())
