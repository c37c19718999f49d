"""The benchmark workloads under pytest-benchmark: one benchmark per (workload, implementation).

    .venv/bin/python -m pytest benchmarks/bench_workloads.py                  # everything
    .venv/bin/python -m pytest benchmarks/bench_workloads.py -k "hessian and functrans"

Each workload is checked once (no loop fallback, every implementation equal to torch.func)
before any of its implementations is timed; so are its compiled forms (``functrans.compile``
with the replay and inductor backends, each checked equal to torch.func and not running
eagerly), which are timed after their first calls.  The torch.compile(torch.func) anchor is
in ``python -m benchmarks`` only (it runs in a subprocess per row).  A workload whose
optional package is missing (the Opacus rows) is skipped with the reason; one with
``compiled=False`` has no compiled forms.  pytest-benchmark times
the implementations one after another; for ratios measured interleaved in one process, use
``python -m benchmarks`` (``make bench``), which prints the table the README shows.
"""
import pytest

from .table import check, compile_columns, skip_reason
from .workloads import COMPILED, IMPLS, WORKLOADS

_rows = {}


def _row(workload, device):
    if workload.id not in _rows:
        row = workload.build(device)
        check(row)
        errors = {}
        backends = tuple(COMPILED.values()) if workload.compiled else ()
        for name, col in compile_columns(row, backends).items():
            if "fn" in col:
                row.impls[name] = col["fn"]
            else:
                errors[name] = col["error"]
        _rows[workload.id] = row, errors
    return _rows[workload.id]


CASES = [(w, impl) for w in WORKLOADS for impl in IMPLS + tuple(COMPILED)]


@pytest.mark.parametrize("workload,impl", CASES, ids=[f"{w.id}-{impl}" for w, impl in CASES])
def test_workload(benchmark, device, workload, impl):
    reason = skip_reason(workload)
    if reason:
        pytest.skip(reason)
    row, errors = _row(workload, device)
    if impl in errors:
        pytest.fail(f"{impl}: {errors[impl]}")
    if impl not in row.impls:
        pytest.skip(f"{workload.name} has no {impl} form")
    benchmark.group = workload.id
    benchmark(row.impls[impl])
