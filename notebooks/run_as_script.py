"""Run the notebook sources as plain Python scripts: no Jupyter, any device.

Each ``notebooks/src/*.py`` source (its code cells, in order, as ``build.parse_source`` reads
them) runs in a fresh interpreter with ``MPLBACKEND=Agg`` (plots are drawn, not shown) and, with
``--device``, ``FUNCTRANS_NOTEBOOK_DEVICE`` set (each notebook otherwise takes a GPU when
there is one).  It prints each notebook's wall time, and exits non-zero if any notebook raised
(its traceback is printed) or ran past ``--timeout``.  This is how a machine without
nbclient/ipykernel (a GPU box) runs the notebooks; tests/test_notebooks.py runs the stored
notebooks in a Jupyter kernel on the CPU.

    python notebooks/run_as_script.py                       # every notebook
    python notebooks/run_as_script.py --device cuda 01 03   # those whose name starts so, on cuda
"""
import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import build  # noqa: E402  (notebooks/build.py: parse_source needs no Jupyter package)


def script_from_source(path: pathlib.Path) -> str:
    """The notebook's code cells joined into one script (markdown cells dropped)."""
    cells = [body for kind, body in build.parse_source(path.read_text()) if kind == "code"]
    return "\n\n".join(f"# --- cell {i + 1}\n{body}" for i, body in enumerate(cells)) + "\n"


def run(path: pathlib.Path, device=None, timeout: float = 600) -> tuple:
    """(return code, seconds) of one notebook run as a script in a fresh interpreter (cwd
    notebooks/, as the notebook kernel; the repository root on PYTHONPATH)."""
    env = dict(os.environ, MPLBACKEND="Agg")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), env.get("PYTHONPATH"))
                                        if p)
    if device:
        env["FUNCTRANS_NOTEBOOK_DEVICE"] = device
    with tempfile.NamedTemporaryFile("w", suffix=f"_{path.stem}.py", delete=False) as f:
        f.write(script_from_source(path))
    start = time.perf_counter()
    try:
        rc = subprocess.run([sys.executable, f.name], cwd=HERE, env=env,
                            timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"{path.stem}: timed out after {timeout:.0f} s", flush=True)
        rc = 124
    finally:
        os.unlink(f.name)
    return rc, time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prefixes", nargs="*", help="only the notebooks whose name starts so")
    p.add_argument("--device", default=None,
                   help="FUNCTRANS_NOTEBOOK_DEVICE for the notebooks (cpu, cuda, ...)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per notebook")
    a = p.parse_args(argv)
    found = build.sources(a.prefixes)
    if not found:
        print(f"no notebook source matches {a.prefixes}", file=sys.stderr)
        return 2
    failed = []
    for src in found:
        print(f"=== {src.stem} (device: {a.device or 'its default'})", flush=True)
        rc, seconds = run(src, a.device, a.timeout)
        print(f"{src.stem}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {seconds:.1f} s",
              flush=True)
        if rc != 0:
            failed.append(src.stem)
    print(f"{len(found) - len(failed)} of {len(found)} notebooks ran"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
