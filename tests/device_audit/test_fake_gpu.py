"""Device audit (issue 17, part 1): the rules and transforms run on a device other than the
CPU, without a GPU.

``python -m tests.support.device_audit`` runs, in a fresh process, every check on the fake GPU
(PyTorch's PrivateUse1 backend with a Python device guard, under FakeTensorMode: shapes,
dtypes and devices, no values; see tests/support/device_audit.py for why not fake ``cuda`` or
``meta``): the OpInfo fast subset plus ``EXTRA_OPS`` under vmap against their for-loop, every
program of tests/support/device_programs.py and the benchmark's small rows against functrans's
own CPU run.  A rule that builds an index or scalar tensor on the CPU, or reads a value back,
fails there; so does a planted one (the last check).  This file runs that process once and
turns its report into one test per op, program and row.  ``-m sweep`` runs the whole op_db.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.support import device_audit as audit
from tests.support import opinfo_sweep as sweep
from tests.support.device_programs import NOT_ON_A_FAKE_DEVICE, PROGRAMS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_reports = {}


def _report(full: bool, tmp_path_factory) -> dict:
    if full not in _reports:
        out = tmp_path_factory.mktemp("device_audit") / "report.json"
        cmd = [sys.executable, "-m", "tests.support.device_audit", "--json", str(out)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        proc = subprocess.run(cmd + (["--full"] if full else []), cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=3000 if full else 600)
        assert proc.returncode == 0, f"the audit process failed:\n{proc.stderr[-4000:]}"
        _reports[full] = json.loads(out.read_text())
    return _reports[full]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return _report(False, tmp_path_factory)


def _check_op(res: dict) -> None:
    if res["skipped"]:
        pytest.skip(res["skipped"])
    assert not res["problems"], "\n".join(res["problems"])


@pytest.mark.parametrize("op", [sweep.op_id(op) for op in audit.audit_ops(full=False)])
def test_op_runs_on_the_gpu_like_its_loop(report, op):
    _check_op(report["ops"][op])


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_program_runs_on_the_gpu(report, name):
    if name in NOT_ON_A_FAKE_DEVICE:
        pytest.skip(NOT_ON_A_FAKE_DEVICE[name])
    assert report["programs"][name] is None


@pytest.mark.parametrize("workload", [w.id for w in audit._workloads()])
def test_benchmark_row_runs_on_the_gpu(report, workload):
    assert report["workloads"][workload] is None


def test_the_audit_checked_something_and_caught_the_planted_bug(report):
    assert sum(r["checked"] for r in report["ops"].values()) > 500
    planted = report["planted"]
    assert planted["problems"], "a rule that makes a tensor on the CPU went unnoticed"
    # FakeTensor's words: "found at least two devices" (torch 2.13), "found two different
    # devices" (torch 2.11)
    assert re.search("two (different )?devices", planted["problems"][0]), planted["problems"][0]


@pytest.mark.sweep
def test_every_op_runs_on_the_gpu_like_its_loop(tmp_path_factory):
    ops = _report(True, tmp_path_factory)["ops"]
    bad = [p for r in ops.values() for p in r["problems"]]
    assert not bad, "\n".join(bad)
