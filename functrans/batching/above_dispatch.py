"""The hooks that must act before ATen sees an op, and ``install()``, which sets them.

Most of vmap happens below ATen's Python bindings, in ``__torch_dispatch__``.  A few calls are
decided before any op reaches it, so no batching rule can see them:

* **A batched 0-d index** (Note [batched 0-d index]).  ``x[k]``, ``x[k] = v``,
  ``torch.narrow(x, d, k, n)`` and ``torch.tensor_split(x, k)`` with ``k`` a batched 0-d integer
  tensor: PyTorch reads ``k`` as a Python integer (``.item()``) in C++, which has no
  per-example answer.  The logically 0-d integer/bool wrappers answer ``__torch_function__``
  (see ``batched_tensor.py``); their hook, ``scalar_index_torch_function``, batches these calls.
* **An RNN's initial state** (Note [RNN initial state]).  The RNN entry points of ``torch._VF``
  decompose, in C++, into an in-place add into ``linear_hh(h0)``; an unbatched ``h0`` must be
  batched before that.
* **An RNN on CUDA** (same Note).  There ``torch._VF.lstm/gru/rnn_*`` would run cuDNN's single
  ``_cudnn_rnn`` op, which has no batching rule; under vmap they run with cuDNN disabled, so
  PyTorch takes its native path (ops with rules), as on the CPU.

* **``F.one_hot`` of batched labels** (Note [one_hot of batched labels]).  Given a tensor
  subclass, ATen's ``one_hot`` skips its range checks and compares the labels with
  ``arange(num_classes)``: an out-of-range label gave a row of zeros instead of eager's error.

``install()`` is called once by ``functrans.batching``'s ``__init__``: importing this module (or
any rules module) patches nothing.

Imports: _levels, errors, batched_tensor, guards (copied-view records), helpers.
"""
from __future__ import annotations

import torch
from torch import _VF

from .. import _levels
from ..errors import FunctransError, UnsupportedUnderVmap
from . import guards
from .batched_tensor import BatchedTensor, innermost, set_scalar_index_hook, top_level
from .helpers import normalize_dim

aten = torch.ops.aten


def install() -> None:
    """Set the hooks (idempotent)."""
    set_scalar_index_hook(scalar_index_torch_function)
    _install_initial_state_hooks()
    _install_one_hot_hook()


_GETITEM = torch._C.TensorBase.__getitem__
_SETITEM = torch._C.TensorBase.__setitem__
_disabled_torch_function = torch._C._disabled_torch_function_impl


def scalar_index_torch_function(func, types, args=(), kwargs=None):
    """``__torch_function__`` of a logically 0-d integer/bool wrapper: ``x[k]``, ``x[k] = v``,
    ``torch.narrow`` and ``torch.tensor_split`` with such a ``k`` are batched here; everything
    else runs as with torch function disabled."""
    out = NotImplemented
    if func is _GETITEM or func is _SETITEM:
        with torch._C.DisableTorchFunctionSubclass():
            if func is _GETITEM:
                out = getitem_with_batched_scalars(*args)
            else:
                out = setitem_with_batched_scalars(*args)
    elif func in _SLICING_FUNCS:
        with torch._C.DisableTorchFunctionSubclass():
            out = _slicing(func, args, kwargs or {})
    if out is not NotImplemented:
        return out
    return _disabled_torch_function(func, types, args, kwargs or {})


# Note [batched 0-d index]
# Python indexing (``x[k]``, ``x[k] = v``) with a batched 0-d integer or boolean tensor ``k``.
#
# PyTorch's ``Tensor.__getitem__``/``__setitem__`` (C++ applySlicing) treats a 0-d integer
# tensor index as a Python int: it calls ``.item()`` and selects.  Under vmap each example has
# its own value, and ``.item()`` on a batched tensor has no answer, so BatchedTensor routes
# those two calls here (through ``__torch_function__``, enabled only on logically 0-d
# integer/bool wrappers, see batched_tensor.py).  A select by a per-example integer is an
# ``aten.index`` by a 0-d index tensor at that dim: its broadcast index shape is (), so the
# result is the select, wherever PyTorch would place the (empty) index block.  All batched
# scalars are applied first, in one ``aten.index``; the rest of the index then applies to the
# remaining dims exactly as it would after eager's selects (ints count as specified dims for an
# Ellipsis, as the removed dims do).  Writes read, update and write back the selected slab.
# ---------------------------------------------------------------------------------------------

_SCALAR_INDEX_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64,
                                  torch.uint16, torch.uint32, torch.uint64})
_SCALAR_MASK_DTYPES = frozenset({torch.bool, torch.uint8})


def _batched_scalar(e) -> bool:
    return type(e) is BatchedTensor and e.dim() == 0 and \
        (e.dtype in _SCALAR_INDEX_DTYPES or e.dtype in _SCALAR_MASK_DTYPES)


def _dims_consumed(e) -> int:
    """How many dims of the indexed tensor one index entry consumes (None/Ellipsis: 0)."""
    if e is None or e is Ellipsis or type(e) is bool:
        return 0
    if isinstance(e, torch.Tensor):
        return e.dim() if e.dtype in _SCALAR_MASK_DTYPES else 1
    if isinstance(e, (list, tuple)):
        try:
            t = torch.as_tensor(e)
        except Exception:
            return 1
        return t.dim() if t.dtype == torch.bool else 1
    return 1


def _scalar_mask_error(what):
    return UnsupportedUnderVmap(
        f"vmap: {what} with a batched 0-d boolean tensor: PyTorch treats a 0-d bool index as "
        "'add a dim of size 1 if True, of size 0 if False', so the per-example results would "
        "have different shapes and cannot be stacked into one batched tensor. Use "
        "torch.where(mask, x, other) (or x * mask) to choose values by the mask, and "
        "x[mask] = value (alone, as the whole index) or torch.where(mask, value, x) to write.")


def _split_scalar_index(x, index):
    """(the [None, ..., k, ...] index list of the batched 0-d integer entries, the rest of the
    index as a tuple), or None when ``index`` has no batched 0-d integer/bool entry."""
    entries = index if type(index) is tuple else (index,)
    if not any(_batched_scalar(e) for e in entries):
        return None
    n = x.dim()
    consumed = [_dims_consumed(e) for e in entries]
    ellipses = sum(e is Ellipsis for e in entries)
    if ellipses > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    specified = sum(consumed)
    if specified > n:
        raise IndexError(f"too many indices for tensor of dimension {n}")
    picks, rest, d = [], [], 0
    for e, c in zip(entries, consumed):
        if _batched_scalar(e):
            if e.dtype in _SCALAR_MASK_DTYPES:
                return e, None  # a 0-d mask: the callers decide
            picks.append((d, e if e.dtype in (torch.int64, torch.int32) else e.long()))
        else:
            rest.append(e)
        d += (n - specified) if e is Ellipsis else c
    indices = [None] * (picks[-1][0] + 1)
    for d, k in picks:
        indices[d] = k
    return indices, tuple(rest)


def getitem_with_batched_scalars(x, index):
    """``x[index]`` when ``index`` holds a batched 0-d integer tensor; NotImplemented when it
    holds none."""
    split = _split_scalar_index(x, index)
    if split is None:
        return NotImplemented
    indices, rest = split
    if rest is None:
        raise _scalar_mask_error("x[mask] (indexing)")
    out = aten.index.Tensor(x, indices)
    return out[rest] if rest else out


def setitem_with_batched_scalars(x, index, value):
    """``x[index] = value`` when ``index`` holds a batched 0-d integer tensor (or is one
    batched 0-d bool mask); NotImplemented when it holds none."""
    split = _split_scalar_index(x, index)
    if split is None:
        return NotImplemented
    indices, rest = split
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value, dtype=x.dtype, device=x.device)
    elif value.dtype != x.dtype:
        value = value.to(x.dtype)  # as eager's select-and-copy_ does
    if rest is None:  # a 0-d bool mask
        if not (type(index) is not tuple or len(index) == 1):
            raise _scalar_mask_error("x[..., mask, ...] = value (assignment mixing it with "
                                     "other indices)")
        while value.dim() > x.dim() and value.shape[0] == 1:
            value = value.squeeze(0)  # eager's x[mask] has a leading dim of size 1
        x.copy_(torch.where(indices, value, x))
        return None
    if not rest:
        aten.index_put_.default(x, indices, value)
        return None
    slab = aten.index.Tensor(x, indices)
    slab[rest] = value
    aten.index_put_.default(x, indices, slab)
    return None


# Slicing with a batched 0-d tensor argument (the second half of Note [batched 0-d index]):
#
# Slicing with per-example tensor arguments: ``narrow`` with a batched 0-d ``start`` and
# ``tensor_split`` with batched split points.
#
# Both ops are CompositeImplicitAutograd: ATen turns the tensor argument into a Python integer
# (``start.item()``, or a raw read of the index tensor's data) before anything reaches
# ``__torch_dispatch__``, so no batching rule can see them.  A logically 0-d integer
# BatchedTensor answers ``__torch_function__`` (see ``batched_tensor.py``), and sends these two
# calls here first (a 1-D tensor of split points has no such hook, which would slow every op on
# batched integer vectors: ATen's raw read of its memory fails, and ``vmap`` turns that failure
# into a clear error, see ``api._raw_data_error``):
#
# * ``torch.narrow(x, dim, start, length)`` with a batched 0-d ``start``: every example keeps
#   ``length`` elements, so the result has one shape; it is ``index_select`` of
#   ``start + arange(length)`` (after wrapping a negative start), batched by the indexing rules.
#   Each example starts at its own offset, so the result cannot be a view of ``x``: it is a copy,
#   recorded by ``guards.record_copy`` so that an in-place write into it (or into ``x``) while
#   it lives
#   raises instead of silently not reaching the other tensor.  Out-of-range starts raise eager's
#   error (checked once on all the examples' starts).
# * ``torch.tensor_split(x, sections)`` with a batched 0-d ``sections``: the pieces' shapes
#   depend on each example's values, so they cannot be stacked: a clear error says so and what to
#   do (an unbatched tensor or a Python list of split points batches fine).

_NARROW = (torch.narrow, torch.Tensor.narrow)
_TENSOR_SPLIT = (torch.tensor_split, torch.Tensor.tensor_split)
_SLICING_FUNCS = frozenset(_NARROW + _TENSOR_SPLIT)
_INT_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


def _is_batched(t) -> bool:
    return type(t) is BatchedTensor


def _bind(params, args, kwargs):
    """The call's arguments by name (positional first, then keywords), or None if the call's
    shape is not one we know (then the default path runs and reports its own error)."""
    bound = dict(zip(params, args))
    for k, v in kwargs.items():
        if k in bound or k not in params:
            return None
        bound[k] = v
    return bound


def _slicing(func, args, kwargs):
    """``torch.narrow`` / ``torch.tensor_split`` with a batched 0-d tensor argument;
    NotImplemented for every call that is not one of ours."""
    if func in _NARROW:
        b = _bind(("input", "dim", "start", "length"), args, kwargs)
        if b is not None and len(b) == 4 and _is_batched(b["start"]) and \
                b["start"].dim() == 0 and b["start"].dtype in _INT_DTYPES:
            return narrow_with_batched_start(b["input"], b["dim"], b["start"], b["length"])
    elif func in _TENSOR_SPLIT:
        b = _bind(("input", "indices_or_sections", "dim"), args, kwargs)
        if b is None:
            b = _bind(("input", "tensor_indices_or_sections", "dim"), args, kwargs)
        if b is not None:
            split = b.get("indices_or_sections", b.get("tensor_indices_or_sections"))
            if _is_batched(split):
                raise _tensor_split_error(split)
    return NotImplemented


def narrow_with_batched_start(x: torch.Tensor, dim: int, start: torch.Tensor,
                              length: int) -> torch.Tensor:
    if x.dim() == 0:
        raise RuntimeError("narrow() cannot be applied to a 0-dim tensor.")
    d = normalize_dim(dim, x.dim())
    size = x.shape[d]
    length = int(length)
    if length < 0:
        raise RuntimeError("narrow(): length must be non-negative.")
    # One check over every example's start (eager reads start.item() too: a host sync).
    starts = innermost(start)
    bad = (starts < -size) | (starts > size) | (torch.where(starts < 0, starts + size, starts)
                                                 + length > size)
    if bool(bad.any()):
        raise IndexError(
            f"narrow(): for some example of the vmapped start tensor, start (in "
            f"[{int(starts.min())}, {int(starts.max())}] over the batch) + length ({length}) "
            f"exceeds dimension size ({size}), or start is out of range [{-size}, {size}].")
    begin = torch.where(start < 0, start + size, start).to(torch.long)
    index = begin.unsqueeze(0) + torch.arange(length, device=x.device)
    out = torch.index_select(x, d, index)
    guards.record_copy(out, x, guards.NARROW)
    return out


def _tensor_split_error(split: torch.Tensor) -> UnsupportedUnderVmap:
    what = "number of sections" if split.dim() == 0 else "split indices"
    return UnsupportedUnderVmap(
        f"vmap: torch.tensor_split was given its {what} as a tensor that is batched (it "
        "differs per example), so the pieces' shapes would differ per example and could not "
        "be stacked into batched tensors. Pass the split points as a Python list/int or as a "
        "tensor that is not mapped over (in_dims=None for it, or created inside the "
        "function), or use a fixed-shape formulation (e.g. masks built with torch.arange).")


# Note [RNN initial state]
# The CompositeImplicitAutograd RNN entry points (and nn.LSTM off the mkldnn path: float64,
# proj_size) decompose into C++ that adds the input gates IN PLACE into ``linear_hh(h0)``.  With
# an unbatched ``h0`` (nn.GRU / nn.RNN / the cells create zeros when none is given) that is a
# batched write into an unbatched temporary, which vmap must refuse.  So the state must be made
# batched BEFORE the entry point decomposes, i.e. above the dispatcher.  A TorchFunctionMode
# would do it but costs every op under vmap about 1.6 us (+19% measured on a chain of sin); the
# nn modules call these entry points through ``torch._VF``, so functrans wraps those eight
# attributes of ``torch._VF`` instead (``install()``, called by ``functrans.batching``'s
# ``__init__``).  A wrapper
# costs one thread-local lookup per RNN call outside vmap and changes nothing there; inside vmap
# it batches the state when another argument is batched.  Direct calls of ``torch.gru``,
# ``torch.lstm_cell``... (not through torch._VF) are not hooked.
#
# The same wrapper picks the path of a full-sequence entry point (lstm, gru, rnn_tanh, rnn_relu)
# on CUDA.  There, with cuDNN enabled, PyTorch runs the whole RNN as ONE op, ``_cudnn_rnn``
# (``_miopen_rnn`` on ROCm, under the same flag), tagged random because it takes a dropout state
# even with dropout=0, and with no batching rule: vmap(grad) of nn.LSTM/nn.GRU failed on an
# H200.  So when such a call is under vmap with a batched argument (``top_level``, as above)
# and any tensor argument is on a CUDA device, it runs with cuDNN disabled for its duration
# (``_cudnn_disabled``): PyTorch then takes its native path, which decomposes into
# linear/matmul, the fused CUDA cell kernels (``_thnn_fused_lstm_cell`` / ``_gru_cell``) and
# pointwise ops, all with rules; that is the decomposition the CPU tests already exercise
# (bar the cell kernels, whose rules are in rules/rnn.py).  Why not a ``_cudnn_rnn`` rule
# instead: its weights come as cuDNN's packed, layout-specific flat buffer (``weight_buf``,
# ``weight_stride0``), its reserve/workspace output is opaque and feeds
# ``_cudnn_rnn_backward``, and batched weights (ensembles) have no cuDNN layout at all; a rule
# would have to re-derive all of it and could not be tested without a GPU, whereas the native
# path needs nothing new.  Outside vmap, with nothing batched, or on the CPU, nothing changes.
#
# Only the ``enabled`` flag is touched (saved, cleared, restored on exit, exception or not),
# through ``torch._C`` rather than ``torch.backends.cudnn.flags(enabled=False, ...)``: ``flags()``
# re-sets every flag, and its first step reads ``allow_tf32``, which RAISES when the cuDNN conv
# and RNN TF32 precisions differ (``torch.backends.cudnn.conv.fp32_precision = ...``, torch
# 2.11 and 2.13), so it would break a legitimate setting; here ``benchmark``,
# ``benchmark_limit``, ``deterministic``, the TF32 / fp32_precision settings and
# ``depthwise_kernel`` are never written.  Caveat, thread safety: the cuDNN flags are
# process-global, not thread-local.  While a vmapped RNN runs on CUDA, other threads' cuDNN ops
# (convolutions, RNNs) also run without cuDNN (slower, possibly slightly different values), and
# two threads that overlap such calls can restore in the wrong order and leave cuDNN disabled
# (A saves True, B saves False, A restores True, B restores False).  ``torch.backends.cudnn
# .flags`` has the same limits.  Single-threaded use, the common case, is exact.
RNN_ENTRY_POINTS = frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell",
                              "rnn_tanh_cell", "rnn_relu_cell"})
FULL_SEQUENCE_ENTRY_POINTS = frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu"})


def _batched_like(h, level):
    """``h`` made batched at ``level`` (``h + zeros``, so autograd still reaches ``h``)."""
    if isinstance(h, BatchedTensor) and h.level is level:
        return h
    zeros = torch.zeros((level.batch_size,) + tuple(h.shape), dtype=h.dtype, device=h.device)
    return h + BatchedTensor(zeros, 0, level)


def _live_level(args):
    level = top_level(args)
    return level if level is not None and level.alive else None


def batch_initial_state(name, args, level=None):
    """``args`` of the RNN entry point ``name`` with its hidden state batched whenever another
    argument is batched (at ``level``, the args' live top level, found when not given); None
    when nothing needs to change."""
    if name not in RNN_ENTRY_POINTS or len(args) < 3:
        return None
    level = level or _live_level(args)
    if level is None:
        return None
    if name.endswith("_cell") or isinstance(args[1], (list, tuple)) or \
            (name != "lstm" and isinstance(args[2], (list, tuple))):
        pos = 1          # (input, hx, ...)
    else:
        pos = 2          # the packed overloads: (data, batch_sizes, hx, ...)
    hx = args[pos]
    if isinstance(hx, (list, tuple)):
        new = type(hx)(_batched_like(h, level) for h in hx)
    elif isinstance(hx, torch.Tensor):
        new = _batched_like(hx, level)
    else:
        return None
    return tuple(args[:pos]) + (new,) + tuple(args[pos + 1:])


def _on_cuda(args) -> bool:
    """Whether a tensor among ``args`` (or in their lists/tuples) is on a CUDA device."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.is_cuda:
                return True
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor) and b.is_cuda:
                    return True
    return False


def needs_native_path(name, args, level=None) -> bool:
    """Whether the RNN entry point ``name`` must run with cuDNN disabled: a full-sequence entry
    point under vmap with a batched argument (``level``, found when not given) and a tensor on
    CUDA (Note [RNN initial state])."""
    if name not in FULL_SEQUENCE_ENTRY_POINTS:
        return False
    return (level or _live_level(args)) is not None and _on_cuda(args)


class _cudnn_disabled:
    """cuDNN's ``enabled`` flag cleared for a ``with`` block, every other flag untouched
    (process-global: see the thread-safety caveat in Note [RNN initial state])."""

    def __enter__(self):
        self.saved = torch._C._get_cudnn_enabled()
        torch._C._set_cudnn_enabled(False)

    def __exit__(self, *exc):
        torch._C._set_cudnn_enabled(self.saved)
        return False


def hook_rnn_entry_point(name, original):
    """``original`` (the ``torch._VF`` entry point ``name``) wrapped as Note [RNN initial state]
    says: the initial state batched, and cuDNN disabled when ``needs_native_path``."""

    def hooked(*args, **kwargs):
        level = _live_level(args) if _levels.stack() else None
        if level is not None:
            native = needs_native_path(name, args, level)
            new = batch_initial_state(name, args, level)
            if new is not None:
                args = new
            if native:
                with _cudnn_disabled():
                    return original(*args, **kwargs)
        return original(*args, **kwargs)

    hooked._functrans_initial_state_hook = True
    hooked.__name__ = name
    return hooked


def _install_initial_state_hooks() -> None:
    """Wrap the RNN entry points of ``torch._VF``: see Note [RNN initial state]."""
    for name in RNN_ENTRY_POINTS:
        current = getattr(_VF, name)
        if getattr(current, "_functrans_initial_state_hook", False):
            continue
        setattr(_VF, name, hook_rnn_entry_point(name, current))


# Note [one_hot of batched labels]
# ``torch.nn.functional.one_hot`` is CompositeImplicitAutograd: it decomposes in C++ before any
# op reaches the dispatcher.  For a plain tensor it checks the labels (``min() >= 0``, ``max() <
# num_classes``, or infers ``num_classes = max() + 1``); for a tensor subclass such as a vmap
# wrapper it skips the checks and compares the labels with ``arange(num_classes)``, so an
# out-of-range label gives a row of zeros: a silent wrong answer (the reference library gives
# the same zeros).  So ``install()`` wraps ``F.one_hot``: with batched labels it checks every
# example's labels with one ``aminmax`` over the physical tensor (all examples of every level)
# and raises eager's error, naming the offending label and num_classes; on CUDA the check is
# ``torch._assert_async`` (no host sync; the error surfaces as a device-side assert, as eager's
# CUDA one_hot does).  ``num_classes=-1`` infers the class count from the labels, a different
# count (output shape) per example, so it is refused with a message asking for num_classes, as
# the reference library refuses it.  Plain labels (and everything outside vmap) go to PyTorch's
# own one_hot untouched.  A name bound before functrans was imported
# (``from torch.nn.functional import one_hot``) is not hooked.
def _checked_one_hot(original):
    def one_hot(tensor, num_classes=-1):
        if type(tensor) is BatchedTensor and tensor.dtype is torch.int64:
            _check_labels(tensor, num_classes)
        return original(tensor, num_classes)

    one_hot._functrans_one_hot_hook = True
    one_hot.__doc__ = original.__doc__
    return one_hot


def _check_labels(tensor, num_classes) -> None:
    if num_classes < 0:
        raise UnsupportedUnderVmap(
            f"vmap: F.one_hot(labels, num_classes={num_classes}) infers the number of classes "
            "from the largest label, which differs per example: the output's shape would "
            "depend on the data. Pass num_classes explicitly (the number of classes of your "
            "task), e.g. F.one_hot(labels, num_classes=10).")
    labels = innermost(tensor)
    if labels.numel() == 0:
        return
    lo, hi = torch.aminmax(labels)
    if labels.is_cuda:
        torch._assert_async((lo >= 0) & (hi < num_classes),
                            "F.one_hot under vmap: class values must be in [0, num_classes)")
        return
    lo, hi = lo.item(), hi.item()
    if lo < 0:
        raise FunctransError(
            f"Class values must be non-negative. F.one_hot(labels, num_classes={num_classes}) "
            f"under vmap got the label {lo}; labels must lie in [0, {num_classes}).")
    if hi >= num_classes:
        raise FunctransError(
            f"Class values must be smaller than num_classes. F.one_hot(labels, "
            f"num_classes={num_classes}) under vmap got the label {hi}; labels must lie in "
            f"[0, {num_classes}): pass a larger num_classes or fix the labels.")


def _install_one_hot_hook() -> None:
    """Wrap ``torch.nn.functional.one_hot``: see Note [one_hot of batched labels]."""
    import torch.nn.functional as F
    if not getattr(F.one_hot, "_functrans_one_hot_hook", False):
        F.one_hot = _checked_one_hot(F.one_hot)
