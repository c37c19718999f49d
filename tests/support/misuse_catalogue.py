"""The misuse catalogue: every common mistake with torch.func-style transforms, what functrans
says about it, and what torch.func does.

ONE source for two things: ``tests/test_misuse_catalogue.py`` runs every entry (exception type,
a regex on the message, and the keywords that show the message names the argument and the
fix), and ``python -m tests.support.misuse_catalogue --markdown`` prints ``docs/misuse.md`` from the
messages functrans gives now (a test checks the file is up to date; regenerate it with
``.venv/bin/python -m tests.support.misuse_catalogue --markdown > docs/misuse.md``).

Each snippet is executed with ``exec`` in a fresh namespace holding ``torch``, ``nn``, ``F``
(``torch.nn.functional``), ``ft`` (``functrans``), ``x = torch.randn(4, 3)`` (a batch of 4
examples) and ``w = torch.randn(3)`` (one example).  The snippet's last statement makes the
mistake.  Entries with ``exc=None`` are mistakes that raise nothing (in functrans and in
torch.func): their ``check`` expression, evaluated after the snippet, states what the user gets.
"""
from __future__ import annotations

import argparse
import re
import sys
import textwrap
import warnings
from dataclasses import dataclass, field
from typing import Optional, Tuple, Type

import torch

import functrans
from functrans.errors import (EscapedBatchedTensorError, InplaceIntoUnbatchedError,
                              TransformArgumentError, UnsupportedUnderVmap)

YES, NO, NA = "yes", "no", "n/a"


@dataclass(frozen=True)
class Entry:
    id: str
    mistake: str                      # what the user did, in words
    source: str                       # the user code (exec'ed)
    exc: Optional[Type[BaseException]]  # None: no error (see ``check``)
    match: str = ""                   # regex the message must match (re.S)
    keywords: Tuple[str, ...] = ()    # substrings naming the argument / the fix
    what: str = YES                   # does the message say what happened,
    which: str = YES                  # which argument/value it is about,
    fix: str = YES                    # and what to do instead?
    torch_func: str = ""              # torch.func's behaviour where it differs (one line)
    check: str = ""                   # for exc=None: an expression that must be True
    note: str = ""                    # for exc=None or known-bad messages: what happens
    categories: Tuple[str, ...] = field(default=())

    @property
    def code(self) -> str:
        return textwrap.dedent(self.source).strip("\n")


def _e(id, mistake, source, exc, match="", keywords=(), **kw) -> Entry:
    return Entry(id, mistake, source, exc, match, tuple(keywords), **kw)


U, T, E = UnsupportedUnderVmap, TransformArgumentError, EscapedBatchedTensorError
_ITEM_TF = ("RuntimeError: \"vmap: It looks like you're calling .item() on a Tensor ...\" "
            "(no fix suggested)")
_CF_TF = ("RuntimeError: \"... attempting to use a Tensor in some data-dependent control "
          "flow. We don't support that yet, please file an issue\"")
_INPLACE_TF = ("RuntimeError: \"vmap: inplace arithmetic(self, *extra_args) is not possible "
               "...\" (names neither the op nor the tensor)")

ENTRIES = [
    # --- Python values from batched tensors -------------------------------------------------
    _e("item", "`.item()` on a batched value",
       """
       def f(a):
           return a * a.sum().item()
       ft.vmap(f)(x)
       """, U, r"\.item\(\).*torch\.where", ("item()", "torch.where", "outside vmap"),
       which=NA, torch_func=_ITEM_TF),
    _e("bool", "`bool()` on a batched value",
       """
       def f(a):
           return a if bool(a[0] > 0) else -a
       ft.vmap(f)(x)
       """, U, r"bool\(tensor\).*torch\.where", ("bool(tensor)", "torch.where"),
       which=NA, torch_func=_CF_TF),
    _e("float", "`float()` on a batched value",
       """
       def f(a):
           return a / float(a.norm())
       ft.vmap(f)(x)
       """, U, r"float\(\).*torch\.where", ("float()", "torch.where"),
       which=NA, torch_func=_ITEM_TF),
    _e("if_on_batched", "Python control flow on a batched value (`if x > 0:`)",
       """
       def f(a):
           if a.sum() > 0:
               return a
           return -a
       ft.vmap(f)(x)
       """, U, r"if x > 0.*torch\.where\(cond, a, b\)", ("if x > 0", "torch.where"),
       which=NA, torch_func=_CF_TF),
    _e("int_index", "`int()` of a batched value used as an index",
       """
       def f(a):
           return a[int(a.argmax())]
       ft.vmap(f)(x)
       """, U, r"int\(\)/float\(\).*torch\.where.*x\[k\]", ("int()", "torch.where", "x[k]"),
       which=NA, torch_func=_ITEM_TF),
    _e("item_several_elements", "`.item()` on a batched value of several elements per example",
       """
       ft.vmap(lambda a: a * a.item())(x)
       """, U, r"\.item\(\).*torch\.where", (".item()", "batched tensor", "outside vmap"),
       which=NA, torch_func=_ITEM_TF),
    _e("if_on_batched_vector", "Python control flow on a batched value of several elements "
       "per example (`if a > 0:` with `a` of shape (3,))",
       """
       def f(a):
           if a > 0:
               return a
           return -a
       ft.vmap(f)(x)
       """, U, r"bool\(tensor\).*`if x:`.*torch\.where\(cond, a, b\)",
       ("bool(tensor)", "if x:", "torch.where"), which=NA, torch_func=_CF_TF),
    _e("tolist", "`.tolist()` inside vmap",
       """
       ft.vmap(lambda a: torch.tensor(a.tolist()))(x)
       """, U, r"\.tolist\(\).*outside vmap", (".tolist()", "outside vmap"), which=NA,
       torch_func="RuntimeError: \"Cannot access data pointer of Tensor that doesn't have "
                  "storage\""),
    _e("numpy", "`.numpy()` inside vmap",
       """
       import numpy as np
       ft.vmap(lambda a: torch.from_numpy(np.tanh(a.numpy())))(x)
       """, U, r"\.numpy\(\).*outside vmap", (".numpy()", "torch ops", "outside vmap"),
       which=NA,
       torch_func="RuntimeError: \"Cannot access data pointer of Tensor that doesn't have "
                  "storage\""),
    _e("torch_tensor_of_batched", "`torch.tensor([...])` built from batched elements",
       """
       ft.vmap(lambda a: torch.tensor([a[0], a[1]]))(x)
       """, U, r"torch\.tensor\(\[\.\.\.\]\) of batched elements.*torch\.stack",
       ("torch.tensor([...])", "torch.stack"), which=NA, torch_func=_ITEM_TF),
    _e("data_dependent_shape", "boolean-mask indexing (`x[x > 0]`): a data-dependent shape",
       """
       ft.vmap(lambda a: a[a > 0])(x)
       """, U, r"shape depends on the values.*torch\.where\(mask, x, 0\)",
       ("aten.index.Tensor", "torch.where(mask, x, 0)"),
       torch_func="RuntimeError: \"vmap: We do not support batching operators that can "
                  "support dynamic shape\" (no fix suggested)"),
    _e("zero_d_bool_index", "indexing with a per-example 0-d boolean (`x[m]`, m a single "
       "True/False per example)",
       """
       ft.vmap(lambda a, m: a[m])(x, x[:, 0] > 0)
       """, U, r"0-d boolean.*size 1 if True, of size 0 if False.*torch\.where\(mask, x, other\)",
       ("x[mask]", "torch.where(mask, x, other)"),
       torch_func="RuntimeError: \"vmap: We do not support batching operators that can "
                  "support dynamic shape\" (no fix suggested)"),
    # --- in-place writes into unbatched tensors ---------------------------------------------
    _e("setitem_into_zeros", "`out = torch.zeros(shape)` then `out[i] = x` inside vmap",
       """
       def f(a):
           out = torch.zeros(3)
           for i in range(3):
               out[i] = 2 * a[i]
           return out
       ft.vmap(f)(x)
       """, InplaceIntoUnbatchedError, r"copy_.*not batched.*torch\.zeros_like\(x\)",
       ("torch.zeros(shape)", "argument 0", "torch.zeros_like(x)", "out-of-place"),
       torch_func=_INPLACE_TF),
    _e("copy_into_zeros", "`out = torch.zeros(shape)` then `out.copy_(x)`",
       """
       def f(a):
           out = torch.zeros(3)
           out.copy_(a)
           return out
       ft.vmap(f)(x)
       """, InplaceIntoUnbatchedError, r"aten\.copy_.*not batched.*zeros_like",
       ("aten.copy_", "argument 0", "torch.zeros_like(x)"), torch_func=_INPLACE_TF),
    _e("iadd_into_zeros", "`out = torch.zeros(shape)` then `out += x`",
       """
       def f(a):
           out = torch.zeros(3)
           out += a
           return out
       ft.vmap(f)(x)
       """, InplaceIntoUnbatchedError, r"aten\.add_.*not batched.*zeros_like",
       ("aten.add_", "argument 0", "torch.zeros_like(x)", "out-of-place"),
       torch_func="RuntimeError: \"output with shape [3] doesn't match the broadcast shape "
                  "[4, 3]\" (mentions no vmap)"),
    _e("inplace_into_unmapped_arg", "in-place write into an argument with in_dim None",
       """
       acc = torch.zeros(3)
       ft.vmap(lambda a, acc: acc.add_(a), in_dims=(0, None))(x, acc)
       """, InplaceIntoUnbatchedError, r"aten\.add_.*argument 0.*captured from outside vmap",
       ("aten.add_", "argument 0", "out-of-place"),
       torch_func="RuntimeError: \"output with shape [3] doesn't match the broadcast shape "
                  "[4, 3]\""),
    # --- autograd misuse -------------------------------------------------------------------
    _e("backward_inside_grad", "`.backward()` inside `grad`",
       """
       def loss(p):
           l = (p ** 2).sum()
           l.backward()
           return l
       ft.grad(loss)(w)
       """, T, r"^grad\(loss.*called \.backward\(\).*return the loss",
       (".backward()", "return the loss", "outside the transform"), which=NA,
       torch_func="RuntimeError: \"backward() called inside a functorch transform. This is "
                  "not supported, please use functorch.grad or functorch.vjp instead\""),
    _e("backward_inside_vjp", "`.backward()` inside the function given to `vjp`",
       """
       def f(p):
           l = (p ** 2).sum()
           l.backward()
           return l
       out, vjp_fn = ft.vjp(f, w)
       vjp_fn(torch.tensor(1.0))
       """, T, r"^vjp\(f, \*primals\): the function called \.backward\(\)",
       (".backward()", "return the loss"), which=NA,
       torch_func="RuntimeError: \"backward() called inside a functorch transform ...\""),
    _e("grad_non_scalar", "`grad` of a function with a non-scalar output",
       """
       ft.grad(torch.sin)(w)
       """, T, r"scalar \(0-d\) tensor, got shape \(3,\).*vjp or jacrev",
       ("shape (3,)", ".sum()", "jacrev"),
       torch_func="RuntimeError: \"Expected f(*args) to return a scalar Tensor, got tensor "
                  "with 1 dims. Maybe you wanted to use the vjp or jacrev APIs instead?\""),
    _e("vmap_grad_non_scalar", "per-sample `vmap(grad(f))` where f returns a vector",
       """
       ft.vmap(ft.grad(lambda p: p ** 2))(x)
       """, T, r"^grad\(<lambda>.*got shape \(3,\)", ("shape (3,)", ".sum()"),
       torch_func="same as above"),
    _e("grad_returns_float", "`grad` of a function returning a Python float",
       """
       ft.grad(lambda p: float((p ** 2).sum()))(w)
       """, T, r"must return a scalar tensor, got float", ("got float", "has_aux=True"),
       torch_func="RuntimeError: \"Expected f(*args) to return a Tensor, got <class "
                  "'float'>\""),
    _e("grad_of_int_tensor", "`grad` w.r.t. an integer tensor",
       """
       ft.grad(lambda n: (n * 2.0).sum())(torch.arange(3))
       """, T, r"args\[0\] has dtype torch\.int64.*x\.float\(\)",
       ("args[0]", "torch.int64", "x.float()", "argnums"),
       torch_func="RuntimeError: \"only Tensors of floating point dtype can require "
                  "gradients\" (no argument named)"),
    _e("jacfwd_of_int_tensor", "`jacfwd` w.r.t. an integer tensor",
       """
       ft.jacfwd(lambda n: n * 2)(torch.arange(3))
       """, T,
       r"^jacfwd\(<lambda>, argnums=0\): primals\[0\] has dtype torch\.int64.*x\.float\(\)",
       ("primals[0]", "torch.int64", "x.float()"),
       torch_func="ValueError: \"Expected primal to be floating point or complex, but got: "
                  "torch.int64\""),
    _e("grad_through_item", "`.item()` / `.detach()` in the loss under `grad`: a silent zero "
                            "gradient",
       """
       result = ft.grad(lambda p: torch.tensor((p ** 2).sum().item()))(w)
       """, None, check="bool((result == 0).all())", what=NA, which=NA, fix=NA,
       note="No error: the loss no longer depends on p, so the gradient is zero "
            "(same in torch.func and in plain autograd)."),
    _e("argnums_out_of_range", "`argnums` out of range",
       """
       ft.grad(lambda p, y: ((p - y) ** 2).sum(), argnums=2)(w, w)
       """, T, r"argnums=2 is out of range.*2 positional argument.*\[-2, 1\]",
       ("argnums=2", "[-2, 1]"),
       torch_func="RuntimeError: \"Got argnum=2, but only 2 positional inputs\""),
    _e("argnums_list", "`argnums` given as a list",
       """
       ft.grad(lambda p, y: (p * y).sum(), argnums=[0, 1])(w, w)
       """, T, r"argnums must be an int or a tuple of ints, got \[0, 1\]",
       ("argnums", "tuple of ints"), fix=YES,
       torch_func="RuntimeError: \"argnums must be int or Tuple[int, ...], got: <class "
                  "'list'>\""),
    _e("grad_non_tensor_arg", "`grad` w.r.t. a Python number",
       """
       ft.grad(lambda p, s: (p * s).sum(), argnums=1)(w, 2.0)
       """, T, r"args\[1\] is a float, not a tensor.*argnums",
       ("args[1]", "argnums"),
       torch_func="ValueError: \"Thing passed to transform API must be Tensor, got <class "
                  "'float'>\" (argument not named)"),
    _e("grad_no_args", "`grad` of a function called with keyword arguments only",
       """
       ft.grad(lambda p: p.sum())(p=w)
       """, T, r"no positional arguments.*argnums", ("positional", "argnums"), which=NA,
       torch_func="RuntimeError: \"Got argnum=0, but only 0 positional inputs\""),
    _e("has_aux_not_pair", "`has_aux=True` but the function returns only the loss",
       """
       ft.grad(lambda p: (p ** 2).sum(), has_aux=True)(w)
       """, T, r"has_aux=True.*pair \(output, aux\); got Tensor",
       ("has_aux=True", "output, aux", "has_aux=False"),
       torch_func="RuntimeError: \"output of function f should be a tuple: (output, aux) if "
                  "has_aux is True\""),
    _e("has_aux_triple", "`has_aux=True` but the function returns (loss, a, b)",
       """
       ft.grad(lambda p: ((p ** 2).sum(), p, p), has_aux=True)(w)
       """, T, r"pair \(output, aux\); got tuple of length 3",
       ("tuple of length 3", "output, aux"), torch_func="same one-line message as above"),
    _e("vjp_cotangent_shape", "`vjp_fn` called with a cotangent of the wrong shape",
       """
       out, vjp_fn = ft.vjp(torch.sin, w)
       vjp_fn(torch.ones(4))
       """, T, r"cotangent of shape \(4,\) .*for an output of shape \(3,\)",
       ("(4,)", "(3,)", "shape of its output"),
       torch_func="RuntimeError: \"Mismatch in shape: grad_output[0] has a shape of "
                  "torch.Size([4]) and output[0] has a shape of torch.Size([3]).\""),
    _e("vjp_cotangent_structure", "`vjp_fn` called with a tuple for a single output",
       """
       out, vjp_fn = ft.vjp(torch.sin, w)
       vjp_fn((torch.ones(3),))
       """, T, r"structure of the function's output \(Tensor\(3,\)\), got \(Tensor\(3,\),\)",
       ("structure", "one cotangent per output"),
       torch_func="RuntimeError: \"Expected pytree structure of cotangents to be the same as "
                  "pytree structure of outputs ... cotangents: (*,), primal output: *\""),
    _e("vjp_cotangent_dtype", "`vjp_fn` called with a float64 cotangent for a float32 output",
       """
       out, vjp_fn = ft.vjp(torch.sin, w)
       vjp_fn(torch.ones(3, dtype=torch.float64))
       """, T, r"cotangent of dtype torch\.float64 .*for an output of dtype torch\.float32",
       ("torch.float64", ".to(torch.float32)"),
       torch_func="accepted without an error"),
    _e("jvp_primals_not_tuple", "`jvp(f, x, t)` instead of `jvp(f, (x,), (t,))`",
       """
       ft.jvp(torch.sin, w, torch.ones(3))
       """, T, r"primals must be a tuple.*primals=\(x,\)", ("primals", "primals=(x,)"),
       torch_func="RuntimeError: \"jvp(f, primals, tangents): Expected primals to be a tuple. "
                  "E.g. it should be valid to call f(*primals).\""),
    _e("jvp_tangent_shape", "`jvp` with a tangent of the wrong shape",
       """
       ft.jvp(torch.sin, (w,), (torch.ones(2),))
       """, T, r"tangent for primals\[0\] has shape \(2,\) but the primal has shape \(3,\)",
       ("primals[0]", "its primal's shape"),
       torch_func="RuntimeError: \"Trying to set a forward gradient that has a different size "
                  "than that of the original Tensor\""),
    _e("jacrev_non_tensor_output", "`jacrev` of a function returning a non-tensor",
       """
       ft.jacrev(lambda p: (p.sin(), 3))(w)
       """, T,
       r"^jacrev\(<lambda>, argnums=0\): the function must return tensors.*output\[1\] is a int",
       ("output[1]", "has_aux=True"),
       torch_func="RuntimeError: \"vjp(f, *primals): expected f(*primals) to return only "
                  "tensors, got unsupported type <class 'int'>\" (says vjp, not jacrev)"),
    # --- vmap arguments -------------------------------------------------------------------
    _e("batch_size_mismatch", "mapped inputs with different batch sizes",
       """
       ft.vmap(torch.dot)(torch.randn(4, 3), torch.randn(5, 3))
       """, T, r"disagree on batch size.*args\[0\] \(in_dim=0\): size 4.*"
               r"args\[1\] \(in_dim=0\): size 5",
       ("args[0] (in_dim=0): size 4", "args[1] (in_dim=0): size 5", "in_dim None"),
       torch_func="ValueError: \"Expected all tensors to have the same size in the mapped "
                  "dimension, got sizes [4, 5]\" (which argument is not said)"),
    _e("shared_arg_not_unmapped", "a shared weight passed without `in_dims=(None, 0)`",
       """
       W = torch.randn(3, 3)
       ft.vmap(ft.grad(lambda W, a: (W @ a).sum()))(W, x)
       """, T, r"disagree on batch size.*args\[0\] \(in_dim=0\): size 3.*size 4",
       ("args[0]", "in_dim None"), torch_func="same as above"),
    _e("in_dims_count", "`in_dims` tuple shorter than the positional arguments",
       """
       ft.vmap(torch.dot, in_dims=(0,))(x, x)
       """, T, r"in_dims has 1 entries but the function was called with 2 positional",
       ("in_dims has 1 entries", "one in_dim per positional argument"),
       torch_func="ValueError: \"in_dims is not compatible with the structure of `inputs`. "
                  "in_dims has structure TreeSpec(tuple, None, [*]) but inputs has ...\""),
    _e("in_dims_pytree_mismatch", "`in_dims` structure does not match a tuple argument",
       """
       ft.vmap(lambda pair: pair[0] + pair[1], in_dims=((0, 0, 0),))((x, x))
       """, T, r"in_dims\[0\]=\(0, 0, 0\) does not match the structure of argument 0 "
               r"\(\(Tensor\(4, 3\), Tensor\(4, 3\)\)\)",
       ("in_dims[0]", "argument 0", "same structure"),
       torch_func="ValueError: prints both TreeSpecs (multi-line) without saying which "
                  "argument"),
    _e("in_dims_dict_keys", "`in_dims` dict with keys that the argument does not have",
       """
       params = {"weight": x}
       ft.vmap(lambda p: p["weight"].sum(), in_dims=({"w": 0},))(params)
       """, T, r"in_dims\[0\]=\{'w': 0\}.*\{'weight': Tensor\(4, 3\)\}",
       ("in_dims[0]", "'weight'", "same structure"),
       torch_func="ValueError: prints both TreeSpecs"),
    _e("in_dim_out_of_range", "`in_dims` past the last dim",
       """
       ft.vmap(torch.sin, in_dims=2)(x)
       """, T, r"in_dim=2 is out of range for args\[0\].*\(4, 3\).*\[-2, 1\]",
       ("args[0]", "[-2, 1]"),
       torch_func="ValueError: \"Got in_dim=2 for some input, but that input is a Tensor of "
                  "dimensionality 2 ...\" (which input is not said)"),
    _e("in_dim_negative_out_of_range", "a negative `in_dims` past the first dim",
       """
       ft.vmap(torch.sin, in_dims=-3)(x)
       """, T, r"in_dim=-3 is out of range for args\[0\].*\[-2, 1\]", ("args[0]", "[-2, 1]"),
       torch_func="ValueError: same as above, input not named"),
    _e("in_dims_str", "`in_dims` that is not an int/None/tuple (a string)",
       """
       ft.vmap(torch.sin, in_dims="batch")
       """, T, r"in_dims must be an int, None.*'batch' \(str\)", ("in_dims", "int, None"),
       torch_func="ValueError at call time: \"expected `in_dims` to be int or a (potentially "
                  "nested) tuple ..., got: <class 'str'>\""),
    _e("in_dims_float", "a float in `in_dims`",
       """
       ft.vmap(torch.sin, in_dims=(0.0,))
       """, T, r"contains 0\.0 \(float\)", ("in_dims", "int, None"),
       torch_func="ValueError at call time: \"Got in_dim=0.0 for an input but in_dim must be "
                  "either an integer dimension or None\""),
    _e("in_dims_bool", "`in_dims=True` (a bool is not a dim)",
       """
       ft.vmap(torch.sin, in_dims=True)
       """, T, r"contains True \(bool\)", ("in_dims", "int, None"),
       torch_func="TypeError: \"size(): argument 'dim' (position 1) must be int, not bool\""),
    _e("in_dim_for_non_tensor", "an int in_dim for a Python number argument",
       """
       ft.vmap(lambda a, s: a * s, in_dims=(0, 0))(x, 3.0)
       """, T, r"in_dim=0 was given for args\[1\], which is a float.*in_dim None",
       ("args[1]", "in_dim None"),
       torch_func="ValueError: \"Got in_dim=0 for an input but the input is of type <class "
                  "'float'>. ... please use None as the respective in_dim\""),
    _e("nothing_mapped", "every `in_dims` None",
       """
       ft.vmap(torch.sin, in_dims=None)(x)
       """, T, r"no input is mapped", ("int in_dim",), which=NA,
       torch_func="ValueError: \"expected `in_dims` to be int or a (potentially nested) tuple "
                  "..., got: <class 'NoneType'>\""),
    _e("in_dim_for_0d_tensor", "mapping over a 0-d tensor",
       """
       ft.vmap(torch.sin)(torch.tensor(1.0))
       """, T, r"args\[0\], a 0-d tensor.*cannot be mapped.*in_dim None",
       ("args[0]", "0-d tensor", "in_dim None"),
       torch_func="ValueError: \"... expected in_dim to satisfy -0 <= in_dim < 0.\""),
    _e("kwargs_not_mapped", "a keyword argument expected to be mapped (only positional "
                            "arguments are)",
       """
       result = ft.vmap(lambda a, b: a + b)(x, b=torch.randn(4, 3))
       """, None, check="result.shape == (4, 4, 3)", what=NA, which=NA, fix=NA,
       note="No error (documented, same as torch.func): keyword arguments are never mapped, "
            "so every example sees the whole b and broadcasting gives shape (4, 4, 3) instead "
            "of (4, 3). Pass b positionally."),
    _e("out_dims_structure", "`out_dims` structure does not match the outputs",
       """
       ft.vmap(lambda a: a * 2, out_dims=(0, 0))(x)
       """, T, r"out_dims=\(0, 0\) does not match the structure of the function's output "
               r"\(Tensor\(3,\)\)", ("out_dims", "one int/None for every output"),
       torch_func="ValueError: \"out_dims is not compatible with the structure of `outputs`\" "
                  "(prints TreeSpecs)"),
    _e("out_dim_out_of_range", "a negative `out_dims` out of range",
       """
       ft.vmap(lambda a: a * 2, out_dims=-3)(x)
       """, T, r"out_dim=-3 is out of range for output.*\[-2, 1\]", ("output", "[-2, 1]"),
       torch_func="IndexError: \"Dimension out of range (expected to be in range of [-2, 1], "
                  "but got -3)\" (does not say out_dims)"),
    _e("out_dims_none_for_batched", "`out_dims=None` for an output that depends on the batch",
       """
       ft.vmap(lambda a: a * 2, out_dims=None)(x)
       """, T, r"out_dim is None for output.*depends on the mapped inputs",
       ("out_dim is None", "int out_dim"),
       torch_func="ValueError: \"`<lambda>` can not return a BatchedTensor when out_dim is "
                  "None\""),
    _e("vmap_returns_int", "vmap of a function returning a Python int",
       """
       ft.vmap(lambda a: (a.sum(), 3))(x)
       """, T, r"returned a int at output\[1\].*out_dim to None",
       ("output[1]", "torch.tensor(value)", "out_dim to None"),
       torch_func="ValueError: \"`<lambda>` must only return Tensors, got type <class 'int'>. "
                  "Did you mean to set out_dims= to None for output?\""),
    _e("vmap_returns_none", "vmap of a function that forgot to `return`",
       """
       def f(a):
           y = a * 2
       ft.vmap(f)(x)
       """, T, r"returned a NoneType at output.*forget to return",
       ("NoneType", "Return a tensor", "forget to return"),
       torch_func="ValueError: \"`f` must only return Tensors, got type <class 'NoneType'>\""),
    _e("chunk_size_zero", "`chunk_size=0`",
       """
       ft.vmap(torch.sin, chunk_size=0)
       """, T, r"chunk_size must be None, a positive int or 'auto', got 0",
       ("chunk_size", "chunk_size=None"),
       torch_func="ValueError: \"vmap: chunk_size should be None or greater than 0. (got 0)\""),
    _e("chunk_size_float", "`chunk_size=2.0`",
       """
       ft.vmap(torch.sin, chunk_size=2.0)
       """, T, r"chunk_size must be None, a positive int or 'auto', got 2\.0",
       ("chunk_size", "chunk_size=None"),
       torch_func="TypeError at call time: \"can't multiply sequence by non-int of type "
                  "'float'\""),
    _e("jacrev_chunk_size", "`jacrev(f, chunk_size=0)`",
       """
       ft.jacrev(torch.sin, chunk_size=0)
       """, T, r"^jacrev\(sin, argnums=0\): chunk_size must be None, a positive int or 'auto'",
       ("chunk_size", "chunk_size=None"),
       torch_func="ValueError: \"jacrev: `chunk_size` should be greater than 0.\""),
    _e("jacrev_chunk_size_bool", "`jacrev(f, chunk_size=True)` (a bool is not a size)",
       """
       ft.jacrev(torch.sin, chunk_size=True)
       """, T, r"^jacrev\(sin, argnums=0\): chunk_size must be None, a positive int or 'auto', got "
               r"True \(bool\)",
       ("chunk_size", "chunk_size=None"),
       torch_func="accepted, then TypeError at call time: \"new_zeros() takes 1 positional "
                  "argument but 2 were given\""),
    _e("randomness_invalid", "an unknown `randomness` value",
       """
       ft.vmap(torch.sin, randomness="differnet")
       """, T, r"randomness must be one of \('error', 'different', 'same'\), got 'differnet'",
       ("randomness", "'different'"),
       torch_func="RuntimeError: \"Only allowed values for randomness are 'error', "
                  "'different', or 'same'. Got differnet\""),
    # --- randomness, escaped values, modules, per-example shapes -----------------------------
    _e("random_op", "a random op under the default `randomness='error'`",
       """
       ft.vmap(lambda a: a + torch.randn(3))(x)
       """, U, r"aten\.randn.*randomness='error'.*randomness='different'.*randomness='same'",
       ("aten.randn", "randomness='different'", "randomness='same'"),
       torch_func="RuntimeError: \"vmap: called random operation while in randomness error "
                  "mode. Please either use the 'same' or 'different' randomness flags\" (op "
                  "not named)"),
    _e("dropout", "dropout in training mode under the default randomness",
       """
       ft.vmap(lambda a: F.dropout(a, 0.5, training=True))(x)
       """, U, r"aten\.bernoulli_.*randomness='different'",
       ("aten.bernoulli_", "randomness='different'"), torch_func="same as above"),
    _e("escaped_batched_tensor", "a BatchedTensor stored in a list and used after vmap returns",
       """
       saved = []
       def f(a):
           saved.append(a * 2)
           return a
       ft.vmap(f)(x)
       saved[0].sum()
       """, E, r"aten\.sum.*already returned.*escaped.*Return it from the vmapped function",
       ("escaped", "Return it from the vmapped function"),
       torch_func="RuntimeError: \"Either your tensor may have escaped from inside a function "
                  "being vmapped and this is a user error ..., or there is an internal "
                  "functorch error\""),
    _e("escaped_as_input", "an escaped BatchedTensor passed to a later vmap",
       """
       saved = []
       ft.vmap(lambda a: saved.append(a) or a)(x)
       ft.vmap(torch.sin)(saved[0])
       """, E, r"args\[0\] is a BatchedTensor whose vmap .* has already returned.*Return it",
       ("args[0]", "escaped", "Return it from that vmapped function"),
       torch_func="RuntimeError: \"level > batched_level INTERNAL ASSERT FAILED ... please "
                  "report a bug to PyTorch\""),
    _e("batch_norm_running_stats", "BatchNorm in training mode with unbatched running stats",
       """
       bn = nn.BatchNorm1d(3)
       ft.vmap(bn)(torch.randn(4, 5, 3))
       """, U, r"running_mean.*not batched.*replace_all_batch_norm_modules_",
       ("running_mean", "module.eval()", "replace_all_batch_norm_modules_",
        "stack_module_state"),
       torch_func="RuntimeError: \"Batch norm got a batched tensor as input while the "
                  "running_mean or running_var ... were not batched\" (similar)"),
    _e("per_example_shape_mismatch", "a batch-shaped tensor mixed into per-example code",
       """
       ft.vmap(lambda a: a + torch.ones(5))(x)
       """, RuntimeError, r"must match the size of tensor b \(5\)",
       ("aten.add.Tensor",), which=YES, fix=NO,
       note="PyTorch's own message with its type kept; functrans adds a note naming the op "
            "being batched.",
       torch_func="the same eager message, no note"),
]

BY_ID = {e.id: e for e in ENTRIES}
assert len(BY_ID) == len(ENTRIES), "duplicate catalogue ids"


def namespace() -> dict:
    torch.manual_seed(0)
    return {"torch": torch, "nn": torch.nn, "F": torch.nn.functional, "ft": functrans,
            "x": torch.randn(4, 3), "w": torch.randn(3)}


def run(entry: Entry):
    """Run an entry's snippet; return the exception it raised (None if it raised nothing) and
    its namespace."""
    ns = namespace()
    code = compile(entry.code, f"<misuse:{entry.id}>", "exec")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            exec(code, ns)
        except Exception as exc:  # noqa: BLE001 -- we report what the user would see
            return exc, ns
    return None, ns


def message(exc: BaseException) -> str:
    """The text the user sees: the message plus any notes."""
    text = str(exc)
    notes = getattr(exc, "__notes__", None)
    if notes:
        text += "\n" + "\n".join(notes)
    return text


def normalize(text: str) -> str:
    """Remove what changes from run to run (vmap level ids)."""
    return re.sub(r"level (\d+)", "level N", text)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


def markdown() -> str:
    out = [
        "# Misuse catalogue",
        "",
        "Every common mistake with function transforms, the exact error functrans gives, and",
        "what torch.func does. Generated from `tests/support/misuse_catalogue.py` (the same",
        "entries run as tests in `tests/test_misuse_catalogue.py`); regenerate with",
        "`.venv/bin/python -m tests.support.misuse_catalogue --markdown > docs/misuse.md`.",
        f"Messages recorded with torch {torch.__version__.split('+')[0]}. In the snippets `x` is",
        "a batch `torch.randn(4, 3)`, `w` one example `torch.randn(3)`, `ft` is `functrans`.",
        "",
        "The columns *what / which / fix* say whether the message tells what happened, which",
        "argument or value it is about, and what to do instead (n/a: there is no argument to",
        "name, or no error).",
        "",
        "| id | mistake | functrans raises | what | which | fix | torch.func |",
        "|---|---|---|---|---|---|---|",
    ]
    details = []
    for e in ENTRIES:
        exc, ns = run(e)
        raised = "nothing" if exc is None else f"`{type(exc).__name__}`"
        out.append(f"| [{e.id}](#{e.id}) | {_cell(e.mistake)} | {raised} | "
                   f"{e.what} | {e.which} | {e.fix} | {_cell(e.torch_func or 'same')} |")
        details += [f"### {e.id}", "", e.mistake + ".", "", "```python", e.code, "```", ""]
        if exc is None:
            details += ["No exception."]
        else:
            details += [f"`{type(exc).__name__}`:", "", "```text",
                        normalize(message(exc)), "```"]
        if e.note:
            details += ["", e.note]
        if e.torch_func:
            details += ["", f"torch.func: {e.torch_func}"]
        details.append("")
    return "\n".join(out + ["", "## Entries", ""] + details).rstrip("\n") + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print docs/misuse.md")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown())
        return 0
    for e in ENTRIES:
        exc, _ = run(e)
        head = "no error" if exc is None else f"{type(exc).__name__}: {message(exc)}"
        print(f"[{e.id}] {normalize(head)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
