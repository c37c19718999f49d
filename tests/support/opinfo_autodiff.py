"""OpInfo-driven checks of vjp, jvp, vmap∘vjp and vmap∘jvp, functrans beside torch.func.

For every op of ``op_db`` (CPU, float32 samples computed in float64, a few samples) the function
under test takes every floating tensor of the sample as a differentiated input and returns the
op's floating outputs.
References never use a transform library: plain ``torch.autograd.grad`` for vjp and
``torch.autograd.forward_ad`` for jvp, and for the vmapped checks a for-loop of those over a batch
of DIFFERENT cotangents / primals+tangents.  Each check's outcome, per implementation:

* ``pass``, ``error`` (the message is kept), ``wrong`` (a value differs: the test FAILS on it
  for functrans), or ``oracle_invalid`` (the reference itself fails, e.g. no forward-AD formula).

``--layouts`` runs the layout checks instead (``sweep_op_layouts``): vmap∘vjp and vmap∘jvp with
the cotangents (primals and tangents) stacked at in_dims 0 and -1 and laid out in every layout
of ``tests.support.layouts``, two samples per op, against the loop over contiguous examples.

Run ``python -m tests.support.opinfo_autodiff [--full | --layouts] [--ops a,b]`` for the report.
"""
from __future__ import annotations

import argparse
import collections
import time
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.autograd.forward_ad as fwAD
import torch.func as tf
import torch.utils._pytree as pytree

import functrans as ft
from tests.support.opinfo_sweep import (FAST_OPS, _is_deterministic_or_fails, all_ops, compare,
                                flatten_sample, op_id, skip_reason)
from tests.support import layouts
from tests.support.oracles import perturb_like

# vmap_vjp batches the cotangents, vmap_jvp primals and tangents together; the two mixed checks
# batch only what jacrev / jacfwd batch or only the primals (a batched primal beside an
# unbatched tangent or cotangent: where layouts of primal and tangent differ, the bugs hide).
CHECKS = ("vjp", "jvp", "vmap_vjp", "vmap_jvp", "vmap_jvp_tangents", "vmap_vjp_primals")
IMPLS = {"functrans": ft, "torch.func": tf}
B = 3
FAST_SAMPLES, FULL_SAMPLES = 2, 3


def _float_outputs(out) -> List[torch.Tensor]:
    """The differentiable outputs: floating and complex (ifft, eig... return complex)."""
    return [o for o in pytree.tree_flatten(out)[0]
            if isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex())]


def _ref_vjp(g, diff, cts):
    xs = [d.detach().requires_grad_() for d in diff]  # same storage: as_strided reads it
    with torch.enable_grad():
        outs = g(*xs)
        live = [(o, c) for o, c in zip(outs, cts) if o.requires_grad]
        if not live:
            return tuple(torch.zeros_like(x) for x in xs)
        grads = torch.autograd.grad([o for o, _ in live], xs, [c for _, c in live],
                                    allow_unused=True)
    return tuple(torch.zeros_like(x) if gr is None else gr for gr, x in zip(grads, xs))


def _ref_jvp(g, diff, tangents):
    with fwAD.dual_level():
        outs = g(*[fwAD.make_dual(d, t) for d, t in zip(diff, tangents)])
        res = []
        for o in outs:
            p, t = fwAD.unpack_dual(o)
            res.append((p.detach(), torch.zeros_like(p) if t is None else t.detach()))
    return tuple(p for p, _ in res), tuple(t for _, t in res)


def _batch(x, k, bdim=0):
    return torch.stack([perturb_like(x, 100 * k + i) for i in range(B)], bdim % (x.dim() + 1))


def _example(b, bdim, i, fresh: bool = False):
    """Example ``i`` of a batch as a fresh contiguous tensor (a slice of the batch has a
    storage offset that as_strided & co. would read as part of the example, and its strides
    must not matter: the oracle of every layout is the contiguous loop).  ``fresh``: the
    example's own clone() instead, keeping its memory order, for the ops that address storage
    (the as_strided family: see tests.support.opinfo_sweep.run_check)."""
    e = b.select(bdim, i)
    if fresh == "storage":   # as_strided / as_strided_copy: where example 0 sits (opinfo_sweep)
        from tests.support.opinfo_sweep import _where_example_zero_sits
        return _where_example_zero_sits(e, b.select(bdim, 0).storage_offset())
    return e.clone() if fresh else e.clone(memory_format=torch.contiguous_format)


def _fresh(name: str):
    """How the loop oracle makes examples of the storage-addressing ops: as_strided and
    as_strided_copy at example 0's place in a copy of the storage (each example viewed as
    example 0 is: Note [as_strided under vmap]), as_strided_scatter a fresh clone (eager writes
    into one); every other op contiguous."""
    if name in ("as_strided", "as_strided_copy") or name.startswith("as_strided."):
        return "storage"
    return name.startswith("as_strided")


def _loop(fn, bdim, *batches, fresh: bool = False):
    outs = [fn(*[_example(b, bdim, i, fresh) for b in batches]) for i in range(B)]
    return pytree.tree_map(lambda *xs: torch.stack(xs), *outs)


def _checks_for(g, diff, randomness: str = "error") -> Dict[str, tuple]:
    """check -> (run(impl), reference()); ``randomness`` for samples that draw random numbers
    without their values depending on the seed (see
    tests.support.opinfo_sweep._is_deterministic)."""
    outs0 = g(*diff)
    cts = tuple(perturb_like(o, 7) for o in outs0)
    tangents = tuple(perturb_like(d, 11) for d in diff)
    CT = tuple(_batch(c, 1) for c in cts)
    X = tuple(_batch(d, 2) for d in diff)
    T = tuple(_batch(t, 3) for t in tangents)
    n = len(diff)

    def loop(fn, *batches):
        return _loop(fn, 0, *batches)

    return {
        "vjp": (lambda m: m.vjp(g, *diff)[1](cts), lambda: _ref_vjp(g, diff, cts)),
        "jvp": (lambda m: m.jvp(g, diff, tangents), lambda: _ref_jvp(g, diff, tangents)),
        "vmap_vjp": (lambda m: m.vmap(m.vjp(g, *diff)[1], randomness=randomness)(CT),
                     lambda: loop(lambda *c: _ref_vjp(g, diff, c), *CT)),
        "vmap_jvp": (lambda m: m.vmap(lambda *a: m.jvp(g, a[:n], a[n:]),
                                      randomness=randomness)(*X, *T),
                     lambda: loop(lambda *a: _ref_jvp(g, a[:n], a[n:]), *X, *T)),
        "vmap_jvp_tangents": (lambda m: m.vmap(lambda *t: m.jvp(g, diff, t),
                                               randomness=randomness)(*T),
                              lambda: loop(lambda *t: _ref_jvp(g, diff, t), *T)),
        "vmap_vjp_primals": (lambda m: m.vmap(lambda *a: m.vjp(g, *a)[1](cts),
                                              randomness=randomness)(*X),
                             lambda: loop(lambda *a: _ref_vjp(g, a, cts), *X)),
    }


# The layout checks (``--layouts``, ``-m sweep``): vmap∘vjp and vmap∘jvp with every batch (the
# cotangents; the primals and tangents) stacked at in_dim 0 or -1 and laid out in each layout
# of tests.support.layouts, against the loop over contiguous examples.
LAYOUT_CHECKS = ("vmap_vjp", "vmap_jvp")
LAYOUT_SAMPLES, LAYOUT_FAST_SAMPLES = 2, 1
LAYOUT_FAST_OPS = ("matmul", "softmax")


def _laid_out(xs, k, layout, bdim, written=frozenset()):
    """Batches of DIFFERENT examples like ``xs`` (number ``k`` of ``_batch``), at ``bdim``, in
    ``layout``; None when the layout applies to none of them."""
    out, laid_any = [], layout == "stacked"
    for j, x in enumerate(xs):
        b = _batch(x, k, bdim)
        laid = layouts.lay_out(b, layouts.bdim_positions(x.dim(), [bdim]), layout,
                               expandable=j not in written)
        laid_any = laid_any or laid is not None
        out.append(b if laid is None else laid)
    return tuple(out) if laid_any else None


def _layout_checks_for(g, diff, layout: str, bdim: int, randomness: str = "error",
                       written=frozenset(), fresh: bool = False) -> Dict[str, tuple]:
    """check -> (run(impl, batches), reference(), batches) for the LAYOUT_CHECKS that the
    layout applies to; ``run`` takes the batches, so that a wrong result can be rerun on the
    same values laid out contiguously (the control of ``_judge_layout``)."""
    outs0 = g(*diff)
    cts = tuple(perturb_like(o, 7) for o in outs0)
    tangents = tuple(perturb_like(d, 11) for d in diff)
    CT = _laid_out(cts, 1, layout, bdim)
    XT = _laid_out(diff + tangents, 2, layout, bdim,
                   written | {j + len(diff) for j in written})
    n = len(diff)
    checks = {}
    if CT is not None:
        checks["vmap_vjp"] = (
            lambda m, ct: m.vmap(m.vjp(g, *diff)[1], in_dims=bdim, randomness=randomness)(ct),
            lambda: _loop(lambda *c: _ref_vjp(g, diff, c), bdim, *CT, fresh=fresh), CT)
    if XT is not None:
        checks["vmap_jvp"] = (
            lambda m, xt: m.vmap(lambda *a: m.jvp(g, a[:n], a[n:]), in_dims=bdim,
                                 randomness=randomness)(*xt),
            lambda: _loop(lambda *a: _ref_jvp(g, a[:n], a[n:]), bdim, *XT, fresh=fresh), XT)
    return checks


def _judge_layout(results, key, run, ref, batches, impls) -> None:
    """``_judge`` of one layout check, with its control: a result that is wrong in the
    expanded layout (which repeats values) and also wrong on the same values laid out
    contiguously is ``oracle_invalid`` (the values, not the layout: rank-deficient matrices)."""
    _judge(results, key, lambda m: run(m, batches), ref, impls, vmapped=True)
    if key[-1] != "expanded":
        return
    same_values = tuple(b.contiguous() for b in batches)
    for impl in impls:
        outs = results[(impl, *key)]
        if not outs[-1].startswith("wrong"):
            continue
        control = collections.defaultdict(list)
        _judge(control, key, lambda m: run(m, same_values), ref, (impl,), vmapped=True)
        if control[(impl, *key)][-1].startswith("wrong"):
            outs[-1] = "oracle_invalid: " + outs[-1]


def _run(impl: str, run, vmapped: bool):
    """(result, how): how is 'pass' for vjp/jvp; for the vmapped checks 'rule' (batching rules
    or decompositions only: functrans ran strict, torch.func gave no fallback warning) or
    'fallback' (some op ran on the per-example loop)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if not vmapped:
            return run(IMPLS[impl]), "pass"
        if impl == "functrans":
            try:
                with ft.config.strict_fallback():
                    return run(ft), "rule"
            except ft.UnsupportedUnderVmap as e:
                if "loop fallback is disabled" not in str(e):
                    raise
            return run(ft), "fallback"
        torch._C._functorch._set_vmap_fallback_warning_enabled(True)
        try:
            out = run(tf)
        finally:
            torch._C._functorch._set_vmap_fallback_warning_enabled(False)  # its default
    slow = any("performance drop" in str(w.message) for w in caught)
    return out, "fallback" if slow else "rule"


def _samples(op, n_samples: int):
    """(flat sample, g, diff) for the first ``n_samples`` usable samples of ``op``: ``g`` takes
    the sample's floating tensors (in float64) and returns the op's floating outputs."""
    samples = list(op.sample_inputs("cpu", torch.float32))[:n_samples]
    for sample in samples:
        flat, why = flatten_sample(op, sample)
        if flat is None or not _is_deterministic_or_fails(flat):
            continue  # no usable tensors, or a sample that draws random values (dropout_p > 0)
        # Compare in float64: derivatives amplify float32 rounding (a batching bug does not
        # depend on the dtype; the float32 vmap sweep covers float32 kernels).
        base = [t.double() if t.dtype == torch.float32 else t for t in flat.tensors]
        pos = [i for i, t in enumerate(base) if t.is_floating_point()]
        pos = _differentiable(flat.call, base, pos)
        if not pos:
            continue

        def g(*diff, _pos=pos, _base=base, _call=flat.call):
            args = list(_base)
            for i, d in zip(_pos, diff):
                args[i] = d
            return tuple(_float_outputs(_call(*args)))

        yield flat, g, tuple(base[i] for i in pos)


def _differentiable(call, base, pos):
    """The floating positions the op's autograd accepts: an argument it refuses to
    differentiate ("not differentiable with respect to argument 'target'", a loss's target) is
    held constant, as torch.func's own OpInfo tests do, instead of making every reference
    fail (which left such ops with no check at all)."""
    def refuses(which):
        args = [t.detach().requires_grad_() if i in which else t for i, t in enumerate(base)]
        try:
            with torch.enable_grad():
                call(*args)
        except RuntimeError as e:
            return "not differentiable with respect to" in str(e)
        except Exception:
            return False
        return False

    if not refuses(set(pos)):
        return pos
    return [i for i in pos if not refuses({i})]


def _judge(results, key, run, ref, impls, vmapped: bool) -> None:
    """Run one check by every implementation; append each outcome to ``results[(impl, *key)]``."""
    try:
        expected = ref()
    except Exception:
        for impl in impls:
            results[(impl, *key)].append("oracle_invalid")
        return
    for impl in impls:
        try:
            actual, how = _run(impl, run, vmapped=vmapped)
            diffmsg = compare(actual, expected)
            results[(impl, *key)].append(how if diffmsg is None or
                                         diffmsg.startswith("only non-finite")
                                         else f"wrong: {diffmsg}")
        except Exception as e:
            results[(impl, *key)].append(f"error: {type(e).__name__}: "
                                         + str(e).split(chr(10))[0][:160])


def _skip(op) -> Optional[str]:
    reason = skip_reason(op)
    if reason:
        return reason
    return None if op.supports_autograd else "no autograd support"


def _usable_samples(op, count: int):
    """(flat, g, diff) of the op's first ``count`` samples whose function has outputs, or
    {"skipped": reason} when the op (or its sample generation) cannot be swept."""
    reason = _skip(op)
    if reason:
        return {"skipped": reason}
    try:
        samples = list(_samples(op, count))
    except Exception as e:  # pragma: no cover - OpInfo sample generation itself failed
        return {"skipped": f"samples: {e}"}
    usable = []
    for flat, g, diff in samples:
        try:
            if g(*diff):
                usable.append((flat, g, diff))
        except Exception:
            continue
    return usable


def sweep_op(op, *, full: bool, impls: Sequence[str] = tuple(IMPLS)) -> Dict[str, object]:
    """{"skipped": reason} or {(impl, check): [outcome or 'error: msg', ...]}"""
    samples = _usable_samples(op, FULL_SAMPLES if full else FAST_SAMPLES)
    if isinstance(samples, dict):
        return samples
    results: Dict[object, List[str]] = collections.defaultdict(list)
    for flat, g, diff in samples:
        try:
            checks = _checks_for(g, diff, flat.randomness)
        except Exception:
            continue
        for name, (run, ref) in checks.items():
            if "jvp" in name and not op.supports_forward_ad:
                continue
            _judge(results, (name,), run, ref, impls, vmapped=name.startswith("vmap"))
    return dict(results) if results else {"skipped": "no usable sample"}


def sweep_op_layouts(op, *, full: bool,
                     impls: Sequence[str] = tuple(IMPLS)) -> Dict[object, object]:
    """The layout checks: {"skipped": reason} or {(impl, check, layout): [outcome, ...]} over
    in_dims 0 and -1 (``full``: LAYOUT_SAMPLES samples and every layout; else one sample and
    the layouts other than "stacked")."""
    samples = _usable_samples(op, LAYOUT_SAMPLES if full else LAYOUT_FAST_SAMPLES)
    if isinstance(samples, dict):
        return samples
    results: Dict[object, List[str]] = collections.defaultdict(list)
    for flat, g, diff in samples:
        try:
            written = layouts.written_inputs(g, diff)
        except Exception:
            continue
        for layout in layouts.LAYOUTS if full else layouts.LAYOUTS[1:]:
            for bdim in (0, -1):
                try:
                    checks = _layout_checks_for(g, diff, layout, bdim, flat.randomness, written,
                                                fresh=_fresh(op.name))
                except Exception:
                    continue
                for name, (run, ref, batches) in checks.items():
                    if "jvp" in name and not op.supports_forward_ad:
                        continue
                    _judge_layout(results, (name, layout), run, ref, batches, impls)
    return dict(results) if results else {"skipped": "no usable sample"}


def worst(outcomes: List[str]) -> str:
    kinds = [o.split(":")[0] for o in outcomes]
    for k in ("wrong", "error", "oracle_invalid", "fallback", "rule", "pass"):
        if k in kinds:
            return k
    return "none"


OUTCOMES = ("pass", "rule", "fallback", "error", "wrong", "oracle_invalid")


def counts(results: Dict[str, Dict[str, object]], check: str) -> Dict[str, collections.Counter]:
    """{impl: Counter of ops by worst outcome} for one check."""
    out = {impl: collections.Counter() for impl in IMPLS}
    for res in results.values():
        if "skipped" in res:
            continue
        for impl in IMPLS:
            if (impl, check) in res:
                out[impl][worst(res[(impl, check)])] += 1
    return out


def select(full: bool, names: Optional[Sequence[str]] = None):
    ops = all_ops()
    if names:
        return [op for op in ops if op_id(op) in names or op.name in names]
    return ops if full else [op for op in ops if op.name in FAST_OPS]


def report(results: Dict[str, Dict[str, object]]) -> str:
    lines = ["OpInfo autodiff checks: ops by worst outcome (functrans | torch.func); for the",
             "vmapped checks 'rule' means batching rules only, 'fallback' that some op looped", ""]
    lines.append(f"{'check':<18}" + "".join(f"{k:>18}" for k in OUTCOMES))
    for check in CHECKS:
        c = counts(results, check)
        lines.append(f"{check:<18}" + "".join(
            f"{c['functrans'][k]:>9} | {c['torch.func'][k]:<6}" for k in OUTCOMES))
    skipped = collections.Counter(r["skipped"] for r in results.values() if "skipped" in r)
    lines += ["", f"ops: {len(results)}; skipped: " + ", ".join(f"{v} {k}" for k, v in
                                                              skipped.most_common())]
    wrong = [f"  {name} {check}: {o}" for name, res in results.items() if "skipped" not in res
             for (impl, check), outs in res.items() if impl == "functrans"
             for o in outs if o.startswith("wrong")]
    lines += ["", "functrans wrong values:"] + (wrong or ["  none"])
    errs = collections.Counter(o.split(":", 2)[-1].strip()[:110] for res in results.values()
                               if "skipped" not in res for (impl, _), outs in res.items()
                               if impl == "functrans" for o in outs if o.startswith("error"))
    lines += ["", "functrans errors (most common):"] + [f"  {n:>4}  {m}" for m, n in
                                                        errs.most_common(15)]
    lines += ["", "functrans ops not passing by rule, per check (worst outcome):"]
    for check in CHECKS:
        by = collections.defaultdict(list)
        for name, res in results.items():
            if "skipped" not in res and ("functrans", check) in res:
                w = worst(res[("functrans", check)])
                if w in ("fallback", "error", "wrong"):
                    by[w].append(name)
        for w in ("wrong", "error", "fallback"):
            if by[w]:
                lines.append(f"  {check} {w} ({len(by[w])}): " + ", ".join(sorted(by[w])))
    return "\n".join(lines)


LAYOUT_COLUMNS = ("checks", "wrong", "error", "fallback", "oracle_invalid")


def layout_counts(results) -> Dict[Tuple[str, str], Dict[str, collections.Counter]]:
    """{(layout, check): {impl: Counter of CHECKS by outcome, plus 'checks'}} of
    ``sweep_op_layouts`` results ('checks' excludes oracle_invalid)."""
    out: Dict[Tuple[str, str], Dict[str, collections.Counter]] = {}
    for res in results.values():
        if "skipped" in res:
            continue
        for (impl, check, layout), outs in res.items():
            cnt = out.setdefault((layout, check), {i: collections.Counter() for i in IMPLS})
            for o in outs:
                kind = o.split(":")[0]
                cnt[impl][kind] += 1
                if kind != "oracle_invalid":
                    cnt[impl]["checks"] += 1
    order = {name: i for i, name in enumerate(layouts.LAYOUTS)}
    return dict(sorted(out.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])))


def layout_report(results) -> str:
    lines = ["OpInfo autodiff layout checks: CHECKS per layout (functrans | torch.func), in_dims",
             "0 and -1, against the loop over contiguous examples", "",
             f"  {'layout':<14}{'check':<10}" + "".join(f"{k:>18}" for k in LAYOUT_COLUMNS)]
    for (layout, check), c in layout_counts(results).items():
        label = {"vmap_vjp": "vmap∘vjp", "vmap_jvp": "vmap∘jvp"}[check]
        lines.append(f"  {layout:<14}{label:<10}" + "".join(
            f"{c['functrans'][k]:>9} | {c['torch.func'][k]:<6}" for k in LAYOUT_COLUMNS))
    for impl in IMPLS:
        wrong = [f"  {name} {check} layout={layout}: {o}" for name, res in results.items()
                 if "skipped" not in res for (i, check, layout), outs in res.items()
                 if i == impl for o in outs if o.startswith("wrong")]
        lines += ["", f"{impl} wrong values:"] + (wrong or ["  none"])
    errs = collections.Counter(
        f"{layout}: " + o.split(":", 2)[-1].strip()[:110] for res in results.values()
        if "skipped" not in res for (impl, _, layout), outs in res.items()
        if impl == "functrans" for o in outs if o.startswith("error"))
    lines += ["", "functrans errors (most common):"] + [f"  {n:>4}  {m}" for m, n in
                                                        errs.most_common(15)]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true")
    p.add_argument("--layouts", action="store_true", help="the layout checks (sweep_op_layouts) "
                   "of every op (or of --ops), instead of the checks above")
    p.add_argument("--ops", default="")
    p.add_argument("--report", default="")
    a = p.parse_args(argv)
    start = time.time()
    names = [s for s in a.ops.split(",") if s]
    ops = select(a.full or a.layouts, names)
    if a.layouts:
        results = {op_id(op): sweep_op_layouts(op, full=True) for op in ops}
        text = layout_report(results)
    else:
        results = {op_id(op): sweep_op(op, full=a.full) for op in ops}
        text = report(results)
    text += f"\n\n{len(ops)} ops in {time.time() - start:.0f} s"
    print(text)
    if a.report:
        with open(a.report, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
