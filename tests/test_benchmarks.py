"""The benchmark workloads stay correct: every small-tier row passes the check that the bench
command runs before timing (no loop fallback; every implementation equal to torch.func), and the
table and README update work.  Timing itself is never asserted here (see benchmarks/)."""
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
    ok = table.run_workload(w, torch.device("cpu"), rounds=1, min_time=0.0)
    failed = dict(ok, error="RuntimeError: boom", times={})
    text = table.format_table([ok, failed], markdown=False)
    assert w.name in text and "FAILED: RuntimeError: boom" in text
    md = table.format_table([ok, failed], markdown=True)
    assert md.count("\n") == 3 and md.startswith("| workload |")
    readme = tmp_path / "README.md"
    readme.write_text("a\n<!-- bench:cpu:start -->\nold\n<!-- bench:cpu:end -->\nb\n")
    table.update_readme(md, torch.device("cpu"), readme)
    assert readme.read_text() == f"a\n<!-- bench:cpu:start -->\n{md}\n<!-- bench:cpu:end -->\nb\n"
