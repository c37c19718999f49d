"""The exception hierarchy and warnings functrans raises, and the helpers every transform uses
to word its argument errors the same way.

What this module owns
- ``FunctransError`` and its subclasses.  Every error functrans raises on purpose is a
  ``FunctransError`` (a ``RuntimeError``), so existing ``except RuntimeError`` code keeps
  working; each subclass ALSO derives from the builtin type users caught before functrans had
  its own (a bad argument is a ``ValueError``, a wrong argument type a ``TypeError``, ...), so
  ``except ValueError`` keeps working too.
- ``ForwardModeAroundVmap``: internal control flow between vmap and jvp (never seen by users).
- ``transform_call(name, func, ...)``: the echoed call every transform's message opens with,
  e.g. ``"jacrev(f, argnums=0): ..."``.
- ``check_chunk_size``: the one validation of ``chunk_size`` (vmap, jacrev, jacfwd, hessian):
  None, a positive int or ``"auto"``.

Imports: nothing (every other module imports this one).
"""
from __future__ import annotations

from typing import Any


class FunctransError(RuntimeError):
    """Base class for every error functrans raises on purpose."""


class TransformArgumentError(FunctransError, ValueError):
    """An argument to a public transform (in_dims, out_dims, chunk_size, ...) is wrong."""


class TransformTypeError(FunctransError, TypeError):
    """An argument to a public function has the wrong type (a ``TypeError`` in PyTorch's and
    Python's own conventions, e.g. ``rearrange`` of something that is not a tensor)."""


class TransformKeyError(FunctransError, KeyError):
    """A name given to a public function does not exist (e.g. ``assign_grads`` with a parameter
    name the model does not have): a ``KeyError``, as a dict lookup would raise."""

    def __str__(self) -> str:   # KeyError's str() quotes its argument: keep the message plain
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class MissingDependencyError(FunctransError, ImportError):
    """An optional dependency a function needs is not installed (``rearrange`` needs einops)."""


class UnsupportedUnderVmap(FunctransError):
    """An operation cannot be expressed per example under vmap.

    Examples: ``.item()`` or ``bool()`` on a batched value, ops whose output shape depends on
    the data (``nonzero``), an in-place op that would write a batched value into an unbatched
    tensor, a random op under ``randomness='error'``.
    """


class InplaceIntoUnbatchedError(UnsupportedUnderVmap):
    """An in-place op under vmap would write a batched value into an unbatched tensor (one the
    function created with a factory, or captured from outside).  Its own type because
    ``jvp`` tells it apart: forward AD's tangent formulas can make such a write where the
    function itself does not (see ``autodiff/jvp.py``)."""


class EscapedBatchedTensorError(FunctransError):
    """A BatchedTensor was used after the vmap that created it returned."""


class ForwardModeAroundVmap(FunctransError):
    """Internal control flow, never seen by users: raised when a vmap starts (or forward AD
    meets functionalize under a vmap) inside ``functrans.jvp``'s own forward-AD level.  jvp
    catches it and retries by its exact double-vjp route.  See Note [autograd on physical
    values] in batching/dispatch.py."""


class PerformanceWarning(UserWarning):
    """An op ran through the slow per-example loop fallback because it has no batching rule."""


class CompileWarning(UserWarning):
    """A ``functrans.compile``d function runs eagerly (or on another backend than asked), and
    why: a value read it cannot guard (``.numpy()``), an in-place write before a value read, a
    value read taking more values than graphs are worth, a Python side effect a graph cannot
    replay (a change of the random generators' state outside a random op among them).  (A
    branch on a tensor's value or a data-dependent size is a graph break, not a warning.)
    Raised instead as ``UntraceableError`` with ``strict=True``."""


class UntraceableError(FunctransError):
    """``functrans.compile(fn, strict=True)``: fn does something a graph cannot bake in (the
    message names the op and the source line)."""


def _func_name(func: Any) -> str:
    if isinstance(func, str):
        return func
    return getattr(func, "__name__", type(func).__name__)


def transform_call(name: str, func: Any = None, *positional: str, **kwargs: Any) -> str:
    """The call as the user wrote it, to open a message: ``name(func, *positional, k=v...)``.

    ``func`` is shown by its ``__name__`` (a string is shown as given; ``None``: left out),
    ``positional`` are argument names shown as given (``"primals"``), and keyword arguments
    with their ``repr``.

    >>> transform_call("jacrev", lambda x: x, argnums=0)
    'jacrev(<lambda>, argnums=0)'
    >>> transform_call("jvp", "f", "primals", "tangents")
    'jvp(f, primals, tangents)'
    """
    parts = ([] if func is None else [_func_name(func)]) + list(positional)
    parts += [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{name}({', '.join(parts)})"


def check_chunk_size(chunk_size: Any, api: str) -> None:
    """``chunk_size`` must be None, a positive int (a bool is refused: ``True`` is not a size)
    or ``"auto"``.  ``api`` is the echoed call (``transform_call``) the message opens with."""
    if chunk_size is None or chunk_size == "auto" and isinstance(chunk_size, str) or (
            isinstance(chunk_size, int) and not isinstance(chunk_size, bool) and chunk_size >= 1):
        return
    raise TransformArgumentError(
        f"{api}: chunk_size must be None, a positive int or 'auto', got {chunk_size!r} "
        f"({type(chunk_size).__name__}). Pass the number of examples to run at a time, "
        "chunk_size=None to run them all at once, or chunk_size='auto' to take the most that "
        "fit in functrans.config.max_memory.")
