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
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.utils._pytree as pytree

import functrans as ft

from .workloads import IMPLS, WORKLOADS, Row, Workload

README = Path(__file__).resolve().parent.parent / "README.md"


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
    names = [n for n in IMPLS if n in row.impls]
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


def run_workload(w: Workload, device, rounds: int, min_time: float) -> dict:
    result = {"workload": w.name, "size": w.size, "tier": w.tier, "times": {}, "error": None,
              "target": w.gpu_target if device.type == "cuda" else w.cpu_target}
    try:
        row = w.build(device)
        check(row)
        result["times"] = measure(row, device, rounds, min_time)
    except Exception as e:                      # a failed row is reported, not raised
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return result
    t = result["times"]
    result["ft/torch.func"] = t["functrans"] / t["torch.func"]
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


def format_table(results: List[dict], markdown: bool) -> str:
    head = ["workload", "size", "functrans ms", "torch.func ms", "loop ms", "closed form ms",
            "ft / torch.func", "loop / ft", "ft / closed", "target (ft / torch.func)"]
    rows = []
    for r in results:
        if r["error"]:
            rows.append([r["workload"], r["size"], "FAILED: " + r["error"]] + [""] * 7)
            continue
        t = r["times"]
        rows.append([r["workload"], r["size"], _ms(t["functrans"]), _ms(t["torch.func"]),
                     _ms(t["loop"]), _ms(t.get("closed form")), f"{r['ft/torch.func']:.2f}",
                     f"{r['loop/ft']:.1f}×",
                     f"{r['ft/closed form']:.2f}" if "ft/closed form" in r else "–", _target(r)])
    ok = [row for row in rows if not row[2].startswith("FAILED")]
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
        where = torch.cuda.get_device_name(device)
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
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    chosen = [w for w in WORKLOADS if args.filter.lower() in w.id.lower()
              and (args.tier is None or w.tier == args.tier)]
    print(describe(device), flush=True)
    results = []
    for w in chosen:
        r = run_workload(w, device, args.rounds, args.min_time)
        results.append(r)
        status = r["error"] or f"ft/torch.func {r['ft/torch.func']:.2f}, loop/ft {r['loop/ft']:.1f}×"
        print(f"  {w.id}: {status}", file=sys.stderr, flush=True)
    table = format_table(results, markdown=False)
    print(table)
    md = f"{describe(device)}\n\n{format_table(results, markdown=True)}"
    if args.markdown:
        Path(args.markdown).write_text(md + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": describe(device), "rows": results},
                                              indent=1))
    if args.update_readme:
        update_readme(md, device)
    failed = [r for r in results if r["error"]]
    missed = [r for r in results if r.get("met") is False]
    print(f"\n{len(results)} rows: {len(results) - len(failed)} checked, {len(failed)} failed; "
          f"targets met {sum(1 for r in results if r.get('met'))}, missed {len(missed)}"
          + (": " + ", ".join(f"{r['workload']} [{r['size']}]" for r in missed) if missed else ""))
    return 1 if failed else 0
