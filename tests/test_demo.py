"""The first thing a new user runs: ``python -m functrans`` (what ``scripts/demo.sh`` runs).

Every "results equal" line must say True, and nothing may warn (a fallback, a deprecation): a
newcomer reads "False" as "wrong" and a warning as a bug.  The comparison inside the demo uses
float32-appropriate tolerances, so rounding differences between a vectorised kernel and a loop
(different summation orders) do not print False.
"""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from functrans.__main__ import _close


def test_demo_prints_only_true_and_no_warning():
    env = dict(os.environ, PYTHONWARNINGS="default")
    proc = subprocess.run([sys.executable, "-m", "functrans"], capture_output=True, text=True,
                          env=env, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if "results equal" in ln]
    assert len(lines) == 3, proc.stdout
    assert all("results equal: True" in ln for ln in lines), proc.stdout
    assert "False" not in proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr


def test_demo_comparison_tolerates_rounding_not_errors():
    torch.manual_seed(0)
    a = torch.randn(128, 3)
    rounded = a * (1 + 2e-7)               # a different summation order's rounding
    assert _close(rounded, a)
    assert not _close(a + 1e-3, a)          # a real difference still prints False
    assert _close({"w": rounded}, {"w": a})  # pytrees of gradients, as demo 3 compares
    assert not _close({"w": a + 1e-3}, {"w": a})
