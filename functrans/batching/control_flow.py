"""torch's control-flow operators under functrans's transforms: ``torch.cond``,
``torch._higher_order_ops.while_loop``, ``scan``, ``associative_scan`` and ``map``.

These are ``HigherOrderOperator``s (HOPs): they take Python callables (branches, loop bodies)
and never reach ``__torch_dispatch__`` as ATen ops, so no batching rule can see them.  While a
functrans transform is active, this module runs each HOP call as ordinary Python control flow
over its callables ("desugared"), under whatever transforms are active, so vmap, nested vmap,
grad, vjp, jvp, jacrev, jacfwd, hessian and their compositions apply to the branches op by op,
through the ordinary rules, autograd and forward AD:

- ``cond`` with a batched predicate (its examples may disagree) runs both branches on the
  batch and picks each example's output with ``torch.where``, the predicate broadcast over
  each output (JAX's and ``torch.func``'s semantics); an unbatched predicate runs one branch.
  The branches must then return the same structure, and tensors of one shape and dtype.
- ``while_loop`` with a batched predicate iterates while ANY example continues, and freezes
  each finished example's carry (``torch.where(pred, body(carry), carry)``): each example ends
  where its own loop would (JAX's semantics).  The body runs on finished examples too (their
  results are discarded).  A Python-int carry cannot differ per example: refused if it would.
- ``scan`` and ``map`` run a Python loop over the scanned dim, stacking the outputs;
  ``associative_scan`` runs the odd-even (log-depth) parallel scan with the combine function
  applied to whole slices, as the ``combine_mode='pointwise'`` contract allows.  Carries,
  inputs and closed-over tensors (``additional_inputs``) may each be batched or not.

Where each call is caught (``install()``, called by ``functrans/batching/__init__.py``):

1. The HOP's per-backend autograd keys (``AutogradCPU``, ``AutogradCUDA``, ...), which the
   HOP dispatcher tries before anything else for an ordinary or a ``BatchedTensor`` argument.
   torch registers its own autograd implementations on the ``Autograd`` alias key; a per-backend
   registration wins over the alias, and hands every call made with no functrans transform
   active (or during a trace on fake tensors) straight to torch's own implementation, so torch's
   behaviour outside functrans is unchanged.  This is the only route ``grad``/``jvp`` outside a
   vmap can take (their tensors are plain), and it is needed: torch's own ``cond``/``scan``/
   ``map``/``while_loop`` drop forward-AD tangents silently (``jvp`` gave zeros).
2. ``VmapLevelMode`` and ``BatchedTensor`` in the HOP's Python-key table, for calls that skip
   the autograd keys (under ``torch.inference_mode``).

What the HOP receives depends on the route torch took: the Python front-ends
(``torch.cond(...)``) run their HOP inside an internal ``torch.compile``.  Under a vmap, dynamo
skips that frame (a dispatch mode is active; ``compile_boundary`` stays silent for these
torch-internal frames), so the HOP gets the user's callables, or the front-end's flattening
wrapper, and its result goes straight back to the front-end; under ``grad``/``jvp`` alone,
dynamo compiles the frame and the HOP gets traced ``GraphModule``s with flat inputs and
outputs.  So the results are shaped as each route expects: flat for a traced graph (as torch's
own dense kernels return them), the front-end's structure for its wrapper (torch's dense
kernels get that wrong when dynamo is skipped: ``scan`` of two carries fails to unpack).

Inside ``functrans.compile`` (with or without a transform: its tracer marks the trace,
``_levels.compile_trace``) the desugared form is what is traced: a ``scan``/``map``/
``associative_scan``, and a ``cond`` with a batched predicate, unroll into the graph; an
unbatched ``cond`` predicate and every ``while_loop`` test read a tensor's value (``bool()``),
which the compiler's tracer makes a graph break (compiler/breaks.py): the value read is
guarded, and other values (another branch, another trip count) run a graph traced for them,
never a graph replayed for inputs it does not fit.

Known difference from a per-example loop: with a batched ``cond`` predicate (or ``while_loop``
freezing), gradients pass through ``torch.where``; where the branch NOT taken by an example has
a non-finite derivative there (``sqrt`` of a negative number), ``0 * nan`` makes that
example's gradient ``nan`` (JAX and ``torch.func`` behave the same).  ``associative_scan``
with ``combine_mode='generic'`` never reaches the HOP: torch's front-end runs it eagerly with
``torch.vmap`` over the combine function, on functrans's tensors.

Imports: _levels, errors, batched_tensor, compile_boundary, mode.
"""
from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable, List, Sequence

import torch
from torch._C import DispatchKey
from torch._higher_order_ops.associative_scan import associative_scan_op
from torch._higher_order_ops.cond import cond_op
from torch._higher_order_ops.map import map_impl
from torch._higher_order_ops.scan import scan_op
from torch._higher_order_ops.while_loop import while_loop_op
from torch.utils import _pytree as pytree

from .. import _levels
from ..errors import FunctransError, UnsupportedUnderVmap
from . import compile_boundary
from .batched_tensor import BatchedTensor, innermost
from .mode import VmapLevelMode

_AUTOGRAD_KEYS = ("AutogradCPU", "AutogradCUDA", "AutogradXPU", "AutogradMPS", "AutogradMeta",
                  "AutogradHPU", "AutogradPrivateUse1", "AutogradOther")


def _unwrapped(x: Any) -> Any:
    """``x`` with the functional wrappers of ``functrans.functionalize`` taken off (under
    ``vmap(functionalize(f))`` a predicate is a functional wrapper of a BatchedTensor)."""
    while isinstance(x, torch.Tensor) and torch._is_functional_tensor(x):
        torch._sync(x)
        x = torch._from_functional_tensor(x)
    return x


def _batched(x: Any) -> bool:
    return type(x) is BatchedTensor or (
        isinstance(x, torch.Tensor) and type(_unwrapped(x)) is BatchedTensor)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {str(x.dtype).replace('torch.', '')} tensor of shape {tuple(x.shape)}"
    return f"{type(x).__name__} {x!r}"


# ---------------------------------------------------------------------------------------------
# cond


def run_cond(pred, true_fn, false_fn, operands):
    """``torch.cond`` as Python: one branch for an unbatched predicate; both branches and a
    per-example ``torch.where`` for a batched one (see the module docstring)."""
    if not _batched(pred):
        return true_fn(*operands) if bool(pred) else false_fn(*operands)
    if pred.dtype != torch.bool:
        pred = pred != 0   # the truth value `if pred:` takes
    tensors = [t for t in pytree.tree_leaves(operands) if isinstance(t, torch.Tensor)]
    versions = [_version(t) for t in tensors]
    true_out = true_fn(*operands)
    _check_unwritten("true_fn", tensors, versions)
    false_out = false_fn(*operands)
    _check_unwritten("false_fn", tensors, versions)
    true_leaves, true_spec = pytree.tree_flatten(true_out)
    false_leaves, false_spec = pytree.tree_flatten(false_out)
    hint = ("Make both branches return the same structure, with tensors of one shape and "
            "dtype (pad or cast inside the branch), or make the predicate the same for every "
            "example (compute it from unbatched values).")
    if true_spec != false_spec:
        raise UnsupportedUnderVmap(
            "torch.cond under functrans.vmap: the predicate differs per example, so both "
            "branches run on the whole batch and each example takes its own branch's outputs "
            "(torch.where); that needs outputs of the same structure, but true_fn returned "
            f"{true_spec} and false_fn {false_spec}. {hint}")
    out = []
    for i, (a, b) in enumerate(zip(true_leaves, false_leaves)):
        out.append(_select(pred, a, b, lambda why: UnsupportedUnderVmap(
            "torch.cond under functrans.vmap: the predicate differs per example, so both "
            "branches run on the whole batch and each example takes its own branch's outputs "
            f"(torch.where); output {i} cannot be selected per example: true_fn returned "
            f"{_describe(a)} and false_fn {_describe(b)} ({why}). {hint}")))
    return pytree.tree_unflatten(out, true_spec)


def _version(t: torch.Tensor) -> Any:
    """``t._version``, or None for an inference tensor (it keeps no version counter)."""
    return None if t.is_inference() else t._version


def _check_unwritten(branch: str, tensors, versions) -> None:
    for i, (t, v) in enumerate(zip(tensors, versions)):
        if v is not None and t._version != v:
            raise UnsupportedUnderVmap(
                f"torch.cond under functrans.vmap: {branch} wrote into operand {i} in place. "
                "The predicate differs per example, so both branches run on the whole batch, "
                "and the write would reach the other branch and the examples that do not take "
                f"this one. Return the new value instead of writing it (x = x + 1, not "
                "x.add_(1)), or write into a clone.")


def _select(pred, new, old, error: Callable[[str], Exception]):
    """Each example's ``new`` where its ``pred`` holds, else its ``old`` (pred is logically 0-d,
    broadcast over the output)."""
    if isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor):
        if new.shape != old.shape:
            raise error("their shapes differ")
        if new.dtype != old.dtype:
            raise error("their dtypes differ")
        if new.device != old.device:
            raise error("their devices differ")
        return torch.where(pred, new, old)
    if isinstance(new, torch.Tensor) or isinstance(old, torch.Tensor):
        raise error("one is a tensor, the other not")
    if new is old or new == old:
        return new
    raise error("a Python value cannot differ per example; return it as a tensor")


# ---------------------------------------------------------------------------------------------
# while_loop


def _check_predicate(pred) -> None:
    if isinstance(pred, bool):
        return
    if isinstance(pred, torch.Tensor) and pred.dtype == torch.bool and pred.dim() == 0:
        return
    raise FunctransError(
        "torch._higher_order_ops.while_loop: cond_fn must return a boolean scalar tensor (or a "
        f"Python bool), but returned {_describe(pred)}. Return e.g. `(x < limit).all()` or "
        "`i < n` for a 0-d tensor i.")


def _front_end_spec(fn) -> Any:
    """The ``in_spec`` torch's ``while_loop`` front-end closed its flat callables over (the
    structure of the carried inputs), or None for a traced graph (flat in, flat out)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells or "in_spec" not in code.co_freevars:
        return None
    spec = cells[code.co_freevars.index("in_spec")].cell_contents
    return spec if isinstance(spec, pytree.TreeSpec) else None


def run_while_loop(cond_fn, body_fn, carried_inputs, additional_inputs, *_, **__):
    """``while_loop`` as Python: iterate while any example's ``cond_fn`` holds, freezing the
    examples that stopped (see the module docstring)."""
    carry = list(carried_inputs)
    extra = tuple(additional_inputs)
    out_spec = None
    while True:
        pred = cond_fn(*carry, *extra)
        _check_predicate(pred)
        if _batched(pred):
            if not bool(innermost(_unwrapped(pred)).any()):
                break
        elif not bool(pred):
            break
        new, out_spec = pytree.tree_flatten(body_fn(*carry, *extra))
        if len(new) != len(carry):
            raise FunctransError(
                "torch._higher_order_ops.while_loop: body_fn must return as many carried "
                f"values as it takes ({len(carry)}), but returned {len(new)}. Return the new "
                "value of every carried input, in the same structure.")
        if _batched(pred):
            new = [_select(pred, n, o, functools.partial(_carry_error, i, n, o))
                   for i, (n, o) in enumerate(zip(new, carry))]
        carry = new
    if out_spec is None:   # no iteration: fresh tensors, as torch's loop returns
        carry = [c.clone() if isinstance(c, torch.Tensor) else c for c in carry]
    spec = _front_end_spec(body_fn)
    if spec is not None:   # torch's front-end returns this to the user as it is
        return pytree.tree_unflatten(carry + list(extra), spec)[0]
    if out_spec is not None and not isinstance(body_fn, torch.fx.GraphModule):
        return pytree.tree_unflatten(carry, out_spec)
    return tuple(carry)


def _carry_error(i, new, old, why):
    return UnsupportedUnderVmap(
        "torch._higher_order_ops.while_loop under functrans.vmap: the loop condition differs "
        "per example, so the loop runs while any example continues and keeps each finished "
        f"example's carried values (torch.where); carried value {i} cannot be kept per "
        f"example: it was {_describe(old)} and body_fn returned {_describe(new)} ({why}). "
        "Make body_fn return each carried value with the shape and dtype it takes, and carry "
        "counters as 0-d tensors (torch.tensor(0)), not Python ints.")


# ---------------------------------------------------------------------------------------------
# scan, map, associative_scan


def _front_end_fn(fn, name: str):
    """The user's function and the keywords of torch's flattening wrapper
    (``functools.partial(wrap_combine_fn_flat, combine_fn=...)``), or None for a traced graph."""
    if isinstance(fn, functools.partial) and getattr(fn.func, "__name__", "") == name \
            and "combine_fn" in fn.keywords:
        return fn.keywords
    return None


def _stack(columns: Sequence[Sequence[Any]]) -> List[Any]:
    """Stack each column of per-step outputs along a new dim 0 (None columns stay None)."""
    out = []
    for col in columns:
        if all(c is None for c in col):
            out.append(None)
        elif all(isinstance(c, torch.Tensor) for c in col):
            out.append(torch.stack(list(col)))
        else:
            raise FunctransError(
                "a scan/map body returned a non-tensor output "
                f"({_describe(next(c for c in col if not isinstance(c, torch.Tensor)))}), "
                "which cannot be stacked across steps. Return tensors.")
    return out


def run_scan(combine_fn, init, xs, additional_inputs):
    """``scan`` (scan dim already moved to 0 and reversed by torch's front-end) as a Python loop
    over dim 0: ``(carry, ys)`` structured for the front-end's wrapper, flat
    ``(*carry, *ys)`` for a traced graph."""
    init, xs, extra = list(init), list(xs), tuple(additional_inputs)
    front = _front_end_fn(combine_fn, "wrap_combine_fn_flat")
    length = xs[0].shape[0]
    carry, steps, y_spec = init, [], None
    for i in range(length):
        step_xs = [x.select(0, i) for x in xs]
        if front is not None:   # the user's (carry, xs) -> (carry, y) with its pytrees
            next_carry, y = front["combine_fn"](
                pytree.tree_unflatten(carry, front["spec_init"]),
                pytree.tree_unflatten(step_xs, front["spec_xs"]))
            carry = pytree.tree_leaves(next_carry)
            y_leaves, y_spec = pytree.tree_flatten(y)
        else:
            leaves = pytree.tree_leaves(combine_fn(*carry, *step_xs, *extra))
            carry, y_leaves = leaves[:len(init)], leaves[len(init):]
        if len(carry) != len(init):
            raise FunctransError(
                f"torch._higher_order_ops.scan: combine_fn returned {len(carry)} carried "
                f"values where init has {len(init)}. Return the next carry with init's "
                "structure.")
        steps.append(y_leaves)
    ys = _stack(list(zip(*steps))) if steps else []
    if front is not None:
        return (pytree.tree_unflatten(carry, front["spec_init"]),
                pytree.tree_unflatten(ys, y_spec))
    return (*carry, *ys)


def run_map(f, xs, pos_args):
    """``map`` as a Python loop over dim 0 of ``xs``, outputs stacked in ``f``'s structure."""
    xs, extra = list(xs), tuple(pos_args)
    outs = [f(*[x.select(0, i) for x in xs], *extra) for i in range(xs[0].shape[0])]
    flat = [pytree.tree_flatten(o) for o in outs]
    spec = flat[0][1]
    return pytree.tree_unflatten(_stack(list(zip(*[leaves for leaves, _ in flat]))), spec)


def _interleave(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    """``even[0], odd[0], even[1], odd[1], ...`` along dim 0 (``even`` one longer or equal)."""
    if even.shape[0] == odd.shape[0]:
        return torch.stack([even, odd], 1).flatten(0, 1)
    head = torch.stack([even[:-1], odd], 1).flatten(0, 1)
    return torch.cat([head, even[-1:]])


def _parallel_scan(combine: Callable, elems: List[torch.Tensor]) -> List[torch.Tensor]:
    """Inclusive scan along dim 0 by odd-even recursion: ``combine(a, b)`` on lists of
    leaves, applied to whole slices (pointwise along the scanned dim)."""
    n = elems[0].shape[0]
    if n < 2:
        return elems
    odd = _parallel_scan(combine, combine([e[0:n - 1:2] for e in elems],
                                          [e[1::2] for e in elems]))
    # odd[k] is the prefix up to 2k+1; even[k] (k >= 1), the prefix up to 2k, is
    # odd[k-1] combined with element 2k.
    if n > 2:
        rest = combine([o[:(n - 1) // 2] for o in odd], [e[2::2] for e in elems])
        even = [torch.cat([e[:1], r]) for e, r in zip(elems, rest)]
    else:
        even = [e[:1] for e in elems]
    return [_interleave(e, o) for e, o in zip(even, odd)]


def run_associative_scan(combine_fn, xs, additional_inputs):
    """``associative_scan`` (pointwise combine, scan dim 0, already reversed by torch's
    front-end) by the odd-even parallel scan."""
    xs, extra = list(xs), tuple(additional_inputs)
    front = _front_end_fn(combine_fn, "wrap_combine_fn_flat")

    def combine(a, b):
        leaves = pytree.tree_leaves(combine_fn(*a, *b, *extra))
        if len(leaves) != len(xs):
            raise FunctransError(
                f"torch._higher_order_ops.associative_scan: combine_fn returned {len(leaves)} "
                f"values for inputs of {len(xs)}. Return one value per input, in the inputs' "
                "structure.")
        return leaves

    out = _parallel_scan(combine, xs)
    if front is not None:
        return pytree.tree_unflatten(out, front["spec"])
    return out


# ---------------------------------------------------------------------------------------------
# registration

IMPLEMENTATIONS = {cond_op: run_cond, while_loop_op: run_while_loop, scan_op: run_scan,
                   associative_scan_op: run_associative_scan, map_impl: run_map}


def _functrans_call(args) -> bool:
    """Is this HOP call functrans's to run?  Yes while a functrans transform is active (or a
    ``BatchedTensor`` is among its arguments, or ``functrans.compile`` traces), except while
    dynamo compiles torch's front-end (``torch.cond`` runs its operator in an internal
    ``torch.compile``) under a transform that runs eagerly: dynamo propagates fake tensors
    through the operator to build its graph node, and the compiled graph's real call comes back
    here.  A transform made inside a compiled region (``torch.compile(functrans.jvp(f))``,
    traced by AOTAutograd) runs it desugared."""
    stack = _levels.stack()
    if not stack and not _levels.in_compile_trace() \
            and not any(_batched(x) for x in pytree.tree_leaves(args)):
        return False
    return not _levels.compiling() or bool(stack and stack[-1].compiling)


def _front_end_codes() -> List[Any]:
    """The code objects of the functions torch's front-ends hand to their internal
    ``torch.compile`` (``_cond_op_wrapper``, ``run_flattened_scan``, ...)."""
    modules = [sys.modules[type(hop).__module__] for hop in IMPLEMENTATIONS]
    fronts = [getattr(m, m.__name__.rpartition(".")[2]) for m in modules]   # cond.cond, ...
    return [c for f in fronts for c in f.__code__.co_consts
            if isinstance(c, types.CodeType) and c.co_name in _FRONT_END_WRAPPERS]


_FRONT_END_WRAPPERS = {"_cond_op_wrapper", "_while_loop_op_wrapper", "run_flattened_scan",
                       "run_flattened_associative_scan", "run_flattened_map"}
_codes: List[Any] = []


def _run(impl, args, kwargs):
    """Run the desugared form.  Dynamo skipped torch's front-end frame to get here (a dispatch
    mode was active) and marked its code as skipped for good, which would leave a later
    ``torch.cond`` outside functrans uncompiled (and ``scan``'s front-end broken: it unpacks
    the compiled result's structure): give those codes back dynamo's default."""
    try:
        return impl(*args, **kwargs)
    finally:
        compile_boundary.unmark(_codes)


def _autograd_kernel(hop, impl):
    torch_kernel = hop.py_kernels[DispatchKey.Autograd]

    def kernel(*args, **kwargs):
        if _functrans_call(args):
            return _run(impl, args, kwargs)
        return torch_kernel(*args, **kwargs)

    return kernel


def _mode_kernel(impl):
    def kernel(mode, *args, **kwargs):
        with mode:   # the HOP dispatcher popped it; the desugared ops must reach it again
            return _run(impl, args, kwargs)
    return kernel


def _subclass_kernel(impl):
    def kernel(*args, **kwargs):
        return _run(impl, args, kwargs)
    return kernel


_installed: List[Any] = []


def install() -> None:
    """Register the desugared implementations on each HOP (see the module docstring).
    Idempotent."""
    if _installed:
        return
    _codes.extend(_front_end_codes())
    for hop, impl in IMPLEMENTATIONS.items():
        kernels = []
        if DispatchKey.Autograd in hop.py_kernels:
            kernels.append(_autograd_kernel(hop, impl))
            for name in _AUTOGRAD_KEYS:
                key = getattr(DispatchKey, name, None)
                if key is not None and key not in hop.py_kernels:
                    hop.py_impl(key)(kernels[-1])
        if VmapLevelMode not in hop.python_key_table:
            kernels.append(hop.py_impl(VmapLevelMode)(_mode_kernel(impl)))
        if BatchedTensor not in hop.python_key_table:
            kernels.append(hop.py_impl(BatchedTensor)(_subclass_kernel(impl)))
        for kernel in kernels:
            # dynamo never converts a frame below them: a front-end dynamo skipped (a dispatch
            # mode was active) would otherwise hand it this kernel's frame to convert
            compile_boundary.skip_recursively(kernel)
        _installed.append(hop)
