"""The device-audit programs with real values: functrans gives torch.func's numbers on each device.

Every program of tests/support/device_programs.py runs on ``device`` (the conftest fixture:
``cpu`` here, ``cuda`` where a CUDA device is present; that item skips cleanly otherwise), once
written against functrans and once against torch.func (or, for the programs torch.func cannot
run, ``device_programs.LOOP_REFERENCES``: a per-example loop of ``torch.autograd.grad``).  Both
runs get the same inputs (modules made from fixed seeds, inputs drawn on the CPU and moved, the
global seed reset before each build and each run), and the outputs must have the same pytree
structure, and tensor for tensor the same shape, dtype and device (on ``device``) and close
values.  The fake-GPU audit (test_fake_gpu.py) checks only shapes, dtypes and devices; this is
the check with numbers, on a real accelerator when the machine has one:
``pytest -m cuda tests/device_audit/test_programs_on_device.py`` runs only the CUDA items.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.func
import torch.utils._pytree as pytree

import functrans
from tests.support.device_programs import LOOP_REFERENCES, PROGRAMS
from tests.support.oracles import assert_same

RTOL, ATOL = 1e-4, 1e-5   # float32, two libraries that may batch the same maths differently


def _run(make):
    """Build with the global seed at 0 and run with it at 1 (the randomness program draws)."""
    torch.manual_seed(0)
    thunk = make()
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return thunk()


def assert_same_values(got, expected, device) -> None:
    """``oracles.assert_same`` (structure, shapes, dtypes, values; ``assert_close`` also checks
    devices), after checking that the reference returned tensors and ran on ``device``."""
    tensors = [e for e in pytree.tree_leaves(expected) if isinstance(e, torch.Tensor)]
    assert tensors, "the program returned no tensor"
    assert all(e.device.type == torch.device(device).type for e in tensors), \
        f"the reference ran on {[str(e.device) for e in tensors]}, not {device}"
    assert_same(got, expected, rtol=RTOL, atol=ATOL, msg="functrans vs the reference")


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_program_gives_torch_func_values(name, device):   # TF32 off: conftest
    dev = torch.device(device)
    got = _run(lambda: PROGRAMS[name](functrans, dev))
    if name in LOOP_REFERENCES:
        expected = _run(lambda: LOOP_REFERENCES[name](dev))
    else:
        expected = _run(lambda: PROGRAMS[name](torch.func, dev))
    assert_same_values(got, expected, device)


@pytest.mark.parametrize("name", list(LOOP_REFERENCES))
def test_a_loop_reference_stands_only_where_torch_func_cannot_run(name):
    """A loop reference replaces torch.func only where torch.func fails on the program (on the
    CPU); when torch.func learns to run it, compare with torch.func instead."""
    with pytest.raises(Exception):
        _run(lambda: PROGRAMS[name](torch.func, torch.device("cpu")))


def test_the_comparison_catches_a_wrong_value_and_a_wrong_device():
    x = torch.ones(3)
    assert_same_values({"a": x}, {"a": x.clone()}, "cpu")
    with pytest.raises(AssertionError):
        assert_same_values({"a": x + 1e-2}, {"a": x}, "cpu")
    with pytest.raises(AssertionError):
        assert_same_values({"a": x.to("meta")}, {"a": x}, "cpu")
    with pytest.raises(AssertionError):
        assert_same_values([x], {"a": x}, "cpu")
