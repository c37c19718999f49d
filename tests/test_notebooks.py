"""The notebooks run top to bottom in a fresh kernel, fast, and stay in step with their sources.

Each stored notebook (``notebooks/*.ipynb``, built by ``notebooks/build.py`` from
``notebooks/src/*.py``) is executed again here, as a reader would run it; a cell that raises
fails the test with the cell's traceback."""
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat", reason="the dev extra installs nbformat")
pytest.importorskip("nbclient", reason="the dev extra installs nbclient")
pytest.importorskip("matplotlib", reason="the dev extra installs matplotlib")

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
sys.path.insert(0, str(NOTEBOOKS))
import build  # noqa: E402  (notebooks/build.py)

SOURCES = build.sources()
LIMIT_S = 60          # the budget for one notebook on a CPU


def test_there_are_four_notebooks():
    assert [p.stem[:2] for p in SOURCES] == ["01", "02", "03", "04"]


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_stored_notebook_matches_its_source_and_has_outputs(src):
    stored = nbformat.read(NOTEBOOKS / f"{src.stem}.ipynb", as_version=4)
    expected = build.notebook_from_source(src)
    assert [(c.cell_type, c.source) for c in stored.cells] == \
        [(c.cell_type, c.source) for c in expected.cells], \
        f"{src.stem}.ipynb is stale: run `.venv/bin/python notebooks/build.py {src.stem}`"
    code = [c for c in stored.cells if c.cell_type == "code"]
    assert code and all(c.execution_count for c in code), "stored without running every cell"
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, "each notebook shows at least one matplotlib plot"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(src):
    nb = nbformat.read(NOTEBOOKS / f"{src.stem}.ipynb", as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    seconds = build.execute(nb, timeout=LIMIT_S)
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if "image/png" in o.get("data", {})]
    assert images, "the plot cell drew nothing"
    assert seconds < LIMIT_S, f"{src.stem} took {seconds:.0f} s; the budget is {LIMIT_S} s"


# notebooks/run_as_script.py: the notebooks as plain scripts (how a machine without Jupyter,
# e.g. the GPU box, runs them: ``python notebooks/run_as_script.py --device cuda``).
import run_as_script  # noqa: E402  (notebooks/run_as_script.py)


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_each_source_becomes_a_script_that_picks_its_device(src):
    script = run_as_script.script_from_source(src)
    compile(script, str(src), "exec")
    assert "FUNCTRANS_NOTEBOOK_DEVICE" in script and "torch.cuda.is_available()" in script


def test_the_script_runner_passes_the_device_and_fails_on_an_exception(tmp_path):
    ok = tmp_path / "ok.py"
    ok.write_text("# %%\nimport os\n"
                  "assert os.environ['FUNCTRANS_NOTEBOOK_DEVICE'] == 'cpu'\n"
                  "assert os.environ['MPLBACKEND'] == 'Agg'\n")
    bad = tmp_path / "bad.py"
    bad.write_text("# %%\nx = 1\n# %% [markdown]\n# text\n# %%\nraise ValueError('boom')\n")
    assert run_as_script.run(ok, "cpu")[0] == 0
    rc, seconds = run_as_script.run(bad, "cpu")
    assert rc != 0 and seconds >= 0
