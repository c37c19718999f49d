"""Sphinx extension: the benchmark page's tables and plots, made from the README at build time.

``python -m benchmarks --update-readme`` (benchmarks/table.py) writes the eager table and the
compiled table between ``<!-- bench:cpu:start -->`` and ``<!-- bench:cpu:end -->`` in README.md.
When the build starts (``builder-inited``) this extension parses them and writes, under
docs/_generated/ (git-ignored, included by docs/benchmarks.md):

* ``bench_eager_table.md``: the machine line and the eager table, with a tier column (small /
  medium / large, from benchmarks/workloads.py) added;
* ``bench_compiled_table.md``: the compiled table and the line the README puts above it;
* ``bench_eager.png``: functrans / torch.func per row, grouped by tier, with the tier's target;
* ``bench_compiled.png``: functrans.compile (replay, inductor) / torch.func eager per row;
* ``bench_gpu.md``: the GPU tables between ``<!-- bench:gpu:start -->`` and
  ``<!-- bench:gpu:end -->`` (``python -m benchmarks.gpu --update-readme``), as they stand.

Nothing is typed by hand: if the README's tables cannot be parsed (markers missing, a column
renamed, a row whose workload is unknown), the build stops with a message saying what and where.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
START, END = "<!-- bench:cpu:start -->", "<!-- bench:cpu:end -->"
EAGER_COLS = ("workload", "size", "functrans ms", "torch.func ms", "ft / torch.func",
              "target (ft / torch.func)")
COMPILED_COLS = ("workload", "size", "replay / torch.func", "inductor / torch.func")
TIERS = ("small", "medium", "large")
TIER_TARGET = {"small": 1.2, "medium": 1.0}


class BenchParseError(RuntimeError):
    """The README's benchmark section is not in the form benchmarks/table.py writes."""


def _fail(what: str) -> BenchParseError:
    return BenchParseError(
        f"docs/_ext/bench_page.py: cannot build the benchmark page from {README}: {what}. "
        "The tables between the bench:cpu markers are written by "
        "`python -m benchmarks --update-readme` (benchmarks/table.py); regenerate them, or update "
        "the parser if the table's format changed on purpose.")


def _tables(section: str) -> List[Tuple[List[str], List[List[str]], str]]:
    """Every markdown table in ``section``: (header, rows, the paragraph just before it)."""
    out, lines, i = [], section.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("| ") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            head = [c.strip() for c in lines[i].strip().strip("|").split("|")]
            j, rows = i + 2, []
            while j < len(lines) and lines[j].startswith("|"):
                rows.append([c.strip() for c in lines[j].strip().strip("|").split("|")])
                j += 1
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            out.append((head, rows, lines[k] if k >= 0 else ""))
            i = j
        else:
            i += 1
    return out


def parse_readme(text: str) -> Dict[str, object]:
    """The eager and compiled tables of the README's bench:cpu section, checked."""
    if START not in text or END not in text:
        raise _fail(f"the markers {START} / {END} are missing")
    section = text.split(START, 1)[1].split(END, 1)[0]
    tables = _tables(section)
    if len(tables) < 1:
        raise _fail("no markdown table between the bench:cpu markers")
    machine = section.strip().splitlines()[0]
    eager_head, eager_rows, _ = tables[0]
    missing = [c for c in EAGER_COLS if c not in eager_head]
    if missing:
        raise _fail(f"the eager table (first table) lacks the columns {missing}; "
                    f"its header is {eager_head}")
    for n, row in enumerate(eager_rows, 1):
        if len(row) != len(eager_head):
            raise _fail(f"eager table row {n} has {len(row)} cells, the header {len(eager_head)}: "
                        f"{row}")
    compiled = None
    if len(tables) > 1:
        head, rows, before = tables[1]
        missing = [c for c in COMPILED_COLS if c not in head]
        if missing:
            raise _fail(f"the compiled table (second table) lacks the columns {missing}")
        compiled = (head, rows, before)
    return {"machine": machine, "eager": (eager_head, eager_rows), "compiled": compiled}


def _tiers() -> Dict[Tuple[str, str], str]:
    from benchmarks.workloads import WORKLOADS
    return {(w.name, w.size): w.tier for w in WORKLOADS}


def _ratio(cell: str, where: str) -> float:
    try:
        return float(cell.rstrip("×"))
    except ValueError:
        raise _fail(f"{where}: {cell!r} is not a number") from None


def _md_table(head: List[str], rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _bar_plot(path: Path, groups: List[Tuple[str, List[Tuple[str, List[float]]]]],
              series: List[str], title: str, targets: Dict[str, float]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = sum(len(rows) for _, rows in groups)
    fig, ax = plt.subplots(figsize=(9, 0.32 * n + 1.6))
    y, ticks, labels, width = 0.0, [], [], 0.8 / len(series)
    colors = ["#3b75af", "#ef8636", "#519e3e"]
    for g, (tier, rows) in enumerate(groups):
        top = y
        for label, values in rows:
            for s, v in enumerate(values):
                ax.barh(y + s * width, v, height=width, color=colors[s % len(colors)],
                        label=series[s] if (g == 0 and y == top and len(series) > 1) else None)
            ticks.append(y + (len(values) - 1) * width / 2)
            labels.append(label)
            y += 1
        if tier in targets:
            ax.plot([targets[tier]] * 2, [top - 0.5, y - 0.5], color="crimson", lw=1.2, ls="--")
        ax.text(0.01, top - 0.45, f"{tier} tier",
                fontsize=8, color="dimgray", transform=ax.get_yaxis_transform())
        y += 0.8
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time ratio over torch.func eager (below 1: faster than torch.func)")
    ax.set_title(title, fontsize=10)
    if len(series) > 1:
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def generate(out: Path, readme: Path = README) -> None:
    """Write the two tables (markdown) and the two plots (PNG) into ``out``."""
    parsed = parse_readme(readme.read_text(encoding="utf-8"))
    tiers = _tiers()
    head, rows = parsed["eager"]
    col = {c: head.index(c) for c in head}
    by_tier: Dict[str, List[Tuple[str, List[float]]]] = {t: [] for t in TIERS}
    table_rows = []
    for row in rows:
        key = (row[col["workload"]], row[col["size"]])
        if key not in tiers:
            raise _fail(f"eager table row {key} names no workload of benchmarks/workloads.py")
        tier = tiers[key]
        table_rows.append(row[:2] + [tier] + row[2:])
        cell = row[col["ft / torch.func"]]
        if cell.startswith(("FAILED", "SKIPPED")):
            continue
        by_tier[tier].append((f"{key[0]} {key[1]}", [_ratio(cell, f"eager row {key}")]))
    groups = [(t, by_tier[t]) for t in TIERS if by_tier[t]]
    if not groups:
        raise _fail("the eager table has no row with a ft / torch.func ratio")
    out.mkdir(parents=True, exist_ok=True)
    _bar_plot(out / "bench_eager.png", groups, ["functrans / torch.func"],
              "Eager: functrans / torch.func per row (dashed: the tier's target)", TIER_TARGET)
    _write(out / "bench_eager_table.md",
           f"*{parsed['machine']}*\n\n" + _md_table(head[:2] + ["tier"] + head[2:], table_rows))
    if parsed["compiled"] is None:
        raise _fail("the compiled table (the second table between the markers) is missing")
    chead, crows, before = parsed["compiled"]
    ccol = {c: chead.index(c) for c in chead}
    cgroups: Dict[str, List[Tuple[str, List[float]]]] = {t: [] for t in TIERS}
    for row in crows:
        key = (row[ccol["workload"]], row[ccol["size"]])
        if key not in tiers:
            raise _fail(f"compiled table row {key} names no workload of benchmarks/workloads.py")
        cells = [row[ccol["replay / torch.func"]], row[ccol["inductor / torch.func"]]]
        if any(not re.match(r"^[0-9.]+$", c) for c in cells):
            continue                       # a FAILED cell: in the table, not in the plot
        cgroups[tiers[key]].append((f"{key[0]} {key[1]}",
                                    [_ratio(c, f"compiled row {key}") for c in cells]))
    if not any(cgroups.values()):
        raise _fail("the compiled table has no row with replay and inductor ratios")
    _bar_plot(out / "bench_compiled.png", [(t, cgroups[t]) for t in TIERS if cgroups[t]],
              ["functrans.compile replay", "functrans.compile inductor"],
              "Compiled: functrans.compile / torch.func eager per row", {})
    _write(out / "bench_compiled_table.md", before + "\n\n" + _md_table(chead, crows))
    _write(out / "bench_gpu.md", gpu_section(readme.read_text(encoding="utf-8")))


def gpu_section(text: str) -> str:
    """The README's GPU tables (``python -m benchmarks.gpu --update-readme`` writes them between
    the bench:gpu markers), as they stand; a line saying so when there is none."""
    start, end = "<!-- bench:gpu:start -->", "<!-- bench:gpu:end -->"
    if start not in text or end not in text:
        raise _fail(f"the markers {start} / {end} are missing")
    section = text.split(start, 1)[1].split(end, 1)[0].strip()
    return section or "*No GPU run has been recorded yet.*"


def _write(path: Path, text: str) -> None:
    """Write only when the text changed, so a warm build does not re-read the page."""
    if not path.exists() or path.read_text(encoding="utf-8") != text + "\n":
        path.write_text(text + "\n", encoding="utf-8")


def _on_builder_inited(app) -> None:
    generate(Path(app.srcdir) / "_generated")


def setup(app):
    app.connect("builder-inited", _on_builder_inited)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
