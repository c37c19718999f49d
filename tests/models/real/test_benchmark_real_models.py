"""benchmarks/real_models.py: every cell is checked against the loop before it is timed; a
functrans failure or difference fails the command, torch.func's failure is an outcome, a
missing package is a SKIPPED row.  Timing is never asserted here."""
import pytest

from benchmarks import real_models
from tests.models.real import zoo


def _need_transformers():
    try:
        zoo.import_transformers()     # a skip only when not installed (a broken install fails)
    except ImportError as e:
        pytest.skip(str(e))


def test_one_model_table():
    _need_transformers()
    text, failed = real_models.table(["gpt2"], repeats=1,
                                     workloads=["per-sample grads", "vmap(jvp)"])
    rows = [line for line in text.splitlines() if line.startswith("| gpt2 |")]
    assert [r.split(" | ")[1] for r in rows] == ["per-sample grads", "vmap(jvp)"]
    assert not failed
    for r in rows:
        outcome = r.split(" | ")[2]
        assert outcome == "ok" or outcome.startswith("torch.func fails"), r


def test_a_wrong_functrans_result_fails_and_a_missing_package_is_skipped(monkeypatch):
    _need_transformers()
    real = zoo.per_sample_grads
    monkeypatch.setattr(zoo, "per_sample_grads", lambda lib, *a, **k: {
        n: g + 1 if lib.__name__ == "functrans" else g for n, g in real(lib, *a, **k).items()})
    text, failed = real_models.table(["gpt2"], repeats=1, workloads=["per-sample grads"])
    assert failed and "| gpt2 | per-sample grads | functrans FAILS" in text

    def missing(name):
        raise ImportError("timm is not installed")
    monkeypatch.setattr(zoo, "spec", missing)
    text, failed = real_models.table(["timm_vit"], repeats=1)
    assert not failed and "| timm_vit | – | SKIPPED: timm is not installed" in text


def test_compiled_table_reports_outcomes_and_fails_on_eager(monkeypatch):
    """benchmarks/real_models_compiled.py's table from its processes' answers (the processes
    themselves compile whole models with Inductor: minutes, run by hand): ratios to each
    process's torch.func eager, segments and tiers in the outcome; a cell whose default
    function ran eagerly, or failed, fails the command."""
    from benchmarks import real_models_compiled as rmc
    answers = {
        ("bart", "functrans"): {"tf_ms": 20.0, "inductor": {"ms": 5.0, "first_s": 30.0},
                                "tiered": {"ms": 4.0, "first_s": 0.5, "segments": 2,
                                           "breaks": ["a value read"], "backend": "inductor"}},
        ("bart", "torch.compile"): {"ms": 8.0, "tf_ms": 16.0, "first_s": 60.0},
        ("gpt2", "functrans"): {"tf_ms": 10.0, "inductor": {"error": "Boom: no"},
                                "tiered": {"ms": 9.0, "first_s": 0.2, "eager_calls": 3,
                                           "eager_reason": "a reason"}},
        ("gpt2", "torch.compile"): {"error": "crashed (exit -11): segfault"},
    }
    monkeypatch.setattr(rmc, "_run_child", lambda m, w, side, r, t: answers[(m, side)])
    text, failed = rmc.table(["bart"], ["per-sample grads"], repeats=1, timeout=1)
    (row,) = [line for line in text.splitlines() if line.startswith("| bart")]
    cells = row.strip("| ").split(" | ")
    assert cells[2].startswith("compiled, 2 segments (a value read)") and cells[3] == "inductor"
    assert cells[4:] == ["0.20", "0.5", "0.25", "30.0", "0.50", "60.0", "0.40"] and not failed
    text, failed = rmc.table(["gpt2"], ["ensemble"], repeats=1, timeout=1)
    (row,) = [line for line in text.splitlines() if line.startswith("| gpt2")]
    assert failed and "eager: a reason" in row and "fails: Boom: no" in row \
        and "fails: crashed (exit -11)" in row
