"""``python -m functrans``: a short demo of what functrans does, checked and timed.

Imports: functrans (the public API only).
"""
from __future__ import annotations

import time
import warnings

import torch

import functrans
from functrans import vmap


def _time(fn, repeat: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _close(actual, expected) -> bool:
    """Equal up to rounding: the tolerances of ``torch.testing.assert_close`` for the dtype
    (float32: rtol 1.3e-6, atol 1e-5).  Vectorised and looped kernels sum in different orders,
    so bit-for-bit equality is not the claim; a fixed ``atol=1e-6`` fails on rounding alone."""
    try:
        torch.testing.assert_close(actual, expected)
    except AssertionError:
        return False
    return True


def demo_vmap(batch: int = 512, dim: int = 64) -> None:
    print(f"1. vmap of a per-example function over a batch of {batch} examples")
    torch.manual_seed(0)
    weight = torch.randn(dim, dim) / dim ** 0.5
    bias = torch.randn(dim)

    def per_example(x):
        """One example: a feature vector of shape [dim] -> attention-like summary [dim]."""
        h = torch.tanh(weight @ x + bias)
        scores = torch.softmax(h * x, dim=0)
        return scores * h - x.mean()

    xs = torch.randn(batch, dim)
    batched = vmap(per_example)
    looped = lambda: torch.stack([per_example(x) for x in xs])
    same = _close(batched(xs), looped())
    t_vmap = _time(lambda: batched(xs))
    t_loop = _time(looped)
    print(f"   results equal: {same}")
    print(f"   Python loop: {t_loop * 1e3:8.2f} ms")
    print(f"   vmap       : {t_vmap * 1e3:8.2f} ms   ({t_loop / t_vmap:.1f}x faster)")


def demo_release_notes_jacobian(dim: int = 64) -> None:
    print(f"\n2. Jacobian of F.linear(x, weight, bias).tanh() (D = {dim}), the PyTorch 1.11 "
          "release-notes example")
    import torch.nn.functional as F
    torch.manual_seed(0)
    weight, bias, x = torch.randn(dim, dim), torch.randn(dim), torch.randn(dim)

    def predict(w, b, v):
        return F.linear(v, w, b).tanh()

    def rows_by_autograd():
        xg = x.clone().requires_grad_()
        out = predict(weight, bias, xg)
        return torch.stack([torch.autograd.grad(out, xg, e, retain_graph=True)[0]
                            for e in torch.eye(dim)])

    def rows_by_vmap():
        _, vjp_fn = functrans.vjp(lambda v: predict(weight, bias, v), x)
        return functrans.vmap(vjp_fn)(torch.eye(dim))[0]

    same = _close(rows_by_vmap(), rows_by_autograd())
    t_loop, t_vmap = _time(rows_by_autograd), _time(rows_by_vmap)
    t_jacrev = _time(lambda: functrans.jacrev(predict, argnums=2)(weight, bias, x))
    print(f"   results equal: {same}")
    print(f"   row-by-row autograd.grad: {t_loop * 1e3:8.2f} ms")
    print(f"   vmap over vjp_fn        : {t_vmap * 1e3:8.2f} ms   ({t_loop / t_vmap:.1f}x faster)")
    print(f"   jacrev                  : {t_jacrev * 1e3:8.2f} ms")


def demo_per_sample_gradients(batch: int = 128) -> None:
    print(f"\n3. Per-sample gradients of a small MLP (784-128-10), batch of {batch}")
    import torch.nn.functional as F
    torch.manual_seed(0)
    params = {"w1": torch.randn(128, 784) * 0.03, "b1": torch.zeros(128),
              "w2": torch.randn(10, 128) * 0.1, "b2": torch.zeros(10)}
    xs, ys = torch.randn(batch, 784), torch.randint(0, 10, (batch,))

    def loss(p, x, y):
        h = F.relu(F.linear(x, p["w1"], p["b1"]))
        return F.cross_entropy(F.linear(h, p["w2"], p["b2"]), y)

    def by_loop():
        out = {k: [] for k in params}
        for x, y in zip(xs, ys):
            ps = {k: v.clone().requires_grad_() for k, v in params.items()}
            grads = torch.autograd.grad(loss(ps, x, y), list(ps.values()))
            for k, g in zip(ps, grads):
                out[k].append(g)
        return {k: torch.stack(v) for k, v in out.items()}

    per_sample = functrans.vmap(functrans.grad(loss), in_dims=(None, 0, 0))
    got, expected = per_sample(params, xs, ys), by_loop()
    same = _close(got, expected)
    t_loop, t_vmap = _time(by_loop, 3), _time(lambda: per_sample(params, xs, ys), 3)
    print(f"   results equal: {same}   (gradient of w1 per sample: {tuple(got['w1'].shape)})")
    print(f"   Python loop of autograd.grad: {t_loop * 1e3:8.2f} ms")
    print(f"   vmap(grad(loss))            : {t_vmap * 1e3:8.2f} ms   ({t_loop / t_vmap:.1f}x faster)")


def main() -> None:
    torch.set_num_threads(1)
    print(f"functrans {functrans.__version__} on torch {torch.__version__} (1 CPU thread)\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", functrans.PerformanceWarning)
        demo_vmap()
        demo_release_notes_jacobian()
        demo_per_sample_gradients()


if __name__ == "__main__":
    main()
