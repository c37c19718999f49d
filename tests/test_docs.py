"""The documentation site's sources hold together (cheap checks; CI builds the site itself with
``bash scripts/docs.sh``, warnings as errors, as a separate step).

Every public name has an API page, every notebook is on the site, every toctree entry exists,
the benchmark page's generator parses the README's tables (and fails clearly on a broken one),
and the examples of "Coming from torch.func" run."""
import pathlib
import re
import sys
import warnings

import pytest
import torch

import functrans
import functrans.extend
import functrans.nn
import functrans.nn.dp

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))
import bench_page  # noqa: E402  (docs/_ext/bench_page.py)
import nb_sync  # noqa: E402  (docs/_ext/nb_sync.py)

API = {p.stem: p.read_text(encoding="utf-8") for p in sorted((DOCS / "api").glob("*.md"))}
DIRECTIVE = re.compile(r"^\.\. auto(?:function|class|exception|module):: ([\w.]+)", re.M)


def _documented():
    """The dotted names the API pages document, and the modules they document with :members:
    and no list (so every public member of those modules is on the page)."""
    names, whole_modules = set(), set()
    for text in API.values():
        for block in re.findall(r"```\{eval-rst\}\n(.*?)```", text, re.S):
            for m in re.finditer(r"^\.\. auto(\w+):: ([\w.]+)\n((?:   .*\n)*)", block, re.M):
                kind, name, options = m.groups()
                names.add(name)
                if kind == "module" and re.search(r":members:\s*$", options, re.M):
                    whole_modules.add(name)
    return names, whole_modules


def test_every_public_name_has_an_api_page():
    names, whole_modules = _documented()
    short = {n.rsplit(".", 1)[-1] for n in names}
    missing = [n for n in functrans.__all__
               if n not in short and f"functrans.{n}" not in whole_modules]
    assert not missing, f"functrans.__all__ names on no page of docs/api/: {missing}"
    nn_missing = [n for n in functrans.nn.__all__ if n not in short and n != "dp"
                  and n not in functrans.nn.dp.__all__]
    assert not nn_missing, f"functrans.nn names on no page of docs/api/: {nn_missing}"
    # DP-SGD and extend are documented whole, so functions added later appear by themselves
    assert {"functrans.nn.dp", "functrans.extend"} <= whole_modules


def test_api_directives_name_importable_objects():
    import importlib
    for page, text in API.items():
        for name in DIRECTIVE.findall(text):
            mod, _, attr = name.rpartition(".")
            try:
                obj = importlib.import_module(name)
            except ImportError:
                obj = getattr(importlib.import_module(mod), attr, None)
            assert obj is not None, f"docs/api/{page}.md documents {name}, which does not exist"


def test_every_toctree_entry_exists():
    for page in DOCS.glob("*.md"):
        for block in re.findall(r"```\{toctree\}\n(.*?)```", page.read_text(), re.S):
            for entry in block.splitlines():
                entry = entry.strip()
                if not entry or entry.startswith(":") or "*" in entry:
                    continue
                assert (DOCS / f"{entry}.md").exists(), f"{page.name}: toctree entry {entry}"


def test_every_notebook_is_on_the_site(tmp_path):
    stored = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    (tmp_path / "99_removed.ipynb").write_text("{}")
    assert nb_sync.sync(ROOT / "notebooks", tmp_path) == stored
    assert sorted(p.name for p in tmp_path.glob("*.ipynb")) == stored   # stale copy removed
    assert "nb_sync.sync(ROOT / \"notebooks\", DOCS / \"notebooks\")" in (
        DOCS / "conf.py").read_text()
    assert re.search(r":glob:\n\nnotebooks/\*\n", (DOCS / "notebooks.md").read_text())
    for name in stored:        # a title, which the toctree shows
        assert '"source": [\n    "# ' in (ROOT / "notebooks" / name).read_text(), name


def test_error_page_includes_the_misuse_catalogue():
    assert "```{include} misuse.md" in (DOCS / "errors.md").read_text()
    assert (DOCS / "misuse.md").read_text().startswith("# Misuse catalogue")


def test_build_outputs_are_ignored():
    ignored = (ROOT / ".gitignore").read_text().split()
    assert {"docs/_build/", "docs/_generated/", "docs/notebooks/"} <= set(ignored)


def test_benchmark_page_parses_the_readme():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    parsed = bench_page.parse_readme(readme)
    section = readme.split(bench_page.START)[1].split(bench_page.END)[0]
    data_rows = [ln for ln in section.splitlines()
                 if ln.startswith("| ") and not ln.startswith(("| workload",))]
    head, rows = parsed["eager"]
    chead, crows, _ = parsed["compiled"]
    assert len(rows) + len(crows) == len(data_rows)
    assert "ft / torch.func" in head and "replay / torch.func" in chead


@pytest.mark.parametrize("breakage, message", [
    (lambda t: t.replace(bench_page.START, ""), "markers"),
    (lambda t: t.replace("| ft / torch.func |", "| ratio |", 1), "lacks the columns"),
    (lambda t: t.replace("| hessian | D=64 |", "| hessian | D=65 |", 1), "names no workload"),
])
def test_benchmark_page_fails_clearly_on_a_broken_readme(tmp_path, breakage, message):
    pytest.importorskip("matplotlib", reason="the dev extra installs matplotlib")
    readme = tmp_path / "README.md"
    readme.write_text(breakage((ROOT / "README.md").read_text(encoding="utf-8")))
    with pytest.raises(bench_page.BenchParseError, match=message):
        bench_page.generate(tmp_path / "out", readme)


def test_benchmark_page_generates_tables_and_plots(tmp_path):
    pytest.importorskip("matplotlib", reason="the dev extra installs matplotlib")
    bench_page.generate(tmp_path, ROOT / "README.md")
    eager = (tmp_path / "bench_eager_table.md").read_text()
    assert "| workload | size | tier |" in eager and "| hessian | D=64 | small |" in eager
    assert "| replay / torch.func |" in (tmp_path / "bench_compiled_table.md").read_text()
    for png in ("bench_eager.png", "bench_compiled.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_from_torch_func_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "from_torch_func.md").read_text(), re.S)
    assert len(blocks) >= 2
    ns = {}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", functrans.PerformanceWarning)  # the page silences its own
        for code in blocks:
            exec(compile(code, "docs/from_torch_func.md", "exec"), ns)
    assert ns["per_sample"].shape == (64, 3, 8)
