"""Test oracles: the for-loop oracle, batch builders with DIFFERENT examples, comparisons.

``loop_oracle(f, in_dims, size, *args)`` is the definition of vmap: slice each mapped argument
at its in_dim, call ``f`` per example, stack.  ``make_batch(sample, bdim, size)`` builds a batch
from one example by drawing each element separately (perturbing floating tensors, re-drawing
integer/bool ones in range), so a rule that mixes examples up cannot pass.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, List, Sequence

import torch
import torch.utils._pytree as pytree

import functrans


def _select(a, d, i):
    if d is None:
        return a
    return a.select(d, i)


def loop_oracle(f: Callable, in_dims: Sequence, size: int, *args, out_dim: int = 0, **kwargs):
    """``torch.stack([f(*args_i) for i in range(size)])`` with pytree outputs."""
    outs = []
    for i in range(size):
        outs.append(f(*[_select(a, d, i) for a, d in zip(args, in_dims)], **kwargs))
    flat0, spec = pytree.tree_flatten(outs[0])
    flats = [pytree.tree_flatten(o)[0] for o in outs]
    stacked = []
    for k, leaf in enumerate(flat0):
        if isinstance(leaf, torch.Tensor):
            stacked.append(torch.stack([fl[k] for fl in flats], out_dim))
        else:
            stacked.append(leaf)
    return pytree.tree_unflatten(stacked, spec)


def contiguous_loop(f: Callable, in_dims: Sequence, size: int, *args, **kwargs):
    """``loop_oracle`` with every example made contiguous first: the answer vmap must give
    whatever the layout of a batched operand (issue 25; tests.support.layouts)."""
    return loop_oracle(lambda *a: f(*[t.contiguous() if isinstance(t, torch.Tensor) else t
                                      for t in a]), in_dims, size, *args, **kwargs)


def perturb_like(x: torch.Tensor, i: int) -> torch.Tensor:
    """A different example of the same shape/dtype as ``x`` (deterministic in ``i``)."""
    g = torch.Generator().manual_seed(1234 + 7919 * i)
    if x.dtype == torch.bool:
        return torch.randint(0, 2, x.shape, generator=g).to(device=x.device, dtype=torch.bool)
    if x.dtype.is_floating_point or x.dtype.is_complex:
        noise = torch.randn(x.shape, generator=g, dtype=torch.float64)
        if x.dtype.is_complex:
            noise = torch.complex(noise, torch.randn(x.shape, generator=g, dtype=torch.float64))
        return (x.detach() + 0.1 * noise.to(x.device)).to(x.dtype)
    if x.numel() == 0:
        return x.clone()
    lo, hi = int(x.min()), int(x.max())
    if lo == hi:
        return x.clone()
    return torch.randint(lo, hi + 1, x.shape, generator=g).to(device=x.device, dtype=x.dtype)


def make_batch(x: torch.Tensor, bdim: int, size: int) -> torch.Tensor:
    """Stack ``size`` DIFFERENT examples shaped like ``x`` along ``bdim`` (may be negative)."""
    items = [x.detach().clone()] + [perturb_like(x, i) for i in range(1, size)]
    nd = x.dim() + 1
    return torch.stack(items, bdim % nd)


def bdim_choices(n_tensors: int, choices=(0, -1, None)) -> List[tuple]:
    """Every assignment of in_dims to ``n_tensors`` tensors, never all None."""
    return [c for c in itertools.product(choices, repeat=n_tensors)
            if any(d is not None for d in c)]


def assert_same(actual, expected, *, rtol=None, atol=None, msg=""):
    fa, sa = pytree.tree_flatten(actual)
    fe, se = pytree.tree_flatten(expected)
    assert sa == se, f"{msg}: output structures differ: {sa} vs {se}"
    for a, e in zip(fa, fe):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"{msg}: expected a tensor, got {type(a)}"
            assert a.shape == e.shape, f"{msg}: shape {tuple(a.shape)} != {tuple(e.shape)}"
            assert a.dtype == e.dtype, f"{msg}: dtype {a.dtype} != {e.dtype}"
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True, msg=msg or None)
        else:
            assert a == e, f"{msg}: {a!r} != {e!r}"


def check_vmap(f: Callable, args: Sequence[Any], in_dims: Sequence, *, size: int = 3,
               strict: bool = True, rtol=None, atol=None, **kwargs):
    """Build batches of DIFFERENT examples from per-example ``args`` and compare
    ``functrans.vmap(f, in_dims)`` against the loop oracle (strict: no fallback allowed)."""
    batched = [a if d is None else make_batch(a, d, size) for a, d in zip(args, in_dims)]
    expected = loop_oracle(f, in_dims, size, *batched, **kwargs)
    with functrans.config.strict_fallback(strict):
        actual = functrans.vmap(lambda *a: f(*a, **kwargs), in_dims=tuple(in_dims))(*batched)
    assert_same(actual, expected, rtol=rtol, atol=atol, msg=f"in_dims={tuple(in_dims)}")
    return actual


def check_vmap_all_bdims(f: Callable, args: Sequence[Any], *, size: int = 3, nested=True,
                         **kwargs):
    """``check_vmap`` over every in_dims choice in {0, -1, None} for the tensor arguments,
    and (``nested``) under a second vmap."""
    tensor_pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    for choice in bdim_choices(len(tensor_pos)):
        in_dims = [None] * len(args)
        for p, d in zip(tensor_pos, choice):
            in_dims[p] = d
        check_vmap(f, args, in_dims, size=size, **kwargs)
        if nested:
            inner = lambda *a: functrans.vmap(lambda *b: f(*b, **kwargs),
                                               in_dims=tuple(in_dims))(*a)
            batched = [a if d is None else make_batch(a, d, size) for a, d in zip(args, in_dims)]
            check_vmap(inner, batched, in_dims, size=2)


@contextlib.contextmanager
def float32_on_cuda(device="cuda"):
    """float32 kept float32 on a CUDA ``device`` for the block: no TF32 in cuDNN convolutions
    (on by default on Ampere and later: it moves results by ~1e-3, past the float32 tolerances
    of the oracles) nor in cuBLAS matmuls; both restored on exit.  Set through ``torch._C``:
    assigning ``torch.backends.cudnn.allow_tf32`` raises once op_db is imported, and
    ``cudnn.flags()`` rewrites every flag (and raises when the conv and RNN precisions differ).
    Nothing to do elsewhere."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        yield
        return
    cudnn, cublas = torch._C._get_cudnn_allow_tf32(), torch._C._get_cublas_allow_tf32()
    torch._C._set_cudnn_allow_tf32(False)
    torch._C._set_cublas_allow_tf32(False)
    try:
        yield
    finally:
        torch._C._set_cudnn_allow_tf32(cudnn)
        torch._C._set_cublas_allow_tf32(cublas)
