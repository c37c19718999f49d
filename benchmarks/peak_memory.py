"""Peak CPU memory of one call, read soundly: the helpers benchmarks/dp_memory.py,
benchmarks/chunk_memory.py and the ``--memory`` column of benchmarks/table.py share.

How a peak is read (Linux): the call runs in a fresh subprocess (``run_child``), so that no
other measurement's freed memory can hide its peak, with ``MALLOC_MMAP_THRESHOLD_=65536`` in
the environment (glibc then serves every buffer above 64 KiB by ``mmap`` and unmaps it when
freed: the resident set follows the live tensors instead of keeping freed heap pages).  In
that process ``peak_above(fn)`` collects garbage, runs ``malloc_trim(0)``, reads the resident
set (``/proc/self/statm``), resets the kernel's high-water mark (``5`` written to
``/proc/self/clear_refs``), calls ``fn`` once and returns the new high-water mark (``VmHWM`` in
``/proc/self/status``) minus the resident set before it: what the call's live tensors, its
temporaries and its result added at their highest.  (``tracemalloc`` does not see torch's CPU
allocations, and torch keeps no CPU allocator statistics; this reads what the kernel charges
the process.)
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
from typing import Callable, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss() -> int:
    """The process's resident set, in bytes."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def hwm() -> int:
    """The process's resident-set high-water mark (``VmHWM``), in bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_hwm() -> None:
    """Reset ``VmHWM`` to the current resident set."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def trim() -> None:
    """Collect garbage and hand freed heap memory back to the kernel."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):      # not glibc: nothing to trim
        pass


def peak_above(fn: Callable[[], object]) -> Dict[str, float]:
    """One call of ``fn``: its peak above the resident set before it, and the process's peak
    during it (``{"peak_mb", "process_peak_mb"}``, MiB).  The result is dropped after."""
    trim()
    before = rss()
    reset_hwm()
    out = fn()
    top = hwm()
    del out
    return {"peak_mb": (top - before) / 2 ** 20, "process_peak_mb": top / 2 ** 20}


def child_env() -> Dict[str, str]:
    """The environment of a measuring subprocess (see the module docstring)."""
    return dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))


def run_child(module: str, args: List[str], timeout: Optional[float] = None,
              measure_memory: bool = True, cold_inductor_cache: bool = False) -> dict:
    """``python -m <module> <args>`` in a fresh process (with ``child_env()`` when
    ``measure_memory``; else this process's environment; ``cold_inductor_cache``: with an empty
    Inductor cache directory of its own, so its compilations are the first a new user pays):
    the JSON object on the last line of its stdout, or ``{"error": ...}`` ("exit N: <last line
    of stderr>" when it failed)."""
    env = child_env() if measure_memory else dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="inductor-cache-") as cache:
        if cold_inductor_cache:
            env["TORCHINDUCTOR_CACHE_DIR"] = cache
        try:
            proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:g} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        try:
            return json.loads(lines[-1])
        except ValueError:
            pass
    last = (proc.stderr.strip().splitlines() or ["failed"])[-1][:160]
    return {"error": last if proc.returncode == 0 else f"exit {proc.returncode}: {last}"}
