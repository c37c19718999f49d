"""Per-op time of the replay backend's generated code against ``gm.forward`` (FX's own codegen,
calling ``torch.ops.aten.X.default``) on the same cleaned hessian graph.

Not a test: ``OMP_NUM_THREADS=1 python benchmarks/replay_entry_points.py``.  Both run the same
graph (after ``passes.clean``) under no_grad on the same inputs; the script checks the outputs
agree, then prints microseconds per call and per op (best of several repeats).
"""
import timeit

import torch

import functrans as ft
from functrans.compiler import passes
from functrans.compiler.backends import replay
from functrans.compiler.backends.replay import entry_point


def f(x):
    return (x.sin() * x).sum() + (x ** 2).prod() * 0.1 + torch.tanh(x @ x.flip(0))


def main(n: int = 4) -> None:
    torch.set_num_threads(1)
    x = torch.randn(n, dtype=torch.float64)
    compiled = ft.compile(ft.hessian(f))
    with torch.no_grad():
        compiled(x)
    gm = compiled.entries()[0].graph_module           # already cleaned by the replay backend
    passes.clean(gm.graph, keep_autograd=False)
    gm.recompile()
    run = replay.build(gm, keep_autograd=False)
    ops = passes.count_ops(gm.graph)
    with torch.no_grad():
        a, b = run([x]), gm(x)
        for u, v in zip(a, b):
            torch.testing.assert_close(u, v, rtol=0, atol=0)
        rows = {"replay (generated, fastest entry point)": lambda: run([x]),
                "gm.forward (FX codegen, aten.X.default)": lambda: gm(x),
                "functrans eager": lambda: ft.hessian(f)(x)}
        times = {}
        for name, call in rows.items():
            number = 200
            best = min(timeit.repeat(call, number=number, repeat=7)) / number
            times[name] = best
    print(f"hessian graph, x of {n}: {ops} ops after cleaning")
    for name, t in times.items():
        print(f"  {name:<42} {t * 1e6:9.1f} us/call  {t * 1e6 / ops:6.2f} us/op")
    base = times["gm.forward (FX codegen, aten.X.default)"]
    print(f"  replay / gm.forward = {times['replay (generated, fastest entry point)'] / base:.2f}")
    kinds = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            fn = entry_point(node)
            kind = "OpOverload._op" if fn is node.target._op else "torch.* / Tensor.*"
            kinds[kind] = kinds.get(kind, 0) + 1
    print(f"  entry points chosen: {kinds}")


if __name__ == "__main__":
    main()
