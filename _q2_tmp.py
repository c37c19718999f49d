import sys, torch, functrans as ft
from torch.utils._python_dispatch import TorchDispatchMode
class M(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        print("OP", func, [ (type(a).__name__, tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args])
        return func(*args, **(kwargs or {}))
x = torch.randn(4, dtype=torch.float64); q = torch.tensor([0.03, 0.4], dtype=torch.float64)
TQ = torch.randn(3, 2, dtype=torch.float64)
try:
    with M():
        ft.vmap(lambda tq: ft.jvp(torch.quantile, (x, q), (torch.ones(4).double(), tq)))(TQ); print("1d ok")
except Exception as e: print("ERR1d", str(e)[:60])
