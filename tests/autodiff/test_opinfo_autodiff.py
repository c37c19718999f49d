"""OpInfo vjp / jvp / vmap∘vjp / vmap∘jvp checks: no wrong value from functrans.

Default: the fast op subset, and vmap∘vjp / vmap∘jvp of ``LAYOUT_FAST_OPS`` with their batches
in every layout of tests/support/layouts.py; the whole of op_db (both) runs under
``-m sweep``."""
import pytest

from tests.support import opinfo_autodiff as sweep
from tests.support.opinfo_sweep import op_id

FAST = sweep.select(full=False)
ALL = sweep.select(full=True)
LAYOUT_FAST = [op for op in sweep.select(full=False, names=sweep.LAYOUT_FAST_OPS)
               if op_id(op) in sweep.LAYOUT_FAST_OPS]


def _assert_no_wrong(res):
    if "skipped" in res:
        pytest.skip(res["skipped"])
    wrong = [f"{check}: {o}" for (impl, check), outs in res.items() if impl == "functrans"
             for o in outs if o.startswith("wrong")]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("op", FAST, ids=op_id)
def test_op(op):
    _assert_no_wrong(sweep.sweep_op(op, full=False, impls=("functrans",)))


@pytest.mark.sweep
@pytest.mark.parametrize("op", ALL, ids=op_id)
def test_op_full(op):
    _assert_no_wrong(sweep.sweep_op(op, full=True, impls=("functrans",)))


@pytest.mark.parametrize("op", LAYOUT_FAST, ids=op_id)
def test_op_in_every_layout(op):
    res = sweep.sweep_op_layouts(op, full=False, impls=("functrans",))
    _assert_no_wrong_in_layouts(res)


@pytest.mark.sweep
@pytest.mark.parametrize("op", ALL, ids=op_id)
def test_op_layouts_full(op):
    _assert_no_wrong_in_layouts(sweep.sweep_op_layouts(op, full=True, impls=("functrans",)))


def _assert_no_wrong_in_layouts(res):
    if "skipped" in res:
        pytest.skip(res["skipped"])
    wrong = [f"{check} layout={layout}: {o}" for (impl, check, layout), outs in res.items()
             for o in outs if o.startswith("wrong")]
    assert not wrong, "\n".join(wrong)
    assert any(o != "oracle_invalid" for outs in res.values() for o in outs), "no check ran"
