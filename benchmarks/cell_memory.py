"""The peak-memory cells of the benchmark table (``python -m benchmarks --memory``): one row's
one implementation, measured in its own process.

    .venv/bin/python -m benchmarks.cell_memory "hessian[D=64]" functrans

benchmarks/table.py runs this once per (row, implementation) as a subprocess, with
benchmarks/peak_memory.py's environment (``MALLOC_MMAP_THRESHOLD_=65536``), so that no other
cell's freed memory can hide this one's peak.  The process builds the row, calls the
implementation twice (warm-up: lazy caches, a compiled implementation's trace or compile), then
measures one call: on the CPU its peak above the resident set before it (``VmHWM`` after
resetting it, ``peak_memory.peak_above``); on CUDA ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``, minus the memory allocated before.  What counts is what the call
adds: its activations, temporaries, per-example values and result, not the row's inputs and
parameters (built before).  The last line of stdout is a JSON object: ``peak_mb``, or
``error``.

Implementations: the row's own (``functrans``, ``torch.func``, ``loop``, ``closed form``),
``ft.compile tiered`` / ``ft.compile replay`` / ``ft.compile inductor`` (``functrans.compile``
of the functrans callable; the tiered one measured after it settled on its tier)
and ``torch.compile(torch.func)``.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from . import peak_memory
from .workloads import ANCHOR, COMPILED, WORKLOADS


def implementation(row, impl: str):
    """The zero-argument callable of ``impl`` for ``row``."""
    if impl in row.impls:
        return row.impls[impl]
    if impl in COMPILED:
        import functrans as ft
        return ft.compile(row.impls["functrans"], backend=COMPILED[impl])
    if impl == ANCHOR:
        return torch.compile(row.impls["torch.func"])
    raise KeyError(f"{impl!r} is not an implementation of this row ({sorted(row.impls)})")


def run(workload_id: str, impl: str, device: torch.device) -> dict:
    (w,) = [w for w in WORKLOADS if w.id == workload_id]
    torch.manual_seed(0)
    row = w.build(device)
    fn = implementation(row, impl)
    fn()
    fn()                                         # warm-up (a compiled one: its first calls)
    if impl == "ft.compile tiered":              # its steady state: on the tier it settles on
        from .table import settle_tiers
        settle_tiers(fn)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del out
        return {"peak_mb": peak / 2 ** 20}
    return {"peak_mb": peak_memory.peak_above(fn)["peak_mb"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cell_memory",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", help="a workload id, e.g. 'hessian[D=64]'")
    ap.add_argument("impl", help="an implementation, e.g. functrans")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        out = run(args.workload, args.impl, device)
    except Exception as e:                       # reported in the cell, the process ends cleanly
        text = str(e).strip()
        out = {"error": f"{type(e).__name__}: {text.splitlines()[0][:160]}" if text
               else type(e).__name__}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
