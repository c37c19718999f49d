"""OpInfo ``error_inputs`` under vmap: every input that makes eager raise makes vmap raise too.

For each op of ``op_db`` (CPU) with ``error_inputs``, each ErrorInput runs
1. eagerly, as given (the reference: it must raise; a case that does not raise in this build is
   counted as ``eager_ok`` and left out, it has nothing to compare);
2. under ``functrans.vmap`` with every tensor of the sample given a batch dim (``in_dims=0`` for
   all of them, each example a copy of the eager tensor, so every example is the error input);
3. where cheap, under ``vmap(vmap(...))`` with two batch dims.
Under vmap the call must raise the exception type eager raised (a subclass counts), or
functrans's ``UnsupportedUnderVmap`` (the documented refusal, e.g. a data-dependent op).  A
result where eager raises is a silent wrong answer: the test fails on it.

The whole of op_db runs in the default run (about 700 cases, each also nested: seconds).  Run
``python -m tests.batching.test_error_inputs [--ops a,b] [--nested]`` for a report with counts.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
import warnings
from typing import Dict, List, Tuple

import pytest
import torch
import torch.utils._pytree as pytree

import functrans
from functrans.errors import UnsupportedUnderVmap

B = 2

# (op id, case index) -> why vmap cannot raise eager's error there.  Each entry is checked: the
# case must still return a result under vmap (a strict xfail), so a fixed case shows up here.
KNOWN_GAPS: Dict[Tuple[str, int], str] = {
}


def op_id(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _ops_with_error_inputs():
    from torch.testing._internal.common_methods_invocations import op_db
    return [op for op in op_db if op.error_inputs_func is not None]


def _flatten(sample):
    """(tensors, call): every tensor leaf of the sample is one mapped argument."""
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def call(fn, *tensors):
        full = list(leaves)
        for i, t in zip(pos, tensors):
            full[i] = t
        inp, args, kwargs = pytree.tree_unflatten(full, spec)
        return fn(inp, *args, **kwargs)

    return [leaves[i] for i in pos], call


def _batch(t: torch.Tensor, levels: int) -> torch.Tensor:
    for _ in range(levels):
        t = torch.stack([t.clone() for _ in range(B)])
    return t


def run_case(op, ei, nested: bool) -> Tuple[str, str]:
    """(outcome, detail); outcome is one of pass, eager_ok, unbatchable, returned, wrong_type."""
    sample = ei.sample_input
    tensors, call = _flatten(sample)
    try:
        call(op.op, *[t.clone() for t in tensors])
    except Exception as e:  # noqa: BLE001 - any exception is eager's answer
        expected = type(e)
    else:
        return "eager_ok", "eager does not raise this case in this build"
    if not tensors or any(t.layout != torch.strided for t in tensors):
        return "unbatchable", "no dense tensor to give a batch dim"
    batched = [_batch(t, 2 if nested else 1) for t in tensors]
    fn = functrans.vmap(lambda *ts: call(op.op, *ts))
    if nested:
        fn = functrans.vmap(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            fn(*batched)
        except Exception as e:  # noqa: BLE001
            if isinstance(e, (expected, UnsupportedUnderVmap)):
                return "pass", ""
            return "wrong_type", (f"eager raised {expected.__name__}, vmap raised "
                                  f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    return "returned", f"eager raised {expected.__name__} ({ei.error_regex!r}); vmap returned"


def cases_of(op) -> List:
    try:
        return list(op.error_inputs("cpu"))
    except Exception:  # pragma: no cover - the OpInfo's own generator failed
        return []


def _check_op(op, nested: bool = True) -> List[str]:
    failures = []
    ran = 0
    for k, ei in enumerate(cases_of(op)):
        for nest in ((False, True) if nested else (False,)):
            outcome, detail = run_case(op, ei, nest)
            key = (op_id(op), k)
            if outcome in ("eager_ok", "unbatchable"):
                continue
            ran += 1
            if key in KNOWN_GAPS:
                continue  # test_known_gap: a strict xfail
            if outcome != "pass":
                failures.append(f"{op_id(op)} case {k}{' nested' if nest else ''}: "
                                f"{outcome}: {detail}")
    return failures


def _select(names) -> list:
    ops = _ops_with_error_inputs()
    return [op for op in ops if op.name in names or op_id(op) in names]


def test_sweep_covers_op_db():
    # The sweep is real: op_db has a couple of hundred ops with error inputs, and most of
    # their cases have tensors to batch.
    ops = _ops_with_error_inputs()
    assert len(ops) >= 150
    counts = collections.Counter(run_case(op, ei, False)[0] for op in _select(["gather",
                                 "masked_fill", "index_select", "amax"]) for ei in cases_of(op))
    assert counts["pass"] >= 10 and not counts["returned"]


@pytest.mark.parametrize("op", _ops_with_error_inputs(), ids=op_id)
def test_error_inputs_raise_under_vmap(op):
    failures = _check_op(op, nested=True)
    assert not failures, "\n".join(failures)


def test_masked_fill_complex_value_into_int_raises():
    # Eager refuses a complex value with an imaginary part for an int64 tensor; the batched
    # value (a vector of 0-d values) must not silently drop the imaginary part.
    x = torch.arange(6).reshape(2, 3)
    mask = torch.tensor([True, False, True])
    value = torch.tensor([1 + 2j, 3 + 1j])
    with pytest.raises(RuntimeError, match="cannot be converted"):
        torch.masked_fill(x[0], mask, value[0])
    for in_dims, xs in (((0, None, 0), x), ((None, None, 0), x[0])):
        with pytest.raises(RuntimeError, match="cannot be converted"):
            functrans.vmap(torch.masked_fill, in_dims=in_dims)(xs, mask, value)


def test_masked_fill_batched_value_matches_loop():
    # The vectorised path still serves values eager converts safely (int into float, float
    # into double); a value eager may refuse per example goes through the loop.
    from tests.support.oracles import loop_oracle
    x = torch.randn(3, 4, dtype=torch.float64)
    mask = torch.tensor([True, False, True, False])
    for value in (torch.tensor([1, -2, 3]), torch.tensor([0.5, 1.5, -2.0], dtype=torch.float32),
                  torch.tensor([7, 1000, -5])):
        got = functrans.vmap(torch.masked_fill, in_dims=(0, None, 0))(x, mask, value)
        want = loop_oracle(torch.masked_fill, (0, None, 0), 3, x, mask, value)
        torch.testing.assert_close(got, want)
    xi = torch.arange(12).reshape(3, 4)
    value = torch.tensor([3 + 0j, -1 + 0j, 2 + 0j])  # no imaginary part: eager converts it
    got = functrans.vmap(torch.masked_fill, in_dims=(0, None, 0))(xi, mask, value)
    want = torch.stack([torch.masked_fill(xi[i], mask, value[i]) for i in range(3)])
    torch.testing.assert_close(got, want)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="")
    p.add_argument("--nested", action="store_true")
    a = p.parse_args(argv)
    names = [s for s in a.ops.split(",") if s]
    ops = _select(names) if names else _ops_with_error_inputs()
    start = time.time()
    counts: Dict[str, int] = collections.Counter()
    bad = []
    for op in ops:
        for k, ei in enumerate(cases_of(op)):
            for nest in ((False, True) if a.nested else (False,)):
                outcome, detail = run_case(op, ei, nest)
                counts[outcome] += 1
                if outcome in ("returned", "wrong_type"):
                    bad.append(f"  {op_id(op)} case {k}{' nested' if nest else ''}: {outcome}: "
                               f"{detail}")
    print(f"{len(ops)} ops, {sum(counts.values())} cases: " +
          ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print("\n".join(bad) or "  no failures")
    print(f"{time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
