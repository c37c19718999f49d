"""functrans beside torch.func on the whole OpInfo ``op_db``: one table, four checks.

Rows: vmap, vmap∘vmap (``tests.support.opinfo_sweep``: against a for-loop of the op),
vmap∘vjp and vmap∘jvp (``tests.support.opinfo_autodiff``: against a for-loop of plain autograd /
forward AD).  Cells count ops by their worst check: ``rule`` (batching rules or decompositions only;
functrans ran strict, torch.func gave no fallback warning), ``fallback`` (some op ran on the
per-example loop), ``error``, ``wrong``.  torch.func runs here as a test-side reference only.

Run ``python -m tests.support.side_by_side [--ops a,b] [--report FILE]`` (the full run takes
~3 min on 2 cores).
"""
from __future__ import annotations

import argparse
import time

from tests.support import opinfo_sweep
from tests.support import opinfo_autodiff


def run(names=None):
    ops = opinfo_sweep.select_ops(True, names)
    vm = opinfo_sweep.sweep(ops, full=True, with_torch=True)
    ad = {opinfo_sweep.op_id(op): opinfo_autodiff.sweep_op(op, full=True) for op in ops}
    rows = {"vmap": opinfo_sweep.per_check(vm, False),
            "vmap∘vmap": opinfo_sweep.per_check(vm, True)}
    for check, label in (("vmap_vjp", "vmap∘vjp"), ("vmap_jvp", "vmap∘jvp")):
        rows[label] = opinfo_autodiff.counts(ad, check)
    return vm, ad, rows


def gaps(vm, ad) -> str:
    """Per check, the ops that torch.func runs (by rule or fallback) where functrans falls
    back or errors: what is left to do, or to explain in known_fallbacks / XFAILS."""
    passing = ("rule", "fallback")
    lines = ["functrans behind torch.func (functrans outcome; torch.func passes):"]
    for nested, label in ((False, "vmap"), (True, "vmap∘vmap")):
        behind = [f"{r.op} ({r.outcome('functrans', nested)})" for r in vm if not r.skipped
                  and r.outcome("functrans", nested) in ("fallback", "error")
                  and r.outcome("torch.vmap", nested) in passing]
        lines.append(f"  {label}: " + (", ".join(behind) or "none"))
    for check, label in (("vmap_vjp", "vmap∘vjp"), ("vmap_jvp", "vmap∘jvp")):
        behind = []
        for name, res in ad.items():
            if "skipped" in res or ("functrans", check) not in res:
                continue
            ours = opinfo_autodiff.worst(res[("functrans", check)])
            theirs = opinfo_autodiff.worst(res[("torch.func", check)])
            if ours in ("fallback", "error") and theirs in passing:
                behind.append(f"{name} ({ours})")
        lines.append(f"  {label}: " + (", ".join(behind) or "none"))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="", help="comma-separated OpInfo names (default: all)")
    p.add_argument("--report", default="", help="also write the report to this file")
    a = p.parse_args(argv)
    start = time.time()
    vm, ad, rows = run([s for s in a.ops.split(",") if s] or None)
    text = "\n".join([f"functrans | torch.func, {len(vm)} OpInfo ops "
                      f"({time.time() - start:.0f} s)", ""] + opinfo_sweep.check_table(rows))
    text += "\n\n" + gaps(vm, ad)
    wrong = [r.op for r in vm if r.outcome("functrans") == "wrong"] + [
        name for name, res in ad.items() if "skipped" not in res and any(
            impl == "functrans" and opinfo_autodiff.worst(outs) == "wrong"
            for (impl, _), outs in res.items())]
    text += "\n\nfunctrans wrong: " + (", ".join(sorted(set(wrong))) or "none")
    print(text)
    if a.report:
        with open(a.report, "w") as fh:
            fh.write(text + "\n")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
