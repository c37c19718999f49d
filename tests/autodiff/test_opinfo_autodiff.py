"""OpInfo vjp / jvp / vmap∘vjp / vmap∘jvp checks: no wrong value from functrans.

Default: the fast op subset; the whole of op_db runs under ``-m sweep``."""
import pytest

from tests.support import opinfo_autodiff as sweep
from tests.support.opinfo_sweep import op_id

FAST = sweep.select(full=False)
ALL = sweep.select(full=True)


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
