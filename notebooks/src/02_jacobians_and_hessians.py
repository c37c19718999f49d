# %% [markdown]
# # Jacobians and Hessians with functrans
#
# This notebook builds Jacobians the way `torch.func` (and JAX) users know: first by hand from
# `vjp`, then with `vmap`, then with `jacrev` / `jacfwd`. Then it covers Hessians, Hessian-vector
# products, and the features functrans adds on top of the `torch.func` API: `chunk_size=` for
# `jacfwd` and `hessian`, `has_aux=` for `hessian`, and nested forward mode
# (`jvp(jvp(f))`, `jacfwd(jacfwd(f))`).
#
# Every result is checked with `torch.testing.assert_close` against `torch.func` or
# `torch.autograd.functional`. Everything runs on a CPU in a few seconds (on a GPU when there is
# one: see `device` below).

# %%
import os
import time
from functools import partial

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import functrans as ft
from functrans import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

torch.manual_seed(0)
torch.set_num_threads(1)   # one thread: timings below are steadier and comparable between runs
# A GPU if there is one, else the CPU; FUNCTRANS_NOTEBOOK_DEVICE=cpu (or cuda) overrides.
device = torch.device(os.environ.get("FUNCTRANS_NOTEBOOK_DEVICE")
                      or ("cuda" if torch.cuda.is_available() else "cpu"))
# float32 stays float32 on a GPU: cuDNN's convolutions use TF32 (10-bit mantissas) by default on
# recent NVIDIA GPUs, which moves results by about 1e-3 and would fail the comparisons below.
torch.backends.cudnn.allow_tf32 = False
print("device:", device)


def sync():
    """Wait for the work queued on a GPU (nothing to wait for on the CPU): the timings below
    read the clock only after it."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_time(fn, repeats=5):
    """Median wall time of fn() in seconds, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]

# %% [markdown]
# ## The functorch release-notes example
#
# A one-layer network: `predict(weight, bias, x)` maps an input `x` of size `D` to `D` outputs.
# We want the Jacobian of the output with respect to `x`, a `D x D` matrix.

# %%
D = 16
weight = torch.randn(D, D, device=device)
bias = torch.randn(D, device=device)
x = torch.randn(D, device=device)


def predict(weight, bias, x):
    return F.linear(x, weight, bias).tanh()


reference = torch.func.jacrev(predict, argnums=2)(weight, bias, x)   # the oracle
reference.shape

# %% [markdown]
# ### Row by row with `vjp`
#
# `vjp` runs the function once and returns a `vjp_fn` that maps a cotangent `u` (same shape as
# the output) to `u^T J`. Feeding it the unit vector `e_i` gives row `i` of the Jacobian, so a
# Python loop over the rows of the identity builds the whole matrix. `vjp_fn` returns one
# gradient per primal, hence the `[0]`.

# %%
_, vjp_fn = vjp(partial(predict, weight, bias), x)
unit_vectors = torch.eye(D, device=device)

jac_loop = torch.stack([vjp_fn(e)[0] for e in unit_vectors])
assert_close(jac_loop, reference)
jac_loop.shape

# %% [markdown]
# ### All rows at once with `vmap(vjp_fn)`
#
# The loop calls the backward pass `D` times. `vmap` runs `vjp_fn` once on the whole batch of
# unit vectors: the backward ops see a batched cotangent and run as batched kernels.

# %%
jac_vmap = vmap(vjp_fn)(unit_vectors)[0]
assert_close(jac_vmap, reference)

# %% [markdown]
# ### `jacrev` and `jacfwd`
#
# `jacrev` packages exactly that: `vjp`, then `vmap` over the standard basis of the output.
# `jacfwd` is its forward-mode twin: `vmap` of `jvp` over the standard basis of the *input*,
# which gives the Jacobian column by column. `argnums=2` picks `x`.

# %%
jac_rev = jacrev(predict, argnums=2)(weight, bias, x)
jac_fwd = jacfwd(predict, argnums=2)(weight, bias, x)

for name, jac in [("loop", jac_loop), ("vmap(vjp_fn)", jac_vmap),
                  ("jacrev", jac_rev), ("jacfwd", jac_fwd)]:
    assert_close(jac, reference)
    print(f"{name:>13}: matches torch.func.jacrev")

# %% [markdown]
# ## How the cost grows with `D`
#
# We time the three reverse-mode routes for `D = 16, 64, 256` (medians of 5 runs), and `jacrev`
# once more compiled with `ft.compile` (traced once per size into one graph of ATen ops, then
# replayed). The row loop and `vmap(vjp_fn)` reuse one forward pass; `jacrev` includes its
# forward pass. Each result is checked against `torch.func.jacrev` before it is timed.

# %%
sizes = [16, 64, 256]
timings = {"row loop": [], "vmap(vjp_fn)": [], "jacrev": [], "compiled jacrev": []}
jacrev_compiled = ft.compile(jacrev(predict, argnums=2))
for d in sizes:
    w = torch.randn(d, d, device=device)
    b, xd = torch.randn(d, device=device), torch.randn(d, device=device)
    ref = torch.func.jacrev(predict, argnums=2)(w, b, xd)
    _, fn = vjp(partial(predict, w, b), xd)
    eye = torch.eye(d, device=device)
    routes = {
        "row loop": lambda: torch.stack([fn(e)[0] for e in eye]),
        "vmap(vjp_fn)": lambda: vmap(fn)(eye)[0],
        "jacrev": lambda: jacrev(predict, argnums=2)(w, b, xd),
        "compiled jacrev": lambda: jacrev_compiled(w, b, xd),
    }
    for name, route in routes.items():
        assert_close(route(), ref)
        timings[name].append(median_time(route))

print("D     " + "".join(f"{name:>17}" for name in timings))
for i, d in enumerate(sizes):
    print(f"{d:<6}" + "".join(f"{timings[name][i] * 1e3:>14.2f} ms" for name in timings))

# %%
fig, ax = plt.subplots(figsize=(5.5, 3.5))
for name, ts in timings.items():
    ax.plot(sizes, [t * 1e3 for t in ts], marker="o", label=name)
ax.set_xscale("log", base=2)
ax.set_xticks(sizes, [str(d) for d in sizes])
ax.set_yscale("log")
ax.set_xlabel("D (Jacobian is D x D)")
ax.set_ylabel("median time [ms]")
ax.set_title("Jacobian of tanh(Wx + b), "
             + ("one CPU thread" if device.type == "cpu" else str(device)))
ax.legend()
plt.show()

# %% [markdown]
# On this machine the loop's time grows with the number of rows, while `vmap(vjp_fn)` and
# `jacrev` push all rows through one batched backward pass (the numbers above; they vary with
# the machine). The compiled `jacrev` runs the same ops without functrans's per-op dispatch, which
# matters most at small `D`, where that dispatch is most of the time.

# %% [markdown]
# ## `jacrev` or `jacfwd`?
#
# For `f: R^n -> R^m` the Jacobian is `m x n`. `jacrev` pushes one cotangent per **output**
# (`m` rows), `jacfwd` one tangent per **input** (`n` columns). So:
#
# * **wide** Jacobians (many inputs, few outputs, e.g. a loss of many parameters): `jacrev`;
# * **tall** Jacobians (few inputs, many outputs): `jacfwd`.
#
# Both are batched, so the difference is smaller than `m` vs `n` loop iterations, but it shows:

# %%
def make_f(n, m):
    A = torch.randn(m, n, device=device) / n ** 0.5
    return lambda v: torch.tanh(A @ v)


rows = []
for kind, n, m in [("wide", 2048, 4), ("tall", 4, 2048)]:
    f, v = make_f(n, m), torch.randn(n, device=device)
    assert_close(jacrev(f)(v), torch.func.jacrev(f)(v))
    assert_close(jacfwd(f)(v), torch.func.jacrev(f)(v))
    t_rev = median_time(lambda: jacrev(f)(v))
    t_fwd = median_time(lambda: jacfwd(f)(v))
    rows.append(f"{kind} {m:>4} x {n:<4}  jacrev {t_rev * 1e3:6.2f} ms  "
                f"jacfwd {t_fwd * 1e3:6.2f} ms")
print("\n".join(rows))

# %% [markdown]
# ## `argnums`: Jacobians with respect to several arguments
#
# As in `torch.func`, `argnums` may be a tuple; the result is then a tuple with one Jacobian per
# chosen argument. Each block has shape `output.shape + argument.shape`.

# %%
jac_w, jac_b = jacrev(predict, argnums=(0, 1))(weight, bias, x)
print(jac_w.shape, jac_b.shape)

ref_w, ref_b = torch.func.jacrev(predict, argnums=(0, 1))(weight, bias, x)
assert_close(jac_w, ref_w)
assert_close(jac_b, ref_b)
fwd_w, fwd_b = jacfwd(predict, argnums=(0, 1))(weight, bias, x)
assert_close(fwd_w, ref_w)
assert_close(fwd_b, ref_b)

# %% [markdown]
# ## Batched Jacobians: `vmap(jacrev(f))`
#
# Transforms compose. To get one Jacobian per input of a batch, `vmap` the Jacobian function,
# mapping only `x` (`in_dims=(None, None, 0)`: the weights are shared).

# %%
xs = torch.randn(8, D, device=device)
batched = vmap(jacrev(predict, argnums=2), in_dims=(None, None, 0))(weight, bias, xs)
print(batched.shape)                      # [batch, D, D]

loop = torch.stack([torch.func.jacrev(predict, argnums=2)(weight, bias, xi) for xi in xs])
assert_close(batched, loop)
assert_close(vmap(jacfwd(predict, argnums=2), in_dims=(None, None, 0))(weight, bias, xs), loop)

# %% [markdown]
# ## Hessians
#
# `hessian(f)` is `jacfwd(jacrev(f))`: forward-mode over reverse-mode (see
# `functrans/autodiff/jacobians.py`). `jacrev(jacrev(f))` gives the same matrix.

# %%
def energy(v):
    return (v.sin() * v).sum() + torch.tanh(v @ weight @ v)


H = hessian(energy)(x)
print(H.shape)
assert_close(H, torch.autograd.functional.hessian(energy, x))
assert_close(jacfwd(jacrev(energy))(x), H)
assert_close(jacrev(jacrev(energy))(x), H)

# %% [markdown]
# ## Hessian-vector products without the Hessian
#
# `H @ v` is the directional derivative of the gradient: `jvp(grad(f), (x,), (v,))`
# (forward-over-reverse). It never builds the `D x D` matrix. `vmap` over `v` gives several
# products at once.

# %%
def hvp(v_dir):
    return jvp(grad(energy), (x,), (v_dir,))[1]


v = torch.randn(D, device=device)
assert_close(hvp(v), H @ v)

vs = torch.randn(5, D, device=device)
assert_close(vmap(hvp)(vs), vs @ H.T)      # five HVPs in one call

# %% [markdown]
# ## What functrans adds
#
# The `torch.func` signatures in this PyTorch have no `chunk_size` for `jacfwd` and `hessian`, and
# no `has_aux` for `hessian`:

# %%
import inspect

for fn in (torch.func.jacfwd, torch.func.hessian, ft.jacfwd, ft.hessian):
    print(f"{fn.__module__:>24}.{fn.__name__}{inspect.signature(fn)}")

# %% [markdown]
# ### `chunk_size=`: bounded memory, same answer
#
# `jacrev`, `jacfwd` and `hessian` push the basis vectors through `vmap`; `chunk_size=k` pushes
# at most `k` of them at a time, so the batched intermediates are `k` rows instead of `D`. The
# result does not change:

# %%
assert_close(jacfwd(predict, argnums=2, chunk_size=4)(weight, bias, x), reference)
assert_close(jacrev(predict, argnums=2, chunk_size=4)(weight, bias, x), reference)
assert_close(hessian(energy, chunk_size=4)(x), H)
assert_close(hessian(energy, chunk_size=1)(x), H)
print("chunked Jacobians and Hessians match")

# %% [markdown]
# ### `has_aux=True` for `hessian`
#
# The function returns `(scalar, aux)`; `aux` is passed through untouched, as with `grad`.

# %%
def energy_with_stats(v):
    e = energy(v)
    return e, {"energy": e.detach(), "norm": v.norm().detach()}


H_aux, stats = hessian(energy_with_stats, has_aux=True)(x)
assert_close(H_aux, H)
assert_close(stats["energy"], energy(x))
stats

# %% [markdown]
# ### Nested forward mode: `jvp(jvp(f))` and `jacfwd(jacfwd(f))`
#
# PyTorch's own forward AD (`torch.autograd.forward_ad`) cannot open a dual level inside
# another:

# %%
import torch.autograd.forward_ad as fwAD

try:
    with fwAD.dual_level():
        with fwAD.dual_level():
            pass
except RuntimeError as e:
    print("RuntimeError:", e)

# %% [markdown]
# functrans's `jvp` builds on `forward_ad`, so when a `jvp` starts while forward AD is already
# active it computes its product by the double-vjp identity instead (reverse mode twice; see
# `functrans/autodiff/jvp.py`). Nested forward mode then just works. The second directional
# derivative `u^T H w` and the forward-over-forward Hessian are checked against `H` and against
# `torch.func`:

# %%
u, w_dir = torch.randn(D, device=device), torch.randn(D, device=device)


def directional(v):                      # d energy(v) [u]
    return jvp(energy, (v,), (u,))[1]


_, second = jvp(directional, (x,), (w_dir,))    # d^2 energy(x) [u, w]
assert_close(second, u @ H @ w_dir)

ref_second = torch.func.jvp(lambda v: torch.func.jvp(energy, (v,), (u,))[1], (x,), (w_dir,))[1]
assert_close(second, ref_second)

H_fwd_fwd = jacfwd(jacfwd(energy))(x)
assert_close(H_fwd_fwd, H)
assert_close(H_fwd_fwd, torch.func.jacfwd(torch.func.jacfwd(energy))(x))
print("jvp(jvp(f)) and jacfwd(jacfwd(f)) match")

# %% [markdown]
# ## Summary
#
# * A Jacobian is a batch of vjps (`jacrev`, one per output) or of jvps (`jacfwd`, one per input);
#   `vmap` runs the batch as one call instead of a Python loop.
# * Choose `jacrev` for wide Jacobians and `jacfwd` for tall ones; `hessian` is
#   `jacfwd(jacrev(f))`; `jvp(grad(f))` gives Hessian-vector products without the Hessian.
# * `argnums`, `vmap(jacrev(f))` and the other compositions behave as in `torch.func`.
# * functrans adds `chunk_size` for `jacfwd` and `hessian`, `has_aux` for `hessian`, and nested
#   forward mode on top of PyTorch's forward AD.
