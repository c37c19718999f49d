"""Compiled transforms: ``functrans.compile`` traces a whole transform stack once into one graph
of plain ATen ops, guarded and cached, and replays it.

Read in the order a call meets the files: ``function.py`` (the compiled function; one call's
path) → ``guards.py`` (the key and the captured-state checks) → ``cache.py`` (entries, LRU,
counters) → ``tracer.py`` (make_fx over the engine; what must not be baked in) → ``passes.py``
(graph cleaning) → ``backends/`` (replay, inductor, cudagraphs) → ``report.py``
(``compile_report``, ``explain``).  Nothing in the engine imports this package.

The subpackage is ``compiler`` rather than ``compile``: the public function
``functrans.compile`` would shadow a subpackage of that name (as ``functrans.vmap`` did).

Imports: compiler.function, compiler.report.
"""
from .function import CompiledFunction, compile
from .report import compile_report, explain

__all__ = ["compile", "CompiledFunction", "compile_report", "explain"]
