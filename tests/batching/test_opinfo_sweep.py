"""The OpInfo sweep as pytest items: one per op, plus a report of outcomes side by side.

The default run covers the fast subset (``opinfo_sweep.FAST_OPS``: pointwise, reductions, views,
matmul; a few samples and in_dims choices per op).  The whole of ``op_db`` (every in_dims choice,
vmap of vmap) runs under the ``sweep`` marker: ``pytest -m sweep tests/batching/test_opinfo_sweep.py``.
An op fails on any wrong value, and on a functrans error where torch.vmap passes the same check
(unless ``opinfo_sweep.XFAILS`` explains it).  See tests/support/opinfo_sweep.py for the outcomes.
"""
from __future__ import annotations

import pytest

from tests.support import opinfo_sweep as sweep

FAST = sweep.select_ops(full=False)
ALL = sweep.select_ops(full=True)

_results = {}  # (full, op id) -> OpResult, shared by the per-op items and the report


def _result(op, full: bool) -> sweep.OpResult:
    key = (full, sweep.op_id(op))
    if key not in _results:
        _results[key] = sweep.sweep_op(op, full=full)
    return _results[key]


def _check(res: sweep.OpResult) -> None:
    if res.skipped:
        pytest.skip(res.skipped)
    why = sweep.failure(res, honour_xfails=False)
    if res.op in sweep.XFAILS:
        assert why, f"{res.op} passes now: remove its stale entry from opinfo_sweep.XFAILS"
        if not why.startswith("WRONG"):
            pytest.xfail(sweep.XFAILS[res.op])
    assert why is None, why
    assert res.checks, "no check ran"


@pytest.mark.parametrize("op", FAST, ids=sweep.op_id)
def test_op(op):
    _check(_result(op, full=False))


def test_report():
    """Counts by outcome, functrans and torch.vmap side by side (``pytest -s`` shows it)."""
    results = [_result(op, full=False) for op in FAST]
    text = sweep.report(results)
    print("\n" + text)
    assert not any(c.outcome == "wrong" for r in results for c in r.checks
                   if c.impl == "functrans"), text
    # The strict path works: the pointwise family always has rules.
    assert _result(next(op for op in FAST if op.name == "exp"), full=False).outcome(
        "functrans") == "rule"


@pytest.mark.sweep
@pytest.mark.parametrize("op", ALL, ids=sweep.op_id)
def test_op_full(op):
    _check(_result(op, full=True))


@pytest.mark.sweep
def test_report_full():
    results = [_result(op, full=True) for op in ALL]
    text = sweep.report(results)
    print("\n" + text)
    assert len(results) == len(ALL)
    assert not any(c.outcome == "wrong" for r in results for c in r.checks
                   if c.impl == "functrans"), text
