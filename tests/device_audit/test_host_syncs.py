"""Host-sync audit (issue 17, part 1): functrans never makes the host wait for the device where
the plain program does not.

Each check runs a program twice under ``tests.support.device_audit.recording_syncs`` (ops that
force a device-to-host sync on a GPU: value reads, data-dependent shapes, ``equal``, copies to
the CPU, ``tolist``/``numpy``) and compares the KINDS of sync: functrans's run against the plain
per-example program (the op's for-loop for the OpInfo checks, the benchmark row's Python loop,
torch.func for the transform programs).  It runs on the CPU: a sync is the same op there, only
free.  The ops: the OpInfo fast subset plus ``device_audit.EXTRA_OPS`` (index-building and
value-checking families); the whole of ``op_db`` runs under ``-m sweep``.
"""
from __future__ import annotations

import pytest
import torch

from tests.support import device_audit as audit
from tests.support import opinfo_sweep as sweep
from tests.support.device_programs import PROGRAMS

OPS = audit.audit_ops(full=False)


def _check(res: audit.OpAudit) -> None:
    if res.skipped:
        pytest.skip(res.skipped)
    assert not res.problems, "\n".join(res.problems)


@pytest.mark.parametrize("op", OPS, ids=sweep.op_id)
def test_op_issues_no_sync_its_loop_does_not(op):
    res = audit.audit_host_syncs(op)
    _check(res)
    assert res.checked, "no check ran"


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_program_issues_no_sync_torch_func_does_not(name):
    assert audit.audit_program_syncs(PROGRAMS[name]) is None


@pytest.mark.parametrize("workload", audit._workloads(), ids=lambda w: w.id)
def test_benchmark_row_issues_no_sync_its_loop_does_not(workload):
    assert audit.audit_workload_syncs(workload) is None


@pytest.mark.filterwarnings("ignore::functrans.PerformanceWarning")
def test_the_recorder_sees_the_syncs_under_functrans():
    import functrans as ft
    x = torch.tensor([[1., 0., 2.], [0., 3., 4.]])
    kinds = audit.syncs_of(lambda: ft.vmap(torch.nonzero)(x))
    assert set(kinds) == {audit.DATA_SHAPE}
    kinds = audit.syncs_of(lambda: ft.vmap(lambda a: a * 2 if a.sum() > -100 else a)(x))
    assert set(kinds) == {audit.VALUE_READ}
    kinds = audit.syncs_of(lambda: (x.tolist(), x.numpy(), torch.equal(x, x)))
    assert set(kinds) == {audit.HOST_READ, audit.EQUAL}
    assert audit.syncs_of(lambda: ft.vmap(ft.grad(lambda a: a.sin().sum()))(x)) == {}


def test_a_planted_value_read_is_caught():
    exp = next(op for op in sweep.all_ops() if op.name == "exp")
    with audit.planted_rule(torch.ops.aten.exp.default, audit.value_read_rule):
        res = audit.audit_host_syncs(exp)
    assert res.problems and audit.VALUE_READ in res.problems[0], res
    assert not audit.audit_host_syncs(exp).problems      # the real rule is back


@pytest.mark.sweep
@pytest.mark.parametrize("op", sweep.select_ops(True), ids=sweep.op_id)
def test_op_issues_no_sync_its_loop_does_not_full(op):
    _check(audit.audit_host_syncs(op, full=True))
