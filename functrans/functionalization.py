"""``functionalize(func, *, remove=...)``: run a function with its mutations (and optionally its
views) replaced by out-of-place ops, as PyTorch's own ``functionalize`` transform does.

What this module owns
- the public ``functionalize`` transform, built on PyTorch's C++ functionalization pass
  (``torch._to_functional_tensor`` / ``torch._enable_functionalization`` / ``torch._sync`` /
  ``torch._from_functional_tensor``), never on PyTorch's own transform layers;
- the differentiable wrapping of inputs into functional wrappers and of outputs back out
  (``_ToFunctional`` / ``_FromFunctional``: ``torch.autograd.Function``s with ``backward`` and
  ``jvp``), so ``grad``, ``vjp``, ``jacrev``, ``jvp`` and ``jacfwd`` compose over it;
- writing mutations of inputs back to the caller's tensors after ``func`` returns;
- ``physical_functionalization(level)`` and ``logical_ops(level)``: the hooks the vmap
  dispatcher and ``vmap`` use so that ``functionalize(vmap(f))`` works (see below);
- ``functional_tangents`` / ``unwrap_functional``: the hooks ``jvp`` uses (see below).

How it composes
- The Functionalize dispatch key sits below Autograd and above Python, so autograd records the
  user's ops on the functional wrappers (its backward formulas then run through the
  functionalization kernels too), and a BatchedTensor *inside* a functional wrapper
  (``vmap(functionalize(f))``) receives the already functionalized ops.
- A functional wrapper *inside* a BatchedTensor (``functionalize(vmap(f))``, and the vmaps of
  ``functionalize(jacrev/jacfwd/hessian(f))``): PyTorch's Functionalize kernel sits ABOVE the
  Python key, so an op mixing a BatchedTensor with a functional tensor of the outer call (a
  closed-over value, a tensor autograd saved for a backward formula run under the vmap, a
  forward-AD primal with a batched tangent) would be taken by the Functionalize kernel first:
  a functional wrapper around the batched result escapes the vmap, or an in-place op asserts
  inside PyTorch.  So a vmap entered directly inside a functionalize call (``logical_ops``, a
  "boundary") EXCLUDES the key for its logical ops, and the vmap handles them first, as in
  PyTorch's own layering: its rules' physical ops run with the key on
  (``physical_functionalization``), and ops without a BatchedTensor run with it on in
  ``_BoundaryMode``, a dispatch mode below the vmap's own.
- Forward-mode AD over functionalize under a vmap (``jacfwd``, ``hessian``, ``vmap(jvp)``) runs
  by jvp's double-vjp route (see ``_no_forward_mode_under_vmap``); for it the gradient entering
  ``func``'s graph becomes a functional wrapper and leaves it unwrapped, both differentiably
  (``_FromFunctional.backward``, ``_ToFunctional.backward``, ``unwrap_functional``).  Inside a
  functionalize call jvp's tangents are made functional (``functional_tangents``).
- A functionalize inside another (directly, or across a vmap) leaves the outer pass on.
- ``make_fx(functionalize(f))`` records the out-of-place ops the pass emits below it: a graph
  with no mutations (and with ``*_copy`` view ops for ``remove='mutations_and_views'``), plus the
  ``copy_`` that writes a mutated input back, exactly as PyTorch's transform does; so does
  ``make_fx(functionalize(jacrev/jacfwd/hessian/vmap(grad)(f)))``.

Limitations: in a vmap inside functionalize, a tensor that the vmapped function creates with a
factory (``torch.zeros(3)``) stays a plain tensor (forward AD materialises a Python scalar's
zero tangent through a factory, which must stay plain), so a write into it keeps that write in a
traced graph (values are right).  As in PyTorch's transform, mutations of closed-over tensors
are not removed (they are not inputs), and an input whose metadata is changed in place
(``x.transpose_(0, 1)``) is refused with a clear error instead of being written back; so is a
write into an input that a transform differentiates (PyTorch refuses the in-place write into
that leaf).  ``functionalize(f, remove='mutations_and_views')`` directly inside another
functionalize call keeps the outer call's view setting.

Imports: _levels, _pytree, errors, batching.batched_tensor (to recognise wrappers),
batching.op_schema (which arguments an op writes). Never the dispatcher.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, List

import torch
import torch.autograd.forward_ad as _fwAD
from torch.utils._python_dispatch import TorchDispatchMode

from . import _levels
from ._pytree import leaf_paths, tree_flatten, tree_unflatten
from .batching.batched_tensor import BatchedTensor
from .batching.op_schema import written_arguments
from .errors import ForwardModeAroundVmap, FunctransError, TransformArgumentError, transform_call

__all__ = ["functionalize"]

_FUNCTIONALIZE = torch._C.DispatchKey.Functionalize
_KEYSET = torch._C.DispatchKeySet(_FUNCTIONALIZE)

_tls = threading.local()
# Number of functionalize calls running in any thread: a cheap test for the vmap dispatcher's
# hot path (the thread-local stack below decides).
_active_anywhere = 0


def _active() -> List[int]:
    s = getattr(_tls, "active", None)
    if s is None:
        s = _tls.active = []
    return s


def _is_functional(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and torch._is_functional_tensor(t)


def _unwrap(t: torch.Tensor) -> torch.Tensor:
    if _is_functional(t):
        torch._sync(t)
        return torch._from_functional_tensor(t)
    return t


class _ToFunctional(torch.autograd.Function):
    """Wrap a tensor into a functional wrapper; the gradient passes through unwrapped."""

    generate_vmap_rule = True   # vmap(functionalize(f)): forward runs on the BatchedTensors

    @staticmethod
    def forward(x):
        return torch._to_functional_tensor(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        # Differentiably (a graph from the cotangent to the result, under create_graph): the
        # double-vjp route of jvp / jacfwd / hessian over functionalize differentiates this
        # gradient with respect to the cotangent.
        if _is_functional(g):
            return _FromFunctional.apply(g, frozenset())
        return g

    @staticmethod
    def jvp(ctx, t):
        if type(t) is not torch.Tensor or any(lv.kind == "vmap" for lv in _levels.stack()):
            _no_forward_mode_under_vmap(t)
        # A fresh wrapper: an in-place op on the input inside func updates its tangent in place
        # (with the functional primal), which must stay functionalized and must not write into
        # the caller's tangent.
        if _is_functional(t):
            return t
        return torch._to_functional_tensor(t)


def _no_forward_mode_under_vmap(t) -> None:
    """Forward-mode AD over functionalize under a vmap (jacfwd, hessian, vmap(jvp), or a jvp
    with ordinary tangents inside any vmap) cannot run on dual tensors: forward AD makes the
    zero tangent of a Python scalar operand (``x * 2``) with ``_efficientzerotensor``, which
    the vmap materialises as a factory call; under the Functionalize key that becomes a
    functional wrapper that PyTorch's Python fallback then reads as a wrapped number (a
    storage-less tensor: a RuntimeError about unallocated data).  functrans.jvp retries by its
    exact double-vjp route (J t = d/du <J^T u, t>, reverse mode, which composes with
    functionalize); forward AD opened by the user (``torch.autograd.forward_ad``) gets a clear
    error instead."""
    if _levels.forward_ad_state() == "mine":
        raise ForwardModeAroundVmap()
    raise FunctransError(
        f"{transform_call('functionalize', 'func')}: forward-mode AD (torch.autograd.forward_ad) "
        "over functionalize under vmap is not supported (got a tangent of type "
        f"{type(t).__name__}). Use functrans.jvp / jacfwd / hessian, which take a reverse-mode "
        "route there, or put functionalize outside: functionalize(jacfwd(f)).")


class _FromFunctional(torch.autograd.Function):
    """Unwrap a functional output (after applying its pending updates)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(w, originals):
        inner = _unwrap(w)
        if id(inner) in originals:
            # func returned (a wrapper of) an input: hand out an alias, never the caller's own
            # tensor object, whose autograd metadata this Function would overwrite.
            inner = torch.ops.aten.alias.default(inner)
        return inner

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        # The gradient enters the graph that func recorded on functional wrappers as a
        # functional wrapper too (differentiably): the backward formulas there then run on
        # functional tensors only, as they would inside the functionalize call.  A plain
        # gradient would meet them in in-place ops (an in-place op on a view records a
        # CopySlices node, whose backward copies the gradient into a fresh tensor): PyTorch's
        # internal assert "mutating a non-functional tensor with a functional tensor" under
        # vmap, and wrong values in jvp's double-vjp route.
        if isinstance(g, torch.Tensor) and not _is_functional(g):
            g = _GradToFunctional.apply(g)
        return g, None

    @staticmethod
    def jvp(ctx, t, _):
        return _unwrap(t)


def functional_tangents(tangents: List[Any]) -> List[Any]:
    """For jvp's forward-AD route inside a functionalize call (``functionalize(jvp(f))``,
    ``functionalize(jacfwd(f))``): the tangents as functional wrappers (under vmap: batched
    tensors around functional wrappers), because forward AD's formulas for in-place ops write
    the new tangent into the old one, and a plain tangent written with functional values is
    PyTorch's internal assert "mutating a non-functional tensor with a functional tensor".
    Differentiable (``_ToFunctional``); the tangents themselves when no call is active."""
    if not _active_anywhere or not _active():
        return tangents
    return [_as_functional(t) if isinstance(t, torch.Tensor) and not _is_functional(
        _innermost(t)) else t for t in tangents]


def _as_functional(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, BatchedTensor) and t.level.id > _active()[-1]:
        # a vmap inside the functionalize call: its physical values are the functional ones
        return BatchedTensor(_as_functional(t.value), t.bdim, t.level)
    return _ToFunctional.apply(t)  # (a wrapper around a vmap's batched tensor outside it)


def _innermost(t: torch.Tensor) -> torch.Tensor:
    while hasattr(type(t), "__torch_dispatch__") and hasattr(t, "value") and \
            isinstance(t.value, torch.Tensor):
        t = t.value  # a BatchedTensor's physical value
    return t


def unwrap_functional(t: Any) -> Any:
    """``t`` itself, or for a functional wrapper its value (after its pending updates),
    differentiably.  For the double-vjp route of jvp (autodiff/jvp.py): the second backward
    pass runs through the graph that a functionalize call recorded on functional wrappers, so
    the gradients it returns for the cotangents can be functional wrappers (around the
    BatchedTensors of jacfwd's vmap); no functionalize call is active there to unwrap them."""
    if _is_functional(t):
        return _FromFunctional.apply(t, frozenset())
    return t


class _GradToFunctional(torch.autograd.Function):
    """A gradient into a functional wrapper, differentiably (see _FromFunctional.backward).
    Old-style on purpose: under vmap its forward runs on the BatchedTensor itself (a
    functional wrapper around it, the layering PyTorch's Functionalize kernel gives when a
    batched gradient meets the functional tensors the graph saved), not on its physical
    value; the backward unwraps it again."""

    @staticmethod
    def forward(ctx, g):
        return torch._to_functional_tensor(g)

    @staticmethod
    def backward(ctx, gg):
        return unwrap_functional(gg)


def _set_tls(enabled: bool, reapply_views: bool) -> None:
    if enabled:
        torch._enable_functionalization(reapply_views=reapply_views)
    else:
        torch._disable_functionalization()


@contextlib.contextmanager
def _functionalization(reapply_views: bool, marker: int):
    global _active_anywhere
    prev_on = torch._C._dispatch_tls_is_dispatch_key_included(_FUNCTIONALIZE)
    prev_reapply = torch._C._functionalization_reapply_views_tls()
    active = _active()
    active.append(marker)
    _active_anywhere += 1
    try:
        # The key on (and not excluded: a functionalize inside a vmap that is itself inside a
        # functionalize call, see logical_ops).  A functionalize directly inside another
        # leaves the outer pass on (PyTorch refuses to nest its mode-style pass; the outer
        # one already removes the mutations), keeping the outer call's view setting.
        with torch._C._ForceDispatchKeyGuard(
                torch._C._dispatch_tls_local_include_set(),
                torch._C._dispatch_tls_local_exclude_set() - _KEYSET):
            if not prev_on:
                _set_tls(True, reapply_views)
            try:
                yield
            finally:
                if not prev_on:
                    _set_tls(False, prev_reapply)
    finally:
        active.pop()
        _active_anywhere -= 1


def _boundaries() -> List[int]:
    """Ids of the vmap levels entered directly inside an active functionalize call (this
    thread): the levels whose physical ops are functionalized."""
    s = getattr(_tls, "boundaries", None)
    if s is None:
        s = _tls.boundaries = []
    return s


def _key_on() -> contextlib.AbstractContextManager:
    include = torch._C._dispatch_tls_local_include_set() | _KEYSET
    exclude = torch._C._dispatch_tls_local_exclude_set() - _KEYSET
    return torch._C._ForceDispatchKeyGuard(include, exclude)


def physical_functionalization(level) -> contextlib.AbstractContextManager:
    """For the vmap dispatcher: a context that switches the Functionalize key back on for the
    physical ops of a rule of ``level`` when ``level`` is a vmap entered directly inside a
    functionalize call (its physical values are then functional wrappers, also when another
    functionalize runs inside the vmap); ``None`` when nothing is needed.  The physical ops
    of a vmap nested deeper run with the key off: they are the logical ops of the vmap outside
    them, which functionalizes its own."""
    if not _active_anywhere:
        return None
    b = _boundaries()
    if not b or level.id not in b:
        return None  # not a vmap entered directly inside a functionalize call
    return _physical()


@contextlib.contextmanager
def _physical():
    # _BoundaryMode stays on the mode stack below the rule: it lets the rule's physical ops
    # (which the Functionalize kernel has already unwrapped) pass untouched.
    _tls.physical = getattr(_tls, "physical", 0) + 1
    try:
        with _key_on():
            yield
    finally:
        _tls.physical -= 1


class _BoundaryMode(TorchDispatchMode):
    """Pushed (below the vmap's own mode) by a vmap entered inside a functionalize call, while
    the Functionalize key is excluded for that vmap's logical ops (see ``logical_ops``).  Every
    op that no vmap rule takes (no BatchedTensor among its arguments: ops on tensors closed
    over from the functionalized region, on saved tensors in a backward formula, forward-AD
    primal computations, factories) comes here and runs with the key switched back on, as it
    would outside the vmap.  Ops with a BatchedTensor pass on to the vmap dispatcher, whose
    rules' physical ops are functionalized (``physical_functionalization``)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self, batched_type):
        super().__init__()
        self.batched_type = batched_type

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_tls, "physical", 0) or self.batched_type in types:
            return func(*args, **kwargs)
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if not any(_is_functional(a) for a in tensors) or \
                any(isinstance(a, self.batched_type) for a in tensors):
            # A batched op (the vmap dispatcher's), one on plain tensors only, or a factory:
            # nothing to functionalize.  Factories stay plain tensors, as before this mode
            # existed (see the module's Limitations): forward AD materialises the zero
            # tangent of a wrapped number (x * 2) as a factory call, and a functional
            # wrapper there reaches PyTorch's Python fallback, which reads its (missing) data.
            return func(*args, **kwargs)
        if _writes_into_plain(func, args, kwargs):
            # An in-place op into a plain tensor (a factory's) with functional operands:
            # PyTorch's Functionalize kernel asserts; run it unfunctionalized on their values.
            args, kwargs = tree_unflatten(
                [_unwrap(a) if _is_functional(a) else a
                 for a in tree_flatten((args, kwargs))[0]], tree_flatten((args, kwargs))[1])
            return func(*args, **kwargs)
        with _key_on():
            return func(*args, **kwargs)


def _writes_into_plain(func, args, kwargs) -> bool:
    schema = func._schema
    if not schema.is_mutable:
        return False
    positions, names = written_arguments(func)
    written = [args[i] if i < len(args) else kwargs.get(schema.arguments[i].name)
               for i in positions] + [kwargs.get(n) for n in names]
    for v in written:
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, torch.Tensor) and not _is_functional(t):
                return True
    return False


@contextlib.contextmanager
def _boundary(level):
    include = torch._C._dispatch_tls_local_include_set() - _KEYSET
    exclude = torch._C._dispatch_tls_local_exclude_set() | _KEYSET
    b = _boundaries()
    b.append(level.id)
    try:
        with torch._C._ForceDispatchKeyGuard(include, exclude), _BoundaryMode(BatchedTensor):
            yield
    finally:
        b.pop()


def logical_ops(level) -> contextlib.AbstractContextManager:
    """For vmap (entered before the vmap's own dispatch mode): while a vmap runs directly
    inside a functionalize call, the Functionalize key is EXCLUDED for its logical ops, because
    PyTorch's Functionalize kernel sits above the Python key: it would take an op that mixes a
    BatchedTensor with a functional tensor of the outer functionalize (a closed-over value, a
    tensor saved by autograd for a backward formula run under vmap, a forward-AD primal with a
    batched tangent) before the vmap could, and wrap the batched result in a functional
    wrapper that then escapes the vmap (or, for an in-place op, raise an internal assert).  As
    in PyTorch's own layering the vmap handles its ops first: a rule's physical ops run with
    the key on (``physical_functionalization``), and the ops without a BatchedTensor run with
    it on too (``_BoundaryMode``).  A no-op when no functionalize call is active, or for a vmap
    nested in one that already did this."""
    if not _active_anywhere or not _active() \
            or not torch._C._dispatch_tls_is_dispatch_key_included(_FUNCTIONALIZE):
        return contextlib.nullcontext()
    return _boundary(level)


def _write_back(original: torch.Tensor, wrapped: torch.Tensor, pos, api: str) -> None:
    """Apply a mutation of an input made inside func to the caller's tensor (as PyTorch's
    transform does): ``original.copy_(new value)``, recorded by autograd like the eager op."""
    torch._sync(wrapped)
    if torch._functionalize_has_metadata_mutation(wrapped):
        raise FunctransError(
            f"{api}: the function changed the shape or strides of its input {pos()} in "
            "place (e.g. x.transpose_(0, 1) or x.resize_(...)); functrans cannot write such a "
            "change back to the caller's tensor. Use the out-of-place op (x = x.transpose(0, 1)) "
            "and return the result instead.")
    if not torch._functionalize_has_data_mutation(wrapped):
        return
    if _fwAD._current_level >= 0 and _fwAD.unpack_dual(original).tangent is not None:
        raise FunctransError(
            f"{api}: the function wrote in place into its input {pos()}, which carries a "
            "forward-mode tangent (jvp over functionalize); writing that mutation back is not "
            "supported. Clone the input inside the function (x = x.clone()) before writing.")
    base = original if original._base is None else original._base
    if original.requires_grad and base.is_leaf and base.requires_grad and \
            torch.is_grad_enabled():
        raise FunctransError(
            f"{api}: the function wrote in place into its input {pos()}, which is "
            "being differentiated (grad, vjp, jacrev, hessian, or jvp's reverse-mode route "
            "under vmap / jacfwd); PyTorch cannot write that mutation back into a leaf that "
            "requires grad. Clone the input inside the function (x = x.clone()) before "
            "writing, or return the new value instead.")
    new = _FromFunctional.apply(wrapped, frozenset((id(original),)))
    original.copy_(new)


def functionalize(func: Callable[..., Any], *, remove: str = "mutations") -> Callable[..., Any]:
    """Return a function with the semantics of ``func`` whose in-place ops (and, with
    ``remove='mutations_and_views'``, view ops) run as out-of-place ops.

    Mutations of the inputs are written back to them after ``func`` returns (one ``copy_`` per
    mutated input), so callers see the same effect as running ``func`` itself.  The returned
    function composes with every functrans transform, in both orders, and with ``make_fx``
    (a traced graph then has no in-place ops).

    Args:
        func: a function of tensors (pytrees of tensors in and out).
        remove: ``'mutations'`` (default): every in-place and ``out=`` op becomes its
            out-of-place counterpart; ``'mutations_and_views'``: in addition every view op
            becomes its ``*_copy`` counterpart (no aliasing left in a traced graph).

    Returns:
        A function of the same arguments, returning what ``func`` returns (same shapes).

    Raises:
        TransformArgumentError: an unknown ``remove``, or a ``func`` that is not callable.

    Example:
        >>> import torch, functrans
        >>> def f(x):
        ...     y = x.clone()
        ...     y.add_(1)                 # in place on an intermediate
        ...     return y * 2
        >>> functrans.functionalize(f)(torch.ones(3))
        tensor([4., 4., 4.])
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> gm = make_fx(functrans.functionalize(f))(torch.ones(3))
        >>> [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        ['aten.clone.default', 'aten.add.Tensor', 'aten.mul.Tensor']
        >>> def g(x):
        ...     x.mul_(2)                 # in place on the input: written back
        ...     return x.sum()
        >>> x = torch.ones(3)
        >>> functrans.functionalize(g)(x), x
        (tensor(6.), tensor([2., 2., 2.]))
    """
    api = transform_call("functionalize", func, remove=remove)
    if remove == "mutations":
        reapply_views = True
    elif remove == "mutations_and_views":
        reapply_views = False
    else:
        raise TransformArgumentError(
            f"{api}: remove must be 'mutations' (every in-place op is replaced by its "
            "out-of-place counterpart) or 'mutations_and_views' (in addition every view op is "
            "replaced by its *_copy counterpart).")
    if not callable(func):
        raise TransformArgumentError(
            f"{api}: expected func to be a callable, got {type(func).__name__}.")

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        flat, spec = tree_flatten((args, kwargs))
        # Inputs already functional (a functionalize nested in another) are left as they are:
        # the outer pass removes their mutations.
        new_flat = [_ToFunctional.apply(a)
                    if isinstance(a, torch.Tensor) and not _is_functional(a) else a
                    for a in flat]
        marker = _levels.Level("functionalize").id
        with _functionalization(reapply_views, marker):
            f_args, f_kwargs = tree_unflatten(new_flat, spec)
            out = func(*f_args, **f_kwargs)
        originals = frozenset(id(a) for a in flat if isinstance(a, torch.Tensor))
        out_flat, out_spec = tree_flatten(out)
        out_flat = [_FromFunctional.apply(o, originals) if _is_functional(o) else o
                    for o in out_flat]
        for i, (a, w) in enumerate(zip(flat, new_flat)):
            if w is not a:
                _write_back(a, w, lambda: (leaf_paths(args, "args")
                                           + leaf_paths(kwargs, "kwargs"))[i], api)
        return tree_unflatten(out_flat, out_spec)

    return wrapped
