"""Pure helpers for batch-dim arithmetic.  Rules should read as calls to these.

Conventions: ``bdim`` is the physical dimension of the batch in a physical tensor, or ``None``
when the tensor is not batched at the current level.  "Logical" shapes and dims are what the
user's per-example function sees; "physical" ones include the batch dimension.

Imports: nothing (torch only).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def logical_rank(x: torch.Tensor, bdim: Optional[int]) -> int:
    return x.dim() - (bdim is not None)


def move_bdim_to_front(x: torch.Tensor, bdim: int) -> torch.Tensor:
    """A view of ``x`` with its batch dim first (``bdim`` must not be None)."""
    return x if bdim == 0 else x.movedim(bdim, 0)


def ensure_bdim_front(x: torch.Tensor, bdim: Optional[int], size: int) -> torch.Tensor:
    """Batch dim first; an unbatched ``x`` becomes an expanded view (no copy)."""
    if bdim is None:
        return x.expand(size, *x.shape)
    return move_bdim_to_front(x, bdim)


def fold_bdim_into_dim0(x: torch.Tensor, bdim: Optional[int], size: int) -> torch.Tensor:
    """``[B, N, ...]`` (the batch dim moved first; an unbatched ``x`` expanded) as
    ``[B*N, ...]``: the vmap batch joined with the op's own leading batch dim."""
    X = ensure_bdim_front(x, bdim, size)
    return X.reshape((size * X.shape[1],) + tuple(X.shape[2:]))


def split_dim0(y: torch.Tensor, size: int) -> torch.Tensor:
    """``[B*N, ...]`` as ``[B, N, ...]`` (the inverse of ``fold_bdim_into_dim0``; ``N`` from the
    sizes, never inferred, so a tensor with a 0-sized dim splits too)."""
    return y.reshape((size, y.shape[0] // size) + tuple(y.shape[1:]))


# Note [layout-dependent kernels]
# A rule hands an eager kernel the physical tensor, whose layout (strides, memory format) the
# user chose, not the layout of any one example.  Most kernels give the same values in every
# layout; a few do not, and a rule that calls them as they are gives a wrong answer in some
# layouts (issue 25), where the right one is the kernel's on each example made contiguous
# (tests/support/layouts.py presents the OpInfo sweeps' batches in each layout).  Found so far:
# * native_group_norm reads a non-contiguous weight/bias as contiguous memory (rules/norms.py);
# * median.dim / nanmedian.dim over a stride-0 (expanded) dim return uninitialised memory, and
#   sort (so argsort) orders ties differently on a stride-0 input of a few thousand elements:
#   ``without_internal_overlap`` (rules/reductions.py, rules/sorting.py);
# * max_unpool2d resolves duplicate indices (different values for one output element) in
#   another order on a channels_last input than on a contiguous one, from call to call
#   (rules/pooling.py);
# * resize reads the example's storage in memory order (the loop fallback, fallback.py);
# * as_strided addresses storage, so an expanded (overlapping) example has no block of its own
#   (rules/views.py).

def has_internal_overlap(x: torch.Tensor) -> bool:
    """Whether some dim of size > 1 has stride 0 (an expanded tensor)."""
    return any(n > 1 and s == 0 for n, s in zip(x.shape, x.stride()))


def without_internal_overlap(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a contiguous copy of it when some dim of size > 1 has stride 0, for kernels
    whose values differ on an expanded input (See Note [layout-dependent kernels])."""
    return x.contiguous() if has_internal_overlap(x) else x


def normalize_dim(dim: int, rank: int) -> int:
    """Wrap a possibly negative logical dim into ``[0, rank)`` (0-d tensors accept 0 and -1)."""
    r = max(rank, 1)
    if not -r <= dim < r:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-r}, {r - 1}], "
                         f"but got {dim})")
    return dim % r


def physical_dim(logical_dim: int, bdim: int, rank: int) -> int:
    """The physical dim of ``logical_dim`` in a tensor whose batch dim is ``bdim``."""
    d = normalize_dim(logical_dim, rank)
    return d + (d >= bdim)


def front_dim(logical_dim: int, rank: int) -> int:
    """The physical dim of ``logical_dim`` once the batch dim is at the front."""
    return normalize_dim(logical_dim, rank) + 1


def pad_to_rank(x: torch.Tensor, rank: int) -> torch.Tensor:
    """``x`` with batch dim first, padded with size-1 dims after it to logical rank ``rank``."""
    missing = rank - (x.dim() - 1)
    if missing <= 0:
        return x
    return x.reshape(x.shape[:1] + (1,) * missing + x.shape[1:])


def match_bdim(x: torch.Tensor, src: Optional[int], dst: Optional[int],
               size: int) -> torch.Tensor:
    """Move (or create, by expanding) the batch dim of ``x`` from ``src`` to ``dst``.

    This is the one place that turns a rule's output bdim into the user's ``out_dims``.
    """
    if dst is None:
        return x
    if src is None:
        return x.unsqueeze(dst).expand(*x.shape[:dst], size, *x.shape[dst:])
    return x if src == dst else x.movedim(src, dst)


def first_bdim(in_dims: Sequence) -> Optional[int]:
    for d in in_dims:
        if d is not None:
            return d
    return None


def keep_bdim_rule(op):
    """A rule for an op that acts on each element (or on the whole tensor) without looking at
    dims, with the batched tensor first: run it on the physical value, keep the bdim."""
    def rule(info, in_dims, x, *args, **kwargs):
        return op(x, *args, **kwargs), in_dims[0]
    rule.__name__ = f"keep_bdim_rule[{op}]"
    return rule
