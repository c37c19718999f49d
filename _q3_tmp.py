import torch, functrans as ft
import torch.autograd.forward_ad as fwAD
x = torch.randn(4, dtype=torch.float64); q = torch.tensor([0.03, 0.4], dtype=torch.float64)
TQ = torch.randn(3, 2, dtype=torch.float64)
def f(x, q):
    print("level", fwAD._current_level)
    w = q * 3
    print(type(fwAD.unpack_dual(w, level=0).tangent).__name__, type(fwAD.unpack_dual(w).tangent).__name__)
    return x.sum() * q
ft.vmap(lambda tq: ft.jvp(f, (x, q), (torch.ones(4).double(), tq)))(TQ)
