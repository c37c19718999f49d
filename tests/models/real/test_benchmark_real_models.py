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
