"""The benchmark workloads stay correct: every small-tier row passes the check that the bench
command runs before timing (no loop fallback; every implementation equal to torch.func), and the
table and README update work.  The Opacus rows (Opacus's DP training step with functrans as its
per-sample-gradient engine, beside torch.func) are checked the same way when opacus is installed,
and skip with the reason otherwise; a row whose optional package is missing is printed as
SKIPPED, never silently dropped.  The compiled columns are exercised on the smallest hessian row with
the replay backend only (inductor compiles take seconds); the torch.compile anchor's subprocess
is replaced by a fake that crashes.  The opt-in peak-memory columns (``--memory``) are measured
for one cell of the smallest hessian row in its subprocess; the others are given.  Timing and
memory figures themselves are never asserted here (see benchmarks/)."""
import pytest
import torch

from benchmarks import table
from benchmarks.workloads import IMPLS, WORKLOADS

SMALL = [w for w in WORKLOADS if w.tier == "small"]
CORE_SMALL = [w for w in SMALL if w.requires is None]
OPACUS = [w for w in WORKLOADS if w.requires == "opacus"]


def test_every_workload_name_has_a_small_row():
    assert {w.name for w in SMALL} == {w.name for w in WORKLOADS}


@pytest.mark.parametrize("workload", CORE_SMALL, ids=lambda w: w.id)
def test_small_row_is_checked_without_fallback(workload):
    row = workload.build(torch.device("cpu"))
    assert {"functrans", "torch.func", "loop"} <= set(row.impls) <= set(IMPLS)
    table.check(row)


def test_a_row_that_hits_the_fallback_fails(monkeypatch):
    row = table.Row({"functrans": lambda: __import__("functrans").vmap(
        lambda x: torch.histogram(x, bins=3).hist)(torch.randn(4, 10)),
        "torch.func": lambda: torch.zeros(4, 3), "loop": lambda: torch.zeros(4, 3)})
    with pytest.raises(Exception, match="fallback"):
        table.check(row)


def test_a_row_whose_results_differ_fails():
    row = table.Row({"functrans": lambda: torch.ones(3), "torch.func": lambda: torch.ones(3),
                     "loop": lambda: torch.ones(3) * 2})
    with pytest.raises(AssertionError, match="loop"):
        table.check(row)


def test_table_and_readme_update(tmp_path):
    w = SMALL[0]
    ok = table.run_workload(w, torch.device("cpu"), rounds=1, min_time=0.0, backends=(),
                            anchor=False)
    failed = dict(ok, error="RuntimeError: boom", times={})
    text = table.format_table([ok, failed], markdown=False)
    assert w.name in text and "FAILED: RuntimeError: boom" in text
    md = table.format_table([ok, failed], markdown=True)
    assert md.count("\n") == 3 and md.startswith("| workload |")
    readme = tmp_path / "README.md"
    readme.write_text("a\n<!-- bench:cpu:start -->\nold\n<!-- bench:cpu:end -->\nb\n")
    table.update_readme(md, torch.device("cpu"), readme)
    assert readme.read_text() == f"a\n<!-- bench:cpu:start -->\n{md}\n<!-- bench:cpu:end -->\nb\n"


def test_compiled_columns_replay_smallest_row():
    """The replay column: compiled from the functrans callable, checked equal to torch.func,
    timed beside the eager ones, with its first calls and the issue's targets reported."""
    w = next(w for w in SMALL if w.name == "hessian")
    r = table.run_workload(w, torch.device("cpu"), rounds=1, min_time=0.0, backends=("replay",),
                           anchor=False)
    assert r["error"] is None
    col = r["compiled"]["ft.compile replay"]
    assert "error" not in col and col["first_calls_s"] > 0
    assert col["ratio"] == r["times"]["ft.compile replay"] / r["times"]["torch.func"]
    labels = [label for label, _ in r["compiled_targets"]]
    assert labels == [f"replay ≤ {w.replay_target:g}", "first calls < 0.5 s"]
    text = table.format_compiled_table([r], markdown=True)
    assert text.count("\n") == 2 and "| hessian | D=64 |" in text


def test_a_compiled_column_that_runs_eagerly_fails_its_cell_only():
    x = torch.randn(5)

    def branchy():                          # a read no graph can guard: runs eagerly
        return x.sin() * float(x.numpy().sum())

    row = table.Row({"functrans": branchy, "torch.func": branchy, "loop": branchy})
    cols = table.compile_columns(row, backends=("replay",))
    assert "error" in cols["ft.compile replay"] and "fn" not in cols["ft.compile replay"]


def test_a_crashing_anchor_costs_one_cell(monkeypatch):
    """torch.compile dying in its subprocess becomes the cell's text; inductor's target there is
    to run at all."""
    import subprocess

    def dies(cmd, **kw):
        assert cmd[1:3] == ["-m", "benchmarks.anchor"] and "hessian[D=64]" in cmd
        return subprocess.CompletedProcess(cmd, -6, "", "...\nRuntimeError: internal assert\n")

    monkeypatch.setattr(table.peak_memory.subprocess, "run", dies)
    w = next(w for w in SMALL if w.name == "hessian")
    anchor = table.run_anchor(w, torch.device("cpu"), 1, 0.0, timeout=10)
    assert anchor == {"error": "crashed (exit -6): RuntimeError: internal assert"}
    r = {"workload": w.name, "size": w.size, "error": None, "times": {"torch.func": 1e-3},
         "anchor": anchor, "compiled": {
             "ft.compile replay": {"time": 1e-4, "ratio": 0.1, "first_calls_s": 0.1},
             "ft.compile inductor": {"time": 1e-4, "ratio": 0.1, "first_calls_s": 2.0}}}
    r["compiled_targets"] = table._compiled_targets(w, r)
    assert ("inductor runs", True) in r["compiled_targets"]
    assert "crashed (exit -6)" in table.format_compiled_table([r], markdown=False)


def test_opacus_rows_are_listed_with_their_target():
    assert [w.name for w in OPACUS] == ["Opacus step CNN", "Opacus step LSTM"]
    assert all(w.cpu_target == 1.0 and not w.compiled for w in OPACUS)


@pytest.mark.parametrize("workload", OPACUS, ids=lambda w: w.id)
def test_opacus_row_runs_on_functrans_and_matches_torch_func(workload):
    """functrans really computes Opacus's per-sample gradients (its calls are counted), the
    step's per-sample gradients and updated parameters equal torch.func's and Opacus's own
    grad samplers', and Opacus's module attributes are back to torch.func's afterwards."""
    pytest.importorskip("opacus", reason=table.skip_reason(workload) or "opacus is missing")
    from opacus.grad_sample import functorch as ofunctorch
    before = {n: getattr(ofunctorch, n) for n in ("vmap", "grad", "make_functional")}
    row = workload.build(torch.device("cpu"))
    assert set(row.impls) == {"functrans", "torch.func", "closed form"}
    engine = row.impls["functrans"].engine
    calls = engine.calls
    table.check(row)
    assert engine.calls > calls
    assert {n: getattr(ofunctorch, n) for n in before} == before
    out = row.impls["torch.func"]()
    assert out["grad_sample"].keys() == out["params"].keys() and all(
        g.shape[0] == workload.batch for g in out["grad_sample"].values())


def test_opacus_engine_restores_opacus_on_error():
    pytest.importorskip("opacus", reason="opacus is not installed")
    from opacus.grad_sample import functorch as ofunctorch

    from benchmarks.opacus_rows import FunctransEngine
    vmap = ofunctorch.vmap
    with pytest.raises(ValueError, match="inside"):
        with FunctransEngine():
            assert ofunctorch.vmap is not vmap
            raise ValueError("inside")
    assert ofunctorch.vmap is vmap


def test_opacus_row_in_the_table():
    pytest.importorskip("opacus", reason="opacus is not installed")
    w = OPACUS[0]
    r = table.run_workload(w, torch.device("cpu"), rounds=1, min_time=0.0)
    assert r["error"] is None and r["skipped"] is None
    assert set(r["times"]) == {"functrans", "torch.func", "closed form"}
    assert r["compiled"] == {} and "anchor" not in r and "loop/ft" not in r
    line = table.format_table([r], markdown=False).splitlines()[2]
    assert line.startswith("Opacus step CNN") and " – " in line
    assert table.format_compiled_table([r], markdown=True).count("\n") == 1   # header only


def test_a_row_whose_package_is_missing_is_skipped_with_the_reason(monkeypatch, capsys):
    real = table.importlib.util.find_spec
    monkeypatch.setattr(table.importlib.util, "find_spec",
                        lambda name, *a: None if name == "opacus" else real(name, *a))
    r = table.run_workload(OPACUS[0], torch.device("cpu"), rounds=1, min_time=0.0)
    assert r["skipped"].startswith("opacus is not installed (bash scripts/setup.sh bench")
    assert "SKIPPED: opacus is not installed" in table.format_table([r], markdown=True)
    assert table.main(["--filter", "Opacus", "--backends", "", "--no-anchor"]) == 0
    out = capsys.readouterr().out
    assert out.count("SKIPPED: opacus is not installed") == 2
    assert "2 rows: 0 checked, 0 failed, 2 skipped" in out


def test_memory_columns(monkeypatch):
    """``--memory``: one cell really measured in its own process (benchmarks/cell_memory.py),
    the others given; a column per implementation and the functrans / torch.func ratio; a
    failed cell says why and fails nothing else."""
    w = next(w for w in SMALL if w.name == "hessian")
    cell = table.run_memory(w, torch.device("cpu"), "functrans", timeout=300)
    assert set(cell) == {"peak_mb"} and cell["peak_mb"] >= 0
    given = {"functrans": {"peak_mb": 3.0}, "torch.func": {"peak_mb": 2.0},
             "ft.compile tiered": {"peak_mb": 2.5}, "ft.compile replay": {"error": "boom"},
             "ft.compile inductor": {"peak_mb": 3.3},
             "torch.compile(torch.func)": {"peak_mb": 1.0}}
    asked = []
    monkeypatch.setattr(table, "run_memory",
                        lambda w, device, impl, timeout=600.0: asked.append(impl) or given[impl])
    r = table.run_workload(w, torch.device("cpu"), rounds=1, min_time=0.0, backends=(),
                           anchor=False, memory=table.MEMORY_IMPLS)
    assert asked == list(table.MEMORY_IMPLS) == list(given) and r["memory"] == given
    text = table.format_table([r], markdown=True)
    head, _, line = text.splitlines()
    assert head.endswith("| functrans peak MB | torch.func peak MB | ft.compile tiered peak MB | "
                         "ft.compile replay peak MB | ft.compile inductor peak MB | "
                         "torch.compile(torch.func) peak MB | peak ft / torch.func | "
                         "peak ft.compile / ft eager |")
    # the largest compiled peak over eager's, and which backend it is
    assert line.endswith("| 3.00 | 2.00 | 2.50 | FAILED: boom | 3.30 | 1.00 | 1.50 | "
                         "1.10 (inductor) |")
    plain = table.format_table([r, dict(r, error="RuntimeError: x", times={})], markdown=False)
    assert "FAILED: RuntimeError: x" in plain
    assert "peak MB" not in table.format_table([dict(r, memory={})], markdown=False)
