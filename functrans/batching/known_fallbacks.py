"""The ATen ops that run on the loop fallback ON PURPOSE, each with the reason.

Every other op reached under vmap has a rule, a derived rule, or a decomposition (the full OpInfo
sweep lists any op that falls back and is not here).  The fallback's warning quotes the reason,
so a user who meets one knows it is deliberate.  Keys are ``str(op)`` (``aten.resize_.default``),
the names the fallback report and ``batching_rules()`` print.  Ops that DO have a rule but
decline some arguments say so in their family's docstring (e.g. group norm's non-contiguous
weights, histogram without a range) and in the fallback warning.

Only ops whose ``batching_coverage`` is 'fallback' belong here (``tests/test_registry_hygiene.py``
fails for any other entry): an op with a decomposition is not listed even when an op it
decomposes into loops (``aten.resize_as`` decomposes into ``aten.resize``, which is listed;
``aten.cudnn_batch_norm`` and its backward decompose into batched ops).

Imports: nothing (a table of reasons).
"""
from __future__ import annotations

from typing import Dict

# (The forward, aten.adaptive_max_pool3d, is not listed: vmap runs its torch._decomp
# decomposition, and only its backward, reached under vmap∘vjp, stays on the loop.)
_SEGFAULT = ("PyTorch's adaptive_max_pool3d_backward kernel crashed (segfault) on inputs with "
             "the vmap batch folded into N or C; the per-example loop is safe")
_RESIZE = ("resizes a tensor's storage in place: the examples of a batched tensor share one "
           "storage, so there is no batched resize; the loop resizes each example's slice")
_GPU_ONLY = ("CUDA/ROCm-only kernel; this machine has no GPU to test a rule against, so the "
             "loop (correct, slow) runs it")

_CUDNN_RNN = ("cuDNN's RNN kernel (packed weights, an opaque workspace for its backward): "
              "under vmap nn.RNN/LSTM/GRU run with cuDNN off, on PyTorch's native path, whose "
              "ops have rules (Note [RNN initial state] in batching/above_dispatch.py); a "
              "direct call of _cudnn_rnn reaches the loop")

_DYNAMIC = ("its output shape depends on the values of its input, so no vectorised rule can "
            "exist; each example runs on its own, and the results are stacked when their "
            "shapes agree (a clear error says so when they differ). For a batched form "
            "without the loop, use a fixed-size variant (nonzero_static(size=...), "
            "bincount(minlength=...)) or torch.where with a mask")

NO_RULE: Dict[str, str] = {
    "aten.nonzero.default": _DYNAMIC,
    "aten.bincount.default": _DYNAMIC,
    "aten.repeat_interleave.Tensor": _DYNAMIC,
    "aten._unique.default": _DYNAMIC,
    "aten._unique2.default": _DYNAMIC,
    "aten.unique_dim.default": _DYNAMIC,
    "aten.unique_consecutive.default": _DYNAMIC,
    "aten.unique_dim_consecutive.default": _DYNAMIC,
    "aten.adaptive_max_pool3d_backward.default": _SEGFAULT,
    "aten.resize_.default": _RESIZE,
    "aten.resize.default": _RESIZE,
    "aten.resize_as_.default": _RESIZE,
    "aten._cudnn_rnn.default": _CUDNN_RNN,
    "aten._cudnn_rnn_backward.default": _CUDNN_RNN,
    "aten.miopen_batch_norm.default": _GPU_ONLY,
}


def reason(op) -> str:
    """The reason ``op`` has no rule on purpose, or ''."""
    return NO_RULE.get(str(op), "")
