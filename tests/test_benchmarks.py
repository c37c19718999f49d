"""The benchmark workloads stay correct: every small-tier row passes the check that the bench
command runs before timing (no loop fallback; every implementation equal to torch.func), and the
table and README update work.  The compiled columns are exercised on the smallest hessian row with
the replay backend only (inductor compiles take seconds); the torch.compile anchor's subprocess
is replaced by a fake that crashes.  Timing itself is never asserted here (see benchmarks/)."""
import pytest
import torch

from benchmarks import table
from benchmarks.workloads import IMPLS, WORKLOADS

SMALL = [w for w in WORKLOADS if w.tier == "small"]


def test_every_workload_name_has_a_small_row():
    assert {w.name for w in SMALL} == {w.name for w in WORKLOADS}


@pytest.mark.parametrize("workload", SMALL, ids=lambda w: w.id)
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

    def branchy():                          # a branch on a tensor value: untraceable
        return x.sin() if x.sum() > 0 else x.cos()

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

    monkeypatch.setattr(table.subprocess, "run", dies)
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
