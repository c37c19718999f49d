"""Random ops on batched tensors, for randomness='different' and 'same' ('error' is refused by
the dispatcher before any rule runs; random ops with nothing batched, and empty_like/new_empty of
unbatched tensors under 'different', are handled by the mode in ../randomness.py).

* Shape-only draws (values depend on the input's shape, not its values): rand_like,
  randn_like, randint_like, bernoulli.p, uniform, normal_, exponential, geometric, cauchy,
  log_normal, random_ and their in-place forms.  'different': one physical draw, every element
  independent, bdim kept.  'same': one draw of the per-example shape, shared by the batch
  (in-place forms copy it into every example).
* Value-dependent draws: bernoulli (probabilities, also bernoulli_.Tensor), normal with tensor
  mean/std, native_dropout, rrelu_with_noise(_), multinomial, poisson, _standard_gamma,
  binomial, _sample_dirichlet.  'different': the inputs are aligned with the batch first and
  drawn in one physical call.  'same': the random numbers are shared while the per-example
  inputs differ: bernoulli compares one uniform draw with every example's p, dropout and rrelu
  share one mask / one slope draw, normal shares one standard-normal z, multinomial shares
  Exp(1) noise (Gumbel-max / Gumbel-top-k); poisson, gamma, binomial and dirichlet, whose
  samplers cannot be split that way, raise.  bernoulli and normal keep their zero derivatives.
Random numbers are drawn with ops that take the physical value (``empty_like(value).uniform_()``)
so that an outer vmap level applies its own randomness to them.
"""
from __future__ import annotations

import torch

from ...errors import UnsupportedUnderVmap
from ..helpers import ensure_bdim_front, move_bdim_to_front, pad_to_rank
from ..op_schema import writes_self
from ..registry import registrar

aten = torch.ops.aten
register_batch_rule = registrar("random")   # the rules below live in this file


def _example(x, bdim):
    """A per-example-shaped template of a batched value (for 'same' draws)."""
    return x.select(bdim, 0)


def _shape_only_rule_for(op):
    inplace = writes_self(op)

    def rule(info, in_dims, x, *args, **kwargs):
        b = in_dims[0]
        if info.randomness == "different":
            out = op(x, *args, **kwargs)
            return (x if inplace else out), b
        if inplace:
            draw = _example(x, b).clone()
            op(draw, *args, **kwargs)
            move_bdim_to_front(x, b).copy_(draw)
            return x, b
        return op(_example(x, b), *args, **kwargs), None
    rule.__name__ = f"shape_only_random_rule[{op}]"
    return rule


_SHAPE_ONLY = [aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
               aten.randint_like.low_dtype, aten.bernoulli.p, aten.bernoulli_.float,
               aten.uniform.default, aten.uniform_.default, aten.normal_.default,
               aten.exponential.default, aten.exponential_.default, aten.geometric.default,
               aten.geometric_.default, aten.cauchy.default, aten.cauchy_.default,
               aten.log_normal.default, aten.log_normal_.default, aten.random_.default,
               getattr(aten.random_, "from"), aten.random_.to]
for _name in ("rand_like.generator", "randn_like.generator", "randint_like.generator",
              "randint_like.low_generator_dtype", "randint_like.Tensor",
              "randint_like.Tensor_generator"):
    _packet, _ov = _name.split(".")
    _op = getattr(getattr(aten, _packet), _ov, None)
    if _op is not None:  # overloads differ between torch versions
        _SHAPE_ONLY.append(_op)
for _op in _SHAPE_ONLY:
    register_batch_rule(_op, _shape_only_rule_for(_op))


def _aligned(args, in_dims):
    """Tensor args with the batch first and padded to a common logical rank (others as is)."""
    ranks = [a.dim() - (d is not None) for a, d in zip(args, in_dims)
             if isinstance(a, torch.Tensor)]
    top = max(ranks) if ranks else 0
    return [pad_to_rank(move_bdim_to_front(a, d), top) if d is not None and
            isinstance(a, torch.Tensor) else a for a, d in zip(args, in_dims)]


def _same_not_supported(op):
    return UnsupportedUnderVmap(
        f"vmap: {op} with batched inputs under randomness='same': its samples cannot share one "
        "random draw across examples whose inputs differ. Use randomness='different', or draw "
        "the samples outside vmap and pass them in.")


def _value_dependent_rule_for(op, same=None):
    def rule(info, in_dims, *args, **kwargs):
        if info.randomness == "same":
            if same is None:
                raise _same_not_supported(op)
            return same(info, in_dims, *args, **kwargs)
        out = op(*_aligned(args, in_dims), **kwargs)
        return out, (tuple(0 for _ in out) if isinstance(out, tuple) else 0)
    rule.__name__ = f"value_random_rule[{op}]"
    return rule


def _uniform(template, generator=None):
    """U[0, 1) numbers of ``template``'s shape, floating even for an integer template.  Drawn
    with ``empty_like(template)`` so an outer vmap level batches them by its own randomness."""
    dtype = template.dtype if template.is_floating_point() else torch.get_default_dtype()
    return torch.empty_like(template, dtype=dtype).uniform_(generator=generator)


def _zero_grad_link(out, *inputs):
    """``out``, made to depend on ``inputs`` with zero derivatives when autograd records (the
    dispatcher's physical autograd): torch.bernoulli and torch.normal are not reparameterised,
    their derivatives are zero, and a draw built from comparisons or a shared ``z`` must not
    differ from them."""
    if not torch.is_grad_enabled():
        return out
    keep = torch.ones((), dtype=torch.bool, device=out.device)
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            out = torch.where(keep, out, t.to(out.dtype))
    return out


def _bernoulli_same(info, in_dims, p, *, generator=None):
    p = move_bdim_to_front(p, in_dims[0])
    return _zero_grad_link((_uniform(p[0], generator) < p).to(p.dtype), p), 0


def _bernoulli_tensor_draw(in_dims, x, p, generator):
    """bernoulli(x, p) for 'same': one U[0, 1) draw of self's logical shape, compared with
    every example's p; unbatched (bdim None) when p is unbatched."""
    u = _uniform(x if in_dims[0] is None else _example(x, in_dims[0]), generator)
    if in_dims[1] is None:
        return _zero_grad_link((u < p).to(x.dtype), p), None
    p = pad_to_rank(move_bdim_to_front(p, in_dims[1]), u.dim())
    return _zero_grad_link((u < p).to(x.dtype), p), 0


@register_batch_rule(aten.bernoulli.Tensor)
def bernoulli_tensor_rule(info, in_dims, x, p, *, generator=None):
    """bernoulli(self, p): self's shape, p broadcast to it; either may be the batched one."""
    if info.randomness == "same":
        return _bernoulli_tensor_draw(in_dims, x, p, generator)
    x = ensure_bdim_front(x, in_dims[0], info.batch_size)
    if in_dims[1] is not None:
        p = pad_to_rank(move_bdim_to_front(p, in_dims[1]), x.dim() - 1)
    return aten.bernoulli.Tensor(x, p, generator=generator), 0


def _normal_same(info, in_dims, mean, std=1.0, *, generator=None):
    """One standard-normal draw of the logical shape: ``mean + std * z`` for every example."""
    in_dims = (*in_dims, None)[:2]  # normal.Tensor_float may come without its std
    mean, std = _aligned([mean, std], in_dims)
    examples = [t if d is None else t[0] for t, d in zip((mean, std), in_dims)
                if isinstance(t, torch.Tensor)]
    template = examples[0].expand(torch.broadcast_shapes(*[t.shape for t in examples]))
    z = torch.empty_like(template).normal_(generator=generator)
    with torch.no_grad():
        out = mean + std * z
    return _zero_grad_link(out, mean, std), 0


def _dropout_same(info, in_dims, x, p, train):
    if not train or p == 0:
        return aten.native_dropout.default(x, p, train), (in_dims[0], in_dims[0])
    keep = torch.empty_like(_example(x, in_dims[0])).bernoulli_(1 - p).bool()
    out = move_bdim_to_front(x, in_dims[0]) * keep * (1.0 / (1 - p))
    return (out, keep), (0, None)


register_batch_rule(aten.bernoulli.default,
                    _value_dependent_rule_for(aten.bernoulli.default, _bernoulli_same))
for _op in (aten.normal.Tensor_Tensor, aten.normal.Tensor_float, aten.normal.float_Tensor):
    register_batch_rule(_op, _value_dependent_rule_for(_op, _normal_same))
register_batch_rule(aten.native_dropout.default,
                    _value_dependent_rule_for(aten.native_dropout.default, _dropout_same))
for _op in (aten.poisson.default, aten._standard_gamma.default, aten.binomial.default,
            aten._sample_dirichlet.default):
    register_batch_rule(_op, _value_dependent_rule_for(_op))


@register_batch_rule(aten.bernoulli_.Tensor)
def bernoulli__tensor_rule(info, in_dims, x, p, *, generator=None):
    b = in_dims[0]
    if info.randomness == "same":
        draw, _ = _bernoulli_tensor_draw(in_dims, x, p, generator)
        move_bdim_to_front(x, b).copy_(draw)
    else:
        target, prob = _aligned([x, p], in_dims)
        target.bernoulli_(prob, generator=generator)
    return x, b


@register_batch_rule(aten.multinomial.default)
def multinomial_rule(info, in_dims, probs, num_samples, replacement=False, *, generator=None):
    p = move_bdim_to_front(probs, in_dims[0])
    if info.randomness == "different":
        rows = p.reshape(-1, p.shape[-1])
        out = torch.multinomial(rows, num_samples, replacement, generator=generator)
        return out.view(*p.shape[:-1], num_samples), 0
    # 'same': shared Exp(1) noise E; the largest p / E is a sample from p (the Gumbel-max
    # trick, as log p - log E), and the k largest are k samples without replacement in order.
    example = p[0]
    if replacement:
        example = example.unsqueeze(-2).expand(*example.shape[:-1], num_samples,
                                               example.shape[-1])
        p = p.unsqueeze(-2)
    noise = torch.empty_like(example).exponential_(generator=generator)
    if replacement:
        return (p / noise).argmax(-1), 0
    _check_enough_categories(probs if in_dims[0] is None else _example(probs, in_dims[0]),
                             num_samples)
    return (p / noise).topk(num_samples, -1).indices, 0


def _check_enough_categories(example, num_samples):
    if num_samples > example.shape[-1]:
        raise RuntimeError(f"multinomial: cannot sample n_sample ({num_samples}) > "
                           f"prob_dist.size(-1) ({example.shape[-1]}) samples without "
                           "replacement")


def _rrelu_rule_for(op):
    """rrelu_with_noise(self, noise!, lower, upper, training): for self <= 0 draws r from
    U(lower, upper), writes r into ``noise`` and returns self * r; elsewhere noise is 1."""
    inplace = writes_self(op)

    def rule(info, in_dims, x, noise, lower=0.125, upper=1 / 3, training=False,
             generator=None):
        xf, nf = (ensure_bdim_front(t, d, info.batch_size) for t, d in zip((x, noise), in_dims))
        if info.randomness == "different" or not training:
            out = op(xf, nf, lower, upper, training, generator)
        else:
            r = torch.empty_like(xf[0]).uniform_(lower, upper, generator=generator)
            positive = xf > 0
            nf.copy_(torch.where(positive, torch.ones_like(r), r))
            out = torch.where(positive, xf, xf * r)
            if inplace:
                xf.copy_(out)
        return (x, in_dims[0]) if inplace else (out, 0)
    rule.__name__ = f"rrelu_rule[{op}]"
    return rule


for _op in (aten.rrelu_with_noise.default, aten.rrelu_with_noise_.default):
    register_batch_rule(_op, _rrelu_rule_for(_op))
