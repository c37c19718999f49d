# %% [markdown]
# # Per-sample gradients with functrans
#
# An ordinary backward pass gives you the gradient of the *mean* (or sum) loss over a batch.
# Several techniques need the gradient of **each example's** loss separately:
#
# - **DP-SGD** (differentially private training, as in Opacus) clips every example's gradient
#   to a maximum norm before summing, then adds noise;
# - **influence functions / data attribution** compare per-example gradients with each other;
# - **gradient-norm diagnostics** look at the distribution of per-example gradient norms to
#   spot mislabelled or outlying examples.
#
# This notebook shows the naive loop, then the functrans recipe (the same one as `torch.func`:
# `vmap(grad(loss))` over `functional_call`), checks that they agree, times them, and ends with
# a DP-SGD step and a recurrent model.

# %%
import os
import time

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn

import functrans as ft

torch.manual_seed(0)
# One thread: the timings below then compare algorithms, not how well each one uses the cores.
torch.set_num_threads(1)
# A GPU if there is one, else the CPU; FUNCTRANS_NOTEBOOK_DEVICE=cpu (or cuda) overrides.
device = torch.device(os.environ.get("FUNCTRANS_NOTEBOOK_DEVICE")
                      or ("cuda" if torch.cuda.is_available() else "cpu"))
# float32 stays float32 on a GPU: cuDNN's convolutions use TF32 (10-bit mantissas) by default on
# recent NVIDIA GPUs, which moves results by about 1e-3 and would fail the comparisons below.
torch.backends.cudnn.allow_tf32 = False
print("torch", torch.__version__, "| functrans", ft.__version__, "| device", device)

# %% [markdown]
# ## A model and a batch
#
# A small MLP classifier on 64 features, and a batch of 32 examples.

# %%
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
xs = torch.randn(32, 64, device=device)
ys = torch.randint(0, 10, (32,), device=device)

# %% [markdown]
# ## The naive way: one backward per example
#
# The definition of a per-sample gradient is simply: run forward and backward on a batch of one,
# store the gradients, repeat. It is correct, but it is a Python loop of tiny kernels.

# %%
def loop_per_sample_grads(model, xs, ys):
    rows = []
    for x, y in zip(xs, ys):
        loss = F.cross_entropy(model(x[None]), y[None])          # a batch of one
        rows.append(torch.autograd.grad(loss, list(model.parameters())))
    names = [name for name, _ in model.named_parameters()]
    return {name: torch.stack([r[j] for r in rows]) for j, name in enumerate(names)}


expected = loop_per_sample_grads(model, xs, ys)
{name: tuple(g.shape) for name, g in expected.items()}

# %% [markdown]
# ## The functrans recipe
#
# 1. `functional_call(model, params, args)` runs the module with the parameters you pass in, so
#    the loss becomes a plain function of `params`.
# 2. Write the loss for **one** example (we add a batch dim of 1 because `nn.Linear` and
#    `cross_entropy` expect one).
# 3. `grad(loss)` differentiates it w.r.t. its first argument (the `params` dict).
# 4. `vmap(..., in_dims=(None, 0, 0))` maps it over the batch: `params` is shared
#    (`None`), `x` and `y` are split along dim 0.
#
# If you know `torch.func`, this is the same code with `torch.func` replaced by `functrans`.

# %%
params = {name: p.detach() for name, p in model.named_parameters()}


def example_loss(params, x, y):                                 # ONE example
    logits = ft.functional_call(model, params, (x[None],))
    return F.cross_entropy(logits, y[None])


per_sample_grads = ft.vmap(ft.grad(example_loss), in_dims=(None, 0, 0))

with ft.config.strict_fallback():        # raises if any op would run on the slow loop fallback
    grads = per_sample_grads(params, xs, ys)
{name: tuple(g.shape) for name, g in grads.items()}

# %% [markdown]
# Every entry has a leading dim of 32: one gradient per example. Check it against the loop and
# against `torch.func` on the same inputs:

# %%
def torch_func_loss(params, x, y):
    return F.cross_entropy(torch.func.functional_call(model, params, (x[None],)), y[None])


torch_func_per_sample_grads = torch.func.vmap(torch.func.grad(torch_func_loss),
                                              in_dims=(None, 0, 0))
reference = torch_func_per_sample_grads(params, xs, ys)

torch.testing.assert_close(grads, expected)
torch.testing.assert_close(grads, reference)
print("functrans == for-loop == torch.func")

# %% [markdown]
# ## A small CNN on 28×28 images
#
# Nothing changes for convolutional models: the same three lines work for any `nn.Module`
# whose forward treats the examples independently. Here `record_fallbacks()` records every op
# that fell back to the per-example loop; it stays empty.

# %%
class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 7 * 7, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)             # 28 -> 14
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)             # 14 -> 7
        return self.fc(x.flatten(1))


cnn = SmallCNN().to(device)
cnn_params = {name: p.detach() for name, p in cnn.named_parameters()}
images = torch.randn(16, 1, 28, 28, device=device)
labels = torch.randint(0, 10, (16,), device=device)


def cnn_loss(params, x, y):
    return F.cross_entropy(ft.functional_call(cnn, params, (x[None],)), y[None])


with ft.record_fallbacks() as report:
    cnn_grads = ft.vmap(ft.grad(cnn_loss), in_dims=(None, 0, 0))(cnn_params, images, labels)
print("loop fallbacks:", report)
assert not report

torch.testing.assert_close(cnn_grads, loop_per_sample_grads(cnn, images, labels))
print({name: tuple(g.shape) for name, g in cnn_grads.items()})

# %% [markdown]
# ## How much faster than the loop?
#
# We time the MLP's per-sample gradients for several batch sizes: the loop, `torch.func`, and
# functrans (under `strict_fallback()`, so the timed code provably takes no loop fallback).
# Each timing is the best of 7 runs (each the mean of 3 calls) after a warm-up; as `timeit`
# recommends, slower runs only measure interference from other processes. The numbers depend
# on the machine; the plot below is what this one measured.

# %%
def best_time(fn, repeats=7, number=3):
    """Best of `repeats` runs of the mean time of `number` calls, after a warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()       # a GPU runs asynchronously: wait before each clock read
        start = time.perf_counter()
        for _ in range(number):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / number)
    return min(times)


batch_sizes = [8, 32, 128, 256]
timings = {"loop": [], "torch.func": [], "functrans": []}
for b in batch_sizes:
    xb, yb = torch.randn(b, 64, device=device), torch.randint(0, 10, (b,), device=device)
    timings["loop"].append(best_time(lambda: loop_per_sample_grads(model, xb, yb)))
    timings["torch.func"].append(best_time(lambda: torch_func_per_sample_grads(params, xb, yb)))
    with ft.config.strict_fallback():
        timings["functrans"].append(best_time(lambda: per_sample_grads(params, xb, yb)))

for i, b in enumerate(batch_sizes):
    print(f"batch {b:4d}: " + "  ".join(f"{k} {v[i] * 1e3:7.2f} ms" for k, v in timings.items()))

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
ours = torch.tensor(timings["functrans"])
ax.plot(batch_sizes, torch.tensor(timings["loop"]) / ours, "o-", label="loop time / functrans time")
ax.plot(batch_sizes, torch.tensor(timings["torch.func"]) / ours, "s-",
        label="torch.func time / functrans time")
ax.axhline(1.0, color="gray", lw=0.8, ls="--")
ax.set_xscale("log", base=2)
ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
ax.set_xlabel("batch size")
ax.set_ylabel("speedup of functrans (×)")
ax.set_title("Per-sample gradients of an MLP, "
             + ("CPU, 1 thread" if device.type == "cpu" else str(device)) + " (this machine)")
ax.legend()
plt.show()

# %% [markdown]
# Above the dashed line functrans is faster than the other method. The loop's cost grows with
# the batch size while the vmapped version runs a handful of batched kernels, so the gap to the
# loop widens with the batch. `torch.func`'s batching rules are in C++ while functrans' dispatcher
# is pure Python, so a ratio below 1 against `torch.func` means that per-op overhead shows on
# a model this small.
#
# ## On a GPU: speed-up against the batch size
#
# The project's GPU benchmark (`python -m benchmarks.gpu --device cuda`, see the README) timed
# the same recipe on an NVIDIA H200 for a 784-512-256-10 MLP and a small CNN at B = 64, 512 and
# 4096, with every result checked against `torch.func` first. This cell plots that stored run
# (`benchmarks/results/`), not this machine: the speed-up over the Python loop of functrans
# eager, `functrans.compile` (CUDA graphs backend) and `torch.func`. On that machine eager
# functrans is host-bound below B = 4096 (every batched op crosses into Python), and the
# compiled function removes that cost.

# %%
import json
import pathlib

gpu = json.loads(next(pathlib.Path("../benchmarks/results").glob("gpu_*.json")).read_text())
gpu_rows = {(r["workload"], r["size"]): r["times"] for r in gpu["rows"] if "times" in r}
gpu_batches = [64, 512, 4096]
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
for ax, arch in zip(axes, ("MLP", "CNN")):
    gpu_times = [gpu_rows[(f"per-sample grads {arch}", f"B={b}")] for b in gpu_batches]
    for cell, label, marker in (("functrans", "functrans (eager)", "o"),
                                ("ft.compile cudagraphs", "functrans.compile (cudagraphs)", "s"),
                                ("torch.func", "torch.func (eager)", "^")):
        ax.plot(gpu_batches, [t["loop"] / t[cell] for t in gpu_times], marker=marker, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(gpu_batches, [str(b) for b in gpu_batches])
    ax.set_xlabel("batch size")
    ax.set_title(f"per-sample gradients, {arch}")
axes[0].set_ylabel("speed-up over the Python loop (×)")
axes[0].legend(fontsize=8)
fig.suptitle(gpu["device"].split(";")[0] + " (stored run: " + gpu["device"].split("; ")[-1] + ")",
             fontsize=9)
plt.show()
for arch in ("MLP", "CNN"):
    for b in gpu_batches:
        t = gpu_rows[(f"per-sample grads {arch}", f"B={b}")]
        print(f"{arch} B={b:5d}: loop {t['loop'] * 1e3:8.1f} ms, functrans {t['functrans'] * 1e3:6.2f}"
              f" ms, compiled {t['ft.compile cudagraphs'] * 1e3:6.2f} ms, torch.func "
              f"{t['torch.func'] * 1e3:6.2f} ms")

# %% [markdown]
# ## Per-sample gradient norms
#
# With all gradients at hand, per-example diagnostics are one line. The total norm of example
# `i` is the L2 norm over all parameters' gradients together (as DP-SGD clips it):

# %%
xb, yb = torch.randn(256, 64, device=device), torch.randint(0, 10, (256,), device=device)
with ft.config.strict_fallback():
    g = per_sample_grads(params, xb, yb)
norms = torch.cat([t.flatten(1) for t in g.values()], dim=1).norm(dim=1)   # [256]

max_norm = float(norms.median())   # DP-SGD's clipping threshold below: here the median norm

plt.figure(figsize=(6, 3))
plt.hist(norms.cpu().numpy(), bins=30)
plt.axvline(max_norm, color="k", ls="--", label=f"max_norm = {max_norm:.2f} (median)")
plt.legend()
plt.xlabel("per-example gradient norm")
plt.ylabel("examples")
plt.title("Gradient norms of 256 examples (untrained MLP)")
plt.show()

# %% [markdown]
# ## One DP-SGD step
#
# `functrans.nn.dp_sgd_grads` packages the DP-SGD recipe (Abadi et al., 2016; the clipping
# factor matches Opacus): per-example gradients with `vmap(grad)`, each example's total gradient
# clipped to `max_norm`, the sum over the batch, Gaussian noise with standard deviation
# `noise_multiplier * max_norm` from a seeded generator, and (`reduction="mean"`) division by
# the batch size. `assign_grads` writes the result into `p.grad`, so any `torch.optim`
# optimizer can step.
#
# To check it, rebuild the same gradient by hand from the per-sample gradients above: clip,
# sum, add the noise drawn from a (CPU) generator with the same seed (parameter by parameter, in
# `named_parameters()` order, then moved to the gradients' device), divide by the batch size.
# The clipping threshold `max_norm` is a hyperparameter; here it is the median norm from the
# histogram, so about half the examples get clipped.

# %%
from functrans.nn import assign_grads, dp_sgd_grads

noise_multiplier, seed = 1.1, 0
with ft.config.strict_fallback():
    noisy, dp_norms = dp_sgd_grads(model, F.cross_entropy, (xb, yb), max_norm=max_norm,
                                   noise_multiplier=noise_multiplier, seed=seed,
                                   reduction="mean", return_norms=True)

# the same step by hand
factor = (max_norm / (norms + 1e-6)).clamp(max=1.0)            # Opacus' clipping factor
gen = torch.Generator().manual_seed(seed)
by_hand = {}
for name, per_example in g.items():
    clipped_sum = (factor.view(-1, *[1] * (per_example.dim() - 1)) * per_example).sum(0)
    noise = torch.randn(clipped_sum.shape, generator=gen).to(device)   # drawn on the CPU
    noise = noise * noise_multiplier * max_norm
    by_hand[name] = (clipped_sum + noise) / len(xb)

torch.testing.assert_close(dp_norms, norms)
torch.testing.assert_close(noisy, by_hand)
print(f"{(norms > max_norm).float().mean():.0%} of the examples were clipped; "
      "dp_sgd_grads == clip + sum + noise by hand")

# %% [markdown]
# Now the actual training step: assign the privatized gradient and let SGD update the model.

# %%
opt = torch.optim.SGD(model.parameters(), lr=0.1)
before = {name: p.detach().clone() for name, p in model.named_parameters()}
opt.zero_grad()
assign_grads(model, noisy)
opt.step()
for name, p in model.named_parameters():
    torch.testing.assert_close(p.detach(), before[name] - 0.1 * noisy[name])
print("one DP-SGD step taken: p <- p - lr * noisy_grad")

# %% [markdown]
# ## Recurrent models: `nn.GRU` and `nn.LSTM`
#
# functrans has batching rules for PyTorch's fused RNN kernels, so the same recipe gives
# per-sample gradients of `nn.GRU` and `nn.LSTM`. A tiny sequence regression with each,
# checked against the loop:

# %%
seqs = torch.randn(8, 6, 3, device=device)                   # 8 sequences of length 6
targets = torch.randn(8, 6, 5, device=device)


def rnn_loss_fn(rnn):
    def loss(params, seq, target):                             # seq: [T, 3], one sequence
        out, _ = ft.functional_call(rnn, params, (seq.unsqueeze(1),))   # [T, 1, 5]
        return ((out.squeeze(1) - target) ** 2).mean()
    return loss


for rnn in (nn.GRU(input_size=3, hidden_size=5).to(device),
            nn.LSTM(input_size=3, hidden_size=5).to(device)):
    rnn_params = {name: p.detach() for name, p in rnn.named_parameters()}
    with ft.config.strict_fallback():
        rnn_grads = ft.vmap(ft.grad(rnn_loss_fn(rnn)), in_dims=(None, 0, 0))(
            rnn_params, seqs, targets)

    rows = []                                                  # the loop
    for seq, target in zip(seqs, targets):
        out, _ = rnn(seq.unsqueeze(1))
        rows.append(torch.autograd.grad(((out.squeeze(1) - target) ** 2).mean(),
                                        list(rnn.parameters())))
    for j, name in enumerate(rnn_params):
        torch.testing.assert_close(rnn_grads[name], torch.stack([r[j] for r in rows]))
    print(f"{type(rnn).__name__}: per-sample gradients match the loop,",
          {name: tuple(t.shape) for name, t in rnn_grads.items()})

# %% [markdown]
# `torch.func` (in this PyTorch version) fails on the GRU: the same loss written with
# `torch.func.functional_call`, under `torch.func.vmap(torch.func.grad(...))`:

# %%
gru = nn.GRU(input_size=3, hidden_size=5).to(device)
gru_params = {name: p.detach() for name, p in gru.named_parameters()}


def torch_func_gru_loss(params, seq, target):
    out, _ = torch.func.functional_call(gru, params, (seq.unsqueeze(1),))
    return ((out.squeeze(1) - target) ** 2).mean()


try:
    torch.func.vmap(torch.func.grad(torch_func_gru_loss), in_dims=(None, 0, 0))(
        gru_params, seqs, targets)
    print("torch.func succeeded here")
except RuntimeError as err:
    print("torch.func raised RuntimeError:", str(err).splitlines()[0][:150])

# %% [markdown]
# ## Summary
#
# - `vmap(grad(loss), in_dims=(None, 0, 0))` over `functional_call(model, params, ...)` gives
#   per-example gradients of any `nn.Module` that treats examples independently (MLP, CNN, GRU
#   above), equal to the loop;
# - `strict_fallback()` / `record_fallbacks()` show whether anything ran on the slow loop;
# - `functrans.nn.dp_sgd_grads` + `assign_grads` turn that into a DP-SGD step for a plain
#   `torch.optim` optimizer.
