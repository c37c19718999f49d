"""Random programs, random transform stacks, and a recursive plain-PyTorch oracle.

Design
======

A fuzz *case* is a program ``f`` (straight-line Python source over float64 tensors) plus a
stack of transforms (``vmap``, ``grad``, ``grad_and_value``, ``vjp``, ``jvp``, ``linearize``,
``jacrev``, ``jacfwd``, ``hessian``) applied innermost first.  The same case is built three ways:

* ``case.build(functrans)``  -- the system under test;
* ``case.oracle()``          -- plain PyTorch, composed recursively layer by layer (below);
* ``case.build(torch.func)`` -- only to triage a mismatch (the failure message shows all three).

**Uniform signature.**  Every function in the stack takes a flat list of tensors and returns a
*tuple* of tensors, so layers compose without special cases:

====================  =================================  ==========================================
layer                 outer inputs -> outer outputs       oracle
====================  =================================  ==========================================
vmap(in, out, chunk)  batch dim inserted at in_dims /      loop over the batch (``select`` at each
                      out_dims                             in_dim), call the inner oracle, ``stack``
                                                           at each out_dim
grad(argnums)         same inputs -> one grad per argnum   ``autograd.grad(reduce(inner(...)),
                      (``grad_and_value``: + the value)    create_graph=True)``; ``reduce`` is a
                                                           fixed weighted sum, so the output of the
                                                           differentiated function is a scalar
vjp                   primals + one cotangent per output   ``autograd.grad(outs, primals, cts,
                      -> outputs + one vjp per primal      create_graph=True)``
jvp / linearize       primals + one tangent per primal     double-vjp: ``g = grad(outs, p, u)`` with
                      -> outputs + tangent outputs         dummy ``u``, then ``grad(g, u, tangents)``
jacrev / jacfwd       same inputs -> d out_k / d x_argnum  row by row: ``grad(out.flatten()[i], x)``
hessian               same inputs -> jac(jac)              the jacobian oracle applied twice
====================  =================================  ==========================================

Cotangents and tangents are *inputs* of the outer function, so an outer ``vmap`` can map over
them (``vmap(vjp)`` is a batched VJP, ``vmap(jvp)`` a batched JVP) and an outer ``grad`` can
differentiate through them.  Each oracle differentiates w.r.t. a fresh alias of its inputs
(``view_as`` if the input is already in a graph, ``detach().requires_grad_()`` otherwise) and
always uses ``create_graph=True``, so oracles nest to any depth.

**Programs.**  ``gen_program`` grows a straight-line program one op at a time, *executing each
op eagerly on example inputs while generating it*: shapes are always known, a generated op that
raises is a generator bug (never silently dropped), and values whose numel exceeds a cap are
rejected.  Ops come from families (pointwise unary / binary with broadcasting and Python scalars,
reductions and scans, views, matmul, indexing, softmax and normalization, conv and pooling).  A
second operand is a constant (captured, unbatched), a new program input (so transforms see it
too), or an earlier value of matching shape.  ``.view`` is only emitted on values that are
contiguous whatever the input layout (an outer ``vmap`` hands the loop oracle non-contiguous
slices, on which eager ``view`` legitimately fails).  Index tensors are literal constants.

**Choices.**  Everything random goes through a ``Chooser``: ``DataChooser`` draws from
hypothesis (so failures shrink to small programs and shallow stacks: every choice shrinks
towards its first option, which is the simplest), ``RandomChooser`` from ``random.Random`` (for
the command line).  ``python -m tests.fuzz.programs -n 300`` runs cases outside pytest and
prints what ran: layer counts, loop-fallback ops, deliberate refusals and mismatches.
"""
from __future__ import annotations

import argparse
import collections
import os
import dataclasses
import math
import random
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

DTYPE = torch.float64
NUMEL_CAP = 48


# ---------------------------------------------------------------------------------------------
# Choosers

class Chooser:
    def integer(self, lo: int, hi: int) -> int:  # inclusive; shrinks towards lo
        raise NotImplementedError

    def choice(self, seq: Sequence):
        return seq[self.integer(0, len(seq) - 1)]

    def boolean(self, p_true: float = 0.5) -> bool:
        # shrinks towards False
        return self.integer(0, 999) >= int(1000 * (1 - p_true))


class RandomChooser(Chooser):
    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def integer(self, lo, hi):
        return self.rng.randint(lo, hi)


class DataChooser(Chooser):
    def __init__(self, data):
        from hypothesis import strategies as st
        self.data, self.st = data, st

    def integer(self, lo, hi):
        if lo == hi:
            return lo
        return self.data.draw(self.st.integers(lo, hi))


# ---------------------------------------------------------------------------------------------
# Programs

def _randn(shape, seed):
    """The constants' values: deterministic float64 normal samples."""
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def _numel(shape) -> int:
    return int(math.prod(shape))


@dataclasses.dataclass
class Var:
    name: str
    shape: Tuple[int, ...]
    contig: bool          # contiguous whatever the layout of the program's inputs
    value: torch.Tensor   # the eager value while generating


class ProgramBuilder:
    def __init__(self, c: Chooser, max_inputs: int, seed: int):
        self.c = c
        self.max_inputs = max_inputs
        self.seed = seed
        self.inputs: List[Var] = []
        self.pool: List[Var] = []
        self.consts: List[Tuple[str, str]] = []   # (name, source)
        self.lines: List[Tuple[str, str]] = []
        self.env: Dict[str, Any] = {"torch": torch, "F": F, "_randn": _randn}
        self.n_consts = 0
        self.n_vars = 0

    # -- operands
    def new_input(self, shape) -> Var:
        name = f"x{len(self.inputs)}"
        value = _randn(shape, 10_000 + self.seed * 7 + len(self.inputs))
        v = Var(name, tuple(shape), False, value)
        self.inputs.append(v)
        self.pool.append(v)
        self.env[name] = value
        return v

    def const(self, shape) -> str:
        name = f"C{self.n_consts}"
        src = f"_randn({tuple(shape)!r}, {self.seed * 31 + self.n_consts})"
        self.n_consts += 1
        self.consts.append((name, src))
        self.env[name] = eval(src, self.env)
        return name

    def literal(self, src: str, prefix="I") -> str:
        name = f"{prefix}{self.n_consts}"
        self.n_consts += 1
        self.consts.append((name, src))
        self.env[name] = eval(src, self.env)
        return name

    def index(self, shape, hi: int, lo: int = 0) -> str:
        """A literal int64 index tensor of ``shape`` with values in [lo, hi)."""
        n = _numel(shape)
        vals = [self.c.integer(lo, hi - 1) for _ in range(n)]
        t = torch.tensor(vals, dtype=torch.long).reshape(shape)
        return self.literal(f"torch.tensor({t.tolist()!r})")

    def mask(self, shape, need_true=False) -> str:
        n = _numel(shape)
        vals = [self.c.boolean() for _ in range(n)]
        if need_true and not any(vals):
            vals[self.c.integer(0, n - 1)] = True
        t = torch.tensor(vals, dtype=torch.bool).reshape(shape)
        return self.literal(f"torch.tensor({t.tolist()!r})", prefix="M")

    def operand(self, shape) -> str:
        """A tensor of exactly ``shape``: a constant, a new input, or an earlier value."""
        shape = tuple(shape)
        options = ["const"]
        if len(self.inputs) < self.max_inputs:
            options.append("input")
        same = [v for v in self.pool if v.shape == shape]
        if same:
            options.append("pool")
        kind = self.c.choice(options)
        if kind == "const":
            return self.const(shape)
        if kind == "input":
            return self.new_input(shape).name
        return self.c.choice(same[::-1]).name

    def pick(self) -> Var:
        """An operand, most often the latest value (so programs are chains through x0)."""
        if len(self.pool) == 1 or not self.c.boolean(0.3):
            return self.pool[-1]
        return self.c.choice(self.pool[::-1])

    # -- adding a line
    def add(self, expr: str, contig: bool) -> Optional[Var]:
        try:
            with torch.no_grad():
                value = eval(expr, self.env)   # a generator bug raises here, loudly
        except Exception as e:
            shapes = {v.name: v.shape for v in self.pool}
            raise AssertionError(f"generator bug: {expr!r} raised {e}; shapes {shapes}") from e
        assert isinstance(value, torch.Tensor) and value.dtype == DTYPE, (expr, value)
        if value.numel() > NUMEL_CAP or value.numel() == 0:
            return None
        name = f"v{self.n_vars}"
        self.n_vars += 1
        self.lines.append((name, expr))
        self.env[name] = value
        v = Var(name, tuple(value.shape), contig, value)
        self.pool.append(v)
        return v


def rand_shape(c: Chooser, max_rank=3, max_dim=3) -> Tuple[int, ...]:
    rank = c.integer(0, max_rank)
    return tuple(c.integer(1, max_dim) for _ in range(rank))


def shape_with_numel(c: Chooser, n: int, max_rank=4) -> List[int]:
    rank = c.integer(0 if n == 1 else 1, max_rank)
    dims = [1] * rank
    m, p = n, 2
    factors = []
    while m > 1:
        while m % p == 0:
            factors.append(p)
            m //= p
        p += 1
    for f in factors:
        dims[c.integer(0, rank - 1)] *= f
    return dims


def _dim(c: Chooser, rank: int) -> int:
    """A dim of a rank-``rank`` tensor, sometimes negative (rank 0 allows 0 and -1)."""
    r = max(rank, 1)
    d = c.integer(0, r - 1)
    return d - r if c.boolean(0.3) else d


def _slices(d: int) -> str:
    return ":, " * d


# -- families: each returns (expr, contig) or None when it does not apply to `a`

UNARY = ["torch.sin({a})", "torch.tanh({a})", "torch.exp({a}.clamp(-3.0, 3.0))", "({a} * {a})",
         "torch.cos({a})", "torch.sigmoid({a})", "torch.abs({a})", "(-{a})", "torch.relu({a})",
         "F.softplus({a})", "F.gelu({a})", "F.silu({a})", "torch.atan({a})", "torch.erf({a})",
         "torch.sqrt({a} * {a} + 1.0)", "torch.log1p({a} * {a})", "torch.rsqrt({a} * {a} + 0.5)",
         "torch.where({a} > 0, {a}, 0.1 * {a})", "F.leaky_relu({a}, 0.2)",
         "{a}.clamp(min=-1.0, max=1.0)", "torch.reciprocal({a} * {a} + 1.0)", "{a}.pow(3)",
         "torch.square({a})", "F.elu({a})", "F.logsigmoid({a})", "torch.sinh({a}.clamp(-3, 3))",
         "({a} ** 2)", "F.hardtanh({a}, -0.5, 0.5)", "torch.lerp({a}, torch.sin({a}), 0.3)",
         "torch.log(torch.cosh({a}.clamp(-3.0, 3.0)))", "torch.expm1({a}.clamp(max=2.0))",
         "torch.nan_to_num({a})", "{a}.clone()"]

SCALAR_BINARY = ["({a} + {s})", "({s} - {a})", "({a} * {s})", "({a} / {s})",
                 "({s} / ({a} * {a} + 1.0))", "torch.pow({a}.abs() + 0.5, {s})",
                 "torch.clamp({a}, max={s})", "torch.where({a} > {s}, {a}, {s})",
                 "torch.add({a}, {s}, alpha=2)", "({a} * torch.tensor({s}, dtype=torch.float64))",
                 "torch.sub({a}, {s})", "torch.mul({a}, {s})", "torch.rsub({a}, {s})"]
SCALARS = ["2.0", "0.5", "-1.5", "3", "-2", "0.25"]

# atan2's second operand is shifted away from 0: at atan2(0, 0) (v and v, both zeroed by triu)
# the derivative is 0/0, and the formula orders give NaN or a number.
BINARY = ["({a} + {b})", "({a} * {b})", "({a} - {b})", "({a} / ({b} * {b} + 1.0))",
          "torch.maximum({a}, {b})", "torch.minimum({a}, {b})", "torch.atan2({a}, {b} + 2.0)",
          "torch.where({a} > {b}, {a}, {b})", "torch.add({a}, {b}, alpha=0.5)",
          "torch.lerp({a}, {b}, 0.25)", "torch.pow({a}.abs() + 0.5, {b})",
          "torch.addcmul({a}, {a}, {b}, value=0.5)", "torch.hypot({a}, {b} + 2.0)",
          "torch.xlogy({a}, {b} * {b} + 1.0)", "torch.copysign({a}, {b})"]


def fam_unary(b: ProgramBuilder, a: Var):
    return b.c.choice(UNARY).format(a=a.name), a.contig


def fam_binary(b: ProgramBuilder, a: Var):
    c = b.c
    kind = c.choice(["scalar", "tensor", "pool", "int_const"])
    if kind == "scalar":
        return c.choice(SCALAR_BINARY).format(a=a.name, s=c.choice(SCALARS)), a.contig
    if kind == "pool":
        others = [v for v in b.pool if _broadcasts(a.shape, v.shape)]
        other = c.choice(others[::-1]).name
    elif kind == "int_const":
        if a.shape and c.boolean():
            shape = a.shape[-1:]
        else:
            shape = ()
        vals = torch.tensor([c.integer(-2, 3) for _ in range(_numel(shape))]).reshape(shape)
        other = b.literal(f"torch.tensor({vals.tolist()!r})")
        return c.choice(["({a} * {b})", "({a} + {b})", "({b} - {a})"]).format(
            a=a.name, b=other), False
    else:
        rank = len(a.shape)
        keep = c.integer(0, rank)
        shape = list(a.shape[rank - keep:])
        for i in range(len(shape)):
            if c.boolean(0.3):
                shape[i] = 1
        if keep == rank and rank < 4 and c.boolean(0.2):
            shape = [c.integer(1, 2)] + shape
        other = b.operand(shape)
    x, y = a.name, other
    if c.boolean(0.3):
        x, y = y, x
    return c.choice(BINARY).format(a=x, b=y), False


def _broadcasts(s1, s2) -> bool:
    try:
        torch.broadcast_shapes(s1, s2)
        return True
    except RuntimeError:
        return False


def fam_reduction(b: ProgramBuilder, a: Var):
    c = b.c
    r = len(a.shape)
    if r == 0 or c.boolean(0.1):
        return c.choice(["{a}.sum()", "{a}.mean()", "torch.amax({a})", "{a}.prod()",
                         "torch.logsumexp({a}.reshape(-1), 0)", "{a}.var(correction=0)",
                         "torch.amin({a})", "{a}.norm()"]).format(a=a.name), True
    keep = c.choice(["False", "True"])
    if r >= 2 and c.boolean(0.25):
        d1 = c.integer(0, r - 1)
        d2 = c.choice([d for d in range(r) if d != d1])
        dims = f"({d1}, {d2 - r if c.boolean(0.3) else d2})"
        tmpl = c.choice(["torch.sum({a}, {d}, keepdim={k})", "{a}.mean({d}, keepdim={k})",
                         "torch.amax({a}, {d}, keepdim={k})", "torch.logsumexp({a}, {d}, {k})",
                         "torch.var({a}, {d}, correction=0, keepdim={k})",
                         "torch.amin({a}, dim={d}, keepdim={k})"])
        return tmpl.format(a=a.name, d=dims, k=keep), False
    d = _dim(c, r)
    tmpl = c.choice(["torch.sum({a}, {d}, keepdim={k})", "{a}.mean({d}, keepdim={k})",
                     "torch.amax({a}, {d}, keepdim={k})", "torch.logsumexp({a}, {d}, {k})",
                     "torch.prod({a}, {d}, keepdim={k})",
                     "torch.var({a}, {d}, correction=0, keepdim={k})",
                     "{a}.max(dim={d}, keepdim={k}).values", "{a}.min({d}).values",
                     "torch.cumsum({a}, {d})", "torch.cumprod({a}, dim={d})",
                     "torch.logcumsumexp({a}, {d})", "torch.sum({a}, dim=[{d}])",
                     "torch.amin({a}, {d}, keepdim={k})", "torch.mean({a}, dim={d})",
                     "torch.sort({a}, dim={d}, stable=True).values",
                     "torch.cummax({a}, {d}).values", "torch.norm({a}, dim={d})"])
    return tmpl.format(a=a.name, d=d, k=keep), False


def fam_view(b: ProgramBuilder, a: Var):
    c = b.c
    s, r, n = a.shape, len(a.shape), a.name
    opts = ["reshape", "unsqueeze", "slice", "expand", "contiguous", "flatten"]
    if r >= 1:
        opts += ["squeeze", "select", "narrow", "flip", "roll", "repeat", "split", "cat",
                 "unbind", "index_int"]
    if r >= 2:
        opts += ["transpose", "permute", "mT", "movedim", "diagonal", "tril", "unfold",
                 "unflatten", "stack"]
    kind = c.choice(opts)
    if kind == "reshape":
        shape = shape_with_numel(c, _numel(s))
        if shape and c.boolean(0.3):
            shape[c.integer(0, len(shape) - 1)] = -1
        if a.contig and c.boolean(0.7):
            return f"{n}.view({tuple(shape)})", True
        return c.choice([f"{n}.reshape({tuple(shape)})",
                         f"torch.reshape({n}, {tuple(shape)})"]), a.contig
    if kind == "contiguous":
        return c.choice([f"{n}.contiguous()", f"{n}.clone(memory_format=torch.contiguous_format)"]), True
    if kind == "flatten":
        if r >= 2 and c.boolean():
            s0 = c.integer(0, r - 2)
            return f"{n}.flatten({s0}, {c.integer(s0 + 1, r - 1)})", a.contig
        return f"{n}.flatten()", a.contig
    if kind == "unsqueeze":
        d = c.integer(0, r)
        if c.boolean(0.3):
            d -= r + 1
        return c.choice([f"{n}.unsqueeze({d})", f"{n}[None]", f"{n}[..., None]"]), a.contig
    if kind == "squeeze":
        return c.choice([f"{n}.squeeze({_dim(c, r)})", f"{n}.squeeze()"]), a.contig
    if kind == "transpose":
        d1, d2 = _dim(c, r), _dim(c, r)
        return c.choice([f"{n}.transpose({d1}, {d2})", f"torch.swapaxes({n}, {d1}, {d2})"]), False
    if kind == "mT":
        return f"{n}.mT", False
    if kind == "permute":
        perm = list(range(r))
        for i in range(r - 1, 0, -1):
            j = c.integer(0, i)
            perm[i], perm[j] = perm[j], perm[i]
        perm = [p - r if c.boolean(0.2) else p for p in perm]
        return f"{n}.permute({', '.join(map(str, perm))})", False
    if kind == "movedim":
        return f"torch.movedim({n}, {_dim(c, r)}, {_dim(c, r)})", False
    if kind == "slice":
        if r == 0:
            return f"{n}[...]", a.contig
        d = c.integer(0, r - 1)
        size = s[d]
        start = c.integer(0, size - 1)
        stop = c.integer(start + 1, size)
        step = c.integer(1, 2)
        st_src = str(start - size) if c.boolean(0.3) else str(start)
        return f"{n}[{_slices(d)}{st_src}:{stop}:{step}]", False
    if kind == "select":
        d = _dim(c, r)
        size = s[d]
        i = c.integer(-size, size - 1)
        return f"{n}.select({d}, {i})", False
    if kind == "index_int":
        d = c.integer(0, r - 1)
        i = c.integer(-s[d], s[d] - 1)
        return f"{n}[{_slices(d)}{i}]", False
    if kind == "narrow":
        d = _dim(c, r)
        size = s[d]
        start = c.integer(0, size - 1)
        return f"{n}.narrow({d}, {start}, {c.integer(1, size - start)})", False
    if kind == "expand":
        new = [c.integer(1, 3) if k == 1 else k for k in s]
        if not new or c.boolean(0.4):
            new = [c.integer(1, 2)] + new
        lead = len(new) - r
        src = [str(v) if (i < lead or s[i - lead] == 1 or not c.boolean(0.3)) else "-1"
               for i, v in enumerate(new)]
        return c.choice([f"{n}.expand({', '.join(src)})",
                         f"torch.broadcast_to({n}, {tuple(new)})"]), False
    if kind == "flip":
        return f"torch.flip({n}, ({_dim(c, r)},))", False
    if kind == "roll":
        return f"torch.roll({n}, {c.integer(-2, 2)}, {_dim(c, r)})", False
    if kind == "repeat":
        reps = [c.integer(1, 2) for _ in range(r + c.integer(0, 1))]
        return c.choice([f"{n}.repeat({', '.join(map(str, reps))})",
                         f"torch.tile({n}, {tuple(reps)})"]), True
    if kind == "split":
        d = _dim(c, r)
        size = s[d]
        k = c.integer(1, size)
        pieces = -(-size // k)
        i = c.integer(0, pieces - 1)
        return c.choice([f"{n}.split({k}, {d})[{i}]",
                         f"torch.chunk({n}, {pieces}, {d})[{min(i, len(torch.chunk(a.value, pieces, d)) - 1)}]"]), False
    if kind == "unbind":
        d = _dim(c, r)
        return f"{n}.unbind({d})[{c.integer(0, s[d] - 1)}]", False
    if kind == "cat":
        d = _dim(c, r)
        other = list(s)
        other[d] = c.integer(1, 2)
        o = b.operand(other)
        pair = f"({n}, {o})" if c.boolean() else f"({o}, {n})"
        return f"torch.cat({pair}, {d})", True
    if kind == "stack":
        o = b.operand(s)
        d = c.integer(-(r + 1), r)
        return f"torch.stack(({n}, {o}), {d})", True
    if kind == "diagonal":
        d1 = c.integer(0, r - 1)
        d2 = c.choice([d for d in range(r) if d != d1])
        return f"torch.diagonal({n}, {c.integer(-1, 1)}, {d1}, {d2})", False
    if kind == "tril":
        return c.choice([f"torch.tril({n})", f"torch.triu({n}, 1)", f"{n}.tril(-1)"]), False
    if kind == "unfold":
        d = _dim(c, r)
        size = c.integer(1, s[d])
        return f"{n}.unfold({d}, {size}, {c.integer(1, 2)})", False
    if kind == "unflatten":
        d = c.integer(0, r - 1)
        k = s[d]
        divs = [q for q in range(1, k + 1) if k % q == 0]
        q = c.choice(divs)
        return f"{n}.unflatten({d}, ({q}, {k // q}))", a.contig
    raise AssertionError(kind)


def fam_matmul(b: ProgramBuilder, a: Var):
    c = b.c
    s, r, n = a.shape, len(a.shape), a.name
    if r == 0:
        return None
    k = s[-1]
    m = c.integer(1, 3)
    if r == 1:
        kind = c.choice(["vec", "mat", "bmat", "left", "dot", "outer", "mv", "einsum_outer"])
        if kind == "vec":
            return f"({n} @ {b.operand((k,))})", False
        if kind == "mat":
            return f"({n} @ {b.operand((k, m))})", False
        if kind == "bmat":
            return f"({n} @ {b.operand((c.integer(1, 2), k, m))})", False
        if kind == "left":
            return f"({b.operand((m, k))} @ {n})", False
        if kind == "dot":
            return c.choice(["torch.dot({a}, {w})", "torch.einsum('i,i->', {a}, {w})",
                             "torch.inner({a}, {w})"]).format(a=n, w=b.operand((k,))), False
        if kind == "outer":
            return f"torch.outer({n}, {b.operand((m,))})", True
        if kind == "mv":
            return f"torch.mv({b.operand((m, k))}, {n})", True
        return f"torch.einsum('i,j->ij', {n}, {b.operand((m,))})", False
    if r == 2:
        nn_ = s[0]
        kind = c.choice(["mat", "vec", "bmat", "mm", "left", "gram", "einsum", "linear", "mv",
                         "einsum_rowdot", "addmm"])
        if kind == "mat":
            return f"({n} @ {b.operand((k, m))})", False
        if kind == "vec":
            return f"({n} @ {b.operand((k,))})", False
        if kind == "bmat":
            return f"torch.matmul({n}, {b.operand((c.integer(1, 2), k, m))})", False
        if kind == "mm":
            return f"torch.mm({n}, {b.operand((k, m))})", True
        if kind == "left":
            return f"({b.operand((m, nn_))} @ {n})", False
        if kind == "gram":
            return c.choice([f"({n} @ {n}.mT)", f"({n}.mT @ {n})", f"torch.mm({n}.t(), {n})"]), False
        if kind == "einsum":
            return f"torch.einsum('ij,jk->ik', {n}, {b.operand((k, m))})", False
        if kind == "linear":
            bias = b.operand((m,)) if c.boolean() else "None"
            return f"F.linear({n}, {b.operand((m, k))}, {bias})", False
        if kind == "mv":
            return f"torch.mv({n}, {b.operand((k,))})", True
        if kind == "addmm":
            return f"torch.addmm({b.operand((m,))}, {n}, {b.operand((k, m))})", True
        return f"torch.einsum('ij,ij->i', {n}, {b.operand(s)})", False
    if r == 3:
        kind = c.choice(["mat", "vec", "bmat", "bmm", "einsum", "gram", "bcast"])
        if kind == "mat":
            return f"({n} @ {b.operand((k, m))})", False
        if kind == "vec":
            return f"({n} @ {b.operand((k,))})", False
        if kind == "bmat":
            return f"({n} @ {b.operand((s[0], k, m))})", False
        if kind == "bcast":
            return f"({n} @ {b.operand((1, k, m))})", False
        if kind == "bmm":
            return f"torch.bmm({n}, {b.operand((s[0], k, m))})", True
        if kind == "einsum":
            return f"torch.einsum('bij,bjk->bik', {n}, {b.operand((s[0], k, m))})", False
        return f"({n} @ {n}.transpose(-1, -2))", False
    return f"({n} @ {b.operand((k, m))})", False


def fam_indexing(b: ProgramBuilder, a: Var):
    c = b.c
    s, r, n = a.shape, len(a.shape), a.name
    if r == 0:
        return None
    opts = ["index_select", "gather", "adv0", "take_along", "masked_fill", "index_add",
            "index_add_zeros", "take", "bool_mask", "index_put", "scatter_add", "where_mask",
            "index_fill"]
    if r >= 2:
        opts += ["adv1", "adv2", "adv_slice", "adv_ellipsis", "embedding"]
    kind = c.choice(opts)
    if kind == "index_select":
        d = _dim(c, r)
        idx = b.index((c.integer(1, 3),), s[d])
        return f"torch.index_select({n}, {d}, {idx})", False
    if kind in ("gather", "take_along"):
        d = _dim(c, r)
        shape = [c.integer(1, 3) if (j == d % r) else c.integer(1, s[j]) for j in range(r)]
        if kind == "take_along":
            shape = [k if (j == d % r or k == 1) else s[j] for j, k in enumerate(shape)]
        idx = b.index(shape, s[d])
        if kind == "gather":
            return f"torch.gather({n}, {d}, {idx})", False
        return f"torch.take_along_dim({n}, {idx}, dim={d})", False
    if kind in ("adv0", "embedding"):
        shape = (c.integer(1, 3),) if c.boolean(0.7) else (c.integer(1, 2), c.integer(1, 2))
        idx = b.index(shape, s[0], lo=-s[0])
        return f"{n}[{idx}]", False
    if kind == "adv1":
        idx = b.index((c.integer(1, 3),), s[1])
        return f"{n}[:, {idx}]", False
    if kind == "adv2":
        k = c.integer(1, 3)
        i1 = b.index((k,), s[0])
        i2 = b.index((k,) if c.boolean() else (1,), s[1])
        return f"{n}[{i1}, {i2}]", False
    if kind == "adv_slice":
        idx = b.index((c.integer(1, 3),), s[0])
        return f"{n}[{idx}, {c.integer(0, s[1] - 1)}:]", False
    if kind == "adv_ellipsis":
        idx = b.index((c.integer(1, 3),), s[-1])
        return f"{n}[..., {idx}]", False
    if kind == "embedding" and r == 2:
        idx = b.index((c.integer(1, 3),), s[0])
        return f"F.embedding({idx}, {n})", False
    if kind == "take":
        idx = b.index((c.integer(1, 4),), _numel(s))
        return f"torch.take({n}, {idx})", False
    if kind == "bool_mask":
        j = c.integer(1, r)
        m = b.mask(s[:j], need_true=True)
        return f"{n}[{m}]", False
    if kind == "masked_fill":
        m = b.mask(s[c.integer(0, r):])
        return f"{n}.masked_fill({m}, 0.5)", False
    if kind == "where_mask":
        m = b.mask(s)
        other = b.operand(s) if c.boolean() else "0.0"
        return f"torch.where({m}, {n}, {other})", False
    if kind == "index_fill":
        d = _dim(c, r)
        return f"{n}.index_fill({d}, {b.index((c.integer(1, 2),), s[d])}, -1.0)", False
    if kind == "index_add":
        d = _dim(c, r)
        k = c.integer(1, 3)
        idx = b.index((k,), s[d])
        src = list(s)
        src[d] = k
        return f"{n}.index_add({d}, {idx}, {b.operand(src)})", False
    if kind == "index_add_zeros":
        d = _dim(c, r)
        out = list(s)
        out[d] = c.integer(1, 3)
        idx = b.index((s[d],), out[d])
        return f"torch.zeros({tuple(out)}, dtype=torch.float64).index_add({d}, {idx}, {n})", False
    if kind == "index_put":
        k = c.integer(1, 3)
        idx = b.index((k,), s[0])
        vals = b.operand((k,) + s[1:])
        return f"{n}.index_put(({idx},), {vals}, accumulate=True)", False
    if kind == "scatter_add":
        d = _dim(c, r)
        shape = [c.integer(1, 3) if (j == d % r) else c.integer(1, s[j]) for j in range(r)]
        idx = b.index(shape, s[d])
        src = b.operand(shape)
        return f"{n}.scatter_add({d}, {idx}, {src})", False
    raise AssertionError(kind)


def fam_softmax(b: ProgramBuilder, a: Var):
    c = b.c
    s, r, n = a.shape, len(a.shape), a.name
    kind = c.choice(["softmax", "log_softmax", "layer_norm", "normalize", "F_softmax"])
    d = _dim(c, r)
    if kind == "softmax":
        return f"torch.softmax({n}, {d})", False
    if kind == "log_softmax":
        return f"torch.log_softmax({n}, dim={d})", False
    if kind == "F_softmax":
        return f"F.softmax({n}, dim={d})", False
    if r == 0:
        return None
    if kind == "normalize":
        return f"F.normalize({n}, dim={d})", False
    k = c.integer(1, r)
    shape = s[r - k:]
    if c.boolean():
        return f"F.layer_norm({n}, {tuple(shape)})", False
    return f"F.layer_norm({n}, {tuple(shape)}, {b.operand(shape)}, {b.operand(shape)})", False


def fam_conv(b: ProgramBuilder, a: Var):
    c = b.c
    s, r, n = a.shape, len(a.shape), a.name
    if r in (2, 3) and (r == 2 or c.boolean()):
        spatial = 1
    elif r in (3, 4):
        spatial = 2
    else:
        return None
    batched_in = (r == spatial + 2)
    C = s[1] if batched_in else s[0]
    sizes = s[-spatial:]
    if c.boolean(0.25):
        k = c.integer(1, min(sizes))
        fn = c.choice(["avg_pool", "max_pool"])
        return f"F.{fn}{spatial}d({n}, {k})", False
    groups = c.choice([g for g in (1, 2, 3) if C % g == 0])
    cout = groups * c.integer(1, 2)
    stride, dil, pad = c.integer(1, 2), c.integer(1, 2), c.integer(0, 1)
    ks = []
    for L in sizes:
        kmax = max(1, (L + 2 * pad - 1) // dil + 1)
        ks.append(c.integer(1, min(3, kmax)))
    w = b.operand((cout, C // groups) + tuple(ks))
    bias = b.operand((cout,)) if c.boolean() else "None"
    return (f"F.conv{spatial}d({n}, {w}, {bias}, stride={stride}, padding={pad}, "
            f"dilation={dil}, groups={groups})"), False


FAMILIES = {"unary": fam_unary, "binary": fam_binary, "reduction": fam_reduction,
            "view": fam_view, "matmul": fam_matmul, "indexing": fam_indexing,
            "softmax": fam_softmax, "conv": fam_conv}
# weights: how often each family is drawn
FAMILY_ORDER = ["unary", "binary", "view", "reduction", "matmul", "indexing", "view",
                "binary", "softmax", "conv", "unary", "reduction", "indexing", "matmul", "view"]


@dataclasses.dataclass
class Program:
    input_shapes: List[Tuple[int, ...]]
    output_shapes: List[Tuple[int, ...]]
    consts: List[Tuple[str, str]]
    lines: List[Tuple[str, str]]
    outputs: List[str]
    families: List[str]

    def source(self) -> str:
        out = [f"{name} = {src}" for name, src in self.consts]
        args = ", ".join(f"x{i}" for i in range(len(self.input_shapes)))
        out.append(f"def f({args}):")
        out += [f"    {name} = {expr}" for name, expr in self.lines]
        out.append(f"    return ({', '.join(self.outputs)},)")
        return "\n".join(out)

    def function(self, reference: bool = False) -> Callable:
        """The program as a function; ``reference=True`` (the oracle's) runs layer_norm as
        primitive ops: PyTorch's fused kernel treats its mean and rstd as constants, so plain
        autograd differentiates it wrongly three or more times (see _ReferenceF)."""
        env = {"torch": torch, "F": _ReferenceF if reference else F, "_randn": _randn}
        exec(self.source(), env)
        return env["f"]


class _ReferenceF:
    """``torch.nn.functional`` with a layer_norm written as primitive ops, for the oracle.
    The fused native_layer_norm returns mean and rstd as outputs autograd treats as constants,
    and its backward formulas take them as inputs; derivatives of order three and more then
    miss every term through them (third-order reverse of a 4-vector's layer_norm is off by
    2.1 against finite differences)."""

    def __getattr__(self, name):
        return getattr(F, name)

    @staticmethod
    def layer_norm(x, shape, weight=None, bias=None, eps=1e-5):
        dims = tuple(range(-len(shape), 0))
        centred = x - x.mean(dims, keepdim=True)
        out = centred / torch.sqrt((centred ** 2).mean(dims, keepdim=True) + eps)
        if weight is not None:
            out = out * weight
        return out if bias is None else out + bias


_ReferenceF = _ReferenceF()


def gen_program(c: Chooser, *, max_ops=5, max_inputs=2, families=None,
                max_rank=3) -> Program:
    seed = c.integer(0, 10_000)
    b = ProgramBuilder(c, max_inputs, seed)
    b.new_input(rand_shape(c, max_rank))
    fam_names = families or FAMILY_ORDER
    used = []
    n_ops = c.integer(1, max_ops)
    for _ in range(n_ops):
        for _attempt in range(6):
            fam = c.choice(fam_names)
            a = b.pick()
            res = FAMILIES[fam](b, a)
            if res is None:
                continue
            if b.add(*res) is not None:
                used.append(fam)
                break
    outs = [b.pool[-1]]
    if c.boolean(0.15) and len(b.pool) >= 2:
        outs.append(c.choice(b.pool[:-1][::-1]))
    return Program([v.shape for v in b.inputs], [v.shape for v in outs], b.consts, b.lines,
                   [v.name for v in outs], used)


# ---------------------------------------------------------------------------------------------
# Transform layers.  Each turns an inner signature (input shapes, output shapes) into the outer
# one, builds the transformed function for a backend (functrans or torch.func), and builds the
# plain-PyTorch oracle from the inner oracle.

def _fresh(x: torch.Tensor) -> torch.Tensor:
    """A new node to differentiate w.r.t. (separates this level's grads from outer levels')."""
    return x.view_as(x) if x.requires_grad else x.detach().requires_grad_()


def _zeros(shape):
    return torch.zeros(shape, dtype=DTYPE)


def _grads(outputs, inputs, grad_outputs=None):
    """``autograd.grad`` with create_graph; zeros for inputs the outputs do not reach."""
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs or [None] * len(outputs))
             if o.requires_grad]
    if not pairs:
        return [torch.zeros_like(x) for x in inputs]
    res = torch.autograd.grad([o for o, _ in pairs], inputs,
                              grad_outputs=[g for _, g in pairs] if grad_outputs else None,
                              create_graph=True, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(res, inputs)]


def _leaves(x) -> tuple:
    return tuple(pytree.tree_leaves(x))


class Layer:
    kind = "?"

    def sig(self, ins, outs):
        raise NotImplementedError

    def build(self, T, f):
        raise NotImplementedError

    def oracle(self, f):
        raise NotImplementedError

    def describe(self, inner: str) -> str:
        raise NotImplementedError


@dataclasses.dataclass
class VmapLayer(Layer):
    in_dims: Tuple[Optional[int], ...]
    out_dims: Tuple[int, ...]
    size: int
    chunk_size: Optional[int]
    in_dims_int: bool = False    # pass in_dims as one int (all equal)
    out_dims_int: bool = False
    kind = "vmap"

    def sig(self, ins, outs):
        def insert(shape, d):
            if d is None:
                return shape
            d = d % (len(shape) + 1)
            return shape[:d] + (self.size,) + shape[d:]
        return ([insert(s, d) for s, d in zip(ins, self.in_dims)],
                [insert(s, d) for s, d in zip(outs, self.out_dims)])

    def _kwargs(self):
        in_dims = self.in_dims[0] if self.in_dims_int else tuple(self.in_dims)
        out_dims = self.out_dims[0] if self.out_dims_int else tuple(self.out_dims)
        kw = dict(in_dims=in_dims, out_dims=out_dims)
        if self.chunk_size is not None:
            kw["chunk_size"] = self.chunk_size
        return kw

    def build(self, T, f):
        return T.vmap(f, **self._kwargs())

    def oracle(self, f):
        def run(*args):
            results = [f(*[a if d is None else a.select(d, i)
                           for a, d in zip(args, self.in_dims)]) for i in range(self.size)]
            return tuple(torch.stack([r[k] for r in results], d)
                         for k, d in enumerate(self.out_dims))
        return run

    def describe(self, inner):
        kw = ", ".join(f"{k}={v!r}" for k, v in self._kwargs().items())
        return f"vmap({inner}, {kw})"


@dataclasses.dataclass
class GradLayer(Layer):
    argnums: Any                 # int or tuple
    weights: List[Optional[torch.Tensor]]   # per output: None (plain .sum()) or weights
    with_value: bool = False
    kind = "grad"

    def _nums(self):
        return (self.argnums,) if isinstance(self.argnums, int) else tuple(self.argnums)

    def sig(self, ins, outs):
        res = [ins[i] for i in self._nums()]
        if self.with_value:
            res.append(())
        return list(ins), res

    def _reduce(self, outs):
        total = 0
        for o, w in zip(outs, self.weights):
            total = total + (o.sum() if w is None else (o * w).sum())
        return total

    def build(self, T, f):
        scalar = lambda *a: self._reduce(f(*a))
        if self.with_value:
            g = T.grad_and_value(scalar, argnums=self.argnums)
            return lambda *a: (lambda gv: _leaves(gv[0]) + (gv[1],))(g(*a))
        g = T.grad(scalar, argnums=self.argnums)
        return lambda *a: _leaves(g(*a))

    def oracle(self, f):
        def run(*args):
            args = list(args)
            nums = self._nums()
            for i in nums:
                args[i] = _fresh(args[i])
            with torch.enable_grad():
                val = self._reduce(f(*args))
                gs = _grads([val], [args[i] for i in nums])
            return tuple(gs) + ((val,) if self.with_value else ())
        return run

    def describe(self, inner):
        ws = ["sum" if w is None else "wsum" for w in self.weights]
        name = "grad_and_value" if self.with_value else "grad"
        return f"{name}(reduce[{', '.join(ws)}]({inner}), argnums={self.argnums!r})"


@dataclasses.dataclass
class VjpLayer(Layer):
    n_primals: int
    kind = "vjp"

    def sig(self, ins, outs):
        return list(ins) + list(outs), list(outs) + list(ins)

    def build(self, T, f):
        n = self.n_primals

        def run(*a):
            out, fn = T.vjp(f, *a[:n])
            return tuple(out) + _leaves(fn(tuple(a[n:])))
        return run

    def oracle(self, f):
        n = self.n_primals

        def run(*a):
            ps = [_fresh(x) for x in a[:n]]
            with torch.enable_grad():
                outs = f(*ps)
                gs = _grads(list(outs), ps, list(a[n:]))
            return tuple(outs) + tuple(gs)
        return run

    def describe(self, inner):
        return f"vjp_with_cotangents_as_inputs({inner}, n_primals={self.n_primals})"


@dataclasses.dataclass
class JvpLayer(Layer):
    n_primals: int
    use_linearize: bool = False
    kind = "jvp"

    def sig(self, ins, outs):
        return list(ins) + list(ins), list(outs) + list(outs)

    def build(self, T, f):
        n = self.n_primals
        if self.use_linearize:
            def run(*a):
                out, fn = T.linearize(f, *a[:n])
                return tuple(out) + _leaves(fn(*a[n:]))
            return run

        def run(*a):
            out, tout = T.jvp(f, tuple(a[:n]), tuple(a[n:]))
            return tuple(out) + tuple(tout)
        return run

    def oracle(self, f):
        n = self.n_primals

        def run(*a):
            ps = [_fresh(x) for x in a[:n]]
            ts = list(a[n:])
            with torch.enable_grad():
                outs = f(*ps)
                # any u gives the same derivative; not 0, where log|grad| formulas
                # (logcumsumexp's backward) have a 0 * inf = NaN derivative
                us = [torch.ones_like(o).requires_grad_() for o in outs]
                gs = _grads(list(outs), ps, us)
                live = [(g, t) for g, t in zip(gs, ts) if g.requires_grad]
                if live:
                    touts = _grads([g for g, _ in live], us, [t for _, t in live])
                else:
                    touts = [torch.zeros_like(o) for o in outs]
            return tuple(outs) + tuple(touts)
        return run

    def describe(self, inner):
        name = "linearize" if self.use_linearize else "jvp"
        return f"{name}_with_tangents_as_inputs({inner}, n_primals={self.n_primals})"


def _jac_oracle(f, argnum):
    def run(*args):
        args = list(args)
        args[argnum] = p = _fresh(args[argnum])
        with torch.enable_grad():
            outs = f(*args)
            res = []
            for o in outs:
                if not o.requires_grad:
                    res.append(_zeros(tuple(o.shape) + tuple(p.shape)))
                    continue
                flat = o.reshape(-1)
                rows = []
                for i in range(flat.numel()):
                    g, = torch.autograd.grad(flat[i], p, retain_graph=True, create_graph=True,
                                             allow_unused=True)
                    rows.append(torch.zeros_like(p) if g is None else g)
                res.append(torch.stack(rows).reshape(tuple(o.shape) + tuple(p.shape)))
        return tuple(res)
    return run


@dataclasses.dataclass
class JacLayer(Layer):
    mode: str            # 'rev' | 'fwd' | 'hessian'
    argnum: int
    chunk_size: Optional[int] = None
    kind = "jac"

    def sig(self, ins, outs):
        p = tuple(ins[self.argnum])
        times = 2 if self.mode == "hessian" else 1
        return list(ins), [tuple(o) + p * times for o in outs]

    def build(self, T, f):
        kw = {}
        if self.chunk_size is not None and (T.__name__ == "functrans" or self.mode == "rev"):
            kw["chunk_size"] = self.chunk_size
        fn = {"rev": T.jacrev, "fwd": T.jacfwd, "hessian": T.hessian}[self.mode]
        g = fn(f, self.argnum, **kw)
        return lambda *a: _leaves(g(*a))

    def oracle(self, f):
        if self.mode == "hessian":
            return _jac_oracle(_jac_oracle(f, self.argnum), self.argnum)
        return _jac_oracle(f, self.argnum)

    def describe(self, inner):
        name = {"rev": "jacrev", "fwd": "jacfwd", "hessian": "hessian"}[self.mode]
        cs = f", chunk_size={self.chunk_size}" if self.chunk_size is not None else ""
        return f"{name}({inner}, argnums={self.argnum}{cs})"


# ---------------------------------------------------------------------------------------------
# Cases

@dataclasses.dataclass
class Case:
    program: Program
    layers: List[Layer]          # innermost first
    input_shapes: List[Tuple[int, ...]]
    output_shapes: List[Tuple[int, ...]]
    seed: int

    def inputs(self) -> List[torch.Tensor]:
        return [_randn(s, self.seed + 101 * i) for i, s in enumerate(self.input_shapes)]

    def build(self, T) -> Callable:
        f = self.program.function()
        for layer in self.layers:
            f = layer.build(T, f)
        return f

    def oracle(self) -> Callable:
        f = self.program.function(reference=True)
        for layer in self.layers:
            f = layer.oracle(f)
        return f

    def describe(self) -> str:
        s = "f"
        for layer in self.layers:
            s = layer.describe(s)
        return s

    def report(self) -> str:
        return (f"program:\n{self.program.source()}\n"
                f"transforms (T = functrans | torch.func): {self.describe()}\n"
                f"outer input shapes: {self.input_shapes}  (values: _randn(shape, {self.seed} + "
                f"101 * i))")


STACK_KINDS = ["vmap", "grad", "vjp", "jvp", "jacrev", "jacfwd", "vmap", "hessian"]


def gen_stack(c: Chooser, program: Program, *, min_depth=1, max_depth=3, kinds=None,
              cost_cap=400, numel_cap=400, max_inputs=6) -> Tuple[List[Layer], list, list]:
    ins, outs = list(program.input_shapes), list(program.output_shapes)
    kinds = kinds or STACK_KINDS
    depth = c.integer(min_depth, max_depth)
    layers: List[Layer] = []
    cost = 1.0
    for _ in range(depth):
        for _attempt in range(4):
            kind = c.choice(kinds)
            layer, mult = _gen_layer(c, kind, ins, outs)
            if layer is None:
                continue
            new_ins, new_outs = layer.sig(ins, outs)
            if (cost * mult > cost_cap or len(new_ins) > max_inputs or len(new_outs) > 6
                    or sum(_numel(s) for s in new_outs) > numel_cap
                    or any(_numel(s) > NUMEL_CAP * 4 for s in new_ins)):
                continue
            cost *= mult
            layers.append(layer)
            ins, outs = new_ins, new_outs
            break
    return layers, ins, outs


def _gen_layer(c: Chooser, kind: str, ins, outs):
    n = len(ins)
    if kind == "vmap":
        size = c.integer(1, 3)
        in_dims = [None if c.boolean(0.3) else c.integer(-(len(s) + 1), len(s)) for s in ins]
        if all(d is None for d in in_dims):
            i = c.integer(0, n - 1)
            in_dims[i] = c.integer(-(len(ins[i]) + 1), len(ins[i]))
        in_dims_int = len(set(in_dims)) == 1 and c.boolean(0.5)
        out_dims = [c.integer(-(len(s) + 1), len(s)) for s in outs]
        out_dims_int = len(set(out_dims)) == 1 and c.boolean(0.5)
        chunk = None if c.boolean(0.6) else c.integer(1, size + 1)
        return VmapLayer(tuple(in_dims), tuple(out_dims), size, chunk, in_dims_int,
                         out_dims_int), size
    if kind == "grad":
        if n > 1 and c.boolean(0.4):
            nums = tuple(sorted({c.integer(0, n - 1) for _ in range(2)}))
        else:
            nums = c.integer(0, n - 1)
        weights = [None if c.boolean(0.3) else _randn(s, 77 + i) for i, s in enumerate(outs)]
        return GradLayer(nums, weights, with_value=c.boolean(0.25)), 3
    if kind == "vjp":
        return VjpLayer(n), 3
    if kind == "jvp":
        return JvpLayer(n, use_linearize=c.boolean(0.25)), 5
    if kind in ("jacrev", "jacfwd", "hessian"):
        argnum = c.integer(0, n - 1)
        p = _numel(ins[argnum])
        o = sum(_numel(s) for s in outs)
        chunk = None if c.boolean(0.7) else c.integer(1, 3)
        mode = {"jacrev": "rev", "jacfwd": "fwd", "hessian": "hessian"}[kind]
        if mode == "hessian":
            if o * p * p > 64:
                return None, 0
            return JacLayer(mode, argnum, chunk), (1 + 2 * o) * (1 + 2 * o * p)
        return JacLayer(mode, argnum, chunk), 1 + 2 * o
    raise AssertionError(kind)


def gen_case(c: Chooser, *, program_kw=None, stack_kw=None) -> Case:
    program = gen_program(c, **(program_kw or {}))
    layers, ins, outs = gen_stack(c, program, **(stack_kw or {}))
    return Case(program, layers, ins, outs, seed=c.integer(0, 1000))


# ---------------------------------------------------------------------------------------------
# Known bugs.  Each entry names the strict-xfail test in test_fuzz_regressions.py that pins the
# bug; the default run and the sweep skip (hypothesis ``assume``) the cases a predicate matches,
# and count them.  Remove an entry when its xfail test starts passing.

def _forward_layers(case: Case) -> bool:
    return any(getattr(l, "kind", "") == "jvp" or getattr(l, "mode", "") in ("fwd", "hessian")
               for l in case.layers)


# (name of the strict-xfail test, predicate on a Case).  Three bugs listed here before
# (vmap(hessian) over 0-d examples and over matmul with in_dims=(2, 1), jacfwd of addcmul with
# an unbatched self) are fixed, and their tests in test_fuzz_regressions.py pass.
KNOWN_BUGS: List[Tuple[str, Callable[[Case], bool]]] = [
    ("test_logcumsumexp_third_order_through_double_vjp_is_nan",
     lambda case: "logcumsumexp" in case.program.source() and _forward_layers(case)),
    ("test_jvp_of_jacfwd_of_grad_of_strided_conv_raises",
     lambda case: "F.conv" in case.program.source() and "stride=1" not in case.program.source()
     and _forward_layers(case) and len(case.layers) >= 3),
]


def known_bug(case: Case) -> Optional[str]:
    for name, matches in KNOWN_BUGS:
        if matches(case):
            return name
    return None


# ---------------------------------------------------------------------------------------------
# Running one case

STATS = {"cases": 0, "oracle_nonfinite": 0, "refused": collections.Counter(), "known_bug_skipped": collections.Counter(), "fallback_ops": collections.Counter(),
         "layers": collections.Counter(), "families": collections.Counter()}


class Mismatch(AssertionError):
    pass


def _tf_result(case: Case, args, expected):
    # torch.func has crashed the interpreter (segfault) on some failing stacks, which would take
    # the whole test run down with it: its result is shown only when asked for.
    if not os.environ.get("FUNCTRANS_FUZZ_TORCH_FUNC"):
        return "(not run; set FUNCTRANS_FUZZ_TORCH_FUNC=1 to show torch.func's result)"
    try:
        import torch.func as tf
        res = [t.detach() for t in case.build(tf)(*args)]
    except Exception as e:   # torch.func may not support the stack; only for the message
        return f"torch.func raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    agree = _compare(tuple(res), expected, 1e-6, 1e-6)
    return f"(torch.func {'agrees with the oracle' if agree is None else 'differs from the oracle: ' + agree})\n{_fmt(res)}"


def _fmt(x):
    if isinstance(x, (list, tuple)):
        return "\n".join(f"  [{i}] shape={tuple(t.shape)} dtype={t.dtype}\n{t}"
                         if isinstance(t, torch.Tensor) else f"  [{i}] {t!r}"
                         for i, t in enumerate(x))
    return str(x)


def run_case(case: Case, *, rtol=1e-6, atol=1e-6, skip_known=True) -> str:
    """Compare functrans against the oracle; returns 'ok', 'refused' (a deliberate
    ``FunctransError``) or 'known-bug' (skipped, see ``known_bug``); raises Mismatch."""
    import functrans
    from functrans import _levels
    from functrans.errors import FunctransError, PerformanceWarning

    STATS["cases"] += 1
    if skip_known:
        bug = known_bug(case)
        if bug:
            STATS["known_bug_skipped"][bug] += 1
            return "known-bug"
    STATS["layers"].update(layer.kind for layer in case.layers)
    STATS["families"].update(case.program.families)
    args = case.inputs()
    expected = [t.detach() for t in case.oracle()(*args)]   # an invalid program raises here
    if any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in expected):
        # PyTorch's own formulas give NaN/inf here (e.g. logcumsumexp's double backward over a
        # size-1 dim): the reference is undefined, so the case says nothing about functrans.
        STATS["oracle_nonfinite"] += 1
        return "oracle-nonfinite"
    args = case.inputs()
    try:
        with functrans.config.strict_fallback(False), functrans.record_fallbacks() as rep, \
                warnings.catch_warnings():
            warnings.simplefilter("ignore", PerformanceWarning)
            actual = case.build(functrans)(*args)
    except FunctransError as e:
        assert _levels.stack() == [], f"levels leaked after an error: {_levels.stack()}"
        STATS["refused"][f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"] += 1
        return "refused"
    except Exception as e:
        assert _levels.stack() == [], f"levels leaked after an error: {_levels.stack()}"
        raise Mismatch(f"functrans raised {type(e).__name__}: {e}\n{case.report()}\n"
                       f"oracle:\n{_fmt(expected)}\ntorch.func:\n{_tf_result(case, args, expected)}"
                       ) from e
    for op in rep.ops.values():
        STATS["fallback_ops"][op.op] += op.calls
    assert _levels.stack() == [], f"levels leaked: {_levels.stack()}\n{case.report()}"
    problem = _compare(actual, expected, rtol, atol)
    if problem:
        raise Mismatch(f"{problem}\n{case.report()}\nfunctrans:\n{_fmt(list(actual))}\n"
                       f"oracle:\n{_fmt(expected)}\ntorch.func:\n{_tf_result(case, args, expected)}")
    return "ok"


def _compare(actual, expected, rtol, atol) -> Optional[str]:
    if not isinstance(actual, tuple) or len(actual) != len(expected):
        return f"structure: functrans returned {type(actual).__name__} of " \
               f"{len(actual) if isinstance(actual, (tuple, list)) else '?'}, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        if not isinstance(a, torch.Tensor):
            return f"output {i}: not a tensor: {type(a).__name__}"
        if type(a) is not torch.Tensor and not isinstance(a, torch.nn.Parameter):
            return f"output {i}: a {type(a).__name__} escaped, not a plain tensor"
        if a.shape != e.shape:
            return f"output {i}: shape {tuple(a.shape)} != oracle {tuple(e.shape)}"
        if a.dtype != e.dtype:
            return f"output {i}: dtype {a.dtype} != oracle {e.dtype}"
        try:
            torch.testing.assert_close(a.detach(), e, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as err:
            return f"output {i}: values differ: {str(err).splitlines()[1:4]}"
    return None


def summary() -> str:
    lines = [f"cases run: {STATS['cases']}",
             f"layers: {dict(STATS['layers'])}",
             f"op families: {dict(STATS['families'])}"]
    if STATS["refused"]:
        lines.append(f"deliberate refusals ({sum(STATS['refused'].values())}):")
        lines += [f"  {n} x {msg}" for msg, n in STATS["refused"].most_common()]
    lines.append(f"not compared: {STATS['oracle_nonfinite']} with a NaN/inf oracle")
    if STATS["known_bug_skipped"]:
        lines.append(f"skipped as known bugs: {dict(STATS['known_bug_skipped'])}")
    if STATS["fallback_ops"]:
        lines.append("ops that ran on the loop fallback (calls):")
        lines += [f"  {op}: {n}" for op, n in STATS["fallback_ops"].most_common()]
    else:
        lines.append("no op ran on the loop fallback")
    return "\n".join(lines)


PROFILES = {
    # vmap and vmap(vmap): every op family, longer programs
    "vmap": dict(program_kw=dict(max_ops=6, max_inputs=3),
                 stack_kw=dict(min_depth=1, max_depth=2, kinds=["vmap"])),
    # one or two autodiff transforms, no vmap of the user's
    "autodiff": dict(program_kw=dict(max_ops=4, max_inputs=2),
                     stack_kw=dict(min_depth=1, max_depth=2,
                                   kinds=["grad", "vjp", "jvp", "jacrev", "jacfwd", "hessian"],
                                   cost_cap=200)),
    # anything, up to three deep
    "mixed": dict(program_kw=dict(max_ops=4, max_inputs=2),
                  stack_kw=dict(min_depth=2, max_depth=3, cost_cap=200)),
    # the sweep: bigger programs, more inputs
    "sweep": dict(program_kw=dict(max_ops=7, max_inputs=3),
                  stack_kw=dict(min_depth=1, max_depth=3, cost_cap=600)),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="mixed", choices=sorted(PROFILES))
    ap.add_argument("--keep-going", action="store_true")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--include-known-bugs", action="store_true")
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.time()
    failures = 0
    for i in range(args.start, args.start + args.n):
        case = gen_case(RandomChooser(args.seed * 1_000_003 + i), **PROFILES[args.profile])
        if args.progress:
            print(f"case {i}: {case.describe()}", file=sys.stderr, flush=True)
        try:
            run_case(case, skip_known=not args.include_known_bugs)
        except Mismatch as e:
            failures += 1
            print(f"--- case {i} FAILED\n{e}\n")
            if not args.keep_going:
                break
    print(summary())
    print(f"{failures} failure(s); {time.time() - t0:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
