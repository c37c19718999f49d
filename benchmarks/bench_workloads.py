"""The benchmark workloads under pytest-benchmark: one benchmark per (workload, implementation).

    .venv/bin/python -m pytest benchmarks/bench_workloads.py                  # everything
    .venv/bin/python -m pytest benchmarks/bench_workloads.py -k "hessian and functrans"

Each workload is checked once (no loop fallback, every implementation equal to torch.func)
before any of its implementations is timed.  pytest-benchmark times the implementations one
after another; for ratios measured interleaved in one process, use ``python -m benchmarks``
(``make bench``), which prints the table the README shows.
"""
import pytest

from .table import check
from .workloads import IMPLS, WORKLOADS

_rows = {}


def _row(workload, device):
    if workload.id not in _rows:
        row = workload.build(device)
        check(row)
        _rows[workload.id] = row
    return _rows[workload.id]


CASES = [(w, impl) for w in WORKLOADS for impl in IMPLS]


@pytest.mark.parametrize("workload,impl", CASES, ids=[f"{w.id}-{impl}" for w, impl in CASES])
def test_workload(benchmark, device, workload, impl):
    row = _row(workload, device)
    if impl not in row.impls:
        pytest.skip(f"{workload.name} has no {impl} form")
    benchmark.group = workload.id
    benchmark(row.impls[impl])
