"""The cache of traced graphs of one compiled function, and its counters.

What this module owns
- ``Entry``: one traced graph ready to run: the backend's callable, the output's structure, the
  captured-state paths and the captured tensors' metadata it must re-check on every hit, and
  what ``cache_info()`` reports of it (op count, trace time, backend, notes).
- ``GraphCache``: entries keyed by ``guards.call_key`` (several variants per key, traced with
  different captured state), least recently used evicted beyond ``size``; hits, misses, calls
  that ran eagerly, retrace reasons and total trace time.  Lookups take no lock (an
  ``OrderedDict`` read and ``move_to_end`` are atomic under the GIL); inserts and counters
  take one, so several threads may call one compiled function.

Imports: compiler.breaks, compiler.guards.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import torch
import torch.utils._pytree as pytree

from .breaks import same_value
from .guards import Captured, tensor_meta


class Entry:
    __slots__ = ("key", "run", "captured", "constant_meta", "out_spec", "out_leaves",
                 "out_positions", "single", "ops", "trace_seconds", "backend", "notes",
                 "graph_module", "source", "symbolic", "shape_guard", "reads", "save_rng")

    def __init__(self, key, run, captured: Optional[Captured], constants: List[torch.Tensor],
                 out_spec, out_leaves, out_positions, ops: int, trace_seconds: float,
                 backend: str, graph_module, source: Optional[str], symbolic: bool = False):
        self.key, self.run, self.captured = key, run, captured
        if captured is not None and not captured.steps:
            self.captured = None
        self.constant_meta = [(t, tensor_meta(t)) for t in constants]
        self.out_spec, self.out_leaves, self.out_positions = out_spec, out_leaves, out_positions
        self.single = (len(out_leaves) == 1 and out_positions == [0]
                       and out_spec == pytree.tree_flatten(torch.empty(0))[1])
        self.ops, self.trace_seconds, self.backend = ops, trace_seconds, backend
        self.notes: List[str] = []
        self.graph_module, self.source, self.symbolic = graph_module, source, symbolic
        self.shape_guard = None
        self.reads: Optional[list] = None  # the graph's breaks (breaks.Read), None: one segment
        self.save_rng = False              # a random op runs before a guard

    def stale(self) -> Optional[str]:
        """Why this entry no longer holds (None when it does)."""
        if self.captured is not None:
            changed = self.captured.check()
            if changed is not None:
                return changed
        for t, meta in self.constant_meta:
            if tensor_meta(t) != meta:
                return "a captured tensor's shape, dtype, device or requires_grad changed"
        return None

    def outputs(self, results: list) -> Any:
        if self.single:
            return results[0]
        leaves = list(self.out_leaves)
        for pos, value in zip(self.out_positions, results):
            leaves[pos] = value
        return pytree.tree_unflatten(leaves, self.out_spec)


@dataclass
class EntryInfo:
    backend: str
    ops: int
    trace_seconds: float
    symbolic: bool
    notes: List[str]
    tier: str = ""      # backend "tiered": the tier serving the entry now, and why
    breaks: List[str] = field(default_factory=list)   # where a segment ends, and the value read

    @property
    def segments(self) -> int:
        """How many segments the graph is replayed in (its breaks + 1)."""
        return len(self.breaks) + 1


@dataclass
class CacheInfo:
    """What ``compiled.cache_info()`` returns."""
    entries: List[EntryInfo]
    hits: int
    misses: int
    eager_calls: int
    retrace_reasons: List[str]
    trace_seconds: float
    eager_reason: Optional[str] = None
    eager_reasons: List[str] = field(default_factory=list)
    read_changes: int = 0   # calls whose replay read another value at a break than its graph

    def __str__(self) -> str:
        lines = [f"{len(self.entries)} graph(s), {self.hits} hits, {self.misses} misses, "
                 f"{self.eager_calls} eager calls, {self.trace_seconds:.3f} s tracing"]
        for i, e in enumerate(self.entries):
            lines.append(f"  entry {i}: {e.backend}, {e.ops} ops, traced in "
                         f"{e.trace_seconds:.3f} s{', symbolic sizes' if e.symbolic else ''}"
                         + "".join(f"; {n}" for n in e.notes)
                         + (f"; {e.tier}" if e.tier else "")
                         + (f"; {e.segments} segments" if e.breaks else ""))
            lines += [f"    {b}" for b in e.breaks]
        if self.read_changes:
            lines.append(f"  {self.read_changes} call(s) read another value at a break")
        lines += [f"  retraced: {r}" for r in self.retrace_reasons]
        if self.eager_reason:
            lines.append(f"  runs eagerly: {self.eager_reason}")
        lines += [f"  a call ran eagerly: {r}" for r in self.eager_reasons]
        return "\n".join(lines)


_MAX_REASONS = 32


class GraphCache:
    """Entries filed by key; one key may hold several variants (newest last), which differ in
    the captured state they were traced with (``model.train()`` / ``model.eval()``, a captured
    scalar toggled between values): a variant whose captured state holds again is reused, not
    retraced.  ``size`` bounds the number of entries over all keys."""

    def __init__(self, size: int):
        self.size = size
        self.entries: "OrderedDict[Any, tuple]" = OrderedDict()   # key -> (Entry, ...)
        self.lock = threading.Lock()
        self.hits = self.misses = self.eager_calls = self.read_changes = 0
        self.trace_seconds = 0.0
        self.retrace_reasons: List[str] = []
        self.eager_reasons: List[str] = []

    def lookup(self, key) -> "tuple[Optional[Entry], Optional[str]]":
        """(an entry for key whose captured state holds, None), counted as a hit, or (None, why
        the newest variant filed under key no longer holds; None when there is none)."""
        variants = self.entries.get(key)
        if not variants:
            return None, None
        try:
            self.entries.move_to_end(key)
        except KeyError:   # evicted by another thread meanwhile
            pass
        why = None
        for entry in reversed(variants):
            stale = entry.stale()
            if stale is None:
                self.note_hit()
                return entry, None
            if why is None:
                why = stale
        return None, why

    def variant_reading(self, key, observed: list) -> Optional[Entry]:
        """A variant filed under ``key`` whose captured state holds and whose graph read the
        values ``observed`` (a prefix of its breaks' values), newest first (the call's lookup
        counted the hit)."""
        for entry in reversed(self.entries.get(key, ())):
            reads = entry.reads
            if reads is None or len(reads) < len(observed):
                continue
            if all(same_value(r.value, v) for r, v in zip(reads, observed)) \
                    and entry.stale() is None:
                return entry
        return None

    def read_variants(self, key) -> List[Entry]:
        return [e for e in self.entries.get(key, ()) if e.reads is not None]

    def promote(self, key, entry: Entry) -> None:
        """Make ``entry`` the variant tried first under ``key`` (it read this call's values)."""
        with self.lock:
            variants = self.entries.get(key, ())
            if variants and variants[-1] is not entry and entry in variants:
                self.entries[key] = tuple(e for e in variants if e is not entry) + (entry,)

    def note_read_change(self) -> None:
        with self.lock:
            self.read_changes += 1

    def note_hit(self, n: int = 1) -> None:
        with self.lock:                 # counted under the lock: threads lose no hits
            self.hits += n

    def all_entries(self) -> List[Entry]:
        with self.lock:
            return [e for variants in self.entries.values() for e in variants]

    def latest(self) -> Optional[Entry]:
        with self.lock:
            variants = next(reversed(self.entries.values()), ())
            return variants[-1] if variants else None

    def put(self, entry: Entry, key: Any = None) -> None:
        key = entry.key if key is None else key
        with self.lock:
            self.entries[key] = self.entries.get(key, ()) + (entry,)
            self.entries.move_to_end(key)
            count = sum(len(v) for v in self.entries.values())
            while count > self.size:
                oldest, variants = next(iter(self.entries.items()))
                if len(variants) > 1:
                    self.entries[oldest] = variants[1:]
                else:
                    del self.entries[oldest]
                count -= 1

    def note_miss(self, reason: Optional[str], seconds: float) -> None:
        with self.lock:
            self.misses += 1
            self.trace_seconds += seconds
            if reason is not None and len(self.retrace_reasons) < _MAX_REASONS:
                self.retrace_reasons.append(reason)

    def note_eager(self, reason: Optional[str]) -> None:
        with self.lock:
            self.eager_calls += 1
            if reason is not None and reason not in self.eager_reasons \
                    and len(self.eager_reasons) < _MAX_REASONS:
                self.eager_reasons.append(reason)

    def info(self, eager_reason: Optional[str]) -> CacheInfo:
        with self.lock:
            entries = [EntryInfo(e.backend, e.ops, e.trace_seconds, e.symbolic, list(e.notes),
                                 e.run.state() if hasattr(e.run, "state") else "",
                                 [r.describe() for r in e.reads or ()])
                       for variants in self.entries.values() for e in variants
                       if not e.symbolic]
            return CacheInfo(entries, self.hits, self.misses, self.eager_calls,
                             list(self.retrace_reasons), self.trace_seconds, eager_reason,
                             list(self.eager_reasons), self.read_changes)

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
