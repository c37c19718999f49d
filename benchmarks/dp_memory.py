"""Peak memory and time of one DP-SGD gradient step: an ordinary backward, functrans's
``dp_sgd_grads`` with ``method="materialize"`` and ``method="ghost"``, and Opacus 1.6's ghost
clipping, side by side (issue 27).

    .venv/bin/python -m benchmarks.dp_memory                  # the MLP below, B=256
    .venv/bin/python -m benchmarks.dp_memory --batch 64 --markdown

Workload: an MLP 512-1024-1024-1024-10 (ReLU; 2.63M parameters, float32), cross-entropy, a batch
of ``--batch`` examples (256), one torch thread, CPU.  A step (what is measured):

* ``backward``: ``zero_grad``, forward, the mean loss, ``backward()`` (no privacy: the floor);
* ``materialize`` / ``ghost``: ``dp_sgd_grads(model, F.cross_entropy, (x, y), max_norm=1.0,
  noise_multiplier=1.0, seed=0, method=...)``: the noisy clipped sum, noise included;
* ``opacus ghost``: Opacus's ``GradSampleModuleFastGradientClipping`` (ghost clipping on),
  ``DPOptimizerFastGradientClipping`` and ``DPLossFastGradientClipping`` (``loss_reduction=
  "sum"``): ``zero_grad``, forward, the loss, ``backward()`` (Opacus's two backwards) and
  ``optimizer.pre_step()`` (the noise; no parameter update).

Peak memory above the model: every method runs in its own subprocess (so one method's freed
memory cannot hide another's peak), with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc then serves
every buffer above 64 KiB by ``mmap`` and unmaps it when freed: the resident set follows the
live tensors instead of keeping freed heap pages).  After one warm-up step (lazy one-off
allocations: caches, Opacus's hooks) the gradients are dropped, ``malloc_trim(0)`` runs, the
resident set is read (``/proc/self/statm``: model, batch, Python, torch) and its high-water mark
is reset (``/proc/self/clear_refs`` 5); one step runs, and the peak above the model is the new
high-water mark (``VmHWM`` in ``/proc/self/status``) minus the resident set before it
(benchmarks/peak_memory.py, shared with benchmarks/chunk_memory.py).  So a
method's returned gradients count (12.5 MB here), as do its activations and temporaries.
(``tracemalloc`` does not see torch's CPU allocations and torch keeps no CPU allocator
statistics; this reads what the kernel charges the process.)  Time: every method in one
more subprocess, each on its own copy of the model, after one warm-up step each: ``--repeats``
rounds, each running every method once in a rotating order (so drift on a shared machine hits
them alike; a method whose steps took ``--budget`` seconds in all sits the remaining rounds out:
materialize), the median per method.

Targets (issue 27): ghost's peak at most 3x the backward's + 64 MB, its time at most 3x.
Opacus is optional (``pip install functrans[dp]``): without it, its row says so.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
from torch import nn

from . import peak_memory

METHODS = ("backward", "materialize", "ghost", "opacus ghost")
WIDTHS = (512, 1024, 1024, 1024, 10)
MAX_NORM, NOISE_MULTIPLIER = 1.0, 1.0
OPACUS_MISSING = "opacus is not installed (pip install functrans[dp])"
MEMORY_FACTOR, MEMORY_SLACK_MB, TIME_FACTOR = 3.0, 64.0, 3.0


def make_mlp() -> nn.Sequential:
    layers: List[nn.Module] = []
    for i, (a, b) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(WIDTHS) - 2 else [])
    return nn.Sequential(*layers)


def _step(method: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable:
    """A callable running one step of ``method``; it returns what the step produces."""
    if method == "backward":
        def step():
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
        return step
    if method in ("materialize", "ghost"):
        from functrans.nn.dp import dp_sgd_grads
        return lambda: dp_sgd_grads(model, F.cross_entropy, (x, y), max_norm=MAX_NORM,
                                    noise_multiplier=NOISE_MULTIPLIER, seed=0, method=method)
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
    gsm = GradSampleModuleFastGradientClipping(model, max_grad_norm=MAX_NORM,
                                               use_ghost_clipping=True, loss_reduction="sum")
    opt = DPOptimizerFastGradientClipping(
        torch.optim.SGD(gsm.parameters(), lr=0.1), noise_multiplier=NOISE_MULTIPLIER,
        max_grad_norm=MAX_NORM, expected_batch_size=x.shape[0], loss_reduction="sum",
        generator=torch.Generator().manual_seed(0))
    criterion = DPLossFastGradientClipping(gsm, opt, nn.CrossEntropyLoss(reduction="sum"),
                                           loss_reduction="sum")

    def step():
        opt.zero_grad(set_to_none=True)
        criterion(gsm(x), y).backward()
        opt.pre_step()
    return step


def _problem(batch: int):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = make_mlp()
    return model, torch.randn(batch, WIDTHS[0]), torch.randint(0, WIDTHS[-1], (batch,))


def peak_here(method: str, batch: int) -> Dict[str, float]:
    """The peak memory above the model of one ``method`` step, in this process (after one
    warm-up step and dropping its gradients; ``peak_memory.peak_above``)."""
    model, x, y = _problem(batch)
    step = _step(method, model, x, y)
    out = step()                                        # warm-up
    del out
    model.zero_grad(set_to_none=True)
    return {"peak_mb": peak_memory.peak_above(step)["peak_mb"]}


def times_here(methods: List[str], batch: int, repeats: int, budget: float
               ) -> Dict[str, Dict[str, float]]:
    """Every method's step, each on its own copy of one model, timed interleaved: ``repeats``
    rounds in a rotating order (a method whose steps took ``budget`` seconds in all sits the
    remaining rounds out); the median per method."""
    model, x, y = _problem(batch)
    steps = {m: _step(m, copy.deepcopy(model), x, y) for m in methods}
    for step in steps.values():
        step()                                          # warm-up
    times: Dict[str, List[float]] = {m: [] for m in methods}
    for r in range(repeats):
        for m in methods[r % len(methods):] + methods[:r % len(methods)]:
            if sum(times[m]) >= budget:
                continue
            t = time.perf_counter()
            out = steps[m]()
            times[m].append(time.perf_counter() - t)
            del out
    return {m: {"time_s": statistics.median(t), "runs": len(t)} for m, t in times.items()}


def _child(args: List[str]) -> dict:
    """``python -m benchmarks.dp_memory --child ...`` in a fresh process: its JSON answer."""
    return peak_memory.run_child("benchmarks.dp_memory", ["--child", *args])


def _opacus_missing() -> bool:
    return importlib.util.find_spec("opacus") is None


def measure(methods: List[str], batch: int, repeats: int, budget: float
            ) -> Dict[str, Dict[str, float]]:
    """Each method's peak (one fresh subprocess each), then the times (one subprocess)."""
    results = {m: ({"error": OPACUS_MISSING} if m == "opacus ghost" and _opacus_missing()
                   else _child(["peak", m, "--batch", str(batch)])) for m in methods}
    timed = [m for m in methods if "error" not in results[m]]
    if timed:
        times = _child(["times", ",".join(timed), "--batch", str(batch), "--repeats",
                        str(repeats), "--budget", str(budget)])
        for m in timed:
            results[m].update(times if "error" in times else times[m])
    return results


def format_table(results: Dict[str, Dict[str, float]], batch: int, markdown: bool) -> str:
    base = results.get("backward", {})
    head = ["step", "peak above the model (MB)", "time (s) (steps)", "peak / backward",
            "time / backward"]
    rows = []
    for method in METHODS:
        r = results[method]
        if "error" in r:
            rows.append([method, r["error"], "", "", ""])
            continue
        ratio_m = f"{r['peak_mb'] / base['peak_mb']:.1f}x" if base.get("peak_mb") else "-"
        ratio_t = f"{r['time_s'] / base['time_s']:.1f}x" if base.get("time_s") else "-"
        rows.append([method, f"{r['peak_mb']:,.0f}", f"{r['time_s']:.3f} ({r['runs']})",
                     ratio_m, ratio_t])
    n = sum(p.numel() for p in make_mlp().parameters())
    title = (f"MLP {'-'.join(map(str, WIDTHS))} ({n / 1e6:.2f}M parameters, float32), "
             f"B={batch}, one CPU thread")
    if markdown:
        lines = [f"| {' | '.join(head)} |", "|" + "---|" * len(head)]
        lines += [f"| {' | '.join(row)} |" for row in rows]
        return title + "\n\n" + "\n".join(lines)
    widths = [max(len(str(row[i])) for row in rows + [head]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([title, fmt.format(*head)] + [fmt.format(*row) for row in rows])


def targets(results: Dict[str, Dict[str, float]]) -> Dict[str, bool]:
    base, ghost = results["backward"], results["ghost"]
    if "error" in base or "error" in ghost:
        return {}
    return {f"ghost peak <= {MEMORY_FACTOR:g}x backward + {MEMORY_SLACK_MB:g} MB":
            ghost["peak_mb"] <= MEMORY_FACTOR * base["peak_mb"] + MEMORY_SLACK_MB,
            f"ghost time <= {TIME_FACTOR:g}x backward":
            ghost["time_s"] <= TIME_FACTOR * base["time_s"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per method")
    parser.add_argument("--budget", type=float, default=20.0,
                        help="seconds of timed steps per method at most (after the first)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, what = args.child
        print(json.dumps(peak_here(what, args.batch) if kind == "peak" else
                         times_here(what.split(","), args.batch, args.repeats, args.budget)))
        return 0
    chosen = [m for m in METHODS if m in args.methods.split(",")]
    results = measure(chosen, args.batch, args.repeats, args.budget)
    results = {m: results.get(m, {"error": "not run"}) for m in METHODS}
    print(format_table(results, args.batch, args.markdown))
    met = targets(results)
    for what, ok in met.items():
        print(f"{what}: {'met' if ok else 'NOT met'}")
    return 0 if all(met.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
