"""The anchor column: ``torch.compile`` (inductor) over one row's whole torch.func call, measured
in its own process.

    .venv/bin/python -m benchmarks.anchor "hessian[D=64]" --rounds 7 --min-time 0.05

benchmarks/table.py runs this once per row as a subprocess, so that a torch.compile failure (an
internal assert inside dynamo can leave the process unable to compile anything after it) or a
crash of the interpreter costs that one cell and nothing else.  The process warms up first
(imports dynamo and inductor and compiles a one-line function, reported as ``setup_s``), so the
row's compile time is that row's own.  The compiled result is checked equal to torch.func eager;
then the two are timed interleaved, and the last line of stdout is a JSON object: ``ratio``
(torch.compile / torch.func eager, steady state), ``times``, ``first_calls_s`` (the first two
calls: compile + first run), ``setup_s``; or ``error``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from .workloads import ANCHOR, WORKLOADS


def warm_up() -> float:
    """Seconds to import dynamo and inductor and compile and run a one-line function (once per
    process)."""
    start = time.perf_counter()
    fn = torch.compile(lambda x: x.sin() + 1)
    fn(torch.randn(3))
    fn(torch.randn(3))
    return time.perf_counter() - start


def run(workload_id: str, device: torch.device, rounds: int, min_time: float) -> dict:
    from .table import _assert_agree, measure
    (w,) = [w for w in WORKLOADS if w.id == workload_id]
    setup = warm_up()
    torch.manual_seed(0)
    row = w.build(device)
    eager = row.impls["torch.func"]
    compiled = torch.compile(eager)
    start = time.perf_counter()
    got = compiled()
    compiled()
    first = time.perf_counter() - start
    _assert_agree(got, eager(), row, ANCHOR)
    row.impls = {"torch.func": eager, ANCHOR: compiled}
    times = measure(row, device, rounds, min_time)
    return {"ratio": times[ANCHOR] / times["torch.func"], "times": times,
            "first_calls_s": first, "setup_s": setup}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.anchor",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", help="a workload id, e.g. 'hessian[D=64]'")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--min-time", type=float, default=0.05)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        out = run(args.workload, device, args.rounds, args.min_time)
    except Exception as e:                       # reported in the cell, the process ends cleanly
        out = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
               if str(e).strip() else type(e).__name__}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
