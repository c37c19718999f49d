"""The benchmark table: every workload run by functrans, torch.func, a Python loop and the
hand-batched closed form, interleaved in one process, checked, and printed side by side.

    make bench                                   # = .venv/bin/python -m benchmarks
    .venv/bin/python -m benchmarks --filter hessian --rounds 5
    .venv/bin/python -m benchmarks --markdown bench.md --update-readme   # refresh the README
    .venv/bin/python -m benchmarks --device cuda                         # on a GPU

For each row, before anything is timed: the functrans implementation runs under
``config.strict_fallback()`` inside ``record_fallbacks()``, so a workload that reaches the loop
fallback fails its row; then every implementation's result is compared with torch.func's.  A
failed row is printed as FAILED with the reason, and the command exits with status 1.

Timing: each implementation is first calibrated to a number of calls lasting about
``--min-time`` seconds; then, for ``--rounds`` rounds, every implementation is timed once per
round in a rotating order, so drift on a shared machine hits all of them alike.  The table shows
the median time per call and the ratios functrans / torch.func (below 1: functrans is faster)
and loop / functrans (the speedup over the loop).  CPU runs use one torch thread.

Compiled columns (a second table): the functrans callable of each row compiled whole with
``functrans.compile(..., backend="replay")`` and ``backend="inductor"`` (``strict=True``), timed
interleaved with the others; the anchor ``torch.compile`` over the torch.func callable
(inductor) runs in a subprocess per row (benchmarks/anchor.py), so a torch.compile crash costs
one cell and nothing else.  Before timing, every compiled result is checked equal to
torch.func's, and a compiled function that ran eagerly or retraced on its second call fails its
cell.  Ratios are steady-state times over torch.func eager measured in the same process; the
first calls (trace or compile, plus the first replay) are reported per row, after one warm-up
per process (importing dynamo, the first make_fx, inductor's first compile) reported apart.
``--no-anchor`` skips the subprocess column, ``--backends replay`` the inductor one.

Peak memory (``--memory``, opt-in: a subprocess per cell, about 3-5 s each): for each row, the
implementations of ``--memory-impls`` (default: functrans and torch.func eager, the functrans
callable compiled by each backend, torch.compile(torch.func)) each run in a fresh process (benchmarks/cell_memory.py, with
benchmarks/peak_memory.py's ``MALLOC_MMAP_THRESHOLD_=65536``): two warm-up calls, then one call
whose peak above the resident set before it is read from ``VmHWM`` (reset before the call; on
CUDA ``max_memory_allocated``).  The table then has a ``peak MB`` column per implementation
, the ratio functrans / torch.func and the largest compiled peak over functrans eager's.

A row that needs an optional package that is missing (the Opacus rows, benchmarks/opacus_rows.py)
is printed as SKIPPED with the reason and how to install it; it neither fails nor counts as
checked.  Rows without a Python loop (the Opacus rows) show "–" in the loop columns, and rows
whose workload has ``compiled=False`` are left out of the compiled table.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.utils._pytree as pytree

import functrans as ft

from . import peak_memory
from .workloads import (ANCHOR, COMPILED, FIRST_CALL_S, INDUCTOR_VS_ANCHOR, TIERED_FIRST_CALL_S,
                        TIERED_VS_ANCHOR_FIRST, WORKLOADS, Row,
                        Workload)

README = Path(__file__).resolve().parent.parent / "README.md"
COLD_INDUCTOR_CACHE = True     # each anchor process compiles with an empty Inductor cache
MEMORY_IMPLS = ("functrans", "torch.func", "ft.compile tiered", "ft.compile replay",
                "ft.compile inductor", "torch.compile(torch.func)")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _assert_agree(got, want, row: Row, what: str) -> None:
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    if got_spec != want_spec:
        raise AssertionError(f"{what}: result structure {got_spec} differs from torch.func's "
                             f"{want_spec}")
    for g, w in zip(got_leaves, want_leaves):
        torch.testing.assert_close(g, w, rtol=row.rtol, atol=row.atol, msg=lambda m: f"{what}: {m}")


def check(row: Row) -> None:
    """Fail if functrans hits the loop fallback or any result differs from torch.func's."""
    with ft.record_fallbacks() as report, ft.config.strict_fallback():
        got = row.impls["functrans"]()
    if len(report):
        raise AssertionError(f"functrans ran the loop fallback: {report}")
    want = row.impls["torch.func"]()
    for name, fn in row.impls.items():
        if name != "torch.func":
            _assert_agree(got if name == "functrans" else fn(), want, row, name)


def _time_calls(fn, n: int, device) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / n


def measure(row: Row, device, rounds: int, min_time: float) -> Dict[str, float]:
    """Median seconds per call of every implementation, interleaved over ``rounds`` rounds."""
    names = list(row.impls)
    calls = {}
    for name in names:
        once = _time_calls(row.impls[name], 1, device)
        calls[name] = max(1, min(1000, math.ceil(min_time / max(once, 1e-7))))
    samples: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            samples[name].append(_time_calls(row.impls[name], calls[name], device))
    return {n: statistics.median(s) for n, s in samples.items()}


def _why(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:160]}" if text else type(e).__name__


def warm_up(backends=tuple(COMPILED.values())) -> Dict[str, float]:
    """One-time process costs, paid here so that no row's first call carries them: importing
    torch._dynamo (the first make_fx does), forward-AD's decompositions, inductor's first
    compile.  Seconds per backend."""
    x = torch.randn(2, 3)
    out = {}
    for backend in backends:
        start = time.perf_counter()
        fn = ft.compile(ft.vmap(ft.jacfwd(ft.jacrev(torch.sin))), backend=backend)
        fn(x)
        fn(x)
        out[backend] = time.perf_counter() - start
    return out


def compile_columns(row: Row, backends) -> Dict[str, dict]:
    """Each backend's compiled functrans callable, checked: ``{name: {"fn", "first_calls_s"}}``
    or ``{name: {"error"}}``.  Adds nothing to ``row``."""
    want = row.impls["torch.func"]()
    out = {}
    for name, backend in COMPILED.items():
        if backend not in backends:
            continue
        try:
            fn = ft.compile(row.impls["functrans"], backend=backend, strict=True)
            start = time.perf_counter()
            first = fn()
            second = fn()
            seconds = time.perf_counter() - start
            info = fn.cache_info()
            if info.eager_calls or info.misses != 1:
                raise AssertionError(f"not compiled: {info.eager_calls} eager calls "
                                     f"({info.eager_reason}), {info.misses} traces")
            _assert_agree(first, want, row, name)
            _assert_agree(second, want, row, name)
            out[name] = {"fn": fn, "first_calls_s": seconds}
            if backend == "tiered":
                out[name]["tier"] = settle_tiers(
                    fn, lambda got, name=name: _assert_agree(got, want, row, name))
        except Exception as e:                  # the cell fails, the row goes on
            out[name] = {"error": _why(e)}
    return out


def settle_tiers(fn, check=lambda got: None) -> str:
    """Call the tiered function (of no arguments) until its graph is hot, wait for the
    background compilation, and call it through the trial (``check`` sees each result), so that
    the calls after it are its steady state; the tier it settled on ("inductor" or "replay")
    and why."""
    from functrans.compiler import tiering
    start = time.perf_counter()
    for _ in range(tiering.HOT_CALLS + tiering.HOT_MANY_CALLS + 10):
        fn()
        if time.perf_counter() - start > 2 * tiering.HOT_SECONDS + 0.05 and \
                "replay (" not in fn.cache_info().entries[0].tier:
            break
    fn.wait(timeout=900)
    for _ in range(2 * tiering.TRIAL_MAX_CALLS + 6):     # the check, then the trial
        check(fn())
        if "on trial" not in fn.cache_info().entries[0].tier:
            break
    for _ in range(2):
        check(fn())
    entry = fn.cache_info().entries[0]
    return entry.tier.replace("tier: ", "", 1)


def run_anchor(w: Workload, device, rounds: int, min_time: float, timeout: float) -> dict:
    """The torch.compile(torch.func) column, measured by benchmarks/anchor.py in a subprocess
    (with an empty Inductor cache of its own unless the run keeps the usual on-disk one)."""
    out = peak_memory.run_child("benchmarks.anchor", [w.id, "--device", str(device), "--rounds",
                                                      str(rounds), "--min-time", str(min_time)],
                                timeout=timeout, measure_memory=False,
                                cold_inductor_cache=COLD_INDUCTOR_CACHE)
    error = out.get("error", "")
    if error.startswith("exit "):               # "exit N: why" -> "crashed (exit N): why"
        code, _, why = error[len("exit "):].partition(": ")
        out["error"] = f"crashed (exit {code}): {why}"
    return out


def _compiled_targets(w: Workload, r: dict) -> List[tuple]:
    """``[(label, met)]`` for issue 15's targets that apply to this row (CPU)."""
    out = []
    c, anchor = r["compiled"], r.get("anchor")
    replay, inductor = c.get("ft.compile replay", {}), c.get("ft.compile inductor", {})
    if "ratio" in replay and w.replay_target is not None:
        out.append((f"replay ≤ {w.replay_target:g}", replay["ratio"] <= w.replay_target))
    if "first_calls_s" in replay and w.tier == "small" and "error" not in replay:
        out.append((f"first calls < {FIRST_CALL_S:g} s", replay["first_calls_s"] < FIRST_CALL_S))
    tiered = c.get("ft.compile tiered", {})
    if "first_calls_s" in tiered and w.tier == "small":
        out.append((f"tiered first calls ≤ {TIERED_FIRST_CALL_S:g} s",
                    tiered["first_calls_s"] <= TIERED_FIRST_CALL_S))
    if anchor is not None and "ratio" in tiered and "ratio" in anchor:
        out.append(("tiered ≤ 1× torch.compile", tiered["ratio"] <= anchor["ratio"]))
    if anchor is not None and "first_calls_s" in tiered and "first_calls_s" in anchor:
        out.append((f"tiered first calls ≤ {TIERED_VS_ANCHOR_FIRST:g}× torch.compile's",
                    tiered["first_calls_s"] <= TIERED_VS_ANCHOR_FIRST * anchor["first_calls_s"]))
    if anchor is not None and inductor:
        if "ratio" in anchor:
            if "ratio" in inductor:
                out.append((f"inductor ≤ {INDUCTOR_VS_ANCHOR:g}× torch.compile",
                             inductor["ratio"] <= INDUCTOR_VS_ANCHOR * anchor["ratio"]))
        else:                                   # torch.compile fails: inductor must run
            out.append(("inductor runs", "error" not in inductor))
    return out


def run_memory(w: Workload, device, impl: str, timeout: float = 600.0) -> dict:
    """One peak-memory cell: ``impl`` of ``w`` in its own process (benchmarks/cell_memory.py):
    ``{"peak_mb"}`` or ``{"error"}``."""
    return peak_memory.run_child("benchmarks.cell_memory", [w.id, impl, "--device", str(device)],
                                 timeout=timeout)


def skip_reason(w: Workload) -> Optional[str]:
    """Why ``w`` cannot run here (an optional package it needs is missing), or None."""
    if w.requires is None or importlib.util.find_spec(w.requires) is not None:
        return None
    if w.requires == "opacus":
        from .opacus_rows import MISSING
        return MISSING
    return f"{w.requires} is not installed"


def run_workload(w: Workload, device, rounds: int, min_time: float,
                 backends=tuple(COMPILED.values()), anchor: bool = True,
                 anchor_timeout: float = 600.0, memory: Tuple[str, ...] = ()) -> dict:
    result = {"workload": w.name, "size": w.size, "tier": w.tier, "times": {}, "error": None,
              "target": w.gpu_target if device.type == "cuda" else w.cpu_target,
              "compiled": {}, "skipped": skip_reason(w), "compiles": w.compiled}
    if result["skipped"]:
        return result
    if not w.compiled:
        backends, anchor = (), False
    try:
        row = w.build(device)
        check(row)
        compiled = compile_columns(row, backends)
        for name, col in compiled.items():
            if "fn" in col:
                row.impls[name] = col.pop("fn")
        result["compiled"] = compiled
        result["times"] = measure(row, device, rounds, min_time)
    except Exception as e:                      # a failed row is reported, not raised
        result["error"] = _why(e)
        return result
    t = result["times"]
    for name, col in result["compiled"].items():
        if name in t:
            col["time"], col["ratio"] = t[name], t[name] / t["torch.func"]
    if anchor:
        result["anchor"] = run_anchor(w, device, rounds, min_time, anchor_timeout)
    if memory:
        result["memory"] = {impl: run_memory(w, device, impl, anchor_timeout)
                            for impl in memory if impl in row.impls
                            or w.compiled and (impl in COMPILED or impl == ANCHOR)}
    if device.type == "cpu":
        result["compiled_targets"] = _compiled_targets(w, result)
    t = result["times"]
    result["ft/torch.func"] = t["functrans"] / t["torch.func"]
    if "loop" in t:
        result["loop/ft"] = t["loop"] / t["functrans"]
    if "closed form" in t:
        result["ft/closed form"] = t["functrans"] / t["closed form"]
    result["met"] = None if result["target"] is None else result["ft/torch.func"] <= result["target"]
    return result


def _ms(seconds: Optional[float]) -> str:
    if seconds is None:
        return "–"
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


def _target(r: dict) -> str:
    if r["target"] is None:
        return "–"
    return f"≤ {r['target']:g} {'met' if r['met'] else 'MISSED'}"


def _render(head: List[str], rows: List[List[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max([len(h)] + [len(row[i]) for row in rows if i < len(row)])
              for i, h in enumerate(head)]
    fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(row) for row in rows])


def _ratio_cell(col: Optional[dict], anchor: bool = False) -> str:
    """The ratio; a functrans column that failed says FAILED, the anchor says how it failed."""
    if col is None:
        return "–"
    if "error" in col:
        return col["error"] if anchor else "FAILED: " + col["error"]
    return _r(col["ratio"])


def _r(ratio: float) -> str:
    return f"{ratio:.3f}" if ratio < 0.1 else f"{ratio:.2f}"


def format_compiled_table(results: List[dict], markdown: bool) -> str:
    """The compiled columns: times, ratios over torch.func eager, first calls, targets."""
    head = ["workload", "size", "torch.func ms", "replay ms", "inductor ms",
            "replay / torch.func", "inductor / torch.func", f"{ANCHOR} / torch.func",
            "inductor / torch.compile", "tiered / torch.func", "tiered / torch.compile",
            "tiered settled on", "replay first calls ms", "tiered first calls ms",
            "inductor first calls s", "torch.compile first calls s", "targets"]
    rows = []
    for r in results:
        if r.get("skipped") or not r.get("compiles", True):
            continue
        if r["error"]:
            rows.append([r["workload"], r["size"], "FAILED: " + r["error"]])
            continue
        c, a = r["compiled"], r.get("anchor")
        rep_, ind = c.get("ft.compile replay"), c.get("ft.compile inductor")
        tie = c.get("ft.compile tiered")
        both = ind is not None and a is not None and "ratio" in ind and "ratio" in a
        tie_both = tie is not None and a is not None and "ratio" in tie and "ratio" in a
        targets = r.get("compiled_targets") or []
        rows.append([
            r["workload"], r["size"], _ms(r["times"]["torch.func"]),
            _ms(rep_.get("time")) if rep_ else "–", _ms(ind.get("time")) if ind else "–",
            _ratio_cell(rep_), _ratio_cell(ind), _ratio_cell(a, anchor=True),
            _r(ind["ratio"] / a["ratio"]) if both else "–",
            _ratio_cell(tie), _r(tie["ratio"] / a["ratio"]) if tie_both else "–",
            (tie.get("tier", "–").split(":")[0] or "–") if tie else "–",
            _ms(rep_.get("first_calls_s")) if rep_ else "–",
            _ms(tie.get("first_calls_s")) if tie else "–",
            f"{ind['first_calls_s']:.1f}" if ind and "first_calls_s" in ind else "–",
            f"{a['first_calls_s']:.1f}" if a and "first_calls_s" in a else "–",
            ", ".join(f"{label} {'met' if met else 'MISSED'}" for label, met in targets) or "–"])
    return _render(head, rows, markdown)


def _memory_impls(results: List[dict]) -> List[str]:
    """The implementations with a peak-memory cell in any row, in the order measured."""
    seen: List[str] = []
    for r in results:
        seen += [impl for impl in r.get("memory", {}) if impl not in seen]
    return seen


def _peak_cell(cell: Optional[dict]) -> str:
    if cell is None:
        return "–"
    if "error" in cell:
        return "FAILED: " + cell["error"]
    mb = cell["peak_mb"]
    return f"{mb:.2f}" if mb < 10 else f"{mb:,.0f}"


def _compiled_over_eager(cells: Dict[str, dict]) -> str:
    """The largest peak of the functrans.compile cells over functrans eager's (issue 26: a
    compiled function's peak is at most eager's), with which backend it is."""
    eager = cells.get("functrans", {}).get("peak_mb", 0)
    compiled = [(c["peak_mb"], impl.replace("ft.compile ", "")) for impl, c in cells.items()
                if impl.startswith("ft.compile") and "peak_mb" in c]
    if eager <= 0 or not compiled:
        return "–"
    mb, backend = max(compiled)
    return f"{mb / eager:.2f} ({backend})"


def format_table(results: List[dict], markdown: bool) -> str:
    head = ["workload", "size", "functrans ms", "torch.func ms", "loop ms", "closed form ms",
            "ft / torch.func", "loop / ft", "ft / closed", "target (ft / torch.func)"]
    mem = _memory_impls(results)
    if mem:
        head += [f"{impl} peak MB" for impl in mem] + ["peak ft / torch.func",
                                                          "peak ft.compile / ft eager"]
    pad = len(head) - 3
    rows = []
    for r in results:
        if r.get("skipped"):
            rows.append([r["workload"], r["size"], "SKIPPED: " + r["skipped"]] + [""] * pad)
            continue
        if r["error"]:
            rows.append([r["workload"], r["size"], "FAILED: " + r["error"]] + [""] * pad)
            continue
        t = r["times"]
        row = [r["workload"], r["size"], _ms(t["functrans"]), _ms(t["torch.func"]),
               _ms(t.get("loop")), _ms(t.get("closed form")), f"{r['ft/torch.func']:.2f}",
               f"{r['loop/ft']:.1f}×" if "loop/ft" in r else "–",
               f"{r['ft/closed form']:.2f}" if "ft/closed form" in r else "–", _target(r)]
        if mem:
            cells = r.get("memory", {})
            row += [_peak_cell(cells.get(impl)) for impl in mem]
            ft_, tf = cells.get("functrans", {}), cells.get("torch.func", {})
            row.append(f"{ft_['peak_mb'] / tf['peak_mb']:.2f}"
                       if tf.get("peak_mb", 0) > 0 and "peak_mb" in ft_ else "–")
            row.append(_compiled_over_eager(cells))
        rows.append(row)
    ok = [row for row in rows if not row[2].startswith(("FAILED", "SKIPPED"))]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row if row in ok else row[:3]) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max([len(h)] + [len(row[i]) for row in (rows if i < 2 else ok)])
              for i, h in enumerate(head)]
    fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(row) for row in rows])


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}"
    else:
        where = f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} torch thread(s)"
    return (f"{where}; torch {torch.__version__}, functrans {ft.__version__}, Python "
            f"{platform.python_version()}; {datetime.date.today().isoformat()}")


def update_readme(markdown: str, device: torch.device, readme: Path = README) -> None:
    kind = "gpu" if device.type == "cuda" else "cpu"
    start, end = f"<!-- bench:{kind}:start -->", f"<!-- bench:{kind}:end -->"
    text = readme.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"{readme} has no {start} ... {end} section to update")
    new = re.sub(re.escape(start) + r".*?" + re.escape(end),
                 lambda _: f"{start}\n{markdown}\n{end}", text, flags=re.S)
    readme.write_text(new)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--filter", default="", help="only workloads whose name or size contains this")
    ap.add_argument("--tier", choices=("small", "medium", "large"), help="only this tier")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--min-time", type=float, default=0.05,
                    help="seconds of calls per timed sample (default 0.05)")
    ap.add_argument("--markdown", metavar="FILE", help="also write the table as markdown")
    ap.add_argument("--json", metavar="FILE", help="also write the raw results as JSON")
    ap.add_argument("--update-readme", action="store_true",
                    help="replace the README's table for this device kind with this run's")
    ap.add_argument("--backends", default=",".join(COMPILED.values()),
                    help="functrans.compile backends to time (comma-separated; '' for none)")
    ap.add_argument("--no-anchor", action="store_true",
                    help="skip the torch.compile(torch.func) column (a subprocess per row)")
    ap.add_argument("--anchor-timeout", type=float, default=600.0,
                    help="seconds one row's torch.compile subprocess may take")
    ap.add_argument("--memory", action="store_true",
                    help="add peak-memory columns (a subprocess per cell: slower)")
    ap.add_argument("--memory-impls", default=",".join(MEMORY_IMPLS),
                    help="implementations measured by --memory (comma-separated)")
    ap.add_argument("--warm-inductor-cache", action="store_true",
                    help="compile with Inductor's usual on-disk cache (default: an empty one "
                         "for this run, so that first calls are those of a new user)")
    args = ap.parse_args(argv)
    memory = tuple(i for i in args.memory_impls.split(",") if i) if args.memory else ()
    global COLD_INDUCTOR_CACHE
    COLD_INDUCTOR_CACHE = not args.warm_inductor_cache
    if COLD_INDUCTOR_CACHE:
        import tempfile
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cache-")
    backends = tuple(b for b in args.backends.split(",") if b)

    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    chosen = [w for w in WORKLOADS if args.filter.lower() in w.id.lower()
              and (args.tier is None or w.tier == args.tier)]
    print(describe(device), flush=True)
    setup = warm_up(backends) if backends else {}
    setup_line = ("One-time process setup before the rows (dynamo import, first make_fx, "
                  "inductor's first compile), functrans.compile: " + ", ".join(
                      f"{b} {s:.1f} s" for b, s in setup.items())) if setup else ""
    if setup_line:
        print(setup_line, flush=True)
    results = []
    for w in chosen:
        r = run_workload(w, device, args.rounds, args.min_time, backends,
                         anchor=not args.no_anchor, anchor_timeout=args.anchor_timeout,
                         memory=memory)
        results.append(r)
        status = r["skipped"] or r["error"]
        if not status:
            loop = f", loop/ft {r['loop/ft']:.1f}×" if "loop/ft" in r else ""
            cells = [f"{n} {_ratio_cell(c)}" for n, c in r["compiled"].items()]
            if "anchor" in r:
                cells.append(f"{ANCHOR} {_ratio_cell(r['anchor'], anchor=True)}")
            cells += [f"{impl} peak {_peak_cell(c)} MB" for impl, c in r.get("memory", {}).items()]
            status = f"ft/torch.func {r['ft/torch.func']:.2f}{loop}" + "".join(
                "; " + c for c in cells)
        print(f"  {w.id}: {status}", file=sys.stderr, flush=True)
    table = format_table(results, markdown=False)
    print(table)
    compiled = any(r["compiled"] or "anchor" in r for r in results)
    if compiled:
        print("\nCompiled (ratios: steady-state time / torch.func eager)\n")
        print(format_compiled_table(results, markdown=False))
    md = f"{describe(device)}\n\n{format_table(results, markdown=True)}"
    if compiled:
        cache = ("each Inductor compilation from an empty cache" if COLD_INDUCTOR_CACHE
                 else "Inductor's on-disk cache as found")
        md += (f"\n\nCompiled: functrans.compile (tiered = the default, replay, inductor) and "
               f"{ANCHOR} (inductor, whole call); {cache}."
               f"{' ' + setup_line + '.' if setup_line else ''}\n\n"
               f"{format_compiled_table(results, markdown=True)}")
    if args.markdown:
        Path(args.markdown).write_text(md + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": describe(device), "rows": results},
                                              indent=1))
    if args.update_readme:
        update_readme(md, device)
    failed = [r for r in results if r["error"]
              or any("error" in c for c in r["compiled"].values())]
    missed = [r for r in results if r.get("met") is False]
    skipped = [r for r in results if r.get("skipped")]
    print(f"\n{len(results)} rows: {len(results) - len(failed) - len(skipped)} checked, "
          f"{len(failed)} failed, {len(skipped)} skipped; "
          f"targets met {sum(1 for r in results if r.get('met'))}, missed {len(missed)}"
          + (": " + ", ".join(f"{r['workload']} [{r['size']}]" for r in missed) if missed else ""))
    if compiled:
        ct = [(r, label, met) for r in results for label, met in r.get("compiled_targets", [])]
        cmissed = [f"{r['workload']} [{r['size']}] {label}" for r, label, met in ct if not met]
        print(f"compiled targets met {len(ct) - len(cmissed)}, missed {len(cmissed)}"
              + (": " + "; ".join(cmissed) if cmissed else ""))
    return 1 if failed else 0
