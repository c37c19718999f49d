"""``BatchedTensor``: the wrapper subclass that carries a batch dimension.

A BatchedTensor reports the LOGICAL (per-example) shape, strides, dtype and device, and holds
the physical tensor (``value``), the physical dim that is the batch (``bdim``) and the
``VmapLevel`` it belongs to.  Autograd state lives in one of two places: on the physical value
when a transform outside the vmap differentiates through it, or on the wrapper when a transform
inside the vmap does (see Note [autograd on physical values] in dispatch.py).  Every ATen op on
it goes to ``functrans.vmap.dispatch.dispatch``.
"""
from __future__ import annotations

import torch

from ..errors import UnsupportedUnderVmap


_make_wrapper = torch.Tensor._make_wrapper_subclass
_STRIDED = torch.strided


class BatchedTensor(torch.Tensor):
    value: torch.Tensor
    bdim: int

    @staticmethod
    def __new__(cls, value: torch.Tensor, bdim: int, level):
        # The wrapper describes example 0's view into the physical storage: the logical sizes
        # and strides, and its storage offset (forward AD compares a view's tangent layout with
        # its primal's).  Keyword arguments are passed only when they differ from the
        # defaults: this runs for every op under vmap, and each one costs parsing time.
        shape = value.shape
        stride = value.stride()
        size, strides = shape[:bdim] + shape[bdim + 1:], stride[:bdim] + stride[bdim + 1:]
        offset = value.storage_offset()
        if offset or value.layout is not _STRIDED:
            out = _make_wrapper(cls, size, strides=strides, storage_offset=offset,
                                dtype=value.dtype, device=value.device, layout=value.layout)
        else:
            out = _make_wrapper(cls, size, strides=strides, dtype=value.dtype,
                                device=value.device)
        out.value = value
        out.bdim = bdim
        out.level = level
        return out

    def __init__(self, value, bdim, level):  # state is set in __new__
        pass

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"BatchedTensor(level={self.level.id}, bdim={self.bdim}, "
                f"value={self.value!r})")

    # Python-level conversions that cannot be batched: say so clearly.
    def tolist(self):
        raise UnsupportedUnderVmap(
            "vmap: .tolist() was called on a batched tensor inside a vmapped function. "
            "The batched value has no single per-example list. Return the tensor from the "
            "function and call .tolist() on the result outside vmap.")

    def numpy(self, *args, **kwargs):
        raise UnsupportedUnderVmap(
            "vmap: .numpy() was called on a batched tensor inside a vmapped function. "
            "NumPy cannot see the batch dimension; compute with torch ops inside the function, "
            "or return the tensor and call .numpy() on the result outside vmap.")

    def __array__(self, *args, **kwargs):
        return self.numpy()


def is_batched(x) -> bool:
    return isinstance(x, BatchedTensor)


from .dispatch import dispatch as _dispatch  # noqa: E402  (circular: dispatch needs the class)
