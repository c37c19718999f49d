"""What runs how under vmap: the fallback recorder and the coverage listing (public API).

* ``record_fallbacks()`` is a context manager that records every op that ran on the loop
  fallback inside its block, in this thread, with call counts and time spent::

      with functrans.record_fallbacks() as report:
          functrans.vmap(model_loss)(xs)
      print(report)            # a table: op, calls, seconds, where its rule belongs
      report.ops               # {op name: FallbackRecord}

  The once-per-op warning says that something fell back; this says what, how often, how slow.
* ``batching_coverage(op)`` says how vmap runs one op: ``'rule'`` (an explicit rule), ``'tag'``
  (a tag rule, e.g. every pointwise op), ``'derived'`` (in-place / out= / *_copy variants from
  their functional op's rule), ``'composite'`` (decomposes above dispatch, into ops that are
  batched themselves), ``'decomposition'`` (a torch._decomp decomposition), ``'fallback'``.
* ``batching_rules()`` lists every ATen op overload with a rule, and the rules file it lives in.

Imports: errors, registry, decompositions, fallback, known_fallbacks, op_schema.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Dict, Iterator, Optional, Union

import torch

from ..errors import TransformTypeError
from . import fallback, registry
from .decompositions import has_decomposition
from .known_fallbacks import reason
from .op_schema import all_overloads, overload_named

OpLike = Union[torch._ops.OpOverload, torch._ops.OpOverloadPacket, str]


@dataclasses.dataclass
class FallbackRecord:
    op: str
    calls: int = 0
    seconds: float = 0.0
    rules_file: str = ""
    on_purpose: str = ""   # why the op has no rule, if that is deliberate (known_fallbacks)


class FallbackReport:
    """The ops that ran on the loop fallback in a ``record_fallbacks()`` block.

    ``ops`` maps an op's name (``'aten._add_relu.Tensor'``) to its ``FallbackRecord``
    (``calls``, ``seconds``, ``rules_file`` where its rule belongs, ``on_purpose``: why it has
    none, when that is deliberate).  ``total_calls`` and ``total_seconds`` sum them; iterating
    gives the records, slowest first; ``str`` is a table.  It is false when nothing fell back.

    Example:
        >>> import torch, functrans
        >>> with functrans.config.fallback_warnings(False), \\
        ...         functrans.record_fallbacks() as report:
        ...     y = functrans.vmap(lambda r: torch.ops.aten._add_relu(r, r))(torch.ones(4, 3))
        >>> bool(report), len(report), report.ops["aten._add_relu.Tensor"].calls
        (True, 1, 1)
    """

    def __init__(self) -> None:
        self.ops: Dict[str, FallbackRecord] = {}

    def _add(self, op: Any, seconds: float) -> None:
        rec = self.ops.get(str(op))
        if rec is None:
            rec = self.ops[str(op)] = FallbackRecord(
                str(op), rules_file=registry.rules_file(op), on_purpose=reason(op))
        rec.calls += 1
        rec.seconds += seconds

    @property
    def total_calls(self) -> int:
        return sum(r.calls for r in self.ops.values())

    @property
    def total_seconds(self) -> float:
        return sum(r.seconds for r in self.ops.values())

    def __bool__(self) -> bool:
        return bool(self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    def __iter__(self) -> Iterator[FallbackRecord]:
        return iter(sorted(self.ops.values(), key=lambda r: -r.seconds))

    def __str__(self) -> str:
        if not self.ops:
            return "vmap fallback report: no op ran on the loop fallback."
        width = max(len(r.op) for r in self.ops.values())
        lines = [f"vmap fallback report: {len(self.ops)} op(s) ran on the per-example loop, "
                 f"{self.total_calls} call(s), {self.total_seconds:.4f} s",
                 f"  {'op':<{width}}  {'calls':>6}  {'seconds':>9}  rule belongs in"]
        for r in self:
            where = f"(none on purpose: {r.on_purpose})" if r.on_purpose else r.rules_file
            lines.append(f"  {r.op:<{width}}  {r.calls:>6}  {r.seconds:>9.4f}  {where}")
        return "\n".join(lines)

    __repr__ = __str__


class record_fallbacks:
    """Context manager: record the ops that take the per-example loop fallback (ops with no
    batching rule) inside the block, in this thread, with call counts and time spent.

    Blocks nest (each records everything inside it).  The fallback's once-per-op
    ``PerformanceWarning`` is unaffected (``functrans.config.fallback_warnings(False)``
    silences it).

    Returns:
        On entering, a ``FallbackReport``, filled in as the block runs.

    Example:
        >>> import torch, functrans
        >>> x = torch.arange(6.).reshape(2, 3)
        >>> with functrans.config.fallback_warnings(False), \\
        ...         functrans.record_fallbacks() as report:
        ...     y = functrans.vmap(lambda r: torch.ops.aten._add_relu(r, r))(x)
        >>> list(report.ops), report.total_calls
        (['aten._add_relu.Tensor'], 1)
        >>> with functrans.record_fallbacks() as report:
        ...     y = functrans.vmap(torch.sin)(x)
        >>> print(report)
        vmap fallback report: no op ran on the loop fallback.
    """

    def __init__(self) -> None:
        self.report = FallbackReport()
        self._thread: Optional[int] = None

    def _observe(self, op: Any, seconds: float) -> None:
        if threading.get_ident() == self._thread:
            self.report._add(op, seconds)

    def __enter__(self) -> FallbackReport:
        self._thread = threading.get_ident()
        fallback.observers.append(self._observe)
        return self.report

    def __exit__(self, *exc: Any) -> None:
        fallback.observers.remove(self._observe)


def _overload(op: OpLike) -> torch._ops.OpOverload:
    """An OpOverload from an overload, a packet (its default) or a name: ``str(op)`` as the
    report prints it (``aten.index_add.default``), ``aten::index_add[.default]`` or
    ``index_add[.default]``."""
    if isinstance(op, torch._ops.OpOverload):
        return op
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op.default
    if isinstance(op, str):
        ov = overload_named(op)
        if ov is not None:
            return ov
    raise TransformTypeError(f"batching_coverage: expected an OpOverload, OpOverloadPacket or "
                             f"an op "
                    f"name like 'aten.index_add.default' or 'aten::index_add', got {op!r}")


def batching_coverage(op: OpLike) -> str:
    """How vmap runs one ATen op (see the module docstring).

    Args:
        op: an ``OpOverload`` (``torch.ops.aten.add.Tensor``), an ``OpOverloadPacket`` (its
            default overload) or a name: ``'aten.add.Tensor'``, ``'aten::add[.Tensor]'`` or
            ``'add[.Tensor]'``.

    Returns:
        ``'rule'`` (an explicit batching rule), ``'tag'`` (a tag rule, e.g. every pointwise
        op), ``'derived'`` (an in-place / ``out=`` / ``*_copy`` variant run by its functional
        op's rule), ``'composite'`` (decomposes above dispatch into batched ops),
        ``'decomposition'`` (a ``torch._decomp`` decomposition) or ``'fallback'`` (the slow
        per-example loop).

    Raises:
        TransformTypeError: ``op`` is not an op or the name of one.

    Example:
        >>> import torch, functrans
        >>> functrans.batching_coverage(torch.ops.aten.mm)
        'rule'
        >>> functrans.batching_coverage("aten::add.Tensor")
        'tag'
        >>> functrans.batching_coverage("aten._add_relu.Tensor")
        'fallback'
    """
    ov = _overload(op)
    how, _ = registry.find_rule(ov)
    if how == "cia":
        return "composite"
    if how != "none":
        return how
    return "decomposition" if has_decomposition(ov) else "fallback"


def batching_rules() -> Dict[str, str]:
    """``{op overload name: rules file}`` for every ATen overload with a rule of any kind
    (explicit, tag or derived), sorted by name.

    The ATen overloads are all those the dispatcher registers (``op_schema.all_overloads()``),
    so the answer does not depend on what ran before.

    Example:
        >>> import functrans
        >>> rules = functrans.batching_rules()
        >>> rules["aten.mm.default"].endswith(".py"), "aten.sin.default" in rules
        (True, True)
    """
    out = {}
    for ov in all_overloads():
        try:
            how, rule = registry.find_rule(ov)
        except RuntimeError:  # defensive: all_overloads() lists dispatcher ops only
            continue
        if rule is not None:
            out[str(ov)] = registry.rules_file(ov)
    return dict(sorted(out.items()))
