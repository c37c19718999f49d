"""Real models compiled: ``functrans.compile`` (default tiered, and ``backend="inductor"``) beside
``torch.compile`` over the torch.func call, on the per-sample gradients and ensembles of
``tests/models/real/`` (issue 26, part 6).

    python -m benchmarks.real_models_compiled                      # every model, both workloads
    python -m benchmarks.real_models_compiled --models gpt2,bert --markdown real_compiled.md

Each cell runs in two fresh processes (``--child``, one JSON line each; a crash or a timeout
costs that cell only), each with an empty Inductor cache directory, so that every first call
is the cold one a new user pays:

* **functrans**: ``compile(fn, backend="inductor")`` first (its first calls: trace, Inductor,
  first run), then the default ``compile(fn)`` (its first calls: the eager call that traces and
  the first replay; then it is called until its graph is hot, the background Inductor
  compilation is awaited and the trial calls are made, so what is timed is its steady state,
  on the tier it settled on);
* **torch.compile(torch.func)**: ``torch.compile`` (inductor) around the same call made with
  torch.func.

Every result is checked against the plain eager loop first (a different answer fails the cell
and the command); a functrans function that ran eagerly says so in the outcome.  Then each
compiled function and torch.func eager are timed alternately in its process, ``--repeats``
rounds, one call each; the medians give the steady ratio to torch.func eager.  One torch
thread.  The timings of the two processes are independent ratios, each to the torch.func eager
of its own process.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch

WORKLOADS = ("per-sample grads", "ensemble")
TOL = dict(rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------ one process
def _cell(model_name: str, workload: str) -> Tuple[Callable, Callable]:
    """(run(lib), loop()) of one cell."""
    from tests.models.real import zoo
    spec = zoo.spec(model_name)
    if workload == "per-sample grads":
        model = spec.make(0)
        xs, ys = spec.batch()
        return (lambda lib: zoo.per_sample_grads(lib, spec, model, xs, ys),
                lambda: zoo.loop_per_sample_grads(spec, model, xs, ys))
    models = [spec.make(0), spec.make(1)]
    xs, _ = spec.batch()
    return (lambda lib: zoo.ensemble(lib, spec, models, xs),
            lambda: zoo.loop_ensemble(spec, models, xs))


def _interleaved(fns: Dict[str, Callable[[], object]], repeats: int) -> Dict[str, float]:
    times: Dict[str, List[float]] = {k: [] for k in fns}
    names = list(fns)
    for i in range(repeats):
        for name in (names if i % 2 == 0 else names[::-1]):
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def _first_two(fn: Callable[[], object]) -> Tuple[object, float]:
    start = time.perf_counter()
    out = fn()
    fn()
    return out, time.perf_counter() - start


def _outcome(compiled) -> dict:
    info = compiled.cache_info()
    out = {"eager_calls": info.eager_calls, "traces": info.misses}
    if info.eager_calls:
        out["eager_reason"] = info.eager_reason
    if info.entries:
        entry = info.entries[0]
        out["segments"] = entry.segments
        out["breaks"] = list(entry.breaks)
        out["tier"] = entry.tier.replace("tier: ", "", 1)
        out["backend"] = entry.backend
    return out


def child(model_name: str, workload: str, side: str, repeats: int) -> dict:
    import torch.func as tf

    import functrans as ft
    from tests.support.oracles import assert_same

    from .table import settle_tiers

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    run, loop = _cell(model_name, workload)
    expected = loop()
    eager = lambda: run(tf)                 # noqa: E731
    result: dict = {}
    try:
        eager()
    except Exception as e:                  # noqa: BLE001 - the user's workaround, as
        from .real_models import _with_math_attention   # benchmarks/real_models.py's
        result["tf_note"] = f"torch.func fails ({type(e).__name__}); its side with " \
                            "sdpa_kernel(MATH)"
        eager = lambda: _with_math_attention(lambda: run(tf))     # noqa: E731
        assert_same(eager(), expected, **TOL)
    if side == "torch.compile":
        compiled = torch.compile(eager)
        got, result["first_s"] = _first_two(compiled)
        assert_same(got, expected, **TOL)
        times = _interleaved({"torch.func": eager, "compiled": compiled}, repeats)
        result["ms"], result["tf_ms"] = 1e3 * times["compiled"], 1e3 * times["torch.func"]
        return result
    fns = {}
    for backend in ("inductor", "tiered"):
        compiled = ft.compile(lambda: run(ft), backend=backend)
        try:
            got, first = _first_two(compiled)
            assert_same(got, expected, **TOL)
            if backend == "tiered" and compiled.cache_info().entries:   # (none: eager)
                settle_tiers(compiled)
                assert_same(compiled(), expected, **TOL)
            result[backend] = {"first_s": first, **_outcome(compiled)}
            fns[backend] = compiled
        except Exception as e:          # noqa: BLE001 - the cell's outcome
            result[backend] = {"error": f"{type(e).__name__}: {str(e).strip()[:200]}"}
    times = _interleaved({"torch.func": eager, **fns}, repeats)
    result["tf_ms"] = 1e3 * times["torch.func"]
    for backend in fns:
        result[backend]["ms"] = 1e3 * times[backend]
    return result


# ------------------------------------------------------------------------------ the table
def _run_child(model_name: str, workload: str, side: str, repeats: int, timeout: float) -> dict:
    from .peak_memory import run_child
    return run_child("benchmarks.real_models_compiled",
                     ["--child", model_name, workload, side, "--repeats", str(repeats)],
                     timeout=timeout, measure_memory=False, cold_inductor_cache=True)


def _ft_outcome(r: dict) -> str:
    if "error" in r:
        return f"FAILS: {r['error']}"
    if r.get("eager_calls"):
        return f"eager: {r.get('eager_reason', '')}"
    out = "compiled"
    if r.get("segments", 1) > 1:
        breaks = "; ".join(re.sub(r"\S*/", "", b) for b in r.get("breaks", []))   # file names
        out += f", {r['segments']} segments ({breaks[:120]})"
    return out


def table(models: List[str], workloads: List[str], repeats: int, timeout: float
          ) -> Tuple[str, bool]:
    lines = [f"Real models compiled, CPU, 1 torch thread, torch {torch.__version__}; each cell "
             "in fresh processes with an empty Inductor cache (cold first calls); ratios: "
             "steady-state time / torch.func eager in the same process, median of "
             f"{repeats}. fti = functrans.compile(backend=\"inductor\"), default = "
             "functrans.compile (tiered), tfc = torch.compile(torch.func). First calls: the "
             "first two calls, in seconds.", "",
             "| model | workload | default outcome | default tier | default ratio | "
             "default first s | fti ratio | fti first s | tfc ratio | tfc first s | "
             "default / tfc |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    failed = False
    for name in models:
        for wl in workloads:
            ft_r = _run_child(name, wl, "functrans", repeats, timeout)
            tc_r = _run_child(name, wl, "torch.compile", repeats, timeout)
            if "error" in ft_r:
                tiered = inductor = {"error": ft_r["error"]}
                tf_ms = None
            else:
                tiered, inductor, tf_ms = ft_r["tiered"], ft_r["inductor"], ft_r["tf_ms"]
            failed |= "error" in tiered or bool(tiered.get("eager_calls"))

            dagger = "†" if "tf_note" in ft_r else ""

            def ratio(r, base):
                return f"{r['ms'] / base:.2f}{dagger}" if base and "ms" in r else "–"
            tc_ratio = f"{tc_r['ms'] / tc_r['tf_ms']:.2f}" if "ms" in tc_r else \
                f"fails: {tc_r.get('error', '')[:80]}"
            if "tf_note" in tc_r:
                tc_ratio += "†"
            vs = (f"{(tiered['ms'] / tf_ms) / (tc_r['ms'] / tc_r['tf_ms']):.2f}"
                  if "ms" in tiered and "ms" in tc_r and tf_ms else "–")
            tier = tiered.get("backend", "–")
            fti = ratio(inductor, tf_ms) if "error" not in inductor else \
                f"fails: {inductor['error'][:80]}"
            first = (lambda r: f"{r['first_s']:.1f}" if "first_s" in r else "–")
            lines.append(f"| {name} | {wl} | {_ft_outcome(tiered)} | {tier} | "
                         f"{ratio(tiered, tf_ms)} | {first(tiered)} | {fti} | "
                         f"{first(inductor)} | {tc_ratio} | {first(tc_r)} | {vs} |")
            print(lines[-1], file=sys.stderr, flush=True)
    if any("†" in line for line in lines):
        lines += ["", "† torch.func fails on this cell (sdpa's fused CPU kernel has no derivative "
                  "for what the workload differentiates); its eager and torch.compile sides "
                  "run with `sdpa_kernel(SDPBackend.MATH)`, the workaround a torch.func user has."]
    return "\n".join(lines), failed


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", help="comma-separated names (default: every model of the zoo)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per process")
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument("--child", nargs=3, metavar=("MODEL", "WORKLOAD", "SIDE"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        try:
            out = child(*args.child, repeats=args.repeats)
        except Exception as e:          # noqa: BLE001 - reported in the cell
            out = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
                   if str(e).strip() else type(e).__name__}
        print(json.dumps(out), flush=True)
        return 0
    from tests.models.real import zoo
    models = args.models.split(",") if args.models else list(zoo.MODELS)
    text, failed = table(models, args.workloads.split(","), args.repeats, args.timeout)
    from .real_models import emit
    return emit(text, args.markdown, failed)


if __name__ == "__main__":
    sys.exit(main())
