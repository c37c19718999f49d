# %% [markdown]
# # Model ensembling: training N models at once
#
# Ensembles, hyperparameter sweeps over seeds and bootstrap estimates all train several models
# of **the same architecture** side by side. Calling each model in a Python loop launches every
# small kernel N times. Instead, stack the N models' parameters along a new leading dim and
# `vmap` one functional forward over that dim: every layer then runs once, as one batched
# kernel, for all members.
#
# This notebook follows the `torch.func` ensembling recipe with functrans
# (`stack_module_state` + `functional_call` + `vmap`), checks it against running each model
# separately, then uses the `functrans.Ensemble` convenience class to train all members with
# one optimizer, and times both against the loop.

# %%
import copy
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
print("device:", device)


def sync():
    """Wait for the work queued on a GPU (nothing to wait for on the CPU): the timings below
    read the clock only after it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
print("torch", torch.__version__, "| functrans", ft.__version__)

# %% [markdown]
# ## N models of one architecture
#
# Four small MLP classifiers, each with its own random initialization.

# %%
def make_model():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10)).to(device)


num_models = 4
models = [make_model() for _ in range(num_models)]

# %% [markdown]
# ## Stack their state
#
# `stack_module_state(models)` returns two dicts, parameters and buffers, in which every tensor
# is the N models' tensors stacked along a new dim 0. The stacked parameters are new leaf
# tensors that require grad (the original models are not touched).

# %%
params, buffers = ft.stack_module_state(models)
{name: tuple(p.shape) for name, p in params.items()}

# %% [markdown]
# `functional_call` needs a module to supply the *code* of the forward; the tensors come from the
# dicts we pass. As in the `torch.func` tutorial we use a copy of one model moved to the
# `"meta"` device: it has no data at all, so it is impossible for the computation to silently
# read a real model's weights instead of the stacked ones.

# %%
base = copy.deepcopy(models[0]).to("meta")


def fmodel(params, buffers, x):              # ONE model: params of one member
    return ft.functional_call(base, (params, buffers), (x,))

# %% [markdown]
# ## Option 1: the same minibatch for every model
#
# `in_dims=(0, 0, None)`: map over dim 0 of the parameters and buffers, and give every member
# the whole (unmapped) minibatch `x`. The output gets a leading member dim.

# %%
x = torch.randn(64, 16, device=device)                      # one minibatch of 64 examples

with ft.config.strict_fallback():            # raises if an op would run on the slow loop
    out_shared = ft.vmap(fmodel, in_dims=(0, 0, None))(params, buffers, x)
print(out_shared.shape)                      # [num_models, 64, 10]

with torch.no_grad():
    expected = torch.stack([m(x) for m in models])
torch.testing.assert_close(out_shared, expected)
print("vmap over the stacked models == each model run separately")

# %% [markdown]
# ## Option 2: a different minibatch for each model
#
# `in_dims=(0, 0, 0)`: the data is mapped too, so member `i` sees `xs[i]` (useful for bagging,
# or for training each member on its own shuffle of the data).

# %%
xs = torch.randn(num_models, 64, 16, device=device)         # minibatch i is for model i

with ft.config.strict_fallback():
    out_own = ft.vmap(fmodel, in_dims=(0, 0, 0))(params, buffers, xs)

with torch.no_grad():
    expected = torch.stack([m(xi) for m, xi in zip(models, xs)])
torch.testing.assert_close(out_own, expected)
print(out_own.shape, "== each model on its own minibatch")

# %% [markdown]
# The same code with `torch.func` gives the same numbers (only `functional_call` and `vmap`
# come from another module):

# %%
def torch_func_fmodel(params, buffers, x):
    return torch.func.functional_call(base, (params, buffers), (x,))


ref_shared = torch.func.vmap(torch_func_fmodel, in_dims=(0, 0, None))(params, buffers, x)
ref_own = torch.func.vmap(torch_func_fmodel, in_dims=(0, 0, 0))(params, buffers, xs)
torch.testing.assert_close(out_shared, ref_shared)
torch.testing.assert_close(out_own, ref_own)
print("functrans == torch.func")

# %% [markdown]
# ## Training: `functrans.Ensemble`
#
# `Ensemble(models)` wraps the recipe above: it stacks the state, keeps a copy of the first model
# as the skeleton, and calls `vmap(functional_call)` for you. `ens(x)` shares `x` between the
# members, `ens(xs, shared=False)` gives `xs[i]` to member `i`. `ens.parameters()` are the
# stacked leaf tensors, so a single ordinary optimizer trains all members.
#
# Why is one optimizer over stacked parameters the same as N optimizers? The members' losses
# do not share parameters, so the gradient of their **sum** w.r.t. member `i`'s slice is the
# gradient of member `i`'s own loss; and SGD/Adam update each coordinate independently. Let's
# check it: train the ensemble for 3 Adam steps, each member on its own minibatch, and do the
# same with 4 separate models and 4 separate Adam optimizers.

# %%
ens = ft.Ensemble(models)
ens_opt = torch.optim.Adam(ens.parameters(), lr=1e-2)

separate = [copy.deepcopy(m) for m in models]              # reference: 4 independent runs
separate_opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in separate]

data = [(torch.randn(num_models, 32, 16, device=device),
         torch.randint(0, 10, (num_models, 32), device=device))
        for _ in range(3)]
for step, (xb, yb) in enumerate(data):
    # all members at once: one forward, one backward, one optimizer step
    with ft.config.strict_fallback():
        logits = ens(xb, shared=False)                     # [4, 32, 10]
    per_member = F.cross_entropy(logits.transpose(1, 2), yb, reduction="none").mean(1)  # [4]
    ens_opt.zero_grad()
    per_member.sum().backward()
    ens_opt.step()

    # the loop
    for i, (m, opt) in enumerate(zip(separate, separate_opts)):
        loss_i = F.cross_entropy(m(xb[i]), yb[i])
        opt.zero_grad()
        loss_i.backward()
        opt.step()
        torch.testing.assert_close(per_member[i], loss_i)
    print(f"step {step}: member losses", [round(v, 4) for v in per_member.tolist()])

for name, stacked in ens.named_parameters():
    torch.testing.assert_close(
        stacked.detach(), torch.stack([dict(m.named_parameters())[name].detach()
                                       for m in separate]))
print("after 3 steps: ensemble parameters == the 4 separately trained models' parameters")

# %% [markdown]
# `ens.members()` turns the stacked state back into ordinary modules, e.g. to save or deploy
# one member:

# %%
member_2 = ens.members()[2]
with torch.no_grad():
    torch.testing.assert_close(member_2(x), separate[2](x))
print(type(member_2).__name__, "member 2 == separately trained model 2")

# %% [markdown]
# ## Timing: one training step for N models
#
# We time one full training step (forward, loss, backward, SGD step) for N = 1 … 32 members
# sharing one minibatch of 64 examples:
#
# - **loop**: N models, N optimizers, one after the other;
# - **torch.func**: the recipe above with `torch.func.vmap`, one optimizer on the stacked state;
# - **functrans**: `Ensemble`, under `strict_fallback()`.
#
# Each number is the best of 7 runs (each the mean of 3 calls) after a warm-up; as `timeit`
# recommends, slower runs only measure interference from other processes. These are tiny
# models (on a CPU with one thread, or on a GPU), where the cost per step is mostly per-kernel
# overhead: this is exactly what batching the members removes. How much is gained depends on
# that share: try a wider `make_model` to see the picture change when the arithmetic dominates.

# %%
def best_time(fn, repeats=7, number=3):
    """Best of `repeats` runs of the mean time of `number` calls, after a warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(number):
            fn()
        sync()
        times.append((time.perf_counter() - start) / number)
    return min(times)


x_shared, y_shared = torch.randn(64, 16, device=device), torch.randint(0, 10, (64,), device=device)


def ensemble_loss(out):                                    # out: [N, 64, 10] -> summed losses
    n = out.shape[0]
    return F.cross_entropy(out.transpose(1, 2), y_shared.expand(n, -1))


member_counts = [1, 2, 4, 8, 16, 32]
timings = {"loop": [], "torch.func": [], "functrans": []}
for n in member_counts:
    ms = [make_model() for _ in range(n)]

    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in ms]

    def loop_step():
        for m, opt in zip(ms, opts):
            opt.zero_grad()
            F.cross_entropy(m(x_shared), y_shared).backward()
            opt.step()

    tf_params, tf_buffers = ft.stack_module_state(ms)
    tf_opt = torch.optim.SGD(tf_params.values(), lr=0.01)

    def torch_func_step():
        out = torch.func.vmap(torch_func_fmodel, in_dims=(0, 0, None))(tf_params, tf_buffers,
                                                                         x_shared)
        tf_opt.zero_grad()
        (ensemble_loss(out) * n).backward()
        tf_opt.step()

    e = ft.Ensemble(ms)
    e_opt = torch.optim.SGD(e.parameters(), lr=0.01)

    def functrans_step():
        out = e(x_shared)
        e_opt.zero_grad()
        (ensemble_loss(out) * n).backward()
        e_opt.step()

    timings["loop"].append(best_time(loop_step))
    timings["torch.func"].append(best_time(torch_func_step))
    with ft.config.strict_fallback():
        timings["functrans"].append(best_time(functrans_step))

for i, n in enumerate(member_counts):
    print(f"{n:3d} models: " + "  ".join(f"{k} {v[i] * 1e3:6.2f} ms"
                                         for k, v in timings.items()))

# %% [markdown]
# (`ensemble_loss(out) * n` is the sum of the N members' mean losses, the same objective the
# loop optimizes, member by member.)

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
for (label, ts), marker in zip(timings.items(), "o^s"):
    ax.plot(member_counts, [t * 1e3 for t in ts], marker + "-", label=label)
ax.set_xscale("log", base=2)
ax.set_xticks(member_counts, [str(n) for n in member_counts])
ax.set_xlabel("number of models")
ax.set_ylabel("ms per training step")
ax.set_title("Training N small MLPs, "
             + ("CPU, 1 thread" if device.type == "cpu" else str(device)) + " (this machine)")
ax.legend()
plt.show()

# %% [markdown]
# The loop's time grows roughly in proportion to N; the vmapped versions run the same number
# of (larger) kernels whatever N is, so they grow much more slowly. For one or two models the
# loop is fastest: vmap has a fixed cost per op, and functrans' dispatcher, being pure Python,
# pays a larger one than `torch.func`'s C++ batching rules. The plot shows where the lines
# cross on this machine.
#
# ## A note on BatchNorm
#
# A BatchNorm layer in training mode updates its running statistics in place. With
# `stack_module_state` / `Ensemble` those buffers are stacked too, so each member keeps and
# updates **its own** statistics, exactly like separate models:

# %%
def make_bn_model():
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(),
                         nn.Linear(32, 10)).to(device)


bn_models = [make_bn_model() for _ in range(num_models)]
bn_ens = ft.Ensemble(bn_models)                   # stacks running_mean / running_var too
xb = torch.randn(num_models, 8, 16, device=device)
with ft.config.strict_fallback():
    out = bn_ens(xb, shared=False)
expected = torch.stack([m(xi) for m, xi in zip(bn_models, xb)])   # updates each model's stats
torch.testing.assert_close(out, expected)
for name, stacked in bn_ens.buffers.items():
    torch.testing.assert_close(stacked, torch.stack([dict(m.named_buffers())[name]
                                                     for m in bn_models]))
print("outputs and updated running stats match the separate models:", list(bn_ens.buffers))

# %% [markdown]
# If instead the buffers are **not** batched (say all members share one set of running
# statistics), each member would write its own statistics into the same buffer. functrans
# refuses and says what to do:

# %%
bn_params, bn_buffers = ft.stack_module_state(bn_models)
bn_base = copy.deepcopy(bn_models[0]).to("meta")
one_set_of_buffers = {name: b[0] for name, b in bn_buffers.items()}


def bn_fmodel(params, buffers, x):
    return ft.functional_call(bn_base, (params, buffers), (x,))


try:
    ft.vmap(bn_fmodel, in_dims=(0, None, 0))(bn_params, one_set_of_buffers, xb)
except ft.UnsupportedUnderVmap as err:
    print(type(err).__name__ + ":", err)

# %% [markdown]
# One of the fixes it names is `replace_all_batch_norm_modules_(model)` (also in `torch.func`):
# every BatchNorm stops tracking running statistics and normalizes with the current batch's
# statistics only. The vmapped result then equals separate models modified the same way:

# %%
ft.replace_all_batch_norm_modules_(bn_base)
with ft.config.strict_fallback():
    out = ft.vmap(lambda p, x: ft.functional_call(bn_base, p, (x,)))(bn_params, xb)
no_stats = [ft.replace_all_batch_norm_modules_(copy.deepcopy(m)) for m in bn_models]
torch.testing.assert_close(out, torch.stack([m(xi) for m, xi in zip(no_stats, xb)]))
print("without running stats:", tuple(out.shape), "== separate models")

# %% [markdown]
# ## Summary
#
# - `stack_module_state(models)` + `vmap(functional_call(base, ...))` runs N same-architecture
#   models as one: `in_dims=(0, 0, None)` shares a minibatch, `in_dims=(0, 0, 0)` gives each
#   model its own; both equal the models run separately (and `torch.func`);
# - `Ensemble` packages this; one `torch.optim` optimizer over `ens.parameters()` gives the same
#   parameters as N optimizers over N models;
# - BatchNorm works with stacked buffers (per-member running stats), or without running stats
#   after `replace_all_batch_norm_modules_`.
