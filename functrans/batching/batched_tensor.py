"""``BatchedTensor``: the wrapper subclass that carries a batch dimension.

A BatchedTensor reports the LOGICAL (per-example) shape, strides, dtype and device, and holds
the physical tensor (``value``), the physical dim that is the batch (``bdim``) and the
``VmapLevel`` it belongs to.  Autograd state lives in one of two places: on the physical value
when a transform outside the vmap differentiates through it, or on the wrapper when a transform
inside the vmap does (see Note [autograd on physical values] in dispatch.py).

Under a vmap every ATen op on a wrapper reaches the level's dispatch mode first (``mode.py``);
the wrapper's own ``__torch_dispatch__`` is the route of ops that run with no mode active (a
backward pass the autograd engine runs after its vmap returned).  Both end in
``dispatch.dispatch``.  Also here: ``top_level`` (the innermost vmap level among an op's
arguments), the errors of Python conversions of a wrapper (``.item()``, ``bool()``...), and the
hook point for the logically 0-d integer wrappers' ``__torch_function__`` (``above_dispatch.py``
installs it).

Imports: errors, dispatch (late, inside ``__torch_dispatch__``: the package's one import cycle,
allowed by tests/test_import_graph.py).
"""
from __future__ import annotations

from operator import attrgetter as _attrgetter

import torch

from ..errors import UnsupportedUnderVmap


_make_wrapper = torch.Tensor._make_wrapper_subclass
_disabled_torch_function = torch._C._disabled_torch_function_impl
_INDEX_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                           torch.uint16, torch.uint32, torch.uint64, torch.bool})
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
        if value.dim() == 1 and value.dtype in _INDEX_DTYPES:  # logically 0-d: maybe an index
            self._torch_function = _scalar_index_hook

    # ``__torch_function__`` is disabled (PyTorch's fast path) on every wrapper except the
    # logically 0-d integer/bool ones: Python indexing calls ``.item()`` on a 0-d integer index
    # (x[k]), which has no per-example answer, so those wrappers intercept ``__getitem__`` /
    # ``__setitem__`` (the hook ``above_dispatch.py`` installs), and ``torch.narrow`` /
    # ``torch.tensor_split``, which read a 0-d tensor start / sections as a Python integer
    # inside ATen, before any dispatch.  PyTorch's C++ check looks the
    # attribute up on the instance (here a C-level property + attrgetter), and every other
    # wrapper answers PyTorch's disabled impl, so ordinary ops keep the fast path.  Looked up on
    # the class the property is "enabled", so torch.overrides' Python helpers route a call with
    # a 0-d index among its arguments through the instances' values.
    __torch_function__ = property(_attrgetter("_torch_function"))
    _torch_function = _disabled_torch_function


    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # The one late import of the package (tests/test_import_graph.py allows exactly this
        # one): the dispatcher wraps its outputs in this class, and this class hands its ops to
        # the dispatcher.  As in DTensor, the class is defined first and imports its dispatcher
        # late.  Under a vmap ops reach the dispatcher through the level's mode, not here.
        from .dispatch import dispatch
        return dispatch(func, args, kwargs or {})

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"BatchedTensor(level={self.level.id}, bdim={self.bdim}, "
                f"value={self.value!r})")

    # Note [a branch every example takes the same way]
    # ``bool()`` of a one-element batched value is answered when every example gives the same
    # answer: then a loop over the examples would take that branch for each of them, so taking
    # it once for the batch computes exactly what the loop computes.  This is what input checks
    # need (F.gaussian_nll_loss's ``if torch.any(var < 0): raise``, ``assert (p >= 0).all()``).
    # When the examples disagree there is no single branch: the clear error below.  It costs a
    # host sync, paid only where the alternative was an error.  For a nested vmap the lower
    # level's ``bool()`` answers the same way, so the branch is taken only when every example
    # of every level agrees.  ``.item()``, ``int()`` and ``float()`` stay errors: a number
    # flows on into the computation, a branch does not.

    # Python-level conversions that cannot be batched: say so clearly.  Without these, an
    # example of more than one element would get eager's numel check ("a Tensor with 4
    # elements cannot be converted to Scalar"), which hides that vmap is the cause; a
    # one-element example reaches aten._local_scalar_dense, whose rule says the same
    # (rules/data_dependent.py).
    def item(self):
        raise _python_value_error(".item()")

    def __bool__(self):
        # See Note [a branch every example takes the same way].
        if self.numel() == 1:
            with torch.no_grad():
                truth = self.value.ne(0)
                if bool(truth.all()):
                    return True
                if not bool(truth.any()):
                    return False
            raise _python_value_error(
                "bool(tensor)", "Python control flow on a tensor calls it: `if x:`, "
                "`while x:`, `x and y`, `assert x`; here the examples of the batch disagree, "
                "some True and some False")
        raise _python_value_error("bool(tensor)", "Python control flow on a tensor calls it: "
                                  "`if x:`, `while x:`, `x and y`, `assert x`")

    # torch.tensor([a[0], a[1]]) converts its batched elements this way, too.
    def __int__(self):
        raise _python_value_error("int(tensor)", _BY_TORCH_TENSOR)

    def __float__(self):
        raise _python_value_error("float(tensor)", _BY_TORCH_TENSOR)

    def __complex__(self):
        raise _python_value_error("complex(tensor)", _BY_TORCH_TENSOR)

    def __index__(self):
        # Eager's TypeError for a non-integer or multi-element tensor stays (code may catch it
        # to test whether a value is int-like); a one-element integer example has no single
        # Python int under vmap.
        if self.dtype in _INDEX_DTYPES and self.numel() == 1:
            raise _python_value_error(
                "operator.index(tensor)", "an integer tensor used as a Python int calls it, "
                "e.g. range(k); " + _BY_TORCH_TENSOR)
        return torch.Tensor.__index__(self)

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

    # ``x.data`` would reach the dispatcher as the autograd engine's own detach, which cuts only
    # the wrappers' graph (Note [detach by the autograd engine]); a user's ``.data`` means
    # "no gradient at all", so it is a detach.  Assigning ``.data`` would swap the wrapper's
    # storage behind the vmap's back: refused.
    @property
    def data(self):
        return self.detach()

    @data.setter
    def data(self, new):
        raise UnsupportedUnderVmap(
            "vmap: assigning x.data = ... on a batched tensor inside a vmapped function is "
            "not supported: the batched value cannot be swapped for another tensor. Use "
            "`with torch.no_grad(): x.copy_(new)`, or compute a new tensor and return it.")


_BY_TORCH_TENSOR = ("torch.tensor([...]) of batched elements calls it too: build that tensor "
                    "with torch.stack instead")


# What a Python conversion of a batched value means, and what to do instead: the one text for
# both routes (a method of the wrapper below, and aten._local_scalar_dense's rule).
NO_PYTHON_VALUE = (
    "a batched tensor was converted to a Python number (aten._local_scalar_dense, reached by "
    ".item(), bool(tensor), int()/float(), or Python control flow such as `if x > 0:` / "
    "`while x.sum() > 1:`). Under vmap the value differs per example, so no single Python "
    "value exists. Keep the computation in tensors: replace the branch with "
    "torch.where(cond, a, b) (compute both sides), or move the control flow outside vmap. To "
    "index with a per-example integer, index with the 0-d tensor itself: x[k], not x[int(k)] "
    "or x[k.item()].")


def _python_value_error(what: str, also: str = "") -> UnsupportedUnderVmap:
    """The error of a Python conversion of a wrapper: what was called (and what else calls
    it), then NO_PYTHON_VALUE."""
    return UnsupportedUnderVmap(
        f"vmap: {what} was called on a batched tensor inside a vmapped function"
        f"{f' ({also})' if also else ''}. {NO_PYTHON_VALUE[:1].upper()}{NO_PYTHON_VALUE[1:]}")


def debug_unwrap(tensor: torch.Tensor, *, recurse: bool = True) -> torch.Tensor:
    """The physical tensor under a ``BatchedTensor``, for debugging (printing a value in a
    debugger, inspecting the batch layout).

    Inside a vmapped function every mapped tensor is a ``BatchedTensor`` that shows one
    example; this returns the tensor it wraps, batch dim included (at the physical position
    the batching rules left it, not necessarily 0).  Anything that is not a ``BatchedTensor``
    comes back unchanged (functrans's grad transforms do not wrap tensors).

    Only for debugging: computing with the result inside the vmapped function mixes examples
    (the batch dim is an ordinary dim to it) and can give wrong results.

    Args:
        tensor: a tensor seen inside a vmapped function (or any tensor).
        recurse: ``True`` (the default) unwraps every nested vmap level down to an ordinary
            tensor; ``False`` only the outermost wrapper (the innermost vmap's level), which
            under nested vmaps is itself a ``BatchedTensor`` of the enclosing vmap.

    Returns:
        The physical tensor: for one vmap of batch size ``B`` over a per-example shape ``S``,
        a tensor with ``len(S) + 1`` dims, one of them of size ``B``.

    Example:
        >>> import torch, functrans
        >>> x = torch.randn(4, 3)
        >>> seen = []
        >>> _ = functrans.vmap(lambda t: seen.append(functrans.debug_unwrap(t)) or t)(x)
        >>> seen[0] is x
        True
        >>> functrans.debug_unwrap(x) is x       # not batched: unchanged
        True
    """
    if recurse:
        return innermost(tensor)
    return tensor.value if isinstance(tensor, BatchedTensor) else tensor


def innermost(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under every level of wrappers: all the examples of every level."""
    while isinstance(t, BatchedTensor):
        t = t.value
    return t


def at_level(x, level):
    """``(physical value, bdim)`` of ``x`` at ``level``: a wrapper of that level unwrapped,
    anything else (a plain value, a wrapper of a lower level) as it is, with bdim None."""
    if type(x) is BatchedTensor and x.level is level:
        return x.value, x.bdim
    return x, None


def top_level(args, kwargs=None):
    """The innermost (highest) vmap level among the wrappers in ``args``, their lists and
    tuples, and ``kwargs``'s values; None when there is none.  Wrappers of that level are the
    ones an op unwraps; wrappers of lower levels are ordinary tensors to it."""
    level = None
    for a in args:
        t = type(a)
        if t is BatchedTensor:
            if level is None or a.level.id > level.id:
                level = a.level
        elif (t is list or t is tuple) and a:
            for b in a:
                if type(b) is BatchedTensor and (level is None or b.level.id > level.id):
                    level = b.level
    if kwargs:
        for a in kwargs.values():
            if type(a) is BatchedTensor:
                if level is None or a.level.id > level.id:
                    level = a.level
            elif type(a) in (list, tuple):
                for b in a:
                    if type(b) is BatchedTensor and (level is None or b.level.id > level.id):
                        level = b.level
    return level


# ``__torch_function__`` of the logically 0-d integer/bool wrappers: PyTorch's disabled impl
# until ``above_dispatch.install()`` sets the hook that batches ``x[k]``, ``x[k] = v``,
# ``torch.narrow(x, d, k, n)`` with such a ``k``.
_scalar_index_hook = _disabled_torch_function


def set_scalar_index_hook(hook) -> None:
    """Install ``hook(func, types, args, kwargs)`` as the ``__torch_function__`` of the wrappers
    created from now on that are logically 0-d integers or bools (see above_dispatch.py)."""
    global _scalar_index_hook
    _scalar_index_hook = hook
