"""Pass / fail / skip counts from a pytest JUnit XML report, over all tests and over the CUDA
tests (those whose id names cuda: the ``device`` fixture's ``[cuda]`` and the ``*_cuda`` tests).

    python scripts/junit_counts.py junit.xml
"""
from __future__ import annotations

import collections
import sys
import xml.etree.ElementTree as ET


def outcome(case: ET.Element) -> str:
    for tag in ("failure", "error", "skipped"):
        el = case.find(tag)
        if el is not None:
            if tag == "skipped" and (el.get("type") or "").endswith("xfail"):
                return "xfailed"
            return {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
    return "passed"


def counts(path: str) -> dict:
    every, cuda = collections.Counter(), collections.Counter()
    failed = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        o = outcome(case)
        every[o] += 1
        if "cuda" in name.lower():
            cuda[o] += 1
        if o in ("failed", "error"):
            failed.append(name)
    return {"all": every, "cuda": cuda, "failed": failed}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    c = counts(argv[0])
    fmt = lambda k: ", ".join(f"{v} {o}" for o, v in sorted(k.items())) or "none"
    print(f"tests, all: {fmt(c['all'])}")
    print(f"tests, cuda: {fmt(c['cuda'])}")
    for name in c["failed"]:
        print(f"  FAILED {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
