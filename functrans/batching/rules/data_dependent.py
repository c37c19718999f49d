"""Data-dependent ops under vmap: what batches, and the errors that say what to do.

* ``.item()`` / ``bool()`` / ``int()`` / Python control flow on a batched value all reach
  ``aten._local_scalar_dense``: one Python value cannot stand for a whole batch (an error);
* ops tagged ``data_dependent_output`` that return Python values: an error, except
  ``equal``, answered when every example gives the same answer (``equal_rule``; the same
  reasoning as Note [a branch every example takes the same way] in ``batched_tensor.py``);
* ops whose output shape depends on the data (``nonzero``, ``bincount``, ``unique*``,
  ``repeat_interleave`` with tensor repeats, ``masked_select`` with a batched mask, and the ops
  tagged ``dynamic_output_shape`` whose shape is static in practice: ``linalg_lstsq``,
  ``_ctc_loss``) have no vectorised rule.  They run per example on the loop fallback, which
  checks that every example's result has the same shape and stacks them; when the shapes
  differ it raises ``fallback.ragged_results_error`` (the op, the shapes, and the fix: pad/mask,
  ``size=``, or ``torch.nested`` outside vmap).  Being loops, they warn (a
  ``PerformanceWarning`` quoting ``known_fallbacks``' reason) and ``strict_fallback()``
  refuses them, like any loop: strict mode promises no per-example loop ran.
  The shape is never guessed from the op's tag or from the ops inside a decomposition.

Rules here: ``nonzero_static`` (its output shape is fixed by ``size``) and ``masked_select``
with an unbatched mask (``torch.combinations`` reaches it this way): the number of selected
elements is the same for every example, so it is one boolean index over the batch.
"""
from __future__ import annotations

import torch

from ...errors import UnsupportedUnderVmap
from ..batched_tensor import NO_PYTHON_VALUE, BatchedTensor
from ..helpers import move_bdim_to_front
from ..registry import Decline, register_tag_rule, registrar

aten = torch.ops.aten
register_batch_rule = registrar("data_dependent")   # the rules below live in this file


@register_batch_rule(aten._local_scalar_dense.default)
def local_scalar_dense_rule(info, in_dims, x):
    raise UnsupportedUnderVmap("vmap: " + NO_PYTHON_VALUE)


def dynamic_shape_error(op) -> UnsupportedUnderVmap:
    return UnsupportedUnderVmap(
        f"vmap: {op} returns a tensor whose shape depends on the values of its input, so "
        "the per-example results could have different shapes and cannot be stacked into one "
        "batched tensor. Use a fixed-shape formulation instead: torch.where(mask, x, 0) "
        "instead of x[mask] / masked_select, a mask multiplied in instead of nonzero(), "
        "or pad to a known size (e.g. nonzero_static / torch.unique(..., sorted) outside "
        "vmap).")


def _data_dependent_rule_for(op):
    if op == aten._local_scalar_dense.default:
        return None
    if all(r.type.kind() == torch._C.TensorType.get().kind() for r in op._schema.returns):
        return None  # returns tensors: an ordinary rule or the fallback can batch it
    def rule(info, in_dims, *args, **kwargs):
        raise UnsupportedUnderVmap(
            f"vmap: {op} returns a Python value computed from the data of a batched tensor; "
            "under vmap the value differs per example, so it cannot be one Python value. "
            "Compare with tensor ops instead (e.g. (a == b).all(dim) or torch.isclose) and "
            "keep the result as a tensor.")
    rule.__name__ = f"data_dependent_error[{op}]"
    return rule


register_tag_rule(torch.Tag.data_dependent_output, _data_dependent_rule_for,
                  family="data_dependent")


@register_batch_rule(aten.nonzero_static.default)
def nonzero_static_rule(info, in_dims, x, *, size, fill_value=-1):
    """``nonzero_static`` has a fixed output shape [size, ndim], so it batches: each example's
    nonzero positions in row-major order (a stable sort puts them first), cut or padded to
    ``size`` with ``fill_value``."""
    y = x.movedim(in_dims[0], 0)
    B, shape = y.shape[0], y.shape[1:]
    mask = (y != 0).reshape(B, -1)
    k = min(size, mask.shape[1])
    flat = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices[:, :k]
    coords = []
    for n in reversed(shape):
        coords.append(flat % n)
        flat = torch.div(flat, n, rounding_mode="floor")
    out = torch.stack(coords[::-1], -1) if coords else flat.new_zeros((B, k, 0))
    valid = torch.arange(k, device=x.device) < mask.sum(1, keepdim=True)
    out = torch.where(valid.unsqueeze(-1), out, fill_value)
    if size > k:
        out = torch.cat([out, out.new_full((B, size - k, len(shape)), fill_value)], 1)
    return out, 0


@register_batch_rule(aten.masked_select.default)
def masked_select_rule(info, in_dims, x, mask):
    """An unbatched mask selects the same positions of every example: one boolean index over
    the batch (both broadcast to their common logical shape first, as eager does).  A batched
    mask may select a different number per example: declined to the loop, which checks."""
    if in_dims[1] is not None or in_dims[0] is None or type(mask) is BatchedTensor:
        raise Decline()   # (a lower level's batched mask: batched there, so ragged too)
    X = move_bdim_to_front(x, in_dims[0])
    shape = torch.broadcast_shapes(X.shape[1:], mask.shape)
    X = X.reshape(X.shape[:1] + (1,) * (len(shape) - (X.dim() - 1)) + X.shape[1:])
    X = X.expand(X.shape[0], *shape)
    return X[:, mask.expand(shape)], 0


def _bool_of(flags: torch.Tensor, value: bool) -> bool:
    """Whether every element of ``flags`` (this level's per-example answers, possibly batched
    at lower levels) equals ``value``: itself a ``torch.equal``, so a lower level answers it
    by this same rule."""
    target = torch.full_like(flags, value)
    return bool(torch.equal(flags, target))


@register_batch_rule(aten.equal.default)
def equal_rule(info, in_dims, a, b):
    """``torch.equal`` (tagged ``data_dependent_output``) is answered when every example gives
    the same answer: that Python bool is then each example's own answer, so code branching on
    it does what a loop would (the same reasoning as ``bool()`` of a batched value).  When the
    examples disagree it raises.  ATen's own checks use it (``is_scalar_tensor_true``:
    ``torch.cov``'s weight checks and its ``norm_factor <= 0`` branch), so those run."""
    from ..helpers import ensure_bdim_front
    la = a.shape[:in_dims[0]] + a.shape[in_dims[0] + 1:] if in_dims[0] is not None else a.shape
    lb = b.shape[:in_dims[1]] + b.shape[in_dims[1] + 1:] if in_dims[1] is not None else b.shape
    if la != lb:
        return False, None  # the logical shapes differ: False for every example
    n = info.batch_size
    pa = ensure_bdim_front(a, in_dims[0], n).reshape(n, -1)
    pb = ensure_bdim_front(b, in_dims[1], n).reshape(n, -1)
    per_example = (pa == pb).all(1)
    if _bool_of(per_example, True):
        return True, None
    if _bool_of(per_example, False):
        return False, None
    raise UnsupportedUnderVmap(
        "vmap: torch.equal (aten.equal, also used by PyTorch's own checks such as "
        "torch.cov's) gives True for some examples and False for others, and one Python bool "
        "cannot stand for both. Compare with tensor ops instead and keep the result as a "
        "tensor: (a == b).all(), then torch.where(...) on it; for torch.cov, make every "
        "example's weights pass the same checks (non-negative, non-zero sum) and its "
        "degrees of freedom (sum of weights - correction) either all positive or all <= 0.")
