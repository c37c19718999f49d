import pytest
import torch

from functrans import _levels


def pytest_configure(config):
    # functrans.compile's default backend "tiered" compiles hot graphs with Inductor in the
    # background; in the suite that would be seconds of compiler per hot graph beside the
    # tests.  Held back here; tests/compiler/test_tiering.py lowers the threshold.
    from functrans.compiler import tiering
    tiering.HOT_SECONDS = float("inf")
    config.addinivalue_line("markers", "sweep: the full OpInfo sweep (long; run with -m sweep)")
    config.addinivalue_line("markers", "cuda: needs a CUDA device")


@pytest.fixture(autouse=True)
def _clean_levels_and_seed():
    torch.manual_seed(0)
    yield
    assert _levels.stack() == [], f"a transform leaked levels: {_levels.stack()}"


@pytest.fixture(autouse=True)
def _float32_stays_float32_on_cuda():
    """Every test computes float32 in float32 on a GPU (``oracles.float32_on_cuda``: cuDNN's
    default TF32 made a BatchNorm ensemble and its per-member loop differ by 5e-4 on an H200)."""
    from tests.support.oracles import float32_on_cuda
    with float32_on_cuda():
        yield


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        params = [pytest.param("cpu", id="cpu"),
                  pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
                      not torch.cuda.is_available(), reason="no CUDA device")])]
        metafunc.parametrize("device", params)


def pytest_collection_modifyitems(config, items):
    """Test ids must be the same in every process (pytest-xdist refuses a run whose workers
    collect different ids): an id holding an object's address fails the collection.  With
    FUNCTRANS_CUDA_IDS=FILE, write the ids of the tests marked ``cuda`` there (one per line;
    under xdist, the first worker writes): scripts/junit_counts.py counts them apart."""
    import os
    import re
    unstable = [item.nodeid for item in items if re.search(r" at 0x[0-9a-f]+", item.nodeid)]
    if unstable:
        raise pytest.UsageError(
            f"{len(unstable)} test id(s) hold a memory address, which differs between "
            f"processes (give the parametrization ids): {unstable[:3]}")
    path = os.environ.get("FUNCTRANS_CUDA_IDS")
    worker = getattr(config, "workerinput", {}).get("workerid", "gw0")
    if path and worker == "gw0":
        with open(path, "w") as fh:
            fh.writelines(item.nodeid + "\n" for item in items
                          if item.get_closest_marker("cuda") is not None)


# ---------------------------------------------------------------------------------------------
# Registry hygiene: every built-in batching rule must run somewhere in the default test run.
# At session start every registered rule is wrapped with a counter (the registry's cache is
# cleared, so dispatch picks the wrappers up).  After a complete default run (all of tests/, no
# -k, the default marker expression) any rule that never ran fails the session, with its name:
# add a family test or an OpInfo op to the fast sweep that reaches it.

_rule_calls = {}


def _complete_default_run(config) -> bool:
    """The whole default run: all of tests/, no -k, the default marker expression.  Under
    pytest-xdist (``-n``) each worker runs a share of the tests, so only the controller, which
    adds up every worker's counts (``pytest_testnodedown``), can tell that a rule never ran:
    workers never decide."""
    import os
    if hasattr(config, "workerinput"):
        return False
    args = [os.path.normpath(os.path.abspath(a)) for a in config.args]
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(tests_dir)
    whole = not args or all(a in (tests_dir, root) for a in args)
    return whole and not config.getoption("keyword") and \
        config.getoption("markexpr") in ("", "not sweep")


_RULE_CALLS_KEY = "functrans_rule_calls"


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist controller: add a finished worker's rule counts to this process's."""
    for key, n in getattr(node, "workeroutput", {}).get(_RULE_CALLS_KEY, {}).items():
        _rule_calls[key] = _rule_calls.get(key, 0) + n


def pytest_sessionstart(session):
    """Count the calls of every registered rule (re-registered, through the registry's public
    API, as a counting wrapper with the same family and flags)."""
    from functrans.batching import registry

    import functools

    def counted(key, fn):
        @functools.wraps(fn)
        def rule(*args, **kwargs):
            _rule_calls[key] += 1
            return fn(*args, **kwargs)
        return rule

    for op in sorted(registry.registered_ops(), key=str):
        reg = registry.registration(op)
        _rule_calls[str(op)] = 0
        registry.register_batch_rule(op, counted(str(op), reg.rule), family=reg.family,
                                     checks_inplace=reg.checks_inplace,
                                     batched_kwargs=reg.batched_kwargs)


def unexercised_rules():
    return sorted(k for k, n in _rule_calls.items() if n == 0)


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):          # an xdist worker: report to the controller
        session.config.workeroutput[_RULE_CALLS_KEY] = dict(_rule_calls)
        return
    if _complete_default_run(session.config) and unexercised_rules() and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _complete_default_run(config):
        return
    missing = unexercised_rules()
    if missing:
        terminalreporter.write_line(
            f"RULE COVERAGE FAILED: {len(missing)} of {len(_rule_calls)} registered batching "
            "rules never ran in the default test run (add a family test or a fast-sweep op "
            "that reaches each):", red=True)
        for name in missing:
            terminalreporter.write_line(f"  {name}")
    else:
        terminalreporter.write_line(
            f"rule coverage: all {len(_rule_calls)} registered batching rules ran.")
