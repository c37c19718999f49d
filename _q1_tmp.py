import torch, functrans as ft, traceback, sys
sys.path.insert(0, '.')
from torch.testing._internal.common_methods_invocations import op_db
op = [o for o in op_db if o.name=="quantile"][0]
s = list(op.sample_inputs("cpu", torch.float32))[30]
print(s.input.shape, s.args, s.kwargs)
x = s.input.double(); q = s.args[0].double() if isinstance(s.args[0], torch.Tensor) else s.args[0]
f = lambda x, q: torch.quantile(x, q, *s.args[1:], **s.kwargs)
TQ = torch.randn(3, *q.shape, dtype=torch.float64)
tx = torch.randn_like(x)
try:
    r = ft.vmap(lambda tq: ft.jvp(f, (x, q), (tx, tq)))(TQ)
    print("ok")
except Exception:
    traceback.print_exc()
