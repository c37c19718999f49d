"""What compiled functions did: ``compile_report()`` and ``explain(fn, *args)``.

- ``compile_report()``: every live compiled function with its ``cache_info()`` (entries,
  hits, misses, retrace reasons, trace time, op counts, why calls ran eagerly).
- ``explain(fn, *args, **kwargs)``: traces ``fn`` (a plain function or a compiled one) on
  these arguments — which runs it once — and returns an ``Explanation``: the graph (one ATen op
  per line), the generated code each op runs through (or the Inductor graph), the guards the
  graph is filed under (argument structure, tensor metadata, non-tensor values, ambient state),
  its segments (each break: the line, what was read and the value its guard compares) and the
  captured state it re-reads on every call; ``print`` it.

Imports: compiler.cache (CacheInfo, a type), compiler.function, compiler.guards.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import torch

from .cache import CacheInfo
from .function import CompiledFunction, all_compiled, compile
from .guards import AMBIENT_NAMES, ambient, call_key, is_tensor_part, strides_text


@dataclass
class CompileReport:
    functions: List[Tuple[str, CacheInfo]]    # (name, CacheInfo)

    def __str__(self) -> str:
        if not self.functions:
            return "no compiled function is alive"
        parts = []
        for name, info in self.functions:
            body = "\n".join("  " + line for line in str(info).splitlines())
            parts.append(f"{name}:\n{body}")
        return "\n".join(parts)


def compile_report() -> CompileReport:
    """What every live ``functrans.compile``d function did: one ``CompileReport`` listing,
    per function, its ``cache_info()`` (graphs, hits, misses, calls that ran eagerly and why,
    retrace reasons, trace time, op counts); ``print`` it.

    Returns:
        A ``CompileReport``: ``functions`` is a list of ``(name, CacheInfo)``; its ``str`` is
        the table.

    Example:
        >>> import torch, functrans
        >>> f = functrans.compile(lambda x: x.sin() * 2)
        >>> _ = f(torch.ones(3)), f(torch.ones(3))
        >>> report = functrans.compile_report()
        >>> [info.hits for name, info in report.functions if name == repr(f)]
        [1]
    """
    return CompileReport([(repr(f), f.cache_info()) for f in all_compiled()])


@dataclass
class Explanation:
    """``graph``: the cleaned graph's code, one ATen op per line (``torch.ops.aten.mm...``);
    ``code``: what the backend runs (the replay's generated source, whose callables are bound
    names, or the Inductor graph)."""
    runs_eagerly: Optional[str]
    code: str
    ops: int
    guards: List[str]
    captured: List[str]
    graph: str = ""
    breaks: List[str] = field(default_factory=list)   # where a segment ends: the value read

    def __str__(self) -> str:
        lines = []
        if self.runs_eagerly:
            lines.append(f"runs eagerly: {self.runs_eagerly}")
        else:
            lines.append(f"graph: {self.ops} ops")
            if self.breaks:
                lines.append(f"{len(self.breaks) + 1} segments: each break's value is guarded "
                             "(another value runs the graph traced for it)")
                lines += [f"  {b}" for b in self.breaks]
            lines.append((self.graph or self.code).strip("\n"))
        lines.append("guards:")
        lines += [f"  {g}" for g in self.guards]
        lines.append("captured (re-read on every call):")
        lines += [f"  {c}" for c in self.captured] or ["  nothing"]
        return "\n".join(lines)


def _describe_key(key: Any) -> List[str]:
    sig, amb = key
    out = []
    tensor_i = 0
    for part in sig:
        if is_tensor_part(part):
            shape, stride, dtype, device, rg = part
            out.append(f"tensor {tensor_i}: shape {tuple(shape)}, strides {strides_text(stride)}, "
                       f"{dtype}, {device}, requires_grad={rg}")
            tensor_i += 1
        elif type(part) is tuple and len(part) == 2 and part[0] in (tuple, list, dict):
            out.append(f"{part[0].__name__} of {len(part[1]) if part[0] is dict else part[1]}"
                       + (f" keys {list(part[1])}" if part[0] is dict else ""))
        elif type(part) is tuple and len(part) == 2 and isinstance(part[0], type):
            out.append(f"value {part[1]!r} ({part[0].__name__})")
        else:
            out.append(f"structure {part}")
    out += [f"{n}: {v}" for n, v in zip(AMBIENT_NAMES, amb)]
    return out


def explain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Explanation:
    """Trace ``fn`` on these arguments (running it once) and say what ``functrans.compile``
    makes of it: the graph, the guards it is filed under and the state it re-reads.

    Args:
        fn: a plain function (compiled with the default settings for this) or a
            ``functrans.compile``d one (its backend and ``dynamic`` setting are used).
        *args: the positional arguments to trace it on.
        **kwargs: the keyword arguments to trace it on.

    Returns:
        An ``Explanation``: ``runs_eagerly`` (why the call would run eagerly, or None),
        ``ops`` (the graph's op count), ``graph`` (one ATen op per line), ``code`` (what the
        backend runs), ``guards`` (argument structure, tensor metadata, non-tensor values,
        ambient state) and ``captured`` (state re-read on every call); ``print`` it.

    Example:
        >>> import torch, functrans
        >>> e = functrans.explain(lambda x: x.sin() * 2, torch.ones(3))
        >>> e.runs_eagerly, e.ops
        (None, 2)
        >>> [op for op in ("aten.sin.default", "aten.mul.Tensor") if op in e.graph]
        ['aten.sin.default', 'aten.mul.Tensor']
        >>> e.guards[1]
        'tensor 0: shape (3,), strides (1,), torch.float32, cpu, requires_grad=False'
    """
    compiled = fn if isinstance(fn, CompiledFunction) else compile(fn)
    probe = CompiledFunction(compiled._fn, compiled.backend, compiled.dynamic, False, 1)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        probe(*args, **kwargs)
    info = probe.cache_info()
    key, _ = call_key(args, kwargs)
    entries = probe.entries()
    if not entries:
        reason = info.eager_reason or (info.eager_reasons[0] if info.eager_reasons else
                                       "nothing was traced")
        return Explanation(reason, "", 0, _describe_key(key), [])
    entry = entries[-1]
    code = entry.source or getattr(getattr(entry.run, "graph_module", None), "code", None) \
        or entry.graph_module.code
    captured = []
    if entry.captured is not None:
        captured = sorted(set(entry.captured.names))
    captured += [f"tensor {tuple(t.shape)} {t.dtype} (read by identity)"
                 for t, _ in entry.constant_meta
                 if entry.captured is None or entry.captured.name_of(t) is None]
    return Explanation(None, code, entry.ops, _describe_key(key), captured,
                       entry.graph_module.code, [r.describe() for r in entry.reads or ()])
