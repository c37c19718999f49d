"""The GPU benchmark (benchmarks/gpu.py) on the CPU: every workload's functrans computation equals
torch.func's and its loop's at smoke sizes (the GPU run checks the same at full size), the
float64 adjudication passes a result as accurate as torch.func's and fails a wrong one naming
both errors, the targets, and the tables of the stored H200 run render and update the README.
Timing is never asserted here; a whole row with its compiled cells runs in the CPU dry run
(``python -m benchmarks.gpu --device cpu --smoke``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import functrans as ft
from benchmarks import gpu, table

ROOT = Path(__file__).resolve().parent.parent
STORED = sorted((ROOT / "benchmarks" / "results").glob("gpu_*.json"))
CPU = torch.device("cpu")


@pytest.mark.parametrize("workload", [gpu._smoke(w) for w in gpu.WORKLOADS], ids=lambda w: w.id)
def test_smoke_row_matches_torch_func_and_its_loop(workload):
    torch.manual_seed(0)
    spec = workload.build(CPU, True)
    want = spec.make(torch.func)(*spec.args)
    with ft.config.strict_fallback():
        got = spec.make(ft)(*spec.args)
    table._assert_agree(got, want, spec, "functrans")
    table._assert_agree(spec.loop(*spec.args), want, spec, "loop")


def _spec():
    return gpu.Spec(lambda m: (lambda w, x: torch.tanh(x @ w.T)),
                    (torch.randn(3, 4), torch.randn(5, 4)), None, rtol=1e-6, atol=1e-7)


def test_a_result_as_accurate_as_torch_func_passes_and_is_recorded():
    spec = _spec()
    want = spec.make(torch.func)(*spec.args)
    exact = spec.make(torch.func)(*gpu._to64(spec.args)).float()
    nudged = exact + 3e-7 * exact.abs().max()   # beyond rtol 1e-6 somewhere, float32-good
    numerics = {}
    gpu._Checker(spec, want, numerics)(nudged, "cell")
    assert numerics["cell"]["vs float64"] < gpu.FLOAT32_OK
    assert "Mismatched" in numerics["cell"]["differs from torch.func"]


def test_a_wrong_result_fails_naming_both_errors():
    spec = _spec()
    want = spec.make(torch.func)(*spec.args)
    numerics = {}
    with pytest.raises(AssertionError, match="against float64: .*torch.func's"):
        gpu._Checker(spec, want, numerics)(want * 1.01, "cell")
    assert numerics["cell"]["vs float64"] > 100 * numerics["cell"]["torch.func vs float64"]


def test_targets():
    w = next(w for w in gpu.WORKLOADS if w.id == "per-sample grads MLP[B=512]")
    r = {"times": {"functrans": 1.04, "torch.func": 1.0, "ft.compile cudagraphs": 1.1,
                   "torch.compile reduce-overhead": 1.0},
         "peak_bytes": {"functrans": 120, "torch.func": 100}}
    got = {label: met for label, met, _ in gpu.targets(w, r)}
    assert got == {"eager ≤ 1.05× torch.func": True, "cudagraphs ≤ 1× reduce-overhead": False,
                   "peak memory ≤ 1.1× torch.func": False}
    small = next(w for w in gpu.WORKLOADS if w.id == "per-sample grads MLP[B=64]")
    assert small.eager_target is None
    assert next(w for w in gpu.WORKLOADS if w.id == "ensemble grad MLP[N=32]").eager_target == 1.05


@pytest.mark.skipif(not STORED, reason="no stored GPU run in benchmarks/results")
def test_stored_run_renders_and_updates_the_readme(tmp_path, monkeypatch):
    saved = json.loads(STORED[-1].read_text())
    assert saved["rows"] and "H200" in saved["device"]
    text = gpu.format_tables(saved["rows"], markdown=True)
    assert text.count("| per-sample grads MLP |") == 6     # the time and the memory table
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- bench:gpu:start -->\nOLD-TABLE\n<!-- bench:gpu:end -->\ny\n")
    monkeypatch.setattr(table, "README", readme)
    assert gpu.main(["--render", str(STORED[-1]), "--update-readme"]) == 0
    new = readme.read_text()
    assert "OLD-TABLE" not in new and saved["device"] in new
    assert new.endswith("<!-- bench:gpu:end -->\ny\n")
