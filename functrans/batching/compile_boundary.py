"""``torch.compile`` inside functrans's transforms: where a compiled function runs eagerly, once
said, and never half-traced.

What happens without this module (measured on torch 2.13): dynamo refuses to compile a frame
while a non-infra ``TorchDispatchMode`` whose ``ignore_compile_internals()`` is False is on the
dispatch stack (``torch/_dynamo/convert_frame.py``, ``any_torch_dispatch_mode_on_stack``).  Under
``functrans.vmap`` the level's ``VmapLevelMode`` is on that stack, so the user's compiled frame is
skipped and runs eagerly: the numbers are right.  But a skip is not recursive, and inside
``__torch_dispatch__`` the mode is popped: every Python frame the engine runs for an op (the
mode, ``dispatch``, the rules, ``BatchedTensor.__new__``) was handed to dynamo and compiled in
fragments, 10-50 graph breaks for a three-line function ("missing tp_iter" over op schemas,
``_make_wrapper_subclass``, ``OpOverload.name``), all of it eager in the end and slower.

What this module does (``install()``, called by ``functrans/batching/__init__.py``):

1. The engine's entry points called from C++ (``VmapLevelMode.__torch_dispatch__``,
   ``BatchedTensor.__torch_dispatch__``, the functionalization boundary mode, the 0-d index
   ``__torch_function__`` hook) get dynamo's recursive SKIP frame strategy
   (``torch._C._dynamo.eval_frame.set_code_exec_strategy``): dynamo never converts a frame run
   below them.  No cost per op: the strategy is a flag on the code object, read only while a
   compiled function's callback is active.
2. ``VmapLevelMode.ignore_compile_internals`` (dynamo's extension point for "may torch.compile
   trace while this mode is active?") answers False, as before, and the first time dynamo asks
   it during one vmap call (that is: a compiled function was entered under that vmap) it warns
   once with a ``functrans.CompileWarning`` saying the function runs eagerly and why; except
   below torch's control-flow front-ends (``torch.cond`` and the others of
   ``torch/_higher_order_ops/`` compile their operator call internally: the user compiled
   nothing, and ``control_flow.py`` runs the operator).
   Dynamo marks a frame it skipped for a dispatch mode as skipped for good (its default
   ``ConvertFrameReturn``: SKIP, applied to the code): one call under a vmap left the function
   uncompiled everywhere after, until ``torch._dynamo.reset()``.  So the code objects dynamo was
   converting when it asked are noted, and their frame strategy is set back to DEFAULT when the
   vmap's mode exits (``VmapLevelMode.__exit__``, wrapped here): the function compiles again
   outside the vmap.
3. ``vjp_fn`` under a vmap (``vmap(vjp_fn)(basis)``, and ``jacrev``, which is that) retries
   eagerly (``retry_eagerly``, called by ``autodiff/vjp.py``) when a compiled function's
   AOTAutograd backward refused the batched cotangents: the forward ran outside the vmap, so it
   was compiled for plain tangents, and a compiled backward cannot take ``BatchedTensor``s.  The
   retry records the forward again under ``torch.compiler.set_stance("force_eager")``, after one
   warning, and pulls the cotangents back through that graph.

``grad``, ``vjp`` and ``jvp`` without a vmap need nothing: their tensors are plain, dynamo
compiles the function (one graph, no break) and AOTAutograd differentiates it.

Why the compiled function is not traced through functrans's rules (the ``__tensor_flatten__``
route): with ``__tensor_flatten__`` on ``BatchedTensor`` and ``ignore_compile_internals`` True,
``vmap``, ``vmap(vmap)`` and ``vmap(grad)`` of a compiled function compiled into one graph of
physical ops with the right values.  But dynamo pops every dispatch mode while it traces and
puts them back for the compiled artifact's run, so (a) a tensor-less random op
(``torch.randn(3)``) never meets the level's randomness at trace time and meets it again at run
time inside the graph (a ``BatchedTensor`` leaked out of the vmap for ``randomness='different'``;
under ``'error'`` inductor would draw silently instead of raising); (b) ``grad(vmap(compiled))``
(autograd on the physical values, the wrappers do not require grad) compiled an inference graph
and gave a wrong gradient; (c) ``vmap(jvp(compiled))`` gave wrong tangents; (d) ``jacrev``'s
batched cotangents hit the backward above.  Each needs a sound guard at trace time (the mode's
behaviour during dynamo's trace, the inner values' requires_grad, forward-AD duals), which
dynamo does not offer today; until then the eager route is the correct one.

Imports: _levels, errors, batched_tensor, mode, above_dispatch, functionalization.
"""
from __future__ import annotations

import sys
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _levels
from .. import functionalization as _functionalization
from ..errors import CompileWarning
from .above_dispatch import scalar_index_torch_function
from .batched_tensor import BatchedTensor
from .mode import VmapLevelMode

_ENTER_CODE = TorchDispatchMode.__enter__.__code__
# AOTAutograd's message when a backward receives a tensor subclass where the traced forward
# saw a plain tensor (torch/_functorch/_aot_autograd/runtime_wrappers.py).
_BATCHED_TANGENT = "we guessed its metadata incorrectly"
# torch.cond, while_loop, scan, associative_scan and map run their operator inside an internal
# torch.compile (these functions of torch/_higher_order_ops/ call it); dynamo skips it under a
# vmap, with no loss: control_flow.py runs the operator.
_HOP_FRONT_ENDS = ("_hop_compile_and_call", "_maybe_compile_and_run_fn", "cond", "while_loop")
_warned_level_id = [0]   # the last vmap level warned about: one warning per vmap call
_skipped_codes = []      # codes dynamo skipped under a vmap: unmarked when the vmap's mode exits
_frames = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
_set_strategy = getattr(_frames, "set_code_exec_strategy", None)
if not hasattr(_frames, "_FrameExecStrategy"):
    _set_strategy = None


def _entry_points():
    return (VmapLevelMode.__torch_dispatch__, BatchedTensor.__torch_dispatch__.__func__,
            _functionalization._BoundaryMode.__torch_dispatch__, scalar_index_torch_function)


def install() -> None:
    """Skip the engine's entry points recursively in dynamo, and answer dynamo's question of
    the vmap mode (see the module docstring).  Idempotent; does nothing where this torch has
    no frame strategy API (its dynamo then converts the engine's frames as before)."""
    VmapLevelMode.ignore_compile_internals = classmethod(_compile_refused)
    if _set_strategy is None:
        return
    skip = _frames._FrameAction.SKIP
    for fn in _entry_points():
        _set_strategy(fn.__code__, _frames._FrameExecStrategy(skip, skip))
    if "__exit__" not in VmapLevelMode.__dict__:
        VmapLevelMode.__exit__ = _exit_and_unmark


_mode_exit = VmapLevelMode.__exit__


def skip_recursively(fn) -> None:
    """Dynamo never converts ``fn``'s frames, nor any frame run below them (as for the engine's
    entry points).  Does nothing where this torch has no frame strategy API."""
    if _set_strategy is not None:
        skip = _frames._FrameAction.SKIP
        _set_strategy(fn.__code__, _frames._FrameExecStrategy(skip, skip))


def unmark(codes) -> None:
    """Give ``codes`` back dynamo's default frame strategy (dynamo marks a frame it skipped for
    a dispatch mode as skipped for good; see the module docstring, 2.)."""
    if _set_strategy is not None:
        default = _frames._FrameAction.DEFAULT
        for code in codes:
            _set_strategy(code, _frames._FrameExecStrategy(default, default))


def _exit_and_unmark(self, exc_type, exc_val, exc_tb):
    """``VmapLevelMode.__exit__``: the mode's own exit, then the codes dynamo skipped under it
    get back the default frame strategy (see the module docstring, 2.)."""
    try:
        return _mode_exit(self, exc_type, exc_val, exc_tb)
    finally:
        if _skipped_codes:
            default = _frames._FrameAction.DEFAULT
            while _skipped_codes:
                _set_strategy(_skipped_codes.pop(), _frames._FrameExecStrategy(default, default))


def _converting_code():
    """The code object of the frame dynamo is converting (a local ``frame`` of its callback,
    beside ``frame_state``), or None where this dynamo's callback looks different."""
    f = sys._getframe(2)
    while f is not None:
        local = f.f_locals
        frame = local.get("frame")
        if "frame_state" in local and hasattr(frame, "f_code"):
            return frame.f_code
        f = f.f_back
    return None


def _under_control_flow_front_end() -> bool:
    """Is dynamo asking from inside torch's own compile of a control-flow operator's call?"""
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        if code.co_name in _HOP_FRONT_ENDS and \
                "torch/_higher_order_ops/" in code.co_filename.replace("\\", "/"):
            return True
        f = f.f_back
    return False


def _compile_refused(cls) -> bool:
    """``VmapLevelMode.ignore_compile_internals``: always False (dynamo must not trace while a
    vmap level is active); warns once per vmap call when dynamo asks while converting a frame,
    i.e. when a compiled function was called under the vmap.  ``TorchDispatchMode.__enter__``
    asks too, on every vmap call: that question is answered silently."""
    if sys._getframe(1).f_code is _ENTER_CODE:
        return False
    code = _converting_code() if _set_strategy is not None else None
    if code is not None:
        _skipped_codes.append(code)
    if _under_control_flow_front_end():
        return False   # torch.cond & co compiled their own call: the user compiled nothing
    level = next((lv for lv in reversed(_levels.stack()) if lv.kind == "vmap"), None)
    if level is not None and level.id != _warned_level_id[0]:
        _warned_level_id[0] = level.id
        name = f" ({code.co_name})" if code is not None else ""
        message = (
            f"a torch.compile'd function{name} was called inside functrans.vmap (or a "
            "transform built on it: jacrev, jacfwd, hessian, vmap of grad): it runs eagerly, "
            "through functrans's batching rules, with the right result. Dynamo cannot trace "
            "while a vmap level's dispatch mode is active. To compile, put torch.compile "
            "outside: torch.compile(functrans.vmap(f)), or use "
            "functrans.compile(functrans.vmap(f)).")
        if code is not None:   # point at the compiled function, not at dynamo's internals
            warnings.warn_explicit(message, CompileWarning, code.co_filename,
                                   code.co_firstlineno)
        else:
            warnings.warn(message, CompileWarning, stacklevel=2)
    return False


def is_batched_tangent_refusal(error: BaseException) -> bool:
    """Did a compiled function's backward refuse batched cotangents (see the docstring)?"""
    return isinstance(error, RuntimeError) and _BATCHED_TANGENT in " ".join(str(error).split())


def retry_eagerly(call, error: BaseException, api: str):
    """Run ``call()`` again with every torch.compile'd function eager, after one warning; re-
    raise ``error`` where that cannot be done (inside a torch.compile trace, or a torch without
    ``torch.compiler.set_stance``)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None or torch.compiler.is_compiling():
        raise error
    warnings.warn(
        f"{api}: a torch.compile'd function inside it was compiled for one cotangent, but a "
        "batch of cotangents (jacrev, or a vmap of vjp_fn) reached its backward, which a "
        "compiled backward cannot take. The forward was run again with torch.compile'd "
        "functions eager (torch.compiler.set_stance('force_eager')), so its Python side "
        "effects ran twice; the result is exact. To compile, put torch.compile outside: "
        "torch.compile(functrans.jacrev(f)).",
        CompileWarning, stacklevel=4)
    with set_stance("force_eager"):
        return call()
