"""Physical layouts of a batch, for the OpInfo sweeps' layout checks (issue 25).

A batching rule sees a batched operand's physical tensor: its strides, its contiguity, its
memory format.  A rule whose answer depends on them is a silent wrong result (native_group_norm
once read a batch-last weight as contiguous memory, as eager does).  The sweeps present each
batched operand in these layouts; the oracle stays the for-loop over contiguous examples.

``LAYOUTS``, for a batch whose examples were stacked at the in_dim (``torch.stack``):

* ``stacked``        as stacked: the batch dim physically where it is logically (in_dim 0:
  outermost in memory, in_dim -1: innermost), the examples contiguous around it;
* ``batch_moved``    the same logical in_dim, the batch dim physically at the other end (in_dim 0
  innermost in memory, in_dim -1 outermost);
* ``transposed``     every example's last two dims swapped in memory, viewed back;
* ``channels_last``  4-d examples in channels_last memory format, 5-d in channels_last_3d;
* ``expanded``       every example expanded (stride 0) along its first dim of size > 1 from its
  slice of size 1 there (different examples still differ).  Only floating and complex operands
  that the op does not write in place: an expanded tensor cannot be written, and repeated
  integer indices would make scatter-like ops pick among duplicates.

A layout that does not apply to an operand (channels_last of a 3-d example, any layout that
leaves every stride of a dim of size > 1 as it was) gives ``None``; a check runs in a layout only
where some operand takes it.  With nested vmap the batch dims of both levels are placed together.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

LAYOUTS = ("stacked", "batch_moved", "transposed", "channels_last", "expanded")


def bdim_positions(example_rank: int, dims: Sequence[int]) -> List[int]:
    """The physical positions of the batch dims of a batch built by stacking examples of rank
    ``example_rank`` at ``dims`` (innermost level first, as ``opinfo_sweep.build_batch``)."""
    pos: List[int] = []
    rank = example_rank
    for d in dims:
        q = d % (rank + 1)
        pos = [p + (p >= q) for p in pos] + [q]
        rank += 1
    return pos


def with_memory_order(t: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """``t``'s values with its dims laid out in memory in ``order`` (outermost first)."""
    inverse = [list(order).index(i) for i in range(t.dim())]
    return t.permute(*order).contiguous().permute(*inverse)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(a.stride(i) == b.stride(i) for i in range(a.dim()) if a.shape[i] > 1)


def _example_order(layout: str, rank: int) -> Optional[List[int]]:
    if layout == "transposed" and rank >= 2:
        return list(range(rank - 2)) + [rank - 1, rank - 2]
    if layout == "channels_last" and rank in (4, 5):
        return [0] + list(range(2, rank)) + [1]
    return None


def lay_out(batch: torch.Tensor, bdims: Sequence[int], layout: str, *,
            expandable: bool = True) -> Optional[torch.Tensor]:
    """``batch`` (batch dims at the physical positions ``bdims``) in ``layout``, or None where
    the layout does not apply to it.  The values stay those of ``batch`` except for
    ``expanded``, which repeats one slice of every example (the oracle reads the same batch)."""
    if layout == "stacked":
        return batch
    bdims = sorted(bdims)
    ex = [i for i in range(batch.dim()) if i not in bdims]
    if layout == "expanded":
        if not expandable or not (batch.is_floating_point() or batch.is_complex()):
            return None
        dim = next((i for i in ex if batch.shape[i] > 1), None)
        if dim is None:
            return None
        return batch.narrow(dim, 0, 1).expand(batch.shape)
    if layout == "batch_moved":
        order = ex + bdims if bdims == list(range(len(bdims))) else bdims + ex
    elif layout in ("transposed", "channels_last"):
        ex_order = _example_order(layout, len(ex))
        if ex_order is None:
            return None
        order, it = [], iter(ex[j] for j in ex_order)
        for i in range(batch.dim()):
            order.append(i if i in bdims else next(it))
    else:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    out = with_memory_order(batch, order)
    return None if _same_layout(out, batch) else out


def written_inputs(call, tensors: Sequence[torch.Tensor]) -> frozenset:
    """The positions of the tensors that ``call(*tensors)`` writes in place, run on clones: a
    version counter that moves, values or metadata that change (native_batch_norm updates its
    running stats without moving their version counters).  Every position if the call fails."""
    clones = [t.clone() for t in tensors]
    before = [(t._version, t.clone(), t.shape, t.stride()) for t in clones]
    try:
        call(*clones)
    except Exception:
        return frozenset(range(len(tensors)))

    def changed(t, b):
        version, value, shape, stride = b
        return (t._version != version or t.shape != shape or t.stride() != stride
                or not torch.equal(t, value))

    return frozenset(i for i, (t, b) in enumerate(zip(clones, before)) if changed(t, b))
