"""The OpInfo sweep: ``functrans.vmap`` against the for-loop oracle, side by side with torch.vmap.

For every op of ``op_db`` (CPU, float32) and a few of its samples, every tensor of the sample
(input, positional and keyword arguments, tensors inside lists) becomes one mapped argument with
an in_dim from {0, -1, None} (never all None), and the op also runs under vmap of vmap.  Each
batch holds DIFFERENT examples: OpInfo re-seeds before every sample, so every example is drawn
separately from the sample (``tests.support.oracles.perturb_like``), with a per-op fix for
arguments that need a domain (sorted boundaries, positive-definite matrices).

One check = (op, sample, in_dims, nested or not).  functrans runs STRICT first
(``functrans.config.strict_fallback()``), so a pass proves that rules ran:

* ``rule``           strict pass, every op reached went through a batching rule;
* ``decomposition``  strict pass, but a ``torch._decomp`` decomposition ran for some op;
* ``fallback``       strict raised the fallback error, the non-strict rerun passed;
* ``error``          any other exception (the message is recorded);
* ``wrong``          a value differs from the loop oracle: the sweep FAILS on it.

The oracle runs the op on each example made contiguous (``as_strided_scatter``: on a fresh
clone; ``as_strided``: on a copy of the storage where the example sits where example 0 does),
while the batch holds the examples at its strides (stacked at the in_dim): so a rule
whose answer depends on a batched operand's memory layout fails here (issue 25).

The layout sweep (``--layouts``, ``Plan`` ``LAYOUT_SWEEP``) runs every op's checks once per
layout of ``tests.support.layouts`` (stacked, batch dim moved to the other end of memory,
transposed, channels_last, expanded: stride 0), on two samples and three in_dims choices (the
first two also nested), against the same contiguous loop; a check runs in a layout only where
some batched operand takes it (``Check.layout``; the report adds a table of checks per layout,
functrans beside torch.func).  An expanded layout repeats values, which can make the answer
ill-posed (a rank-deficient matrix's singular vectors): a check wrong there that is also wrong
on the same values stacked contiguously is ``oracle_invalid``.

A check whose loop oracle itself fails on the drawn examples (or disagrees about NaNs) is
``oracle_invalid``, not a functrans failure.  An op's outcome is the worst over its checks.  The
same checks run with ``torch.vmap`` as the implementation (``rule`` / ``fallback``, detected by its
performance warning, / ``error`` / ``wrong``), so the report shows both side by side.

``XFAILS`` lists understood errors (never a wrong value without the lead's OK).

On a device (``device="cuda"``; ``--device cuda`` on the command line) OpInfo builds the samples
there (after ``torch.manual_seed(0)``, which seeds every device), every example of a batch is
drawn on the CPU from a seeded generator and moved there, and the oracle, functrans and
torch.vmap all run there; TF32 is off for the sweep (``oracles.float32_on_cuda``) so the float32
tolerances hold.  An output on another device than the oracle's is ``wrong``.

Run ``python -m tests.support.opinfo_sweep [--full | --layouts] [--ops a,b] [--device cuda]
[--report FILE]`` for a report.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import itertools
import re
import sys
import time
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import functrans
from functrans.errors import UnsupportedUnderVmap
from functrans.batching import decompositions
from tests.support import layouts
from tests.support.oracles import bdim_choices, float32_on_cuda, loop_oracle, perturb_like

SIZE = 3          # batch size of the inner (or only) vmap
OUTER_SIZE = 2    # batch size of the outer vmap in vmap(vmap(...))
RTOL, ATOL = 1e-4, 1e-5    # atol is scaled by the largest |expected| value (see compare)

# Outcomes, best to worst (an op's outcome is the worst over its checks).
FUNCTRANS_OUTCOMES = ("rule", "decomposition", "fallback", "error", "wrong")
TORCH_OUTCOMES = ("rule", "fallback", "error", "wrong")

# Understood errors: {op id: reason}.  A "wrong" entry needs the lead's OK.
XFAILS: Dict[str, str] = {}

# Ops skipped whole, with the reason (counted in the report, never silently).
_RANDOM_WORDS = ("rand", "normal", "bernoulli", "dropout", "multinomial", "uniform", "cauchy",
                 "exponential", "geometric", "poisson", "rrelu")
_UNINITIALISED = ("empty", "new_empty", "empty_like", "new_empty_strided", "empty_strided",
                  "empty_permuted")

# The fast (default) subset: the families the rules cover.
FAST_OPS = (
    # pointwise unary
    "abs", "neg", "exp", "log", "sin", "tanh", "sigmoid", "sqrt", "rsqrt", "erf", "clamp",
    "nn.functional.relu", "nn.functional.gelu", "nn.functional.silu", "nn.functional.softplus",
    "reciprocal", "floor", "trunc", "sign", "nan_to_num", "logical_not",
    # pointwise binary / ternary
    "add", "sub", "mul", "div", "pow", "maximum", "atan2", "eq", "ne", "lt", "ge", "where",
    "lerp", "addcmul", "addcdiv", "fmod", "remainder", "logical_and", "masked_fill",
    # reductions and scans
    "sum", "mean", "prod", "amax", "amin", "argmax", "argmin", "max", "min", "aminmax", "std",
    "var", "var_mean", "std_mean", "logsumexp", "norm", "linalg.vector_norm", "nansum",
    "count_nonzero", "cumsum", "cumprod", "logcumsumexp", "cummax", "softmax", "log_softmax",
    "all", "any",
    # views and shapes
    "view", "view_as", "reshape", "reshape_as", "permute", "transpose", "squeeze", "unsqueeze",
    "expand", "expand_as", "broadcast_to", "flatten", "unflatten", "select", "narrow", "t",
    "movedim", "diagonal", "diag_embed", "unfold", "split", "chunk", "unbind", "cat", "stack",
    "hstack", "vstack", "contiguous", "clone", "flip", "roll", "tile", "repeat", "tril", "triu",
    # matmul
    "mm", "bmm", "matmul", "addmm", "addmv", "addbmm", "baddbmm", "addr", "mv", "dot", "inner",
    "outer", "tensordot", "einsum", "kron", "linalg.multi_dot", "nn.functional.linear",
    "nn.functional.bilinear",
)
FAST_SAMPLES = 3      # samples per op in the fast subset
FAST_IN_DIMS = 8      # in_dims choices per sample in the fast subset (sampled deterministically)
FULL_SAMPLES = 4
FULL_IN_DIMS = 26     # every choice for up to 3 tensors; sampled deterministically beyond


def _sort_last(x: torch.Tensor) -> torch.Tensor:
    return x.sort(-1).values


def _positive_definite(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    return x @ x.mT + n * torch.eye(n, dtype=x.dtype, device=x.device)


def _probability(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(0, 1)


# {op name: {flat tensor index: fix}}: a fix maps one drawn example into the op's domain.
DOMAIN: Dict[str, Dict[int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "searchsorted": {0: _sort_last},
    "bucketize": {1: _sort_last},
    "cholesky": {0: _positive_definite},
    "linalg.cholesky": {0: _positive_definite},
    "linalg.cholesky_ex": {0: _positive_definite},
    "nn.functional.binary_cross_entropy": {0: _probability, 1: _probability},
}


def op_id(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def all_ops():
    from torch.testing._internal.common_methods_invocations import op_db
    return list(op_db)


def select_ops(full: bool, names: Optional[Sequence[str]] = None):
    ops = all_ops()
    if names:
        wanted = set(names)
        return [op for op in ops if op_id(op) in wanted or op.name in wanted]
    if full:
        return ops
    return [op for op in ops if op.name in FAST_OPS]


def skip_reason(op, device="cpu") -> Optional[str]:
    """Why an op is skipped as a whole (on ``device``), or None."""
    if torch.float32 not in op.supported_dtypes(torch.device(device).type):
        return "no float32 support"
    name = op.name.lower()
    if any(w in name for w in _RANDOM_WORDS):
        return "random"
    if op.name.split(".")[-1] in _UNINITIALISED:
        return "uninitialised output"
    return None


# ---------------------------------------------------------------------------------------------
# Samples, flattened: every tensor leaf is one mapped argument.

@dataclasses.dataclass
class FlatSample:
    tensors: List[torch.Tensor]
    call: Callable  # call(*tensors) runs the op on the sample with these tensors
    # "same" for a sample that draws random numbers but whose values do not depend on the
    # seed (see _is_deterministic): vmap needs a randomness mode to run it at all.
    randomness: str = "error"
    # The positions of the tensors the op writes in place (never presented expanded).
    written: frozenset = frozenset()


def flatten_sample(op, sample) -> Tuple[Optional[FlatSample], Optional[str]]:
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if not isinstance(sample.input, torch.Tensor) and not (
            isinstance(sample.input, (list, tuple)) and sample.input
            and all(isinstance(t, torch.Tensor) for t in sample.input)):
        return None, "input is not a tensor"
    if not pos:
        return None, "no tensor argument"
    if any(leaves[i].layout != torch.strided for i in pos):
        return None, "sparse tensor argument"
    if not any(leaves[i].dtype == torch.float32 for i in pos):
        return None, "no float32 tensor"
    fn = op.op

    def call(*tensors):
        full = list(leaves)
        for i, t in zip(pos, tensors):
            full[i] = t
        inp, args, kwargs = pytree.tree_unflatten(full, spec)
        return fn(inp, *args, **kwargs)

    return FlatSample([leaves[i].detach() for i in pos], call), None


def draw(x: torch.Tensor, seed: int, fix, device=None) -> torch.Tensor:
    """Example number ``seed`` drawn from ``x`` (0 is ``x`` itself), fixed into the domain, on
    ``device`` (default: ``x``'s).  The random part is drawn on the CPU from a generator seeded
    by ``seed`` (``perturb_like``), so every device gets the same numbers."""
    e = x.detach().clone() if seed == 0 else perturb_like(x, seed)
    if device is not None:
        e = e.to(device)
    return fix(e) if fix is not None else e


def build_batch(x: torch.Tensor, dims: Sequence[int], sizes: Sequence[int], fix,
                seeds, device=None) -> torch.Tensor:
    """Stack independently drawn examples (numbers from the iterator ``seeds``) at ``dims``,
    with ``sizes`` examples per level, innermost level first, on ``device`` (default: ``x``'s)."""
    if not dims:
        return draw(x, next(seeds), fix, device)
    *inner, d = dims
    *inner_sizes, n = sizes
    items = [build_batch(x, inner, inner_sizes, fix, seeds, device) for _ in range(n)]
    return torch.stack(items, d % (items[0].dim() + 1))


def choices_for(n_tensors: int, cap: int, salt: int) -> List[tuple]:
    """The in_dims choices to try: all of them up to ``cap``, else a deterministic sample
    that always keeps the all-0 and all--1 choices."""
    allc = bdim_choices(n_tensors)
    if len(allc) <= cap:
        return allc
    keep = [tuple([0] * n_tensors), tuple([-1] * n_tensors)]
    rest = [c for c in allc if c not in keep]
    step = max(1, len(rest) // max(1, cap - len(keep)))
    picked = rest[salt % step::step][:cap - len(keep)]
    return keep + picked


# ---------------------------------------------------------------------------------------------
# One check.

@dataclasses.dataclass
class Check:
    op: str
    sample: int
    shapes: List[tuple]
    in_dims: tuple
    nested: bool
    impl: str
    outcome: str
    detail: str = ""
    via: Tuple[str, ...] = ()   # the ops that decomposed, or the first op with no rule
    layout: str = "stacked"     # how the batches are laid out in memory (tests.support.layouts)


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}"[:300]


_MISSING_RULE = re.compile(r"batching rule for (\S+?)(?:,| declined)")
_TORCH_SLOW = re.compile(r"batching rule for (\S+?)\.? ")


def _is_fallback_error(e: BaseException) -> bool:
    return isinstance(e, UnsupportedUnderVmap) and "loop fallback is disabled" in str(e)


def _scale(e: torch.Tensor) -> float:
    """max(1, largest finite |value|): float32 sums of large terms cancel to small results."""
    if e.numel() == 0 or not (e.is_floating_point() or e.is_complex()):
        return 1.0
    finite = e.abs()[torch.isfinite(e.abs())]
    return max(1.0, float(finite.max())) if finite.numel() else 1.0


NONFINITE = "only non-finite values differ: "


def compare(actual, expected) -> Optional[str]:
    """None if equal (values, shapes, dtypes), else what differs."""
    fa, _ = pytree.tree_flatten(actual)
    fe, _ = pytree.tree_flatten(expected)
    if len(fa) != len(fe):
        return f"{len(fa)} outputs, expected {len(fe)}"
    for k, (a, e) in enumerate(zip(fa, fe)):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                return f"output {k}: expected a tensor, got {type(a).__name__}"
            if a.shape != e.shape:
                return f"output {k}: shape {tuple(a.shape)} != {tuple(e.shape)}"
            if a.dtype != e.dtype:
                return f"output {k}: dtype {a.dtype} != {e.dtype}"
            if a.device != e.device:
                return f"output {k}: device {a.device} != {e.device}"
            try:
                torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL * _scale(e),
                                           equal_nan=True)
            except AssertionError as err:
                msg = f"output {k}: " + " ".join(str(err).split())[:300]
                both = torch.isfinite(a) & torch.isfinite(e)
                if not both.all() and _close(a[both], e[both], _scale(e)):
                    return NONFINITE + msg
                return msg
        elif a != e:
            return f"output {k}: {a!r} != {e!r}"
    return None


def _close(a: torch.Tensor, e: torch.Tensor, scale: float) -> bool:
    try:
        torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL * scale)
        return True
    except AssertionError:
        return False


@contextlib.contextmanager
def _recording_decompositions():
    """The ops that ran a ``torch._decomp`` decomposition inside the block."""
    decomposed = []
    original = decompositions.run_decomposition

    def run_decomposition(op, args, kwargs):
        done, result = original(op, args, kwargs)
        if done:
            decomposed.append(str(op))
        return done, result

    decompositions.run_decomposition = run_decomposition
    try:
        yield decomposed
    finally:
        decompositions.run_decomposition = original


def _functrans_fn(call, in_dims, nested, randomness="error"):
    inner = functrans.vmap(call, in_dims=in_dims, randomness=randomness)
    return functrans.vmap(inner, in_dims=in_dims, randomness=randomness) if nested else inner


def _torch_fn(call, in_dims, nested, randomness="error"):
    inner = torch.vmap(call, in_dims=in_dims, randomness=randomness)
    return torch.vmap(inner, in_dims=in_dims, randomness=randomness) if nested else inner


def run_functrans(call, in_dims, nested, batched, expected,
                  randomness="error") -> Tuple[str, str, Tuple[str, ...]]:
    fn = _functrans_fn(call, in_dims, nested, randomness)
    try:
        with _recording_decompositions() as decomposed, functrans.config.strict_fallback():
            out = fn(*batched)
        how, via = ("decomposition", tuple(sorted(set(decomposed)))) if decomposed \
            else ("rule", ())
    except Exception as e:
        if not _is_fallback_error(e):
            return "error", _first_line(e), ()
        # The strict error names the first op with no rule: the rule to write next.
        missing = _MISSING_RULE.search(str(e))
        try:
            out = fn(*batched)
        except Exception as e2:
            return "error", _first_line(e2), ()
        how, via = "fallback", (missing.group(1),) if missing else ()
    diff = compare(out, expected)
    return ("wrong", diff, via) if diff else (how, "", via)


def run_torch(call, in_dims, nested, batched, expected,
              randomness="error") -> Tuple[str, str, Tuple[str, ...]]:
    fn = _torch_fn(call, in_dims, nested, randomness)
    torch._C._functorch._set_vmap_fallback_warning_enabled(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fn(*batched)
    except Exception as e:
        return "error", _first_line(e), ()
    finally:
        torch._C._functorch._set_vmap_fallback_warning_enabled(False)  # its default
    messages = [str(w.message) for w in caught if "performance drop" in str(w.message)]
    slow = sorted({m.group(1) if m else "?" for m in map(_TORCH_SLOW.search, messages)})
    diff = compare(out, expected)
    if diff:
        return "wrong", diff, tuple(slow)
    return ("fallback", "", tuple(slow)) if slow else ("rule", "", ())


def _where_example_zero_sits(a: torch.Tensor, first: int) -> torch.Tensor:
    """A fresh copy of ``a``'s storage, shifted so that ``a`` (an example of a batch whose
    example 0 starts at storage offset ``first``) starts at ``first``, viewed as ``a``."""
    whole = a.new_empty(0).set_(a.untyped_storage())
    return whole[a.storage_offset() - first:].clone().as_strided(a.shape, a.stride(), first)


def run_check(op, k, flat: FlatSample, dims: tuple, nested: bool,
              with_torch: bool, device="cpu", layout: str = "stacked") -> List[Check]:
    """The check of one sample with these in_dims, its batches in ``layout``
    (``tests.support.layouts``); no check (``[]``) where no batched operand takes the layout."""
    fixes = DOMAIN.get(op.name, {})
    levels = 2 if nested else 1
    sizes = [SIZE, OUTER_SIZE][:levels]
    batched, laid_out = [], layout == "stacked"
    for j, (t, d) in enumerate(zip(flat.tensors, dims)):
        if d is None:
            batched.append(t)
            continue
        b = build_batch(t, [d] * levels, sizes, fixes.get(j), itertools.count(), device)
        laid = layouts.lay_out(b, layouts.bdim_positions(t.dim(), [d] * levels), layout,
                               expandable=j not in flat.written)
        laid_out = laid_out or laid is not None
        batched.append(b if laid is None else laid)
    if not laid_out:
        return []
    base = dict(op=op_id(op), sample=k, shapes=[tuple(t.shape) for t in flat.tensors],
                in_dims=dims, nested=nested, layout=layout)
    example_call = flat.call
    if op.name in ("as_strided", "as_strided_copy"):
        # Storage-addressing views: a slice of the stacked batch sits at an offset that depends
        # on its index, and an absolute storage_offset means, for example i, the same place
        # relative to it as for example 0 (Note [as_strided under vmap] in rules/views.py, the
        # reference library's rule): each example is a fresh copy of the storage in which it
        # sits where example 0 sits.
        firsts = [t.storage_offset() for t in batched]
        example_call = lambda *a: flat.call(  # noqa: E731
            *[_where_example_zero_sits(t, f) for t, f in zip(a, firsts)])
    elif op.name.startswith("as_strided"):
        # as_strided_scatter writes into a fresh clone in eager: an example is a fresh tensor
        example_call = lambda *a: flat.call(*[t.clone() for t in a])  # noqa: E731
    else:
        # Every example contiguous: the answer must not depend on how a batched operand is
        # laid out (the stacked batch gives each example the batch's strides), and a kernel
        # that reads a strided operand as contiguous memory (native_group_norm's weight) would
        # otherwise hide a rule that copies that layout-dependent read (issue 25).  Over the
        # full sweep (57,968 checks) the outcomes are those of the strided oracle but for it.
        example_call = lambda *a: flat.call(*[t.contiguous() for t in a])  # noqa: E731
    oracle_call = example_call
    if nested:
        oracle_call = lambda *a: loop_oracle(example_call, dims, SIZE, *a)  # noqa: E731
    try:
        expected = loop_oracle(oracle_call, dims, sizes[-1], *batched)
    except Exception as e:
        return [Check(**base, impl=impl, outcome="oracle_invalid", detail=_first_line(e))
                for impl in (("functrans", "torch.vmap") if with_torch else ("functrans",))]
    results = []
    impls = [("functrans", run_functrans)] + ([("torch.vmap", run_torch)] if with_torch else [])
    for impl, runner in impls:
        outcome, detail, via = runner(flat.call, dims, nested, batched, expected,
                                      flat.randomness)
        if outcome == "wrong" and detail.startswith(NONFINITE):
            outcome = "oracle_invalid"
        elif outcome == "wrong" and layout == "expanded":
            # The control: the same values in the stacked layout (a contiguous batch).  Wrong
            # there too, the values are what the oracle cannot judge (the expanded layout
            # repeats values: a rank-deficient matrix's singular vectors), not the layout.
            # (The other layouts keep the stacked check's values: their wrong is the layout's.)
            same_values = [b.contiguous() if d is not None else b
                           for b, d in zip(batched, dims)]
            if runner(flat.call, dims, nested, same_values, expected,
                      flat.randomness)[0] == "wrong":
                outcome, detail = "oracle_invalid", ILL_POSED + detail
        results.append(Check(**base, impl=impl, outcome=outcome, detail=detail, via=via))
    return results


ILL_POSED = "wrong on the same values stacked contiguously too (values the oracle cannot judge): "


# ---------------------------------------------------------------------------------------------
# One op.

@dataclasses.dataclass
class OpResult:
    op: str
    skipped: Optional[str] = None
    checks: List[Check] = dataclasses.field(default_factory=list)

    def outcome(self, impl: str, nested: Optional[bool] = None) -> str:
        """The worst outcome over this op's checks by ``impl`` (only the plain vmap checks,
        or only vmap∘vmap, when ``nested`` is given)."""
        if self.skipped:
            return "skipped"
        order = FUNCTRANS_OUTCOMES if impl == "functrans" else TORCH_OUTCOMES
        seen = [c.outcome for c in self.checks if c.impl == impl and c.outcome in order
                and (nested is None or c.nested == nested)]
        if not seen:
            return "oracle_invalid" if self.checks else "skipped"
        return max(seen, key=order.index)

    def worst(self, impl: str) -> Optional[Check]:
        out = self.outcome(impl)
        return next((c for c in self.checks if c.impl == impl and c.outcome == out), None)


class _DrawsRandom(TorchDispatchMode):
    """Records whether any random op ran (ops tagged nondeterministic_seeded)."""

    def __init__(self):
        super().__init__()
        self.drew = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.drew = True
        return func(*args, **(kwargs or {}))


def _is_deterministic(flat: FlatSample) -> bool:
    """Whether the sample's values are the same under two seeds.  A deterministic sample that
    draws random numbers all the same (OpInfo's ``wrapper_set_seed`` re-seeds inside the call,
    so every example of the loop oracle sees the same draw) runs with randomness='same'."""
    outs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        with _DrawsRandom() as mode:
            outs.append(flat.call(*flat.tensors))
    same = compare(outs[0], outs[1]) is None
    if same and mode.drew:
        flat.randomness = "same"
    return same


def _is_deterministic_or_fails(flat: FlatSample) -> bool:
    """False only for a sample that runs and gives different values under two seeds (a sample
    that fails on its own is kept: the caller reports it)."""
    try:
        return _is_deterministic(flat)
    except Exception:
        return True


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a sweep runs per op: ``samples`` samples, ``in_dims`` in_dims choices per sample
    (``choices_for``), the first ``nested`` of them (all: None) also under vmap∘vmap, each in
    every layout of ``layouts`` (``tests.support.layouts``)."""
    samples: int
    in_dims: int
    nested: Optional[int]
    layouts: Tuple[str, ...] = ("stacked",)


FAST = Plan(FAST_SAMPLES, FAST_IN_DIMS, 2)
FULL = Plan(FULL_SAMPLES, FULL_IN_DIMS, None)
# The layout sweep (``--layouts``, ``-m sweep``): every layout, the all-0 and all--1 in_dims
# plus one more choice, the first two also nested; "stacked" is its like-for-like baseline.
LAYOUT_SWEEP = Plan(2, 3, 2, layouts.LAYOUTS)
# The default run's layout slice: the non-stacked layouts on LAYOUT_FAST_OPS (among them the
# ops whose rules were layout-dependent), one sample, in_dims all 0 and all -1, plain vmap only.
LAYOUT_FAST = Plan(1, 2, 0, layouts.LAYOUTS[1:])
LAYOUT_FAST_OPS = ("matmul", "cumsum", "nn.functional.max_unpool2d", "masked.median", "resize_")


def sweep_op(op, *, full: bool, with_torch: bool = True, device="cpu",
             plan: Optional[Plan] = None) -> OpResult:
    """Every check of one op on ``device`` (the ops' own warnings are silenced), by ``plan``
    (default: ``FULL`` if ``full`` else ``FAST``)."""
    with warnings.catch_warnings(), float32_on_cuda(device):
        warnings.simplefilter("ignore")
        return _sweep_op(op, plan or (FULL if full else FAST), with_torch, str(device))


def _sweep_op(op, plan: Plan, with_torch: bool, device="cpu") -> OpResult:
    res = OpResult(op_id(op))
    res.skipped = skip_reason(op, device)
    if res.skipped:
        return res
    torch.manual_seed(0)
    reasons = collections.Counter()
    flats = []
    try:
        samples = op.sample_inputs(device, torch.float32, requires_grad=False)
        for sample in samples:
            flat, why = flatten_sample(op, sample)
            if flat is None:
                reasons[why] += 1
                continue
            if not _is_deterministic_or_fails(flat):
                # This sample draws random values (dropout_p > 0, fractional pooling's random
                # samples, randomized low-rank SVD): a loop oracle cannot be compared with it.
                reasons["non-deterministic output"] += 1
                continue
            flats.append(flat)
            if len(flats) == plan.samples:
                break
    except Exception as e:
        res.skipped = f"sample generation failed: {_first_line(e)}"
        return res
    if not flats:
        res.skipped = reasons.most_common(1)[0][0] if reasons else "no samples"
        return res
    try:
        out = flats[0].call(*flats[0].tensors)
    except Exception as e:
        res.skipped = f"the op fails on its own sample: {_first_line(e)}"
        return res
    leaves = pytree.tree_flatten(out)[0]
    if not all(isinstance(t, torch.Tensor) for t in leaves):
        res.skipped = "non-tensor output"
        return res
    if any(t.layout != torch.strided for t in leaves):
        res.skipped = "sparse output"
        return res
    for k, flat in enumerate(flats):
        if "expanded" in plan.layouts:
            flat.written = layouts.written_inputs(flat.call, flat.tensors)
        choices = choices_for(len(flat.tensors), plan.in_dims, salt=k)
        for c, dims in enumerate(choices):
            nested = (False, True) if plan.nested is None or c < plan.nested else (False,)
            for layout in plan.layouts:
                for n in nested:
                    res.checks += run_check(op, k, flat, dims, n, with_torch, device, layout)
    return res


def failure(res: OpResult, honour_xfails: bool = True) -> Optional[str]:
    """Why the sweep fails on this op, or None: any wrong value from functrans, and any
    functrans error on a check that torch.vmap passes (unless ``XFAILS`` explains it)."""
    by_key = {(c.sample, c.in_dims, c.nested, c.layout): c for c in res.checks
              if c.impl == "torch.vmap"}
    errors = []
    for c in res.checks:
        if c.impl != "functrans":
            continue
        if c.outcome == "wrong":
            return f"WRONG {describe(c)}"
        ref = by_key.get((c.sample, c.in_dims, c.nested, c.layout))
        if c.outcome == "error" and ref is not None and ref.outcome in ("rule", "fallback"):
            errors.append(f"ERROR (torch.vmap passes) {describe(c)}")
    if errors and not (honour_xfails and res.op in XFAILS):
        return errors[0]
    return None


def describe(c: Check) -> str:
    kind = "vmap(vmap(op))" if c.nested else "vmap(op)"
    if c.layout != "stacked":
        kind += f" layout={c.layout}"
    return (f"{c.op} sample {c.sample} shapes={c.shapes} in_dims={c.in_dims} {kind}: "
            f"{c.detail}")


# ---------------------------------------------------------------------------------------------
# The report.

def sweep(ops, *, full: bool, with_torch: bool = True, progress=None,
          device="cpu", plan: Optional[Plan] = None) -> List[OpResult]:
    out = []
    for op in ops:
        t0 = time.perf_counter()
        out.append(sweep_op(op, full=full, with_torch=with_torch, device=device, plan=plan))
        if progress:
            progress(out[-1], time.perf_counter() - t0)
    return out


SIDE_BY_SIDE = ("rule", "fallback", "error", "wrong")


def per_check(results: List[OpResult], nested: bool) -> Dict[str, collections.Counter]:
    """{impl: Counter of ops by worst outcome} over the plain (or nested) checks, with
    'decomposition' counted as 'rule' (both are batched code, not the loop)."""
    out = {}
    for impl in ("functrans", "torch.vmap"):
        cnt = collections.Counter()
        for r in results:
            if r.skipped:
                continue
            o = r.outcome(impl, nested)
            cnt["rule" if o == "decomposition" else o] += 1
        out["torch.func" if impl == "torch.vmap" else impl] = cnt
    return out


def check_table(rows: Dict[str, Dict[str, collections.Counter]]) -> List[str]:
    """Rows of 'functrans | torch.func' op counts per outcome, one row per check."""
    lines = [f"  {'check':<11}" + "".join(f"{k:>18}" for k in SIDE_BY_SIDE)]
    for check, counts in rows.items():
        lines.append(f"  {check:<11}" + "".join(
            f"{counts['functrans'].get(k, 0):>9} | {counts['torch.func'].get(k, 0):<6}"
            for k in SIDE_BY_SIDE))
    lines.append("  (each cell: functrans | torch.func)")
    return lines


LAYOUT_COLUMNS = ("checks", "wrong", "error", "fallback", "oracle_invalid")


def layout_counts(results: List[OpResult]) -> Dict[Tuple[str, str], Dict[str, collections.Counter]]:
    """{(layout, 'vmap' or 'vmap∘vmap'): {impl: Counter of CHECKS by outcome, plus 'checks'}}
    ('decomposition' counted as 'rule'; 'checks' excludes oracle_invalid)."""
    out: Dict[Tuple[str, str], Dict[str, collections.Counter]] = {}
    for r in results:
        for c in r.checks:
            key = (c.layout, "vmap∘vmap" if c.nested else "vmap")
            impl = "torch.func" if c.impl == "torch.vmap" else c.impl
            cnt = out.setdefault(key, {"functrans": collections.Counter(),
                                       "torch.func": collections.Counter()})[impl]
            cnt["rule" if c.outcome == "decomposition" else c.outcome] += 1
            if c.outcome != "oracle_invalid":
                cnt["checks"] += 1
    order = {name: i for i, name in enumerate(layouts.LAYOUTS)}
    return dict(sorted(out.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1])))


def layout_table(results: List[OpResult]) -> List[str]:
    """Rows of 'functrans | torch.func' CHECK counts per layout and transform."""
    lines = [f"  {'layout':<14}{'transform':<11}" + "".join(f"{k:>18}" for k in LAYOUT_COLUMNS)]
    for (layout, transform), counts in layout_counts(results).items():
        lines.append(f"  {layout:<14}{transform:<11}" + "".join(
            f"{counts['functrans'].get(k, 0):>9} | {counts['torch.func'].get(k, 0):<6}"
            for k in LAYOUT_COLUMNS))
    lines.append("  (checks per layout; each cell: functrans | torch.func; 'checks' excludes "
                 "oracle_invalid)")
    return lines


def report(results: List[OpResult], seconds: Optional[float] = None,
           device: Optional[str] = None) -> str:
    lines = []
    ft = collections.Counter(r.outcome("functrans") for r in results)
    tv = collections.Counter(r.outcome("torch.vmap") for r in results)
    checks_ft = collections.Counter(c.outcome for r in results for c in r.checks
                                    if c.impl == "functrans")
    checks_tv = collections.Counter(c.outcome for r in results for c in r.checks
                                    if c.impl == "torch.vmap")
    head = f"OpInfo sweep: {len(results)} ops"
    if device is not None:
        head += f" on {device}"
    if seconds is not None:
        head += f" in {seconds:.0f} s"
    lines += [head, "", f"{'outcome':<16}{'functrans ops':>14}{'torch.vmap ops':>16}"
              f"{'functrans checks':>18}{'torch.vmap checks':>19}"]
    for o in FUNCTRANS_OUTCOMES + ("oracle_invalid", "skipped"):
        lines.append(f"{o:<16}{ft.get(o, 0):>14}{tv.get(o, 0) if o != 'decomposition' else '-':>16}"
                     f"{checks_ft.get(o, 0):>18}"
                     f"{checks_tv.get(o, 0) if o != 'decomposition' else '-':>19}")
    if any(c.layout != "stacked" for r in results for c in r.checks):
        lines += ["", "per layout (tests.support.layouts):"] + layout_table(results)
    lines += ["", "per check (ops by worst outcome; rule includes decomposition):"]
    lines += check_table({"vmap": per_check(results, False),
                          "vmap∘vmap": per_check(results, True)})
    lines.append("")
    skips = collections.Counter(r.skipped.split(":")[0] for r in results if r.skipped)
    lines.append("skipped: " + ", ".join(f"{why} ({n})" for why, n in skips.most_common()))

    lines += ["", "WRONG (per op: number of wrong checks, then the first as a repro):"]
    for impl in ("functrans", "torch.vmap"):
        for r in results:
            wrong = [c for c in r.checks if c.impl == impl and c.outcome == "wrong"]
            if wrong:
                lines.append(f"  [{impl}] {len(wrong)} x {describe(wrong[0])}")

    for impl in ("functrans", "torch.vmap"):
        lines += ["", f"{impl}: ops by outcome"]
        for o in (FUNCTRANS_OUTCOMES if impl == "functrans" else TORCH_OUTCOMES) + \
                ("oracle_invalid",):
            names = sorted(r.op for r in results if r.outcome(impl) == o)
            if names:
                lines.append(f"  {o} ({len(names)}): {', '.join(names)}")

    errs = collections.Counter()
    err_ops = collections.defaultdict(list)
    for r in results:
        c = r.worst("functrans")
        if c is not None and c.outcome == "error":
            key = c.detail.split(" (functrans:")[0][:160]
            errs[key] += 1
            err_ops[key].append(r.op)
    lines += ["", "functrans errors (one per op, most common first):"]
    for msg, n in errs.most_common():
        lines.append(f"  {n:>3}  {msg}   <- {', '.join(err_ops[msg][:8])}"
                     + (" ..." if n > 8 else ""))

    for impl, outcome in (("functrans", "fallback"), ("functrans", "decomposition"),
                          ("torch.vmap", "fallback")):
        cnt = collections.Counter()
        users = collections.defaultdict(set)
        for r in results:
            for c in r.checks:
                if c.impl == impl and c.outcome == outcome:
                    for v in c.via:
                        users[v].add(r.op)
        for v, s in users.items():
            cnt[v] = len(s)
        lines += ["", f"{impl}: ATen ops taking the {outcome} (number of OpInfo ops using it)"]
        lines += [f"  {n:>3}  {v}" for v, n in cnt.most_common()]

    inv = [(r.op, [c for c in r.checks if c.impl == "functrans" and
                   c.outcome == "oracle_invalid"]) for r in results]
    inv = sorted(((name, cs) for name, cs in inv if cs), key=lambda t: -len(t[1]))
    if inv:
        lines += ["", "oracle_invalid checks (the loop oracle failed on the drawn examples, or "
                  "gave non-finite values that differ), per op:"]
        lines += [f"  {len(cs):>4} x {name}: {cs[0].detail[:160]}" for name, cs in inv]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="all of op_db, all in_dims, vmap(vmap)")
    p.add_argument("--ops", default="", help="comma-separated op names (OpInfo name or id)")
    p.add_argument("--layouts", action="store_true", help="the layout sweep (LAYOUT_SWEEP: "
                   "every batch also transposed, channels_last, expanded, batch dim moved)")
    p.add_argument("--report", default="", help="also write the report to this file")
    p.add_argument("--no-torch", action="store_true", help="skip the torch.vmap column")
    p.add_argument("--device", default="cpu", help="where the samples and batches live and "
                   "everything runs (cpu, cuda, cuda:1, ...)")
    p.add_argument("-v", "--verbose", action="store_true", help="print each op as it finishes")
    a = p.parse_args(argv)
    if torch.device(a.device).type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {a.device}: torch.cuda.is_available() is False")
    names = [n for n in a.ops.split(",") if n]
    ops = select_ops(a.full or a.layouts, names)

    def progress(r, s):
        if a.verbose:
            print(f"{s:6.2f}s {r.op:<40} {r.outcome('functrans'):<15} "
                  f"{r.outcome('torch.vmap'):<15} {r.skipped or ''}", file=sys.stderr,
                  flush=True)

    t0 = time.perf_counter()
    results = sweep(ops, full=a.full or bool(names), with_torch=not a.no_torch,
                    progress=progress, device=a.device,
                    plan=LAYOUT_SWEEP if a.layouts else None)
    text = report(results, time.perf_counter() - t0, device=a.device)
    print(text)
    if a.report:
        with open(a.report, "w") as f:
            f.write(text + "\n")
    return 1 if any(failure(r) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
