"""Dispatch overhead and per-sample gradients: functrans, torch.func and a Python loop on the
same inputs, each checked against the others before it is timed.  No workload may hit the loop
fallback (strict mode)."""
import pytest
import torch
import torch.nn.functional as F

import functrans as ft


def chain(a):
    for _ in range(100):
        a = a.sin()
    return a


X_SMALL = torch.randn(8, 16)


@pytest.mark.parametrize("impl", ["functrans", "torch.func", "loop"])
def test_dispatch_overhead_chain_of_100_ops(benchmark, impl):
    fn = {"functrans": lambda: ft.vmap(chain)(X_SMALL),
          "torch.func": lambda: torch.func.vmap(chain)(X_SMALL),
          "loop": lambda: torch.stack([chain(x) for x in X_SMALL])}[impl]
    with ft.config.strict_fallback():
        torch.testing.assert_close(fn(), chain(X_SMALL))
        benchmark(fn)


PARAMS = {"w1": torch.randn(512, 784) * 0.03, "b1": torch.zeros(512),
          "w2": torch.randn(256, 512) * 0.05, "b2": torch.zeros(256),
          "w3": torch.randn(10, 256) * 0.05, "b3": torch.zeros(10)}


def mlp_loss(p, x, y):
    h = F.relu(F.linear(x, p["w1"], p["b1"]))
    h = F.relu(F.linear(h, p["w2"], p["b2"]))
    return -(F.log_softmax(F.linear(h, p["w3"], p["b3"]), -1) * y).sum()


@pytest.mark.parametrize("batch", [64, 256])
@pytest.mark.parametrize("impl", ["functrans", "torch.func"])
def test_per_sample_grads_mlp(benchmark, impl, batch):
    xs = torch.randn(batch, 784)
    ys = F.one_hot(torch.randint(0, 10, (batch,)), 10).float()
    m = ft if impl == "functrans" else torch.func
    fn = lambda: m.vmap(m.grad(mlp_loss), in_dims=(None, 0, 0))(PARAMS, xs, ys)
    ref = torch.func.vmap(torch.func.grad(mlp_loss), in_dims=(None, 0, 0))(PARAMS, xs, ys)
    with ft.config.strict_fallback():
        got = fn()
        for k in PARAMS:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-5)
        benchmark(fn)
