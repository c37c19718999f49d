"""Build the notebooks from their sources and store them with outputs.

Each notebook's source is a plain Python file in ``notebooks/src/`` in the "percent" format:
``# %%`` starts a code cell, ``# %% [markdown]`` a markdown cell whose lines are comments
(``# `` is stripped).  ``build.py`` turns a source into ``notebooks/<name>.ipynb``, runs it top
to bottom in a fresh Jupyter kernel (the interpreter running this script) and writes it back
with its outputs, so the stored notebook shows what a reader will see.

    .venv/bin/python notebooks/build.py                 # every notebook
    .venv/bin/python notebooks/build.py 01_per_sample   # the ones whose name starts so

``tests/test_notebooks.py`` re-executes the stored notebooks in CI and checks that each one
still matches its source.  ``notebooks/run_as_script.py`` runs the sources as plain Python (no
Jupyter needed), on a chosen device.  ``parse_source`` and ``sources`` need no Jupyter package
(nbformat and nbclient are imported where a notebook is built or executed).
"""
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
SRC = HERE / "src"
KERNEL = "python3"


def parse_source(text):
    """The cells of a percent-format source: a list of ("code" | "markdown", text)."""
    cells, kind, lines = [], None, []

    def flush():
        if kind is not None:
            body = "\n".join(lines).strip("\n")
            if body:
                cells.append((kind, body))

    for line in text.splitlines():
        if line.startswith("# %%"):
            flush()
            kind = "markdown" if "[markdown]" in line else "code"
            lines = []
        elif kind == "markdown":
            lines.append(line[2:] if line.startswith("# ") else line.lstrip("#"))
        elif kind is not None:
            lines.append(line)
    flush()
    return cells


def notebook_from_source(path):
    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": KERNEL, "display_name": "Python 3", "language": "python"}
    make = {"code": nbformat.v4.new_code_cell, "markdown": nbformat.v4.new_markdown_cell}
    nb.cells = [make[kind](body) for kind, body in parse_source(path.read_text())]
    return nb


def execute(nb, cwd=HERE, timeout=120):
    """Run ``nb`` in place in a fresh kernel; returns the seconds it took."""
    import nbclient
    start = time.perf_counter()
    nbclient.NotebookClient(nb, timeout=timeout, kernel_name=KERNEL,
                            resources={"metadata": {"path": str(cwd)}}).execute()
    return time.perf_counter() - start


def sources(prefixes=()):
    found = sorted(SRC.glob("*.py"))
    if prefixes:
        found = [p for p in found if any(p.stem.startswith(q) for q in prefixes)]
    return found


def main(argv):
    import nbformat
    for src in sources(argv):
        nb = notebook_from_source(src)
        seconds = execute(nb)
        out = HERE / f"{src.stem}.ipynb"
        nbformat.write(nb, out)
        print(f"{out.name}: {len(nb.cells)} cells, ran in {seconds:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
