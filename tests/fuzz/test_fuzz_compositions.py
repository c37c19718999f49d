"""Property-based fuzzing of transform compositions against a plain-PyTorch oracle.

Each example is a random program (``programs.gen_program``) under a random stack of transforms
(``programs.gen_stack``), compared with the recursive oracle (see ``programs``' docstring).
The default run is fixed-seed (``derandomize=True``) and runs 1,050 examples; the ``sweep``
marker runs ``FUNCTRANS_FUZZ_SWEEP_EXAMPLES`` (default 20,000) more, with bigger programs.

The draws depend on the seed alone (see ``_pin_hypothesis_constants``), so a full test session
runs the same 1,050 programs as this file alone.  Cases that hit a known bug are skipped with ``assume``; ``programs.known_bug`` names, for each,
the strict-xfail test in ``test_fuzz_regressions.py`` that pins it.  A deliberate refusal (a
``functrans.errors.FunctransError``) passes and is counted in ``programs.STATS``, as are the ops
that ran on the loop fallback (``python -m tests.fuzz.programs`` prints them).
"""
import os

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from . import programs as P


def _pin_hypothesis_constants():
    """Make the drawn programs depend on the seed alone.

    Hypothesis (6.13x and later) mixes into its integer draws, with probability 0.05 each,
    constants it collects from every *local* module in ``sys.modules``: here ``functrans`` and
    ``benchmarks``, whatever the session has imported.  So the same fixed seed drew different
    programs in a full test session than in this file alone, and after any edit to a constant
    in the package.  Constants from Hypothesis's own global pool stay; the local pool is kept
    empty.  Older releases have no local pool and need nothing.
    """
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:                                  # pragma: no cover
        return
    empty = getattr(providers, "_local_constants", None)
    if empty is not None and hasattr(providers, "_get_local_constants"):
        empty = type(empty)()
        providers._get_local_constants = lambda: empty


_pin_hypothesis_constants()

_SETTINGS = dict(derandomize=True, database=None, deadline=None, print_blob=False,
                 suppress_health_check=list(HealthCheck))


def _check(data, profile):
    case = P.gen_case(P.DataChooser(data), **P.PROFILES[profile])
    bug = P.known_bug(case)
    if bug:
        P.STATS["known_bug_skipped"][bug] += 1
    assume(bug is None)
    P.run_case(case, skip_known=False)


@settings(max_examples=400, **_SETTINGS)
@given(st.data())
def test_vmap_and_vmap_of_vmap(data):
    """vmap / vmap(vmap) with random in_dims, out_dims, chunk_size over every op family."""
    _check(data, "vmap")


@settings(max_examples=300, **_SETTINGS)
@given(st.data())
def test_autodiff_stacks(data):
    """One or two of grad, grad_and_value, vjp, jvp, linearize, jacrev, jacfwd, hessian."""
    _check(data, "autodiff")


@settings(max_examples=350, **_SETTINGS)
@given(st.data())
def test_mixed_stacks(data):
    """Two or three transforms of any kind (vmap(grad), jacrev(vmap), vmap(jvp), ...)."""
    _check(data, "mixed")


SWEEP_EXAMPLES = int(os.environ.get("FUNCTRANS_FUZZ_SWEEP_EXAMPLES", "20000"))


@pytest.mark.sweep
@settings(max_examples=SWEEP_EXAMPLES, **_SETTINGS)
@given(st.data())
def test_sweep(data):
    """The long run: up to seven ops, three inputs, three transforms deep."""
    _check(data, "sweep")
