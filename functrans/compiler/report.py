"""What compiled functions did: ``compile_report()`` and ``explain(fn, *args)``.

- ``compile_report()``: every live compiled function with its ``cache_info()`` (entries,
  hits, misses, retrace reasons, trace time, op counts, why calls ran eagerly).
- ``explain(fn, *args, **kwargs)``: traces ``fn`` (a plain function or a compiled one) on
  these arguments — which runs it once — and returns an ``Explanation``: the graph (one ATen op
  per line), the generated code each op runs through (or the Inductor graph), the guards the
  graph is filed under (argument structure, tensor metadata, non-tensor values, ambient state)
  and the captured state it re-reads on every call; ``print`` it.

Imports: compiler.function, compiler.guards.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from .function import CompiledFunction, all_compiled, compile
from .guards import AMBIENT_NAMES, ambient, call_key, is_tensor_part


@dataclass
class CompileReport:
    functions: List[tuple]    # (name, CacheInfo)

    def __str__(self) -> str:
        if not self.functions:
            return "no compiled function is alive"
        parts = []
        for name, info in self.functions:
            body = "\n".join("  " + line for line in str(info).splitlines())
            parts.append(f"{name}:\n{body}")
        return "\n".join(parts)


def compile_report() -> CompileReport:
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

    def __str__(self) -> str:
        lines = []
        if self.runs_eagerly:
            lines.append(f"runs eagerly: {self.runs_eagerly}")
        else:
            lines.append(f"graph: {self.ops} ops")
            lines.append((self.graph or self.code).strip("\n"))
        lines.append("guards:")
        lines += [f"  {g}" for g in self.guards]
        lines.append("captured (re-read on every call):")
        lines += [f"  {c}" for c in self.captured] or ["  nothing"]
        return "\n".join(lines)


def _describe_key(key) -> List[str]:
    sig, amb = key
    out = []
    tensor_i = 0
    for part in sig:
        if is_tensor_part(part):
            shape, stride, dtype, device, rg = part
            out.append(f"tensor {tensor_i}: shape {tuple(shape)}, strides {tuple(stride)}, "
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


def explain(fn, *args, **kwargs) -> Explanation:
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
                       entry.graph_module.code)
