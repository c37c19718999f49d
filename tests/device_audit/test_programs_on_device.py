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
from tests.support.opinfo_sweep import precise_device

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
    fg, sg = pytree.tree_flatten(got)
    fe, se = pytree.tree_flatten(expected)
    assert sg == se, f"output structures differ:\n{sg}\nvs\n{se}"
    assert any(isinstance(e, torch.Tensor) for e in fe), "the program returned no tensor"
    for k, (g, e) in enumerate(zip(fg, fe)):
        if not isinstance(e, torch.Tensor):
            assert g == e, f"leaf {k}: {g!r} != {e!r}"
            continue
        assert isinstance(g, torch.Tensor), f"leaf {k}: expected a tensor, got {type(g)}"
        assert e.device.type == torch.device(device).type, \
            f"leaf {k}: the reference ran on {e.device}, not {device}"
        assert (g.shape, g.dtype, g.device) == (e.shape, e.dtype, e.device), \
            f"leaf {k}: {(tuple(g.shape), g.dtype, g.device)} != " \
            f"{(tuple(e.shape), e.dtype, e.device)}"
        torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL, msg=lambda m: f"leaf {k}: {m}")


@pytest.fixture
def precise(device):
    """No TF32 on CUDA (cuDNN convolutions may use it by default): float32 stays float32."""
    with precise_device(device):
        yield


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_program_gives_torch_func_values(name, device, precise):
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
