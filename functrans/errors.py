"""The exception hierarchy and warnings functrans raises.

Every error a user can trigger is a ``FunctransError`` (a ``RuntimeError``), so existing
``except RuntimeError`` code keeps working.  Bad arguments to a public API are
``TransformArgumentError``, which is also a ``ValueError``, as in PyTorch's own transforms.
"""
from __future__ import annotations


class FunctransError(RuntimeError):
    """Base class for every error functrans raises on purpose."""


class TransformArgumentError(FunctransError, ValueError):
    """An argument to a public transform (in_dims, out_dims, chunk_size, ...) is wrong."""


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


class PerformanceWarning(UserWarning):
    """An op ran through the slow per-example loop fallback because it has no batching rule."""
