"""``python -m functrans``: a short demo of what functrans does, checked and timed."""
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
    same = torch.allclose(batched(xs), looped(), atol=1e-6)
    t_vmap = _time(lambda: batched(xs))
    t_loop = _time(looped)
    print(f"   results equal: {same}")
    print(f"   Python loop: {t_loop * 1e3:8.2f} ms")
    print(f"   vmap       : {t_vmap * 1e3:8.2f} ms   ({t_loop / t_vmap:.1f}x faster)")


def main() -> None:
    torch.set_num_threads(1)
    print(f"functrans {functrans.__version__} on torch {torch.__version__} (1 CPU thread)\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", functrans.PerformanceWarning)
        demo_vmap()


if __name__ == "__main__":
    main()
