"""Pass / fail / skip counts from a pytest JUnit XML report, over all tests and over the CUDA
tests (the ids the run listed with FUNCTRANS_CUDA_IDS=FILE: the tests marked ``cuda``).

    python scripts/junit_counts.py junit.xml cuda_ids.txt
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


def junit_name(nodeid: str) -> str:
    """``tests/a/test_b.py::test_c[x]`` as JUnit names it: ``tests.a.test_b::test_c[x]``
    (a test in a class: ``tests.a.test_b.Class::test_c``)."""
    path, _, rest = nodeid.partition("::")
    parts = rest.split("::")
    return ".".join([path[:-3].replace("/", ".")] + parts[:-1]) + "::" + parts[-1]


def counts(path: str, cuda_ids=()) -> dict:
    every, cuda = collections.Counter(), collections.Counter()
    cuda_names = {junit_name(i) for i in cuda_ids}
    failed = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        o = outcome(case)
        every[o] += 1
        if name in cuda_names:
            cuda[o] += 1
        if o in ("failed", "error"):
            failed.append(name)
    return {"all": every, "cuda": cuda, "failed": failed}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ids = open(argv[1]).read().split("\n") if len(argv) > 1 else []
    c = counts(argv[0], [i for i in ids if i])
    fmt = lambda k: ", ".join(f"{v} {o}" for o, v in sorted(k.items())) or "none"
    print(f"tests, all: {fmt(c['all'])}")
    print(f"tests, cuda (marked cuda): {fmt(c['cuda'])}")
    for name in c["failed"]:
        print(f"  FAILED {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
