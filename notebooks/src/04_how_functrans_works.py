# %% [markdown]
# # How functrans works, and how to extend it
#
# This notebook opens up the `vmap` engine for readers who want to add to it:
#
# 1. **levels**: the thread-local stack of active transforms, and what a function under
#    `vmap(vmap(f))` actually receives;
# 2. **`BatchedTensor` and `__torch_dispatch__`**: how one ATen op finds its batching rule
#    (explicit rule, tag rule, derived rule, composite, decomposition, loop fallback);
# 3. **a batching rule for your own custom op**, written with the public rule-author API in
#    `functrans.extend`: before it, the op runs on the slow per-example loop (and says so);
#    after it, it runs as one batched call;
# 4. **the fallback report** on a real ATen op that still loops, and where its rule belongs.
#
# Some cells look at internals (`functrans._levels`, `functrans.batching.*`) to show the machinery;
# user code needs only `functrans` and `functrans.extend`.

# %%
import collections
import contextlib
import os
import time
import warnings

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import functrans as ft
from functrans import _levels, vmap
from functrans.batching.batched_tensor import BatchedTensor

torch.manual_seed(0)
torch.set_num_threads(1)   # one thread: the timings below are steadier between runs
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

# %% [markdown]
# ## 1. Levels
#
# Every transform pushes a `Level` onto a thread-local stack while it runs and pops it in a
# `finally`. A `vmap` level (`VmapLevel`) records its batch size and its randomness mode; level
# ids only grow, so an inner transform always has the larger id.
#
# Inside the vmapped function each batched input is a `BatchedTensor`. It reports the
# **logical** (per-example) shape and holds three things: `value` (the physical tensor, batch
# included), `bdim` (which physical dim is the batch) and `level` (the `VmapLevel` it belongs
# to). Under `vmap(vmap(f))` the wrappers nest: the inner level's `value` is itself a
# `BatchedTensor` of the outer level.

# %%
def describe(t, label):
    print(f"{label}: {type(t).__name__} with logical shape {tuple(t.shape)}")
    depth = 1
    while isinstance(t, BatchedTensor):
        print("  " * depth + f"level={t.level.id} (batch {t.level.batch_size}), bdim={t.bdim}, "
              f"value: {type(t.value).__name__} of shape {tuple(t.value.shape)}")
        t, depth = t.value, depth + 1


def f(x):
    print("stack:", _levels.stack())
    describe(x, "input")
    return x.sin()


data = torch.randn(3, 4, 5, device=device)
out = vmap(vmap(f), in_dims=1)(data)      # outer vmap maps dim 1 (size 4), inner dim 0 (size 3)
print("result:", tuple(out.shape), "| stack after:", _levels.stack())
assert_close(out, data.sin().transpose(0, 1))

# %% [markdown]
# Reading the output from the top: `f` sees a tensor of shape `(5,)`, one example. It is a
# wrapper of the inner level (batch 3, `bdim=0`) whose `value` has logical shape `(3, 5)`; that
# value is a wrapper of the outer level (batch 4), whose `value` is the real `(3, 4, 5)` tensor
# with the batch at `bdim=1` — where `in_dims=1` put it. No data was moved or copied.
#
# Other transforms push levels too: `grad`, `vjp` and `jacrev` a `"grad"` level, a forward-mode
# `jvp` a `"jvp"` level (plain `Level` records):

# %%
def loss(x):
    print("stack inside vmap(grad(loss)):", _levels.stack(),
          [level.kind for level in _levels.stack()])
    return (x ** 2).sum()


per_example_grads = vmap(ft.grad(loss))(torch.randn(2, 3, device=device))

# %% [markdown]
# A popped level is marked dead. A `BatchedTensor` that escapes its `vmap` (here through a
# list the function appends to) therefore raises a clear error instead of silently computing
# with a batch that no longer exists:

# %%
leaked = []


def leaky(x):
    leaked.append(x)
    return x * 2


vmap(leaky)(torch.randn(3, 2, device=device))
print(leaked[0].level)
try:
    leaked[0] + 1
except ft.EscapedBatchedTensorError as e:
    print(type(e).__name__, ":", e)

# %% [markdown]
# ## 2. `BatchedTensor` and `__torch_dispatch__`
#
# `BatchedTensor` is a wrapper subclass (`torch.Tensor._make_wrapper_subclass`), so every ATen
# op that touches one ends up in Python. (To save a round trip, each `vmap` also pushes a
# `TorchDispatchMode` that sees every op first and forwards ops on `BatchedTensor`s straight to
# the dispatcher in `functrans/batching/dispatch.py`; it also handles random ops with no batched
# argument.) For one op the dispatcher
#
# 1. finds the highest level among the arguments and unwraps only that level's wrappers;
# 2. if nothing at that level is batched, runs the op one level down;
# 3. otherwise looks the op up: **explicit rule** for the `OpOverload`, then its overload packet
#    → **tag rule** (one factory for every `torch.Tag.pointwise` op) → **derived** rule (in-place,
#    `out=` and `*_copy` variants reuse their functional op's rule) → **composite**
#    (`CompositeImplicitAutograd` ops decompose into ops that are batched themselves) →
#    **decomposition** from `torch._decomp` → **loop fallback** (slice, call, stack: correct
#    but slow, and it warns);
# 4. calls the rule on the physical values and their bdims and re-wraps the outputs.
#
# To watch it, we temporarily wrap the dispatcher function the mode forwards to and log each op
# with the level it runs at and `batching_coverage(op)`. A separate `TorchDispatchMode` entered
# *outside* the vmap logs the ops that run on plain tensors, with their input shapes: the
# physical computation.

# %%
from torch.utils._python_dispatch import TorchDispatchMode

from functrans.batching import mode as _vmap_mode   # where the vmap mode calls dispatch()


@contextlib.contextmanager
def logical_ops():
    seen, original = [], _vmap_mode.dispatch

    def logged(op, args, kwargs, *rest):
        top = max(a.level.id for a in args if isinstance(a, BatchedTensor))
        seen.append(f"level {top}: {op} [{ft.batching_coverage(op)}]")
        return original(op, args, kwargs, *rest)

    _vmap_mode.dispatch = logged
    try:
        yield seen
    finally:
        _vmap_mode.dispatch = original


class PhysicalOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not any(isinstance(a, BatchedTensor) for a in tensors):   # plain tensors only
            self.seen.append(f"{func} {[tuple(a.shape) for a in tensors]}")
        return func(*args, **(kwargs or {}))


W, b = torch.randn(4, 3, device=device), torch.randn(4, device=device)
xs = torch.randn(2, 5, 3, device=device)

with logical_ops() as logical, PhysicalOps() as physical:
    out = vmap(vmap(lambda x: F.linear(x, W, b).tanh()))(xs)
assert_close(out, torch.tanh(xs @ W.T + b))

print("ops on BatchedTensors, with how each is batched:\n  " + "\n  ".join(logical))
print("physical ops on plain tensors:\n  " + "\n  ".join(physical.seen))

# %% [markdown]
# `F.linear` is composite, so it never reaches the dispatcher: the per-example function
# issues `view`, `addmm` and `tanh` on wrappers of the inner level (the larger id). The inner
# `addmm` rule calls `addmm` again on values that are still batched at the outer level (the
# composite `movedim`, `flatten` and `unflatten` around it come from that rule too); the outer
# rule folds both batch dims into the rows, and the physical computation is a single `addmm`
# with `2 * 5 = 10` rows.
#
# `batching_coverage` answers "how would this op run?" for any op; here is one of each kind:

# %%
examples = ["aten::mm", "aten::sort", "aten::sin", "aten::add_.Tensor", "aten::sin.out",
            "aten::sort.values", "aten::matmul", "aten::_euclidean_dist", "aten::resize_"]
for name in examples:
    print(f"{name:24} {ft.batching_coverage(name)}")

from functrans.batching.known_fallbacks import reason
print("\nwhy aten::resize_ stays on the loop:", reason(torch.ops.aten.resize_.default))

# %% [markdown]
# `batching_rules()` lists every ATen overload that has a rule of any kind (explicit, tag or
# derived) and the rules file it lives in. Counting per file shows how the work is split; the
# pointwise file is one tag-rule factory that covers hundreds of overloads. (The listing
# enumerates every ATen overload registered with PyTorch's dispatcher, so the total is the same
# in any process.)

# %%
rules = ft.batching_rules()
per_file = collections.Counter(path.rsplit("/", 1)[-1] for path in rules.values())
print(len(rules), "ATen overloads with a rule")

names, counts = zip(*sorted(per_file.items(), key=lambda kv: kv[1]))
fig, ax = plt.subplots(figsize=(6, 6))
ax.barh(names, counts)
ax.set_xscale("log")
ax.set_xlabel("ATen overloads with a rule (log scale)")
ax.set_title("batching_rules(): overloads per rules file")
for y, c in enumerate(counts):
    ax.text(c * 1.05, y, str(c), va="center", fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 3. A batching rule for a custom op
#
# Take an op PyTorch knows nothing about: `nbdemo::softclip` scales each row (the last dim) of
# `x` so that its norm is smoothly capped at `limit`. It is defined with
# `torch.library.custom_op`; `register_fake` gives its output's shape without computing it.

# %%
@torch.library.custom_op("nbdemo::softclip", mutates_args=())
def softclip(x: torch.Tensor, limit: float) -> torch.Tensor:
    norm = x.norm(dim=-1, keepdim=True)
    return x * (limit * torch.tanh(norm / limit) / norm.clamp_min(1e-12))


@softclip.register_fake
def _(x, limit):
    return torch.empty_like(x)


softclip_op = torch.ops.nbdemo.softclip.default
batch = torch.randn(32, 10, 8, device=device)   # 32 examples, each 10 rows of 8
oracle = torch.stack([softclip(example, 2.0) for example in batch])   # the for-loop oracle
print("coverage:", ft.batching_coverage(softclip_op))

# %% [markdown]
# ### Before: the loop fallback
#
# With no rule, `vmap` still gives the right answer, by calling the op once per example. It
# says so three ways: a one-time `functrans.PerformanceWarning`, the `record_fallbacks()`
# report (op, calls, seconds, where the rule belongs), and, under `config.strict_fallback()`, an
# error. Rule tests run strict, so a passing test proves that a rule ran.

# %%
def clip_example(x):
    return softclip(x, 2.0)


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with ft.record_fallbacks() as report:
        out = vmap(clip_example)(batch)
assert_close(out, oracle)

for w in caught:
    print(f"{w.category.__name__}: {w.message}\n")
print(report)

# %%
try:
    with ft.config.strict_fallback():
        vmap(clip_example)(batch)
except ft.UnsupportedUnderVmap as e:
    print("UnsupportedUnderVmap:", e)

# %% [markdown]
# Before adding the rule, we time the loop for a few batch sizes (medians of 5 runs; the warning
# has already been shown, so it is switched off for the timing).

# %%
def median_time(fn, repeats=5):
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


batch_sizes = [8, 32, 128, 512]
inputs = {B: torch.randn(B, 10, 8, device=device) for B in batch_sizes}
ft.config.warn_on_fallback = False
loop_times = [median_time(lambda: vmap(clip_example)(inputs[B])) for B in batch_sizes]
ft.config.warn_on_fallback = True

# %% [markdown]
# ### Writing the rule
#
# A rule has the signature of `torch.library.register_vmap`:
# `rule(info, in_dims, *args) -> (out, out_dims)`. `args` are this level's **physical** values,
# `in_dims` holds each argument's batch dim (`None` if unbatched; the float `limit` is always
# `None`), and `info` is the `VmapLevel` (`info.batch_size`). `functrans.extend` exports the
# registration decorator and the bdim helpers:

# %%
import functrans.extend as extend

print(extend.__all__)

# %% [markdown]
# `softclip` acts on the last dim and treats every leading dim as independent rows, so the
# rule moves the batch dim to the front and calls the op once on the whole batch; the output's
# batch dim is 0. One case would be wrong: a **0-d** example. Physically it is a 1-d tensor of
# the batch, and the op would take the norm *across* examples. The rule raises `Decline` for it,
# which sends that call to the loop fallback (still correct).

# %%
from functrans.extend import Decline, logical_rank, move_bdim_to_front, register_batch_rule


# Registered from outside functrans, the rule's messages (a Decline's warning, the fallback
# report) say its rule lives in "your own code".
@register_batch_rule(softclip_op)
def softclip_rule(info, in_dims, x, limit):
    x_bdim = in_dims[0]
    if logical_rank(x, x_bdim) == 0:      # a 0-d example: the last dim would be the batch
        raise Decline()
    return softclip_op(move_bdim_to_front(x, x_bdim), limit), 0


print("coverage:", ft.batching_coverage(softclip_op))

# %% [markdown]
# ### After: the rule runs, and matches the oracle
#
# Strict mode proves that no loop ran. Nesting works with no extra code: under
# `vmap(vmap(...))` the inner rule's call re-dispatches to the outer level, which runs the same
# rule there.

# %%
with ft.config.strict_fallback(), ft.record_fallbacks() as report:
    out = vmap(clip_example)(batch)
    nested = vmap(vmap(clip_example), in_dims=1)(batch)      # map rows, then examples
print(report)
assert_close(out, oracle)
assert_close(nested, torch.stack([torch.stack([softclip(batch[i, j], 2.0) for i in range(32)])
                                  for j in range(10)]))

# %% [markdown]
# And the declined case (0-d examples) falls back to the loop and is still right:

# %%
scalars = torch.randn(6, device=device)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with ft.record_fallbacks() as report:
        out = vmap(clip_example)(scalars)
assert_close(out, torch.stack([softclip(s, 2.0) for s in scalars]))
print(caught[0].message if caught else "(warning already shown)")
print(report)

# %% [markdown]
# ### Loop vs rule, against batch size

# %%
rule_times = [median_time(lambda: vmap(clip_example)(inputs[B])) for B in batch_sizes]
for B, t_loop, t_rule in zip(batch_sizes, loop_times, rule_times):
    print(f"B={B:<4} loop {t_loop * 1e3:7.2f} ms   rule {t_rule * 1e3:6.2f} ms   "
          f"{t_loop / t_rule:5.1f}x")

fig, ax = plt.subplots(figsize=(5.5, 3.5))
ax.plot(batch_sizes, [t * 1e3 for t in loop_times], marker="o", label="loop fallback")
ax.plot(batch_sizes, [t * 1e3 for t in rule_times], marker="o", label="batching rule")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xticks(batch_sizes, [str(B) for B in batch_sizes])
ax.set_xlabel("batch size")
ax.set_ylabel("median time [ms]")
ax.set_title("vmap(softclip) on [B, 10, 8], "
             + ("one CPU thread" if device.type == "cpu" else str(device)))
ax.legend()
plt.show()

# %% [markdown]
# On this machine the loop's time grows linearly with the batch (one op call per example),
# while the rule's time barely changes at these sizes: one op call for the whole batch.

# %% [markdown]
# ## 4. The fallback report on a real op
#
# A few ATen ops still run on the loop in some cases. `torch.histogram` with a bin count but
# no `range` is one: each example's bins come from its own min and max.

# %%
def summary(x):
    return torch.histogram(x, bins=4).hist


samples = torch.randn(16, 100)   # on the CPU: torch.histogram has no CUDA kernel
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with ft.record_fallbacks() as report:
        hists = vmap(summary)(samples)
assert_close(hists, torch.stack([summary(s) for s in samples]))
for w in caught:
    print(f"{w.category.__name__}: {w.message}\n")
print(report)
print("\ncoverage of aten::histogram.bin_ct:", ft.batching_coverage("aten::histogram.bin_ct"))

# %% [markdown]
# The op **has** a rule (coverage `'rule'`), but the rule declined these arguments, so the call
# went to the loop; the report names the file where a rule for this case belongs. That file's
# docstring says which cases it declines and why:

# %%
from functrans.batching.rules import histograms as histogram_rules

doc = histogram_rules.__doc__
print(doc[doc.index("Declined"):].strip())

# %% [markdown]
# With an explicit `range` the same op runs by its rule, as strict mode confirms:

# %%
def summary_in_range(x):
    return torch.histogram(x, bins=4, range=(-3.0, 3.0)).hist


with ft.config.strict_fallback():
    hists = vmap(summary_in_range)(samples)
assert_close(hists, torch.stack([summary_in_range(s) for s in samples]))
print("histogram with a range: batched by its rule, matches the loop")

# %% [markdown]
# ## Summary
#
# * Transforms push levels on a thread-local stack; a `BatchedTensor` carries `value`, `bdim`
#   and `level`, and nested `vmap`s nest wrappers, so a rule only ever sees its own level.
# * One ATen op on a `BatchedTensor` goes: explicit rule → tag rule → derived → composite →
#   decomposition → loop fallback. `batching_coverage` and `batching_rules` show which applies.
# * A rule is `rule(info, in_dims, *args) -> (out, out_dims)`, registered with
#   `functrans.extend.register_batch_rule`; it may `Decline` the cases it does not handle.
# * `record_fallbacks()`, the `PerformanceWarning` and `config.strict_fallback()` tell you when
#   the slow loop ran and where the missing rule belongs.
