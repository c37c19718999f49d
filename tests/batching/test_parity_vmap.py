"""Surface parity of vmap with torch.func: out_dims=(k,), cat's legacy empty inputs under
autograd, the view metadata of outputs (``out._base``), the errors of Python conversions of a
batched value, and ``debug_unwrap``.  Each case is compared with torch.func on the same inputs
(and values with a loop over the examples)."""
import inspect
import operator

import pytest
import torch
import torch.func

import functrans as ft
from functrans.errors import TransformArgumentError, UnsupportedUnderVmap
from tests.support.oracles import assert_same, loop_oracle, make_batch


# --- out_dims=(k,) for a function returning one tensor ---------------------------------------

@pytest.mark.parametrize("k", [0, 1, 2, -1, -3])
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_one_tuple_out_dims_for_a_single_tensor_output(k, chunk_size):
    x = torch.randn(5, 3, 4)
    f = lambda t: t.sin() * 2
    got = ft.vmap(f, out_dims=(k,), chunk_size=chunk_size)(x)
    # (torch.func's chunked path fails on out_dims=(k,) with an internal AssertionError, so the
    # reference is its unchunked call)
    ref = torch.func.vmap(f, out_dims=(k,))(x)
    assert_same(got, ref)
    assert_same(got, loop_oracle(f, [0], 5, x, out_dim=k))


def test_one_tuple_out_dims_none_for_an_unbatched_output():
    x, w = torch.randn(5, 3), torch.randn(3)
    f = lambda t: w * 2
    assert_same(ft.vmap(f, out_dims=(None,))(x), torch.func.vmap(f, out_dims=(None,))(x))
    with pytest.raises(TransformArgumentError, match="out_dim is None"):
        ft.vmap(lambda t: t * 2, out_dims=(None,))(x)
    with pytest.raises(ValueError):
        torch.func.vmap(lambda t: t * 2, out_dims=(None,))(x)


@pytest.mark.parametrize("f,out_dims", [(lambda t: (t, t * 2), (0,)),
                                        (lambda t: t * 2, (0, 1)),
                                        (lambda t: t * 2, [0])])
def test_out_dims_that_do_not_match_the_outputs_still_raise(f, out_dims):
    x = torch.randn(5, 3)
    with pytest.raises(TransformArgumentError, match="does not match the structure"):
        ft.vmap(f, out_dims=out_dims)(x)
    with pytest.raises(ValueError):
        torch.func.vmap(f, out_dims=out_dims)(x)


# --- cat skips legacy (0,) tensors but autograd records them ---------------------------------

def test_cat_with_only_a_legacy_empty_input_requiring_grad_keeps_requires_grad():
    x = torch.randn(4, 3)
    results = []
    for vmap in (ft.vmap, torch.func.vmap):
        e = torch.empty(0, requires_grad=True)
        out = vmap(lambda t: torch.cat([t, e]))(x)
        assert out.requires_grad
        out.sum().backward()
        results.append((out.detach(), e.grad))
    eager_e = torch.empty(0, requires_grad=True)
    assert torch.cat([x[0], eager_e]).requires_grad
    assert_same(results[0], results[1])
    assert_same(results[0][0], x)
    assert results[0][1].shape == (0,)


def test_cat_with_a_batched_legacy_empty_input_requiring_grad():
    x = torch.randn(4, 3, 2)
    f = lambda t, e: torch.cat([t, e], 1)
    results = []
    for vmap in (ft.vmap, torch.func.vmap):
        e = torch.empty(4, 0, requires_grad=True)
        out = vmap(f)(x, e)
        assert out.requires_grad
        (out * torch.arange(out.numel()).view(out.shape)).sum().backward()
        results.append((out.detach(), e.grad))
    assert_same(results[0], results[1])
    assert_same(results[0][0], loop_oracle(f, [0, 0], 4, x, torch.empty(4, 0)))
    assert results[0][1].shape == (4, 0)


def test_cat_legacy_empty_inputs_take_part_in_type_promotion_and_all_empty_case():
    x = torch.randn(4, 3)
    e64 = torch.empty(0, dtype=torch.float64)
    f = lambda t: torch.cat([e64, t])
    got = ft.vmap(f)(x)
    assert got.dtype == torch.float64
    assert_same(got, loop_oracle(f, [0], 4, x))
    assert_same(got, torch.func.vmap(f)(x))
    g = lambda a, b: torch.cat([a, b])
    a, b = torch.empty(4, 0), torch.empty(4, 0, dtype=torch.float64)
    assert_same(ft.vmap(g)(a, b), torch.func.vmap(g)(a, b))
    assert_same(ft.vmap(g)(a, b), loop_oracle(g, [0, 0], 4, a, b))


# --- views returned by vmap keep their view metadata -----------------------------------------

_VIEWS = {
    "view": lambda t: t.view(2, 6),
    "reshape_as_view": lambda t: t.reshape(12),
    "view_as": lambda t: t.view_as(torch.empty(6, 2)),
    "flatten": lambda t: t.flatten(),
    "transpose": lambda t: t.transpose(0, 1),
    "t": lambda t: t.t(),
    "mT": lambda t: t.mT,
    "permute": lambda t: t.permute(1, 0),
    "select": lambda t: t[1],
    "select_dim1": lambda t: t.select(1, 2),
    "slice": lambda t: t[1:3],
    "slice_step": lambda t: t[:, ::2],
    "narrow": lambda t: t.narrow(1, 1, 2),
    "unsqueeze": lambda t: t.unsqueeze(1),
    "squeeze": lambda t: t.unsqueeze(0).squeeze(0),
    "expand": lambda t: t.unsqueeze(0).expand(2, 3, 4),
    "diagonal": lambda t: t.diagonal(),
    "unbind": lambda t: t.unbind(1)[2],
    "split": lambda t: t.split(2, 1)[1],
    "chunk": lambda t: t.chunk(3, 0)[0],
    "unfold": lambda t: t.unfold(1, 2, 1),
    "movedim": lambda t: t.movedim(0, 1),
    "alias_of_alias": lambda t: t[1:].t()[::2],
    "view_dtype": lambda t: t.view(torch.int32),
    "view_as_real": lambda t: torch.view_as_real(t.to(torch.complex64)).select(-1, 0),
}


@pytest.mark.parametrize("name", sorted(_VIEWS))
@pytest.mark.parametrize("in_dim,out_dim", [(0, 0), (1, 0), (0, 1), (2, -1)])
def test_a_view_of_an_input_has_the_input_as_base(name, in_dim, out_dim):
    f = _VIEWS[name]
    x = make_batch(torch.randn(3, 4), in_dim, 5)
    try:
        f(x.select(in_dim, 0))
    except RuntimeError as e:  # no view of this example exists (eager's view raises)
        assert "view size is not compatible" in str(e)
        with pytest.raises(RuntimeError, match="view size is not compatible"):
            torch.func.vmap(f, in_dims=in_dim, out_dims=out_dim)(x)
        # functrans's view rule copies here (Note [view after moving the bdim]): a copy is no
        # view of the input
        got = ft.vmap(f, in_dims=in_dim, out_dims=out_dim)(x)
        assert got._base is None
        assert_same(got, loop_oracle(lambda t: f(t.contiguous()), [in_dim], 5, x,
                                     out_dim=out_dim))
        return
    got = ft.vmap(f, in_dims=in_dim, out_dims=out_dim)(x)
    base = x if x._base is None else x._base
    try:
        ref = torch.func.vmap(f, in_dims=in_dim, out_dims=out_dim)(x)
    except RuntimeError as e:
        # torch 2.11's torch.func has no batching rule for view.dtype (torch 2.13's has, and
        # its fallback refuses view ops): functrans is held to eager's answer alone, whether
        # the view of an example has the (root) input as its base.
        assert "Batching rule not implemented" in str(e) and name == "view_dtype", e
        ref = None
    assert_same(got, loop_oracle(f, [in_dim], 5, x, out_dim=out_dim))
    if ref is None:
        eager_base = f(x.select(in_dim, 0))._base
        assert (got._base is base) == (eager_base is base), (got._base, eager_base)
        return
    assert_same(got, ref)
    # eager: a view of an example has the (root) input as its base; torch.func agrees unless
    # the op copies (to(complex) above)
    assert (got._base is base) == (ref._base is base), (got._base, ref._base)
    # the view shares the input's storage and version counter, as torch.func's does
    if ref._base is base:
        v0, r0 = got._version, ref._version
        x.add_(1)
        assert got._version != v0 and ref._version != r0
        assert_same(got, ref)


def test_a_view_of_a_view_input_has_the_root_as_base():
    root = torch.randn(6, 4, 3)
    x = root[1:]
    for vmap in (ft.vmap, torch.func.vmap):
        out = vmap(lambda t: t.t())(x)
        assert out._base is root


def test_non_views_and_outputs_that_are_the_input_are_unchanged():
    x = torch.randn(5, 3, 4)
    for f in (lambda t: t * 2, lambda t: t.clone(), lambda t: t.contiguous().sin(),
              lambda t: t.t().reshape(12)):
        got, ref = ft.vmap(f)(x), torch.func.vmap(f)(x)
        assert_same(got, ref)
        assert got._base is None and ref._base is None
    assert ft.vmap(lambda t: t)(x) is x and torch.func.vmap(lambda t: t)(x) is x
    y = x.clone()
    assert ft.vmap(lambda t: t.add_(1))(y) is y


def test_nested_vmap_view_has_the_input_as_base():
    x = torch.randn(2, 3, 4, 5)
    f = ft.vmap(ft.vmap(lambda t: t.t()))
    ref = torch.func.vmap(torch.func.vmap(lambda t: t.t()))(x)
    got = f(x)
    assert_same(got, ref)
    assert got._base is x and ref._base is x


def test_writes_through_a_returned_view_reach_the_input_as_in_torch_func():
    xs = [torch.randn(5, 3, 4) for _ in range(2)]
    xs[1].copy_(xs[0])
    outs = [vmap(lambda t: t[1])(x) for vmap, x in zip((ft.vmap, torch.func.vmap), xs)]
    for o in outs:
        o.mul_(3)
    assert_same(xs[0], xs[1])
    assert_same(outs[0], outs[1])


def test_autograd_through_returned_views():
    w = torch.randn(4)
    grads = []
    for vmap in (ft.vmap, torch.func.vmap):
        x = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(0)).requires_grad_()
        out = vmap(lambda t: t.t()[1:])(x)
        assert out._base is x and out.requires_grad
        (out.sin() * w[:3, None]).sum().backward()
        grads.append(x.grad)
    assert_same(grads[0], grads[1])
    # an input that does not require grad: the returned view is a view of a leaf; an in-place
    # op with a tensor that requires grad then records through it as in eager
    results = []
    for vmap in (ft.vmap, torch.func.vmap):
        x = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(1))
        p = torch.randn(3, requires_grad=True, generator=torch.Generator().manual_seed(2))
        out = vmap(lambda t: t[:, 0])(x)
        assert out._base is x and not out.requires_grad
        out.mul_(p)
        assert x.requires_grad
        x.sum().backward()
        results.append((x.detach(), p.grad))
    assert_same(results[0], results[1])


def test_detached_outputs_of_inputs_that_require_grad_stay_detached():
    x = torch.randn(5, 3, requires_grad=True)
    for vmap in (ft.vmap, torch.func.vmap):
        out = vmap(lambda t: t.detach())(x)
        assert not out.requires_grad and out.grad_fn is None and out._base is None


# --- Python conversions of a batched value ---------------------------------------------------

_CONVERSIONS = {
    "item": lambda a: a.item(),
    "bool": lambda a: bool(a),
    "if": lambda a: a if a else -a,
    "int": lambda a: int(a),
    "float": lambda a: float(a),
    "complex": lambda a: complex(a),
    "tolist": lambda a: torch.tensor(a.tolist()),
}


@pytest.mark.parametrize("name", sorted(_CONVERSIONS))
@pytest.mark.parametrize("example_shape", [(4,), (1,), ()])
def test_python_conversions_of_a_batched_value_name_vmap_and_the_fix(name, example_shape):
    f = _CONVERSIONS[name]
    x = torch.randn(3, *example_shape)
    if name in ("bool", "if"):
        x[1] = 0   # the examples disagree (a branch they all take the same way is taken)
    with pytest.raises(UnsupportedUnderVmap) as info:
        ft.vmap(f)(x)
    msg = str(info.value)
    assert msg.startswith("vmap: ") and "batched tensor" in msg and "outside vmap" in msg, msg
    if name != "tolist":
        assert "torch.where" in msg, msg
    with pytest.raises(Exception):  # torch.func refuses these too
        torch.func.vmap(f)(x)


def test_python_conversions_name_what_was_called():
    x = torch.randn(3, 4)
    for f, what in [(lambda a: a.item(), r"\.item\(\)"), (lambda a: bool(a), r"bool\(tensor\)"),
                    (lambda a: a if a else a, r"if x:"), (lambda a: int(a), r"int\(tensor\)"),
                    (lambda a: float(a), r"float\(tensor\)")]:
        with pytest.raises(UnsupportedUnderVmap, match=f"^vmap: .*{what}.*torch\\.where"):
            ft.vmap(f)(x)


def test_conversions_reached_only_inside_pytorch_still_go_through_the_rule():
    # scalar arguments parsed by PyTorch call aten._local_scalar_dense directly
    # (data_dependent.py's rule)
    f = lambda a: torch.full((2,), a.sum())
    a = torch.randn(3, 2)
    with pytest.raises(UnsupportedUnderVmap, match=r"^vmap: a batched.*_local_scalar_dense.*"
                                                   r"torch\.where"):
        ft.vmap(f)(a)
    with pytest.raises(RuntimeError, match=r"\.item\(\)"):
        torch.func.vmap(f)(a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.complex64])
def test_torch_tensor_of_batched_elements(dtype):
    f = lambda a: torch.tensor([a[0], a[1]])
    x = torch.randn(4, 3).to(dtype)
    with pytest.raises(UnsupportedUnderVmap, match=r"torch\.tensor\(\[\.\.\.\]\).*torch\.stack"):
        ft.vmap(f)(x)
    with pytest.raises(RuntimeError):
        torch.func.vmap(f)(x)


def test_index_of_a_batched_integer():
    k = torch.tensor([0, 1, 2])
    for g in (lambda k: torch.zeros(operator.index(k)), lambda k: torch.zeros(3)[:range(k)[-1]]):
        with pytest.raises(UnsupportedUnderVmap, match=r"operator\.index.*torch\.where"):
            ft.vmap(g)(k)
        with pytest.raises(RuntimeError):
            torch.func.vmap(g)(k)
    # not an integer, or several elements: eager's TypeError, as in a loop over the examples
    for a in (torch.randn(3), torch.tensor([[0, 1], [1, 2], [2, 0]])):
        with pytest.raises(TypeError, match="only integer tensors of a single element"):
            ft.vmap(operator.index)(a)
        with pytest.raises(TypeError, match="only integer tensors of a single element"):
            operator.index(a[0])


def test_conversions_of_ordinary_tensors_inside_vmap_still_work():
    w = torch.tensor([2.0])
    f = lambda t: t * w.item() * float(w) * int(w) + (1 if w else 0)
    x = torch.randn(3, 2)
    assert_same(ft.vmap(f)(x), torch.func.vmap(f)(x))


# --- debug_unwrap ----------------------------------------------------------------------------

def test_debug_unwrap_signature_matches_torch_func():
    ours = inspect.signature(ft.debug_unwrap).parameters
    ref = inspect.signature(torch.func.debug_unwrap).parameters
    assert list(ours) == list(ref)
    for name, p in ref.items():
        assert ours[name].kind == p.kind and ours[name].default == p.default
    assert "debug_unwrap" in ft.__all__ and ft.debug_unwrap.__module__ == "functrans"


def test_debug_unwrap_of_a_plain_tensor_is_the_tensor():
    x = torch.randn(3)
    assert ft.debug_unwrap(x) is x and ft.debug_unwrap(x, recurse=False) is x
    assert torch.func.debug_unwrap(x) is x


@pytest.mark.parametrize("in_dim", [0, 1, -1])
def test_debug_unwrap_under_vmap(in_dim):
    x = make_batch(torch.randn(3, 4), in_dim, 5)
    seen = {}

    def f(tag, unwrap):
        def g(t):
            seen[tag] = (unwrap(t), unwrap(t, recurse=False), unwrap(t * 2))
            return t
        return g
    ft.vmap(f("ours", ft.debug_unwrap), in_dims=in_dim)(x)
    torch.func.vmap(f("ref", torch.func.debug_unwrap), in_dims=in_dim)(x)
    (full, one, prod), (rfull, rone, rprod) = seen["ours"], seen["ref"]
    assert_same(full, rfull)
    assert_same(one, rone)
    assert full is x and type(one) is torch.Tensor
    # the product's physical layout is the rules' choice: compare it through its batch dim
    bdim = [d for d in range(prod.dim()) if prod.shape[d] == 5]
    assert prod.dim() == 3 and bdim
    assert_same(prod.movedim(bdim[0], 0), (x * 2).movedim(in_dim, 0))


def test_debug_unwrap_under_nested_vmap():
    x = torch.randn(2, 3, 4)
    seen = {}

    def inner(tag, unwrap):
        def g(t):
            seen[tag] = (unwrap(t), unwrap(t, recurse=False))
            return t.sum()
        return g
    ft.vmap(ft.vmap(inner("ours", ft.debug_unwrap)))(x)
    torch.func.vmap(torch.func.vmap(inner("ref", torch.func.debug_unwrap)))(x)
    (full, one), (rfull, rone) = seen["ours"], seen["ref"]
    assert_same(full, rfull)
    assert full is x
    # one level: still a batched tensor of the outer vmap, showing one outer example (3, 4)
    assert one.shape == rone.shape == (3, 4)
    assert type(one) is not torch.Tensor and ft.debug_unwrap(one) is x
    assert ft.debug_unwrap(one, recurse=False) is x


def test_debug_unwrap_inside_grad_under_vmap():
    x = torch.randn(4, 3)
    seen = []

    def loss(t):
        seen.append(ft.debug_unwrap(t))
        return (t ** 2).sum()
    g = ft.vmap(ft.grad(loss))(x)
    assert_same(g, torch.func.vmap(torch.func.grad(lambda t: (t ** 2).sum()))(x))
    assert type(seen[0]) is torch.Tensor and seen[0].shape == (4, 3)
    assert_same(seen[0].detach(), x)


@pytest.mark.parametrize("example_shape", [(1,), ()])
def test_a_branch_every_example_takes_the_same_way_is_taken(example_shape):
    # See Note [a branch every example takes the same way] in batching/batched_tensor.py: the
    # result is what the loop computes (torch.func refuses every branch on a batched value).
    def f(a):
        if (a > -10).all():
            return a * 2
        return a

    def g(a):
        if (a > 10).any():
            return a * 2
        return a - 1

    x = torch.randn(5, *example_shape)
    for fn in (f, g):
        torch.testing.assert_close(ft.vmap(fn)(x), torch.stack([fn(e) for e in x]))
        xs = torch.randn(2, 5, *example_shape)
        torch.testing.assert_close(ft.vmap(ft.vmap(fn))(xs),
                                   torch.stack([torch.stack([fn(e) for e in r]) for r in xs]))
    # one example of one nested level disagrees: no single branch
    xs = torch.zeros(2, 3, *example_shape)
    xs[1, 2] = 20
    with pytest.raises(UnsupportedUnderVmap, match="disagree"):
        ft.vmap(ft.vmap(g))(xs)
    # and a branch taken inside grad inside vmap
    grads = ft.vmap(ft.grad(lambda a: f(a).sum()))(x)
    torch.testing.assert_close(grads, torch.full_like(x, 2.))


# --- clone(memory_format=torch.contiguous_format) is a copy ------------------------------------

@pytest.mark.parametrize("in_dims", [0, 1])
def test_contiguous_clone_is_a_copy_under_vmap(in_dims):
    # It used to be ``.contiguous()`` of the physical value, which is the input itself when the
    # batch is already first and dense: a write into the "clone" wrote into the input.
    x = torch.randn(3, 4)
    before = x.clone()

    def f(a):
        y = a.clone(memory_format=torch.contiguous_format)
        y.add_(1)
        return y

    out = ft.vmap(f, in_dims=in_dims)(x)
    torch.testing.assert_close(x, before)
    torch.testing.assert_close(out, torch.func.vmap(f, in_dims=in_dims)(before))


def test_vmap_over_a_double_backward_through_an_inplace_view_write():
    # autograd's CopySlices clones a slice of the gradient (contiguous_format) and then writes
    # into the slice: with the aliasing clone, vmap over linearize's jvp_fn lost one term
    # (I instead of 2I), silently.
    f = lambda x: x.clone().view(-1).add_(x)  # noqa: E731
    x = torch.randn(3)
    _, jvp_fn = ft.linearize(f, x)
    T = torch.randn(4, 3)
    expected = torch.stack([torch.func.jvp(f, (x,), (t,))[1] for t in T])
    torch.testing.assert_close(ft.vmap(jvp_fn)(T), expected)
    xr, u = x.clone().requires_grad_(), torch.ones(3, requires_grad=True)
    g, = torch.autograd.grad(f(xr), xr, u, create_graph=True)
    got = ft.vmap(lambda t: torch.autograd.grad(g, u, t, retain_graph=True)[0])(T)
    torch.testing.assert_close(got, torch.stack([torch.autograd.grad(g, u, t, retain_graph=True)[0]
                                                 for t in T]))
