"""The prologue of a compiled call: the key a cached graph is filed under, and the checks of what
a graph read from outside its arguments.

What this module owns
- ``call_key(args, kwargs)``: one hashable key for everything a trace baked in from the call:
  the pytree structure of the arguments, each tensor's shape, significant strides
  (``tensor_meta``: not those of a size-1 dim or an empty tensor), dtype, device, layout and
  requires_grad, the value (and type) of every non-tensor leaf, and the ambient state
  (``ambient()``: grad mode, inference mode, default dtype, autocast on CPU and CUDA with the
  dtype it casts to).  It also
  returns the argument tensors in pytree order: the graph's inputs.  Flat tuples, lists and dicts
  of tensors and Python scalars take a hand-written walk; anything else (namedtuples, custom
  pytree nodes) goes through ``torch.utils._pytree``, which gives the same leaf order.
- ``Captured``: the state a traced function reads without taking it as an argument — tensors in
  closures, globals, module attributes and parameters (the graph reads them at call time, so
  in-place updates are seen) and the Python scalars beside them (baked into the graph).
  ``Captured.discover(fn)`` walks what ``fn`` can reach (closure cells, the globals its code
  names, ``functools.partial``, bound methods, ``nn.Module`` attributes, containers) and records
  the path to each object; ``check()`` re-reads every step of every path on each call, so
  rebinding a name, swapping a module's parameter or changing a captured scalar is seen and
  answered by a retrace, never by a stale graph.
- ``object_arguments(args, kwargs)``: the argument leaves that are neither tensors nor plain
  values (objects, modules, functions), whose attributes a trace may read like captured state.
- ``describe_difference(old, new)``: why a key missed, in words, for ``cache_info()``.

Imports: nothing (torch only).
"""
from __future__ import annotations

import functools
import types
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.utils._pytree as pytree

_Tensor = torch.Tensor
_SCALARS = (int, float, bool, str, type(None), complex, torch.dtype, torch.device,
            torch.memory_format, torch.layout)


class Unguardable(Exception):
    """An argument a cached graph cannot be keyed on (an unhashable non-tensor leaf, a tensor
    subclass, a sparse tensor): the call runs eagerly and the reason is recorded."""


if hasattr(torch, "get_autocast_dtype"):
    _autocast_dtype = torch.get_autocast_dtype
else:  # pragma: no cover - older torch
    def _autocast_dtype(device_type: str) -> torch.dtype:
        return (torch.get_autocast_cpu_dtype() if device_type == "cpu"
                else torch.get_autocast_gpu_dtype())


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


def ambient() -> tuple:
    """Grad mode, inference mode, default dtype, and for CPU and CUDA autocast False when off,
    else the dtype it casts to (a graph traced under bfloat16 autocast bakes in bfloat16)."""
    if _any_autocast is not None and not _any_autocast():     # one call on every compiled call
        return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                torch.get_default_dtype(), False, False)
    cpu = torch.is_autocast_enabled("cpu") and _autocast_dtype("cpu")
    cuda = torch.is_autocast_enabled("cuda") and _autocast_dtype("cuda")
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch.get_default_dtype(), cpu, cuda)


def is_tensor_part(part: Any) -> bool:
    """Whether a part of a key's signature is a tensor's ``tensor_meta``."""
    return type(part) is tuple and len(part) == 5 and isinstance(part[0], torch.Size)


def tensor_meta(t: torch.Tensor) -> tuple:
    """(shape, significant strides, dtype, device, requires_grad): the strides as torch counts
    them significant (``torch._prims_common.check_significant_strides``; Inductor's
    ``assert_size_stride`` skips the same ones), None where a stride addresses nothing: a dim
    of size 1 (its only index is 0) and every dim of an empty tensor.  Two tensors that differ
    only there hold the same elements at the same offsets, so one graph serves both (a
    transposed ``(3, 1)`` column, strides ``(1, 3)``, and a contiguous one, ``(1, 1)``)."""
    if t.layout is not torch.strided:
        raise Unguardable(f"a tensor with layout {t.layout} (only strided tensors are traced)")
    shape, stride = t.shape, t.stride()
    if 1 in shape or 0 in shape:
        stride = (None,) * len(stride) if 0 in shape else tuple(
            st if size > 1 else None for size, st in zip(shape, stride))
    return (shape, stride, t.dtype, t.device, t.requires_grad)


def strides_text(stride: tuple) -> str:
    """A key's strides in words: ``*`` where a stride is not significant (``tensor_meta``)."""
    parts = ["*" if st is None else str(st) for st in stride]
    return f"({parts[0]},)" if len(parts) == 1 else f"({', '.join(parts)})"


def _walk(obj: Any, tensors: List[torch.Tensor], sig: list) -> bool:
    """Append obj's leaves to tensors/sig in pytree order; False where pytree must decide."""
    cls = type(obj)
    if cls is _Tensor or cls is torch.nn.Parameter:
        tensors.append(obj)
        sig.append(tensor_meta(obj))
        return True
    if cls is tuple or cls is list:
        sig.append((cls, len(obj)))
        for item in obj:
            if not _walk(item, tensors, sig):
                return False
        return True
    if cls is dict:
        sig.append((dict, tuple(obj)))
        for item in obj.values():
            if not _walk(item, tensors, sig):
                return False
        return True
    if cls in _SCALARS:
        sig.append((cls, obj))
        return True
    return False


def _leaf_sig(leaf: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(leaf, _Tensor):
        if type(leaf) not in (_Tensor, torch.nn.Parameter):
            raise Unguardable(f"a tensor of type {type(leaf).__name__} (a subclass: it runs "
                              "eagerly)")
        tensors.append(leaf)
        return tensor_meta(leaf)
    try:
        hash(leaf)
    except TypeError:
        raise Unguardable(f"an argument of type {type(leaf).__name__}, which is not hashable "
                          "(a graph is keyed on the value of every non-tensor argument)") from None
    return (type(leaf), leaf)


def call_key(args: tuple, kwargs: dict) -> Tuple[tuple, List[torch.Tensor]]:
    """(key, argument tensors in pytree order).  Raises Unguardable."""
    tensors: List[torch.Tensor] = []
    sig: list = []
    if _walk(args, tensors, sig) and (not kwargs or _walk(kwargs, tensors, sig)):
        return (tuple(sig), ambient()), tensors
    tensors = []
    leaves, spec = pytree.tree_flatten((args, kwargs))
    sig = [spec] + [_leaf_sig(leaf, tensors) for leaf in leaves]
    return (tuple(sig), ambient()), tensors


def dynamic_key(key: tuple) -> tuple:
    """``key`` without sizes: each tensor's shape and strides become its rank and whether it is
    contiguous (a graph traced with symbolic sizes is filed under this, and checks the sizes
    with its ``shape_guard``)."""
    sig, amb = key
    out = []
    for part in sig:
        if is_tensor_part(part):
            shape, stride, dtype, device, rg = part
            expected, acc = [], 1
            for size in reversed(shape):
                expected.append(acc)
                acc *= max(size, 1)
            contiguous = all(st is None or st == e or sz <= 1 for st, e, sz in
                             zip(stride, reversed(expected), shape))
            out.append(("sym", len(shape), contiguous, dtype, device, rg))
        else:
            out.append(part)
    return tuple(out), amb


def shape_guard(graph_module) -> Any:
    """A function of the argument tensors: whether the sizes meet what the symbolic trace of
    ``graph_module`` assumed (its ShapeEnv's guards, static ones included)."""
    placeholders = [n.meta.get("val") for n in graph_module.graph.nodes if n.op == "placeholder"]
    fake = next((p for p in placeholders if isinstance(p, torch.Tensor)), None)
    shape_env = getattr(getattr(fake, "fake_mode", None), "shape_env", None)
    if shape_env is None:
        return lambda tensors: True
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP
    code = shape_env.produce_guards_expression(placeholders, ignore_static=False)
    if code is None:
        return lambda tensors: True
    compiled = compile(code, "<functrans shape guards>", "eval")
    names = [f"t{i}" for i in range(len(placeholders))]

    def check(tensors) -> bool:
        return bool(eval(compiled, SYMPY_INTERP, {"L": dict(zip(names, tensors))}))

    check.source = code
    return check


def object_arguments(args: tuple, kwargs: dict) -> tuple:
    return tuple(leaf for leaf in pytree.tree_leaves((args, kwargs))
                 if not isinstance(leaf, _Tensor) and type(leaf) not in _SCALARS)


AMBIENT_NAMES = ("grad mode", "inference mode", "default dtype", "CPU autocast", "CUDA autocast")


def only_sizes_differ(old: tuple, new: tuple) -> bool:
    """Whether two keys differ in tensor sizes or strides and in nothing else (the case a graph
    with symbolic sizes serves)."""
    return old != new and dynamic_key(old) == dynamic_key(new)


def describe_difference(old: tuple, new: tuple) -> str:
    """In words, the first thing that differs between two keys of ``call_key``."""
    (osig, oamb), (nsig, namb) = old, new
    ambient_changes = [f"{name} changed ({a} -> {b})"
                       for name, a, b in zip(AMBIENT_NAMES, oamb, namb) if a != b]
    if ambient_changes:     # all of them: inference mode also turns grad mode off
        return ", ".join(ambient_changes)
    if len(osig) != len(nsig):
        return "the structure of the arguments changed"
    tensor_i = -1
    for a, b in zip(osig, nsig):
        a_tensor, b_tensor = is_tensor_part(a), is_tensor_part(b)
        if a_tensor:
            tensor_i += 1
        if a == b:
            continue
        if a_tensor and b_tensor:
            for what, x, y in zip(("shape", "strides", "dtype", "device", "requires_grad"), a, b):
                if x != y:
                    if what == "strides":
                        x, y = strides_text(x), strides_text(y)
                    return (f"tensor argument {tensor_i}: {what} "
                            f"{tuple(x) if isinstance(x, torch.Size) else x} -> "
                            f"{tuple(y) if isinstance(y, torch.Size) else y}")
        if a_tensor != b_tensor or type(a) is not tuple or len(a) != 2 or a[0] in (
                tuple, list, dict):
            return "the structure of the arguments changed"
        return f"a non-tensor argument changed ({a[1]!r} -> {b[1]!r})"
    return "the key differs"  # pragma: no cover - keys that differ differ somewhere


# --------------------------------------------------------------------------------------------
# Captured state: what a function reads without taking it as an argument.

_MISSING = object()
_CELL, _DICT, _ATTR, _SEQ = range(4)
_MAX_OBJECTS = 4000
_MAX_DEPTH = 8
_GUARDED_VALUES = (int, float, bool, str, complex, type(None))


def _read(kind: int, holder: Any, key: Any) -> Any:
    """One step of a path.  Containers are read through the builtin type's own methods: a
    subclass may override ``get``/``__getitem__``/``__len__`` with other signatures or side
    effects (transformers has a dict subclass whose ``get`` takes one argument)."""
    try:
        if kind == _CELL:
            return holder.cell_contents
        if kind == _DICT:
            return dict.get(holder, key, _MISSING)
        if kind == _ATTR:
            return getattr(holder, key, _MISSING)
        seq = list if isinstance(holder, list) else tuple
        return seq.__getitem__(holder, key) if key < seq.__len__(holder) else _MISSING
    except ValueError:   # an empty cell
        return _MISSING


def _is_library_function(fn: Any) -> bool:
    module = getattr(fn, "__module__", None) or ""
    return module.split(".")[0] in ("torch", "functrans")


def _code_names(code: types.CodeType) -> List[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_code_names(const))
    return names


class Captured:
    """The paths from a function to the tensors and scalars it can reach (see the module doc).

    ``steps``: (kind, holder, key, expected) — each read of a path, deduplicated; ``tensors``:
    {id: (tensor, name)} for every tensor reached; ``scalars``: the number of guarded values."""

    def __init__(self) -> None:
        self.steps: List[tuple] = []
        self.names: List[str] = []
        self.tensors: Dict[int, Tuple[torch.Tensor, str]] = {}
        self._seen_steps: set = set()

    @classmethod
    def discover(cls, fn: Any, guarded_tensors: Optional[set] = None,
                 arguments: tuple = ()) -> "Captured":
        """Walk what fn reaches, and what the object ``arguments`` reach (a method's ``self``,
        a module passed in: the key holds them by identity, their attributes are read here).
        Paths are kept for every scalar, and for every tensor whose id is in
        ``guarded_tensors`` (all tensors when None)."""
        self = cls()
        seen: set = set()
        # (object, name, depth, path of steps leading to it)
        stack: List[tuple] = [(fn, getattr(fn, "__name__", "fn"), 0, ())]
        stack += [(arg, f"argument {type(arg).__name__}", 1, ((_SEQ, arguments, i, arg),))
                  for i, arg in enumerate(arguments)]
        while stack and len(seen) < _MAX_OBJECTS:
            obj, name, depth, path = stack.pop()
            if isinstance(obj, _Tensor):
                if id(obj) not in self.tensors:
                    self.tensors[id(obj)] = (obj, name)
                    if guarded_tensors is None or id(obj) in guarded_tensors:
                        self._add_path(path, name)
                continue
            if isinstance(obj, _GUARDED_VALUES):
                self._add_path(path, name)
                continue
            if id(obj) in seen or depth > _MAX_DEPTH:
                continue
            seen.add(id(obj))
            # a module's submodules and tensors are one structure however deep it nests
            # (BERT's attention weights sit 8 modules down): depth bounds other objects
            in_module = isinstance(obj, torch.nn.Module)
            for child in self._children(obj, name):
                kind, holder, key, child_name, value = child
                step = (kind, holder, key, value)
                flat = in_module and isinstance(value, (torch.nn.Module, _Tensor))
                stack.append((value, child_name, depth if flat else depth + 1,
                              path + (step,)))
        return self

    def _add_path(self, path: tuple, name: str) -> None:
        for step in path:
            ident = (step[0], id(step[1]), step[2])
            if ident not in self._seen_steps:
                self._seen_steps.add(ident)
                self.steps.append(step)
                self.names.append(name)

    @staticmethod
    def _children(obj: Any, name: str):
        if isinstance(obj, (types.ModuleType, type)):
            return
        if isinstance(obj, types.FunctionType):
            library = _is_library_function(obj)
            for var, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
                value = _read(_CELL, cell, None)
                if value is not _MISSING:
                    yield _CELL, cell, None, f"{var} (closure of {obj.__name__})", value
            if not library:
                g = obj.__globals__
                for var in dict.fromkeys(_code_names(obj.__code__)):
                    if var in g:
                        yield _DICT, g, var, f"{var} (global of {obj.__name__})", g[var]
            if obj.__defaults__ and not library:   # def loss(p, x, model=model): like a closure
                yield _ATTR, obj, "__defaults__", f"{name} (defaults)", obj.__defaults__
            if obj.__kwdefaults__ and not library:
                yield _ATTR, obj, "__kwdefaults__", f"{name} (keyword defaults)", \
                    obj.__kwdefaults__
            if obj.__dict__:
                for var, value in obj.__dict__.items():
                    yield _DICT, obj.__dict__, var, f"{name}.{var}", value
            return
        if isinstance(obj, types.MethodType):
            yield _ATTR, obj, "__func__", name, obj.__func__
            yield _ATTR, obj, "__self__", name, obj.__self__
            return
        if isinstance(obj, functools.partial):
            yield _ATTR, obj, "func", name, obj.func
            for i, value in enumerate(obj.args):
                yield _SEQ, obj.args, i, f"{name} (argument {i})", value
            for var, value in obj.keywords.items():
                yield _DICT, obj.keywords, var, f"{name} (argument {var})", value
            return
        if isinstance(obj, (list, tuple)):
            seq = list if isinstance(obj, list) else tuple
            if seq.__len__(obj) <= 256:
                for i in range(seq.__len__(obj)):
                    value = seq.__getitem__(obj, i)
                    yield _SEQ, obj, i, f"{name}[{i}]", value
            return
        if isinstance(obj, dict):
            if dict.__len__(obj) <= 256:
                for key, value in list(dict.items(obj)):
                    if isinstance(key, (str, int)):
                        yield _DICT, obj, key, f"{name}[{key!r}]", value
            return
        if isinstance(obj, torch.nn.Module):
            d = obj.__dict__
            for var, value in d.items():
                if var in ("_parameters", "_buffers", "_modules"):
                    for sub, v in value.items():
                        if v is not None:
                            yield _DICT, value, sub, f"{name}.{sub}", v
                elif not var.startswith("_") or var == "_forward":
                    yield _DICT, d, var, f"{name}.{var}", value
            yield _ATTR, type(obj), "forward", f"{type(obj).__name__}.forward", type(obj).forward
            return
        if _is_library_function(type(obj)):
            return      # torch's own objects (generators, streams, ...): never user state
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict):
            for var, value in d.items():
                yield _DICT, d, var, f"{name}.{var}", value
            call = getattr(type(obj), "__call__", None)
            if isinstance(call, types.FunctionType):
                yield _ATTR, type(obj), "__call__", f"{type(obj).__name__}.__call__", call

    def check(self) -> Optional[str]:
        """None when every path still reads what the trace read; otherwise what changed."""
        for kind, holder, key, expected in self.steps:
            value = _read(kind, holder, key)
            if value is expected:
                continue
            if isinstance(expected, _GUARDED_VALUES) and type(value) is type(expected) \
                    and value == expected:
                continue
            return self._describe(kind, holder, key, expected, value)
        return None

    def _describe(self, kind, holder, key, expected, value) -> str:
        name = next(n for s, n in zip(self.steps, self.names) if s[1] is holder and s[2] == key)
        if isinstance(expected, _GUARDED_VALUES):
            return f"captured value {name} changed ({expected!r} -> {value!r})"
        return f"captured {name} was rebound to another object"

    def name_of(self, tensor: torch.Tensor) -> Optional[str]:
        found = self.tensors.get(id(tensor))
        return found[1] if found is not None and found[0] is tensor else None
