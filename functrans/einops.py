"""``rearrange(tensor, pattern, **axes_lengths)``: einops-style axis rearrangement that works on
functrans's transformed tensors (per-example patterns under ``vmap``, differentiable under
``grad``/``jacrev``...).

What this module owns: the public ``rearrange`` entry point and the clear ImportError when the
optional ``einops`` package is missing (``MissingDependencyError``, an ``ImportError``).

Why einops and not a re-implementation: ``einops.rearrange`` only reads the tensor's (logical)
shape and calls ``reshape``/``permute``/``expand``-free view ops on it; a ``BatchedTensor``
reports the per-example shape and functrans batches those ops, so the full einops pattern
language (``...``, ``()``, ``1``, composed and decomposed axes, its error messages) comes for
free and stays exactly einops's semantics.  einops is a small pure-Python package; it is an
optional extra (``pip install functrans[einops]``) so the core keeps its two dependencies.

Imports: errors (the optional einops package is imported inside ``rearrange``).
"""
from __future__ import annotations

from typing import Any

import torch

from .errors import MissingDependencyError, TransformTypeError, transform_call

__all__ = ["rearrange"]


_API = transform_call("rearrange", "tensor", "pattern", "**axes_lengths")


def rearrange(tensor: torch.Tensor, pattern: str, **axes_lengths: Any) -> torch.Tensor:
    """Rearrange the axes of ``tensor`` by an einops pattern, e.g. ``'b c h w -> b (h w) c'``,
    ``'(b1 b2) c -> b1 b2 c'`` with ``b1=2``, ``'... c -> c ...'``.

    Under ``vmap`` the pattern describes ONE example (the logical shape): the batch dim is
    never named.  Needs the optional ``einops`` package (``pip install functrans[einops]``).

    Args:
        tensor: the tensor to rearrange (a batched one under ``vmap``).
        pattern: an einops pattern ``'<input axes> -> <output axes>'``; the semantics and error
            messages are einops's own.
        **axes_lengths: sizes of axes the pattern cannot infer (``b1=2``).

    Returns:
        The rearranged tensor (a view where einops's ops give one).

    Raises:
        MissingDependencyError: (an ``ImportError``) einops is not installed.
        TransformTypeError: ``tensor`` is not a tensor or ``pattern`` not a string.

    Example:
        >>> import torch, functrans
        >>> functrans.rearrange(torch.ones(6, 4), "(b1 b2) c -> b1 b2 c", b1=2).shape
        torch.Size([2, 3, 4])
        >>> per_example = functrans.vmap(lambda t: functrans.rearrange(t, "h w -> (h w)"))
        >>> per_example(torch.ones(5, 2, 3)).shape      # the pattern sees one (2, 3) example
        torch.Size([5, 6])
    """
    try:
        import einops
    except ImportError as e:
        raise MissingDependencyError(
            f"{_API}: functrans.rearrange needs the optional 'einops' package, which is not "
            "installed. Install it with `pip install functrans[einops]` (or "
            "`pip install einops`).") from e
    if not isinstance(tensor, torch.Tensor):
        raise TransformTypeError(
            f"{_API}: expected tensor to be a torch.Tensor, got {type(tensor).__name__}. For a "
            "list of tensors, torch.stack them first.")
    if not isinstance(pattern, str):
        raise TransformTypeError(
            f"{_API}: expected pattern to be a str such as 'b c h w -> b (h w) c', got "
            f"{type(pattern).__name__}.")
    return einops.rearrange(tensor, pattern, **axes_lengths)
