"""Ghost clipping: DP-SGD's clipped sum from per-example gradient NORMS, never holding every
example's gradient (``dp_sgd_grads(..., method="ghost")``; Li et al. 2022, Bu et al. 2023).

This module owns steps 1-3 of the recipe in ``functrans.nn.dp`` (per-example norms, clipping
factors, the clipped sum) for ``method="ghost"``; ``dp.py`` adds the noise, the reduction and the
all-reduce exactly as for ``method="materialize"``.  One step:

1. A probe forward of the first example alone (a batch of one, under ``no_grad``) and the forward
   of the batch, with forward hooks on every module: the shapes of each call's tensors in the
   two runs give each tensor's batch dim (the one dim that is 1 in the probe and ``B`` in the
   batch; no dim differs: not batched; anything else: an error naming the module).  A
   ``TorchFunctionMode`` records, during the batch's forward, which module call (the innermost
   running one) passes each trainable parameter to an op.
2. The per-example losses ``loss_i = loss_fn(out_i, t_i)``, with ``out_i`` example ``i``'s row of
   the batched output kept as a batch of one (``unsqueeze`` at its batch dim) and ``t_i`` the other
   batch tensors' rows as batches of one: the same loss as ``dp_sgd_grads`` runs per example
   (``vmap`` over the rows).  The model must be per-example independent: example ``i``'s output
   in the batch is its output alone (no BatchNorm in training mode: refused).
3. One backward of ``sum_i loss_i`` (graph retained).  Tensor hooks on the outputs of every call
   of a module that owns trainable parameters receive the output gradient ``g`` (all examples at
   once); with the call's input ``a`` (the activations), each example's squared gradient norm
   is added up layer by layer:

   * ``nn.Linear`` (any leading dims: ``T`` positions per example), ``nn.Conv1d/2d/3d`` (the
     im2col columns of its input: ``T`` = output positions; groups, dilation, stride, string
     padding and padding modes), ``nn.Embedding`` (``a`` = the indices): the weight's
     ``||sum_t g_t a_t^T||^2 = sum_{t,s} (a_t.a_s)(g_t.g_s)`` from two ``T x T`` Gram matrices
     when ``T^2`` is below the weight's size, else that one layer's per-example gradient
     (``B`` times the weight; a convolution's from its weight backward with the examples
     folded into the groups, no im2col), as Opacus's ghost clipping chooses; the bias
     ``||sum_t g_t||^2``.  The Gram matrices and per-layer gradients are made a chunk of
     examples at a time (``_CHUNK_ELEMENTS``);
   * ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm``: the per-example gradients of their
     affine weight and bias (``B`` times a vector), from the normalised input recomputed from
     ``a``;
   * any other module that owns trainable parameters (``nn.LSTM``, a subclass whose forward is
     its own, a custom module): that module's per-example gradient w.r.t. its own parameters
     alone, ``vmap(grad(<module(a_i), g_i>))`` over the examples (functrans), after the backward:
     peak memory one module's per-example gradients, not the model's.

   A parameter used by more than one module call (a module called twice: summed per call
   before the norm) falls back to per-example gradients for that parameter only; so, with the
   whole model's per-example gradient w.r.t. that parameter alone (``vmap(grad)`` as
   ``dp.per_sample_grads`` computes it), does a tied weight or a parameter read in another
   module's forward (an LM head ``h @ emb.weight.T``), a parameter of a module whose output is
   the same for every example (a positional embedding of ``arange(T)``: its output gradient
   is already summed over the batch), and a parameter that reaches the loss although no op
   was seen to read it.
4. The clipping factors ``c_i`` from the norms (``dp.py``'s formula, passed in), and one more
   backward, of ``sum_i c_i loss_i`` (``c`` detached): the clipped sum ``sum_i c_i g_i``.

Gradients are taken with ``torch.autograd.grad``: no ``p.grad`` is written.  ``B = 1``: the
batch's gradient is the example's (no hooks).  ``B = 0``: zero sums.  The per-module and
per-parameter fallbacks re-run forwards per example under ``vmap(randomness="error")``: a
module (or, for a tied parameter, a model) that draws random numbers (dropout) there cannot be
replayed and raises an error naming it (dropout between the modules is fine: each example draws
its own mask in the batched forward, as ``randomness="different"`` gives).

Imports: errors, _pytree, stateless, batching.api, autodiff.grad.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .._pytree import tree_flatten, tree_unflatten
from ..autodiff.grad import grad
from ..batching.api import vmap
from ..errors import FunctransError, TransformArgumentError, UnsupportedUnderVmap
from .stateless import functional_call

__all__ = ["ghost_clipped_sum"]

Grads = Dict[str, torch.Tensor]

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORMS = (nn.LayerNorm, nn.GroupNorm) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


# --------------------------------------------------------------------------------------------
# Per-layer kernels.  Each gets the layer's input ``a`` and output gradient ``g`` with the batch
# dim in front, and the trainable parameter names to cover; it returns ``{name: the per-example
# squared norm [B]}`` (``norm=True``) or ``{name: the per-example gradient [B, ...]}``.

def _seq(t: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, ..., width]`` -> ``[B, T, width]``."""
    return t.reshape(t.shape[0], -1, width)


def _sq(t: torch.Tensor) -> torch.Tensor:
    """Per-example squared norm of ``[B, ...]``: ``[B]``."""
    return t.reshape(t.shape[0], -1).square().sum(1)


# A squared norm's temporaries (Gram matrices, one layer's per-example gradients) are made for
# as many examples at a time as keep them under this many elements (64 MB in float32).
_CHUNK_ELEMENTS = 1 << 24


def _chunked(b: int, per_example: int, fn: Callable[[slice], torch.Tensor]) -> torch.Tensor:
    """``fn`` (per-example squared norms of a slice of the examples) over chunks of at most
    ``_CHUNK_ELEMENTS // per_example`` examples, concatenated: ``[B]``."""
    step = max(1, _CHUNK_ELEMENTS // max(per_example, 1))
    if step >= b:
        return fn(slice(None))
    return torch.cat([fn(slice(i, i + step)) for i in range(0, b, step)])


def _weight_sq_or_grad(a: torch.Tensor, g: torch.Tensor, norm: bool):
    """``a [B, T, K]``, ``g [B, T, O]``: ``||g^T a||^2`` per example (Gram matrices when
    ``T^2 < O*K``) or the per-example gradient ``g^T a`` ``[B, O, K]``."""
    b, t, k, o = a.shape[0], a.shape[1], a.shape[2], g.shape[2]
    if not norm:
        return g.mT @ a
    if t == 1:
        return a.square().sum((1, 2)) * g.square().sum((1, 2))
    if t * t < k * o:
        return _chunked(b, 2 * t * t, lambda s: ((a[s] @ a[s].mT) * (g[s] @ g[s].mT))
                        .sum((1, 2)))
    return _chunked(b, o * k, lambda s: (g[s].mT @ a[s]).square().sum((1, 2)))


def _linear(module: nn.Linear, a, g, names, norm):
    a, g = _seq(a, module.in_features), _seq(g, module.out_features)
    out = {}
    if "weight" in names:
        out["weight"] = _weight_sq_or_grad(a, g, norm)
    if "bias" in names:
        out["bias"] = _sq(g.sum(1)) if norm else g.sum(1)
    return out


def _padded(x: torch.Tensor, module) -> torch.Tensor:
    """A convolution's input padded as its forward pads it (any ``padding_mode``, string
    padding included): what the kernel then slides over with no padding."""
    pads = module._reversed_padding_repeated_twice
    if not any(pads):
        return x
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, pads, mode=mode)


def _unfold(x: torch.Tensor, module) -> torch.Tensor:
    """im2col of a convolution's (padded) input ``[B, C, *S]``: ``[B, L, C * prod(kernel)]``
    (``L`` output positions; columns ordered as the weight's ``[C, *kernel]``)."""
    n = x.dim() - 2
    k, s, d = module.kernel_size, module.stride, module.dilation
    for j in range(n):
        x = x.unfold(2 + j, d[j] * (k[j] - 1) + 1, s[j])
    x = x[(Ellipsis,) + tuple(slice(None, None, d[j]) for j in range(n))]
    x = x.permute([0, *range(2, 2 + n), 1, *range(2 + n, 2 + 2 * n)])   # [B, L.., C, k..]
    return x.reshape(x.shape[0], -1, x.shape[1 + n:].numel())


def _conv_weight_grads(module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-example weight gradients ``[b, *weight.shape]`` from the padded input ``x`` and the
    output gradient ``g``: convolution's weight backward with the examples folded into the
    groups (no im2col: the memory is the result's)."""
    b, n, weight = x.shape[0], x.dim() - 2, module.weight
    shape = (b * weight.shape[0],) + tuple(weight.shape[1:])
    _, gw, _ = torch.ops.aten.convolution_backward(
        g.reshape(1, -1, *g.shape[2:]), x.reshape(1, -1, *x.shape[2:]),
        g.new_empty(1).expand(shape), None, list(module.stride), [0] * n,
        list(module.dilation), False, [0] * n, b * module.groups, [False, True, False])
    return gw.view((b,) + tuple(weight.shape))


def _conv(module, a, g, names, norm):
    """Conv1d/2d/3d: the weight's squared norms from Gram matrices of im2col columns when the
    output positions ``L`` are few (``G L^2 < O Cg K``), else from per-example gradients made by
    the weight backward, a chunk of examples at a time; the bias from ``g``'s sums."""
    b, groups, o = a.shape[0], module.groups, module.out_channels
    x = _padded(a, module)
    out = {}
    if "weight" in names:
        per_example = module.weight.numel()
        length = g[0, 0].numel()
        if not norm:
            out["weight"] = _conv_weight_grads(module, x, g)
        elif groups * length * length < per_example:
            def gram(s):
                cols = _unfold(x[s], module)                      # [b, L, C*K]
                ag = cols.reshape(cols.shape[0], length, groups, -1).transpose(1, 2)
                gg = g[s].reshape(cols.shape[0], groups, -1, length).mT   # [b, G, L, Og]
                return ((ag @ ag.mT) * (gg @ gg.mT)).sum((1, 2, 3))
            columns = x.shape[1] * math.prod(module.kernel_size)   # C*K per position
            out["weight"] = _chunked(b, length * (columns + 2 * groups * length), gram)
        else:
            out["weight"] = _chunked(b, per_example, lambda s: _sq(
                _conv_weight_grads(module, x[s], g[s])))
    if "bias" in names:
        bias = g.reshape(b, o, -1).sum(-1)
        out["bias"] = _sq(bias) if norm else bias
    return out


def _embedding(module: nn.Embedding, idx, g, names, norm):
    b, dim = idx.shape[0], module.embedding_dim
    idx, g = idx.reshape(b, -1), _seq(g, dim)
    if module.padding_idx is not None:
        g = g * (idx != module.padding_idx).unsqueeze(-1).to(g.dtype)
    if "weight" not in names:
        return {}
    t, vocab = idx.shape[1], module.num_embeddings

    def full(i: torch.Tensor, gi: torch.Tensor) -> torch.Tensor:   # [b, vocab, dim]
        rows = (i + vocab * torch.arange(i.shape[0], device=i.device).unsqueeze(1)).reshape(-1)
        out = gi.new_zeros(i.shape[0] * vocab, dim).index_add_(0, rows, gi.reshape(-1, dim))
        return out.view(i.shape[0], vocab, dim)
    if not norm:
        return {"weight": full(idx, g)}
    if t * t < vocab * dim:
        return {"weight": _chunked(b, 2 * t * t, lambda s: (
            (idx[s].unsqueeze(2) == idx[s].unsqueeze(1)).to(g.dtype) * (g[s] @ g[s].mT))
            .sum((1, 2)))}
    return {"weight": _chunked(b, vocab * dim, lambda s: _sq(full(idx[s], g[s])))}


def _normalized(module, x: torch.Tensor) -> torch.Tensor:
    """The input of a norm layer normalised as its forward does, before the affine map."""
    if isinstance(module, nn.GroupNorm):
        xr = x.reshape(x.shape[0], module.num_groups, -1)
        var, mean = torch.var_mean(xr, -1, unbiased=False, keepdim=True)
        return ((xr - mean) * torch.rsqrt(var + module.eps)).reshape(x.shape)
    dims = tuple(range(-len(module.normalized_shape), 0))
    if isinstance(module, nn.LayerNorm):
        var, mean = torch.var_mean(x, dims, unbiased=False, keepdim=True)
        return (x - mean) * torch.rsqrt(var + module.eps)
    eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps   # RMSNorm
    return x * torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)


def _norm_layer(module, a, g, names, norm):
    b = a.shape[0]
    if isinstance(module, nn.GroupNorm):   # per channel: [B, C, rest]
        def per_example(t):
            return t.reshape(b, module.num_channels, -1).sum(-1)
    else:                                  # per normalised element: [B, rest, *shape]
        shape = tuple(module.normalized_shape)

        def per_example(t):
            return t.reshape((b, -1) + shape).sum(1)
    out = {}
    if "weight" in names:
        out["weight"] = per_example(g * _normalized(module, a))
    if "bias" in names:
        out["bias"] = per_example(g)
    return {k: _sq(v) for k, v in out.items()} if norm else out


def _kernel(module: nn.Module) -> Optional[Callable]:
    """The factorised kernel for ``module``, or None (the per-module ``vmap(grad)``): only the
    standard forwards (a subclass that overrides ``forward`` is a custom module)."""
    kind = type(module)
    if kind.forward is nn.Linear.forward:
        return _linear
    if any(kind.forward is c.forward for c in _CONVS):
        return _conv
    if kind.forward is nn.Embedding.forward and not module.scale_grad_by_freq:
        return _embedding
    if any(kind.forward is c.forward for c in _NORMS):
        return _norm_layer
    return None


# --------------------------------------------------------------------------------------------
# Recording: hooks on every module, a TorchFunctionMode for parameter uses.

class _Call:
    """One call of a module that owns trainable parameters."""
    __slots__ = ("module", "leaves", "spec", "out_leaves", "in_dims", "out_dims", "grads",
                 "plan")

    def __init__(self, module, leaves, spec, out_leaves):
        self.module, self.leaves, self.spec, self.out_leaves = module, leaves, spec, out_leaves
        self.in_dims: List[Optional[int]] = []
        self.out_dims: List[Optional[int]] = []
        self.grads: Dict[int, torch.Tensor] = {}
        self.plan = None   # (kernel or None, {local name: param}, norm?) once classified


def _shapes(leaves) -> List[Optional[Tuple[int, ...]]]:
    return [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in leaves]


def _batch_dims(probe, real, b: int, what: str, api: str) -> List[Optional[int]]:
    """Each tensor's batch dim from its shape in the probe (one example) and in the batch."""
    dims = []
    for i, (p, r) in enumerate(zip(probe, real)):
        if p is None or r is None or p == r:
            dims.append(None)
            continue
        diff = [d for d in range(len(r)) if len(p) != len(r) or p[d] != r[d]]
        if len(p) != len(r) or len(diff) != 1 or p[diff[0]] != 1 or r[diff[0]] != b:
            raise TransformArgumentError(
                f"{api}: method='ghost' needs every tensor of the model to have one batch dim "
                f"(size 1 for one example, B={b} for the batch) or none; {what}'s tensor {i} "
                f"has shape {p} for one example and {r} for the batch (examples folded into "
                "another dim?).  Use method='materialize'.")
        dims.append(diff[0])
    return dims


class _UseMode(TorchFunctionMode):
    """Records which module call passes each trainable parameter to an op."""

    def __init__(self, rec: "_Recorder"):
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ids = self.rec.param_ids
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                if id(a) in ids:
                    self.rec.use(a)
            elif isinstance(a, (list, tuple)):
                for t in a:
                    if isinstance(t, torch.Tensor) and id(t) in ids:
                        self.rec.use(t)
        return func(*args, **kwargs)


class _Recorder:
    """The hooks' state over one step: the calls (probe, then batch), the parameters' uses."""

    def __init__(self, model: nn.Module, params: Dict[int, nn.Parameter]):
        self.param_ids = params
        self.owners: Dict[int, List[Tuple[nn.Module, str]]] = {}
        self.owning = set()   # ids of modules that directly own a trainable parameter
        for module in model.modules():
            for local, p in module._parameters.items():
                if p is not None and id(p) in params:
                    self.owners.setdefault(id(p), []).append((module, local))
                    self.owning.add(id(module))
        self.phase = "off"   # "probe" | "batch" (forwards) | "backward" (the first) | "off"
        self.stack: List[Optional[int]] = []   # running calls (index into calls, or None)
        self.calls: List[_Call] = []
        self.probe_shapes: List[Tuple[nn.Module, list, list]] = []
        self.uses: Dict[int, set] = {}
        self.handles = []
        # the hooked outputs' places in the graph, taken before any in-place op can move them:
        # the first backward runs up to these (its tensor hooks fire there) and computes no
        # parameter gradient
        self.edges: List[torch.autograd.graph.GradientEdge] = []
        for module in model.modules():
            self.handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post, with_kwargs=True,
                                                             always_call=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def use(self, p) -> None:
        self.uses.setdefault(id(p), set()).add(self.stack[-1] if self.stack else None)

    def _pre(self, module, args, kwargs):
        if self.phase == "batch":
            owning = id(module) in self.owning
            self.stack.append(len(self.calls) if owning else None)
            if owning:
                self.calls.append(None)   # filled in by _post, in call-start order
        elif self.phase == "probe":
            if id(module) in self.owning:
                self.stack.append(len(self.probe_shapes))
                self.probe_shapes.append(None)
            else:
                self.stack.append(None)

    def _post(self, module, args, kwargs, output):
        if self.phase == "off" or not self.stack:
            return None
        index = self.stack.pop()
        if index is None:
            return None
        leaves, spec = tree_flatten((args, kwargs))
        out_leaves, _ = tree_flatten(output)
        if self.phase == "probe":
            self.probe_shapes[index] = (module, _shapes(leaves), _shapes(out_leaves))
            return None
        call = _Call(module, [t.detach() if isinstance(t, torch.Tensor) else t
                              for t in leaves], spec, out_leaves)
        self.calls[index] = call
        seen = set()   # a tensor returned twice gets one hook: its gradient holds both uses
        for j, t in enumerate(out_leaves):
            if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in seen:
                seen.add(id(t))
                self.handles.append(t.register_hook(self._grad_hook(call, j)))
                self.edges.append(torch.autograd.graph.get_gradient_edge(t))
        return None

    def _grad_hook(self, call: _Call, j: int):
        def hook(g):
            if self.phase == "backward" and call.plan is not None:
                call.grads[j] = g.detach()
                self.on_grad(call)
        return hook

    on_grad: Callable[[_Call], None]


# --------------------------------------------------------------------------------------------
# The step.

def _front(t: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
    return t if dim in (None, 0) else t.movedim(dim, 0)


def _example_input(t: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
    return t if dim is None else t.unsqueeze(dim)


def _module_name(model: nn.Module, module: nn.Module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return f"{name or 'the model'} ({type(module).__name__})"
    return type(module).__name__


def _no_replay(err: Exception, what: str, api: str) -> FunctransError:
    return TransformArgumentError(
        f"{api}: method='ghost' re-runs {what} per example (vmap(grad), randomness='error') "
        f"and it draws random numbers there (dropout inside it?), which cannot replay the "
        f"batch's draws: {err}.  Use method='materialize', or put the randomness outside it.")


def ghost_clipped_sum(model: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple,
                      clip_factors: Callable[[torch.Tensor], torch.Tensor], api: str
                      ) -> Tuple[Grads, torch.Tensor]:
    """``(sums, norms)`` as ``dp.clip_and_sum`` returns them (``sums[name] = sum_i c_i g_i``,
    ``norms[i] = ||g_i||`` over all trainable parameters, ``c = clip_factors(norms)``), for the
    per-example losses ``loss_fn(model(x_i), t_i)`` of ``batch = (x, *others)`` (each a batch
    of one), computed without per-example gradients of the whole model (module docstring).
    ``model`` is the plain module (no DDP wrapper)."""
    named = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if not named:
        raise TransformArgumentError(
            f"{api}: there are no gradients to clip; does the model have trainable parameters "
            "(requires_grad=True)?")
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
            raise TransformArgumentError(
                f"{api}: method='ghost' runs the batch through the model at once, and "
                f"{name} ({type(m).__name__}) is in training mode: its batch statistics mix "
                "the examples (DP-SGD forbids that anyway).  Use GroupNorm/LayerNorm, or "
                "model.eval() for that module.")
    b = batch[0].shape[0]
    params = list(named.values())
    dtype = params[0].dtype
    if b == 0:
        return ({k: torch.zeros_like(p) for k, p in named.items()},
                params[0].new_zeros(0))
    with torch.enable_grad():
        if b > 1:
            return _ghost(model, loss_fn, batch, clip_factors, api, named, b, dtype)
        # one example: the batch's gradient is the example's
        grads = _grads(loss_fn(model(batch[0]), *batch[1:]), params)
    norm = torch.stack([g.square().sum() for g in grads]).sum().sqrt().reshape(1)
    c = clip_factors(norm).detach()
    return {k: c[0].to(g.dtype) * g for k, g in zip(named, grads)}, norm


def _grads(loss: torch.Tensor, params, retain_graph: bool = False) -> List[torch.Tensor]:
    if not loss.requires_grad:
        return [torch.zeros_like(p) for p in params]
    grads = torch.autograd.grad(loss, params, retain_graph=retain_graph, allow_unused=True)
    return [torch.zeros_like(p) if g is None else (g.to_dense() if g.is_sparse else g)
            for g, p in zip(grads, params)]


def _ghost(model, loss_fn, batch, clip_factors, api, named, b, dtype):
    by_id = {id(p): p for p in named.values()}
    rec = _Recorder(model, by_id)
    x, others = batch[0], batch[1:]
    try:
        # 1. the probe (one example) and the batch's forward, recorded
        rec.phase = "probe"
        with torch.no_grad():
            probe_out = model(x[:1])
        rec.phase = "batch"
        rec.stack = []
        with _UseMode(rec):
            out = model(x)
        rec.phase = "off"
        if len(rec.calls) != len(rec.probe_shapes) or any(
                c.module is not p[0] for c, p in zip(rec.calls, rec.probe_shapes)):
            raise TransformArgumentError(
                f"{api}: method='ghost' needs the model to call the same modules in the same "
                "order for one example and for the batch; it did not.  Use "
                "method='materialize'.")
        for call, (module, p_in, p_out) in zip(rec.calls, rec.probe_shapes):
            what = _module_name(model, module)
            call.in_dims = _batch_dims(p_in, _shapes(call.leaves), b, what + "'s input", api)
            call.out_dims = _batch_dims(p_out, _shapes(call.out_leaves), b,
                                        what + "'s output", api)
        out_leaves, out_spec = tree_flatten(out)
        out_dims = _batch_dims(_shapes(tree_flatten(probe_out)[0]), _shapes(out_leaves), b,
                               "the model's output", api)
        if all(d is None for d in out_dims):
            raise TransformArgumentError(
                f"{api}: the model's output has no batch dim (shape "
                f"{_shapes(out_leaves)}); method='ghost' needs one row per example.")
        losses = _per_example_losses(loss_fn, out_leaves, out_spec, out_dims, others, api)

        # 2. which parameters the hooks can cover: used in calls of their one owner only
        sq = torch.zeros(b, dtype=dtype, device=x.device)
        global_params = _plan(rec, by_id, model, losses)
        acc: Dict[int, torch.Tensor] = {}
        deferred: List[_Call] = []

        def on_grad(call: _Call) -> None:
            kernel, local, norm = call.plan
            if kernel is None:
                if not any(c is call for c in deferred):
                    deferred.append(call)
                return
            g = _front(call.grads.pop(0), call.out_dims[0])
            a = _front(call.leaves[0], call.in_dims[0])
            call.leaves = None
            result = kernel(call.module, a, g, set(local), norm)
            _add(result, local, norm, sq, acc, b, squared=norm)

        rec.on_grad = on_grad
        # 3. the backward of the summed loss: the hooks fill sq / acc
        rec.phase = "backward"
        if rec.edges and losses.requires_grad:
            torch.autograd.grad(losses.sum(), _frontier(rec.edges), retain_graph=True,
                                allow_unused=True)
        rec.edges = []
        rec.phase = "off"
        for call in deferred:
            _, local, norm = call.plan
            _add(_module_grads(call, local, model, api), local, norm, sq, acc, b,
                 squared=False)
            call.leaves = None
        for g in acc.values():
            sq += g.reshape(b, -1).square().sum(1).to(dtype)
        acc.clear()
        if global_params:
            for g in _model_grads(model, loss_fn, batch, global_params, named, api).values():
                sq += g.reshape(b, -1).square().sum(1).to(dtype)
        norms = sq.clamp(min=0).sqrt()
        # 4. the clipped sum: one more backward, of sum_i c_i loss_i
        c = clip_factors(norms).detach()
        grads = _grads((c.to(losses.dtype) * losses).sum(), list(named.values()))
        return dict(zip(named, grads)), norms
    finally:
        rec.phase = "off"
        rec.remove()


def _frontier(edges: List[torch.autograd.graph.GradientEdge]):
    """The edges whose node reaches no other edge's node in the graph: the backward that
    captures the gradients at these runs every other edge's node on its way (so their tensor
    hooks fire, and tensor hooks fire at a captured edge too), and holds only these captured
    gradients until it returns."""
    hooked = {id(e.node) for e in edges}
    out = []
    for e in edges:
        stack = [f for f, _ in e.node.next_functions if f is not None]
        seen, reaches = set(), False
        while stack and not reaches:
            f = stack.pop()
            if id(f) in seen:
                continue
            seen.add(id(f))
            reaches = id(f) in hooked
            stack.extend(nf for nf, _ in f.next_functions if nf is not None)
        if not reaches:
            out.append(e)
    return out


def _add(result: Grads, local: Dict[str, nn.Parameter], norm: bool, sq, acc, b: int,
         squared: bool) -> None:
    """Add a call's result to the squared norms ``sq`` (``norm``: the parameters are used in
    this call alone; ``squared``: the result holds squared norms, not gradients) or to the
    per-example gradients ``acc`` (summed over the calls)."""
    for name, r in result.items():
        if norm:
            sq += (r if squared else _sq(r)).to(sq.dtype)
        else:
            p = local[name]
            r = r.reshape((b,) + tuple(p.shape))
            acc[id(p)] = acc[id(p)] + r if id(p) in acc else r


def _plan(rec: _Recorder, by_id, model, losses) -> Dict[str, nn.Parameter]:
    """Set each call's plan; return the parameters left to the whole-model fallback: those
    used outside their one owner's calls (tied, or read by another module), those of a module
    with a call whose outputs have no batch dim (its gradient cannot be split by example), and
    those no op was seen to read that still reach the loss."""
    calls_of: Dict[int, List[int]] = {}
    for i, call in enumerate(rec.calls):
        calls_of.setdefault(id(call.module), []).append(i)
    unbatched = {id(c.module) for c in rec.calls if all(d is None for d in c.out_dims)}
    names = {id(p): n for n, p in model.named_parameters()}
    local_ids, fallback, unseen = set(), {}, []
    for pid, p in by_id.items():
        owners = rec.owners.get(pid, [])
        uses = rec.uses.get(pid)
        if uses is None:
            unseen.append(p)
        elif len(owners) == 1 and id(owners[0][0]) not in unbatched and \
                uses <= set(calls_of.get(id(owners[0][0]), ())):
            local_ids.add(pid)
        else:
            fallback[names[pid]] = p
    if unseen and losses.requires_grad:   # unused (a zero gradient), or read unseen
        reached = torch.autograd.grad(losses.sum(), unseen, retain_graph=True,
                                      allow_unused=True)
        fallback.update({names[id(p)]: p for p, g in zip(unseen, reached) if g is not None})
    for call in rec.calls:
        local = {n: p for n, p in call.module._parameters.items()
                 if p is not None and id(p) in local_ids}
        if not local:
            continue
        kernel = _kernel(call.module)
        if kernel is not None and (len(call.out_leaves) != 1 or call.in_dims[:1] == [None]):
            kernel = None
        call.plan = (kernel, local, len(calls_of[id(call.module)]) == 1)
    return fallback


def _per_example_losses(loss_fn, out_leaves, out_spec, out_dims, others, api):
    tensors = [i for i, t in enumerate(out_leaves) if isinstance(t, torch.Tensor)]

    def example_loss(outs, *rows):
        leaves = list(out_leaves)
        for i, o in zip(tensors, outs):
            leaves[i] = _example_input(o, out_dims[i])
        loss = loss_fn(tree_unflatten(leaves, out_spec), *(r.unsqueeze(0) for r in rows))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TransformArgumentError(
                f"{api}: loss_fn must return one number per example (a scalar loss of a batch "
                f"of one); got {loss!r:.80}.")
        return loss.reshape(())

    in_dims = ([out_dims[i] for i in tensors],) + (0,) * len(others)
    return vmap(example_loss, in_dims=in_dims, randomness="different")(
        [out_leaves[i] for i in tensors], *others)


def _module_grads(call: _Call, local: Dict[str, nn.Parameter], model, api) -> Grads:
    """One call's per-example gradients w.r.t. the module's own ``local`` parameters:
    ``vmap(grad(<module(a_i), g_i>))``."""
    batched = [i for i, d in enumerate(call.in_dims) if d is not None]
    outs = [j for j in sorted(call.grads) if call.out_dims[j] is not None]
    if not outs:
        return {}

    def example(p, xs, gs):
        leaves = list(call.leaves)
        for i, xi in zip(batched, xs):
            leaves[i] = _example_input(xi, call.in_dims[i])
        args, kwargs = tree_unflatten(leaves, call.spec)
        out_leaves, _ = tree_flatten(functional_call(call.module, p, tuple(args), kwargs))
        return sum((out_leaves[j] * _example_input(g, call.out_dims[j])).sum()
                   for j, g in zip(outs, gs))

    in_dims = (None, [call.in_dims[i] for i in batched], [call.out_dims[j] for j in outs])
    params = {n: p.detach() for n, p in local.items()}
    try:
        return vmap(grad(example), in_dims=in_dims, randomness="error")(
            params, [call.leaves[i] for i in batched], [call.grads[j] for j in outs])
    except UnsupportedUnderVmap as err:
        raise _no_replay(err, _module_name(model, call.module), api) from err
    finally:
        call.grads.clear()


def _model_grads(model, loss_fn, batch, sub: Dict[str, nn.Parameter], named, api) -> Grads:
    """The whole model's per-example gradients w.r.t. the parameters ``sub`` alone."""
    rest = {n: p.detach() for n, p in model.named_parameters() if n not in sub}
    rest.update({n: t.detach() for n, t in model.named_buffers()})

    def example_loss(p, x, *others):
        out = functional_call(model, (p, rest), (x.unsqueeze(0),))
        return loss_fn(out, *(o.unsqueeze(0) for o in others))

    params = {n: p.detach() for n, p in sub.items()}
    try:
        return vmap(grad(example_loss), in_dims=(None,) + (0,) * len(batch),
                    randomness="error")(params, *batch)
    except UnsupportedUnderVmap as err:
        raise _no_replay(err, f"the model (for the shared parameters {sorted(sub)})",
                         api) from err
