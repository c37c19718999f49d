"""The OpInfo sweep as pytest items: one per op, plus a report of outcomes side by side.

The default run covers the fast subset (``opinfo_sweep.FAST_OPS``: pointwise, reductions, views,
matmul; a few samples and in_dims choices per op), and a slice of the layout sweep
(``LAYOUT_FAST_OPS`` with their batches transposed, channels_last, expanded, batch dim moved:
tests/support/layouts.py).  The whole of ``op_db`` (every in_dims choice, vmap of vmap; and the
layout sweep, ``LAYOUT_SWEEP``) runs under the ``sweep`` marker:
``pytest -m sweep tests/batching/test_opinfo_sweep.py``.
An op fails on any wrong value, and on a functrans error where torch.vmap passes the same check
(unless ``opinfo_sweep.XFAILS`` explains it).  See tests/support/opinfo_sweep.py for the
outcomes.

``test_op_on_cuda`` (marker ``cuda``) runs the same fast subset with the samples, the batches,
the loop oracle and both vmaps on the CUDA device, judged by the same ``_check``; without CUDA
every item skips with one reason.  ``pytest -m cuda tests/batching/test_opinfo_sweep.py``.
"""
from __future__ import annotations

import pytest
import torch

from tests.support import opinfo_sweep as sweep

FAST = sweep.select_ops(full=False)
ALL = sweep.select_ops(full=True)

LAYOUT_FAST = [op for op in sweep.select_ops(full=False, names=sweep.LAYOUT_FAST_OPS)
               if sweep.op_id(op) in sweep.LAYOUT_FAST_OPS]

_results = {}  # (full, op id, device, plan) -> OpResult, shared by the per-op items and reports


def _result(op, full: bool, device: str = "cpu", plan=None) -> sweep.OpResult:
    key = (full, sweep.op_id(op), device, plan)
    if key not in _results:
        _results[key] = sweep.sweep_op(op, full=full, device=device, plan=plan)
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


@pytest.mark.parametrize("op", LAYOUT_FAST, ids=sweep.op_id)
def test_op_in_every_layout(op):
    """The default run's layout slice (``opinfo_sweep.LAYOUT_FAST``): the batches transposed,
    channels_last, expanded, batch dim moved (tests/support/layouts.py), one sample, in_dims
    all 0 and all -1, against the contiguous loop (functrans only: no wrong value)."""
    res = sweep.sweep_op(op, full=False, plan=sweep.LAYOUT_FAST, with_torch=False)
    _check(res)
    assert any(c.outcome != "oracle_invalid" for c in res.checks), "no layout check ran"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("op", FAST, ids=sweep.op_id)
def test_op_on_cuda(op):
    _check(_result(op, full=False, device="cuda"))


def test_batches_are_drawn_alike_on_every_device():
    """The examples of a batch are drawn on the CPU from seeded generators and then moved, so
    a device sweep sees the CPU sweep's numbers ("meta" stands in for a device here)."""
    import itertools
    x = torch.randn(2, 3)
    cpu = sweep.build_batch(x, [0, -1], [3, 2], None, itertools.count())
    again = sweep.build_batch(x, [0, -1], [3, 2], None, itertools.count(), "cpu")
    meta = sweep.build_batch(x, [0, -1], [3, 2], None, itertools.count(), "meta")
    assert torch.equal(cpu, again) and cpu.shape == (3, 2, 3, 2)
    assert meta.device.type == "meta" and meta.shape == cpu.shape
    assert len({tuple(cpu[i, ..., j].flatten().tolist()) for i in range(3) for j in range(2)}) \
        == 6, "the examples of a batch differ"


def test_skip_reason_asks_about_the_device():
    cholesky = next(op for op in sweep.all_ops() if op.name == "cholesky")
    cpu_only = next((op for op in sweep.all_ops()
                     if torch.float32 in op.supported_dtypes("cpu")
                     and torch.float32 not in op.supported_dtypes("cuda")), None)
    assert sweep.skip_reason(cholesky, "cuda") is None
    if cpu_only is not None:
        assert sweep.skip_reason(cpu_only, "cpu") != "no float32 support"
        assert sweep.skip_reason(cpu_only, "cuda") == "no float32 support"


def test_the_cpu_sweep_is_the_default_sweep():
    """``device="cpu"`` is the default: the same checks, outcomes and details."""
    op = next(op for op in FAST if op.name == "addmm")
    a, b = _result(op, full=False), sweep.sweep_op(op, full=False, device="cpu")
    assert [(c.sample, c.in_dims, c.nested, c.impl, c.outcome, c.detail) for c in a.checks] \
        == [(c.sample, c.in_dims, c.nested, c.impl, c.outcome, c.detail) for c in b.checks]
    assert a.checks


def test_compare_reports_an_output_on_another_device():
    x = torch.ones(2)
    assert sweep.compare(x.to("meta"), x) == "output 0: device meta != cpu"


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
@pytest.mark.parametrize("op", ALL, ids=sweep.op_id)
def test_op_layouts_full(op):
    """The layout sweep (``opinfo_sweep.LAYOUT_SWEEP``) of every op."""
    _check(_result(op, full=True, plan=sweep.LAYOUT_SWEEP))


@pytest.mark.sweep
def test_report_layouts_full():
    results = [_result(op, full=True, plan=sweep.LAYOUT_SWEEP) for op in ALL]
    text = sweep.report(results)
    print("\n" + text)
    assert not any(c.outcome == "wrong" for r in results for c in r.checks
                   if c.impl == "functrans"), text


@pytest.mark.sweep
def test_report_full():
    results = [_result(op, full=True) for op in ALL]
    text = sweep.report(results)
    print("\n" + text)
    assert len(results) == len(ALL)
    assert not any(c.outcome == "wrong" for r in results for c in r.checks
                   if c.impl == "functrans"), text
