"""Peak memory and time of ``jacrev(f, chunk_size=...)``: unchunked, ``chunk_size="auto"`` under
``functrans.config.max_memory(512 MB)`` and a fixed chunk, side by side (issue 27).

    .venv/bin/python -m benchmarks.chunk_memory              # both workloads below
    .venv/bin/python -m benchmarks.chunk_memory --markdown --budget-mb 256 --fixed 64

Workloads (float32, one torch thread, CPU), each a map R^n -> R^n:

* ``tanh(W @ x)``, n = 4096 (a 4096x4096 layer): each cotangent's backward makes a few
  n-vectors, so the whole batch of n cotangents holds a few n x n blocks (64 MB each);
* ``tanh((W * x).sum(1))``, n = 1024 (the same layer written as a broadcast product): each
  cotangent's backward makes an n x n product, so the whole batch holds n^3 floats (4 GB).

Methods: ``chunk_size=None`` (unchunked), ``"auto"`` under ``max_memory(--budget-mb)`` (the
probes on fake tensors are part of every timed call) and ``--fixed``.  Each (workload, method)
runs in its own subprocess (benchmarks/peak_memory.py: ``MALLOC_MMAP_THRESHOLD_=65536``, the
high-water mark reset before the call, ``VmHWM`` after): one warm-up call, one measured call
(peak above the inputs and the process's peak), then ``--repeats`` timed calls (median).  The
chunk that ``"auto"`` chose is read from ``functrans.batching.chunking.last_choice()``.  Every
result is checked equal to ``chunk_size=64``'s in the same process (before the measured
call).

Target (issue 27): ``"auto"`` under 512 MB peaks at <= 1.5 GB (the process) on the first
workload.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch

from . import peak_memory

WORKLOADS = {"tanh(W @ x)": 4096, "tanh((W * x).sum(1))": 1024}
METHODS = ("unchunked", "auto", "fixed")
TARGET_GB = 1.5


def _problem(name: str) -> Tuple[Callable, torch.Tensor]:
    torch.manual_seed(0)
    n = WORKLOADS[name]
    w, x = torch.randn(n, n) / n ** 0.5, torch.randn(n)
    if name == "tanh(W @ x)":
        return (lambda v: torch.tanh(w @ v)), x
    return (lambda v: torch.tanh((w * v).sum(1))), x


def run_here(name: str, method: str, budget_mb: int, fixed: int, repeats: int) -> dict:
    """One (workload, method) in this process: peak, chosen chunk, median time."""
    import functrans as ft
    from functrans.batching import chunking
    torch.set_num_threads(1)
    f, x = _problem(name)
    chunk = {"unchunked": None, "auto": "auto", "fixed": fixed}[method]
    jac = ft.jacrev(f, chunk_size=chunk)

    def call():
        with ft.config.max_memory(budget_mb * 2 ** 20):
            return jac(x)
    want = ft.jacrev(f, chunk_size=64)(x)          # the reference, in chunks of 64
    got = call()                                    # warm-up
    torch.testing.assert_close(got, want)
    del got, want
    out = peak_memory.peak_above(call)
    choice = chunking.last_choice() if method == "auto" else None
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        got = call()
        times.append(time.perf_counter() - start)
        del got
    out.update(time_s=statistics.median(times),
               chunk=(choice.chunk_size or WORKLOADS[name]) if choice else
               (WORKLOADS[name] if chunk is None else chunk),
               reason=choice.reason if choice else "")
    return out


def measure(names: List[str], methods: List[str], budget_mb: int, fixed: int,
            repeats: int) -> Dict[str, Dict[str, dict]]:
    return {name: {m: peak_memory.run_child(
        "benchmarks.chunk_memory", ["--child", name, m, "--budget-mb", str(budget_mb),
                                    "--fixed", str(fixed), "--repeats", str(repeats)])
        for m in methods} for name in names}


def format_table(results: Dict[str, Dict[str, dict]], budget_mb: int, fixed: int,
                 markdown: bool) -> str:
    head = ["workload", "chunk_size", "chunk", "peak above inputs (MB)", "process peak (MB)",
            "time (s)"]
    rows = []
    for name, per in results.items():
        for m, r in per.items():
            label = {"unchunked": "None", "auto": f'"auto", {budget_mb} MB',
                     "fixed": str(fixed)}[m]
            if "error" in r:
                rows.append([name, label, r["error"], "", "", ""])
                continue
            rows.append([name, label, str(r["chunk"]), f"{r['peak_mb']:,.0f}",
                         f"{r['process_peak_mb']:,.0f}", f"{r['time_s']:.2f}"])
    if markdown:
        lines = [f"| {' | '.join(head)} |", "|" + "---|" * len(head)]
        return "\n".join(lines + [f"| {' | '.join(row)} |" for row in rows])
    widths = [max(len(row[i]) for row in rows + [head]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*row) for row in rows])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.chunk_memory",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-mb", type=int, default=512, help="max_memory for 'auto' (MB)")
    ap.add_argument("--fixed", type=int, default=256, help="the fixed chunk size")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per method")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help="comma-separated: " + ", ".join(WORKLOADS))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_here(*args.child, args.budget_mb, args.fixed, args.repeats)))
        return 0
    names = [n for n in WORKLOADS if n in args.workloads.split(",")]
    methods = [m for m in METHODS if m in args.methods.split(",")]
    results = measure(names, methods, args.budget_mb, args.fixed, args.repeats)
    print(format_table(results, args.budget_mb, args.fixed, args.markdown))
    first = results.get("tanh(W @ x)", {}).get("auto", {})
    if "process_peak_mb" in first and args.budget_mb == 512:
        ok = first["process_peak_mb"] <= TARGET_GB * 1024
        print(f'"auto" under 512 MB peaks <= {TARGET_GB:g} GB: {"met" if ok else "NOT met"}')
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
