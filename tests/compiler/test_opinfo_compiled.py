"""The OpInfo sweep through ``functrans.compile`` (replay): vmap, vjp and vmap∘vjp of every op
with a batching rule, compiled, against the same stack run eagerly (``-m sweep``).

Samples come from the sweeps (``tests.support.opinfo_sweep.flatten_sample`` /
``build_batch``; the float64 differentiable view of ``tests.support.opinfo_autodiff``).  Per op
and sample (``SAMPLES`` of them):

* ``vmap``     every tensor mapped at dim 0 (then at -1), run strict: an op without a rule is
  not checked here (``no_rule``), unless it has none on purpose
  (``functrans.batching.known_fallbacks``: nonzero, unique, resize_, ...): the per-example loop
  is then that op's vmap, and the check runs through it;
* ``vjp``      ``vjp(g, *primals)[1](cotangents)``, primals and cotangents as arguments;
* ``vmap_vjp`` ``vmap(vjp(g, *primals)[1])(batched cotangents)``.

A compiled function is called twice on the same arguments (trace, then replay) and once on new
values of the same shapes; each answer must equal the eager stack's.  Outcomes:
``compiled`` (served from the graph), ``segmented`` (served from graphs with a break: the op's
output shape depends on the data, or it reads a value into Python; new values may trace another
graph), ``eager`` (its kernel branches on data that make_fx refuses, as cov's ``aten.equal``
does, or a read a graph cannot guard: it must run eagerly after one ``CompileWarning``, with the
eager answer), ``refused`` (eager raises on some argument set; compiled, traced and replayed on
the sets before it, must raise the same type on it), ``eager_only_check`` (eager raises one of
``_EAGER_ONLY_CHECKS``, a value check ATen skips whenever a Python dispatch mode is active, as in
make_fx's trace: compiled must answer what eager answers under a pass-through dispatch mode),
``no_rule``, ``error`` or ``wrong`` (the test fails on those two).

``python -m tests.compiler.test_opinfo_compiled [--ops a,b] [--limit N]`` prints counts.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import sys
import warnings
from typing import Dict, List

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import functrans as ft
from functrans.batching import known_fallbacks
from functrans.errors import CompileWarning
from tests.support import opinfo_sweep as S
from tests.support.opinfo_autodiff import _float_outputs
from tests.support.oracles import perturb_like

SAMPLES = 2
B = 3
# Reasons a compiled op legitimately runs eagerly: data-dependent output shapes, a value read
# into Python, a kernel branching on data that make_fx refuses (cov/corrcoef: aten.equal), or
# a re-seeding of the random generator a graph cannot replay (OpInfo's wrapper_set_seed around
# an op that draws: fractional_max_pool2d/3d's samples, multi_head_attention_forward's dropout).
_BY_DESIGN = ("depends on the data", "reads a tensor's value",
              "get value out of a tracing tensor",
              "random number generator's state was changed outside a random op")
# Value checks in ATen's C++ that run only when no Python dispatch mode is active and no tensor
# is subclass-like (``at::isTensorSubclassLike``): make_fx's trace, torch.compile and vmap
# (torch.func's and functrans's) all skip them, so a graph holds no trace of them.  Each entry:
# the opening of the error message.  linalg_eig_backward checks that a complex loss does not
# depend on the phase of the eigenvectors (FunctionsManual.cpp: ``if (V.is_complex() &&
# !at::isTensorSubclassLike(diag_VhgV)) TORCH_CHECK(at::allclose(imag(diag(V^H gV)), 0))``).
_EAGER_ONLY_CHECKS = (
    "linalg_eig_backward: The eigenvectors in the complex case are specified up to "
    "multiplication by e^{i phi}",
)


class _PassThrough(TorchDispatchMode):
    """Runs every op as it is; its presence makes ATen skip ``_EAGER_ONLY_CHECKS``."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _compare_refusal(fn, arg_sets, index: int, exc: BaseException, expected) -> str:
    """Eager answered ``arg_sets[:index]`` (``expected``) and raised ``exc`` on
    ``arg_sets[index]``: compiled, traced and replayed on the sets before, must raise the same
    type there (its trace, for index 0, is an eager call; a replay runs the graph)."""
    compiled = ft.compile(fn)
    for k, args in enumerate(arg_sets[:index]):
        try:
            diff = S.compare(compiled(*args), expected[k])
        except Exception as e2:
            return f"error: eager answered argument set {k}, compiled raised {S._first_line(e2)}"
        if diff is not None and not diff.startswith(S.NONFINITE):
            return f"wrong: argument set {k}: {diff}"
    try:
        actual = compiled(*arg_sets[index])
    except type(exc):
        return "refused"
    except Exception as e2:
        return f"error: eager raised {type(exc).__name__}, compiled {S._first_line(e2)}"
    if str(exc).startswith(_EAGER_ONLY_CHECKS):
        try:
            with _PassThrough():
                skipped = fn(*arg_sets[index])
        except Exception as e3:
            return (f"error: eager raised {S._first_line(exc)} also under a dispatch mode "
                    f"({S._first_line(e3)}), compiled did not")
        diff = S.compare(actual, skipped)
        if diff is not None and not diff.startswith(S.NONFINITE):
            return f"wrong: argument set {index} (eager without its value check): {diff}"
        return "eager_only_check"
    return f"error: eager raised {S._first_line(exc)} on argument set {index}, compiled did not"


def _compare_call(fn, arg_sets) -> str:
    """Run eager and compiled on each argument set; return the outcome (or 'wrong: ...')."""
    expected = []
    for index, args in enumerate(arg_sets):
        try:
            expected.append(fn(*args))
        except Exception as e:
            return _compare_refusal(fn, arg_sets, index, e, expected)
    compiled = ft.compile(fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            actual = [compiled(*args) for args in (arg_sets[0],) + tuple(arg_sets)]
        except Exception as e:
            return f"error: {S._first_line(e)}"
    expected = [expected[0]] + expected
    for i, (a, e) in enumerate(zip(actual, expected)):
        diff = S.compare(a, e)
        if diff is not None and not diff.startswith(S.NONFINITE):
            return f"wrong: call {i} (trace, replay, replay on same, new values): {diff}"
    info = compiled.cache_info()
    warned = [str(w.message) for w in caught if issubclass(w.category, CompileWarning)]
    if info.eager_reason is not None:
        if len(warned) == 1 and any(w in info.eager_reason for w in _BY_DESIGN):
            return "eager"
        return f"error: ran eagerly: {info.eager_reason} (warnings: {warned})"
    if not warned and not info.eager_calls and any(e.breaks for e in info.entries):
        return "segmented"      # a graph break: new values may trace a graph of their own
    if warned or info.misses != 1 or info.eager_calls:
        return f"error: {info} (warnings: {warned})"
    return "compiled"


def _loops_on_purpose(e: BaseException) -> bool:
    """Whether the strict fallback error names an op that has no rule on purpose."""
    missing = S._MISSING_RULE.search(str(e))
    return missing is not None and bool(known_fallbacks.reason(missing.group(1)))


def _vmap_checks(op, flat) -> Dict[str, str]:
    out = {}
    for dims in (tuple([0] * len(flat.tensors)), tuple([-1] * len(flat.tensors))):
        fixes = S.DOMAIN.get(op.name, {})
        sets = []
        for seed0 in (0, 1000):
            seeds = itertools.count(seed0)
            sets.append(tuple(S.build_batch(t, [d], [B], fixes.get(j), seeds)
                              for j, (t, d) in enumerate(zip(flat.tensors, dims))))
        fn = S._functrans_fn(flat.call, dims, False, flat.randomness)
        try:
            with ft.config.strict_fallback(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fn(*sets[0])
        except Exception as e:
            if S._is_fallback_error(e) and not _loops_on_purpose(e):
                out[f"vmap{dims[:1]}"] = "no_rule"
                continue
        with ft.config.strict_fallback(False):
            out[f"vmap{dims[:1]}"] = _compare_call(fn, sets)
    return out


def _vjp_checks(op, flat) -> Dict[str, str]:
    if not op.supports_autograd:
        return {}
    base = [t.double() if t.dtype == torch.float32 else t for t in flat.tensors]
    pos = [i for i, t in enumerate(base) if t.is_floating_point()]
    if not pos:
        return {}

    def g(*diff):
        args = list(base)
        for i, d in zip(pos, diff):
            args[i] = d
        return tuple(_float_outputs(flat.call(*args)))

    diff = tuple(base[i] for i in pos)
    try:
        outs = g(*diff)
    except Exception:
        return {}
    if not outs:
        return {}
    n = len(diff)

    def vjp(*a):
        return ft.vjp(g, *a[:n])[1](tuple(a[n:]))

    def vmap_vjp(*a):
        return ft.vmap(ft.vjp(g, *a[:n])[1], randomness=flat.randomness)(tuple(a[n:]))

    def arg_sets(batched):
        sets = []
        for k in (1, 2):
            primals = tuple(d if k == 1 else perturb_like(d, 50) for d in diff)
            cts = tuple(torch.stack([perturb_like(o, 100 * k + i) for i in range(B)])
                        if batched else perturb_like(o, 7 * k) for o in outs)
            sets.append(primals + cts)
        return sets

    with ft.config.strict_fallback(False):
        return {"vjp": _compare_call(vjp, arg_sets(False)),
                "vmap_vjp": _compare_call(vmap_vjp, arg_sets(True))}


def sweep_op(op) -> Dict[str, List[str]]:
    """{"skipped": [reason]} or {check: [outcome per sample]}."""
    reason = S.skip_reason(op)
    if reason:
        return {"skipped": [reason]}
    results: Dict[str, List[str]] = collections.defaultdict(list)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        flats = []
        try:
            for sample in op.sample_inputs("cpu", torch.float32, requires_grad=False):
                flat, _ = S.flatten_sample(op, sample)
                if flat is not None and S._is_deterministic_or_fails(flat):
                    flats.append(flat)
                if len(flats) == SAMPLES:
                    break
        except Exception as e:
            return {"skipped": [f"sample generation failed: {S._first_line(e)}"]}
        for flat in flats:
            try:
                outs = pytree.tree_flatten(flat.call(*flat.tensors))[0]
            except Exception:
                continue
            if not outs or not all(isinstance(t, torch.Tensor) and t.layout == torch.strided
                                   for t in outs):
                continue
            for check, outcome in {**_vmap_checks(op, flat), **_vjp_checks(op, flat)}.items():
                results[check].append(outcome)
    return dict(results) if results else {"skipped": ["no usable sample"]}


def failures(res: Dict[str, List[str]]) -> List[str]:
    return [f"{check}: {o}" for check, outs in res.items() if check != "skipped"
            for o in outs if o.startswith(("wrong", "error"))]


ALL = S.select_ops(full=True)


@pytest.mark.sweep
@pytest.mark.parametrize("op", ALL, ids=S.op_id)
def test_op_compiled(op):
    res = sweep_op(op)
    if "skipped" in res:
        pytest.skip(res["skipped"][0])
    bad = failures(res)
    assert not bad, "\n".join(bad)
    assert any(o in ("compiled", "segmented", "eager", "refused", "eager_only_check")
               for outs in res.values() for o in outs), res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="")
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--limit", type=int, default=0)
    a = p.parse_args(argv)
    names = [n for n in a.ops.split(",") if n]
    ops = S.select_ops(full=True, names=names or None)[a.start:]
    if a.limit:
        ops = ops[:a.limit]
    per_check = collections.defaultdict(collections.Counter)
    per_op = collections.Counter()
    bad_ops = []
    for op in ops:
        res = sweep_op(op)
        if "skipped" in res:
            per_op["skipped"] += 1
            continue
        for check, outs in res.items():
            for o in outs:
                per_check[check][o.split(":")[0]] += 1
        bad = failures(res)
        per_op["fail" if bad else "pass"] += 1
        if bad:
            bad_ops.append((S.op_id(op), bad[0][:400]))
        eager = [c for c, outs in res.items() if "eager" in outs]
        if eager:
            print(f"eager by design: {S.op_id(op)} ({', '.join(eager)})", flush=True)
    print(f"ops: {len(ops)}; {dict(per_op)}")
    for check, cnt in sorted(per_check.items()):
        print(f"  {check:<10} {dict(cnt)}")
    for name, why in bad_ops:
        print(f"FAIL {name}: {why}")
    return 1 if bad_ops else 0


if __name__ == "__main__":
    sys.exit(main())
